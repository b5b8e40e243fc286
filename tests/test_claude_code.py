"""The real Claude Code CLI against a real ``dynamoe serve`` of the embedded demo model, as the README's
recipe runs it: print mode, stream-json, and a two-turn interactive session in tmux.

The CLI comes from the npm registry (the recipe's pinned 2.1.197 and the newest release), installed
once into a cache outside the repository (``$DYNAMOE_TEST_CACHE`` or ``~/.cache/dynamoe-tests``).
Where node/npm are missing these tests skip and say so; an install that fails is a failure. Every
request the CLI makes goes through a recording proxy, and a failing test prints them (method, path,
status, the message roles and sizes) with the server's log.
"""
from __future__ import annotations

import http.client
import http.server
import json
import os
import re
import shutil
import subprocess
import sys
import threading
import time
import urllib.request
from urllib.parse import urlsplit

import pytest

from serve_testing import free_port, stop_process

PINNED = "2.1.197"  # the version the recipe pins
QUESTION, ANSWER = "What is 12 + 35?", "47"
SECOND, SECOND_ANSWER = "What is 8 + 5?", "13"
API_KEY = "sk-ant-api00-local-mock-key"
CACHE = os.environ.get("DYNAMOE_TEST_CACHE") or os.path.join(os.path.expanduser("~"), ".cache", "dynamoe-tests")

pytestmark = pytest.mark.skipif(not (shutil.which("node") and shutil.which("npm")),
                                reason="node and npm are not installed: the Claude Code CLI cannot be installed here")


# ------------------------------------------------------------------------------ the CLI from npm
def _npm(*args: str, timeout: float = 600) -> str:
    out = subprocess.run(["npm", *args], capture_output=True, text=True, timeout=timeout)
    if out.returncode:
        raise RuntimeError(f"npm {' '.join(args)} failed ({out.returncode}):\n{out.stdout}\n{out.stderr}")
    return out.stdout.strip()


def install_claude(version: str) -> str:
    """Path of the ``claude`` executable of ``version`` ('latest': the registry's newest), installed once.
    npm 11 does not run the package's postinstall (which puts the native binary in place) unless allowed,
    so it is run here as the package would."""
    if version == "latest":
        version = _npm("view", "@anthropic-ai/claude-code", "version", timeout=120)
    prefix = os.path.join(CACHE, f"claude-code-{version}")
    exe = os.path.join(prefix, "node_modules", ".bin", "claude")
    if os.path.exists(os.path.join(prefix, ".complete")):
        return exe
    os.makedirs(prefix, exist_ok=True)
    _npm("install", "--prefix", prefix, "--no-audit", "--no-fund", f"@anthropic-ai/claude-code@{version}")
    pkg = os.path.join(prefix, "node_modules", "@anthropic-ai", "claude-code")
    if os.path.exists(os.path.join(pkg, "install.cjs")):
        subprocess.run(["node", "install.cjs"], cwd=pkg, check=True, capture_output=True, timeout=120)
    out = subprocess.run([exe, "--version"], capture_output=True, text=True, timeout=60)
    if out.returncode or version not in out.stdout:
        raise RuntimeError(f"claude --version of {version}: {out.stdout!r} {out.stderr!r}")
    open(os.path.join(prefix, ".complete"), "w").close()
    return exe


# ------------------------------------------------------------------------------ a recording proxy
class RecordingProxy:
    """Forwards HTTP to ``upstream`` and streams the response back as it arrives (SSE), recording
    each exchange: method, path, status, and a summary of a JSON body."""

    def __init__(self, upstream: str):
        self.upstream = urlsplit(upstream)
        self.records: list[dict] = []
        proxy = self

        class Handler(http.server.BaseHTTPRequestHandler):
            protocol_version = "HTTP/1.1"

            def log_message(self, *args):
                pass

            def _forward(self):
                n = int(self.headers.get("Content-Length") or 0)
                body = self.rfile.read(n) if n else None
                rec = {"method": self.command, "path": self.path, "request": _summary(body),
                       "beta": self.headers.get("anthropic-beta")}
                proxy.records.append(rec)
                conn = http.client.HTTPConnection(proxy.upstream.hostname, proxy.upstream.port, timeout=900)
                headers = {k: v for k, v in self.headers.items() if k.lower() not in ("host", "connection")}
                conn.request(self.command, self.path, body=body, headers=headers)
                resp = conn.getresponse()
                rec["status"] = resp.status
                self.send_response(resp.status)
                for k, v in resp.getheaders():
                    if k.lower() not in ("transfer-encoding", "connection", "content-length"):
                        self.send_header(k, v)
                self.send_header("Connection", "close")
                self.end_headers()
                self.close_connection = True
                if self.command == "HEAD":
                    return
                text = []
                while True:
                    chunk = resp.read1(65536)
                    if not chunk:
                        break
                    text.append(chunk)
                    self.wfile.write(chunk)
                    self.wfile.flush()
                rec["response"] = b"".join(text)[-600:].decode("utf-8", "replace")

            do_GET = do_POST = do_HEAD = do_PUT = do_DELETE = _forward

        self.server = http.server.ThreadingHTTPServer(("127.0.0.1", 0), Handler)
        self.url = f"http://127.0.0.1:{self.server.server_address[1]}"
        threading.Thread(target=self.server.serve_forever, daemon=True).start()

    def report(self) -> str:
        return "\n".join(json.dumps(r, ensure_ascii=False) for r in self.records)

    def close(self):
        self.server.shutdown()


def _summary(body: bytes | None):
    if not body:
        return None
    try:
        b = json.loads(body)
    except ValueError:
        return body[:200].decode("utf-8", "replace")
    if not isinstance(b, dict):
        return str(b)[:200]
    msgs = b.get("messages") or []
    return {"model": b.get("model"), "bytes": len(body), "tools": len(b.get("tools") or []),
            "roles": [m.get("role") for m in msgs if isinstance(m, dict)], "max_tokens": b.get("max_tokens"),
            "stream": b.get("stream")}


# ------------------------------------------------------------------------------ fixtures
class MakeServe:
    """``dynamoe serve`` as ``make serve`` runs it: the embedded demo model and every default, but the port."""

    def __init__(self, log_path: str):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        env = {k: v for k, v in os.environ.items() if k != "DYNAMOE_API_KEY"}
        with open(log_path, "w") as log:
            self.proc = subprocess.Popen([sys.executable, "-m", "dynamoe.cli", "serve", "--port", str(self.port)],
                                         stdout=log, stderr=subprocess.STDOUT, env=dict(env, PYTHONUNBUFFERED="1"), cwd=root)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"dynamoe serve exited with {self.proc.returncode}:\n{self.log()}")
            try:
                with urllib.request.urlopen(self.url + "/health", timeout=2) as r:
                    if r.status == 200:
                        return
            except OSError:
                time.sleep(0.2)
        self.stop()
        raise RuntimeError(f"dynamoe serve did not answer /health in 180 s:\n{self.log()}")

    def log(self) -> str:
        with open(self.log_path, errors="replace") as f:
            return f.read()

    def stop(self) -> None:
        stop_process(self.proc, grace=20)


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """``make serve``'s server with a recording proxy in front."""
    server = MakeServe(str(tmp_path_factory.mktemp("claude-code") / "server.log"))
    proxy = RecordingProxy(server.url)
    yield server, proxy
    proxy.close()
    server.stop()


@pytest.fixture(params=[PINNED, "latest"], scope="module")
def claude(request):
    return install_claude(request.param)


@pytest.fixture
def cli_env(tmp_path, served):
    """The recipe's environment, with a fresh config folder and working directory per test."""
    _, proxy = served
    config = tmp_path / "config"
    config.mkdir()
    (config / ".claude.json").write_text(json.dumps({"customApiKeyResponses": {"approved": [API_KEY[len("sk-ant-"):]]}}))
    work = tmp_path / "work"
    work.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith(("ANTHROPIC_", "CLAUDE"))}
    env.update(ANTHROPIC_BASE_URL=proxy.url, ANTHROPIC_API_KEY=API_KEY, CLAUDE_CONFIG_DIR=str(config),
               DISABLE_AUTOUPDATER="1", HOME=str(tmp_path), NO_COLOR="1")
    return env, str(work)


def _explain(served, what: str) -> str:
    server, proxy = served
    return f"{what}\n--- requests the CLI made ---\n{proxy.report()}\n--- server log ---\n{server.log()[-4000:]}"


def _run(claude, cli_env, *args, timeout=900):
    env, work = cli_env
    return subprocess.run([claude, *args], capture_output=True, text=True, env=env, cwd=work, timeout=timeout,
                          stdin=subprocess.DEVNULL)


# ------------------------------------------------------------------------------ tests
def test_print_mode_answers(claude, cli_env, served):
    start = len(served[1].records)
    out = _run(claude, cli_env, "-p", QUESTION)
    assert out.returncode == 0 and ANSWER in out.stdout, _explain(
        served, f"claude -p exited {out.returncode}\nstdout: {out.stdout}\nstderr: {out.stderr}")
    mine = served[1].records[start:]
    main = [r for r in mine if isinstance(r.get("request"), dict) and r["request"]["tools"]]
    assert main and main[-1]["status"] == 200, _explain(served, "no main request with tools succeeded")
    # nothing refused (the CLI retries some refusals without a beta, which hides them from its output)
    refused = [r for r in mine if r.get("status", 200) >= 400 and r["method"] != "HEAD"]
    assert not refused, _explain(served, f"{len(refused)} requests refused")


def test_stream_json_parses(claude, cli_env, served):
    out = _run(claude, cli_env, "-p", QUESTION, "--output-format", "stream-json", "--verbose")
    assert out.returncode == 0, _explain(served, f"exit {out.returncode}: {out.stderr}")
    events = [json.loads(line) for line in out.stdout.splitlines() if line.strip()]
    result = [e for e in events if e.get("type") == "result"]
    assert result and result[-1]["is_error"] is False and ANSWER in result[-1]["result"], _explain(served, out.stdout)
    assert any(e.get("type") == "assistant" for e in events)


def _screen(session: str) -> str:
    return subprocess.run(["tmux", "capture-pane", "-p", "-t", session], capture_output=True, text=True).stdout


def _idle(screen: str) -> bool:
    """The empty input box between two rules, and nothing running ("esc to interrupt" while it works)."""
    return bool(re.search(r"─{10,}[ \t]*\n❯[\s\u00a0]*\n─{10,}", screen)) and "esc to interrupt" not in screen


def _wait_for(session: str, pred, timeout: float, enter_until_ready: bool = False, stable: bool = False) -> str:
    """Poll the screen until ``pred(screen)``; while waiting for the input box, accept each first-run
    screen (theme, security notes) with Enter and trust the working folder, as a new user would (newer
    releases put the cursor on "No, exit" first)."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        screen = _screen(session)
        if pred(screen):
            if not stable:
                return screen
            time.sleep(2.0)  # and still so two seconds later: the reply has finished streaming
            again = _screen(session)
            if again == screen:
                return screen
            continue
        if enter_until_ready and "trust this folder" in screen:  # choose "Yes, I trust this folder"
            chosen = next((line for line in screen.splitlines() if "❯" in line), "")
            subprocess.run(["tmux", "send-keys", "-t", session, "Enter" if "Yes" in chosen else "Down"], check=True)
        elif enter_until_ready and re.search(r"Enter to (confirm|continue)|Press Enter|text style", screen):
            subprocess.run(["tmux", "send-keys", "-t", session, "Enter"], check=True)
        time.sleep(1.0)
    raise TimeoutError(screen)


@pytest.mark.skipif(not shutil.which("tmux"), reason="tmux is not installed: no interactive session here")
def test_interactive_two_turns(claude, cli_env, served):
    env, work = cli_env
    session = f"dynamoe-cc-{os.getpid()}-{int(time.monotonic() * 1000) % 100000}"
    envs = " ".join(f"{k}={_sh(v)}" for k, v in env.items() if k in ("ANTHROPIC_BASE_URL", "ANTHROPIC_API_KEY",
                                                                      "CLAUDE_CONFIG_DIR", "DISABLE_AUTOUPDATER", "HOME"))
    subprocess.run(["tmux", "new-session", "-d", "-s", session, "-x", "150", "-y", "50", "-c", work,
                    f"env {envs} {_sh(claude)}"], check=True, env=env)
    try:
        _wait_for(session, _idle, 120, enter_until_ready=True)
        for question, answer in ((QUESTION, ANSWER), (SECOND, SECOND_ANSWER)):
            subprocess.run(["tmux", "send-keys", "-t", session, "-l", question], check=True)
            time.sleep(0.5)
            subprocess.run(["tmux", "send-keys", "-t", session, "Enter"], check=True)
            screen = _wait_for(session, lambda s: _replied(s, question) is not None and _idle(s), 900, stable=True)
            reply = _replied(screen, question)
            assert answer in reply, _explain(served, f"turn {question!r}: reply {reply!r}\nscreen:\n{screen}")
    except TimeoutError as e:
        pytest.fail(_explain(served, f"the interactive session stalled; screen:\n{e}"))
    finally:
        subprocess.run(["tmux", "kill-session", "-t", session], capture_output=True)
    turns = [r["request"]["roles"] for r in served[1].records if isinstance(r.get("request"), dict) and r["request"]["tools"]]
    assert any(roles.count("user") >= 2 and "assistant" in roles for roles in turns), _explain(served, "no second turn")


def _replied(screen: str, question: str) -> str | None:
    """The reply shown after ``question`` on the screen (the '●' lines up to the next prompt), or None."""
    i = screen.rfind(question)
    if i < 0:
        return None
    after = screen[i + len(question):]
    m = re.search(r"●(.*?)(?:\n\s*[✻✽✢·*]|\n─|\Z)", after, re.S)
    return m.group(1).strip() if m else None


def _sh(s: str) -> str:
    return "'" + s.replace("'", "'\\''") + "'"
