"""routed_ffn (the grouped bf16 GEMM kernels) against a plain fp32 loop and against the torch path,
forward and gradients; and MoELayer picking it on CPU in bf16."""
import os

import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamoe.moe import ExpertConfig, GateConfig, MoEConfig, MoELayer
from dynamoe.ops import grouped_mm
from dynamoe.ops import routed_ffn as rf

KERNELS = rf._kernels()
pytestmark = pytest.mark.skipif(KERNELS is None, reason="the grouped bf16 GEMM needs AVX512-BF16 and the CPU kernels")
bf16 = torch.bfloat16
#: both kernel paths where this CPU has AMX tiles (else the dot-product path alone)
PATHS = [True, False] if KERNELS is not None and KERNELS.has_grouped_gemm_amx() else [False]


@pytest.fixture(params=PATHS, ids=lambda amx: "amx" if amx else "dot")
def path(request, monkeypatch):
    monkeypatch.setattr(rf, "USE_AMX", request.param)
    return request.param


def _problem(T, D, Fh, O, counts, bias, seed=0):
    g = torch.Generator().manual_seed(seed)
    E, N = len(counts), sum(counts)
    x = torch.randn(T, D, generator=g).to(bf16)
    token = torch.randint(0, T, (N,), generator=g)
    s = torch.rand(N, generator=g)
    w1 = (torch.randn(E, Fh, D, generator=g) / D ** 0.5).to(bf16)
    w2 = (torch.randn(E, Fh, O, generator=g) / Fh ** 0.5).to(bf16)
    b1 = torch.randn(E, Fh, generator=g).to(bf16) if bias else None
    b2 = torch.randn(E, O, generator=g).to(bf16) if bias else None
    return x, token, s, w1, b1, w2, b2


def _torch_path(x, token, s, counts, w1, b1, w2, b2):
    """What the layer runs without the kernels: gather, two grouped matmuls, ReLU, row scale, index_add."""
    h = F.relu(grouped_mm(x.index_select(0, token), w1, counts, b1, trans_w=True))
    y = grouped_mm(h, w2, counts, b2, row_scale=s)
    return torch.zeros(x.size(0), y.size(1), dtype=y.dtype).index_add_(0, token, y)


def _grads(fn, leaves, g, *args):
    for t in leaves:
        t.grad = None
    y = fn(*args)
    y.backward(g.to(y.dtype))
    return y.detach(), [t.grad.clone() for t in leaves]


def _rel(a, b):
    return ((a.float() - b.float()).abs().max() / b.float().abs().max().clamp_min(1e-6)).item()


def _close(a, b, rtol, atol):
    """max |a - b| <= rtol * max |b| + atol."""
    return float((a.float() - b.float()).abs().max()) <= rtol * float(b.float().abs().max()) + atol


def _check(T, D, Fh, O, counts, bias, seed=0):
    x, token, s, w1, b1, w2, b2 = _problem(T, D, Fh, O, counts, bias, seed)
    leaves = [t for t in (x, s, w1, b1, w2, b2) if t is not None]
    for t in leaves:
        t.requires_grad_()
    g = torch.randn(T, O, generator=torch.Generator().manual_seed(seed + 1))

    def ours(*a):
        return rf.routed_ffn(a[0], token, a[1], counts, a[2], a[3], a[4], a[5], KERNELS)

    y, got = _grads(ours, leaves, g, x, s, w1, b1, w2, b2)
    y_t, want_t = _grads(lambda *a: _torch_path(a[0], token, a[1], counts, *a[2:]), leaves, g, x, s, w1, b1, w2, b2)
    ref_leaves = [t.detach().float().requires_grad_() for t in leaves]
    it = iter(ref_leaves)
    xr, sr, w1r = next(it), next(it), next(it)
    b1r = next(it) if bias else None
    w2r = next(it)
    b2r = next(it) if bias else None
    y_r, want_r = _grads(lambda: rf.routed_ffn_reference(xr, token, sr, counts, w1r, b1r, w2r, b2r), ref_leaves, g)
    # same rounding points as the torch path: about one bf16 ulp apart; the fp32 loop a few -- plus an absolute
    # floor of bf16 rounding at these O(1) inputs: where ReLU cancels nearly everything (an output or gradient
    # of 1e-3 from terms of 1e-1) the bf16 paths agree with each other but not to 3 % with fp32 (hypothesis finds it)
    assert _rel(y, y_t) < 2e-2 and _close(y, y_r, 3e-2, 2e-3)
    for a, b, c in zip(got, want_t, want_r):
        assert a.shape == c.shape and a.dtype == b.dtype
        assert _rel(a, b) < 3e-2 and _close(a, c, 5e-2, 1e-2)
    idle = [e for e, c in enumerate(counts) if c == 0]
    if idle:  # experts without rows: zero gradients, not garbage
        assert got[2][idle].abs().sum() == 0 and got[3 if not bias else 4][idle].abs().sum() == 0


@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("shape", [(16, 64, 64, 64), (37, 96, 80, 48), (20, 33, 70, 17), (300, 256, 128, 256)])
@pytest.mark.parametrize("counts", [[5, 0, 11], [1, 19, 0, 0, 30], [64, 0, 7]])
def test_matches_reference_and_torch_path(bias, shape, counts, path):
    T, D, Fh, O = shape
    _check(T, D, Fh, O, counts, bias)


@pytest.mark.parametrize("amx", PATHS)
@settings(max_examples=25, deadline=None)
@given(counts=st.lists(st.integers(0, 40), min_size=1, max_size=6).filter(lambda c: sum(c) > 0),
       D=st.integers(1, 70), Fh=st.integers(1, 70), O=st.integers(1, 70), bias=st.booleans(), seed=st.integers(0, 99))
def test_ragged_counts_property(counts, D, Fh, O, bias, seed, amx):
    """Any ragged counts (empty experts, odd K, widths off the 16/64 grid): same as the references."""
    previous, rf.USE_AMX = rf.USE_AMX, amx  # (hypothesis reruns the body: no function-scoped fixture)
    try:
        _check(9, D, Fh, O, counts, bias, seed)
    finally:
        rf.USE_AMX = previous


def test_amx_runs_where_the_cpu_has_it():
    """Under make test (kernels required) a CPU that reports AMX-BF16 must get the tile path: a build
    without it, or a refused tile permission, fails here instead of the AMX cases quietly dropping out."""
    from dynamoe.ops import cpu_kernels
    flags = open("/proc/cpuinfo").read().split() if os.path.exists("/proc/cpuinfo") else []
    if not (cpu_kernels.required() and "amx_bf16" in flags and "amx_tile" in flags):
        pytest.skip("no AMX-BF16 on this CPU, or the kernels are not required (DYNAMOE_REQUIRE_CPU_KERNELS unset)")
    assert KERNELS.has_grouped_gemm_amx(), "this CPU has AMX-BF16 but the grouped GEMM kernels cannot use it"


def test_amx_and_dot_products_agree_on_layer_sized_work():
    """K and row counts off the tile grid (K % 32, rows % 16, a k tail in the weight gradient): the
    two kernel paths within bf16 rounding of each other."""
    if len(PATHS) < 2:
        pytest.skip("this CPU has no AMX tiles: one kernel path")
    outs, previous = [], rf.USE_AMX
    for amx in PATHS:
        rf.USE_AMX = amx
        try:
            x, token, s, w1, b1, w2, b2 = _problem(200, 100, 72, 136, [70, 0, 129, 33], True, seed=3)
            leaves = [x, s, w1, b1, w2, b2]
            for t in leaves:
                t.requires_grad_()
            y = rf.routed_ffn(x, token, s, [70, 0, 129, 33], w1, b1, w2, b2, KERNELS)
            y.float().pow(2).sum().backward()
            outs.append([y.detach()] + [t.grad for t in leaves])
        finally:
            rf.USE_AMX = previous
    for a, b in zip(*outs):
        assert _rel(a, b) < 2e-2


@pytest.mark.parametrize("K", [33, 48, 80, 100, 130, 300, 600])
@pytest.mark.parametrize("counts", [[5], [20, 0, 16], [40, 3], [301]])
def test_k_tails_of_the_tile_path_are_zero_padded(K, counts, path):
    """A K that is not a multiple of 32 makes the tile path copy its last k pairs into a zero-padded tail
    tile, and weight-gradient groups of rows off the 32 grid do the same along their k: those copies are
    read only by tile loads, which the compiler does not see as memory reads (GCC's _tile_loadd), so a
    missing barrier let it drop them -- NaNs or garbage in outputs and gradients. Finite and equal to fp32;
    also where k runs in several blocks (K 300 and 600, a group of 301 rows: the C tiles carried between them)."""
    _check(24, K, K + 16, K, counts, bias=True, seed=K)
    x, token, s, w1, b1, w2, b2 = _problem(24, K, K + 16, K, counts, True, seed=K)
    leaves = [x, s, w1, b1, w2, b2]
    for t in leaves:
        t.requires_grad_()
    rf.routed_ffn(x, token, s, counts, w1, b1, w2, b2, KERNELS).float().sum().backward()
    assert all(bool(t.grad.isfinite().all()) for t in leaves)


def test_repacks_after_an_in_place_weight_update():
    counts = [20, 12]
    x, token, s, w1, b1, w2, b2 = _problem(16, 32, 32, 32, counts, False)
    y0 = rf.routed_ffn(x, token, s, counts, w1, None, w2, None, KERNELS)
    with torch.no_grad():
        w2.mul_(2)  # (an optimizer step: same tensor, new version)
    y1 = rf.routed_ffn(x, token, s, counts, w1, None, w2, None, KERNELS)
    torch.testing.assert_close(y1, _torch_path(x, token, s, counts, w1, None, w2, None), atol=3e-2, rtol=2e-2)
    assert _rel(y1, 2 * y0) < 2e-2


def test_applies_only_where_it_pays():
    w1, w2 = torch.zeros(4, 8, 16, dtype=bf16), torch.zeros(4, 8, 16, dtype=bf16)
    x = torch.zeros(64, 16, dtype=bf16)
    assert rf.routed_ffn_kernels(x, w1, w2, (None, None), F.relu, [16, 16, 0, 32]) is KERNELS
    assert rf.routed_ffn_kernels(x, w1, w2, (None, None), F.relu, [2, 3, 1, 2]) is None  # decode size
    assert rf.routed_ffn_kernels(x.float(), w1.float(), w2.float(), (None, None), F.relu, [16] * 4) is None
    assert rf.routed_ffn_kernels(x, w1, w2, (None, None), F.gelu, [16] * 4) is None
    assert rf.routed_ffn_kernels(x, w1, w2, (None, None), F.relu, [8] * 8) is None  # k*E groups


def test_errors_name_the_argument():
    x, token, s, w1, b1, w2, b2 = _problem(8, 16, 16, 16, [16, 16], False)
    with pytest.raises(ValueError, match="token_N"):
        rf.routed_ffn(x, token[:5], s, [16, 16], w1, None, w2, None, KERNELS)
    with pytest.raises(ValueError, match="weight_N"):
        rf.routed_ffn(x, token, s[:5], [16, 16], w1, None, w2, None, KERNELS)


def _layer(bias, seed=0):
    torch.manual_seed(seed)
    return MoELayer(MoEConfig(model_dim=64, gates=[GateConfig(k=2, capacity_factor=0.0)], aux_loss="none",
                              experts=ExpertConfig(num_experts_per_device=4, hidden_size_per_expert=96,
                                                   has_fc1_bias=bias, has_fc2_bias=bias))).to(bf16)


@pytest.mark.parametrize("capacity_factor", [0.0, 1.0])
@pytest.mark.parametrize("bias", [False, True])
def test_layer_uses_the_kernels_and_agrees_with_the_torch_path(monkeypatch, capacity_factor, bias, path):
    layer = _layer(bias)
    x = torch.randn(128, 64, dtype=bf16)
    calls = []
    real = rf.routed_ffn

    def spy(*a, **kw):
        calls.append(1)
        return real(*a, **kw)

    import dynamoe.moe.experts as experts_mod
    monkeypatch.setattr(experts_mod, "routed_ffn", spy)

    def run():
        xg = x.clone().requires_grad_()
        layer.zero_grad(set_to_none=True)
        y = layer(xg, capacity_factor=capacity_factor)
        y.float().pow(2).sum().backward()
        return y.detach(), [xg.grad] + [p.grad.clone() for p in layer.parameters()]

    y, grads = run()
    assert calls, "MoELayer did not run the routed_ffn kernels on CPU in bf16"
    monkeypatch.setattr(experts_mod, "routed_ffn_kernels", lambda *a, **kw: None)
    y_t, grads_t = run()
    assert len(calls) == 1
    assert _rel(y, y_t) < 2e-2
    for a, b in zip(grads, grads_t):
        assert _rel(a, b) < 5e-2
    with torch.no_grad():  # inference (scratch hidden rows) gives the training forward's values
        torch.testing.assert_close(layer(x, capacity_factor=capacity_factor), y, atol=0, rtol=0)
