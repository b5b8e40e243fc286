"""The server's own routes and guards with plain ``httpx``: /chat streaming, /, /health, /metrics (expert
load), error shapes, body limit, API key; disconnects and queueing; the web page in headless Chromium
when it is installed."""
import json
import re
import shutil
import subprocess
import threading
import time

import httpx
import pytest

from serve_testing import MAX_BODY, InProcessServer, scripted_engine, shared_server


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    return shared_server(tmp_path_factory)


def metric(text: str, name: str, **labels) -> float:
    lab = ",".join(f'{k}="{v}"' for k, v in labels.items())
    m = re.search(rf"^{re.escape(name)}{re.escape('{' + lab + '}') if lab else ''} (\S+)$", text, re.M)
    return float(m.group(1)) if m else 0.0


def test_chat_streams_plain_text(server):
    body = {"text": "hello world", "max_tokens": 24, "temperature": 0}
    chunks = []
    t0 = time.perf_counter()
    with httpx.stream("POST", server.url + "/chat", json=body, headers=server.headers) as r:
        assert r.status_code == 200 and r.headers["content-type"].startswith("text/plain")
        for chunk in r.iter_text():
            chunks.append((time.perf_counter() - t0, chunk))
    text = "".join(c for _, c in chunks)
    assert len(chunks) > 1 and text   # streamed in pieces, not one body
    # the same text as the OpenAI route for the same turn
    ref = httpx.post(server.url + "/v1/chat/completions", headers=server.headers,
                     json={"messages": [{"role": "user", "content": "hello world"}], "max_tokens": 24,
                           "temperature": 0}).json()
    assert ref["choices"][0]["message"]["content"] == text
    raw = httpx.post(server.url + "/chat", json={"text": "hello", "raw": True, "max_tokens": 5}, headers=server.headers)
    assert raw.status_code == 200 and raw.text
    bad = httpx.post(server.url + "/chat", json={"text": "hello", "top_k": -3}, headers=server.headers)
    assert bad.status_code == 400 and "top_k" in bad.json()["error"]["message"]


def test_index_health_metrics(server):
    assert httpx.head(server.url + "/").status_code == 200
    page = httpx.get(server.url + "/")
    assert page.status_code == 200 and "tiny-moe" in page.text and "/v1/chat/completions" in page.text
    health = httpx.get(server.url + "/health").json()   # open without the key
    assert health["status"] == "ok" and health["model"] == "tiny-moe"
    httpx.post(server.url + "/v1/completions", headers=server.headers,
               json={"prompt": "hello", "max_tokens": 4, "temperature": 0}).raise_for_status()
    text = httpx.get(server.url + "/metrics", headers=server.headers).text
    for layer in (0, 1):   # both layers of the tiny model are MoE layers with 8 experts
        loads = [metric(text, "dynamoe_moe_expert_tokens_total", layer=layer, expert=e) for e in range(8)]
        assert sum(loads) > 0 and sum(loads) % 2 == 0   # top-2: two assignments per token
        assert f'dynamoe_moe_dropped_tokens_total{{layer="{layer}"}} 0' in text
    assert metric(text, "dynamoe_http_requests_total", route="/v1/completions", status=200) >= 1
    assert metric(text, "dynamoe_generation_tokens_total") >= 4
    assert metric(text, "dynamoe_time_to_first_token_seconds_count") >= 1
    assert metric(text, "dynamoe_request_latency_seconds_count") >= 1
    assert "dynamoe_queue_depth 0" in text and "dynamoe_max_num_seqs 8" in text
    # the startup heap (torch, the model, the tokenizer, the app) is out of the collector's reach, so a full
    # collection does not walk it while every stream waits
    assert metric(text, "dynamoe_gc_frozen_objects") > 50_000
    assert metric(text, "python_gc_collections_total", generation=0) >= 1


def test_errors_and_limits(server):
    h = server.headers
    r = httpx.post(server.url + "/v1/chat/completions", headers=h, content=b'{"messages": [')
    assert r.status_code == 400 and r.json()["error"]["type"] == "invalid_request_error"
    assert "not valid JSON" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/chat/completions", headers=h, json=[1, 2])
    assert r.status_code == 400 and "JSON object" in r.json()["error"]["message"]
    big = {"messages": [{"role": "user", "content": "x" * (MAX_BODY + 10)}]}
    r = httpx.post(server.url + "/v1/chat/completions", headers=h, json=big)
    assert r.status_code == 413 and "limit" in r.json()["error"]["message"]
    r = httpx.post(server.url + "/v1/messages", headers=h, json={"max_tokens": 1, **big})
    assert r.status_code == 413 and r.json()["error"]["type"] == "request_too_large"
    r = httpx.get(server.url + "/v1/nothing", headers=h)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(server.url + "/v1/chat/completions", headers=h)
    assert r.status_code == 405 and "error" in r.json()
    assert httpx.get(server.url + "/health").status_code == 200   # still serving


def test_api_key(server):
    body = {"prompt": "hi", "max_tokens": 2}
    for route, shape in (("/v1/completions", "openai"), ("/v1/messages", "anthropic")):
        r = httpx.post(server.url + route, json=body)
        assert r.status_code == 401
        assert (r.json()["type"] == "error") if shape == "anthropic" else (r.json()["error"]["code"] == "invalid_api_key")
    assert httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": "Bearer wrong"}).status_code == 401
    assert httpx.get(server.url + "/metrics").status_code == 401
    assert httpx.get(server.url + "/v1/models").status_code == 401
    assert httpx.post(server.url + "/chat", json={"text": "x"}).status_code == 401
    ok = httpx.post(server.url + "/v1/completions", json=body, headers={"Authorization": f"Bearer {server.api_key}"})
    assert ok.status_code == 200
    ok = httpx.post(server.url + "/v1/completions", json=body, headers={"x-api-key": server.api_key})
    assert ok.status_code == 200


def test_disconnect_cancels_and_frees_the_slot(server):
    before = httpx.get(server.url + "/metrics", headers=server.headers).text
    body = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 230, "stream": True, "temperature": 0}
    with httpx.Client(timeout=30) as c:
        with c.stream("POST", server.url + "/v1/chat/completions", json=body, headers=server.headers) as r:
            lines = r.iter_lines()
            assert next(lines).startswith("data: ")
            next(lines)
        # leaving the block closes the connection mid-stream
    deadline = time.monotonic() + 10
    while True:
        text = httpx.get(server.url + "/metrics", headers=server.headers).text
        cancelled = metric(text, "dynamoe_generations_finished_total", finish_reason="cancelled")
        if cancelled > metric(before, "dynamoe_generations_finished_total", finish_reason="cancelled") \
                and metric(text, "dynamoe_running_sequences") == 0:
            break
        assert time.monotonic() < deadline, text
        time.sleep(0.05)
    assert metric(text, "dynamoe_generation_tokens_total") - metric(before, "dynamoe_generation_tokens_total") < 230


def test_one_slot_queues_and_a_disconnect_frees_it_at_once(tmp_path):
    """--max-num-seqs 1: a second request waits for the slot; a stream abandoned after its first token
    gives the slot up at once (the next request finishes long before the abandoned one would have)."""
    engine, tok = scripted_engine(str(tmp_path), max_batch=1, delay=0.02)   # "long story": 300 tokens, ~6 s
    srv = InProcessServer(engine, tok)
    try:
        story = {"messages": [{"role": "user", "content": "a long story"}], "stream": True}
        with httpx.Client(timeout=30) as c:
            with c.stream("POST", srv.url + "/v1/chat/completions", json=story) as r:
                for line in r.iter_lines():
                    if '"delta": {"content": "l' in line:   # the first token of the story
                        break
        t0 = time.perf_counter()
        out = httpx.post(srv.url + "/v1/chat/completions", timeout=30,
                         json={"messages": [{"role": "user", "content": "hi"}]}).json()
        assert out["choices"][0]["message"]["content"] == "Hello from the script."
        assert time.perf_counter() - t0 < 3.0   # the abandoned story alone would take ~6 s

        results = {}

        def ask(name, content):
            r = httpx.post(srv.url + "/v1/chat/completions", timeout=30,
                           json={"messages": [{"role": "user", "content": content}]})
            results[name] = r.json()["choices"][0]["message"]["content"]

        threads = [threading.Thread(target=ask, args=("a", "hi")), threading.Thread(target=ask, args=("b", "think about it"))]
        for t in threads:
            t.start()
        saw_queue = False
        while any(t.is_alive() for t in threads):
            saw_queue |= engine.num_waiting > 0
            time.sleep(0.005)
        assert results == {"a": "Hello from the script.", "b": "Forty-two."}
        assert saw_queue and engine.num_running == 0
    finally:
        srv.stop()


CHROMIUM = shutil.which("chromium")


@pytest.mark.skipif(CHROMIUM is None, reason="no `chromium` on PATH (the browser test runs where Debian's chromium is "
                                             "installed)")
def test_web_page_in_headless_chromium(tmp_path_factory, tmp_path):
    """Load the page with ?q=... (it sends the message on load) and read the DOM once the reply streamed in."""
    from serve_testing import scripted_server
    srv = scripted_server(tmp_path_factory)
    cmd = [CHROMIUM, "--headless", "--no-sandbox", "--disable-gpu", "--no-first-run", "--disable-background-networking",
           "--disable-component-update", "--disable-sync", f"--user-data-dir={tmp_path / 'profile'}",
           "--virtual-time-budget=15000", "--dump-dom", srv.url + "/?q=hi"]
    dom = subprocess.run(cmd, capture_output=True, text=True, timeout=60).stdout
    assert 'data-done="1"' in dom, dom[-2000:]
    assert "Hello from the script." in dom
    assert "scripted" in dom   # the model name


NODE = shutil.which("node")

# a minimal DOM for the page's script: elements keep text and children, events are recorded, fetch goes
# to the server; the script runs as the page would (it sends ?q= on load) until it marks itself done
NODE_HARNESS = r"""
const [base, query, model, file, key] = process.argv.slice(2);
class El {
  constructor(tag) { this.tag = tag; this.children = []; this.dataset = {}; this.style = {}; this.value = "";
    this._text = ""; this.className = ""; this.innerHTML = ""; this.firstChild = {textContent: ""};
    this.classList = {add: (c) => { this.className += " " + c; }}; }
  set textContent(v) { this._text = String(v); this.children = []; }
  get textContent() { return this._text + this.children.map((c) => c.textContent).join(""); }
  appendChild(c) { this.children.push(c); return c; }
  insertBefore(c, ref) { const i = this.children.indexOf(ref); this.children.splice(i < 0 ? this.children.length : i, 0, c); return c; }
  addEventListener() {} focus() {} requestSubmit() {}
}
const els = {};
globalThis.document = {getElementById: (id) => (els[id] = els[id] || new El("#" + id)),
                       createElement: (t) => new El(t), body: new El("body")};
document.getElementById("model").textContent = model;
globalThis.localStorage = {getItem: () => key || null, setItem: () => {}};
globalThis.location = {search: "?q=" + encodeURIComponent(query)};
const realFetch = fetch;
globalThis.fetch = (url, opts) => realFetch(url.startsWith("/") ? base + url : url, opts);
globalThis.setInterval = () => 0;
require("vm").runInThisContext(require("fs").readFileSync(file, "utf8"));
const t0 = Date.now();
(function wait() {
  if (document.body.dataset.done === "1" || Date.now() - t0 > 20000) {
    const log = document.getElementById("log").children;
    const bot = log[log.length - 1];
    const think = bot.children.find((c) => c.tag === "details");
    console.log(JSON.stringify({done: document.body.dataset.done, user: log[0].textContent,
      reasoning: think ? think.children[0].textContent : null, content: bot.children[bot.children.length - 1].textContent,
      stats: document.getElementById("stats").textContent, heat: document.getElementById("heat").children.length}));
    return;
  }
  setTimeout(wait, 20);
})();
"""


@pytest.mark.skipif(NODE is None, reason="no `node` on PATH")
@pytest.mark.parametrize("query, reasoning, content", [("hi", None, "Hello from the script."),
                                                       ("think about it", "Six times seven.", "Forty-two.")])
def test_web_page_script_streams_a_reply(tmp_path_factory, tmp_path, query, reasoning, content):
    """The page's own script (run by node over a minimal DOM) sends the message, reads the SSE stream,
    shows the reasoning in its collapsible block and the answer in the bubble, and draws the expert view."""
    from dynamoe.serve.webui import page
    from serve_testing import scripted_server

    srv = scripted_server(tmp_path_factory)
    script = re.search(r"<script>(.*)</script>", page("scripted"), re.S).group(1)
    (tmp_path / "page.js").write_text(script)
    (tmp_path / "harness.js").write_text(NODE_HARNESS)
    out = subprocess.run([NODE, str(tmp_path / "harness.js"), srv.url, query, "scripted", str(tmp_path / "page.js")],
                         capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    got = json.loads(out.stdout)
    assert got["done"] == "1" and got["user"] == query
    assert (got["reasoning"], got["content"]) == (reasoning, content)


@pytest.mark.skipif(NODE is None, reason="no `node` on PATH")
def test_web_page_script_with_api_key_and_expert_view(server, tmp_path):
    """Against the real model (API key from the page's storage): the reply streams and the expert view
    draws one row per MoE layer (a label and 8 experts each)."""
    from dynamoe.serve.webui import page

    script = re.search(r"<script>(.*)</script>", page("tiny-moe"), re.S).group(1)
    (tmp_path / "page.js").write_text(script)
    (tmp_path / "harness.js").write_text(NODE_HARNESS)
    httpx.post(server.url + "/v1/completions", headers=server.headers, json={"prompt": "x", "max_tokens": 2})
    out = subprocess.run([NODE, str(tmp_path / "harness.js"), server.url, "hello", "tiny-moe", str(tmp_path / "page.js"),
                          server.api_key], capture_output=True, text=True, timeout=60)
    got = json.loads(out.stdout)
    assert got["done"] == "1" and got["content"] and "[error]" not in got["content"]
    assert got["heat"] == 2 * (1 + 8) and got["stats"].startswith("running")


def test_a_failing_forward_is_an_error_answer_not_a_dead_server(tmp_path_factory):
    import anthropic
    import openai

    from serve_testing import scripted_server

    srv = scripted_server(tmp_path_factory)
    oai = openai.OpenAI(base_url=srv.url + "/v1", api_key="x", max_retries=0)
    boom = [{"role": "user", "content": "explode"}]
    with pytest.raises(openai.InternalServerError, match="generation failed: RuntimeError: the scripted model failed"):
        oai.chat.completions.create(model="scripted", messages=boom)
    with pytest.raises(openai.APIError, match="the scripted model failed"):
        list(oai.chat.completions.create(model="scripted", messages=boom, stream=True))
    ant = anthropic.Anthropic(base_url=srv.url, api_key="x", max_retries=0)
    with pytest.raises(anthropic.APIError, match="the scripted model failed"):
        with ant.messages.stream(model="m", max_tokens=10, messages=boom) as s:
            list(s)
    r = httpx.post(srv.url + "/v1/messages", json={"model": "m", "max_tokens": 10, "messages": boom})
    assert r.status_code == 500 and r.json()["error"]["type"] == "api_error"
    out = oai.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "hi"}])
    assert out.choices[0].message.content == "Hello from the script."


def test_probes_and_published_api(server):
    """Claude Code's probes (HEAD / and HEAD /api/hello, sent without the key) get 200 / a quiet 404; the
    API's description and FastAPI's docs page are behind the key like the data routes."""
    assert httpx.head(server.url + "/").status_code == 200
    for path in ("/api/hello", "/nothing/here"):
        r = httpx.head(server.url + path)
        assert r.status_code == 404 and not r.content
        r = httpx.get(server.url + path)
        assert r.status_code == 404 and r.json()["error"]["type"] == "not_found_error"
    assert "Traceback" not in server.log() and "/api/hello" not in server.log()
    for path in ("/openapi.json", "/docs"):
        assert httpx.get(server.url + path).status_code == 401
    spec = httpx.get(server.url + "/openapi.json", headers=server.headers).json()
    for path in ("/v1/chat/completions", "/v1/completions", "/v1/messages", "/v1/messages/count_tokens", "/chat"):
        ref = spec["paths"][path]["post"]["requestBody"]["content"]["application/json"]["schema"]["$ref"]
        assert ref.removeprefix("#/components/schemas/") in spec["components"]["schemas"]
    messages = spec["components"]["schemas"]["MessagesRequest"]["properties"]
    assert messages["temperature"]["anyOf"][0]["maximum"] == 1 and messages["max_tokens"]["minimum"] == 1
    docs = httpx.get(server.url + "/docs", headers=server.headers)
    assert docs.status_code == 200 and "/openapi.json" in docs.text
