"""Bit-level codec tests against references written from the format definitions."""
import math
import struct

import pytest
import torch

from dynamoe.quant import (E2M1_VALUES, e2m1_decode, e2m1_encode, e4m3_decode, e4m3_encode, e8m0_decode,
                           e8m0_encode_exponent, pack_nibbles, unpack_nibbles)

E2M1 = [0.0, 0.5, 1.0, 1.5, 2.0, 3.0, 4.0, 6.0]


def ref_e4m3_value(code: int) -> float:
    sign = -1.0 if code & 0x80 else 1.0
    exp, man = (code >> 3) & 0xF, code & 0x7
    if exp == 15 and man == 7:
        return float("nan")
    if exp == 0:
        return sign * man / 8 * 2.0 ** -6
    return sign * (1 + man / 8) * 2.0 ** (exp - 7)


def ref_nearest_even(x: float, codes_values: list[tuple[int, float]]) -> int:
    """Nearest representable value; ties go to the code with an even mantissa (even code)."""
    best = min(abs(x - v) for _, v in codes_values)
    tied = [c for c, v in codes_values if abs(x - v) == best]
    even = [c for c in tied if c % 2 == 0]
    return (even or tied)[0]


def test_every_e2m1_code_round_trips():
    codes = torch.arange(16, dtype=torch.uint8)
    values = e2m1_decode(codes)
    assert values.tolist()[:8] == E2M1 and values.tolist()[8:] == [-v for v in E2M1]
    assert torch.signbit(values[8])  # code 8 is -0.0
    assert torch.equal(e2m1_encode(values), codes)
    assert torch.equal(E2M1_VALUES, values)


@pytest.mark.parametrize("x,code", [
    (0.25, 0), (0.75, 2), (1.25, 2), (1.75, 4), (2.5, 4), (3.5, 6), (5.0, 6),  # ties to even
    (0.26, 1), (5.01, 7), (6.0, 7), (7.0, 7), (1e9, 7), (float("inf"), 7),  # saturation
    (-0.25, 8), (-5.0, 14), (-float("inf"), 15), (-0.0, 8),
])
def test_e2m1_rounding_and_saturation(x, code):
    assert e2m1_encode(torch.tensor([x])).item() == code


def test_e2m1_encode_matches_brute_force_reference():
    g = torch.Generator().manual_seed(0)
    xs = torch.cat([torch.randn(2000, generator=g) * 3, torch.tensor([m / 4 for m in range(-30, 31)])])
    table = [(c, E2M1[c]) for c in range(8)]
    got = e2m1_encode(xs)
    for x, c in zip(xs.tolist(), got.tolist()):
        mag = ref_nearest_even(min(abs(x), 6.0), table)
        assert c == mag | (8 if math.copysign(1, x) < 0 else 0), x


def test_e2m1_nan_is_rejected():
    with pytest.raises(ValueError, match="NaN"):
        e2m1_encode(torch.tensor([1.0, float("nan")]))


def test_nibble_packing_low_nibble_is_even_element():
    assert pack_nibbles(torch.tensor([1, 2], dtype=torch.uint8)).item() == 0x21
    codes = torch.randint(0, 16, (3, 5, 8), dtype=torch.uint8)
    packed = pack_nibbles(codes)
    assert packed.shape == (3, 5, 4)
    assert torch.equal(unpack_nibbles(packed), codes)
    assert torch.equal(packed & 0xF, codes[..., 0::2])
    with pytest.raises(ValueError, match="even"):
        pack_nibbles(torch.zeros(3, dtype=torch.uint8))


def test_e4m3_lut_matches_bit_field_reference_for_all_256_codes():
    got = e4m3_decode(torch.arange(256, dtype=torch.uint8)).tolist()
    for code, v in enumerate(got):
        want = ref_e4m3_value(code)
        assert (math.isnan(v) and math.isnan(want)) or v == want, code


@pytest.mark.parametrize("x,code", [
    (448.0, 0x7E), (449.0, 0x7E), (464.0, 0x7E), (1e6, 0x7E), (float("inf"), 0x7E), (-1e6, 0xFE),
    (2.0 ** -9, 0x01), (2.0 ** -10, 0x00), (3 * 2.0 ** -10, 0x02), (1.0625, 0x38), (1.1875, 0x3A), (0.0, 0x00),
    (-0.0, 0x80),
])
def test_e4m3_edge_values(x, code):
    assert e4m3_encode(torch.tensor([x])).item() == code


def test_e4m3_nan_stays_nan_and_encode_matches_reference():
    assert math.isnan(e4m3_decode(e4m3_encode(torch.tensor([float("nan")]))).item())
    finite = [(c, ref_e4m3_value(c)) for c in range(0x7F)]  # non-negative finite codes
    g = torch.Generator().manual_seed(1)
    xs = torch.cat([torch.rand(1500, generator=g) * 460, torch.rand(500, generator=g) * 0.02])
    # float32 inputs, exactly as the encoder sees them
    xs = torch.tensor([struct.unpack("f", struct.pack("f", v))[0] for v in xs.tolist()])
    for x, c in zip(xs.tolist(), e4m3_encode(xs).tolist()):
        assert c == ref_nearest_even(min(x, 448.0), finite), x


def test_e8m0():
    assert e8m0_decode(torch.tensor([127, 0, 254, 128], dtype=torch.uint8)).tolist() == [1.0, 2.0 ** -127, 2.0 ** 127, 2.0]
    assert math.isnan(e8m0_decode(torch.tensor([255], dtype=torch.uint8)).item())
    assert e8m0_encode_exponent(torch.tensor([0.0, -200.0, 300.0, float("nan"), -3.0])).tolist() == [127, 0, 254, 255, 124]
