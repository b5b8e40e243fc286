// A decode step's routed GLU experts with packed weights (blockwise FP8, MXFP4, NVFP4, INT4) in one call, as
// moe_decode.cpp does for bf16/fp32: tokens grouped by expert (each expert's packed bytes read once for
// all its tokens), gate_up rows in one parallel region, the activation in fp32, down rows in a second
// region, the weighted sum per token in fp32. Biases and out are fp32; x is fp32, or bf16 with bf16_acts:
// then the activations go into the bf16 row kernels of packed_rows.h (weights decoded into bf16 words:
// AVX512-BF16 dot products for an expert's single token, fp32 FMAs on the widened words for several;
// where those kernels are not compiled in, x is widened to fp32) and the GLU output h is rounded to bf16
// before the down projection, as bf16 experts do. With acts == PackedActs::kInt8 (4-bit formats) x and h
// are quantized to int8 per 32 elements instead (packed_int8.h; h after its bf16 rounding when x is bf16)
// for VNNI dot products. Fills load[E] and returns the largest load.
//
// A packed weight [E, O, I] is three tensors and two ints, by format:
//   0 FP8:   a = e4m3 bytes [E, O, I], b = fp32 scales [E, ceil(O/blk0), ceil(I/blk1)]
//   1 MXFP4: a = blocks [E, O, I/32, 16], b = e8m0 scales [E, O, I/32]
//   2 NVFP4: a = packed [E, O, I/2], b = e4m3 scales [E, O, I/16], c = fp32 global scales [E]
//   3 INT4:  a = the int32 words as bytes [E, O, I/2], b = fp32 / bf16 / fp16 scales [E, O, ceil(I/group)],
//            blk0 = group (a multiple of 16, as I) -- compressed-tensors pack-quantized (dynamoe/quant/int4.py)
#include <torch/extension.h>
#include "decode_ops.h"
#include <ATen/Parallel.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <vector>
#include "decode_pairs.h"
#include "packed_int8.h"
#include "packed_rows.h"
#include "token_chunks.h"

namespace {
using namespace dynamoe::packed;
constexpr int64_t kRowsPerItem = 16;

struct Packed {
  int64_t fmt, E, O, I, blk0 = 1, blk1 = 1;
  const uint8_t* a;
  const uint8_t* b8 = nullptr;     // MXFP4 / NVFP4 scales
  const float* bf = nullptr;       // FP8 scales
  const float* global = nullptr;   // NVFP4
  const uint8_t* sw = nullptr;     // INT4 scales (words of `words`, ScaleWords)
  int words = kScaleF32;
};

int int4_scale_words(const torch::Tensor& s, const char* name) {
  if (s.scalar_type() == torch::kFloat32) return kScaleF32;
  if (s.scalar_type() == torch::kBFloat16) return kScaleBF16;
  TORCH_CHECK(s.scalar_type() == torch::kHalf, name, ": INT4 scales must be float32, bfloat16 or float16, got ", s.scalar_type());
  return kScaleF16;
}

Packed packed_weight(int64_t fmt, const torch::Tensor& a, const torch::Tensor& b, const torch::Tensor& c, int64_t blk0,
                     int64_t blk1, const char* name) {
  TORCH_CHECK(a.is_contiguous() && b.is_contiguous() && a.element_size() == 1, name, ": packed tensors must be contiguous bytes");
  Packed w{fmt, a.size(0), a.size(1), 0};
  w.a = static_cast<const uint8_t*>(a.data_ptr());
  if (fmt == 0) {
    TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && b.scalar_type() == torch::kFloat && blk0 >= 1 && blk1 >= 1, name,
                ": FP8 needs bytes [E, O, I] and fp32 scales [E, R, C]");
    w.I = a.size(2);
    w.blk0 = blk0;
    w.blk1 = blk1;
    TORCH_CHECK(b.size(0) == w.E && b.size(1) == (w.O + blk0 - 1) / blk0 && b.size(2) == (w.I + blk1 - 1) / blk1, name,
                ": FP8 scales must be [E, ceil(O/", blk0, "), ceil(I/", blk1, ")]");
    w.bf = b.data_ptr<float>();
  } else if (fmt == 1) {
    TORCH_CHECK(a.dim() == 4 && a.size(3) == 16 && b.dim() == 3 && b.size(0) == w.E && b.size(1) == w.O &&
                b.size(2) == a.size(2) && b.element_size() == 1, name, ": MXFP4 needs blocks [E, O, I/32, 16], scales [E, O, I/32]");
    w.I = a.size(2) * 32;
    w.b8 = static_cast<const uint8_t*>(b.data_ptr());
  } else if (fmt == 3) {
    TORCH_CHECK(a.dim() == 3 && b.dim() == 3 && b.size(0) == w.E && b.size(1) == w.O, name,
                ": INT4 needs packed bytes [E, O, I/2], scales [E, O, ceil(I/group)]");
    w.I = a.size(2) * 2;
    w.blk0 = blk0;
    TORCH_CHECK(blk0 >= 16 && blk0 % 16 == 0 && w.I % 16 == 0, name, ": INT4 kernels need group_size and in_features "
                "divisible by 16, got group_size ", blk0, ", in_features ", w.I);
    TORCH_CHECK(b.size(2) == (w.I + blk0 - 1) / blk0, name, ": INT4 scales must be [E, O, ceil(I/", blk0, ")]");
    w.words = int4_scale_words(b, name);
    w.sw = static_cast<const uint8_t*>(b.data_ptr());
  } else {
    TORCH_CHECK(fmt == 2 && a.dim() == 3 && b.dim() == 3 && b.element_size() == 1 && b.size(0) == w.E && b.size(1) == w.O,
                name, ": format must be 0 (FP8), 1 (MXFP4), 2 (NVFP4) or 3 (INT4); NVFP4 needs packed [E, O, I/2], scales [E, O, I/16]");
    w.I = a.size(2) * 2;
    TORCH_CHECK(w.I % 16 == 0 && b.size(2) == w.I / 16, name, ": NVFP4 scales must be [E, O, I/16]");
    TORCH_CHECK(c.numel() == w.E && c.scalar_type() == torch::kFloat && c.is_contiguous(), name,
                ": NVFP4 needs fp32 global scales [E]");
    w.b8 = static_cast<const uint8_t*>(b.data_ptr());
    w.global = c.data_ptr<float>();
  }
  return w;
}

// The activations [pairs, I] of one weight, in the forms the row kernels take: fp32 x (FP8) or its even
// and odd halves xe, xo [pairs, I/2] (FP4); or (bf16 path) bf16 words q [pairs, qs] laid out by
// fp8_bf16_acts / fp4_bf16_acts and their fp32 values qf [pairs, qs] by fp8_f32_acts / fp4_f32_acts.
struct Acts {
  const float* x = nullptr;
  const float* xe = nullptr;
  const float* xo = nullptr;
  const uint16_t* q = nullptr;  // one-token chunks (dot products)
  const float* qf = nullptr;    // the same in the widened kernels' fp32 layout (chunks of several tokens)
  int64_t qs = 0;
  const I8Acts* i8 = nullptr;   // int8 activations [pairs] (PackedActs::kInt8; 4-bit formats)
};

// rows [o0, o1) of expert e for the Tg pairs from pair `off` of a
void rows(const Packed& w, int64_t e, int64_t o0, int64_t o1, const Acts& a, int64_t off, int64_t Tg, float* out,
          int64_t out_stride) {
  const ByteTables& tab = byte_tables();
  const int64_t I = w.I, h = I / 2;
  // the bf16-activation layouts (null when the activations are fp32, or the bf16 kernels are not built in)
  const uint16_t* xq = a.q ? a.q + off * a.qs : nullptr;
  const float* xqf = a.q ? a.qf + off * a.qs : nullptr;
  if (w.fmt == 0) {
    const int64_t C = (I + w.blk1 - 1) / w.blk1, R = (w.O + w.blk0 - 1) / w.blk0;
    const uint8_t* q = w.a + e * w.O * I;
    const float* s = w.bf + e * R * C;
    const int64_t ahead = prefetch_ahead_rows(I);
    if (o0 == 0) prefetch_first_rows(q, 0, w.O, I, ahead);  // an expert's first rows (later ones: ahead)
    for (int64_t o = o0; o < o1; ++o) {
      prefetch_row(q, o, w.O, I, ahead);
#if defined(DYNAMOE_PACKED_BF16)
      if (xq) {
        dynamoe::for_token_chunks(Tg, [&]<int TT>(int64_t t0) {
          fp8_row_acts<TT>(q + o * I, I, xq + t0 * a.qs, xqf + t0 * a.qs, a.qs, s + (o / w.blk0) * C, w.blk1,
                           out + t0 * out_stride + o, out_stride);
        });
        continue;
      }
#endif
      const float* x = a.x + off * I;
      dynamoe::for_token_chunks(Tg, [&]<int TT>(int64_t t0) {
        fp8_row<TT>(q + o * I, I, x + t0 * I, s + (o / w.blk0) * C, w.blk1, tab.e4m3, out + t0 * out_stride + o, out_stride);
      });
    }
    return;
  }
  // kernel groups of 32 elements (16 bytes: MXFP4, INT4 with group % 32 == 0) or 16 (8 bytes: NVFP4, other INT4)
  const int64_t kg = w.fmt == 1 ? 32 : w.fmt == 3 ? int4_kernel_group(w.blk0) : 16;
  const int64_t G = (I + kg - 1) / kg;
  // the bf16 kernels read whole 64-byte steps of scales (4 or 8 groups): zeros past the row's groups
  const int64_t steps = (h + kFp4StepBytes - 1) / kFp4StepBytes, gstride = std::max(G, steps * (kFp4StepElems / kg));
  std::vector<float> gs(gstride, 0.f);
  const int64_t Gs = w.fmt == 3 ? (I + w.blk0 - 1) / w.blk0 : G;  // scales per row on disk
  const int64_t srow_bytes = w.fmt == 3 ? Gs * (w.words == kScaleF32 ? 4 : 2) : G;
  const uint8_t* scales = w.fmt == 3 ? w.sw : w.b8;
  float e4m3[256];
  if (w.fmt == 2)
    for (int v = 0; v < 256; ++v) e4m3[v] = tab.e4m3[v] * w.global[e];
  const float* xe = a.xe ? a.xe + off * h : nullptr;
  const float* xo = a.xo ? a.xo + off * h : nullptr;
  const int64_t ahead = prefetch_ahead_rows(h);
  if (o0 == 0) prefetch_first_rows(w.a + e * w.O * h, 0, w.O, h, ahead);  // an expert's first rows
  for (int64_t o = o0; o < o1; ++o) {
    const uint8_t* srow = scales + (e * w.O + o) * srow_bytes;
    const uint8_t* prow = w.a + (e * w.O + o) * h;
    prefetch_row(w.a + e * w.O * h, o, w.O, h, ahead);  // the packed bytes of the row `ahead` rows on
    prefetch_row(scales + e * w.O * srow_bytes, o, w.O, srow_bytes, ahead);  // and its scales
    if (w.fmt == 3) {
      int4_row_scales(srow, w.words, G, w.blk0 / kg, gs.data());
      if (a.i8 && kg == 32) fp4_row_tokens_i8<16, Int4Codec>(prow, h, Tg, *a.i8, off, gs.data(), out + o, out_stride);
      else if (a.i8) fp4_row_tokens_i8<8, Int4Codec>(prow, h, Tg, *a.i8, off, gs.data(), out + o, out_stride);
      else if (kg == 32) fp4_row_tokens<16, Int4Codec>(prow, h, Tg, xq, xqf, a.qs, xe, xo, gs.data(), out + o, out_stride);
      else fp4_row_tokens<8, Int4Codec>(prow, h, Tg, xq, xqf, a.qs, xe, xo, gs.data(), out + o, out_stride);
    } else if (w.fmt == 1) {
      e8m0_row_scales(srow, G, tab.e8m0, gs.data());
      if (a.i8) fp4_row_tokens_i8<16>(prow, h, Tg, *a.i8, off, gs.data(), out + o, out_stride);
      else fp4_row_tokens<16>(prow, h, Tg, xq, xqf, a.qs, xe, xo, gs.data(), out + o, out_stride);
    } else {
      nvfp4_row_scales(srow, G, w.global[e], e4m3, gs.data());
      if (a.i8) fp4_row_tokens_i8<8>(prow, h, Tg, *a.i8, off, gs.data(), out + o, out_stride);
      else fp4_row_tokens<8>(prow, h, Tg, xq, xqf, a.qs, xe, xo, gs.data(), out + o, out_stride);
    }
  }
}

// one weight over all groups: activations [pairs, I] -> out [pairs, O], one parallel region
void run(const Packed& w, const std::vector<int64_t>& groups, const Acts& a, const float* bias, float* out) {
  const int64_t G = static_cast<int64_t>(groups.size()) / 3, O = w.O;
  const int64_t chunks = (O + kRowsPerItem - 1) / kRowsPerItem;
  at::parallel_for(0, G * chunks, 1, [&](int64_t begin, int64_t end) {
    for (int64_t item = begin; item < end; ++item) {
      const int64_t g = item / chunks, e = groups[3 * g], off = groups[3 * g + 1], n = groups[3 * g + 2];
      const int64_t o0 = (item % chunks) * kRowsPerItem, o1 = std::min(O, o0 + kRowsPerItem);
      rows(w, e, o0, o1, a, off, n, out + off * O, O);
      if (bias)
        for (int64_t t = 0; t < n; ++t)
          for (int64_t o = o0; o < o1; ++o) out[(off + t) * O + o] += bias[e * O + o];
    }
  });
}

// Activations [P, I] as bf16 words (in order) into the bf16 kernels' layout for format fmt
void bf16_layout(int64_t fmt, const uint16_t* x, int64_t P, int64_t I, std::vector<uint16_t>& q, std::vector<float>& qf,
                 Acts& a) {
  a.qs = fmt == 0 ? fp8_bf16_stride(I) : fp4_bf16_stride(I);
  q.resize(P * a.qs);
  qf.resize(P * a.qs);
  if (fmt == 0) {
    fp8_bf16_acts(x, P, I, I, q.data());
    fp8_f32_acts(x, P, I, I, qf.data());
  } else {
    fp4_bf16_acts(x, P, I, I, q.data());
    fp4_f32_acts(x, P, I, I, qf.data());
  }
  a.q = q.data();
  a.qf = qf.data();
}

// fp32 activations [P, I] in the fp32 kernels' layout: x itself (FP8) or its halves (FP4)
void fp32_layout(int64_t fmt, const float* x, int64_t P, int64_t I, std::vector<float>& xe, std::vector<float>& xo,
                 Acts& a) {
  a.x = x;
  if (fmt != 0) {
    split_even_odd(x, P, I, xe, xo);
    a.xe = xe.data();
    a.xo = xo.data();
  }
}

// fp32 activations [P, I] quantized to int8 for format fmt's codec (packed_int8.h)
void int8_layout(int64_t fmt, const float* x, int64_t P, int64_t I, I8Acts& q, Acts& a) {
  if (fmt == 3) i8_acts<Int4Codec>(x, P, I, I, q);
  else i8_acts<E2M1Codec>(x, P, I, I, q);
  a.i8 = &q;
}
}  // namespace

int64_t packed_moe_glu_decode_out(int64_t fmt, torch::Tensor x, torch::Tensor ids, torch::Tensor weights,
                                  torch::Tensor w1a, torch::Tensor w1b, torch::Tensor w1c, torch::Tensor w2a,
                                  torch::Tensor w2b, torch::Tensor w2c, int64_t blk0, int64_t blk1,
                                  c10::optional<torch::Tensor> b1, c10::optional<torch::Tensor> b2, int64_t act,
                                  double alpha, double limit, torch::Tensor out, torch::Tensor load, bool bf16_acts,
                                  PackedActs acts) {
  TORCH_CHECK(acts == PackedActs::kExact || acts == PackedActs::kInt8, "acts must be PackedActs.exact or .int8");
  const bool int8 = acts == PackedActs::kInt8;
  TORCH_CHECK(!int8 || fmt != 0, "int8 activations are for the 4-bit formats (MXFP4, NVFP4, INT4), not FP8");
  const Packed w1 = packed_weight(fmt, w1a, w1b, w1c, blk0, blk1, "w1");
  const Packed w2 = packed_weight(fmt, w2a, w2b, w2c, blk0, blk1, "w2");
  const int64_t E = w1.E, F2 = w1.O, F = F2 / 2, D = w1.I, O = w2.O;
  TORCH_CHECK(F2 % 2 == 0 && w2.E == E && w2.I == F, "w2 must be [", E, ", O, ", F, "] for w1 [", E, ", ", F2, ", ", D, "]");
  TORCH_CHECK(x.dim() == 2 && x.scalar_type() == (bf16_acts ? torch::kBFloat16 : torch::kFloat) && x.is_contiguous() &&
              x.size(1) == D, "x must be contiguous ", bf16_acts ? "bf16" : "fp32", " [T, ", D, "]");
  TORCH_CHECK(out.dim() == 2 && out.size(0) == x.size(0) && out.size(1) == O && out.scalar_type() == torch::kFloat &&
              out.is_contiguous(), "out must be contiguous fp32 [T, ", O, "]");
  TORCH_CHECK(act >= 0 && act <= dynamoe::kSiluClampIn,
              "act must be a GLU activation 0..6 (silu, gelu, gelu_tanh, relu, gpt_oss, silu_clamp, silu_clamp_in), got ",
              act);
  const float* bp1 = nullptr;
  const float* bp2 = nullptr;
  if (b1.has_value()) {
    TORCH_CHECK(b1->dim() == 2 && b1->size(0) == E && b1->size(1) == F2 && b1->scalar_type() == torch::kFloat &&
                b1->is_contiguous(), "b1 must be contiguous fp32 [E, 2F]");
    bp1 = b1->data_ptr<float>();
  }
  if (b2.has_value()) {
    TORCH_CHECK(b2->dim() == 2 && b2->size(0) == E && b2->size(1) == O && b2->scalar_type() == torch::kFloat &&
                b2->is_contiguous(), "b2 must be contiguous fp32 [E, O]");
    bp2 = b2->data_ptr<float>();
  }

  const int64_t T = x.size(0);
  const dynamoe::DecodePairs d = dynamoe::group_pairs(ids, weights, T, E, load);
  const int64_t P = static_cast<int64_t>(d.pair_token.size());
  // bf16 activations go through the bf16 kernels (FP8: when whole 32-element steps fit in its scale
  // blocks); elsewhere, or without AVX512-BF16, they are widened to fp32 (exactly) for the fp32 kernels.
  const bool bf16_kernels = !int8 && kPackedBf16 && bf16_acts && (fmt != 0 || blk1 % kFp8StepElems == 0);

  std::vector<float> xf, xe, xo;
  std::vector<uint16_t> xq, hq;
  std::vector<float> xqf, hqf;
  Acts a1, a2;
  I8Acts xi, hi;
  if (bf16_kernels) {
    std::vector<uint16_t> xg(P * D);
    dynamoe::gather_pairs(d, reinterpret_cast<const uint16_t*>(x.data_ptr()), D, xg.data());
    bf16_layout(fmt, xg.data(), P, D, xq, xqf, a1);
  } else {
    xf.resize(P * D);
    if (bf16_acts) {
      const uint16_t* xb = reinterpret_cast<const uint16_t*>(x.data_ptr());
      for (int64_t p = 0; p < P; ++p)
        for (int64_t i = 0; i < D; ++i) xf[p * D + i] = bf16_float(xb[d.pair_token[p] * D + i]);
    } else {
      dynamoe::gather_pairs(d, x.data_ptr<float>(), D, xf.data());
    }
    if (int8) int8_layout(fmt, xf.data(), P, D, xi, a1);
    else fp32_layout(fmt, xf.data(), P, D, xe, xo, a1);
  }
  std::vector<float> gu(P * F2);
  run(w1, d.groups, a1, bp1, gu.data());

  // the activation in fp32; with bf16 activations h is rounded to bf16 (as bf16 experts do)
  std::vector<float> hbuf(P * F);
  std::vector<uint16_t> hb(bf16_acts ? P * F : 0);
  const float a = static_cast<float>(alpha), lim = static_cast<float>(limit);
  for (int64_t p = 0; p < P; ++p)
    for (int64_t f = 0; f < F; ++f) {
      const float v = dynamoe::glu_value(gu[p * F2 + f], gu[p * F2 + F + f], act, a, lim);
      if (bf16_acts) {
        hb[p * F + f] = bf16_bits(v);
        hbuf[p * F + f] = bf16_float(hb[p * F + f]);
      } else {
        hbuf[p * F + f] = v;
      }
    }
  if (bf16_kernels) bf16_layout(fmt, hb.data(), P, F, hq, hqf, a2);
  else if (int8) int8_layout(fmt, hbuf.data(), P, F, hi, a2);
  else fp32_layout(fmt, hbuf.data(), P, F, xe, xo, a2);
  std::vector<float> y(P * O);
  run(w2, d.groups, a2, bp2, y.data());

  dynamoe::combine_pairs(d, y.data(), T, O, out.data_ptr<float>());
  return d.max_load;
}
