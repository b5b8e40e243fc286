// fp32 GEMV row blocks for decode-sized batches (used by the fused decode kernels): R weight rows
// at once for TT tokens, AVX-512 (or else AVX2) FMAs where compiled in, a scalar loop elsewhere.
#include "gemv_blocks.h"
#include "token_chunks.h"
#include <algorithm>
#include <cstdint>
#if defined(__AVX512F__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#include "simd_avx2.h"

namespace {
template <int TT, int R>
void f32_rows(const float* w, int64_t I, const float* x, int64_t x_stride, float* acc_out) {
  float acc_s[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc_s[r][t] = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__)
  __m512 acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_setzero_ps();
  for (; i + 16 <= I; i += 16) {
    __m512 wv[R];
    // each row's line 8 KiB ahead as it is read (see bf16_gemv.cpp)
    for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + r * I + i) + 8192, _MM_HINT_T0);
    for (int r = 0; r < R; ++r) wv[r] = _mm512_loadu_ps(w + r * I + i);
    for (int t = 0; t < TT; ++t) {
      const __m512 xv = _mm512_loadu_ps(x + t * x_stride + i);
      for (int r = 0; r < R; ++r) acc[r][t] = _mm512_fmadd_ps(wv[r], xv, acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc_s[r][t] = _mm512_reduce_add_ps(acc[r][t]);
#elif defined(DYNAMOE_AVX2)
  __m256 acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm256_setzero_ps();
  for (; i + 8 <= I; i += 8) {
    __m256 wv[R];
    for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + r * I + i) + 8192, _MM_HINT_T0);
    for (int r = 0; r < R; ++r) wv[r] = _mm256_loadu_ps(w + r * I + i);
    for (int t = 0; t < TT; ++t) {
      const __m256 xv = _mm256_loadu_ps(x + t * x_stride + i);
      for (int r = 0; r < R; ++r) acc[r][t] = _mm256_fmadd_ps(wv[r], xv, acc[r][t]);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc_s[r][t] = dynamoe::avx2::reduce_add(acc[r][t]);
#endif
  for (; i < I; ++i)
    for (int r = 0; r < R; ++r) {
      const float wi = w[r * I + i];
      for (int t = 0; t < TT; ++t) acc_s[r][t] += wi * x[t * x_stride + i];
    }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc_out[r * 8 + t] = acc_s[r][t];
}
}  // namespace

namespace dynamoe {
void row_block(const float* wp, int64_t O, int64_t I, int64_t o0, const float* xp, int64_t xs, int64_t T,
               const float* bp, float* op, int64_t os) {
  constexpr int R = kGemvRowBlock;
  float acc[R * 8];
  const int rows = static_cast<int>(std::min<int64_t>(R, O - o0));
  for_token_chunks(T, [&]<int TT>(int64_t t0) {
    if (rows == R) f32_rows<TT, R>(wp + o0 * I, I, xp + t0 * xs, xs, acc);
    else for (int r = 0; r < rows; ++r) f32_rows<TT, 1>(wp + (o0 + r) * I, I, xp + t0 * xs, xs, acc + r * 8);
    for (int r = 0; r < rows; ++r) {
      const float b = bp ? bp[o0 + r] : 0.f;
      for (int t = 0; t < TT; ++t) op[(t0 + t) * os + o0 + r] = acc[r * 8 + t] + b;
    }
  });
}
}  // namespace dynamoe
