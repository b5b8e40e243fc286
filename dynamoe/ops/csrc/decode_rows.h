// Row-level pieces of a decode step shared by the kernels (rms_norm.cpp, rope.cpp, attn_decode.cpp),
// each with the op-by-op path's roundings.
#pragma once
#include <c10/util/BFloat16.h>
#include <cmath>
#include <cstdint>

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

template <typename scalar_t>
inline float round_to(float v) { return static_cast<float>(static_cast<scalar_t>(v)); }

// RMSNorm of one row: h = x / sqrt(mean(x^2) + eps) in fp32; out = w * h with h rounded to x's dtype
// first (Llama/Qwen/DeepSeek), or w * h in fp32 (weight_fp32: GPT-OSS), rounded to x's dtype.
template <typename scalar_t>
inline void rms_row(const scalar_t* x, const scalar_t* w, int64_t dim, float eps, bool weight_fp32, scalar_t* out) {
  float ss = 0.f;
  for (int64_t i = 0; i < dim; ++i) {
    const float v = static_cast<float>(x[i]);
    ss += v * v;
  }
  const float r = 1.f / std::sqrt(ss / static_cast<float>(dim) + eps);
  for (int64_t i = 0; i < dim; ++i) {
    const float h = static_cast<float>(x[i]) * r;
    out[i] = weight_fp32 ? static_cast<scalar_t>(static_cast<float>(w[i]) * h)
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
