"""The three weight formats: hand-made tensors, independent elementwise dequantization, error bounds,
unaligned FP8 shapes, NaN groups, expert indexing and memory accounting."""

import pytest
import torch

from dynamoe.quant import BlockFP8Weight, MXFP4Weight, NVFP4Weight, quantize
from test_quant_codecs import E2M1, ref_e4m3_value


def e2m1_value(nib: int) -> float:
    return (-1 if nib & 8 else 1) * E2M1[nib & 7]


# ---------------------------------------------------------------- blockwise FP8
def test_fp8_unaligned_shape_has_partial_edge_blocks():
    w = torch.randn(576, 7168)
    q = BlockFP8Weight.quantize(w)
    assert q.weight.dtype == torch.float8_e4m3fn and q.weight.shape == (576, 7168)
    assert q.weight_scale_inv.shape == (5, 56)
    # the last scale row covers 64 rows only: its scale comes from those rows' amax
    torch.testing.assert_close(q.weight_scale_inv[4, 0], w[512:, :128].abs().max() / 448)
    d = q.dequantize(torch.float32)
    assert d.shape == w.shape


def test_fp8_dequantize_matches_elementwise_reference():
    w = torch.randn(200, 300) * 3
    q = BlockFP8Weight.quantize(w, block=(128, 128))
    d = q.dequantize(torch.float32)
    codes = q.weight.view(torch.uint8)
    g = torch.Generator().manual_seed(0)
    for _ in range(300):
        i, j = int(torch.randint(200, (1,), generator=g)), int(torch.randint(300, (1,), generator=g))
        want = ref_e4m3_value(int(codes[i, j])) * float(q.weight_scale_inv[i // 128, j // 128])
        assert float(d[i, j]) == pytest.approx(want, rel=1e-6, abs=1e-12)


@pytest.mark.parametrize("scale_fmt", ["fp32", "ue8m0"])
@pytest.mark.parametrize("shape,block", [((256, 384), (128, 128)), ((130, 70), (128, 128)), ((3, 5, 40), (16, 8))])
def test_fp8_error_bound(shape, block, scale_fmt):
    w = torch.randn(*shape) * torch.rand(*shape) * 10
    q = BlockFP8Weight.quantize(w, block=block, scale_fmt=scale_fmt)
    d = q.dequantize(torch.float32)
    scales = q.scales()
    s = scales.repeat_interleave(block[0], -2).repeat_interleave(block[1], -1)[..., : shape[-2], : shape[-1]]
    # e4m3 keeps 3 mantissa bits: relative error <= 2^-4, plus half the smallest subnormal step
    assert ((d - w).abs() <= w.abs() * 2 ** -4 + s * 2 ** -10 + 1e-12).all()
    if scale_fmt == "ue8m0":
        assert q.weight_scale_inv.dtype == torch.uint8
        assert torch.equal(torch.exp2(torch.log2(scales).round()), scales)  # powers of two


def test_fp8_zero_and_nan_blocks():
    w = torch.zeros(256, 256)
    w[0, 0] = float("nan")
    w[200, 200] = 3.0
    q = BlockFP8Weight.quantize(w)
    d = q.dequantize(torch.float32)
    assert torch.isnan(d[:128, :128]).all() and not torch.isnan(d[128:]).any()
    assert float(d[200, 200]) == 3.0 and float(d[130, 10]) == 0.0
    assert float(q.weight_scale_inv[0, 1]) == 1.0  # all-zero block: scale 1


def test_fp8_bad_scale_grid_is_rejected():
    q = BlockFP8Weight.quantize(torch.randn(576, 256))
    with pytest.raises(ValueError, match="weight_scale_inv"):
        BlockFP8Weight(q.weight, q.weight_scale_inv[:4], (576, 256))


# ---------------------------------------------------------------- MXFP4
def test_mxfp4_hand_made_block_every_code():
    codes = torch.arange(32, dtype=torch.uint8) % 16                  # every e2m1 code, twice
    blocks = (codes[0::2] | (codes[1::2] << 4)).view(1, 1, 16)        # low nibble = even element
    for scale_code, factor in [(127, 1.0), (130, 8.0), (120, 2.0 ** -7)]:
        q = MXFP4Weight(blocks, torch.tensor([[scale_code]], dtype=torch.uint8), (1, 32))
        want = torch.tensor([e2m1_value(int(c)) * factor for c in codes])
        assert torch.equal(q.dequantize(torch.float32)[0], want)


def test_mxfp4_dequantize_matches_elementwise_reference_and_error_bound():
    w = torch.randn(2, 24, 64) * 5
    q = MXFP4Weight.quantize(w)
    assert q.blocks.shape == (2, 24, 2, 16) and q.scales.shape == (2, 24, 2)
    d = q.dequantize(torch.float32)
    for e, i, j in [(0, 0, 0), (1, 23, 63), (0, 5, 33), (1, 7, 17)]:
        byte = int(q.blocks[e, i, j // 32, (j % 32) // 2])
        nib = byte & 0xF if j % 2 == 0 else byte >> 4
        assert float(d[e, i, j]) == e2m1_value(nib) * 2.0 ** (int(q.scales[e, i, j // 32]) - 127)
    # scale 2^e with amax/2^e in [4, 8): every element within 2^e (saturation at 6 included)
    step = torch.exp2(q.scales.float() - 127).repeat_interleave(32, -1)
    assert ((d - w).abs() <= step * 2 + 1e-6).all()
    assert ((d - w).norm() / w.norm()) < 0.2


def test_mxfp4_requantizing_dequantized_values_is_exact():
    q = MXFP4Weight.quantize(torch.randn(8, 96))
    d = q.dequantize(torch.float32)
    assert torch.equal(MXFP4Weight.quantize(d).dequantize(torch.float32), d)


def test_mxfp4_nan_group_has_nan_scale():
    w = torch.randn(2, 64)
    w[1, 40] = float("nan")
    q = MXFP4Weight.quantize(w)
    assert int(q.scales[1, 1]) == 255
    d = q.dequantize(torch.float32)
    assert torch.isnan(d[1, 32:]).all() and not torch.isnan(d[1, :32]).any() and not torch.isnan(d[0]).any()


# ---------------------------------------------------------------- NVFP4
def test_nvfp4_dequantize_matches_elementwise_reference():
    w = torch.randn(3, 16, 48) * 2
    q = NVFP4Weight.quantize(w)
    assert q.weight.shape == (3, 16, 24) and q.weight_scale.shape == (3, 16, 3) and q.weight_scale_2.shape == (3,)
    d = q.dequantize(torch.float32)
    for e, i, j in [(0, 0, 0), (2, 15, 47), (1, 3, 17), (1, 9, 30)]:
        byte = int(q.weight[e, i, j // 2])
        nib = byte & 0xF if j % 2 == 0 else byte >> 4
        scale = ref_e4m3_value(int(q.weight_scale[e, i, j // 16].view(torch.uint8))) * float(q.weight_scale_2[e])
        assert float(d[e, i, j]) == pytest.approx(e2m1_value(nib) * scale, rel=1e-6)
    torch.testing.assert_close(q.weight_scale_2, w.abs().flatten(1).amax(1) / (6 * 448))
    assert ((d - w).norm() / w.norm()) < 0.15


def test_nvfp4_compressed_tensors_global_scale_is_the_reciprocal():
    w = torch.randn(4, 32, 64)  # four experts, each with its own global scale
    q = NVFP4Weight.quantize(w)
    torch.testing.assert_close(q.weight_global_scale * q.weight_scale_2, torch.ones(4))
    ct = NVFP4Weight.from_compressed_tensors(q.weight, q.weight_scale, q.weight_global_scale, q.shape)
    torch.testing.assert_close(ct.dequantize(torch.float32), q.dequantize(torch.float32))
    # a loader that forgets the reciprocal (multiplies by the global scale) is far off
    wrong = NVFP4Weight(q.weight, q.weight_scale, q.weight_global_scale, q.shape).dequantize(torch.float32)
    assert not torch.allclose(wrong, q.dequantize(torch.float32), rtol=0.5)


# ---------------------------------------------------------------- shared behaviour
@pytest.mark.parametrize("fmt", ["fp8_block", "mxfp4", "nvfp4", "int4"])
def test_expert_indexing_memory_and_dtypes(fmt):
    w = torch.randn(4, 64, 128, dtype=torch.bfloat16)
    q = quantize(w, fmt)
    full = q.dequantize(torch.float32)
    for e in (0, 3, -1):
        torch.testing.assert_close(q[e].dequantize(torch.float32), full[e])
    assert q[1].shape == (64, 128) and len(q) == 4
    bits = {"fp8_block": 8 + 32 / (128 * 128), "mxfp4": 4 + 8 / 32, "nvfp4": 4 + 8 / 16, "int4": 4 + 16 / 32}[fmt]
    assert q.bits_per_weight == pytest.approx(bits, rel=0.01)
    assert q.dequantize().dtype == torch.bfloat16
    with pytest.raises(IndexError):
        q[4]
    with pytest.raises(TypeError):
        q[0][0]


@pytest.mark.parametrize("fmt,shape", [("mxfp4", (4, 48)), ("nvfp4", (4, 40))])
def test_group_alignment_errors(fmt, shape):
    with pytest.raises(ValueError, match="divisible"):
        quantize(torch.randn(*shape), fmt)
    with pytest.raises(ValueError, match="format"):
        quantize(torch.randn(4, 64), "int3")
    with pytest.raises(ValueError, match="floating-point"):
        quantize(torch.ones(4, 64, dtype=torch.long), fmt)
