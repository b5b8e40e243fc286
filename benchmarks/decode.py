"""Prefill and decode of a ~490M-parameter Qwen3-MoE on CPU: dynamoe vs transformers' generate, with
the memory-bandwidth floor of a decode step, measured in the same run.

    python benchmarks/decode.py [--dtypes bfloat16 float32] [--prompt 128] [--new 64] [--rounds 3]
    python benchmarks/decode.py --quantized mxfp4 mxfp4:experts,attention,lm_head fp8 [--act-quant int8]

``--quantized FORMAT[:MODULES]`` instead converts the checkpoint with ``dynamoe quantize --format FORMAT
[--modules MODULES]`` for each variant and times them (loaded in bf16) against the bf16 model, interleaved,
with each one's DecodePlan summary (which layers run fused).

The model (random weights, same seed for both): hidden 1024, 8 layers, 64 experts, top-8,
moe_intermediate 256, 16 heads / 4 KV heads (head_dim 64), vocab 32000. It is built once with
transformers, saved as safetensors to a temporary folder and loaded by dynamoe.models.load, so
both run identical weights. Batch 1, greedy, `--prompt` tokens, `--new` generated tokens.

* prefill tok/s: prompt tokens / time to the first token's logits.
* decode ms/token: (time for all `--new` tokens - prefill) / (`--new` - 1).
* floor: bytes a decode step must read (attention weights, the 8 routed experts of every layer,
  router, norms, lm_head, one embedding row; the KV cache is negligible here) / the machine's read
  bandwidth, measured as the best of a few passes summing a 1 GiB buffer -- before every round, as a
  shared VM's bandwidth drifts; "x floor" is the median over rounds of time / that round's floor.
Medians over `--rounds` (after a warm-up run).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
import dynamoe.models  # noqa: E402

CONFIG = dict(vocab_size=32000, hidden_size=1024, num_hidden_layers=8, num_attention_heads=16, num_key_value_heads=4,
              head_dim=64, intermediate_size=2816, moe_intermediate_size=256, num_experts=64, num_experts_per_tok=8,
              norm_topk_prob=True, max_position_embeddings=4096, rms_norm_eps=1e-6, rope_theta=1e6,
              tie_word_embeddings=False, decoder_sparse_step=1, mlp_only_layers=[])
DTYPES = {"bfloat16": torch.bfloat16, "float32": torch.float32}


def build_checkpoint(folder: str) -> int:
    from transformers import Qwen3MoeConfig, Qwen3MoeForCausalLM

    torch.manual_seed(0)
    model = Qwen3MoeForCausalLM(Qwen3MoeConfig(**CONFIG)).eval()
    model.save_pretrained(folder, safe_serialization=True)
    return sum(p.numel() for p in model.parameters())


def read_bandwidth() -> float:
    """Bytes/s of a streaming read (sum over a 1 GiB fp32 buffer), best of 5."""
    x = torch.ones(256 * 1024 * 1024)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * x.element_size() / best


def decode_bytes(cfg: dict, elem: int) -> int:
    D, H, KV, hd = cfg["hidden_size"], cfg["num_attention_heads"], cfg["num_key_value_heads"], cfg["head_dim"]
    attn = D * H * hd * 2 + D * KV * hd * 2 + 2 * hd            # q, o, k, v, q/k norms
    experts = cfg["num_experts_per_tok"] * 3 * D * cfg["moe_intermediate_size"]
    router = cfg["num_experts"] * D
    per_layer = attn + experts + router + 2 * D
    return elem * (cfg["num_hidden_layers"] * per_layer + cfg["vocab_size"] * D + 2 * D)


def time_dynamoe(model, prompt: torch.Tensor, new: int) -> tuple[float, float, list[int]]:
    """(prefill s, total s, tokens): greedy, batch 1, the KV cache in one slot."""
    cache = model.new_cache(1, prompt.size(1) + new)
    out = []
    with torch.inference_mode():
        t0 = time.perf_counter()
        logits = model(prompt, cache=cache, logits_to_keep=1)
        tok = logits[:, -1].float().argmax(-1, keepdim=True)  # fp32, as the engine's sampler and HF's generate
        t1 = time.perf_counter()
        out.append(int(tok))
        for _ in range(new - 1):
            tok = model(tok, cache=cache)[:, -1].float().argmax(-1, keepdim=True)
            out.append(int(tok))
        t2 = time.perf_counter()
    return t1 - t0, t2 - t0, out


def time_transformers(model, prompt: torch.Tensor, new: int) -> tuple[float, float, list[int]]:
    kw = dict(do_sample=False, pad_token_id=0, eos_token_id=None)
    with torch.inference_mode():
        t0 = time.perf_counter()
        model.generate(prompt, max_new_tokens=1, min_new_tokens=1, **kw)
        t1 = time.perf_counter()
        out = model.generate(prompt, max_new_tokens=new, min_new_tokens=new, **kw)
        t2 = time.perf_counter()
    return t1 - t0, t2 - t1, out[0, prompt.size(1):].tolist()


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--dtypes", nargs="+", choices=list(DTYPES), default=list(DTYPES))
    p.add_argument("--prompt", type=int, default=128)
    p.add_argument("--new", type=int, default=64)
    p.add_argument("--rounds", type=int, default=3)
    p.add_argument("--skip-transformers", action="store_true")
    p.add_argument("--quantized", nargs="+", metavar="FORMAT[:MODULES]", default=None,
                   help="time dynamoe quantize variants against bf16 (see the module docstring)")
    p.add_argument("--act-quant", choices=["int8"], default=None, help="--quantized: int8 activations (4-bit formats)")
    args = p.parse_args(argv)
    if args.prompt < 1 or args.new < 2 or args.rounds < 1:
        p.error("--prompt >= 1, --new >= 2 and --rounds >= 1 are needed")
    if args.quantized:
        from dynamoe.quant.checkpoint_writer import FORMATS, check_modules
        for spec in args.quantized:  # before minutes of model building, not after
            fmt, _, mods = spec.partition(":")
            if fmt not in FORMATS:
                p.error(f"--quantized: format must be one of {list(FORMATS)}, got {fmt!r}")
            try:
                if mods:
                    check_modules(mods.split(","))
            except ValueError as e:
                p.error(f"--quantized {spec}: {e}")
        return quantized_main(args)
    from transformers import AutoModelForCausalLM

    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads")
    rows = []
    with tempfile.TemporaryDirectory() as folder:
        n_params = build_checkpoint(folder)
        print(f"# Qwen3-MoE, {n_params / 1e6:.0f}M parameters, prompt {args.prompt}, {args.new} new tokens, batch 1, greedy")
        prompt = torch.randint(0, CONFIG["vocab_size"], (1, args.prompt), generator=torch.Generator().manual_seed(1))
        for name in args.dtypes:
            dtype = DTYPES[name]
            ours = dynamoe.models.load(folder, dtype=dtype, progress=False)
            theirs = None if args.skip_transformers else AutoModelForCausalLM.from_pretrained(folder, dtype=dtype).eval()
            time_dynamoe(ours, prompt, args.new)  # warm-up (kernels, allocator)
            if theirs is not None:
                time_transformers(theirs, prompt, 4)
            res = {"dynamoe": [], "transformers": []}
            same = None
            bws = []
            for _ in range(args.rounds):  # interleaved, so both see the same machine state
                bws.append(read_bandwidth())  # this VM's bandwidth drifts: the floor of each round
                res["dynamoe"].append(time_dynamoe(ours, prompt, args.new))
                if theirs is not None:
                    res["transformers"].append(time_transformers(theirs, prompt, args.new))
            if theirs is not None:
                a, b = res["dynamoe"][0][2], res["transformers"][0][2]
                # bf16 on random weights: near-tied logits may flip at rounding level after a while
                same = a == b or f"from token {next((i for i, (x, y) in enumerate(zip(a, b)) if x != y), min(len(a), len(b)))} on"
            nbytes = decode_bytes(CONFIG, torch.finfo(dtype).bits // 8)
            floors = [nbytes / b * 1e3 for b in bws]
            print(f"# {name}: read bandwidth per round {', '.join(f'{b / 1e9:.1f}' for b in bws)} GB/s")
            for who, runs in res.items():
                if not runs:
                    continue
                pre = statistics.median(r[0] for r in runs)
                if who == "dynamoe":
                    per_round = [(r[1] - r[0]) / (args.new - 1) for r in runs]
                else:  # transformers: generate(new) re-runs the prefill; subtract the 1-token generate
                    per_round = [(r[1] - pre) / (args.new - 1) for r in runs]
                dec = statistics.median(per_round)
                # x floor: the median over rounds of each round's time over that round's floor
                x_floor = statistics.median(t * 1e3 / f for t, f in zip(per_round, floors))
                rows.append((name, who, args.prompt / pre, dec * 1e3, statistics.median(floors), x_floor))
            if same is not None:
                print(f"# {name}: identical greedy tokens: {'yes' if same is True else f'no, different {same}'}")
            del ours, theirs
    print(f"\n{'dtype':>9} {'engine':>13} {'prefill tok/s':>14} {'decode ms/tok':>14} {'floor ms':>9} {'x floor':>8} {'decode tok/s':>13}")
    by = {(r[0], r[1]): r for r in rows}
    for name, who, pre, dec, floor, x_floor in rows:
        print(f"{name:>9} {who:>13} {pre:14.1f} {dec:14.2f} {floor:9.2f} {x_floor:8.2f} {1e3 / dec:13.1f}")
    for name in args.dtypes:
        if (name, "transformers") in by and (name, "dynamoe") in by:
            ratio = by[(name, "transformers")][3] / by[(name, "dynamoe")][3]
            print(f"# {name}: dynamoe decodes {ratio:.2f}x the tokens/s of transformers")


def quantized_main(args) -> None:
    from dynamoe.cli import quantize_checkpoint
    from dynamoe.quant import ActQuant
    from dynamoe.quant.checkpoint_writer import check_modules

    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads; bf16 activations, batch 1, greedy, "
          f"prompt {args.prompt}, {args.new} new tokens")
    prompt = torch.randint(0, CONFIG["vocab_size"], (1, args.prompt), generator=torch.Generator().manual_seed(1))
    with tempfile.TemporaryDirectory() as root:
        src = os.path.join(root, "dense")
        build_checkpoint(src)
        models = {"bf16": dynamoe.models.load(src, dtype=torch.bfloat16, progress=False)}
        for spec in args.quantized:
            fmt, _, mods = spec.partition(":")
            dst = os.path.join(root, spec.replace(":", "_").replace(",", "-"))
            quantize_checkpoint(src, dst, fmt, log=lambda *a: None,
                                modules=check_modules(mods.split(",")) if mods else None)
            model = dynamoe.models.load(dst, dtype=torch.bfloat16, progress=False)
            if args.act_quant:  # the packed modules of the 4-bit formats (FP8 has no int8 kernels)
                for m in model.modules():
                    if getattr(m, "format", None) in ("mxfp4", "nvfp4", "int4") and hasattr(m, "act_quant"):
                        m.act_quant = ActQuant(args.act_quant)
            models[spec] = model
        for m in models.values():
            time_dynamoe(m, prompt, 4)  # warm-up
        times = {k: [] for k in models}
        names = list(models)
        for r in range(args.rounds):
            for k in names[r % len(names):] + names[:r % len(names)]:
                pre, total, _ = time_dynamoe(models[k], prompt, args.new)
                times[k].append((pre, (total - pre) / (args.new - 1)))
    base = statistics.median(t[1] for t in times["bf16"])
    print(f"\n{'checkpoint':<36} {'prefill tok/s':>14} {'decode ms/tok':>14} {'vs bf16':>8}  plan")
    for k, ts in times.items():
        dec = statistics.median(t[1] for t in ts)
        pre = statistics.median(t[0] for t in ts)
        plan = models[k].__dict__.get("_plan")
        desc = plan[2].describe() if plan and plan[2] is not None else "no plan"
        print(f"{k:<36} {args.prompt / pre:14.1f} {dec * 1e3:14.2f} {base / dec:7.2f}x  {desc}")


if __name__ == "__main__":
    main()
