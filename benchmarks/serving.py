"""Serving throughput and latency: 1, 4, 8, 16 concurrent streaming clients against one server; and the
engine core's scenarios (``--scenario``).

    python benchmarks/serving.py [--url 127.0.0.1:8000 [--api-key K]] [--concurrency 1 4 8 16]
                                 [--max-tokens 64] [--rounds 2] [--model DIR] [--threads N]
    python benchmarks/serving.py --scenario long-prompt [--long-tokens 12000] [--streams 4]
    python benchmarks/serving.py --scenario shared-prefix [--prefix-tokens 6000] [--clients 6]
    python benchmarks/serving.py --scenario capacity [--kv-cache-memory 64MiB] [--capacity-tokens 1500]
    python benchmarks/serving.py --scenario speculative [--num-speculative-tokens 4] [--rounds 2]

Scenarios (the server this script starts gets ``--max_seq_len 32768`` and a model of as many positions):

* ``long-prompt``: ``--streams`` requests stream; once each has 16 tokens, a ``--long-tokens`` prompt arrives.
  Reports the streams' inter-token gaps before it arrived (median) and while it prefilled (median, p99, max,
  max / the median before), the long prompt's time to first token, and a control: the same streams again alone,
  their median gap between the same tokens (they decode slower as they grow) and the max above over it.
* ``shared-prefix``: one warm request with a ``--prefix-tokens`` prefix, then ``--clients`` requests sent
  together with the same prefix and their own tails; then as many with prefixes of their own (nothing to
  share: the baseline of the same run). Reports TTFT p50/max and the cached tokens usage reports.
* ``capacity``: with ``--kv-cache-memory``, as many requests of ``--capacity-tokens`` prompt tokens as slots
  (``--concurrency``'s largest) at once; reports the most sequences running together (``/metrics``), the
  preemptions, and what a cache of whole-context slots would hold in the same memory.
* ``speculative``: a code-editing-style workload on the embedded demo model (the default ``--model`` here: it
  was trained to write six Python functions; a random model would accept no draft): each function asked for,
  then asked for again after its own answer (the repeated context an agent resends, the code to write mostly
  on the page already). Two servers, one with ``--num-speculative-tokens`` n-gram drafts, requests one at a
  time, interleaved over ``--rounds``. Reports generated tokens/s of both kinds of request on each, the
  speed-up, the draft tokens accepted (``/metrics``), and whether every output is the same on both (greedy).

Without ``--url`` it starts ``dynamoe serve`` itself on a random Qwen3-MoE checkpoint it writes to a temp
folder (``--hidden 256 --layers 4 --experts 16 --top-k 4``; transformers writes it), or on ``--model DIR``.
Each client sends ``--rounds`` chat completions one after the other (``stream: true``, ``ignore_eos``: every
request generates exactly ``--max-tokens``) with a short distinct prompt; all clients start together.

Per concurrency level: aggregate generated tokens/s over the level's wall time (and its ratio to one
client), time to first token (send -> first content chunk) and inter-token latency (between content
chunks) p50/p99. The clients run in this process (asyncio + httpx); on a small CPU machine they compete
with the server for cores, which the ``client CPU`` column shows.
"""
from __future__ import annotations

import argparse
import asyncio
import json
import os
import socket
import statistics
import subprocess
import sys
import tempfile
import time

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))

WORDS = ("the quick brown fox jumps over the lazy dog while the engine streams text to many clients at once "
         "and every expert sees its share of the tokens").split()


def pct(xs, q):
    if not xs:
        return float("nan")
    xs = sorted(xs)
    return xs[min(len(xs) - 1, int(round(q / 100 * (len(xs) - 1))))]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def write_random_checkpoint(path: str, hidden: int, layers: int, experts: int, top_k: int,
                            max_position: int = 2048) -> str:
    """A random Qwen3-MoE with a small byte-level BPE tokenizer (over the benchmark's words) and a ChatML template."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    # the alphabet of the words only (no lone high bytes): every token the random model draws decodes to whole
    # characters at once, so each token is a content chunk and the gaps between chunks are the engine's own
    # (with all 256 bytes, a drawn high byte is held back until a UTF-8 character completes: a gap of
    # several steps that no stall caused)
    tok.train_from_iterator([" ".join(WORDS)] * 4, trainers.BpeTrainer(
        vocab_size=1024, special_tokens=special, show_progress=False, initial_alphabet=[]))
    os.makedirs(path, exist_ok=True)
    tok.save(os.path.join(path, "tokenizer.json"))
    template = ("{% for m in messages %}{{ '<|im_start|>' + m.role + '\\n' + m.content + '<|im_end|>\\n' }}{% endfor %}"
                "{% if add_generation_prompt %}{{ '<|im_start|>assistant\\n' }}{% endif %}")
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "chat_template": template}, f)
    cfg = transformers.Qwen3MoeConfig(
        vocab_size=tok.get_vocab_size(), hidden_size=hidden, intermediate_size=2 * hidden,
        moe_intermediate_size=hidden // 2, num_hidden_layers=layers, num_attention_heads=max(hidden // 64, 1),
        num_key_value_heads=max(hidden // 128, 1), head_dim=64, num_experts=experts, num_experts_per_tok=top_k,
        max_position_embeddings=max_position, bos_token_id=None, eos_token_id=tok.token_to_id("<|im_end|>"))
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.05)
    hf.save_pretrained(path)
    return path


def start_server(model_dir: str, max_num_seqs: int, threads: int | None, extra=()) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "dynamoe.cli", "serve", "--model", model_dir, "--port", str(port),
           "--max-num-seqs", str(max_num_seqs), "--log-level", "warning", "--serve", "core",
           "--served-model-name", "bench", *extra]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.PIPE,
                            cwd=os.path.join(os.path.dirname(__file__), ".."))
    import httpx
    url = f"http://127.0.0.1:{port}"
    deadline = time.monotonic() + 180
    while time.monotonic() < deadline:
        if proc.poll() is not None:
            raise SystemExit(f"server exited: {proc.stderr.read().decode()}")
        try:
            if httpx.get(url + "/health", timeout=1).status_code == 200:
                return proc, url
        except httpx.HTTPError:
            pass
        time.sleep(0.2)
    proc.kill()
    raise SystemExit("server did not start in 180 s")


async def stream_chat(client, url: str, model: str, messages: list[dict], max_tokens: int | None, **extra) -> dict:
    """One greedy streaming chat completion: its content, the times its content chunks arrived (and when it was
    sent), and the usage it reports (completion and cached prompt tokens)."""
    body = {"model": model, "messages": messages, "max_tokens": max_tokens, "stream": True,
            "stream_options": {"include_usage": True}, "temperature": 0, **extra}
    t0 = time.perf_counter()
    parts, arrivals, tokens, cached = [], [], 0, 0
    async with client.stream("POST", url + "/v1/chat/completions", json=body) as r:
        if r.status_code != 200:
            await r.aread()
            raise RuntimeError(f"HTTP {r.status_code}: {r.text}")
        async for line in r.aiter_lines():
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            chunk = json.loads(line[6:])
            if chunk.get("usage"):
                tokens = chunk["usage"]["completion_tokens"]
                cached = (chunk["usage"].get("prompt_tokens_details") or {}).get("cached_tokens", 0)
            for ch in chunk.get("choices", []):
                if ch.get("delta", {}).get("content"):
                    parts.append(ch["delta"]["content"])
                    arrivals.append(time.perf_counter())
    return {"text": "".join(parts), "sent": t0, "arrivals": arrivals, "tokens": tokens, "cached": cached,
            "seconds": time.perf_counter() - t0}


async def one_request(client, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    r = await stream_chat(client, url, model, [{"role": "user", "content": prompt}], max_tokens, ignore_eos=True)
    arrivals = r["arrivals"]
    return {"ttft": arrivals[0] - r["sent"] if arrivals else float("nan"),
            "itl": [b - a for a, b in zip(arrivals, arrivals[1:])], "tokens": r["tokens"], "cached": r["cached"],
            "arrivals": arrivals}


async def level(url: str, headers: dict, model: str, clients: int, rounds: int, max_tokens: int) -> dict:
    import httpx

    async def client_loop(i, client):
        out = []
        for r in range(rounds):
            prompt = " ".join(WORDS[(i * 7 + r * 3 + k) % len(WORDS)] for k in range(12 + i % 5))
            out.append(await one_request(client, url, model, prompt, max_tokens))
        return out

    limits = httpx.Limits(max_connections=clients + 4)
    async with httpx.AsyncClient(timeout=None, headers=headers, limits=limits) as client:
        await one_request(client, url, model, "warm up", 4)
        cpu0, t0 = time.process_time(), time.perf_counter()
        results = await asyncio.gather(*(client_loop(i, client) for i in range(clients)))
        wall, cpu = time.perf_counter() - t0, time.process_time() - cpu0
    reqs = [r for rs in results for r in rs]
    return {"clients": clients, "requests": len(reqs), "tokens": sum(r["tokens"] for r in reqs), "wall": wall,
            "tok_s": sum(r["tokens"] for r in reqs) / wall, "ttft": [r["ttft"] for r in reqs],
            "itl": [x for r in reqs for x in r["itl"]], "client_cpu": cpu / wall}


def text(n_words: int, seed: int = 0) -> str:
    return " ".join(WORDS[(seed * 13 + k * 7 + k // len(WORDS)) % len(WORDS)] for k in range(n_words))


def words_for(url: str, headers: dict, model: str, tokens: int) -> int:
    """Words of :func:`text` that make about ``tokens`` tokens (the server's own count)."""
    import httpx

    body = {"model": model, "messages": [{"role": "user", "content": text(1000)}]}
    n = httpx.post(url + "/v1/messages/count_tokens", json=body, headers=headers).raise_for_status().json()["input_tokens"]
    return max(1, int(tokens * 1000 / n))


async def long_prompt(url: str, headers: dict, model: str, streams: int, long_tokens: int) -> dict:
    """Streams running; a long prompt arrives: their gaps before it and while it prefills -- and, as a control, the
    same streams again without it, up to the same tokens: their gaps between the same tokens (the streams' own
    decode steps get slower as they grow, whatever arrives)."""
    import httpx

    n_words = words_for(url, headers, model, long_tokens)
    async with httpx.AsyncClient(timeout=None, headers=headers, limits=httpx.Limits(max_connections=streams + 4)) as c:
        await one_request(c, url, model, "warm up", 4)

        async def stream(i, arrivals, max_tokens=8192):
            body = {"model": model, "messages": [{"role": "user", "content": text(12, seed=i)}],
                    "max_tokens": max_tokens, "stream": True, "temperature": 0, "ignore_eos": True}
            async with c.stream("POST", url + "/v1/chat/completions", json=body) as r:
                async for line in r.aiter_lines():
                    if line.startswith("data: {") and '"content":' in line:
                        arrivals.append(time.perf_counter())

        arrivals: list[list[float]] = [[] for _ in range(streams)]
        tasks = [asyncio.create_task(stream(i, arrivals[i])) for i in range(streams)]
        while min(len(a) for a in arrivals) < 16:
            await asyncio.sleep(0.01)
        t_long = time.perf_counter()
        long = await one_request(c, url, model, text(n_words, seed=99), 4)
        t_first = t_long + long["ttft"]
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)
        # (j: the gap from token j to j + 1 of a stream) those while the long prompt prefilled
        spans = [[j for j, (a, b) in enumerate(zip(arr, arr[1:])) if t_long <= b and a <= t_first] for arr in arrivals]
        alone: list[list[float]] = [[] for _ in range(streams)]
        await asyncio.gather(*(stream(i, alone[i], max(js, default=0) + 2) for i, js in enumerate(spans)))
    before = [b - a for arr in arrivals for a, b in zip(arr, arr[1:]) if b < t_long]
    during = [arr[j + 1] - arr[j] for arr, js in zip(arrivals, spans) for j in js]
    control = [arr[j + 1] - arr[j] for arr, js in zip(alone, spans) for j in js if j + 1 < len(arr)]
    return {"before": before, "during": during, "control": control, "ttft": long["ttft"], "words": n_words}


async def shared_prefix(url: str, headers: dict, model: str, clients: int, prefix_tokens: int) -> dict:
    """TTFT of requests sent together with one shared prefix (after a warm one), and with prefixes of their own."""
    import httpx

    n_words = words_for(url, headers, model, prefix_tokens)
    prefix = text(n_words, seed=5)
    async with httpx.AsyncClient(timeout=None, headers=headers, limits=httpx.Limits(max_connections=clients + 4)) as c:
        await one_request(c, url, model, prefix + " warm", 2)
        shared = await asyncio.gather(*(one_request(c, url, model, prefix + f" {text(6, seed=i)} {i}", 2)
                                        for i in range(clients)))
        own = await asyncio.gather(*(one_request(c, url, model, f"{i} " + text(n_words, seed=40 + i), 2)
                                     for i in range(clients)))
    return {"shared": shared, "own": own}


async def capacity(url: str, headers: dict, model: str, clients: int, prompt_tokens: int, max_tokens: int) -> dict:
    """As many requests as slots at once; the most running together, sampled from /metrics."""
    import re

    import httpx

    n_words = words_for(url, headers, model, prompt_tokens)
    peak, used = 0, 0
    done = asyncio.Event()

    async def sample(c):
        nonlocal peak, used
        while not done.is_set():
            m = (await c.get(url + "/metrics")).text
            peak = max(peak, int(re.search(r"^dynamoe_running_sequences (\d+)", m, re.M).group(1)))
            used = max(used, int(re.search(r'^dynamoe_kv_cache_blocks\{state="used"\} (\d+)', m, re.M).group(1)))
            await asyncio.sleep(0.05)

    async with httpx.AsyncClient(timeout=None, headers=headers, limits=httpx.Limits(max_connections=clients + 4)) as c:
        sampler = asyncio.create_task(sample(c))
        t0 = time.perf_counter()
        reqs = await asyncio.gather(*(one_request(c, url, model, f"{i} " + text(n_words, seed=i), max_tokens)
                                      for i in range(clients)))
        wall = time.perf_counter() - t0
        done.set()
        await sampler
        health = (await c.get(url + "/health")).json()["kv_cache"]
        m = (await c.get(url + "/metrics")).text
    preempted = int(re.search(r"^dynamoe_preemptions_total (\d+)", m, re.M).group(1))
    return {"peak": peak, "used": used, "health": health, "preempted": preempted, "wall": wall,
            "tokens": sum(r["tokens"] for r in reqs)}


async def code_edits(url: str, headers: dict, model: str, max_tokens: int) -> dict:
    """The speculative scenario's workload on one server: per function, its first request and the repeat."""
    import httpx

    from dynamoe.examples.demo_code import CANONICAL_CODE_PROMPTS

    out = {"first": [], "again": [], "texts": []}
    async with httpx.AsyncClient(timeout=None, headers=headers) as c:
        for prompt in CANONICAL_CODE_PROMPTS.values():
            ask = [{"role": "user", "content": prompt}]
            first = await stream_chat(c, url, model, ask, max_tokens)
            again = await stream_chat(c, url, model, ask + [{"role": "assistant", "content": first["text"]},
                                                             {"role": "user", "content": prompt}], max_tokens)
            out["first"].append((first["tokens"], first["seconds"]))
            out["again"].append((again["tokens"], again["seconds"]))
            out["texts"] += [first["text"], again["text"]]
    return out


def spec_counters(url: str, headers: dict) -> tuple[int, int]:
    """(draft tokens verified, accepted) so far, every draft source, from /metrics."""
    import httpx

    drafted = accepted = 0
    for line in httpx.get(url + "/metrics", headers=headers).text.splitlines():
        if line.startswith("dynamoe_spec_draft_tokens_total"):
            drafted += int(float(line.rsplit(" ", 1)[1]))
        elif line.startswith("dynamoe_spec_accepted_tokens_total"):
            accepted += int(float(line.rsplit(" ", 1)[1]))
    return drafted, accepted


def run_speculative(args, servers: dict, headers: dict) -> None:
    """Both servers (name -> url), the workload interleaved over the rounds; prints the table."""
    res = {name: {"first": [], "again": [], "texts": []} for name in servers}
    for r in range(args.rounds):
        for name, url in (list(servers.items()) if r % 2 == 0 else list(servers.items())[::-1]):
            one = asyncio.run(code_edits(url, headers, "bench", args.max_tokens))
            for key in res[name]:
                res[name][key] += one[key]
    same = res["plain"]["texts"] == res["speculative"]["texts"]
    drafted, accepted = spec_counters(servers["speculative"], headers)
    print(f"\ncode-editing workload (6 functions, each asked for and then again after its answer), "
          f"{args.rounds} rounds, --num-speculative-tokens {args.num_speculative_tokens}\n")
    print("| server | first ask: tok/s | asked again: tok/s | tokens generated |")
    print("| --- | ---: | ---: | ---: |")
    rate = {}
    for name, r in res.items():
        tps = [sum(n for n, _ in r[k]) / sum(t for _, t in r[k]) for k in ("first", "again")]
        rate[name] = tps
        print(f"| {name} | {tps[0]:.1f} | {tps[1]:.1f} | {sum(n for k in ('first', 'again') for n, _ in r[k])} |")
    print(f"\nspeed-up: first ask {rate['speculative'][0] / rate['plain'][0]:.2f}x, asked again "
          f"{rate['speculative'][1] / rate['plain'][1]:.2f}x; draft tokens accepted {accepted} of {drafted} "
          f"({accepted / max(drafted, 1):.0%}); outputs {'identical' if same else 'DIFFER'} on both servers")


def ms(x: float) -> str:
    return f"{1000 * x:.1f}"


def run_scenario(args, url: str, headers: dict, model: str) -> None:
    if args.scenario == "long-prompt":
        r = asyncio.run(long_prompt(url, headers, model, args.streams, args.long_tokens))
        med = statistics.median(r["before"])
        print(f"\n{args.streams} streams; a {args.long_tokens}-token prompt arrives ({r['words']} words)\n")
        print("| gap before, p50 ms | while it prefills: p50 ms | p99 ms | max ms | max / p50 before | "
              "same tokens without it: p50 ms | max / that | long prompt TTFT s |")
        print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
        d = r["during"] or [float("nan")]
        alone = statistics.median(r["control"]) if r["control"] else float("nan")
        print(f"| {ms(med)} | {ms(statistics.median(d))} | {ms(pct(d, 99))} | {ms(max(d))} | "
              f"{max(d) / med:.1f}x | {ms(alone)} | {max(d) / alone:.1f}x | {r['ttft']:.2f} |")
    elif args.scenario == "shared-prefix":
        r = asyncio.run(shared_prefix(url, headers, model, args.clients, args.prefix_tokens))
        print(f"\n{args.clients} requests sent together, {args.prefix_tokens}-token prefix\n")
        print("| prefix | TTFT p50 s | TTFT max s | cached tokens (min / max) |")
        print("| --- | ---: | ---: | ---: |")
        for name, rows in (("shared (after one warm request)", r["shared"]), ("each its own", r["own"])):
            t = [x["ttft"] for x in rows]
            cached = [x["cached"] for x in rows]
            print(f"| {name} | {statistics.median(t):.2f} | {max(t):.2f} | {min(cached)} / {max(cached)} |")
    else:
        r = asyncio.run(capacity(url, headers, model, max(args.concurrency), args.capacity_tokens, args.max_tokens))
        h = r["health"]
        per_position = h["bytes_per_block"] / h["block_size"]
        slots_model = int(h["blocks_total"] * h["block_size"] // args.max_seq_len)
        print(f"\n{max(args.concurrency)} requests of ~{args.capacity_tokens} + {args.max_tokens} tokens at once, "
              f"KV cache {h['blocks_total']} blocks x {h['block_size']} ({h['blocks_total'] * h['bytes_per_block'] / 2**20:.0f} "
              f"MiB, {per_position / 1024:.1f} KiB a position)\n")
        print("| most running at once | blocks used (peak) | preemptions | whole-context slots (max_seq_len "
              f"{args.max_seq_len}) in the same memory | tokens/s |")
        print("| ---: | ---: | ---: | ---: | ---: |")
        print(f"| {r['peak']} | {r['used']} of {h['blocks_total']} | {r['preempted']} | {slots_model} | "
              f"{r['tokens'] / r['wall']:.1f} |")


def main_speculative(args) -> int:
    """The speculative scenario: two servers on --model (default: the embedded demo model)."""
    from dynamoe.serve.cli import DEMO_MODEL_DIR

    if args.url:
        raise SystemExit("--scenario speculative starts its own two servers: drop --url")
    model_dir = args.model or DEMO_MODEL_DIR
    headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
    procs = []
    try:
        servers = {}
        drafting = ["--num-speculative-tokens", str(args.num_speculative_tokens)]
        for name, extra in (("plain", []), ("speculative", drafting)):
            extra = extra + (["--dtype", args.dtype] if args.dtype else [])
            proc, url = start_server(model_dir, 1, args.threads, extra)
            procs.append(proc)
            servers[name] = url
        print(f"servers {servers}, model {model_dir}, scenario speculative")
        run_speculative(args, servers, headers)
    finally:
        for proc in procs:
            proc.terminate()
            proc.wait(10)
    return 0


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--url", help="a running server (host:port or URL); default: start one")
    p.add_argument("--api-key", default=os.environ.get("DYNAMOE_API_KEY"))
    p.add_argument("--model", help="checkpoint folder for the server this script starts")
    p.add_argument("--concurrency", type=int, nargs="+", default=[1, 4, 8, 16])
    p.add_argument("--max-tokens", type=int, default=64)
    p.add_argument("--rounds", type=int, default=2, help="requests per client, one after the other")
    p.add_argument("--threads", type=int, default=None, help="OMP_NUM_THREADS of the server this script starts")
    p.add_argument("--hidden", type=int, default=256)
    p.add_argument("--layers", type=int, default=4)
    p.add_argument("--experts", type=int, default=16)
    p.add_argument("--top-k", type=int, default=4)
    p.add_argument("--scenario", choices=["concurrency", "long-prompt", "shared-prefix", "capacity", "speculative"],
                   default="concurrency")
    p.add_argument("--streams", type=int, default=4, help="long-prompt: running streams")
    p.add_argument("--long-tokens", type=int, default=12000, help="long-prompt: tokens of the arriving prompt")
    p.add_argument("--clients", type=int, default=6, help="shared-prefix: requests sent together")
    p.add_argument("--prefix-tokens", type=int, default=6000, help="shared-prefix: tokens of the shared prefix")
    p.add_argument("--kv-cache-memory", default="64MiB", help="capacity: the server's --kv-cache-memory")
    p.add_argument("--capacity-tokens", type=int, default=1500, help="capacity: prompt tokens per request")
    p.add_argument("--max-seq-len", type=int, default=32768, help="the server's --max_seq_len in the scenarios")
    p.add_argument("--num-speculative-tokens", type=int, default=4,
                   help="speculative: the draft tokens per step of the second server")
    p.add_argument("--dtype", choices=["float32", "bfloat16"], default=None,
                   help="the server's --dtype (weights, activations and KV cache); default: the checkpoint's (fp32)")
    args = p.parse_args(argv)
    scenario = args.scenario != "concurrency"

    import httpx

    proc = None
    tmp = None
    if args.scenario == "speculative":
        return main_speculative(args)
    try:
        if args.url:
            url = args.url if args.url.startswith("http") else "http://" + args.url
        else:
            model_dir = args.model
            if model_dir is None:
                tmp = tempfile.TemporaryDirectory()
                model_dir = write_random_checkpoint(os.path.join(tmp.name, "ckpt"), args.hidden, args.layers,
                                                    args.experts, args.top_k,
                                                    args.max_seq_len if scenario else 2048)
            extra = ["--max_seq_len", str(args.max_seq_len)] if scenario else []
            if args.dtype:
                extra += ["--dtype", args.dtype]
            if args.scenario == "capacity":
                extra += ["--kv-cache-memory", args.kv_cache_memory]
            proc, url = start_server(model_dir, max(args.concurrency), args.threads, extra)
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = httpx.get(url + "/v1/models", headers=headers).raise_for_status().json()["data"][0]["id"]
        if scenario:
            print(f"server {url}, model {model}, scenario {args.scenario}")
            run_scenario(args, url, headers, model)
            return 0
        print(f"server {url}, model {model}, {args.max_tokens} tokens per request, {args.rounds} requests per client")
        rows = [asyncio.run(level(url, headers, model, c, args.rounds, args.max_tokens)) for c in args.concurrency]
    finally:
        if proc is not None:
            proc.terminate()
            proc.wait(10)
        if tmp is not None:
            tmp.cleanup()
    base = rows[0]["tok_s"]
    print(f"\n| clients | requests | tokens/s | vs {rows[0]['clients']} | TTFT p50 ms | TTFT p99 ms | ITL p50 ms | "
          f"ITL p99 ms | client CPU |")
    print("| ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        print(f"| {r['clients']} | {r['requests']} | {r['tok_s']:.1f} | {r['tok_s'] / base:.2f}x | "
              f"{1000 * statistics.median(r['ttft']):.1f} | {1000 * pct(r['ttft'], 99):.1f} | "
              f"{1000 * pct(r['itl'], 50):.1f} | {1000 * pct(r['itl'], 99):.1f} | {100 * r['client_cpu']:.0f}% |")
    return 0


if __name__ == "__main__":
    sys.exit(main())
