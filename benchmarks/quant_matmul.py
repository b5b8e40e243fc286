"""Decode-shaped MoE expert compute with packed weights against bf16, on CPU.

The same MoE layer (E=64 SwiGLU experts, k=8, D=1024, F=512) with bf16 experts and with FP8
(blockwise), MXFP4, NVFP4 and INT4 (group 32) experts (dynamoe.quant.QuantizedExperts), at T = 1, 2, 4, 8 tokens.
Every round draws fresh tokens, so the active experts -- and their weights -- change (cold reads);
the methods run interleaved, after warm-up, and the medians are reported with the bytes of expert
weights each step reads (distinct active experts x their packed size).

``--kernels`` measures the kernels themselves, without the layer around them (router, Python):

* ``gemv``: one [O, I] = [1024, 1024] weight times x [T, 1024] (``dynamoe.quant.matmul.packed_gemv``, the bf16
  GEMV for bf16), each call on the next of a pool of distinct weights larger than the L3 cache (cold reads);
* ``moe``: the fused decode of the routed experts alone (``dynamoe.ops.moe_decode.packed_glu_decode`` /
  ``glu_decode``) on fixed random routings;
* ``read``: the machine's streaming read bandwidth (sum of a 1 GiB buffer), the floor both approach.

GB/s = packed bytes read / time. ``--act-quant int8`` adds the int8-activation kernels as extra rows.

``--prefill`` times prefill-sized grouped products instead: one projection of ``--experts`` experts of gpt-oss-20b's
shape ([5760, 2880], the gate/up projection) with ``--rows`` bf16 rows each, per format, through
``quantized_grouped_mm`` (the grouped GEMM over panels decoded on the fly, csrc/panel_decode.h), against the
path it replaces, written out here: each expert's dense bf16 copy (``dense``, the native dequantize) then
``torch.mm``; and the bf16 weights' ``torch.mm`` alone (no decoding: the floor). Interleaved rounds, medians.

    python benchmarks/quant_matmul.py [--rounds 31] [--tokens 1 2 4 8] [--kernels] [--act-quant int8]
    python benchmarks/quant_matmul.py --prefill [--rows 17 32 128] [--experts 4] [--rounds 7]
"""
from __future__ import annotations

import argparse
import copy
import os
import statistics
import sys
import time

import torch

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from dynamoe import quant  # noqa: E402
from dynamoe.moe import ExpertConfig, GateConfig, MoEConfig, MoELayer  # noqa: E402
from dynamoe.ops import cpu_kernels, moe_decode  # noqa: E402
from dynamoe.quant.dequantize import dense  # noqa: E402
from dynamoe.quant.matmul import packed_gemv, quantized_grouped_mm  # noqa: E402

E, K, D, F = 64, 8, 1024, 512
FORMATS = ["fp8_block", "mxfp4", "nvfp4", "int4"]
INT8_FORMATS = ["mxfp4", "nvfp4", "int4"]  # the formats with int8-activation kernels
POOL_BYTES = 96e6  # a GEMV's pool of distinct weights: about 3x the L3 cache, so every call reads cold


def build(act_quant=None):
    torch.manual_seed(0)
    base = MoELayer(MoEConfig(model_dim=D, gates=[GateConfig(k=K, capacity_factor=0.0)], aux_loss="none",
                              experts=ExpertConfig(type="glu", num_experts_per_device=E, hidden_size_per_expert=F)))
    layers = {"bf16": copy.deepcopy(base).to(torch.bfloat16)}
    for fmt in FORMATS:
        q = copy.deepcopy(base).to(torch.bfloat16)
        quant.quantize_experts_(q, fmt)
        layers[fmt] = q
        if act_quant and fmt in INT8_FORMATS:
            q = copy.deepcopy(base).to(torch.bfloat16)
            quant.quantize_experts_(q, fmt, act_quant=act_quant)
            layers[f"{fmt}/{act_quant}"] = q
    # inference, as a served model runs: decode batches take the fused kernels (training mode, which
    # earlier versions of this script measured by mistake, runs the general per-expert path)
    return {name: layer.eval() for name, layer in layers.items()}


def expert_bytes(layer) -> float:
    """Bytes of one expert's weights as stored."""
    ex = layer.experts
    if hasattr(ex, "w1"):
        return (ex.w1.nbytes + ex.w2.nbytes) / E
    return (ex.gate_up_proj.numel() + ex.down_proj.numel()) * ex.gate_up_proj.element_size() / E


def read_bandwidth() -> float:
    """GB/s of a streaming read (sum over a 1 GiB fp32 buffer), best of 5."""
    x = torch.ones(256 * 1024 * 1024)
    best = float("inf")
    for _ in range(5):
        t = time.perf_counter()
        x.sum()
        best = min(best, time.perf_counter() - t)
    return x.numel() * 4 / best / 1e9


def interleaved(fns: dict, rounds: int, warmup: int) -> dict:
    """Median ms per name, the names taking turns within every round."""
    names = list(fns)
    times = {n: [] for n in names}
    for r in range(rounds + warmup):
        for i in range(len(names)):
            n = names[(r + i) % len(names)]
            t0 = time.perf_counter()
            fns[n]()
            if r >= warmup:
                times[n].append((time.perf_counter() - t0) * 1e3)
    return {n: statistics.median(v) for n, v in times.items()}


def gemv_pools(act_quant):
    """name -> (list of weights [1024, 1024], bytes of one): bf16 tensors or QuantizedWeights, each pool
    about POOL_BYTES."""
    torch.manual_seed(1)
    pools = {}
    for name in ["bf16", *FORMATS]:
        fmt = name
        ws = []
        while sum(_nbytes(w) for w in ws) < POOL_BYTES:
            chunk = (torch.randn(8, D, D) * 0.02).to(torch.bfloat16)
            ws += list(chunk) if fmt == "bf16" else [quant.quantize(c, fmt) for c in chunk]
        pools[name] = ws
        if act_quant and fmt in INT8_FORMATS:
            pools[f"{fmt}/{act_quant}"] = ws
    return pools


def _nbytes(w) -> int:
    return w.numel() * w.element_size() if isinstance(w, torch.Tensor) else w.nbytes


def kernel_tables(args, kernels) -> None:
    print(f"# read bandwidth (1 GiB sum): {read_bandwidth():.1f} GB/s")
    pools = gemv_pools(args.act_quant)
    print(f"{'T':>3} {'kernel':6} {'format':16} {'ms':>8} {'MB read':>8} {'GB/s':>6} {'speed-up vs bf16':>17}")
    for T in args.tokens:
        x = torch.randn(T, D, dtype=torch.bfloat16)
        fns = {}
        for name, ws in pools.items():
            it = iter(range(1 << 62))
            if name == "bf16":
                out = torch.empty(T, D, dtype=torch.bfloat16)
                fns[name] = lambda ws=ws, it=it, out=out: kernels.bf16_gemv_out(x, ws[next(it) % len(ws)], None, out)
            else:
                aq = name.split("/")[1] if "/" in name else None
                kw = {"act_quant": aq} if aq else {}
                fns[name] = lambda ws=ws, it=it, kw=kw: packed_gemv(x, ws[next(it) % len(ws)], **kw)
        ms = interleaved(fns, args.rounds * 8, args.warmup * 8)
        for name in fns:
            mb = _nbytes(pools[name][0]) / 1e6
            print(f"{T:>3} {'gemv':6} {name:16} {ms[name]:8.3f} {mb:8.2f} {mb / ms[name]:6.2f} {ms['bf16'] / ms[name]:17.2f}",
                  flush=True)
    layers = build(args.act_quant)
    per_expert = {name: expert_bytes(layer) for name, layer in layers.items()}
    g = torch.Generator().manual_seed(2)
    for T in args.tokens:
        x = torch.randn(T, D, dtype=torch.bfloat16)
        routings = [torch.rand(T, E, generator=g).topk(K) for _ in range(64)]
        fns = {}
        for name, layer in layers.items():
            run = moe_decode.glu_decode if name == "bf16" else moe_decode.packed_glu_decode
            it = iter(range(1 << 62))

            def call(run=run, ex=layer.experts, it=it):
                w, ids = routings[next(it) % len(routings)]
                assert run(x, ids, w.softmax(-1), ex) is not None, "the fused decode kernel did not apply"
            fns[name] = call
        with torch.no_grad():
            ms = interleaved(fns, args.rounds, args.warmup)
        active = statistics.median(len(ids.unique()) for _, ids in routings)
        for name in fns:
            mb = active * per_expert[name] / 1e6
            print(f"{T:>3} {'moe':6} {name:16} {ms[name]:8.3f} {mb:8.2f} {mb / ms[name]:6.2f} {ms['bf16'] / ms[name]:17.2f}",
                  flush=True)


def prefill_table(args) -> None:
    """--prefill: the grouped products of the module docstring."""
    O, I = 5760, 2880
    torch.manual_seed(3)
    wf = torch.randn(args.experts, O, I) * 0.02
    weights = {fmt: quant.quantize(wf, fmt) for fmt in FORMATS}
    wb = wf.to(torch.bfloat16)
    print(f"# {args.experts} experts x [{O}, {I}]; ms per product; speed-up: the dense path's time / the panels'")
    print(f"{'rows/expert':>11} {'format':10} {'panels ms':>10} {'dense+mm ms':>12} {'speed-up':>9} {'bf16 mm ms':>11}")
    for rows in args.rows:
        counts = [rows] * args.experts
        x = torch.randn(rows * args.experts, I, dtype=torch.bfloat16)

        def floor():
            for e in range(args.experts):
                torch.mm(x[e * rows:(e + 1) * rows], wb[e].t())

        for fmt, w in weights.items():
            def via_dense(w=w):
                out = x.new_empty(x.size(0), O)
                for e in range(args.experts):
                    torch.mm(x[e * rows:(e + 1) * rows], dense(w[e], torch.bfloat16).t(), out=out[e * rows:(e + 1) * rows])
                return out

            def panels(w=w):
                return quantized_grouped_mm(x, w, counts)
            ms = interleaved({"panels": panels, "dense": via_dense, "floor": floor}, args.rounds, 2)
            print(f"{rows:>11} {fmt:10} {ms['panels']:10.1f} {ms['dense']:12.1f} {ms['dense'] / ms['panels']:8.2f}x "
                  f"{ms['floor']:11.1f}", flush=True)


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=31)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    p.add_argument("--kernels", action="store_true", help="time the kernels alone (GEMVs, fused MoE decode) instead")
    p.add_argument("--act-quant", choices=["int8"], default=None, help="also run the int8-activation kernels")
    p.add_argument("--prefill", action="store_true", help="time prefill-sized grouped products instead")
    p.add_argument("--rows", type=int, nargs="+", default=[17, 32, 128], help="--prefill: rows per expert")
    p.add_argument("--experts", type=int, default=4, help="--prefill: experts of one product")
    args = p.parse_args(argv)
    if args.rounds < 1 or any(t < 1 for t in args.tokens):
        p.error("--rounds and --tokens must be positive")
    kernels = cpu_kernels.load()
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads; packed-weight kernels: "
          f"{'built' + (' (AVX-512)' if kernels.has_avx512() else ' (scalar)') if kernels else 'unavailable (dequantize-then-matmul)'}")
    if args.prefill:
        if min(args.rows) < 1 or args.experts < 1:
            p.error("--rows and --experts must be positive")
        with torch.no_grad():
            prefill_table(args)
        return
    if args.kernels:
        with torch.no_grad():
            kernel_tables(args, kernels)
        return
    layers = build(args.act_quant)
    per_expert = {name: expert_bytes(layer) for name, layer in layers.items()}
    print(f"{'T':>3} {'format':10} {'ms':>8} {'MB read':>8} {'GB/s':>6} {'speed-up vs bf16':>17}")
    for T in args.tokens:
        xs = [torch.randn(T, D, dtype=torch.bfloat16) for _ in range(args.rounds + args.warmup)]
        names = list(layers)
        times = {n: [] for n in names}
        active = []
        with torch.no_grad():
            for r, x in enumerate(xs):
                for i in range(len(names)):
                    n = names[(r + i) % len(names)]
                    t0 = time.perf_counter()
                    y = layers[n](x)
                    dt = time.perf_counter() - t0
                    if r >= args.warmup:
                        times[n].append(dt * 1e3)
                if r >= args.warmup:
                    active.append(int((y.routing_stats.kept > 0).sum()))
        n_active = statistics.median(active)
        base = statistics.median(times["bf16"])
        for n in names:
            ms = statistics.median(times[n])
            mb = n_active * per_expert[n] / 1e6
            print(f"{T:>3} {n:10} {ms:8.3f} {mb:8.2f} {mb / ms:6.2f} {base / ms:17.2f}", flush=True)


if __name__ == "__main__":
    main()
