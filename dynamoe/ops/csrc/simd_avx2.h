// AVX2 + FMA (+ F16C) building blocks for the kernels' paths on CPUs without AVX-512 (most client x86 CPUs, AMD
// before Zen 4): DYNAMOE_AVX2 is defined where those paths are compiled (AVX2 and FMA, no AVX-512 -- an
// AVX-512 build takes the wider paths instead).
#pragma once
#if defined(__AVX2__) && defined(__FMA__) && defined(__F16C__) && !defined(__AVX512F__)
#define DYNAMOE_AVX2 1
#include <immintrin.h>
#include <cstdint>

namespace dynamoe::avx2 {

// 16 bf16 words -> their even words (0, 2, ..) and odd words (1, 3, ..) as fp32, exactly: a bf16 is the
// high half of its fp32. Dot products of two such splits in the same order are the dot product itself.
inline void bf16x16_even_odd(const void* p, __m256& even, __m256& odd) {
  const __m256i v = _mm256_loadu_si256(static_cast<const __m256i*>(p));
  even = _mm256_castsi256_ps(_mm256_slli_epi32(v, 16));
  odd = _mm256_castsi256_ps(_mm256_and_si256(v, _mm256_set1_epi32(static_cast<int32_t>(0xFFFF0000u))));
}

// 8 bf16 words -> fp32, in order
inline __m256 bf16x8(const void* p) {
  return _mm256_castsi256_ps(_mm256_slli_epi32(_mm256_cvtepu16_epi32(_mm_loadu_si128(static_cast<const __m128i*>(p))), 16));
}

inline float reduce_add(__m256 v) {
  __m128 s = _mm_add_ps(_mm256_castps256_ps128(v), _mm256_extractf128_ps(v, 1));
  s = _mm_add_ps(s, _mm_movehl_ps(s, s));
  s = _mm_add_ss(s, _mm_movehdup_ps(s));
  return _mm_cvtss_f32(s);
}

}  // namespace dynamoe::avx2
#endif
