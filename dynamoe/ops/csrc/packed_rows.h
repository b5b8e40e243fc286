// The packed-weight row kernels (MXFP4, NVFP4, blockwise FP8) shared by the GEMVs (packed_gemv.cpp)
// and the fused MoE decode (moe_decode_packed.cpp): one output row for TT tokens, decoded in registers.
#pragma once
#include <cmath>
#include <cstdint>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace dynamoe::packed {
inline constexpr float kE2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

inline float e4m3_value(uint8_t b) {
  const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  if (e == 15 && m == 7) return NAN;
  const float v = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.f + m / 8.f, e - 7);
  return s ? -v : v;
}

inline float e8m0_value(uint8_t b) { return b == 255 ? NAN : std::ldexp(1.f, static_cast<int>(b) - 127); }

// x split into even and odd elements: the low nibble of byte j holds element 2j, the high one 2j+1.
inline void split_even_odd(const float* x, int64_t T, int64_t I, std::vector<float>& xe, std::vector<float>& xo) {
  const int64_t h = I / 2;
  xe.resize(T * h);
  xo.resize(T * h);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < h; ++j) {
      xe[t * h + j] = x[t * I + 2 * j];
      xo[t * h + j] = x[t * I + 2 * j + 1];
    }
}

// One output row of an FP4 weight for TT tokens (a compile-time count, so the accumulators live in
// registers): `packed` holds I/2 bytes, `gscale[g]` is the scale of group g, a group spanning
// `bytes_per_group` bytes (16 for MXFP4's 32 elements, 8 for NVFP4's 16).
template <int TT, int kBytesPerGroup>
void fp4_row(const uint8_t* packed, int64_t h, const float* xe, const float* xo, int64_t x_stride,
             const float* gscale, float* out, int64_t out_stride) {
  float acc_s[TT];
  for (int t = 0; t < TT; ++t) acc_s[t] = 0.f;
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 lut = _mm512_loadu_ps(kE2M1);
  __m512 acc[TT];
  for (int t = 0; t < TT; ++t) acc[t] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi32(15);
  // lanes 0-7 take group scale 0, lanes 8-15 group scale 1 (NVFP4: two 8-byte groups per step)
  const __m512i two_groups = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  for (; j + 16 <= h; j += 16) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + j)));
    const __m512 vlo = _mm512_permutexvar_ps(_mm512_and_si512(b, low4), lut);
    const __m512 vhi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut);
    const __m512 scale = kBytesPerGroup >= 16
        ? _mm512_set1_ps(gscale[j / kBytesPerGroup])
        : _mm512_permutexvar_ps(two_groups, _mm512_castps128_ps512(_mm_castsi128_ps(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(gscale + j / 8)))));
    for (int t = 0; t < TT; ++t) {  // unscaled dot of the step, then one scaled accumulate
      const __m512 g = _mm512_fmadd_ps(vhi, _mm512_loadu_ps(xo + t * x_stride + j),
                                       _mm512_mul_ps(vlo, _mm512_loadu_ps(xe + t * x_stride + j)));
      acc[t] = _mm512_fmadd_ps(g, scale, acc[t]);
    }
  }
  for (int t = 0; t < TT; ++t) acc_s[t] = _mm512_reduce_add_ps(acc[t]);
#endif
  for (; j < h; ++j) {
    const float s = gscale[j / kBytesPerGroup];
    const float lo = kE2M1[packed[j] & 15] * s, hi = kE2M1[packed[j] >> 4] * s;
    for (int t = 0; t < TT; ++t) acc_s[t] += lo * xe[t * x_stride + j] + hi * xo[t * x_stride + j];
  }
  for (int t = 0; t < TT; ++t) out[t * out_stride] = acc_s[t];
}

template <int TT>
void fp8_row(const uint8_t* row, int64_t I, const float* xp, const float* srow, int64_t b1, const float* lut,
             float* out, int64_t out_stride) {
  float acc_s[TT];
  for (int t = 0; t < TT; ++t) acc_s[t] = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__)
  if (b1 % 16 == 0) {
    __m512 acc[TT];
    for (int t = 0; t < TT; ++t) acc[t] = _mm512_setzero_ps();
    // e4m3 -> fp16 is a shift: fp16 bits = sign << 8 | (e, m) << 7, worth 2^-8 of the e4m3 value
    // (exactly, subnormals included); the 2^8 goes into the block scale. The e4m3 NaN byte would
    // decode as a finite value here: our quantizer never writes it (a NaN block has a NaN scale).
    const __m256i sign_mask = _mm256_set1_epi16(0x80), body_mask = _mm256_set1_epi16(0x7F);
    for (int64_t blk = 0; blk + b1 <= I; blk += b1) {  // whole scale blocks; b1 % 16 == 0
      const __m512 sv = _mm512_set1_ps(srow[blk / b1] * 256.f);
      for (i = blk; i < blk + b1; i += 16) {
        const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i)));
        const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, sign_mask), 8),
                                          _mm256_slli_epi16(_mm256_and_si256(b, body_mask), 7));
        const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(h), sv);
        for (int t = 0; t < TT; ++t) acc[t] = _mm512_fmadd_ps(v, _mm512_loadu_ps(xp + t * I + i), acc[t]);
      }
    }
    for (int t = 0; t < TT; ++t) acc_s[t] = _mm512_reduce_add_ps(acc[t]);
  }
#endif
  for (; i < I; ++i) {
    const float w = lut[row[i]] * srow[i / b1];
    for (int t = 0; t < TT; ++t) acc_s[t] += w * xp[t * I + i];
  }
  for (int t = 0; t < TT; ++t) out[t * out_stride] = acc_s[t];
}

// The fp32 scales of one NVFP4 row: e4m3 bytes [G] times the global scale, 16 at a time through fp16
// (see fp8_row); NaN scales (0x7F) take the table ``e4m3`` (e4m3 value * global, 256 entries).
inline void nvfp4_row_scales(const uint8_t* srow, int64_t G, float global_scale, const float* e4m3, float* gs) {
  int64_t g = 0;
#if defined(__AVX512F__)
  const __m512 sv = _mm512_set1_ps(global_scale * 256.f);
  for (; g + 16 <= G; g += 16) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(srow + g));
    const __m256i b = _mm256_cvtepu8_epi16(raw);
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                      _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
    _mm512_storeu_ps(gs + g, _mm512_mul_ps(_mm512_cvtph_ps(h), sv));
    const __mmask16 nan = _mm_cmpeq_epi8_mask(_mm_and_si128(raw, _mm_set1_epi8(0x7F)), _mm_set1_epi8(0x7F));
    for (int l = 0; l < 16; ++l)
      if (nan >> l & 1) gs[g + l] = e4m3[srow[g + l]];
  }
#endif
  for (; g < G; ++g) gs[g] = e4m3[srow[g]];
}
}  // namespace dynamoe::packed
