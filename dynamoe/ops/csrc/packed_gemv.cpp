// Fused dequantize-and-multiply for decode-sized batches on CPU: y[t, o] = sum_i x[t, i] * W[o, i]
// with W packed as MXFP4, NVFP4 or blockwise FP8. Each weight byte is read once, decoded in
// registers and used for all T tokens; no dequantized copy of the weight is ever written.
// AVX-512 path (permute-based e2m1 lookup, arithmetic e4m3 decode) with a portable scalar fallback.
#include <torch/extension.h>
#include "token_chunks.h"
#include <ATen/Parallel.h>
#include <cmath>
#include <cstdint>
#include <algorithm>
#include <cstring>
#include <vector>
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

constexpr int kMaxT = 16;  // rows per call (processed in chunks of 8)
const float kE2M1[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};

inline float e4m3_value(uint8_t b) {
  const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  if (e == 15 && m == 7) return NAN;
  const float v = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.f + m / 8.f, e - 7);
  return s ? -v : v;
}

inline float e8m0_value(uint8_t b) { return b == 255 ? NAN : std::ldexp(1.f, static_cast<int>(b) - 127); }

void check_x(const torch::Tensor& x, int64_t in_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous float32 CPU tensor [T, I]");
  TORCH_CHECK(x.size(1) == in_features, "x has ", x.size(1), " features, the weight expects ", in_features);
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxT, "packed gemv takes 1..", kMaxT, " rows, got ", x.size(0));
}

// x split into even and odd elements: the low nibble of byte j holds element 2j, the high one 2j+1.
void split_even_odd(const float* x, int64_t T, int64_t I, std::vector<float>& xe, std::vector<float>& xo) {
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

}  // namespace

torch::Tensor mxfp4_gemv(torch::Tensor x, torch::Tensor blocks, torch::Tensor scales) {
  TORCH_CHECK(blocks.dim() == 3 && blocks.size(2) == 16 && blocks.scalar_type() == torch::kUInt8 && blocks.is_contiguous(),
              "blocks must be contiguous uint8 [O, I/32, 16]");
  const int64_t O = blocks.size(0), G = blocks.size(1), I = G * 32, T = x.size(0);
  TORCH_CHECK(scales.sizes() == torch::IntArrayRef({O, G}) && scales.scalar_type() == torch::kUInt8 && scales.is_contiguous(),
              "scales must be contiguous uint8 [O, I/32]");
  check_x(x, I);
  std::vector<float> xe, xo;
  split_even_odd(x.data_ptr<float>(), T, I, xe, xo);
  auto y = torch::empty({T, O}, x.options());
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  const uint8_t* sp = scales.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  float e8m0[256];
  for (int v = 0; v < 256; ++v) e8m0[v] = e8m0_value(static_cast<uint8_t>(v));
  at::parallel_for(0, O, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> gs(G);
    for (int64_t o = begin; o < end; ++o) {
      for (int64_t g = 0; g < G; ++g) gs[g] = e8m0[sp[o * G + g]];
      dynamoe::for_token_chunks(T, [&]<int TT>(int64_t t0) {
        fp4_row<TT, 16>(bp + o * (I / 2), I / 2, xe.data() + t0 * (I / 2), xo.data() + t0 * (I / 2), I / 2, gs.data(),
                        yp + t0 * O + o, O);
      });
    }
  });
  return y;
}

torch::Tensor nvfp4_gemv(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, double global_scale) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(),
              "packed must be contiguous uint8 [O, I/2]");
  const int64_t O = packed.size(0), I = packed.size(1) * 2, T = x.size(0);
  TORCH_CHECK(I % 16 == 0, "NVFP4 needs in_features divisible by 16");
  TORCH_CHECK(scale.sizes() == torch::IntArrayRef({O, I / 16}) && scale.element_size() == 1 && scale.is_contiguous(),
              "scale must be contiguous e4m3 bytes [O, I/16]");
  check_x(x, I);
  float e4m3[256];
  for (int v = 0; v < 256; ++v) e4m3[v] = e4m3_value(static_cast<uint8_t>(v)) * static_cast<float>(global_scale);
  std::vector<float> xe, xo;
  split_even_odd(x.data_ptr<float>(), T, I, xe, xo);
  auto y = torch::empty({T, O}, x.options());
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const uint8_t* sp = static_cast<const uint8_t*>(scale.data_ptr());
  float* yp = y.data_ptr<float>();
  const int64_t G = I / 16;
  at::parallel_for(0, O, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> gs(G);
    for (int64_t o = begin; o < end; ++o) {
      const uint8_t* srow = sp + o * G;
      int64_t g = 0;
#if defined(__AVX512F__)
      // e4m3 scales 16 at a time through fp16 (see fp8_row); NaN scales (0x7F) take the table
      const __m512 sv = _mm512_set1_ps(static_cast<float>(global_scale) * 256.f);
      for (; g + 16 <= G; g += 16) {
        const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(srow + g));
        const __m256i b = _mm256_cvtepu8_epi16(raw);
        const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                          _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
        _mm512_storeu_ps(gs.data() + g, _mm512_mul_ps(_mm512_cvtph_ps(h), sv));
        const __mmask16 nan = _mm_cmpeq_epi8_mask(_mm_and_si128(raw, _mm_set1_epi8(0x7F)), _mm_set1_epi8(0x7F));
        for (int l = 0; l < 16; ++l)
          if (nan >> l & 1) gs[g + l] = e4m3[srow[g + l]];
      }
#endif
      for (; g < G; ++g) gs[g] = e4m3[srow[g]];
      dynamoe::for_token_chunks(T, [&]<int TT>(int64_t t0) {
        fp4_row<TT, 8>(pp + o * (I / 2), I / 2, xe.data() + t0 * (I / 2), xo.data() + t0 * (I / 2), I / 2, gs.data(),
                       yp + t0 * O + o, O);
      });
    }
  });
  return y;
}

namespace {
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
}  // namespace

torch::Tensor fp8_block_gemv(torch::Tensor x, torch::Tensor q, torch::Tensor scale_inv, int64_t b0, int64_t b1) {
  TORCH_CHECK(q.dim() == 2 && q.element_size() == 1 && q.is_contiguous(), "q must be contiguous e4m3 bytes [O, I]");
  const int64_t O = q.size(0), I = q.size(1), T = x.size(0);
  const int64_t R = (O + b0 - 1) / b0, C = (I + b1 - 1) / b1;
  TORCH_CHECK(scale_inv.sizes() == torch::IntArrayRef({R, C}) && scale_inv.scalar_type() == torch::kFloat32 &&
                  scale_inv.is_contiguous(),
              "scale_inv must be contiguous float32 [ceil(O/b0), ceil(I/b1)]");
  check_x(x, I);
  const float* xp = x.data_ptr<float>();
  const uint8_t* qp = static_cast<const uint8_t*>(q.data_ptr());
  const float* sp = scale_inv.data_ptr<float>();
  auto y = torch::empty({T, O}, x.options());
  float* yp = y.data_ptr<float>();
  float lut[256];
  for (int v = 0; v < 256; ++v) lut[v] = e4m3_value(static_cast<uint8_t>(v));
  at::parallel_for(0, O, 16, [&](int64_t begin, int64_t end) {
    for (int64_t o = begin; o < end; ++o) {
      dynamoe::for_token_chunks(T, [&]<int TT>(int64_t t0) {
        fp8_row<TT>(qp + o * I, I, xp + t0 * I, sp + (o / b0) * C, b1, lut, yp + t0 * O + o, O);
      });
    }
  });
  return y;
}

bool has_avx512() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}

// bf16_gemv.cpp
void bf16_gemv_out(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, torch::Tensor out);
void bf16_grouped_gemv_out(torch::Tensor x, torch::Tensor w, torch::Tensor groups, c10::optional<torch::Tensor> bias,
                           torch::Tensor out);

bool has_avx512_bf16() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

int64_t moe_glu_decode_out(torch::Tensor x, torch::Tensor ids, torch::Tensor weights, torch::Tensor w_gate_up,
                           torch::Tensor w_down, c10::optional<torch::Tensor> b_gate_up,
                           c10::optional<torch::Tensor> b_down, int64_t act, double alpha, double limit,
                           torch::Tensor out, torch::Tensor load);

void rms_norm_out(torch::Tensor x, torch::Tensor w, double eps, bool weight_in_fp32, torch::Tensor out);

void rope_out(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, bool interleaved, torch::Tensor out);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("rope_out", &rope_out, "rotary embedding of x [B, H, T, d] (bf16 or fp32) with cos/sin [B, T, R/2] into out");
  m.def("rms_norm_out", &rms_norm_out, "RMSNorm of x [N, dim] (bf16 or fp32) into out, fp32 statistics");
  m.def("moe_glu_decode_out", &moe_glu_decode_out,
        "a decode step's routed GLU experts (T <= 16 rows, bf16 or fp32): out [T, O], load [E] filled; returns the max load");
  m.def("bf16_gemv_out", &bf16_gemv_out, "out [T, O] = x [T, I] @ W^T (+ bias): bf16 in and out, fp32 accumulation");
  m.def("bf16_grouped_gemv_out", &bf16_grouped_gemv_out,
        "per group (expert e, row offset, rows 1..8): out[rows] = x[rows] @ W[e]^T (+ bias[e]); W bf16 [E, O, I]");
  m.def("has_avx512_bf16", &has_avx512_bf16, "whether the AVX512-BF16 path was compiled in");
  m.def("mxfp4_gemv", &mxfp4_gemv, "y [T, O] = x [T, I] @ W^T, W MXFP4 (blocks [O, I/32, 16], e8m0 scales [O, I/32])");
  m.def("nvfp4_gemv", &nvfp4_gemv, "y [T, O] = x [T, I] @ W^T, W NVFP4 (packed [O, I/2], e4m3 scales [O, I/16], global)");
  m.def("fp8_block_gemv", &fp8_block_gemv, "y [T, O] = x [T, I] @ W^T, W blockwise FP8 (e4m3 [O, I], fp32 scales)");
  m.def("has_avx512", &has_avx512, "whether the AVX-512 path was compiled in");
}
