"""gpt-oss-20b at real scale on CPU: a random checkpoint with gpt-oss-20b's exact config and tensor layout
(MXFP4 routed experts, everything else bf16; ~13 GB), then dynamoe's memory and speed on it.

    python benchmarks/gpt_oss_scale.py build DIR            # writes the checkpoint (~13 GB; a few minutes)
    python benchmarks/gpt_oss_scale.py run DIR [--prompts 128 2048] [--new 16] [--threads 2]
    python benchmarks/gpt_oss_scale.py llama DIR [--rounds 2] [--prompts 128 2048] [--new 16]

``build``: config.json as openai/gpt-oss-20b's (24 layers, hidden 2880, 64 query / 8 KV heads of 64, 32 experts
top-4, intermediate 2880, vocab 201088, sliding window 128 on even layers, sinks, YaRN x32, swiglu_limit 7,
``quantization_config {quant_method: mxfp4}``) and its tensor names, shapes and dtypes: per layer
``self_attn.{q,k,v,o}_proj.{weight,bias}`` + ``sinks``, ``mlp.router.{weight,bias}``,
``mlp.experts.gate_up_proj_{blocks [32, 5760, 90, 16], scales [32, 5760, 90], bias}`` and
``down_proj_{blocks [32, 2880, 90, 16], scales, bias}`` (u8 FP4 pairs / e8m0 scales, group 32), norms; the
embedding and an untied lm_head. Random values, seed 0: bf16 N(0, 0.02) weights, random FP4 codes, scales
2^-6..2^-4 (expert weights of about the size the real ones have), in 5 GB shards with an index, as the hub has it.
No tokenizer: token ids in, token ids out.

``run`` (one process, ``torch.set_num_threads(--threads)``): loads with ``dynamoe.models.load`` (experts stay
MXFP4), runs one warm-up (a 256-token prefill and 4 decode steps: the first pass faults in the weights read in
place from the mapped files, timed apart), then per prompt length a prefill of random tokens into a fresh cache
to the first token's logits, and ``--new`` greedy decode steps; reports tok/s, ms/token, resident memory (the
process's own and the mapped weights') after loading and the peak (VmHWM) after each phase -- the issue's bound
is a peak <= 17 GB including a 2048-token prefill on the 24 GiB VM.

``llama``: the same weights in llama.cpp, timed beside dynamoe in one run. llama.cpp is built as
benchmarks/llama_cpp.py builds it (the llama-cpp-python sdist's vendor/llama.cpp, under ~/.cache/dynamoe-bench);
its own convert_hf_to_gguf.py converts DIR (experts repacked as MXFP4 as they are, the rest bf16, no vocabulary:
the random checkpoint has no tokenizer) into DIR.gguf once. Each round runs ``llama-bench -t 2 -p P1,P2 -n NEW``
(its own warm-up first) and then this script's ``run`` in a fresh process (the two models do not fit in memory
together: each round reads its weights from the page cache or the disk again, after its warm-up), the order
alternating between rounds; medians over rounds.
"""
from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
sys.path.insert(0, os.path.dirname(__file__))

CONFIG = {
    "architectures": ["GptOssForCausalLM"], "model_type": "gpt_oss", "attention_bias": True, "attention_dropout": 0.0,
    "eos_token_id": 200002, "pad_token_id": 199999, "experts_per_token": 4, "num_experts_per_tok": 4, "head_dim": 64,
    "hidden_act": "silu", "hidden_size": 2880, "initial_context_length": 4096, "initializer_range": 0.02,
    "intermediate_size": 2880, "layer_types": ["sliding_attention", "full_attention"] * 12,
    "max_position_embeddings": 131072, "num_attention_heads": 64, "num_hidden_layers": 24, "num_key_value_heads": 8,
    "num_local_experts": 32, "output_router_logits": False, "rms_norm_eps": 1e-05,
    "rope_scaling": {"beta_fast": 32.0, "beta_slow": 1.0, "factor": 32.0, "original_max_position_embeddings": 4096,
                     "rope_type": "yarn", "truncate": False},
    "rope_theta": 150000, "router_aux_loss_coef": 0.9, "sliding_window": 128, "swiglu_limit": 7.0,
    "tie_word_embeddings": False, "torch_dtype": "bfloat16", "use_cache": True, "vocab_size": 201088,
    "quantization_config": {"quant_method": "mxfp4", "modules_to_not_convert": [
        "model.layers.*.self_attn", "model.layers.*.mlp.router", "model.embed_tokens", "lm_head"]},
}
SHARD_BYTES = 5 * 10 ** 9


def tensors(cfg: dict):
    """(name, shape, dtype) of every tensor of the checkpoint, in the hub's order (embedding, layers, norm, head)."""
    D, V, E, F = cfg["hidden_size"], cfg["vocab_size"], cfg["num_local_experts"], cfg["intermediate_size"]
    H, K, hd = cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    bf, u8 = torch.bfloat16, torch.uint8
    yield "model.embed_tokens.weight", (V, D), bf
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        yield p + "input_layernorm.weight", (D,), bf
        yield p + "post_attention_layernorm.weight", (D,), bf
        for name, out, inp in (("q_proj", H * hd, D), ("k_proj", K * hd, D), ("v_proj", K * hd, D), ("o_proj", D, H * hd)):
            yield p + f"self_attn.{name}.weight", (out, inp), bf
            yield p + f"self_attn.{name}.bias", (out,), bf
        yield p + "self_attn.sinks", (H,), bf
        yield p + "mlp.router.weight", (E, D), bf
        yield p + "mlp.router.bias", (E,), bf
        for name, out, inp in (("gate_up_proj", 2 * F, D), ("down_proj", D, F)):
            yield p + f"mlp.experts.{name}_blocks", (E, out, inp // 32, 16), u8
            yield p + f"mlp.experts.{name}_scales", (E, out, inp // 32), u8
            yield p + f"mlp.experts.{name}_bias", (E, out), bf
    yield "model.norm.weight", (D,), bf
    yield "lm_head.weight", (V, D), bf


def random_tensor(name: str, shape: tuple, dtype: torch.dtype, gen: torch.Generator) -> torch.Tensor:
    if name.endswith("_blocks"):
        return torch.randint(0, 256, shape, dtype=torch.uint8, generator=gen)
    if name.endswith("_scales"):
        return torch.randint(127 - 6, 127 - 3, shape, dtype=torch.uint8, generator=gen)   # 2^-6 .. 2^-4
    if name.endswith("layernorm.weight") or name == "model.norm.weight":
        return torch.ones(shape, dtype=dtype)
    if name.endswith("sinks"):
        return torch.zeros(shape, dtype=dtype)
    return (torch.randn(shape, generator=gen) * 0.02).to(dtype)


def build(folder: str) -> None:
    from safetensors.torch import save_file

    os.makedirs(folder, exist_ok=True)
    with open(os.path.join(folder, "config.json"), "w") as f:
        json.dump(CONFIG, f, indent=2)
    gen = torch.Generator().manual_seed(0)
    specs = list(tensors(CONFIG))
    shards, cur, size = [], [], 0
    for spec in specs:
        nbytes = torch.Size(spec[1]).numel() * spec[2].itemsize
        if cur and size + nbytes > SHARD_BYTES:
            shards.append(cur)
            cur, size = [], 0
        cur.append(spec)
        size += nbytes
    shards.append(cur)
    weight_map, total = {}, 0
    for n, shard in enumerate(shards):
        fname = f"model-{n:05d}-of-{len(shards) - 1:05d}.safetensors"
        data = {name: random_tensor(name, shape, dtype, gen) for name, shape, dtype in shard}
        save_file(data, os.path.join(folder, fname), metadata={"format": "pt"})
        for name, t in data.items():
            weight_map[name] = fname
            total += t.numel() * t.element_size()
        print(f"{fname}: {len(data)} tensors, {sum(t.numel() * t.element_size() for t in data.values()) / 1e9:.2f} GB",
              flush=True)
        del data
    with open(os.path.join(folder, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": total}, "weight_map": weight_map}, f, indent=2)
    print(f"{folder}: {total / 1e9:.2f} GB in {len(shards)} shards")


def memory_gb() -> dict[str, float]:
    """This process's memory in GB, from /proc/self/status: VmRSS (resident now), VmHWM (peak resident), RssAnon
    (resident memory of its own) and RssFile (resident pages of mapped files: weights read in place)."""
    vals = {}
    with open("/proc/self/status") as f:
        for line in f:
            k, _, v = line.partition(":")
            if k in ("VmRSS", "VmHWM", "RssAnon", "RssFile"):
                vals[k] = int(v.split()[0]) * 1024 / 1e9
    return vals


def run(folder: str, prompts: list[int], new: int, threads: int) -> dict:
    import dynamoe.models

    torch.set_num_threads(threads)
    t0 = time.perf_counter()
    model = dynamoe.models.load(folder, dtype=torch.bfloat16, progress=False)
    m = memory_gb()
    print(f"loaded in {time.perf_counter() - t0:.1f} s: resident {m['VmRSS']:.2f} GB ({m['RssAnon']:.2f} of its own, "
          f"{m['RssFile']:.2f} of mapped weights), peak {m['VmHWM']:.2f} GB; {threads} threads")
    gen = torch.Generator().manual_seed(1)
    # the first forward after loading faults in the weights read in place (mapped pages): timed apart
    with torch.inference_mode():
        cache = model.new_cache(1, 256 + 4)
        t = time.perf_counter()
        tok = model(torch.randint(0, CONFIG["vocab_size"], (1, 256), generator=gen), cache=cache, logits_to_keep=1)
        cold = time.perf_counter() - t
        for _ in range(4):
            tok = model(tok[:, -1].float().argmax(-1, keepdim=True), cache=cache)
        del cache
    print(f"warm-up: a 256-token prefill right after loading took {cold:.1f} s (weights read from the page cache)")
    print("\n| prompt | prefill tok/s | decode ms/token | resident after, GB (own + mapped) | peak so far, GB |")
    print("| ---: | ---: | ---: | ---: | ---: |")
    out = {"load_s": time.perf_counter() - t0, "cold_prefill256_s": cold}
    for P in prompts:
        ids = torch.randint(0, CONFIG["vocab_size"], (1, P), generator=gen)
        cache = model.new_cache(1, P + new)
        with torch.inference_mode():
            t = time.perf_counter()
            tok = model(ids, cache=cache, logits_to_keep=1)[:, -1].float().argmax(-1, keepdim=True)
            prefill = time.perf_counter() - t
            t = time.perf_counter()
            for _ in range(new):
                tok = model(tok, cache=cache)[:, -1].float().argmax(-1, keepdim=True)
            step = (time.perf_counter() - t) / new
        del cache
        m = memory_gb()
        print(f"| {P} | {P / prefill:.2f} | {1000 * step:.1f} | {m['VmRSS']:.2f} ({m['RssAnon']:.2f} + "
              f"{m['RssFile']:.2f}) | {m['VmHWM']:.2f} |", flush=True)
        out[f"pp{P}"], out[f"decode_ms@{P}"], out[f"peak_gb@{P}"] = P / prefill, 1000 * step, m["VmHWM"]
    return out


def llama(folder: str, rounds: int, prompts: list[int], new: int) -> None:
    import statistics
    import subprocess

    import llama_cpp as lc   # benchmarks/llama_cpp.py: the pinned llama.cpp source and its build

    src = lc.llama_cpp_source(lc.LLAMA_CPP_PYTHON)
    bins = lc.build_llama_cpp(src)
    gguf = os.path.abspath(folder.rstrip("/")) + ".gguf"
    if not os.path.exists(gguf):
        lc.log(f"converting {folder} to {gguf} (convert_hf_to_gguf.py: MXFP4 experts, bf16 rest)")
        lc.run([sys.executable, "-c", lc.convert_script("conversion.gpt_oss", "GptOssModel"), src, folder, gguf + ".tmp"])
        os.replace(gguf + ".tmp", gguf)
    results: dict[str, list[dict]] = {"llama.cpp": [], "dynamoe": []}
    for r in range(rounds):
        for engine in (["llama.cpp", "dynamoe"] if r % 2 == 0 else ["dynamoe", "llama.cpp"]):
            lc.log(f"round {r + 1}: {engine}")
            if engine == "llama.cpp":
                results[engine].append(lc.bench_llama(bins, gguf, prompts, new))
            else:
                res = subprocess.run([sys.executable, __file__, "run", folder, "--new", str(new), "--json", "-",
                                      "--prompts", *map(str, prompts)], capture_output=True, text=True, check=True)
                results[engine].append(json.loads(res.stdout.strip().splitlines()[-1]))
    med = {e: {k: statistics.median(x[k] for x in runs) for k in runs[0] if isinstance(runs[0][k], (int, float))}
           for e, runs in results.items()}
    print(f"\n{rounds} rounds, medians; llama.cpp {results['llama.cpp'][0]['info'].get('build_commit')}, 2 threads\n")
    print("| engine | " + " | ".join(f"prefill tok/s @{p}" for p in prompts) + " | decode ms/token |")
    print("| --- | " + " | ".join("---:" for _ in prompts) + " | ---: |")
    ll, dy = med["llama.cpp"], med["dynamoe"]
    print("| llama.cpp | " + " | ".join(f"{ll[f'pp{p}']:.2f}" for p in prompts) + f" | {ll['decode_ms']:.1f} |")
    dec = dy[f"decode_ms@{min(prompts)}"]   # (llama-bench decodes from an empty cache: ours after the shortest prompt)
    print("| dynamoe | " + " | ".join(f"{dy[f'pp{p}']:.2f}" for p in prompts) + f" | {dec:.1f} |")
    print("| dynamoe / llama.cpp (tok/s) | " + " | ".join(f"{dy[f'pp{p}'] / ll[f'pp{p}']:.2f}x" for p in prompts)
          + f" | {ll['decode_ms'] / dec:.2f}x |")


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    sub = p.add_subparsers(dest="cmd", required=True)
    b = sub.add_parser("build", help="write the random gpt-oss-20b-shaped checkpoint")
    b.add_argument("folder")
    r = sub.add_parser("run", help="load it and time prefill and decode, with resident memory")
    r.add_argument("folder")
    r.add_argument("--prompts", type=int, nargs="+", default=[128, 2048])
    r.add_argument("--new", type=int, default=16, help="decode steps timed after each prefill")
    r.add_argument("--threads", type=int, default=2)
    r.add_argument("--json", metavar="FILE", help="also write the results as JSON ('-': a last line on stdout)")
    q = sub.add_parser("llama", help="llama.cpp on the same weights beside dynamoe, interleaved rounds")
    q.add_argument("folder")
    q.add_argument("--rounds", type=int, default=2)
    q.add_argument("--prompts", type=int, nargs="+", default=[128, 2048])
    q.add_argument("--new", type=int, default=16)
    args = p.parse_args(argv)
    if args.cmd == "build":
        build(args.folder)
    elif args.cmd == "llama":
        llama(args.folder, args.rounds, args.prompts, args.new)
    else:
        out = run(args.folder, args.prompts, args.new, args.threads)
        if args.json == "-":
            print(json.dumps(out))
        elif args.json:
            with open(args.json, "w") as f:
                json.dump(out, f)
    return 0


if __name__ == "__main__":
    sys.exit(main())
