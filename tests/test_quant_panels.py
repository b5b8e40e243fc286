"""Quantized prefill on decoded panels (csrc/panel_decode.h, dynamoe.quant.matmul.panel_gemm): the grouped bf16 GEMM
with a packed b decodes each panel of 64 output features from the packed bytes as it goes. Pinned: bit for bit the
same GEMM over pack_weight(dense(w)) -- every format, widths and heights off every grid, groups that reuse an expert
(g % E), bias, NaN and tiny scales --; the entry points (quantized_grouped_mm, quantized_linear) send their large
bf16 groups there and the small ones to the decode kernels, within bf16 rounding of a float64 reference; bad
arguments are refused by name."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamoe.ops import cpu_kernels
from dynamoe.quant import BlockFP8Weight, INT4Weight, MXFP4Weight, NVFP4Weight, quantized_grouped_mm, quantized_linear
from dynamoe.quant.dequantize import dense, packed_codes
from dynamoe.quant.matmul import panel_gemm

K = cpu_kernels.load()
pytestmark = pytest.mark.skipif(K is None or not K.has_grouped_gemm_bf16(),
                                reason="the grouped bf16 GEMM needs AVX512-BF16 and the CPU kernels")
LIMIT = cpu_kernels.MAX_ROWS

FORMATS = {
    "mxfp4": (32, lambda w: MXFP4Weight.quantize(w)),
    "nvfp4": (16, lambda w: NVFP4Weight.quantize(w)),
    "fp8_128": (1, lambda w: BlockFP8Weight.quantize(w)),
    "fp8_16x32": (1, lambda w: BlockFP8Weight.quantize(w, block=(16, 32))),
    "fp8_ue8m0": (1, lambda w: BlockFP8Weight.quantize(w, block=(128, 128), scale_fmt="ue8m0")),
    "int4_g32": (1, lambda w: INT4Weight.quantize(w, group_size=32)),
    "int4_g128": (1, lambda w: INT4Weight.quantize(w, group_size=128)),
    "int4_g16": (1, lambda w: INT4Weight.quantize(w, group_size=16)),
}


def _weight(fmt, shape, seed):
    g = torch.Generator().manual_seed(seed)
    w = torch.randn(*shape, generator=g) * torch.rand(*shape[:-1], 1, generator=g) * 3
    return FORMATS[fmt][1](w)


def _gemm(x, w, counts, bias=None, packed=True):
    """grouped_rows_gemm of the rows over w [E, O, I], from the packed bytes or from pack_weight(dense(w))."""
    args = K.RowsGemm()
    args.a, args.cols, args.counts = x, w.shape[-2], counts
    if packed:
        args.packed_b = packed_codes(w)
    else:
        args.b = K.pack_weight(dense(w, torch.bfloat16), False)
    if bias is not None:
        args.bias = bias
    args.out = torch.full((x.size(0), w.shape[-2]), 7.0, dtype=torch.bfloat16)
    K.grouped_rows_gemm(args=args)
    return args.out


def _same(a, b):
    torch.testing.assert_close(a, b, rtol=0, atol=0, equal_nan=True)


@pytest.mark.parametrize("fmt", sorted(FORMATS))
@pytest.mark.parametrize("E,O,I,counts", [(2, 64, 64, [5, 0, 40, 3]), (3, 70, 96, [1, 33, 0, 2, 2, 70]),
                                          (1, 17, 320, [23]), (2, 130, 160, [97, 130])])
def test_equals_the_gemm_over_dense(fmt, E, O, I, counts):
    """Groups g use expert g % E; bias per expert; columns past O and panels past the last zero padded."""
    w = _weight(fmt, (E, O, I), 1)
    x = torch.randn(sum(counts), I).bfloat16()
    bias = torch.randn(E, O).bfloat16()
    _same(_gemm(x, w, counts, bias), _gemm(x, w, counts, bias, packed=False))
    _same(_gemm(x, w, counts), _gemm(x, w, counts, packed=False))


@settings(max_examples=25, deadline=None)
@given(E=st.integers(1, 3), O=st.integers(1, 150), groups=st.integers(1, 5), tail=st.integers(0, 31),
       rows=st.lists(st.integers(0, 40), min_size=1, max_size=6), seed=st.integers(0, 999),
       fmt=st.sampled_from(sorted(FORMATS)))
def test_property_any_shape(E, O, groups, tail, rows, seed, fmt):
    """Heights and widths off every grid the formats allow (INT4 and FP8 take any width: odd K included)."""
    step = FORMATS[fmt][0]
    I = 32 * groups + (tail if step == 1 else tail // step * step)
    counts = (rows * E)[:E * max(1, len(rows) // E)]
    w = _weight(fmt, (E, O, I), seed)
    x = torch.randn(sum(counts), I).bfloat16()
    _same(_gemm(x, w, counts), _gemm(x, w, counts, packed=False))


def test_nan_and_tiny_scales():
    """An e8m0 NaN scale makes its 32 values NaN in both; scales near the bottom of fp32's range (denormal
    products) decode as dense() rounds them."""
    w = MXFP4Weight.quantize(torch.randn(2, 80, 128))
    w.scales[0, 3, 1] = 255
    w.scales[1, 7, :] = 1    # 2^-126: products below fp32's normal range
    w.scales[1, 9, 2] = 20   # 2^-107: bf16-representable tiny values
    x = torch.randn(40, 128).bfloat16()
    got = _gemm(x, w, [20, 20])
    _same(got, _gemm(x, w, [20, 20], packed=False))
    assert got[:20, 3].isnan().all() and not got[:20, :3].isnan().any()


@pytest.mark.parametrize("fmt", ["mxfp4", "int4_g32", "nvfp4"])
def test_scales_across_the_whole_range(fmt):
    """Scales from the bottom of fp32's range to the top: power-of-two ones (the integer path: the table's bf16
    words with the scale's exponent added), those whose products would leave the normal range (the checked path:
    denormals, infinities), NaN -- mixed within 16-row blocks -- all as dense() rounds them."""
    g = torch.Generator().manual_seed(6)
    w = _weight(fmt, (2, 80, 96), 6)
    if fmt == "mxfp4":
        w.scales.copy_(torch.randint(0, 256, w.scales.shape, generator=g, dtype=torch.uint8))
    elif fmt == "nvfp4":
        w.weight_scale_2 = torch.tensor([2.0 ** -120, 2.0 ** 100])
    else:
        j = torch.randint(-134, 128, w.weight_scale.shape, generator=g).float()
        w.weight_scale = torch.exp2(j).to(w.weight_scale.dtype)
    x = torch.randn(40, 96).bfloat16()
    _same(_gemm(x, w, [20, 20]), _gemm(x, w, [20, 20], packed=False))


def _reference(x, w, counts):
    """float64 rows x dequantize()^T per group (g % E)."""
    E, out, off = w.shape[0], [], 0
    for g, c in enumerate(counts):
        out.append(x[off:off + c].double() @ w[g % E].dequantize(torch.float32).double().t())
        off += c
    return torch.cat(out)


def _close(y, ref):
    torch.testing.assert_close(y.double(), ref, atol=2e-2 * ref.abs().max().item(), rtol=1e-2)


@pytest.mark.parametrize("fmt", ["mxfp4", "nvfp4", "fp8_16x32", "int4_g32"])
def test_entry_points_send_large_groups_here(fmt, monkeypatch):
    """quantized_grouped_mm: groups above the decode kernels' limit through the panels (no dense copy of any
    weight), the others through the decode kernels (their rows exactly those of packed_gemv); quantized_linear
    likewise above the limit. Both within bf16 rounding of the float64 product."""
    w = _weight(fmt, (3, 96, 128), 2)
    counts = [LIMIT + 1, 0, 3, 40, LIMIT, 0]
    x = torch.randn(sum(counts), 128).bfloat16()
    dense_calls, panel_calls = [], []
    real_dq, real_gemm = K.dequantize, K.grouped_rows_gemm
    monkeypatch.setattr(K, "dequantize", lambda **kw: (dense_calls.append(1), real_dq(**kw))[1])
    monkeypatch.setattr(K, "grouped_rows_gemm", lambda **kw: (panel_calls.append(list(kw["args"].counts)),
                                                              real_gemm(**kw))[1])
    y = quantized_grouped_mm(x, w, counts)
    assert not dense_calls and panel_calls == [[LIMIT + 1, 0, 0, 40, 0, 0]], panel_calls
    _close(y, _reference(x, w, counts))
    small = quantized_grouped_mm(x[LIMIT + 1:LIMIT + 4], w, [0, 0, 3])
    _same(y[LIMIT + 1:LIMIT + 4], small)
    panel_calls.clear()
    _close(quantized_linear(x[:40], w[1]), _reference(x[:40], w, [0, 40]))
    assert panel_calls == [[40]] and not dense_calls


def test_other_dtypes_and_autograd_keep_the_dense_path():
    w = _weight("mxfp4", (2, 64, 64), 3)
    x = torch.randn(40, 64)
    assert panel_gemm(x, w, [20, 20]) is None                        # fp32
    xb = x.bfloat16().requires_grad_()
    assert panel_gemm(xb, w, [20, 20]) is None                       # autograd
    y = quantized_grouped_mm(xb, w, [20, 20])
    y.float().sum().backward()
    assert xb.grad is not None and xb.grad.shape == xb.shape


def test_refuses_bad_arguments_by_name():
    w = _weight("mxfp4", (1, 64, 64), 4)
    x = torch.randn(20, 64).bfloat16()
    args = K.RowsGemm()
    args.a, args.cols, args.counts, args.packed_b = x, 64, [20], packed_codes(w)
    args.out = torch.empty(20, 64, dtype=torch.bfloat16)
    args.epilogue = K.GemmEpilogue.SCATTER_ADD
    args.out_index = torch.arange(20)
    with pytest.raises(RuntimeError, match="packed b takes the store epilogue only"):
        K.grouped_rows_gemm(args=args)
    args.epilogue, args.out_index = K.GemmEpilogue.STORE, None
    bad = packed_codes(w)
    bad.bits = 3
    args.packed_b = bad
    with pytest.raises(RuntimeError, match="packed_b.bits must be 4 or 8"):
        K.grouped_rows_gemm(args=args)
    bad = packed_codes(w)
    bad.scales = bad.scales[:, :10].contiguous()
    args.packed_b = bad
    with pytest.raises(RuntimeError, match="packed_b.scales must be"):
        K.grouped_rows_gemm(args=args)
    args.packed_b, args.counts = packed_codes(_weight("mxfp4", (2, 64, 64), 4)), [10, 5, 5]
    with pytest.raises(RuntimeError, match="not a multiple of the 2 weights"):
        K.grouped_rows_gemm(args=args)
