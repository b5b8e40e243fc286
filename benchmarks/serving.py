"""Serving throughput and latency: 1, 4, 8, 16 concurrent streaming clients against one server.

    python benchmarks/serving.py [--url 127.0.0.1:8000 [--api-key K]] [--concurrency 1 4 8 16]
                                 [--max-tokens 64] [--rounds 2] [--model DIR] [--threads N]

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


def write_random_checkpoint(path: str, hidden: int, layers: int, experts: int, top_k: int) -> str:
    """A random Qwen3-MoE with a small byte-level BPE tokenizer and a ChatML template."""
    import torch
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    special = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    tok.train_from_iterator([" ".join(WORDS)] * 4, trainers.BpeTrainer(
        vocab_size=1024, special_tokens=special, show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
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
        max_position_embeddings=2048, bos_token_id=None, eos_token_id=tok.token_to_id("<|im_end|>"))
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.05)
    hf.save_pretrained(path)
    return path


def start_server(model_dir: str, max_num_seqs: int, threads: int | None) -> tuple[subprocess.Popen, str]:
    port = free_port()
    env = dict(os.environ)
    if threads:
        env["OMP_NUM_THREADS"] = str(threads)
    cmd = [sys.executable, "-m", "dynamoe.cli", "serve", "--model", model_dir, "--port", str(port),
           "--max-num-seqs", str(max_num_seqs), "--log-level", "warning", "--serve", "core",
           "--served-model-name", "bench"]
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


async def one_request(client, url: str, model: str, prompt: str, max_tokens: int) -> dict:
    body = {"model": model, "messages": [{"role": "user", "content": prompt}], "max_tokens": max_tokens,
            "stream": True, "stream_options": {"include_usage": True}, "temperature": 0, "ignore_eos": True}
    t0 = time.perf_counter()
    arrivals, tokens = [], 0
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
            for ch in chunk.get("choices", []):
                if ch.get("delta", {}).get("content"):
                    arrivals.append(time.perf_counter())
    return {"ttft": arrivals[0] - t0 if arrivals else float("nan"),
            "itl": [b - a for a, b in zip(arrivals, arrivals[1:])], "tokens": tokens}


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
    args = p.parse_args(argv)

    import httpx

    proc = None
    tmp = None
    try:
        if args.url:
            url = args.url if args.url.startswith("http") else "http://" + args.url
        else:
            model_dir = args.model
            if model_dir is None:
                tmp = tempfile.TemporaryDirectory()
                model_dir = write_random_checkpoint(os.path.join(tmp.name, "ckpt"), args.hidden, args.layers,
                                                    args.experts, args.top_k)
            proc, url = start_server(model_dir, max(args.concurrency), args.threads)
        headers = {"Authorization": f"Bearer {args.api_key}"} if args.api_key else {}
        model = httpx.get(url + "/v1/models", headers=headers).raise_for_status().json()["data"][0]["id"]
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
