// Row-level pieces of a decode step shared by the kernels (rms_norm.cpp, rope.cpp, attn_decode.cpp),
// each with the op-by-op path's roundings.
#pragma once
#include <c10/util/BFloat16.h>
#include <cmath>
#include <cstdint>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif
#include "simd_avx2.h"

namespace dynamoe {
// sum_i x[i] * w[i] in fp32 (x fp32, w bf16 or fp32), 16 independent partial sums so that the compiler
// vectorizes it without reassociating
template <typename scalar_t>
inline float dot_f32(const float* x, const scalar_t* w, int64_t n) {
  constexpr int kLanes = 16;
  float acc[kLanes] = {0.f};
  int64_t i = 0;
  for (; i + kLanes <= n; i += kLanes)
    for (int j = 0; j < kLanes; ++j) acc[j] += x[i + j] * static_cast<float>(w[i + j]);
  float s = 0.f;
  for (int j = 0; j < kLanes; ++j) s += acc[j];
  for (; i < n; ++i) s += x[i] * static_cast<float>(w[i]);
  return s;
}

// sum_i a[i] * b[i] of two fp32 rows with 16-lane FMAs and a tree sum (attention scores: the order
// differs from dot_f32's, within fp32 rounding)
inline float dot_rows(const float* a, const float* b, int64_t n) {
  int64_t i = 0;
  float s = 0.f;
#if defined(__AVX512F__)
  __m512 acc = _mm512_setzero_ps();
  for (; i + 16 <= n; i += 16) acc = _mm512_fmadd_ps(_mm512_loadu_ps(a + i), _mm512_loadu_ps(b + i), acc);
  s = _mm512_reduce_add_ps(acc);
#elif defined(DYNAMOE_AVX2)
  __m256 acc = _mm256_setzero_ps();
  for (; i + 8 <= n; i += 8) acc = _mm256_fmadd_ps(_mm256_loadu_ps(a + i), _mm256_loadu_ps(b + i), acc);
  s = avx2::reduce_add(acc);
#endif
  for (; i < n; ++i) s += a[i] * b[i];
  return s;
}

#if defined(__AVX512F__)
// e^x for 16 lanes: x = n ln2 + r (Cody-Waite), e^r by Cephes' expf polynomial, times 2^n by scalef;
// within ~2 ulp of expf; NaN stays NaN, large negative x gives 0
inline __m512 exp16(__m512 x) {
  x = _mm512_max_ps(_mm512_set1_ps(-104.f), _mm512_min_ps(_mm512_set1_ps(88.72f), x));  // (NaN passes)
  const __m512 n = _mm512_roundscale_ps(_mm512_mul_ps(x, _mm512_set1_ps(1.44269504088896341f)),
                                        _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m512 r = _mm512_fnmadd_ps(n, _mm512_set1_ps(0.693359375f), x);
  r = _mm512_fnmadd_ps(n, _mm512_set1_ps(-2.12194440e-4f), r);
  __m512 p = _mm512_set1_ps(1.9875691500e-4f);
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.3981999507e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(8.3334519073e-3f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(4.1665795894e-2f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(1.6666665459e-1f));
  p = _mm512_fmadd_ps(p, r, _mm512_set1_ps(5.0000001201e-1f));
  p = _mm512_fmadd_ps(p, _mm512_mul_ps(r, r), _mm512_add_ps(r, _mm512_set1_ps(1.f)));
  return _mm512_scalef_ps(p, n);
}
#elif defined(DYNAMOE_AVX2)
// exp16's method on 8 lanes; 2^n from its exponent bits (n in [-151, 128] after the clamp: the product is
// formed in two steps so that neither factor leaves fp32's normal range)
inline __m256 exp8(__m256 x) {
  x = _mm256_max_ps(_mm256_set1_ps(-104.f), _mm256_min_ps(_mm256_set1_ps(88.72f), x));
  const __m256 n = _mm256_round_ps(_mm256_mul_ps(x, _mm256_set1_ps(1.44269504088896341f)),
                                   _MM_FROUND_TO_NEAREST_INT | _MM_FROUND_NO_EXC);
  __m256 r = _mm256_fnmadd_ps(n, _mm256_set1_ps(0.693359375f), x);
  r = _mm256_fnmadd_ps(n, _mm256_set1_ps(-2.12194440e-4f), r);
  __m256 p = _mm256_set1_ps(1.9875691500e-4f);
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.3981999507e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(8.3334519073e-3f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(4.1665795894e-2f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(1.6666665459e-1f));
  p = _mm256_fmadd_ps(p, r, _mm256_set1_ps(5.0000001201e-1f));
  p = _mm256_fmadd_ps(p, _mm256_mul_ps(r, r), _mm256_add_ps(r, _mm256_set1_ps(1.f)));
  const __m256i ni = _mm256_cvtps_epi32(n), half = _mm256_srai_epi32(ni, 1);
  auto pow2 = [](__m256i e) { return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_add_epi32(e, _mm256_set1_epi32(127)), 23)); };
  return _mm256_mul_ps(_mm256_mul_ps(p, pow2(half)), pow2(_mm256_sub_epi32(ni, half)));
}
#endif

// p[j] = e^(p[j] - mx) for j < n; returns their sum (softmax numerators and denominator)
inline float exp_shifted(float* p, int64_t n, float mx) {
  int64_t j = 0;
  float s = 0.f;
#if defined(__AVX512F__)
  const __m512 m = _mm512_set1_ps(mx);
  __m512 acc = _mm512_setzero_ps();
  for (; j + 16 <= n; j += 16) {
    const __m512 e = exp16(_mm512_sub_ps(_mm512_loadu_ps(p + j), m));
    _mm512_storeu_ps(p + j, e);
    acc = _mm512_add_ps(acc, e);
  }
  s = _mm512_reduce_add_ps(acc);
#elif defined(DYNAMOE_AVX2)
  const __m256 m = _mm256_set1_ps(mx);
  __m256 acc = _mm256_setzero_ps();
  for (; j + 8 <= n; j += 8) {
    const __m256 e = exp8(_mm256_sub_ps(_mm256_loadu_ps(p + j), m));
    _mm256_storeu_ps(p + j, e);
    acc = _mm256_add_ps(acc, e);
  }
  s = avx2::reduce_add(acc);
#endif
  for (; j < n; ++j) {
    p[j] = std::exp(p[j] - mx);
    s += p[j];
  }
  return s;
}

template <typename scalar_t>
inline float round_to(float v) { return static_cast<float>(static_cast<scalar_t>(v)); }

// RMSNorm of one row: h = x / sqrt(mean(x^2) + eps) in fp32; out = w * h with h rounded to x's dtype
// first (Llama/Qwen/DeepSeek), or w * h in fp32 (weight_fp32: GPT-OSS), rounded to x's dtype. zero_centered:
// the scale is 1 + w, in fp32 (Qwen3-Next, Step-3.5: (h * (1 + w)) in fp32, then rounded; weight_fp32 implied).
template <typename scalar_t>
inline void rms_row(const scalar_t* x, const scalar_t* w, int64_t dim, float eps, bool weight_fp32, scalar_t* out,
                    bool zero_centered = false) {
  float ss = 0.f;
  for (int64_t i = 0; i < dim; ++i) {
    const float v = static_cast<float>(x[i]);
    ss += v * v;
  }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
  for (int64_t i = 0; i < dim; ++i) {
    const float h = static_cast<float>(x[i]) * r;
    out[i] = zero_centered ? static_cast<scalar_t>((static_cast<float>(w[i]) + 1.f) * h)
           : weight_fp32 ? static_cast<scalar_t>(static_cast<float>(w[i]) * h)
                         : static_cast<scalar_t>(static_cast<float>(w[i]) * round_to<scalar_t>(h));
  }
}

// Rotary embedding of one head row x [d] with cos/sin [half]: half-split pairs (i, i + half), or
// interleaved pairs (2i, 2i + 1) written out half-split; dims past 2 * half pass through. Products
// and sums rounded to the dtype as torch's op-by-op path does. out must not alias x.
template <typename scalar_t>
inline void rope_row(const scalar_t* x, const scalar_t* c, const scalar_t* s, int64_t half, int64_t d,
                     bool interleaved, scalar_t* out) {
  for (int64_t i = 0; i < half; ++i) {
    const float x1 = static_cast<float>(interleaved ? x[2 * i] : x[i]);
    const float x2 = static_cast<float>(interleaved ? x[2 * i + 1] : x[i + half]);
    const float ci = static_cast<float>(c[i]), si = static_cast<float>(s[i]);
    out[i] = static_cast<scalar_t>(round_to<scalar_t>(x1 * ci) - round_to<scalar_t>(x2 * si));
    out[i + half] = static_cast<scalar_t>(round_to<scalar_t>(x2 * ci) + round_to<scalar_t>(x1 * si));
  }
  for (int64_t i = 2 * half; i < d; ++i) out[i] = x[i];
}
}  // namespace dynamoe
