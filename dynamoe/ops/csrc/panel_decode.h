// Packed (quantized) weights decoded straight into the grouped GEMM's panel layout, one panel of 64 output
// columns at a time, for prefill-sized products: the grouped GEMM decodes a panel into a per-thread buffer
// that stays in L2 and runs every row of the expert over it, instead of writing the whole dense weight to
// memory and reading it back (dequantize.cpp + a matmul).
//
// The codes are a PackedCodes (packed_codes.h) whose R rows are the output columns and C columns the k values:
// value(e, c, k) rounded to bf16 as c10::BFloat16 does (denormals kept, NaN quiet) -- the bits of dense(w, bf16),
// so a product over decoded panels equals one over pack_weight(dense(w)).
//
// Panel layout (grouped_gemm_bf16.cpp): element (k, c) of panel p at (k / 2) * 128 + (c - 64 p) * 2 + k % 2,
// KP = ceil(K / 2) pairs, zero padded. A step decodes 16 weight rows x 32 k values (16 pairs: one zmm of
// dwords per row), transposes the 16 x 16 dwords and stores one 64-byte line per pair.
#pragma once

#include <torch/extension.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cstdint>
#include <cfloat>
#include <cstring>
#include <limits>
#include "packed_codes.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace dynamoe {

// One value of weight e, row c (its scales srow), column k, as bf16 bits (the scalar path: tails, other groups).
inline uint16_t panel_value(const CodesView& S, int64_t e, int64_t c, const float* srow, int64_t k) {
  const c10::BFloat16 v(S.lut[S.code(e, c, k)] * srow[k / S.group]);
  return v.x;
}

#if defined(__AVX512F__)
// fp32 -> bf16 bits in the low half of each dword: round to nearest even, NaN quiet (c10::BFloat16's rounding;
// vcvtneps2bf16 would flush denormals, which torch keeps)
inline __m512i panel_round_bf16(__m512 v) {
  const __m512i b = _mm512_castps_si512(v);
  const __m512i lsb = _mm512_and_si512(_mm512_srli_epi32(b, 16), _mm512_set1_epi32(1));
  const __m512i r = _mm512_srli_epi32(_mm512_add_epi32(b, _mm512_add_epi32(lsb, _mm512_set1_epi32(0x7fff))), 16);
  return _mm512_mask_mov_epi32(r, _mm512_cmp_ps_mask(v, v, _CMP_UNORD_Q), _mm512_set1_epi32(0x7fc0));
}

// r[j] holds row j of a 16 x 16 dword matrix; afterwards r[i] holds its column i.
inline void transpose16x16_epi32(__m512i r[16]) {
  __m512i t[16];
  for (int i = 0; i < 16; i += 2) {
    t[i] = _mm512_unpacklo_epi32(r[i], r[i + 1]);
    t[i + 1] = _mm512_unpackhi_epi32(r[i], r[i + 1]);
  }
  for (int i = 0; i < 16; i += 4) {
    r[i] = _mm512_unpacklo_epi64(t[i], t[i + 2]);
    r[i + 1] = _mm512_unpackhi_epi64(t[i], t[i + 2]);
    r[i + 2] = _mm512_unpacklo_epi64(t[i + 1], t[i + 3]);
    r[i + 3] = _mm512_unpackhi_epi64(t[i + 1], t[i + 3]);
  }
  for (int i = 0; i < 4; ++i) {  // (then the 4 x 4 grid of 128-bit lanes)
    t[i] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0x88);
    t[i + 4] = _mm512_shuffle_i32x4(r[i], r[i + 4], 0xdd);
    t[i + 8] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0x88);
    t[i + 12] = _mm512_shuffle_i32x4(r[i + 8], r[i + 12], 0xdd);
  }
  for (int i = 0; i < 4; ++i) {
    r[i] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0x88);
    r[i + 8] = _mm512_shuffle_i32x4(t[i], t[i + 8], 0xdd);
    r[i + 4] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0x88);
    r[i + 12] = _mm512_shuffle_i32x4(t[i + 4], t[i + 12], 0xdd);
  }
}

#if defined(__AVX512BF16__)
// 32 fp32 values in k order (v0: k0..k0+15, v1: the next 16) as 16 dwords of bf16 pairs, rounded as c10 does:
// vcvtne2ps2bf16 rounds to nearest even too but flushes denormal inputs and keeps NaN payloads, so lanes of
// those kinds (rare: tiny or NaN scales) take the integer rounding.
// How a block of rows is decoded: products checked for NaN / denormals, known to have none (CodesView::plain), or
// (4-bit tables exact in bf16, power-of-two scales: CodesView::pow2) bf16 table words with the scale's exponent
// added -- no fp32 at all.
enum class PanelMode { kChecked, kPlain, kPow2 };

// PLAIN: the caller knows there are none (CodesView::plain scales).
template <bool PLAIN>
inline __m512i pairs_bf16(__m512 v0, __m512 v1) {
  constexpr int kNanOrDenormal = 0x01 | 0x80 | 0x20;  // (vfpclassps: QNaN, SNaN, denormal)
  if (PLAIN || !(_mm512_fpclass_ps_mask(v0, kNanOrDenormal) | _mm512_fpclass_ps_mask(v1, kNanOrDenormal)))
    return (__m512i)_mm512_cvtne2ps_pbh(v1, v0);
  const __m256i w0 = _mm512_cvtepi32_epi16(panel_round_bf16(v0)), w1 = _mm512_cvtepi32_epi16(panel_round_bf16(v1));
  return _mm512_inserti64x4(_mm512_castsi256_si512(w0), w1, 1);
}

// Row c's 16 pairs at k0 (k0 % 32 == 0, k0 + 32 <= K) as dwords, the even k's bf16 in the low half. 4-bit codes:
// the nibbles put in k order, looked up in the 16-entry table in a register; 8-bit (e4m3) codes: fp16 bits by
// shifts (sign << 8 | rest << 7: 2^-8 of the e4m3 value, exactly, subnormals included), widened by vcvtph2ps and
// scaled back by 2^8 (exact), NaN bytes (0x7F, 0xFF) made NaN -- the table's values (CodesView::e4m3_lut).
// kPow2: the 4-bit codes put in k order as 32 words, looked up in the table's bf16 words (table16) and, where
// nonzero, the scale's exponent added (one per 32 k values, or per half for group 16).
inline __m512i panel_pairs_pow2(const CodesView& S, const uint8_t* row, const float* srow, int64_t k0, int64_t g,
                                __m512i table16) {
  const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k0 / 2));
  const __m128i nib = _mm_set1_epi8(15);
  const __m128i lo = _mm_and_si128(b, nib), hi = _mm_and_si128(_mm_srli_epi16(b, 4), nib);
  const __m512i codes = _mm512_cvtepu8_epi16(_mm256_set_m128i(_mm_unpackhi_epi8(lo, hi), _mm_unpacklo_epi8(lo, hi)));
  const __m512i v = _mm512_permutexvar_epi16(codes, table16);
  auto delta = [](float s) {
    uint32_t bits;
    std::memcpy(&bits, &s, 4);
    return static_cast<short>((static_cast<int>(bits >> 23) - 127) * 128);
  };
  const short d0 = delta(srow[g]), d1 = S.group == 16 ? delta(srow[g + 1]) : d0;
  const __m512i d = _mm512_mask_blend_epi16(0xFFFF0000u, _mm512_set1_epi16(d0), _mm512_set1_epi16(d1));
  return _mm512_mask_add_epi16(v, _mm512_test_epi16_mask(v, _mm512_set1_epi16(0x7FFF)), v, d);
}

template <bool PLAIN>
inline __m512i panel_pairs(const CodesView& S, const uint8_t* row, const float* srow, int64_t k0, int64_t g,
                           __m512 table) {
  __m512 v0, v1;
  if (S.bits == 4) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(row + k0 / 2));
    const __m128i nib = _mm_set1_epi8(15);
    const __m128i lo = _mm_and_si128(b, nib), hi = _mm_and_si128(_mm_srli_epi16(b, 4), nib);
    v0 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpacklo_epi8(lo, hi)), table);
    v1 = _mm512_permutexvar_ps(_mm512_cvtepu8_epi32(_mm_unpackhi_epi8(lo, hi)), table);
  } else {
    const __m512i b = _mm512_cvtepu8_epi16(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + k0)));
    const __m512i rest = _mm512_and_si512(b, _mm512_set1_epi16(0x7F));
    const __m512i h = _mm512_or_si512(_mm512_slli_epi16(_mm512_and_si512(b, _mm512_set1_epi16(0x80)), 8),
                                      _mm512_slli_epi16(rest, 7));
    const __mmask32 nan = _mm512_cmpeq_epi16_mask(rest, _mm512_set1_epi16(0x7F));
    const __m512 two8 = _mm512_set1_ps(256.f), qnan = _mm512_set1_ps(std::numeric_limits<float>::quiet_NaN());
    v0 = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_castsi512_si256(h)), two8);
    v1 = _mm512_mul_ps(_mm512_cvtph_ps(_mm512_extracti64x4_epi64(h, 1)), two8);
    v0 = _mm512_mask_mov_ps(v0, static_cast<__mmask16>(nan), qnan);
    v1 = _mm512_mask_mov_ps(v1, static_cast<__mmask16>(nan >> 16), qnan);
  }
  // the scales: one per 32 k values, or (group 16) one per half
  const __m512 s0 = _mm512_set1_ps(srow[g]), s1 = S.group == 16 ? _mm512_set1_ps(srow[g + 1]) : s0;
  return pairs_bf16<PLAIN>(_mm512_mul_ps(v0, s0), _mm512_mul_ps(v1, s1));
}

// CodesView::scale_row, plain and pow2 of one row, 16 scales at a time (a decoded 16-row block reads 16 rows of
// scales: as scalar loops these cost a third of a 4-bit panel's decode).
inline const float* scale_row_classified(const CodesView& S, int64_t e, int64_t r, float* buf, bool& plain,
                                         bool& pow2) {
  const int64_t at = (e * S.scale_rows + r / S.block_rows) * S.scale_cols;
  const __m512 mul = _mm512_set1_ps(S.scale_mul ? S.scale_mul[e] : 1.f);
  const __m512 big = _mm512_set1_ps(FLT_MAX), least = _mm512_set1_ps(S.plain_scale_min);
  const __m512i lo = _mm512_set1_epi32(S.pow2_lo), hi = _mm512_set1_epi32(S.pow2_hi);
  __mmask16 odd = 0, not_pow2 = 0;
  const float* src = S.scales ? S.scales + at : buf;
  for (int64_t j = 0; j < S.scale_cols; j += 16) {
    const __mmask16 m = static_cast<__mmask16>(S.scale_cols - j >= 16 ? 0xFFFF : (1u << (S.scale_cols - j)) - 1);
    __m512 v;
    if (S.scales) {
      v = _mm512_maskz_loadu_ps(m, S.scales + at + j);
    } else {
      const __m512i idx = _mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, S.scale_codes + at + j));
      v = _mm512_mask_i32gather_ps(_mm512_setzero_ps(), m, idx, S.scale_lut, 4);
      if (S.scale_mul) v = _mm512_mul_ps(v, mul);
      _mm512_mask_storeu_ps(buf + j, m, v);
    }
    const __m512 a = _mm512_abs_ps(v);
    odd |= m & (~_mm512_cmp_ps_mask(a, big, _CMP_LE_OQ) |
                (_mm512_cmp_ps_mask(a, _mm512_setzero_ps(), _CMP_NEQ_OQ) & _mm512_cmp_ps_mask(a, least, _CMP_LT_OQ)));
    const __m512i b = _mm512_castps_si512(v), ex = _mm512_srli_epi32(b, 23);
    not_pow2 |= m & (_mm512_test_epi32_mask(b, _mm512_set1_epi32(0x7FFFFF)) | _mm512_cmplt_epi32_mask(ex, lo) |
                     _mm512_cmpgt_epi32_mask(ex, hi));
  }
  plain = !odd;
  pow2 = !not_pow2;
  return src;
}

// 16 rows' 16 pairs at every k0 < kv, transposed into the panel's lines (col: the block's pair 0).
template <PanelMode MODE>
inline void panel_block(const CodesView& S, const uint8_t* const* row, const float* const* srow, int64_t rows,
                        int64_t kv, uint16_t* col) {
  const __m512 table = S.bits == 4 ? _mm512_loadu_ps(S.lut) : _mm512_setzero_ps();
  alignas(64) uint16_t words[32] = {};
  if (MODE == PanelMode::kPow2)
    for (int i = 0; i < 16; ++i) words[i] = c10::BFloat16(S.lut[i]).x;  // (exact: CodesView::pow2_lo <= pow2_hi)
  const __m512i table16 = _mm512_load_si512(words);
  const int64_t ahead = 256 / (8 / S.bits);  // k values 256 bytes of codes ahead: the 16 rows are 16 streams
  for (int64_t k0 = 0; k0 < kv; k0 += 32) {
    const int64_t g = k0 / S.group;  // (the step's first scale)
    __m512i r[16];
    for (int i = 0; i < rows; ++i)
      _mm_prefetch(reinterpret_cast<const char*>(row[i] + (k0 + ahead) * S.bits / 8), _MM_HINT_T0);
    for (int i = 0; i < 16; ++i)
      r[i] = i >= rows                      ? _mm512_setzero_si512()
             : MODE == PanelMode::kPow2     ? panel_pairs_pow2(S, row[i], srow[i], k0, g, table16)
             : MODE == PanelMode::kPlain    ? panel_pairs<true>(S, row[i], srow[i], k0, g, table)
                                            : panel_pairs<false>(S, row[i], srow[i], k0, g, table);
    transpose16x16_epi32(r);
    for (int j = 0; j < 16; ++j) _mm512_storeu_si512(col + (k0 / 2 + j) * 128, r[j]);
  }
}

// Panel p of expert e: `out` [KP][64][2] bf16 bits (KP = ceil(C / 2)); columns past R and the pair of an odd
// C's last value are zero. sbuf: room for 16 rows of decoded scales (16 * S.scale_cols floats).
inline void decode_panel(const CodesView& S, int64_t e, int64_t p, uint16_t* out, float* sbuf) {
  const int64_t KP = (S.C + 1) / 2, c_begin = p * 64, c_end = std::min(S.R, c_begin + 64);
  const bool vector_steps = (S.group % 32 == 0 || S.group == 16) && (S.bits == 4 || S.e4m3_lut);
  const int64_t kv = vector_steps ? S.C / 32 * 32 : 0;  // k values the vector steps decode
  for (int64_t c0 = c_begin; c0 < c_begin + 64; c0 += 16) {
    const int64_t rows = std::max<int64_t>(0, std::min<int64_t>(16, c_end - c0));
    uint16_t* col = out + (c0 - c_begin) * 2;  // this block's 16 columns of pair 0
    if (rows == 0) {
      for (int64_t kp = 0; kp < KP; ++kp) std::memset(col + kp * 128, 0, 64);
      continue;
    }
    const uint8_t* row[16];
    const float* srow[16];
    bool plain = true, pow2 = S.bits == 4 && S.pow2_lo <= S.pow2_hi;
    for (int i = 0; i < 16; ++i) {
      const int64_t c = c0 + std::min<int64_t>(i, rows - 1);
      row[i] = S.codes + (e * S.R + c) * S.row_bytes;
      if (i >= rows) {
        srow[i] = srow[i - 1];
        continue;
      }
      bool row_plain, row_pow2;
      srow[i] = scale_row_classified(S, e, c, sbuf + i * S.scale_cols, row_plain, row_pow2);
      plain = plain && row_plain;
      pow2 = pow2 && row_pow2;
    }
    if (pow2) panel_block<PanelMode::kPow2>(S, row, srow, rows, kv, col);
    else if (plain) panel_block<PanelMode::kPlain>(S, row, srow, rows, kv, col);
    else panel_block<PanelMode::kChecked>(S, row, srow, rows, kv, col);
    for (int64_t kp = kv / 2; kp < KP; ++kp) {  // the tail (or every pair where the steps do not apply)
      uint16_t* dst = col + kp * 128;
      for (int i = 0; i < 16; ++i) {
        const int64_t k = 2 * kp;
        dst[2 * i] = i < rows ? panel_value(S, e, c0 + i, srow[i], k) : 0;
        dst[2 * i + 1] = i < rows && k + 1 < S.C ? panel_value(S, e, c0 + i, srow[i], k + 1) : 0;
      }
    }
  }
}
#endif  // __AVX512BF16__
#endif  // __AVX512F__

}  // namespace dynamoe
