"""The Triton kernels (dynamoe.ops.triton) against the plain references they replace.

On CPU the kernels run under Triton's interpreter on CPU tensors. ``triton.jit`` reads
TRITON_INTERPRET when it decorates: when triton itself is first imported (its library functions,
tl.sum and the like) and when a kernel module is imported. So this module sets it before its first
``import triton`` -- nothing in dynamoe imports triton on CPU -- imports the kernel modules
(re-importing any imported compiled), then puts the variable back; an autouse fixture sets it again
during each test of this module only (triton also reads it while launching). If triton was imported
compiled earlier in the same process the module skips and says so. With a CUDA device the compiled
kernels run on it instead (DYNAMOE_TEST_TRITON_INTERPRET=1 forces the interpreter there too).

Interpreter caveats the tolerances allow for: fp32 -> bf16 casts truncate (the GPU rounds to
nearest even), and half-precision ``tl.dot`` is wrong there, so the launchers feed it fp32 tiles.
fp32 activations are compared tightly: the decoded weights are exact.
"""
import importlib
import importlib.util
import itertools
import os
import subprocess
import sys

import pytest
import torch
import torch.nn.functional as F

if importlib.util.find_spec("triton") is None:  # pragma: no cover - depends on the install
    pytest.skip("triton is not installed (pip install 'dynamoe[gpu]', Linux x86-64 only): the Triton kernels "
                "are not tested here", allow_module_level=True)

from dynamoe import ops  # noqa: E402  (none of these imports triton)
from dynamoe.moe.dispatch import build_plan, combine_padded, combine_ragged, dispatch_padded, dispatch_ragged  # noqa: E402
from dynamoe.ops.grouped_matmul import grouped_mm_reference  # noqa: E402
from dynamoe.quant import BlockFP8Weight, MXFP4Weight, NVFP4Weight, quantized_grouped_mm  # noqa: E402

INTERPRET = not torch.cuda.is_available() or os.environ.get("DYNAMOE_TEST_TRITON_INTERPRET") == "1"
DEV = "cpu" if INTERPRET else "cuda"
_KERNEL_MODULES = ["routing", "permute", "grouped_gemm", "quant_gemm"]  # in dependency order


def _interpreted_triton() -> bool:
    """Whether the imported triton decorated its own library functions (tl.sum, ...) for the interpreter."""
    from triton.language import standard
    from triton.runtime.interpreter import InterpretedFunction
    return any(isinstance(v, InterpretedFunction) for v in vars(standard).values())


def _import_kernels():
    """Import triton and the kernel modules with TRITON_INTERPRET=1 when interpreting, then restore it.
    triton's own library functions are decorated when triton is first imported: if that already
    happened without the interpreter in this process, the kernels cannot run on CPU here."""
    if INTERPRET and "triton" in sys.modules and not _interpreted_triton():
        why = ("triton was imported (compiled mode) before this module could set TRITON_INTERPRET=1 (a test module "
               "imported at collection imports it): import that lazily, or run tests/test_triton_kernels.py alone")
        if os.environ.get("DYNAMOE_REQUIRE_CPU_KERNELS") == "1":  # `make test`: the kernels must be tested, not skipped
            raise RuntimeError(why)
        pytest.skip(why, allow_module_level=True)
    saved = os.environ.get("TRITON_INTERPRET")
    if INTERPRET:
        os.environ["TRITON_INTERPRET"] = "1"
    try:
        import triton  # noqa: F401
        from dynamoe.ops.triton import interpreted
        mods = {}
        for name in _KERNEL_MODULES:
            full = f"dynamoe.ops.triton.{name}"
            mod = sys.modules.get(full)
            mod = importlib.import_module(full) if mod is None else mod
            kernel = next(v for k, v in vars(mod).items() if k.startswith("_") and k.endswith("_kernel"))
            if INTERPRET and not interpreted(kernel):
                mod = importlib.reload(mod)  # imported compiled earlier in this process
            mods[name] = mod
        return mods
    finally:
        if saved is None:
            os.environ.pop("TRITON_INTERPRET", None)
        else:
            os.environ["TRITON_INTERPRET"] = saved


K = _import_kernels()


@pytest.fixture(autouse=True)
def _interpret_env(monkeypatch):
    """triton also reads TRITON_INTERPRET while launching (modules it imports lazily): set during each test."""
    if INTERPRET:
        monkeypatch.setenv("TRITON_INTERPRET", "1")
TR, TP, TG, TQ = K["routing"], K["permute"], K["grouped_gemm"], K["quant_gemm"]


def _dev(*ts):
    return [t.to(DEV) if isinstance(t, torch.Tensor) else t for t in ts]


def _close_half(got, want, rel=2e-2):
    """bf16/fp16 outputs: a couple of ulps of the largest magnitude."""
    got, want = got.float().cpu(), want.float().cpu()
    torch.testing.assert_close(got, want, rtol=rel, atol=rel * max(float(want.abs().max()), 1.0))


# --------------------------------------------------------------------------------------------------
# selection


def test_use_triton_is_false_on_cpu_and_when_disabled(monkeypatch):
    from dynamoe.ops.triton import use_triton
    assert not use_triton(torch.zeros(2))
    assert not use_triton()
    if torch.cuda.is_available():
        x = torch.zeros(2, device="cuda")
        assert use_triton(x)
        monkeypatch.setenv("DYNAMOE_NO_TRITON", "1")
        assert not use_triton(x)


# --------------------------------------------------------------------------------------------------
# routing


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("E,k", [(8, 1), (8, 2), (20, 4)])
@pytest.mark.parametrize("renormalize", [True, False])
def test_softmax_topk_matches_reference(dtype, E, k, renormalize):
    logits = torch.randn(13, E).to(dtype)
    w, ids, probs = TR.softmax_topk(*_dev(logits), k, renormalize)
    w_ref, ids_ref, probs_ref = ops.softmax_topk_reference(logits, k, renormalize)
    assert w.dtype == torch.float32 and ids.dtype == torch.int64
    assert torch.equal(ids.cpu(), ids_ref)
    torch.testing.assert_close(w.cpu(), w_ref)
    torch.testing.assert_close(probs.cpu(), probs_ref)


def test_softmax_topk_without_probs_and_empty_batch():
    w, ids, probs = TR.softmax_topk(*_dev(torch.randn(5, 8)), 2, True, need_probs=False)
    assert probs is None and w.shape == (5, 2)
    w, ids, probs = TR.softmax_topk(*_dev(torch.randn(0, 8)), 2, True)
    assert w.shape == (0, 2) and ids.shape == (0, 2) and probs.shape == (0, 8)


def test_softmax_topk_ties_go_to_the_lowest_index():
    logits = torch.randint(0, 3, (16, 12)).float()  # many equal logits
    w, ids, _ = TR.softmax_topk(*_dev(logits), 4, True)
    ids = ids.cpu()
    vals = logits.gather(1, ids)
    assert torch.equal(vals, logits.topk(4).values)                 # a valid top-k ...
    for t in range(16):                                             # ... best first, ties by index
        order = sorted(range(12), key=lambda e: (-float(logits[t, e]), e))[:4]
        assert ids[t].tolist() == order
    torch.testing.assert_close(w.cpu(), torch.softmax(vals, -1))


def test_normalized_topk_matches_tutel_op():
    probs = torch.softmax(torch.randn(6, 64), -1)
    w, ids = TR.normalized_topk(*_dev(probs), 8)
    w_ref, ids_ref = ops.qwen3_moe_scaled_topk(probs, top_k=8)
    assert torch.equal(ids.cpu(), ids_ref)
    torch.testing.assert_close(w.cpu(), w_ref)


SIGMOID_CASES = [  # E, n_group, topk_group, k
    (16, 4, 2, 4),    # group-limited, top-2 group score
    (20, 4, 3, 3),    # group size 5: not a power of two
    (8, 8, 2, 2),     # groups of one expert: the group score is the expert's
    (16, 4, 4, 4),    # every group kept: no limiting
    (12, 1, 1, 2),    # no groups (GLM / Kimi style)
]


@pytest.mark.parametrize("E,n_group,topk_group,k", SIGMOID_CASES)
@pytest.mark.parametrize("bias", [True, False])
def test_sigmoid_group_topk_matches_reference(E, n_group, topk_group, k, bias):
    logits = torch.randn(11, E)
    b = torch.randn(E) * 0.3 if bias else None
    for renormalize, scale in ((True, 2.5), (False, 1.0)):
        x, bd = _dev(logits, b)
        w, ids, scores = TR.sigmoid_group_topk(x, k, bd, n_group, topk_group, renormalize, scale)
        w_ref, ids_ref, scores_ref = ops.sigmoid_group_topk(logits, k, b, n_group, topk_group, renormalize, scale)
        assert torch.equal(ids.cpu(), ids_ref)
        torch.testing.assert_close(w.cpu(), w_ref)
        torch.testing.assert_close(scores.cpu(), scores_ref)


def _check_group_choice(logits, bias, ids, w, n_group, topk_group, k, scale):
    """ids must be *a* valid DeepSeek choice: kept groups rank at the top, experts rank at the top
    of the kept groups, weights = renormalised unbiased scores * scale (ties may go either way)."""
    T, E = logits.shape
    s = torch.sigmoid(logits)
    c = s + bias
    gs = E // n_group
    cg = c.view(T, n_group, gs)
    group_score = cg.topk(2, -1).values.sum(-1) if gs > 1 else cg.amax(-1)
    for t in range(T):
        chosen = ids[t].tolist()
        assert len(set(chosen)) == k

        def valid(kept):  # kept: a top-topk_group set of groups, chosen: a top-k of their experts
            gsc = group_score[t]
            if min(gsc[g] for g in kept) < max((gsc[g] for g in range(n_group) if g not in kept), default=-1e9):
                return False
            pool = [e for e in range(E) if e // gs in kept]
            rest = [float(c[t, e]) for e in pool if e not in chosen]
            return set(chosen) <= set(pool) and min(float(c[t, e]) for e in chosen) >= max(rest, default=-1e9)

        assert any(valid(set(kept)) for kept in itertools.combinations(range(n_group), topk_group))
        want = s[t, chosen] / s[t, chosen].sum() * scale
        torch.testing.assert_close(w[t], want)


def test_sigmoid_group_topk_with_ties():
    logits = torch.randint(-2, 3, (24, 16)).float()  # equal scores within and across groups
    bias = torch.zeros(16)
    x, b = _dev(logits, bias)
    w, ids, _ = TR.sigmoid_group_topk(x, 4, b, 4, 2, True, 2.5)
    _check_group_choice(logits, bias, ids.cpu(), w.cpu(), 4, 2, 4, 2.5)


# --------------------------------------------------------------------------------------------------
# permutation and combine

PERMUTE_CASES = [  # T, K, E
    (1, 2, 8),        # decode: most experts empty
    (13, 1, 5),       # k=1
    (50, 4, 20),      # E not a power of two
    (300, 2, 16),     # several blocks: the histogram + scan path
]


def _routing(T, K, E):
    ids = torch.stack([torch.randperm(E)[:K] for _ in range(T)]) if T else torch.zeros(0, K, dtype=torch.long)
    return ids, torch.rand(T, K)


@pytest.mark.parametrize("T,K,E", PERMUTE_CASES)
def test_sort_by_expert_matches_expert_slots_and_plan(T, K, E):
    ids, w = _routing(T, K, E)
    s = TP.sort_by_expert(*_dev(ids), E, *_dev(w))
    slots, load, order = ops.expert_slots(ids, E)
    plan = build_plan(ids, w, E, 0.0)
    assert torch.equal(s.slots_TK.cpu(), slots)
    assert torch.equal(s.counts_E.long().cpu(), load)
    assert torch.equal(s.order_N.cpu(), order)
    assert s.offsets_E1.tolist() == [0] + torch.cumsum(load, 0).tolist()
    assert torch.equal(s.token_N.cpu(), plan.token_N)
    assert torch.equal(s.weight_N.cpu(), plan.weight_N)
    x, y = torch.randn(T, 24), torch.randn(T * K, 24)
    assert torch.equal(TP.gather_rows(*_dev(x, s.token_N)).cpu(), dispatch_ragged(x, plan))
    torch.testing.assert_close(TP.gather_rows(*_dev(x, s.token_N, s.weight_N)).cpu(), dispatch_ragged(x, plan, prescale=True))
    torch.testing.assert_close(TP.combine(*_dev(y, s.rows_TK, w)).cpu(), combine_ragged(y, plan))
    torch.testing.assert_close(TP.combine(*_dev(y, s.rows_TK)).cpu(), combine_ragged(y, plan, postscore=False))


@pytest.mark.parametrize("T,K,E", PERMUTE_CASES[1:])
@pytest.mark.parametrize("capacity_factor", [0.5, 1.0])
def test_padded_capacity_layout_matches_plan(T, K, E, capacity_factor):
    ids, w = _routing(T, K, E)
    plan = build_plan(ids, w, E, capacity_factor)
    C = plan.capacity
    s = TP.sort_by_expert(*_dev(ids), E, *_dev(w), capacity=C)
    kept = s.padded_TK.cpu() >= 0
    assert int((~kept).sum()) == plan.num_dropped
    x = torch.randn(T, 16)
    x_ECD = TP.gather_rows(*_dev(x, s.padded_token_EC.reshape(-1))).view(E, C, 16)
    assert torch.equal(x_ECD.cpu(), dispatch_padded(x, plan))
    y = torch.randn(E, C, 16)
    torch.testing.assert_close(TP.combine(*_dev(y.view(E * C, 16), s.padded_TK, w)).cpu(), combine_padded(y, plan))


def test_sort_by_expert_empty():
    s = TP.sort_by_expert(torch.zeros(0, 2, dtype=torch.long, device=DEV), 4)
    assert s.counts_E.tolist() == [0] * 4 and s.offsets_E1.tolist() == [0] * 5 and s.order_N.numel() == 0


# --------------------------------------------------------------------------------------------------
# grouped GEMM

GEMM_COUNTS = [[3, 0, 17, 1], [0, 0, 0, 9], [2, 2, 2, 2, 0, 5, 1, 0]]  # empty groups, 2E groups (g % E)


@pytest.mark.parametrize("counts", GEMM_COUNTS)
@pytest.mark.parametrize("trans_w", [False, True])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_grouped_gemm_matches_reference(counts, trans_w, dtype):
    E, I, O = 4, 24, 40  # unaligned to the tiles: masked edges
    N = sum(counts)
    x = torch.randn(N, I).to(dtype)
    w = (torch.randn(E, O, I) if trans_w else torch.randn(E, I, O)).to(dtype)
    b, s = torch.randn(E, O).to(dtype), torch.rand(N)
    off = TG.offsets_from_counts(counts, DEV)
    y = TG.grouped_gemm(*_dev(x, w, off, b), trans_w, *_dev(s))
    y_ref = grouped_mm_reference(x.float(), w.float(), counts, b.float(), trans_w, s)
    assert y.dtype == dtype
    if dtype == torch.float32:
        torch.testing.assert_close(y.cpu(), y_ref, rtol=1e-5, atol=1e-5)
    else:
        _close_half(y, y_ref)


def test_grouped_gemm_gather_swiglu_and_out():
    counts, E, D, F_, T = [4, 0, 6], 3, 32, 24, 5
    x = torch.randn(T, D)
    tok = torch.randint(0, T, (10,))
    w, b = torch.randn(E, 2 * F_, D), torch.randn(E, 2 * F_)
    out = torch.empty(10, F_, device=DEV)
    y = TG.grouped_gemm(*_dev(x, w, TG.offsets_from_counts(counts, DEV), b), True, gather=tok.to(DEV), swiglu=True, out=out)
    assert y.data_ptr() == out.data_ptr()
    gu = grouped_mm_reference(x[tok], w, counts, b, True)
    torch.testing.assert_close(y.cpu(), F.silu(gu[:, :F_]) * gu[:, F_:], rtol=1e-5, atol=1e-5)


def test_grouped_gemm_no_rows():
    y = TG.grouped_gemm(*_dev(torch.randn(0, 8), torch.randn(2, 8, 4), TG.offsets_from_counts([0, 0], "cpu")))
    assert y.shape == (0, 4)


# --------------------------------------------------------------------------------------------------
# packed-weight grouped GEMM


def _quantized(fmt, w):
    if fmt == "fp8":        # partial edge blocks both ways, block columns not a multiple of the tile
        return BlockFP8Weight.quantize(w, block=(16, 24))
    if fmt == "fp8_ue8m0":  # block columns a multiple of the tile: one scale per row per step
        return BlockFP8Weight.quantize(w, block=(16, 32), scale_fmt="ue8m0")
    return MXFP4Weight.quantize(w) if fmt == "mxfp4" else NVFP4Weight.quantize(w)


def _quant_call(qw, x, off, **kw):
    if isinstance(qw, BlockFP8Weight):
        return TQ.fp8_block_gemm(x, qw.weight, qw.weight_scale_inv, off, qw.block, qw.scale_fmt == "ue8m0", **kw)
    if isinstance(qw, MXFP4Weight):
        return TQ.mxfp4_gemm(x, qw.blocks, qw.scales, off, **kw)
    return TQ.nvfp4_gemm(x, qw.weight, qw.weight_scale, qw.weight_scale_2, off, **kw)


QUANT_FORMATS = ["fp8", "fp8_ue8m0", "mxfp4", "nvfp4"]


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_quant_decode_is_exact(fmt):
    """fp32 identity rows pick out the decoded weight columns: they must equal dequantize()."""
    w = torch.randn(2, 40, 64)
    qw = _quantized(fmt, w)
    x = torch.eye(64)[:48].repeat(2, 1)[:64].contiguous()  # 64 rows: expert 0 gets 20, expert 1 44
    counts = [20, 44]
    y = _quant_call(qw.to(DEV), x.to(DEV), TG.offsets_from_counts(counts, DEV)).cpu()
    want = grouped_mm_reference(x, qw.dequantize(torch.float32), counts, trans_w=True)
    assert torch.equal(y, want)


@pytest.mark.parametrize("fmt", QUANT_FORMATS)
def test_quant_gemm_matches_quantized_grouped_mm(fmt):
    counts = [3, 0, 6, 0, 1, 2]  # 2E groups: group g uses expert g % 3
    E, O, I = 3, 40, 64
    N = sum(counts)
    qw = _quantized(fmt, torch.randn(E, O, I))
    x = torch.randn(N, I, dtype=torch.bfloat16)
    b, s = torch.randn(E, O, dtype=torch.bfloat16), torch.rand(N)
    y = _quant_call(qw.to(DEV), x.to(DEV), TG.offsets_from_counts(counts, DEV), bias=b.to(DEV), row_scale=s.to(DEV))
    want = grouped_mm_reference(x.float(), qw.dequantize(torch.bfloat16).float(), counts, b.float(), True, s)
    assert y.dtype == torch.bfloat16
    _close_half(y, want)


def test_quant_gemm_gather_and_swiglu():
    E, D, F_, T = 2, 64, 24, 4
    counts = [3, 4]
    qw = NVFP4Weight.quantize(torch.randn(E, 2 * F_, D))
    x = torch.randn(T, D)
    tok = torch.randint(0, T, (7,))
    y = _quant_call(qw.to(DEV), x.to(DEV), TG.offsets_from_counts(counts, DEV), gather=tok.to(DEV), swiglu=True).cpu()
    gu = grouped_mm_reference(x[tok], qw.dequantize(torch.float32), counts, trans_w=True)
    torch.testing.assert_close(y, F.silu(gu[:, :F_]) * gu[:, F_:], rtol=1e-5, atol=1e-5)


# --------------------------------------------------------------------------------------------------
# the wiring: the existing ops take the Triton path when use_triton() says so (forced here)


@pytest.fixture
def force_triton(monkeypatch):
    import dynamoe.ops.grouped_matmul as gm
    import dynamoe.ops.routing as rt
    import dynamoe.ops.slots as sl
    import dynamoe.quant.matmul as qm
    for mod in (gm, rt, sl, qm):
        monkeypatch.setattr(mod, "use_triton", lambda *ts: True)


def test_ops_take_the_triton_path_when_selected(force_triton):
    logits = torch.randn(9, 16).to(DEV)
    with torch.no_grad():
        w, ids, _ = ops.softmax_topk(logits, 2, True)
        w_ref, ids_ref, _ = ops.softmax_topk_reference(logits.cpu(), 2, True)
        assert torch.equal(ids.cpu(), ids_ref) and torch.allclose(w.cpu(), w_ref)
        w, ids = ops.deepseek_moe_sigmoid_scaled_topk(logits, torch.zeros(16, device=DEV), top_k=4, n_group=4, topk_group=2)
        assert w.shape == (9, 4)
        slots, load, order = ops.expert_slots(ids, 16)
        assert int(load.sum()) == 36 and load.dtype == torch.int64
        counts = load.tolist()
        x, wt = torch.randn(36, 8).to(DEV), torch.randn(16, 8, 6).to(DEV)
        torch.testing.assert_close(ops.grouped_mm(x, wt, counts).cpu(), grouped_mm_reference(x.cpu(), wt.cpu(), counts),
                                   rtol=1e-5, atol=1e-5)
        qw = MXFP4Weight.quantize(torch.randn(16, 6, 32))
        xq = torch.randn(36, 32).to(DEV)
        y = quantized_grouped_mm(xq, qw.to(DEV), counts)
        torch.testing.assert_close(y.cpu(), grouped_mm_reference(xq.cpu(), qw.dequantize(torch.float32), counts, trans_w=True),
                                   rtol=1e-5, atol=1e-5)
    # with autograd recording, the reference path runs (the kernels are forward-only)
    logits.requires_grad_(True)
    w, _, _ = ops.softmax_topk(logits, 2, True)
    assert w.grad_fn is not None


# --------------------------------------------------------------------------------------------------
# compiled for a GPU target, no GPU needed (the interpreter cannot see lowering errors)


def _compile_check(*flags):
    script = os.path.join(os.path.dirname(__file__), "triton_compile_check.py")
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    r = subprocess.run([sys.executable, script, *flags], env=env, capture_output=True, text=True, timeout=900)
    assert r.returncode == 0, r.stdout + r.stderr


def test_kernels_compile_for_hopper():
    """Every kernel compiles to sm_90 PTX/cubin (ptxas ships in the triton wheel); the prefill grouped
    GEMM uses wgmma and asynchronous copies. In a subprocess: this one imports triton interpreted."""
    _compile_check()


@pytest.mark.slow
def test_kernels_compile_for_hopper_deepseek_groups():
    _compile_check("--all")


# --------------------------------------------------------------------------------------------------
# bigger shapes (slow under the interpreter)


@pytest.mark.slow
def test_deepseek_v3_routing_shape():
    logits, bias = torch.randn(64, 256), torch.randn(256) * 0.1
    x, b = _dev(logits, bias)
    w, ids, _ = TR.sigmoid_group_topk(x, 8, b, 8, 4, True, 2.5)
    w_ref, ids_ref, _ = ops.sigmoid_group_topk(logits, 8, bias, 8, 4, True, 2.5)
    assert torch.equal(ids.cpu(), ids_ref)
    torch.testing.assert_close(w.cpu(), w_ref)


@pytest.mark.slow
def test_grouped_gemm_gpu_tile_config():
    """The tile sizes the GPU uses for prefill, run through the same code (bigger blocks)."""
    counts = [70, 0, 130, 3]
    x, w = torch.randn(203, 96), torch.randn(4, 80, 96)
    cfg = TG.pick_config(200.0, 80)
    y = TG.grouped_gemm(*_dev(x, w, TG.offsets_from_counts(counts, DEV)), trans_w=True, config=cfg)
    torch.testing.assert_close(y.cpu(), grouped_mm_reference(x, w, counts, trans_w=True), rtol=1e-4, atol=1e-4)
