// bf16 GEMV for decode-sized batches: out[t, o] = sum_i x[t, i] * W[o, i] (+ bias[o]), x and W bf16,
// fp32 accumulation (AVX512-BF16 dot products where the CPU has them, AVX2 FMAs on the widened words where
// it has those, a scalar loop elsewhere).
// Registered in packed_gemv.cpp's module (one extension).
#include <torch/extension.h>
#include "decode_ops.h"
#include "token_chunks.h"
#include "gemv_blocks.h"
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cstdint>
#if defined(__AVX512BF16__) || (defined(__AVX2__) && defined(__FMA__))
#include <immintrin.h>
#endif
#include "simd_avx2.h"

namespace {
constexpr int kRowBlock = dynamoe::kGemvRowBlock;
constexpr int kPrefetchAhead = 8192;

// R consecutive weight rows at once for TT tokens: R*TT accumulators in registers, every x vector
// loaded once per R rows and every weight vector once per TT tokens.
template <int TT, int R>
void bf16_rows(const c10::BFloat16* w, int64_t I, const c10::BFloat16* x, int64_t x_stride, float* acc_out) {
  float acc_s[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc_s[r][t] = 0.f;
  int64_t i = 0;
#if defined(__AVX512BF16__)
  __m512 acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm512_setzero_ps();
  for (; i + 32 <= I; i += 32) {
    __m512bh wv[R];
    // each row's line kPrefetchAhead bytes on, as it is read: cold weights keep streaming in (measured on
    // 2 cores: +10-18 % over prefetching the whole next block at once, most for short rows)
    for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + r * I + i) + kPrefetchAhead, _MM_HINT_T0);
    for (int r = 0; r < R; ++r) wv[r] = (__m512bh)_mm512_loadu_si512(w + r * I + i);
    for (int t = 0; t < TT; ++t) {
      const __m512bh xv = (__m512bh)_mm512_loadu_si512(x + t * x_stride + i);
      for (int r = 0; r < R; ++r) acc[r][t] = _mm512_dpbf16_ps(acc[r][t], wv[r], xv);
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc_s[r][t] = _mm512_reduce_add_ps(acc[r][t]);
#elif defined(DYNAMOE_AVX2)
  // 16 bf16 words per load: the even words widened by a shift, the odd ones by a mask -- the same
  // permutation of x and w, so their dot product is the sum of both halves' FMAs
  __m256 acc[R][TT];
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc[r][t] = _mm256_setzero_ps();
  for (; i + 16 <= I; i += 16) {
    __m256 we[R], wo[R];
    for (int r = 0; r < R; ++r) _mm_prefetch(reinterpret_cast<const char*>(w + r * I + i) + kPrefetchAhead, _MM_HINT_T0);
    for (int r = 0; r < R; ++r) dynamoe::avx2::bf16x16_even_odd(w + r * I + i, we[r], wo[r]);
    for (int t = 0; t < TT; ++t) {
      __m256 xe, xo;
      dynamoe::avx2::bf16x16_even_odd(x + t * x_stride + i, xe, xo);
      for (int r = 0; r < R; ++r) acc[r][t] = _mm256_fmadd_ps(wo[r], xo, _mm256_fmadd_ps(we[r], xe, acc[r][t]));
    }
  }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc_s[r][t] = dynamoe::avx2::reduce_add(acc[r][t]);
#endif
  for (; i < I; ++i)
    for (int r = 0; r < R; ++r) {
      const float wi = static_cast<float>(w[r * I + i]);
      for (int t = 0; t < TT; ++t) acc_s[r][t] += wi * static_cast<float>(x[t * x_stride + i]);
    }
  for (int r = 0; r < R; ++r)
    for (int t = 0; t < TT; ++t) acc_out[r * 8 + t] = acc_s[r][t];
}

}  // namespace

namespace dynamoe {
// Output rows [o0, o0 + R) (fewer at the end) of one weight for all T rows of x.
void row_block(const c10::BFloat16* wp, int64_t O, int64_t I, int64_t o0, const c10::BFloat16* xp, int64_t xs,
               int64_t T, const c10::BFloat16* bp, c10::BFloat16* op, int64_t os) {
  constexpr int R = kRowBlock;
  float acc[R * 8];
  const int rows = static_cast<int>(std::min<int64_t>(R, O - o0));
  dynamoe::for_token_chunks(T, [&]<int TT>(int64_t t0) {
    if (rows == R) bf16_rows<TT, R>(wp + o0 * I, I, xp + t0 * xs, xs, acc);
    else for (int r = 0; r < rows; ++r) bf16_rows<TT, 1>(wp + (o0 + r) * I, I, xp + t0 * xs, xs, acc + r * 8);
    for (int r = 0; r < rows; ++r) {
      const float b = bp ? static_cast<float>(bp[o0 + r]) : 0.f;
      for (int t = 0; t < TT; ++t) op[(t0 + t) * os + o0 + r] = c10::BFloat16(acc[r * 8 + t] + b);
    }
  });
}

// Work items per thread: at least ~1 MiB of weights, so small matrices stay on one thread (a
// parallel region costs microseconds, and far more when another process holds the other cores).
int64_t grain_blocks(int64_t I, int64_t elem) { return std::max<int64_t>(1, (int64_t{1} << 20) / (kRowBlock * I * elem)); }
}  // namespace dynamoe

namespace {
using dynamoe::grain_blocks;
using dynamoe::row_block;

void check_x_out(const torch::Tensor& x, const torch::Tensor& out, int64_t I, int64_t O) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kBFloat16 && x.stride(1) == 1, "x must be bf16 [T, I] with unit stride");
  TORCH_CHECK(x.size(1) == I, "x has ", x.size(1), " features, w expects ", I);
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == O && out.stride(1) == 1 &&
              out.scalar_type() == torch::kBFloat16, "out must be bf16 [T, O] with unit stride");
}

}  // namespace

void bf16_gemv_out(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, torch::Tensor out) {
  TORCH_CHECK(w.dim() == 2 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous(), "w must be contiguous bf16 [O, I]");
  const int64_t I = w.size(1), O = w.size(0), T = x.size(0);
  check_x_out(x, out, I, O);
  const c10::BFloat16* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->numel() == O && bias->scalar_type() == torch::kBFloat16 && bias->is_contiguous(), "bias must be contiguous bf16 [O]");
    bp = bias->data_ptr<c10::BFloat16>();
  }
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const c10::BFloat16* wp = w.data_ptr<c10::BFloat16>();
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const int64_t xs = x.stride(0), os = out.stride(0);
  at::parallel_for(0, (O + kRowBlock - 1) / kRowBlock, grain_blocks(I), [&](int64_t begin, int64_t end) {
    for (int64_t blk = begin; blk < end; ++blk) row_block(wp, O, I, blk * kRowBlock, xp, xs, T, bp, op, os);
  });
}

// Several experts at once (decode): group g multiplies rows [off_g, off_g + rows_g) of x by expert
// e_g's weight [O, I] (w is [E, O, I]); one parallel region for all groups.
void bf16_grouped_gemv_out(torch::Tensor x, torch::Tensor w, torch::Tensor groups, c10::optional<torch::Tensor> bias,
                           torch::Tensor out) {
  TORCH_CHECK(w.dim() == 3 && w.scalar_type() == torch::kBFloat16 && w.is_contiguous(), "w must be contiguous bf16 [E, O, I]");
  const int64_t E = w.size(0), O = w.size(1), I = w.size(2);
  check_x_out(x, out, I, O);
  TORCH_CHECK(groups.dim() == 2 && groups.size(1) == 3 && groups.scalar_type() == torch::kLong && groups.is_contiguous() &&
              groups.device().is_cpu(), "groups must be a contiguous int64 CPU tensor [G, 3] of (expert, row offset, rows)");
  const c10::BFloat16* bp = nullptr;
  if (bias.has_value()) {
    TORCH_CHECK(bias->dim() == 2 && bias->size(0) == E && bias->size(1) == O && bias->scalar_type() == torch::kBFloat16 &&
                bias->is_contiguous(), "bias must be contiguous bf16 [E, O]");
    bp = bias->data_ptr<c10::BFloat16>();
  }
  const int64_t G = groups.size(0), N = x.size(0);
  const int64_t* gp = groups.data_ptr<int64_t>();
  for (int64_t g = 0; g < G; ++g)
    TORCH_CHECK(gp[3 * g] >= 0 && gp[3 * g] < E && gp[3 * g + 1] >= 0 && gp[3 * g + 2] >= 1 && gp[3 * g + 2] <= 8 &&
                gp[3 * g + 1] + gp[3 * g + 2] <= N, "group ", g, " is out of range (expert < ", E, ", rows 1..8 within ", N, ")");
  const c10::BFloat16* xp = x.data_ptr<c10::BFloat16>();
  const c10::BFloat16* wp = w.data_ptr<c10::BFloat16>();
  c10::BFloat16* op = out.data_ptr<c10::BFloat16>();
  const int64_t xs = x.stride(0), os = out.stride(0), blocks = (O + kRowBlock - 1) / kRowBlock;
  at::parallel_for(0, G * blocks, grain_blocks(I), [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / blocks, e = gp[3 * g], off = gp[3 * g + 1];
      row_block(wp + e * O * I, O, I, (item % blocks) * kRowBlock, xp + off * xs, xs, gp[3 * g + 2],
                bp ? bp + e * O : nullptr, op + off * os, os);
    }
  });
}
