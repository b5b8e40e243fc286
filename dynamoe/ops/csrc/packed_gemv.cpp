// Fused dequantize-and-multiply for decode-sized batches on CPU: y[t, o] = sum_i x[t, i] * W[o, i]
// with W packed as MXFP4, NVFP4 or blockwise FP8. Each weight byte is read once, decoded in
// registers and used for all T tokens; no dequantized copy of the weight is ever written.
// AVX-512 path (permute-based e2m1 lookup, arithmetic e4m3 decode) with a portable scalar fallback.
#include <torch/extension.h>
#include "token_chunks.h"
#include "packed_rows.h"
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
using namespace dynamoe::packed;

void check_x(const torch::Tensor& x, int64_t in_features) {
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == torch::kFloat32 && x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous float32 CPU tensor [T, I]");
  TORCH_CHECK(x.size(1) == in_features, "x has ", x.size(1), " features, the weight expects ", in_features);
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxT, "packed gemv takes 1..", kMaxT, " rows, got ", x.size(0));
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
      nvfp4_row_scales(sp + o * G, G, static_cast<float>(global_scale), e4m3, gs.data());
      dynamoe::for_token_chunks(T, [&]<int TT>(int64_t t0) {
        fp4_row<TT, 8>(pp + o * (I / 2), I / 2, xe.data() + t0 * (I / 2), xo.data() + t0 * (I / 2), I / 2, gs.data(),
                       yp + t0 * O + o, O);
      });
    }
  });
  return y;
}

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

int64_t packed_moe_glu_decode_out(int64_t fmt, torch::Tensor x, torch::Tensor ids, torch::Tensor weights,
                                  torch::Tensor w1a, torch::Tensor w1b, torch::Tensor w1c, torch::Tensor w2a,
                                  torch::Tensor w2b, torch::Tensor w2c, int64_t blk0, int64_t blk1,
                                  c10::optional<torch::Tensor> b1, c10::optional<torch::Tensor> b2, int64_t act,
                                  double alpha, double limit, torch::Tensor out, torch::Tensor load);

int64_t moe_ffn_decode_out(torch::Tensor x, torch::Tensor ids, torch::Tensor weights, torch::Tensor w1, torch::Tensor w2,
                           c10::optional<torch::Tensor> b1, c10::optional<torch::Tensor> b2, int64_t act,
                           torch::Tensor out, torch::Tensor load);

void route_decode_out(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias,
                      c10::optional<torch::Tensor> sel_bias, int64_t kind, bool renormalize, double scale,
                      int64_t n_group, int64_t topk_group, torch::Tensor ids, torch::Tensor weights);

void attn_decode_out(torch::Tensor h, torch::Tensor norm_w, double norm_eps, bool norm_weight_fp32, torch::Tensor w_qkv,
                     c10::optional<torch::Tensor> b_qkv, c10::optional<torch::Tensor> q_norm,
                     c10::optional<torch::Tensor> k_norm, double qk_eps, torch::Tensor cos, torch::Tensor sin,
                     bool interleaved, torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor slots,
                     torch::Tensor positions, int64_t window, c10::optional<torch::Tensor> sinks, double scale,
                     torch::Tensor w_o, c10::optional<torch::Tensor> b_o, torch::Tensor out);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  m.def("attn_decode_out", &attn_decode_out,
        "a decode step of B <= 16 sequences through an attention block: out = h + o_proj(attention(RoPE(qk-norm("
        "qkv(norm(h)))))) with k/v written into the cache at (slots, positions)");
  m.def("route_decode_out", &route_decode_out,
        "router of a decode step: fp32 logits of x [T, D] @ W^T (+ bias), softmax (0) or DeepSeek sigmoid-group (1) "
        "top-k into ids [T, K] int64 and weights [T, K] fp32");
  m.def("moe_ffn_decode_out", &moe_ffn_decode_out,
        "a decode step's routed FFN experts in Tutel's layout (T <= 16 rows, bf16 or fp32): out [T, O], load [E]");
  m.def("packed_moe_glu_decode_out", &packed_moe_glu_decode_out,
        "a decode step's routed GLU experts with packed weights (0 FP8, 1 MXFP4, 2 NVFP4; T <= 16, fp32 x/out)");
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
