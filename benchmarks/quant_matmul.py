"""Decode-shaped MoE expert compute with packed weights against bf16, on CPU.

The same MoE layer (E=64 SwiGLU experts, k=8, D=1024, F=512) with bf16 experts and with FP8
(blockwise), MXFP4, NVFP4 and INT4 (group 32) experts (dynamoe.quant.QuantizedExperts), at T = 1, 2, 4, 8 tokens.
Every round draws fresh tokens, so the active experts -- and their weights -- change (cold reads);
the methods run interleaved, after warm-up, and the medians are reported with the bytes of expert
weights each step reads (distinct active experts x their packed size).

    python benchmarks/quant_matmul.py [--rounds 31] [--tokens 1 2 4 8]
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
from dynamoe.ops import cpu_kernels  # noqa: E402

E, K, D, F = 64, 8, 1024, 512
FORMATS = ["fp8_block", "mxfp4", "nvfp4", "int4"]


def build():
    torch.manual_seed(0)
    base = MoELayer(MoEConfig(model_dim=D, gates=[GateConfig(k=K, capacity_factor=0.0)], aux_loss="none",
                              experts=ExpertConfig(type="glu", num_experts_per_device=E, hidden_size_per_expert=F)))
    layers = {"bf16": copy.deepcopy(base).to(torch.bfloat16)}
    for fmt in FORMATS:
        q = copy.deepcopy(base).to(torch.bfloat16)
        quant.quantize_experts_(q, fmt)
        layers[fmt] = q
    # inference, as a served model runs: decode batches take the fused kernels (training mode, which
    # earlier versions of this script measured by mistake, runs the general per-expert path)
    return {name: layer.eval() for name, layer in layers.items()}


def expert_bytes(layer) -> float:
    """Bytes of one expert's weights as stored."""
    ex = layer.experts
    if hasattr(ex, "w1"):
        return (ex.w1.nbytes + ex.w2.nbytes) / E
    return (ex.gate_up_proj.numel() + ex.down_proj.numel()) * ex.gate_up_proj.element_size() / E


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--rounds", type=int, default=31)
    p.add_argument("--warmup", type=int, default=5)
    p.add_argument("--tokens", type=int, nargs="+", default=[1, 2, 4, 8])
    args = p.parse_args(argv)
    if args.rounds < 1 or any(t < 1 for t in args.tokens):
        p.error("--rounds and --tokens must be positive")
    kernels = cpu_kernels.load()
    print(f"# torch {torch.__version__}, {torch.get_num_threads()} threads; packed-weight kernels: "
          f"{'built' + (' (AVX-512)' if kernels.has_avx512() else ' (scalar)') if kernels else 'unavailable (dequantize-then-matmul)'}")
    layers = build()
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
