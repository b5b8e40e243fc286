"""The bf16-activation packed-weight kernels (csrc/packed_rows.h: fp4_row_bf16 / fp8_row_bf16 for one token,
fp4_row_wide / fp8_row_wide for several): the fused decode of packed GLU experts (packed_moe_glu_decode_out
with bf16_acts) and the packed GEMVs with bf16 x, against dequantize-then-matmul from the same bf16
activations; the fp32 path beside them."""

import pytest
import torch

from dynamoe import quant
from dynamoe.moe import ExpertConfig, GateConfig, MoEConfig, MoELayer
from dynamoe.ops import cpu_kernels, linear_decode, moe_decode
from dynamoe.ops.activations import glu_activation
from dynamoe.quant.matmul import packed_gemv

kernels = cpu_kernels.load()
needs_kernels = pytest.mark.skipif(kernels is None, reason="the CPU kernels could not be built here")
needs_bf16 = pytest.mark.skipif(kernels is None or not kernels.has_avx512_bf16(),
                                reason="the bf16 kernels need AVX512-BF16")

# (model dim, hidden size, options) per format: row lengths that end in a partial 128-weight step
# (FP4: 224 = 128 + 96, 96; FP8: 200 = 6 x 32 + 8 with 64-column scale blocks, 72 = 2 x 32 + 8)
# INT4: groups of 64 (two 32-element kernel groups each; 224 and 96 end in a partial group)
SHAPES = {"mxfp4": (224, 96, {}), "nvfp4": (224, 48, {}), "fp8_block": (200, 72, {"block": (32, 64)}),
          "int4": (224, 96, {"group_size": 64})}


def _experts(fmt, act="silu", bias=False, E=6, seed=0):
    D, Fh, options = SHAPES[fmt]
    torch.manual_seed(seed)
    cfg = MoEConfig(model_dim=D, gates=[GateConfig(type="top", k=2, capacity_factor=0.0, fp32_gate=True)],
                    experts=ExpertConfig(type="glu", num_experts_per_device=E, hidden_size_per_expert=Fh,
                                         glu_activation=act, glu_bias=bias, gpt_oss_limit=0.5),
                    aux_loss="none", dtype=torch.bfloat16, check_finite=False)
    layer = MoELayer(cfg).eval()
    with torch.no_grad():
        for p in layer.experts.parameters():
            p.mul_(4)
    quant.quantize_experts_(layer, fmt, **options)
    return layer.experts


def _call(ex, x, ids, w, bf16_acts):
    """The fused op on packed experts ``ex`` (as moe_decode.packed_glu_decode calls it)."""
    a1, b1, c1, blk0, blk1 = linear_decode.packed_fields(ex.w1)
    a2, b2, c2, _, _ = linear_decode.packed_fields(ex.w2)
    bias1 = None if ex.b1 is None else ex.b1.float().contiguous()
    bias2 = None if ex.b2 is None else ex.b2.float().contiguous()
    out = torch.empty(x.size(0), ex.w2.shape[1])
    load = torch.empty(ex.w1.shape[0], dtype=torch.long)
    kernels.packed_moe_glu_decode_out(int(kernels.WeightFormat.__members__[ex.format]), x, ids, w, a1, b1, c1, a2, b2, c2, blk0, blk1,
                                      bias1, bias2, int(kernels.Activation.__members__[ex.glu_kind]), float(ex.alpha), float(ex.limit),
                                      out, load, bf16_acts, kernels.PackedActs.exact)
    return out, load


def _reference(ex, x, ids, w, round_h):
    """Per token and chosen expert in fp64 from the dequantized weights; h rounded to bf16 if asked."""
    W1, W2 = ex.w1.dequantize(torch.float64), ex.w2.dequantize(torch.float64)
    out = torch.zeros(x.size(0), W2.size(1), dtype=torch.float64)
    for t in range(x.size(0)):
        for j in range(ids.size(1)):
            e = int(ids[t, j])
            gu = W1[e] @ x[t].double() + (0 if ex.b1 is None else ex.b1[e].double())
            h = glu_activation(gu[:ex.hidden_size], gu[ex.hidden_size:], ex.glu_kind, ex.alpha, ex.limit)
            if round_h:
                h = h.float().bfloat16().double()
            out[t] += w[t, j].double() * (W2[e] @ h + (0 if ex.b2 is None else ex.b2[e].double()))
    return out


def _routing(T, E=6, k=2, seed=1):
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)])
    w = torch.rand(T, k, generator=g)
    return ids.contiguous(), (w / w.sum(-1, keepdim=True)).contiguous()


@needs_kernels  # without AVX512-BF16 the op widens bf16 x to fp32 (same results up to fp32 rounding)
@pytest.mark.parametrize("fmt", list(SHAPES))
@pytest.mark.parametrize("T", [1, 3, 16])
@pytest.mark.parametrize("act,bias", [("silu", False), ("gpt_oss", True)])
def test_fused_bf16_matches_dequantized_reference(fmt, T, act, bias):
    ex = _experts(fmt, act, bias)
    D = SHAPES[fmt][0]
    x = torch.randn(T, D).bfloat16()
    ids, w = _routing(T)
    out, load = _call(ex, x, ids, w, True)
    want = _reference(ex, x, ids, w, round_h=True)
    torch.testing.assert_close(out.double(), want, atol=1e-2 * want.abs().max().item(), rtol=0)
    assert torch.equal(load, torch.bincount(ids.flatten(), minlength=6))


@needs_kernels
@pytest.mark.parametrize("fmt", list(SHAPES))
@pytest.mark.parametrize("T", [1, 3, 16])
def test_fused_fp32_path_unchanged(fmt, T):
    """fp32 activations keep fp32 precision: no bf16 rounding anywhere."""
    ex = _experts(fmt, "gpt_oss", True)
    x = torch.randn(T, SHAPES[fmt][0])
    ids, w = _routing(T)
    out, _ = _call(ex, x, ids, w, False)
    want = _reference(ex, x, ids, w, round_h=False)
    torch.testing.assert_close(out.double(), want, atol=1e-5 * want.abs().max().item(), rtol=1e-5)
    with pytest.raises(RuntimeError, match="x must be contiguous bf16"):
        _call(ex, x, ids, w, True)
    with pytest.raises(RuntimeError, match="x must be contiguous fp32"):
        _call(ex, x.bfloat16(), ids, w, False)


@needs_kernels
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_layer_passes_bf16_activations(monkeypatch, dtype):
    """packed_glu_decode hands bf16 x and the flag to the kernel (fp32 x: the fp32 path)."""
    ex = _experts("mxfp4")
    real = kernels
    calls = []

    class Spy:
        def __getattr__(self, name):
            return getattr(real, name)

        def packed_moe_glu_decode_out(self, *args):
            calls.append((args[1].dtype, args[-2]))  # x and bf16_acts (the last argument is acts)
            return real.packed_moe_glu_decode_out(*args)

    monkeypatch.setattr(cpu_kernels, "load", lambda: Spy())
    x = torch.randn(3, SHAPES["mxfp4"][0]).to(dtype)
    ids, w = _routing(3)
    with torch.inference_mode():
        y, load, _ = moe_decode.packed_glu_decode(x, ids, w, ex)
    bf16 = dtype == torch.bfloat16 and real.has_avx512_bf16()
    assert calls == [(torch.bfloat16 if bf16 else torch.float32, bf16)] and y.dtype == dtype
    want = _reference(ex, x, ids, w, round_h=dtype == torch.bfloat16)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5  # bf16: the output rounded too
    torch.testing.assert_close(y.double(), want, atol=tol * want.abs().max().item(), rtol=tol)


@needs_bf16
def test_fp8_bf16_kernel_is_the_one_that_runs():
    """The bf16 dot products read e4m3 subnormals (|value| < 2^-6 of the block scale) as zero: a row whose
    only non-zero products come from subnormal weights gives 0 on the bf16 path, not on the fp32 one."""
    w = torch.zeros(2, 64)
    w[:, 0] = 448.0                      # block scale 1: e4m3 values are the weights themselves
    w[:, 1] = 2.0 ** -8                  # an e4m3 subnormal
    w[1, 2] = 0.5                        # a normal one
    q = quant.quantize(w, "fp8_block", block=(1, 64))
    for T in (1, 2):  # one token: dot products; several: the widened kernel (same rule)
        x = torch.zeros(T, 64)
        x[:, 1] = 1.0
        x[:, 2] = 1.0
        y32 = kernels.fp8_block_gemv(x, q.weight.view(torch.uint8), q.scales().contiguous(), 1, 64)
        y16 = kernels.fp8_block_gemv(x.bfloat16(), q.weight.view(torch.uint8), q.scales().contiguous(), 1, 64)
        assert (y32[:, 0] == 2.0 ** -8).all() and (y16[:, 0] == 0.0).all()
        assert (y32[:, 1] == 0.5 + 2.0 ** -8).all() and (y16[:, 1] == 0.5).all()
        assert y16.dtype == torch.float32


@needs_kernels
@pytest.mark.parametrize("fmt,shape,options", [
    ("mxfp4", (40, 256), {}), ("mxfp4", (17, 96), {}), ("mxfp4", (9, 352), {}),   # 352 = 2 steps + 32 bytes
    ("nvfp4", (40, 256), {}), ("nvfp4", (9, 48), {}), ("nvfp4", (5, 272), {}),
    ("fp8_block", (300, 272), {}), ("fp8_block", (33, 200), {"block": (8, 32)}),
    ("fp8_block", (5, 200), {"block": (4, 40)}),                                    # b1 % 32 != 0: the fp32 kernel
    ("fp8_block", (33, 256), {"scale_fmt": "ue8m0"}),
    ("int4", (40, 256), {}), ("int4", (17, 80), {}), ("int4", (9, 352), {"group_size": 16}),   # 80: partial group
    ("int4", (5, 160), {"group_size": 160, "scale_dtype": torch.float16}), ("int4", (6, 96), {"group_size": 48}),
])
@pytest.mark.parametrize("T", [1, 3, 9, 16])  # 9: a chunk of 8 tokens, then one
def test_gemv_bf16_x_matches_dequantize_then_matmul(fmt, shape, options, T):
    w = quant.quantize(torch.randn(*shape) * 3, fmt, **options)
    x = torch.randn(T, shape[1]).bfloat16()
    y = packed_gemv(x, w)
    assert y is not None and y.shape == (T, shape[0]) and y.dtype == torch.float32
    want = x.double() @ w.dequantize(torch.float64).t()
    # exact products, fp32 sums; FP8 subnormals (< 3.5e-5 of a block's largest value) read as zero
    torch.testing.assert_close(y.double(), want, atol=1e-4 * want.abs().max().item(), rtol=1e-4)


@needs_kernels
@pytest.mark.parametrize("T", [1, 4])
def test_gemv_ops_take_bf16_x(T):
    """The ops themselves with bf16 x (the bf16 kernels, or widening to fp32 where those are not built)."""
    x = torch.randn(T, 352).bfloat16()
    w = torch.randn(24, 352)
    for fmt, options in (("fp8_block", {"block": (8, 64)}), ("mxfp4", {}), ("nvfp4", {}), ("int4", {})):
        q = quant.quantize(w, fmt, **options)
        if fmt == "int4":
            y = kernels.int4_gemv(x, q.weight_packed.view(torch.uint8), q.weight_scale, 32)
        elif fmt == "mxfp4":
            y = kernels.mxfp4_gemv(x, q.blocks, q.scales)
        elif fmt == "nvfp4":
            y = kernels.nvfp4_gemv(x, q.weight, q.weight_scale.view(torch.uint8), float(q.weight_scale_2))
        else:
            y = kernels.fp8_block_gemv(x, q.weight.view(torch.uint8), q.scales().contiguous(), 8, 64)
        want = x.double() @ q.dequantize(torch.float64).t()
        assert y.dtype == torch.float32
        torch.testing.assert_close(y.double(), want, atol=1e-4 * want.abs().max().item(), rtol=1e-4)


@needs_kernels
def test_nan_scales_propagate_with_bf16_x():
    w = torch.randn(4, 352)
    w[1, 3] = float("nan")
    x = torch.randn(2, 352).bfloat16()
    for fmt, options in (("fp8_block", {"block": (1, 32)}), ("mxfp4", {}), ("nvfp4", {}), ("int4", {})):
        q = quant.quantize(w, fmt, **options)
        y = packed_gemv(x, q)
        assert torch.isnan(y[:, 1]).all() and not torch.isnan(y[:, [0, 2, 3]]).any(), fmt
    q = quant.quantize(w.nan_to_num(), "mxfp4")
    q.scales[2, 10] = 255  # the e8m0 NaN scale, in the last (partial) step
    assert torch.isnan(packed_gemv(x, q)[:, 2]).all()


@needs_kernels
@pytest.mark.parametrize("fmt", list(SHAPES))
def test_fused_nan_expert_propagates(fmt):
    ex = _experts(fmt)
    D = SHAPES[fmt][0]
    if fmt == "mxfp4":
        ex.w1.scales[2, 0, 0] = 255
    elif fmt == "nvfp4":
        ex.w1.weight_scale.view(torch.uint8)[2, 0, 0] = 0x7F
    elif fmt == "int4":
        ex.w1.weight_scale[2, 0, 0] = float("nan")
    else:
        ex.w1.weight_scale_inv[2, 0, 0] = float("nan")
    x = torch.randn(4, D).bfloat16()
    ids = torch.tensor([[2, 0], [1, 3], [4, 2], [5, 0]])
    w = torch.full((4, 2), 0.5)
    for bf16 in (True, False):
        out, _ = _call(ex, x if bf16 else x.float(), ids, w, bf16)
        assert torch.isnan(out[[0, 2]]).all() and not torch.isnan(out[[1, 3]]).any(), (fmt, bf16)
