"""Helpers of the serving tests: a tiny random Qwen3-MoE checkpoint with a tool-aware Qwen3-style chat
template, the real server as a subprocess (started once per test session), and an in-process server
over a scripted model (it writes given text, e.g. a tool call, which a random model never would)."""
from __future__ import annotations

import atexit
import os
import subprocess
import sys
import threading
import time
from types import SimpleNamespace

import httpx
import torch
from torch import nn

from engine_testing import write_tokenizer_dir
from ports import free_port

from dynamoe.models.cache import KVCache

API_KEY = "test-key-123"
MAX_SEQ_LEN = 256
MAX_BODY = 1 << 20

# the real Qwen3 template's structure, shortened: tools in the system turn, <tool_call> JSON in assistant
# turns, tool results as <tool_response> in a user turn, reasoning_content in <think>, enable_thinking
QWEN3_TEMPLATE = """\
{%- if tools %}
{{- '<|im_start|>system\\n' }}
{%- if messages[0].role == 'system' %}{{- messages[0].content + '\\n\\n' }}{%- endif %}
{{- '# Tools\\n\\nYou may call functions. Signatures in <tools></tools>:\\n<tools>' }}
{%- for tool in tools %}{{- '\\n' }}{{- tool | tojson }}{%- endfor %}
{{- '\\n</tools>\\n\\nReturn calls as <tool_call>\\n{"name": <name>, "arguments": <args>}\\n</tool_call><|im_end|>\\n' }}
{%- elif messages[0].role == 'system' %}
{{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}
{%- endif %}
{%- for message in messages %}
{%- if message.role == 'system' %}
{%- if not loop.first %}{{- raise_exception('the system message must come first') }}{%- endif %}
{%- elif message.role == 'user' %}
{{- '<|im_start|>user\\n' + message.content + '<|im_end|>\\n' }}
{%- elif message.role == 'assistant' %}
{{- '<|im_start|>assistant\\n' }}
{%- if message.reasoning_content %}{{- '<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n' }}{%- endif %}
{{- message.content }}
{%- for tool_call in message.tool_calls or [] %}
{%- if tool_call.function %}{%- set tool_call = tool_call.function %}{%- endif %}
{{- '\\n<tool_call>\\n{"name": "' + tool_call.name + '", "arguments": ' }}
{%- if tool_call.arguments is string %}{{- tool_call.arguments }}{%- else %}{{- tool_call.arguments | tojson }}{%- endif %}
{{- '}\\n</tool_call>' }}
{%- endfor %}
{{- '<|im_end|>\\n' }}
{%- elif message.role == 'tool' %}
{%- if loop.first or messages[loop.index0 - 1].role != 'tool' %}{{- '<|im_start|>user' }}{%- endif %}
{{- '\\n<tool_response>\\n' + message.content + '\\n</tool_response>' }}
{%- if loop.last or messages[loop.index0 + 1].role != 'tool' %}{{- '<|im_end|>\\n' }}{%- endif %}
{%- endif %}
{%- endfor %}
{%- if add_generation_prompt %}
{{- '<|im_start|>assistant\\n' }}
{%- if enable_thinking is defined and enable_thinking is false %}{{- '<think>\\n\\n</think>\\n\\n' }}{%- endif %}
{%- endif %}
"""


def stop_process(proc: subprocess.Popen, grace: float = 10.0) -> None:
    """SIGTERM, then SIGKILL after ``grace`` seconds; waits for the exit."""
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(grace)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def make_checkpoint(path: str) -> str:
    """A tiny random Qwen3-MoE (2 layers, 8 experts, top-2) + the test tokenizer under ``path``. The
    special and think tokens have zero lm_head rows (logit 0, below the largest of the others), so greedy
    decoding runs to ``max_tokens`` (or a stop string) and has no reasoning part."""
    import transformers

    write_tokenizer_dir(path, chat_template=QWEN3_TEMPLATE, jinja_file=True)
    from dynamoe.engine import Tokenizer
    tok = Tokenizer.from_dir(path)
    cfg = transformers.Qwen3MoeConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=48,
                                      moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8, num_experts=8, num_experts_per_tok=2,
                                      max_position_embeddings=512, bos_token_id=None, eos_token_id=2)
    with torch.random.fork_rng():
        torch.manual_seed(0)
        hf = transformers.Qwen3MoeForCausalLM(cfg).eval()
        with torch.no_grad():
            for p in hf.parameters():
                p.normal_(0, 0.2)
            banned = [tok.token_to_id(t)
                      for t in ("<|endoftext|>", "<|im_start|>", "<|im_end|>", "<think>", "</think>")]
            hf.lm_head.weight[banned] = 0.0
    hf.save_pretrained(path)
    return path


class ServerProcess:
    """``dynamoe serve`` in a subprocess; ``url`` once ``/health`` answers."""

    def __init__(self, model_dir: str, *extra: str, api_key: str | None = API_KEY, log_path: str | None = None):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = api_key
        cmd = [sys.executable, "-m", "dynamoe.cli", "serve", "--model", model_dir, "--port", str(self.port),
               "--max_seq_len", str(MAX_SEQ_LEN), "--max-num-seqs", "8", "--served-model-name", "tiny-moe",
               "--max-request-bytes", str(MAX_BODY), "--log-level", "warning", "--device", "cpu", *extra]
        if api_key:
            cmd += ["--api-key", api_key]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
        env.pop("DYNAMOE_API_KEY", None)
        self.log_path = log_path or os.path.join(model_dir, "server.log")
        self._log = open(self.log_path, "w")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=root)
        atexit.register(self.stop)
        self._wait()

    def _wait(self, timeout: float = 90.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited with {self.proc.returncode}:\n{self.log()}")
            try:
                if httpx.get(self.url + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        self.stop()
        raise RuntimeError(f"server did not answer /health in {timeout} s:\n{self.log()}")

    def log(self) -> str:
        with open(self.log_path) as f:
            return f.read()

    @property
    def headers(self) -> dict:
        return {"Authorization": f"Bearer {self.api_key}"} if self.api_key else {}

    def stop(self) -> None:
        stop_process(self.proc)
        self._log.close()


_SHARED: dict = {}


def shared_server(tmp_path_factory) -> ServerProcess:
    """One server for the whole session (every test module asks for the same one)."""
    if "server" not in _SHARED:
        d = make_checkpoint(str(tmp_path_factory.mktemp("serve_ckpt")))
        _SHARED["server"] = ServerProcess(d)
    return _SHARED["server"]


# --- a scripted model, served in-process ------------------------------------------------------------

class ScriptedLM(nn.Module):
    """Honours the engine's model contract and writes ``script(prompt_text)`` (then EOS), one token per
    step: the text a real model would write, without training one. ``delay`` seconds per forward."""

    def __init__(self, tokenizer, script, eos_token_id: int, delay: float = 0.0, max_position_embeddings: int = 1024):
        super().__init__()
        self.tokenizer, self.script, self.delay = tokenizer, script, delay
        self.config = SimpleNamespace(vocab_size=tokenizer.vocab_size, eos_token_id=eos_token_id,
                                      max_position_embeddings=max_position_embeddings, model_type="scripted")
        self.dummy = nn.Parameter(torch.zeros(1))
        self._plan: dict[int, tuple[int, list[int]]] = {}   # slot -> (prompt length, output ids)
        self._seen: dict[int, list[int]] = {}                # slot -> the tokens it was fed
        self.prompts: list[str] = []

    #: its per-slot script is state a prefix cache cannot share (the engine turns prefix caching off)
    recurrent_state = True

    def new_cache(self, num_slots, max_seq_len, dtype=None, device=None, **paging) -> KVCache:
        return KVCache(num_slots, max_seq_len, num_layers=1, dtype=dtype or torch.float32, device=device, **paging)

    def forward(self, input_ids, cache=None, slots=None):
        if self.delay:
            time.sleep(self.delay)
        B, T = input_ids.shape
        V = self.config.vocab_size
        starts = cache.check_room(slots, T)
        logits = torch.zeros(B, T, V)
        for b in range(B):
            slot, start = int(slots[b]), int(starts[b])
            ids = input_ids[b].tolist()
            seen = self._seen.setdefault(slot, [])
            del seen[start:]
            plan = self._plan.get(slot)
            decoding = (start > 0 and T == 1 and plan is not None and start >= plan[0]
                        and start - plan[0] < len(plan[1]) and plan[1][start - plan[0]] == ids[0])
            seen.extend(ids)
            if not decoding:   # a prompt (or a chunk of one): the script of everything so far, in case it ends here
                text = self.tokenizer.decode(seen, skip_special_tokens=False)
                if start == 0 or plan is None or plan[0] != start:
                    self.prompts.append(text)
                else:
                    self.prompts[-1] = text
                plan = self._plan[slot] = (len(seen), self.tokenizer.encode(self.script(text), add_special_tokens=False))
            prompt_len, out = plan
            i = start + T - prompt_len
            logits[b, -1, out[i] if i < len(out) else self.config.eos_token_id] = 30.0
        cache.advance(slots, T)
        return logits


class InProcessServer:
    """``create_app`` over ``engine`` under uvicorn on a thread (same process: the test can look inside)."""

    def __init__(self, engine, tokenizer, **config):
        import uvicorn

        from dynamoe.serve import ServerConfig, create_app

        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cfg = ServerConfig(**{"model_name": "scripted", "max_seq_len": engine.max_seq_len,
                              "max_num_seqs": engine.max_batch, **config})
        self.app = create_app(engine, tokenizer, cfg)
        self.server = uvicorn.Server(uvicorn.Config(self.app, host="127.0.0.1", port=self.port, log_level="warning"))
        self.thread = threading.Thread(target=self.server.run, daemon=True)
        self.thread.start()
        deadline = time.monotonic() + 30
        while not self.server.started:
            if time.monotonic() > deadline or not self.thread.is_alive():
                raise RuntimeError("in-process server did not start")
            time.sleep(0.02)

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)


def script(prompt: str) -> str:
    """What the scripted model writes for a prompt (the chat template rendered): a tool call when tools
    were offered, the answer once a tool result came back, a think block when asked to think; the
    forward fails for "explode"."""
    if "explode" in prompt:
        raise RuntimeError("the scripted model failed")
    if "<tool_response>" in prompt:
        return "It is sunny in Paris."
    if "# Tools" in prompt:
        return ('<think>\nThe user wants the weather.\n</think>\n\n<tool_call>\n'
                '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>')
    if "think about it" in prompt:
        return "<think>\nSix times seven.\n</think>\n\nForty-two."
    if "long story" in prompt:
        return "la " * 150
    return "Hello from the script."


def scripted_engine(tmp_dir: str, max_batch: int = 4, delay: float = 0.0, max_seq_len: int = 1024):
    from dynamoe.engine import GenerationEngine, Tokenizer

    if not os.path.exists(os.path.join(tmp_dir, "tokenizer.json")):
        write_tokenizer_dir(tmp_dir, chat_template=QWEN3_TEMPLATE)
    tok = Tokenizer.from_dir(tmp_dir)
    model = ScriptedLM(tok, script, eos_token_id=tok.token_to_id("<|im_end|>"), delay=delay)
    # the script is chosen from the whole prompt at position 0: no prefix cache (it holds no keys/values)
    return GenerationEngine(model, tok, max_seq_len=max_seq_len, max_batch=max_batch, prefix_caching=False), tok


def scripted_server(tmp_path_factory) -> InProcessServer:
    """One in-process server over the scripted model for the session (no API key)."""
    if "scripted" not in _SHARED:
        engine, tok = scripted_engine(str(tmp_path_factory.mktemp("scripted_tok")))
        _SHARED["scripted"] = srv = InProcessServer(engine, tok)
        atexit.register(srv.stop)
    return _SHARED["scripted"]


IMAGE_PART = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
AUDIO_PART = {"type": "input_audio", "input_audio": {"data": "AAAA", "format": "wav"}}


def image_refusal(model, tmp_dir: str, model_name: str, part: dict = IMAGE_PART) -> str:
    """The error message a served ``model`` gives a chat request holding an image part (or ``part``, e.g.
    :data:`AUDIO_PART`), asserting a 400."""
    from engine_testing import write_tokenizer_dir

    from dynamoe.engine import GenerationEngine, Tokenizer

    tok = Tokenizer.from_dir(write_tokenizer_dir(os.path.join(tmp_dir, "tok")))
    srv = InProcessServer(GenerationEngine(model, tok, max_seq_len=64, max_batch=2), tok, model_name=model_name)
    try:
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=30, json={"messages": [
            {"role": "user", "content": [{"type": "text", "text": "what is this?"}, part]}]})
        assert r.status_code == 400, r.text
        return r.json()["error"]["message"]
    finally:
        srv.stop()
