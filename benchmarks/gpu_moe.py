"""MoE layer on one GPU: the Triton fast paths (dynamoe.ops.triton) against the torch reference path
and a per-expert loop, measured against the machine's own ceilings. Meant for an H200 in one short
run (< 5 minutes, most of it Triton compiling and weight init).

    python benchmarks/gpu_moe.py                 # both layers, T = 1 8 64 4096 16384, bf16
    python benchmarks/gpu_moe.py --layers qwen3 --tokens 1 4096
    python benchmarks/gpu_moe.py --dry-run       # CPU: tiny shapes through the Triton interpreter

What runs, in this order:
1. Ceilings: bf16 matmul TFLOP/s at 8192^3 (torch.mm), device-to-device copy GB/s (read + write).
2. Correctness on the real shapes, first: the Triton routing ids against torch's, the fused
   pipeline's output against an fp32 per-expert reference (T = 64), every packed format's grouped
   GEMM against its dequantized reference on a few experts. A failure stops the run (exit 1).
3. Per layer and T (bf16, inference, dropless):
   - "fused": the all-Triton pipeline, no host synchronisation: routing kernel -> sort by expert ->
     grouped GEMM 1 (rows gathered from x, SwiGLU fused) -> grouped GEMM 2 (gate weight fused) ->
     combine; time split into routing (incl. the router matmul) / permute / GEMMs / combine (the
     shared expert, a dense torch MLP, is timed apart and left out of the overhead and bandwidth);
   - "layer": dynamoe.moe.MoELayer.forward with the Triton paths selected (routing, expert slots,
     grouped_mm; the plan still synchronises once for its counts);
   - "torch": the same layer with DYNAMOE_NO_TRITON=1 (torch routing, torch._grouped_mm);
   - "loop": a transformers-style per-expert loop;
   the shared expert (DeepSeek) is included in all four.
4. Weight-only FP8 (128x128 blocks) / MXFP4 / NVFP4 decode at T <= 8: the two expert GEMMs with
   packed weights against bf16 (same routing), from a cold L2.
5. Targets, each reached / not reached: GEMMs >= 70 % of the matmul ceiling at T >= 4096;
   routing + permute + combine <= 20 % on top of the GEMMs at T >= 4096; at T <= 64 the routed
   experts (fused total) read their active weights at >= 60 % of the copy bandwidth; FP8 decode
   >= 1.6x and FP4 decode >= 2.5x faster than bf16.
Times are medians over repetitions, each from a cold L2 (a 512 MiB buffer is rewritten before it).
"""
from __future__ import annotations

import argparse
import os
import statistics
import sys
import time

DRY_RUN = "--dry-run" in sys.argv
if DRY_RUN:  # triton.jit reads it when triton and the kernel modules are imported: before any import
    os.environ["TRITON_INTERPRET"] = "1"

import torch  # noqa: E402
import torch.nn.functional as F  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from dynamoe.moe import ExpertConfig, GateConfig, MoEConfig, MoELayer  # noqa: E402

# name: D, F, E, k, n_group, topk_group, shared experts, route scale
LAYERS = {
    "qwen3": dict(D=2048, F=768, E=128, k=8, n_group=1, topk_group=1, shared=0, scale=1.0),     # Qwen3-30B-A3B
    "deepseek": dict(D=7168, F=2048, E=256, k=8, n_group=8, topk_group=4, shared=1, scale=2.5),  # DeepSeek-V3
}
TINY = {  # --dry-run
    "qwen3": dict(D=64, F=32, E=16, k=4, n_group=1, topk_group=1, shared=0, scale=1.0),
    "deepseek": dict(D=64, F=32, E=16, k=4, n_group=4, topk_group=2, shared=1, scale=2.5),
}
FORMATS = ("fp8", "mxfp4", "nvfp4")


# ---------------------------------------------------------------------------------------------------
# timing


class Clock:
    """Median times of a callable (ms); CUDA events on a GPU, each run after rewriting a buffer larger
    than the L2 (cold weights), or wall time on CPU."""

    def __init__(self, device: str, reps: int):
        self.cuda = device == "cuda"
        self.reps = reps
        self.flush_buf = torch.empty(512 * 2**20, dtype=torch.int8, device=device) if self.cuda else None

    def flush(self):
        if self.cuda:
            self.flush_buf.zero_()

    def stages(self, fn, n_marks: int) -> list[float]:
        """fn(mark) calls mark() n_marks - 1 times between its stages; medians of each stage (ms)."""
        per = [[] for _ in range(n_marks - 1)]
        fn(lambda: None)  # warm-up (compiles)
        for _ in range(self.reps):
            self.flush()
            marks = []
            if self.cuda:
                def mark():
                    ev = torch.cuda.Event(enable_timing=True)
                    ev.record()
                    marks.append(ev)
            else:
                def mark():
                    marks.append(time.perf_counter())
            mark()
            fn(mark)
            mark()
            if self.cuda:
                torch.cuda.synchronize()
                ts = [a.elapsed_time(b) for a, b in zip(marks, marks[1:])]
            else:
                ts = [(b - a) * 1e3 for a, b in zip(marks, marks[1:])]
            if len(ts) != n_marks - 1:
                raise RuntimeError(f"expected {n_marks - 1} stages, got {len(ts)}")
            for i, t in enumerate(ts):
                per[i].append(t)
        return [statistics.median(p) for p in per]

    def time(self, fn) -> float:
        return self.stages(lambda mark: fn(), 2)[0]


def ceilings(device: str, clock: Clock, dry: bool) -> tuple[float, float]:
    """(bf16 matmul TFLOP/s at n^3, copy GB/s counting read + write)."""
    n = 512 if dry else 8192
    a = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    b = torch.randn(n, n, device=device, dtype=torch.bfloat16)
    t_mm = min(clock.time(lambda: torch.mm(a, b)) for _ in range(2))
    size = (64 if dry else 2048) * 2**20
    src = torch.empty(size, dtype=torch.int8, device=device).fill_(1)
    dst = torch.empty_like(src)
    t_cp = min(clock.time(lambda: dst.copy_(src)) for _ in range(2))
    return 2 * n**3 / t_mm / 1e9, 2 * size / t_cp / 1e6


# ---------------------------------------------------------------------------------------------------
# the layer and the four ways to run it


def build_layer(spec: dict, device: str) -> MoELayer:
    gate = GateConfig(type="sigmoid" if spec["n_group"] > 1 else "top", k=spec["k"], capacity_factor=0.0,
                      n_group=spec["n_group"], topk_group=spec["topk_group"], route_scale=spec["scale"],
                      normalize=True)
    experts = ExpertConfig(type="glu", num_experts_per_device=spec["E"], hidden_size_per_expert=spec["F"],
                           num_shared_experts=spec["shared"])
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(model_dim=spec["D"], gates=[gate], experts=experts, aux_loss="none",
                               check_finite=False, dtype=torch.bfloat16, device=device)).eval()
    bias = getattr(layer.gates[0], "e_score_correction_bias", None)
    if bias is not None:
        bias.normal_(0, 0.02)  # a trained-looking selection bias, so it matters
    return layer


def route_torch(layer, spec, x):
    from dynamoe.ops import routing
    logits = F.linear(x, layer.gates[0].wg.weight)
    if spec["n_group"] > 1:
        w, ids, _ = routing.sigmoid_group_topk(logits, spec["k"], layer.gates[0].e_score_correction_bias,
                                               spec["n_group"], spec["topk_group"], True, spec["scale"])
    else:
        w, ids, _ = routing.softmax_topk(logits, spec["k"], True, need_probs=False)
    return w, ids


def fused(layer, spec, x, mark=lambda: None, fmt_weights=None):
    """The all-Triton pipeline; mark() between routing | permute | GEMMs | combine | shared expert."""
    from dynamoe.ops.triton import grouped_gemm as tg
    from dynamoe.ops.triton import permute as tp
    from dynamoe.ops.triton import routing as tr
    ex, E = layer.experts, spec["E"]
    logits = F.linear(x, layer.gates[0].wg.weight)
    if spec["n_group"] > 1:
        w, ids, _ = tr.sigmoid_group_topk(logits, spec["k"], layer.gates[0].e_score_correction_bias, spec["n_group"],
                                          spec["topk_group"], True, spec["scale"], need_scores=False)
    else:
        w, ids, _ = tr.softmax_topk(logits, spec["k"], True, need_probs=False)
    mark()
    s = tp.sort_by_expert(ids, E, w)
    mark()
    if fmt_weights is None:
        h = tg.grouped_gemm(x, ex.gate_up_proj, s.offsets_E1, trans_w=True, gather=s.token_N, swiglu=True)
        y = tg.grouped_gemm(h, ex.down_proj, s.offsets_E1, trans_w=True, row_scale=s.weight_N)
    else:
        w1, w2 = fmt_weights
        h = quant_call(w1, x, s.offsets_E1, gather=s.token_N, swiglu=True)
        y = quant_call(w2, h, s.offsets_E1, row_scale=s.weight_N)
    mark()
    out = tp.combine(y, s.rows_TK)
    mark()
    if layer.shared_experts is not None:
        out = out + layer.shared_experts(x)
    return out


def layer_forward(layer, x, triton_on: bool):
    old = os.environ.get("DYNAMOE_NO_TRITON")
    if triton_on:
        os.environ.pop("DYNAMOE_NO_TRITON", None)
    else:
        os.environ["DYNAMOE_NO_TRITON"] = "1"
    try:
        return layer(x)
    finally:
        if old is None:
            os.environ.pop("DYNAMOE_NO_TRITON", None)
        else:
            os.environ["DYNAMOE_NO_TRITON"] = old


def per_expert_loop(layer, spec, x):
    """transformers-style: route, then for every hit expert gather its tokens, GLU, index_add."""
    w, ids = _no_triton(route_torch, layer, spec, x)
    ex, Fh = layer.experts, spec["F"]
    out = torch.zeros_like(x)
    hit = torch.bincount(ids.flatten(), minlength=spec["E"]).nonzero().flatten().tolist()
    for e in hit:
        tok, choice = torch.where(ids == e)
        gu = x[tok] @ ex.gate_up_proj[e].t()
        h = F.silu(gu[:, :Fh]) * gu[:, Fh:]
        out.index_add_(0, tok, (h @ ex.down_proj[e].t()) * w[tok, choice, None].to(x.dtype))
    if layer.shared_experts is not None:
        out = out + layer.shared_experts(x)
    return out


def reference_fp32(layer, spec, x, w, ids):
    """fp32 per-expert reference for given routing."""
    ex, Fh = layer.experts, spec["F"]
    out = torch.zeros(x.shape, dtype=torch.float32, device=x.device)
    xf = x.float()
    for e in torch.unique(ids).tolist():
        tok, choice = torch.where(ids == e)
        gu = xf[tok] @ ex.gate_up_proj[e].float().t()
        h = F.silu(gu[:, :Fh]) * gu[:, Fh:]
        out.index_add_(0, tok, (h @ ex.down_proj[e].float().t()) * w[tok, choice, None].float())
    if layer.shared_experts is not None:
        out = out + layer.shared_experts(x).float()
    return out


# ---------------------------------------------------------------------------------------------------
# packed weights


def quant_call(qw, x, offsets, **kw):
    from dynamoe.ops.triton import quant_gemm as tq
    fmt, t = qw
    if fmt == "fp8":
        return tq.fp8_block_gemm(x, t["q"], t["s"], offsets, (128, 128), False, **kw)
    if fmt == "mxfp4":
        return tq.mxfp4_gemm(x, t["p"], t["s"], offsets, **kw)
    return tq.nvfp4_gemm(x, t["p"], t["s"], t["s2"], offsets, **kw)


def random_packed(fmt: str, E: int, O: int, I: int, device: str):
    """Packed weights with random but finite contents (speed does not depend on the values)."""
    g = dict(device=device)
    if fmt == "fp8":
        q = torch.randint(0, 0x7F, (E, O, I), dtype=torch.uint8, **g) | (torch.randint(0, 2, (E, O, I), dtype=torch.uint8, **g) << 7)
        s = torch.rand(E, -(-O // 128), -(-I // 128), **g) * 1e-3
        return fmt, dict(q=q, s=s)
    p = torch.randint(0, 256, (E, O, I // 2), dtype=torch.uint8, **g)
    if fmt == "mxfp4":
        return fmt, dict(p=p, s=torch.randint(118, 124, (E, O, I // 32), dtype=torch.uint8, **g))
    s = torch.randint(0x28, 0x40, (E, O, I // 16), dtype=torch.uint8, **g)
    return fmt, dict(p=p, s=s, s2=torch.rand(E, **g) * 1e-3)


def packed_from(qweight) -> tuple:
    """(fmt, tensors) of a dynamoe.quant QuantizedWeight, for quant_call."""
    from dynamoe.quant import BlockFP8Weight, MXFP4Weight
    if isinstance(qweight, BlockFP8Weight):
        return "fp8", dict(q=qweight.weight, s=qweight.weight_scale_inv)
    if isinstance(qweight, MXFP4Weight):
        return "mxfp4", dict(p=qweight.blocks, s=qweight.scales)
    return "nvfp4", dict(p=qweight.weight, s=qweight.weight_scale, s2=qweight.weight_scale_2)


# ---------------------------------------------------------------------------------------------------
# checks


def check(name: str, ok: bool, detail: str, failures: list):
    print(f"  {'ok  ' if ok else 'FAIL'} {name}: {detail}")
    if not ok:
        failures.append(name)


def correctness(name, layer, spec, device, failures, T):
    from dynamoe import quant
    from dynamoe.ops.triton import grouped_gemm as tg
    from dynamoe.ops.triton import routing as tr
    torch.manual_seed(1)
    x = torch.randn(T, spec["D"], device=device, dtype=torch.bfloat16)
    with torch.inference_mode():
        w_ref, ids_ref = _no_triton(route_torch, layer, spec, x)
        logits = F.linear(x, layer.gates[0].wg.weight)
        if spec["n_group"] > 1:
            w, ids, _ = tr.sigmoid_group_topk(logits, spec["k"], layer.gates[0].e_score_correction_bias,
                                              spec["n_group"], spec["topk_group"], True, spec["scale"])
        else:
            w, ids, _ = tr.softmax_topk(logits, spec["k"], True)
        same = (ids.sort(1).values == ids_ref.sort(1).values).all(1).float().mean().item()
        check(f"{name} routing ids", same >= 0.99, f"{same:.4f} of tokens choose the same experts", failures)
        y = fused(layer, spec, x)
        want = reference_fp32(layer, spec, x, w, ids)
        err = ((y.float() - want).norm() / want.norm()).item()
        check(f"{name} fused layer", err < 2e-2, f"relative error {err:.2e} vs fp32 per-expert reference", failures)
        y_layer = layer_forward(layer, x, True)
        err = ((y_layer.float() - want).norm() / want.norm()).item()
        check(f"{name} MoELayer (Triton path)", err < 2e-2, f"relative error {err:.2e}", failures)
        # packed formats on 4 experts of the real shapes, 16 rows each
        E4, rows = 4, 16
        w1 = layer.experts.gate_up_proj[:E4]
        counts = [rows] * E4
        off = tg.offsets_from_counts(counts, device)
        xr = torch.randn(E4 * rows, spec["D"], device=device, dtype=torch.bfloat16)
        for fmt, qname in (("fp8", "fp8_block"), ("mxfp4", "mxfp4"), ("nvfp4", "nvfp4")):
            qw = quant.quantize(w1, qname)
            got = quant_call(packed_from(qw), xr, off).float()
            dq = qw.dequantize(torch.bfloat16).float()
            ref = torch.cat([xr[e * rows:(e + 1) * rows].float() @ dq[e].t() for e in range(E4)])
            err = ((got - ref).norm() / ref.norm()).item()
            check(f"{name} {fmt} grouped GEMM", err < 1e-2, f"relative error {err:.2e} vs dequantized reference", failures)


def _no_triton(fn, *args):
    os.environ["DYNAMOE_NO_TRITON"] = "1"
    try:
        return fn(*args)
    finally:
        os.environ.pop("DYNAMOE_NO_TRITON", None)


# ---------------------------------------------------------------------------------------------------
# measurements


def measure_layer(name, layer, spec, device, clock, tokens, peak_tflops, copy_gbs, rows_out, targets):
    D, Fh, k = spec["D"], spec["F"], spec["k"]
    expert_bytes = 3 * D * Fh * 2
    for T in tokens:
        torch.manual_seed(T)
        x = torch.randn(T, D, device=device, dtype=torch.bfloat16)
        with torch.inference_mode():
            stages = clock.stages(lambda mark: fused(layer, spec, x, mark), 6)
            t_layer = clock.time(lambda: layer_forward(layer, x, True))
            t_torch = clock.time(lambda: layer_forward(layer, x, False))
            t_loop = clock.time(lambda: per_expert_loop(layer, spec, x))
            _, ids = route_torch(layer, spec, x)
            active = int(torch.unique(ids).numel())
        t_route, t_perm, t_gemm, t_comb, t_shared = stages
        total = sum(stages)
        routed = total - t_shared
        flops = 2 * T * k * 3 * D * Fh
        gemm_tflops = flops / t_gemm / 1e9
        overhead = (t_route + t_perm + t_comb) / t_gemm
        read_gbs = active * expert_bytes / routed / 1e6
        rows_out.append((name, T, total, t_layer, t_torch, t_loop, t_route, t_perm, t_gemm, t_comb, gemm_tflops,
                         overhead, active, read_gbs))
        if T >= 4096:
            targets.append((f"{name} T={T}: GEMMs >= 70% of matmul ceiling",
                            gemm_tflops >= 0.7 * peak_tflops, f"{gemm_tflops:.0f} / {peak_tflops:.0f} TFLOP/s = {gemm_tflops / peak_tflops:.0%}"))
            targets.append((f"{name} T={T}: routing+permute+combine <= 20% extra",
                            overhead <= 0.2, f"{overhead:.0%} of the GEMM time"))
        if T <= 64:
            targets.append((f"{name} T={T}: active weights read at >= 60% of copy bandwidth",
                            read_gbs >= 0.6 * copy_gbs, f"{read_gbs:.0f} / {copy_gbs:.0f} GB/s = {read_gbs / copy_gbs:.0%} "
                                                        f"({active} experts, {active * expert_bytes / 1e6:.0f} MB)"))


def measure_quant(name, layer, spec, device, clock, tokens, rows_out, targets, dry):
    from dynamoe.ops.triton import grouped_gemm as tg
    from dynamoe.ops.triton import permute as tp
    D, Fh, E = spec["D"], spec["F"], spec["E"]
    packed = {}
    for fmt in FORMATS:
        packed[fmt] = (random_packed(fmt, E, 2 * Fh, D, device), random_packed(fmt, E, D, Fh, device))
    ex = layer.experts
    for T in [t for t in tokens if t <= 8]:
        torch.manual_seed(T)
        x = torch.randn(T, D, device=device, dtype=torch.bfloat16)
        with torch.inference_mode():
            w, ids = route_torch(layer, spec, x)
            s = tp.sort_by_expert(ids, E, w)

            def bf16():
                h = tg.grouped_gemm(x, ex.gate_up_proj, s.offsets_E1, trans_w=True, gather=s.token_N, swiglu=True)
                return tg.grouped_gemm(h, ex.down_proj, s.offsets_E1, trans_w=True, row_scale=s.weight_N)

            def packed_run(fmt):
                w1, w2 = packed[fmt]
                h = quant_call(w1, x, s.offsets_E1, gather=s.token_N, swiglu=True)
                return quant_call(w2, h, s.offsets_E1, row_scale=s.weight_N)

            t_bf16 = clock.time(bf16)
            times = {fmt: clock.time(lambda f=fmt: packed_run(f)) for fmt in FORMATS}
        rows_out.append((name, T, t_bf16, *(times[f] for f in FORMATS)))
        for fmt in FORMATS:
            need = 1.6 if fmt == "fp8" else 2.5
            speed = t_bf16 / times[fmt]
            targets.append((f"{name} T={T}: {fmt} decode >= {need}x bf16", speed >= need, f"{speed:.2f}x"))


def main(argv=None):
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--layers", nargs="+", choices=list(LAYERS), default=list(LAYERS))
    p.add_argument("--tokens", type=int, nargs="+", default=None)
    p.add_argument("--reps", type=int, default=None, help="repetitions per measurement (median)")
    p.add_argument("--dry-run", action="store_true", help="CPU, tiny shapes, Triton interpreter: checks the code paths")
    args = p.parse_args(argv)
    dry = args.dry_run
    if not dry and not torch.cuda.is_available():
        print("benchmarks/gpu_moe.py needs a CUDA device (none found); `--dry-run` runs tiny shapes on CPU "
              "through the Triton interpreter instead", file=sys.stderr)
        return 2
    try:
        import triton
    except ImportError:
        print("benchmarks/gpu_moe.py needs triton (pip install 'dynamoe[gpu]')", file=sys.stderr)
        return 2
    device = "cpu" if dry else "cuda"
    tokens = args.tokens or ([1, 8, 64] if dry else [1, 8, 64, 4096, 16384])
    reps = args.reps or (1 if dry else 10)
    specs = TINY if dry else LAYERS
    t_start = time.perf_counter()
    dev_name = torch.cuda.get_device_name() if not dry else "CPU (Triton interpreter: timings meaningless)"
    print(f"# {dev_name}; torch {torch.__version__}, triton {triton.__version__}; bf16, inference, dropless; "
          f"{reps} reps, medians")
    clock = Clock(device, reps)
    peak, copy_gbs = ceilings(device, clock, dry)
    print(f"ceilings: bf16 matmul {peak:.0f} TFLOP/s ({512 if dry else 8192}^3), device copy {copy_gbs:.0f} GB/s (read + write)")

    failures, targets, rows, qrows = [], [], [], []
    for name in args.layers:
        spec = specs[name]
        print(f"\n## {name}: D {spec['D']}, F {spec['F']}, E {spec['E']}, k {spec['k']}, groups "
              f"{spec['n_group']}/{spec['topk_group']}, shared {spec['shared']}   [{time.perf_counter() - t_start:.0f} s]")
        layer = build_layer(spec, device)
        correctness(name, layer, spec, device, failures, T=64)
        if failures:
            print(f"\ncorrectness failed ({', '.join(failures)}): no timings", file=sys.stderr)
            return 1
        measure_layer(name, layer, spec, device, clock, tokens, peak, copy_gbs, rows, targets)
        measure_quant(name, layer, spec, device, clock, tokens, qrows, targets, dry)
        del layer
        if device == "cuda":
            torch.cuda.empty_cache()

    print("\n## layer forward (ms): fused = all-Triton pipeline; layer = MoELayer with Triton; torch = "
          "MoELayer with DYNAMOE_NO_TRITON=1; loop = per-expert loop")
    hdr = ("layer", "T", "fused", "layer", "torch", "loop", "route", "permute", "GEMMs", "combine", "GEMM TF/s",
           "extra", "experts", "read GB/s")
    print(" | ".join(f"{h:>9}" for h in hdr))
    for r in rows:
        name, T, *vals = r
        cells = [f"{name:>9}", f"{T:>9}"] + [f"{v:9.3f}" for v in vals[:8]] + [f"{vals[8]:9.0f}", f"{vals[9]:9.0%}",
                                                                                f"{vals[10]:9d}", f"{vals[11]:9.0f}"]
        print(" | ".join(cells))
    if qrows:
        print("\n## expert GEMMs at decode, packed weights (ms, two GEMMs; weight-only, tiles decoded in registers)")
        print(" | ".join(f"{h:>9}" for h in ("layer", "T", "bf16") + FORMATS))
        for name, T, *vals in qrows:
            print(" | ".join([f"{name:>9}", f"{T:>9}"] + [f"{v:9.3f}" for v in vals]))
    print("\n## targets")
    for what, ok, detail in targets:
        print(f"  {'reached    ' if ok else 'NOT reached'}  {what}: {detail}")
    print(f"\n# done in {time.perf_counter() - t_start:.0f} s")
    return 0


if __name__ == "__main__":
    sys.exit(main())
