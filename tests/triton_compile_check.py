"""Compile the Triton kernels for a GPU target without a GPU: the front end, the optimiser passes and
ptxas (shipped in the triton wheel) all run on CPU, so type or lowering errors that Triton's
interpreter cannot see show up here. Run in its own process, *without* TRITON_INTERPRET:

    python tests/triton_compile_check.py [--arch 90] [--all]

Prints one line per kernel variant and exits 1 on the first failure. The arguments are shaped like
the Qwen3-30B-A3B layer (D 2048, F 768, E 128) with the 16-byte alignment a real launch specialises
on, so the code is the code a launch would build; the prefill grouped GEMM must use wgmma (Hopper)
and asynchronous copies (software pipelining).
"""
from __future__ import annotations

import argparse
import os
import re
import sys
import time

if os.environ.get("TRITON_INTERPRET", "0") not in ("", "0"):
    sys.exit("triton_compile_check.py compiles real kernels: unset TRITON_INTERPRET")

import torch  # noqa: E402
import triton  # noqa: E402
from triton.backends.compiler import GPUTarget  # noqa: E402
from triton.compiler import ASTSource  # noqa: E402

sys.path.insert(0, os.path.join(os.path.dirname(__file__), ".."))
from dynamoe.ops.triton import grouped_gemm as G  # noqa: E402
from dynamoe.ops.triton import permute as P  # noqa: E402
from dynamoe.ops.triton import quant_gemm as Q  # noqa: E402
from dynamoe.ops.triton import routing as R  # noqa: E402

_TY = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32", torch.int64: "i64", torch.int32: "i32",
       torch.uint8: "u8"}


def compile_kernel(fn, args: list, consts: dict, arch: int, num_warps: int = 4, num_stages: int = 3):
    """What a launch with these arguments would compile: pointers and ints divisible by 16 get the
    divisibility hint, ints equal to 1 become constants (triton's own specialisation)."""
    consts, attrs, sig = dict(consts), {}, {}
    for i, (name, a) in enumerate(zip(fn.arg_names, args)):
        is_int = isinstance(a, int) and not isinstance(a, bool)
        if isinstance(a, torch.Tensor) or (is_int and a % 16 == 0):
            attrs[(i,)] = [["tt.divisibility", 16]]
        if is_int and a == 1:
            consts[name] = 1
        elif isinstance(a, torch.Tensor):
            sig[name] = "*" + _TY[a.dtype]
        elif is_int:
            sig[name] = "i32"
        else:
            sig[name] = "fp32"
    for name in consts:
        sig[name] = "constexpr"
    sig = {n: sig[n] for n in fn.arg_names}
    src = ASTSource(fn, sig, consts, attrs)
    return triton.compile(src, target=GPUTarget("cuda", arch, 32), options=dict(num_warps=num_warps, num_stages=num_stages))


def cases(full: bool):
    bf, f32 = torch.empty(1, dtype=torch.bfloat16), torch.empty(1)
    i64, i32, u8 = torch.empty(1, dtype=torch.int64), torch.empty(1, dtype=torch.int32), torch.empty(1, dtype=torch.uint8)
    D, F_, E = 2048, 768, 128
    yield "softmax_topk", R._softmax_topk_kernel, [bf, f32, i64, f32, 7, E, E], \
        dict(K=8, KP=8, MODE=0, WRITE_PROBS=False, BLOCK_T=32, BLOCK_E=E), {}
    n_group = 8 if full else 4  # the compile time grows with the groups (unrolled)
    yield f"sigmoid_group_topk {n_group} groups", R._sigmoid_group_topk_kernel, [bf, f32, f32, i64, f32, 7, 256, 256, 2.5, 256 // n_group], \
        dict(K=8, KP=8, HAS_BIAS=True, N_GROUP=n_group, TOPK_GROUP=n_group // 2, LIMIT_GROUPS=True, TOP2=True, RENORM=True,
             WRITE_SCORES=False, BLOCK_T=16, BLOCK_E=256, BLOCK_G=n_group), {}
    yield "permute hist", P._hist_kernel, [i64, i32, 7, 9, 8, 1, E], dict(BLOCK_A=64, BLOCK_E=E), {}
    yield "permute scan", P._scan_kernel, [i32, i32, 9, E], dict(BLOCK_B=256, BLOCK_EC=16), {}
    yield "permute scatter", P._scatter_kernel, [i64, i32, i32, i32, f32, i64, i64, i64, i64, f32, i64, i64, 7, 9, 8, 1, E, 5], \
        dict(SINGLE=False, HAS_W=True, PADDED=True, BLOCK_A=64, BLOCK_E=E), {}
    yield "gather_rows", P._gather_rows_kernel, [bf, i64, f32, bf, 7, D, D, D], dict(HAS_SCALE=True, BLOCK_N=4, BLOCK_D=1024), {}
    yield "combine", P._combine_kernel, [bf, i64, f32, bf, 7, D, D, D], dict(K=8, HAS_W=True, BLOCK_T=4, BLOCK_O=1024), {}
    for label, rows, swiglu, want in (("decode", 8, False, ("mma",)), ("prefill swiglu", 300, True, ("wgmma", "cp.async"))):
        cfg = dict(G.pick_config(rows, 2 * F_, swiglu))
        launch = dict(num_warps=cfg.pop("num_warps"), num_stages=cfg.pop("num_stages"))
        # x [N, D], w [E, 2F, D] read as [E, D, 2F] (trans_w): strides (2F*D, 1, D)
        yield f"grouped_gemm {label}", G._grouped_gemm_kernel, \
            [bf, bf, bf, f32, i64, i32, bf, E, E, F_ if swiglu else 2 * F_, D, F_, 99, D, 1, 2 * F_ * D, 1, D, 2 * F_, F_],\
            dict(HAS_BIAS=False, HAS_SCALE=True, GATHER=True, SWIGLU=swiglu, UPCAST=False, IEEE=False, BLOCK_G=E, **cfg), \
            dict(launch, want=want)
    for fmt, name in ((0, "fp8"), (1, "mxfp4"), (2, "nvfp4")):
        cfg = dict(G.pick_config(8, 2 * F_))
        launch = dict(num_warps=cfg.pop("num_warps"), num_stages=cfg.pop("num_stages"))
        ih, group = D // 2, (16 if fmt == 1 else 8)
        q_row = D if fmt == 0 else ih
        s_row = D // 128 if fmt == 0 else ih // group
        yield f"quant_gemm {name} decode", Q._quant_gemm_kernel, \
            [bf, u8, f32 if fmt == 0 else u8, f32, bf, f32, i64, i32, bf, E, E, F_, D, ih, F_, 99, 128, 128,
             D, 1, 2 * F_ * q_row, q_row, 2 * F_ * s_row if fmt else 12 * s_row, s_row, 1, 2 * F_, F_], \
            dict(FORMAT=fmt, E8M0=False, SCALE_ROW=True, GROUP_H=group, HAS_BIAS=False, HAS_SCALE=True, GATHER=True,
                 SWIGLU=True, UPCAST=False, IEEE=False, BLOCK_G=E, **cfg), dict(launch, want=("cp.async",))


def main(argv=None) -> int:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--arch", type=int, default=90, help="CUDA compute capability x10 (90 = Hopper)")
    p.add_argument("--all", action="store_true", help="DeepSeek's 8 expert groups too (slower to compile)")
    args = p.parse_args(argv)
    for label, fn, kargs, consts, launch in cases(args.all):
        launch = dict(launch)
        want = launch.pop("want", ())
        t0 = time.perf_counter()
        try:
            k = compile_kernel(fn, kargs, consts, args.arch, **launch)
        except Exception as e:  # noqa: BLE001 - report which kernel and why
            print(f"FAIL {label}: {type(e).__name__}: {e}")
            return 1
        ptx = k.asm["ptx"]
        missing = [w for w in want if not re.search(re.escape(w), ptx)] if args.arch >= 90 else []
        print(f"{'ok  ' if not missing else 'FAIL'} {label}: sm_{args.arch}, {k.metadata.shared} B shared, "
              f"{time.perf_counter() - t0:.1f} s" + (f"; PTX lacks {missing}" if missing else ""))
        if missing:
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
