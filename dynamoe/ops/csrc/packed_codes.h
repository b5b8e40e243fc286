// A stack of packed (quantized) weights as the native decoders read them -- dequantize.cpp (to dense bf16 / fp32)
// and panel_decode.h (into the grouped GEMM's panels) take the same argument:
//
//   value(e, r, c) = lut[code(e, r, c)] * scale(e, r / block_rows, c / group)
//   scale(e, i, j) = scales[e][i][j]                                (fp32 scales)
//                  = scale_lut[scales[e][i][j]] (* scale_mul[e])    (uint8 scale codes: e8m0, e4m3)
//
// each product in fp32, as the formats' torch dequantize() computes it (dynamoe/quant/dequantize.py gives each
// format's tables). Codes: 4-bit (two per byte, the even column in the low nibble) or 8-bit, one row of
// row_bytes per weight row.
#pragma once

#include <torch/extension.h>
#include <c10/util/BFloat16.h>
#include <cfloat>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <string>

struct PackedCodes {
  at::Tensor codes;                      // uint8 [E, R, row_bytes], contiguous
  int64_t bits = 4;                      // 4 (nibbles) or 8 (bytes)
  at::Tensor lut;                        // fp32 [2^bits]: the value of each code
  at::Tensor scales;                     // fp32, or uint8 scale codes: [E, ceil(R / block_rows), ceil(C / group)]
  c10::optional<at::Tensor> scale_lut;   // fp32 [256]: the value of each scale code (uint8 scales only)
  c10::optional<at::Tensor> scale_mul;   // fp32 [E]: each weight's scales times this (NVFP4's global scale)
  int64_t group = 32;                    // columns per scale
  int64_t block_rows = 1;                // rows per scale
};

namespace dynamoe {

// The e4m3fn value of a byte (NaN for 0x7F and 0xFF).
inline float e4m3fn_value(uint8_t b) {
  const int e = (b >> 3) & 15, m = b & 7;
  const float mag = e == 15 && m == 7 ? NAN : e == 0 ? std::ldexp(static_cast<float>(m), -9)
                                                     : std::ldexp(1.f + m / 8.f, e - 7);
  return b & 0x80 ? -mag : mag;
}

// The raw pointers of a PackedCodes for weights of C columns, checked once (view_codes).
struct CodesView {
  const uint8_t* codes;
  int64_t E, R, C, row_bytes, bits;
  const float* lut;
  const float* scales;        // fp32 scales, or null
  const uint8_t* scale_codes; // uint8 scales, or null
  const float* scale_lut;
  const float* scale_mul;     // or null
  int64_t scale_rows, scale_cols, group, block_rows;
  bool e4m3_lut;              // 8-bit codes whose table is e4m3fn's (the vector decoders compute it)
  // Rows the vector decoders may take faster (panel_decode.h): a finite scale s with s == 0 or |s| >=
  // plain_scale_min makes every lut * s a normal fp32 or zero -- no NaN, no denormal, which vcvtne2ps2bf16 would
  // round otherwise than c10; with a 4-bit table exact in bf16, a scale 2^(b - 127), b in [pow2_lo, pow2_hi],
  // makes every nonzero lut * s bf16(lut) with b - 127 added to its exponent (pow2_lo > pow2_hi: never).
  float plain_scale_min;
  int pow2_lo, pow2_hi;

  // The fp32 scales of row r of weight e: the grid's own row, or its codes decoded into buf [scale_cols].
  const float* scale_row(int64_t e, int64_t r, float* buf) const {
    const int64_t at = (e * scale_rows + r / block_rows) * scale_cols;
    if (scales) return scales + at;
    const float mul = scale_mul ? scale_mul[e] : 1.f;
    for (int64_t j = 0; j < scale_cols; ++j)
      buf[j] = scale_mul ? scale_lut[scale_codes[at + j]] * mul : scale_lut[scale_codes[at + j]];
    return buf;
  }
  uint8_t code(int64_t e, int64_t r, int64_t c) const {
    const uint8_t* row = codes + (e * R + r) * row_bytes;
    return bits == 4 ? (row[c >> 1] >> ((c & 1) * 4)) & 15 : row[c];
  }
};

// Checks w for weights of C columns; messages name the argument as `name` (e.g. "packed_b").
inline CodesView view_codes(const PackedCodes& w, int64_t C, const std::string& name) {
  const char* n = name.c_str();
  TORCH_CHECK(w.bits == 4 || w.bits == 8, n, ".bits must be 4 or 8, got ", w.bits);
  TORCH_CHECK(w.group >= 1 && w.block_rows >= 1, n, ".group and ", n, ".block_rows must be >= 1");
  TORCH_CHECK(w.codes.device().is_cpu() && w.codes.scalar_type() == at::kByte && w.codes.dim() == 3 &&
                  w.codes.is_contiguous(), n, ".codes must be a contiguous CPU uint8 [E, R, row_bytes]");
  TORCH_CHECK(w.codes.size(2) * (8 / w.bits) >= C, n, ".codes ", w.codes.sizes(), " do not hold rows of ", C, " ",
              w.bits, "-bit codes");
  TORCH_CHECK(w.lut.scalar_type() == at::kFloat && w.lut.is_contiguous() && w.lut.numel() == (int64_t{1} << w.bits),
              n, ".lut must be a contiguous fp32 [", (1 << w.bits), "]");
  const int64_t E = w.codes.size(0), R = w.codes.size(1);
  const int64_t sr = (R + w.block_rows - 1) / w.block_rows, sc = (C + w.group - 1) / w.group;
  const bool coded = w.scales.scalar_type() == at::kByte;
  TORCH_CHECK((coded || w.scales.scalar_type() == at::kFloat) && w.scales.is_contiguous() && w.scales.dim() == 3 &&
                  w.scales.size(0) == E && w.scales.size(1) == sr && w.scales.size(2) == sc,
              n, ".scales must be a contiguous fp32 or uint8 [", E, ", ", sr, ", ", sc, "], got ", w.scales.scalar_type(),
              " ", w.scales.sizes());
  TORCH_CHECK(coded == w.scale_lut.has_value(), n, ".scale_lut (fp32 [256]) goes with uint8 scales, and only with them");
  if (coded)
    TORCH_CHECK(w.scale_lut->scalar_type() == at::kFloat && w.scale_lut->is_contiguous() && w.scale_lut->numel() == 256,
                n, ".scale_lut must be a contiguous fp32 [256]");
  if (w.scale_mul)
    TORCH_CHECK(coded && w.scale_mul->scalar_type() == at::kFloat && w.scale_mul->is_contiguous() &&
                    w.scale_mul->numel() == E, n, ".scale_mul must be a contiguous fp32 [", E, "] with uint8 scales");
  CodesView v{};
  v.codes = w.codes.data_ptr<uint8_t>();
  v.E = E, v.R = R, v.C = C, v.row_bytes = w.codes.size(2), v.bits = w.bits;
  v.lut = w.lut.data_ptr<float>();
  v.scales = coded ? nullptr : w.scales.data_ptr<float>();
  v.scale_codes = coded ? w.scales.data_ptr<uint8_t>() : nullptr;
  v.scale_lut = coded ? w.scale_lut->data_ptr<float>() : nullptr;
  v.scale_mul = w.scale_mul ? w.scale_mul->data_ptr<float>() : nullptr;
  v.scale_rows = sr, v.scale_cols = sc, v.group = w.group, v.block_rows = w.block_rows;
  float smallest = INFINITY;  // the smallest nonzero |lut| value; a NaN value (4-bit) keeps rows off the plain path
  bool nan4 = false, bf16_exact = w.bits == 4;
  int exp_lo = 255, exp_hi = 0;  // biased exponents of the nonzero values
  v.e4m3_lut = w.bits == 8;
  for (int64_t i = 0; i < (int64_t{1} << w.bits); ++i) {
    const float x = v.lut[i];
    uint32_t xb;
    std::memcpy(&xb, &x, 4);
    if (std::isnan(x)) nan4 = nan4 || w.bits == 4;
    else if (x != 0.f) smallest = std::min(smallest, std::fabs(x));
    if (x != 0.f) {
      const int ex = static_cast<int>((xb >> 23) & 255);
      exp_lo = std::min(exp_lo, ex), exp_hi = std::max(exp_hi, ex);
      bf16_exact = bf16_exact && !(xb & 0xFFFF) && ex > 0 && ex < 255;
    }
    if (w.bits == 8) {
      const float want = e4m3fn_value(static_cast<uint8_t>(i));
      v.e4m3_lut = v.e4m3_lut && (std::isnan(want) ? std::isnan(x) : std::memcmp(&want, &x, 4) == 0);
    }
  }
  v.plain_scale_min = nan4 ? INFINITY : smallest == INFINITY ? 0.f : FLT_MIN / smallest * 2.f;
  // result exponent exp + b - 127 within [1, 254] for every value, and the scale itself normal
  v.pow2_lo = bf16_exact ? std::max(1, 128 - exp_lo) : 1;
  v.pow2_hi = bf16_exact ? std::min(254, 381 - exp_hi) : 0;
  return v;
}

}  // namespace dynamoe
