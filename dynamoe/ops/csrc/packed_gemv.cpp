// Fused dequantize-and-multiply for decode-sized batches on CPU: y[t, o] = sum_i x[t, i] * W[o, i]
// with W packed as MXFP4, NVFP4, INT4 (compressed-tensors pack-quantized) or blockwise FP8. Each weight byte is read once, decoded in
// registers and used for all T tokens; no dequantized copy of the weight is ever written.
// AVX-512 path (permute-based e2m1 lookup, arithmetic e4m3 decode) with a portable scalar fallback.
#include <torch/extension.h>
#include "token_chunks.h"
#include "packed_rows.h"
#include "packed_int8.h"
#include "decode_ops.h"
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

// x: fp32, or bf16 (then the bf16 kernels run where they are compiled in; the output is fp32 either way)
void check_x(const torch::Tensor& x, int64_t in_features) {
  TORCH_CHECK(x.dim() == 2 && (x.scalar_type() == torch::kFloat32 || x.scalar_type() == torch::kBFloat16) &&
                  x.is_contiguous() && x.device().is_cpu(),
              "x must be a contiguous float32 or bfloat16 CPU tensor [T, I]");
  TORCH_CHECK(x.size(1) == in_features, "x has ", x.size(1), " features, the weight expects ", in_features);
  TORCH_CHECK(x.size(0) >= 1 && x.size(0) <= kMaxT, "packed gemv takes 1..", kMaxT, " rows, got ", x.size(0));
}

bool bf16_kernels(const torch::Tensor& x) { return kPackedBf16 && x.scalar_type() == torch::kBFloat16; }

const uint16_t* bf16_words(const torch::Tensor& x) { return reinterpret_cast<const uint16_t*>(x.data_ptr()); }

// bf16 x [T, I] in the FP4 bf16 kernels' layouts: the dot products' (one token) and, for T > 1, the widened
// kernels' (fp4_row_acts)
void fp4_layouts(const torch::Tensor& x, std::vector<uint16_t>& xq, std::vector<float>& xqf) {
  const int64_t T = x.size(0), I = x.size(1), S = fp4_bf16_stride(I);
  xq.resize(T * S);
  fp4_bf16_acts(bf16_words(x), T, I, I, xq.data());
  if (T > 1) {
    xqf.resize(T * S);
    fp4_f32_acts(bf16_words(x), T, I, I, xqf.data());
  }
}

// the ScaleWords code of an INT4 weight_scale tensor
int scale_words(const torch::Tensor& s) {
  switch (s.scalar_type()) {
    case torch::kFloat32: return kScaleF32;
    case torch::kBFloat16: return kScaleBF16;
    case torch::kHalf: return kScaleF16;
    default: TORCH_CHECK(false, "INT4 scales must be float32, bfloat16 or float16, got ", s.scalar_type());
  }
  return 0;
}

// fp32 activations for the fp32 kernels (bf16 widened exactly)
torch::Tensor as_fp32(const torch::Tensor& x) { return x.scalar_type() == torch::kFloat32 ? x : x.to(torch::kFloat32); }

// Whether `acts` asks for int8 activations; checks it is a known value
bool int8_acts(PackedActs acts, const char* op) {
  TORCH_CHECK(acts == PackedActs::kExact || acts == PackedActs::kInt8, op, ": acts must be PackedActs.exact or .int8");
  return acts == PackedActs::kInt8;
}

// x [T, I] quantized to int8 per 32 elements for Codec's weights (packed_int8.h)
template <class Codec>
void int8_layout(const torch::Tensor& x, I8Acts& a) {
  const torch::Tensor xf = as_fp32(x);
  i8_acts<Codec>(xf.data_ptr<float>(), x.size(0), x.size(1), x.size(1), a);
}

}  // namespace

torch::Tensor mxfp4_gemv(torch::Tensor x, torch::Tensor blocks, torch::Tensor scales, PackedActs acts) {
  TORCH_CHECK(blocks.dim() == 3 && blocks.size(2) == 16 && blocks.scalar_type() == torch::kUInt8 && blocks.is_contiguous(),
              "blocks must be contiguous uint8 [O, I/32, 16]");
  const int64_t O = blocks.size(0), G = blocks.size(1), I = G * 32, T = x.size(0), h = I / 2;
  TORCH_CHECK(scales.sizes() == torch::IntArrayRef({O, G}) && scales.scalar_type() == torch::kUInt8 && scales.is_contiguous(),
              "scales must be contiguous uint8 [O, I/32]");
  check_x(x, I);
  const bool i8 = int8_acts(acts, "mxfp4_gemv");
  const bool bf16 = !i8 && bf16_kernels(x);
  std::vector<float> xe, xo, xqf;
  std::vector<uint16_t> xq;
  I8Acts xi;
  if (i8) int8_layout<E2M1Codec>(x, xi);
  else if (bf16) fp4_layouts(x, xq, xqf);
  else split_even_odd(as_fp32(x).data_ptr<float>(), T, I, xe, xo);
  auto y = torch::empty({T, O}, x.options().dtype(torch::kFloat32));
  const uint8_t* bp = blocks.data_ptr<uint8_t>();
  const uint8_t* sp = scales.data_ptr<uint8_t>();
  float* yp = y.data_ptr<float>();
  const float* e8m0 = byte_tables().e8m0;
  const int64_t steps = (h + kFp4StepBytes - 1) / kFp4StepBytes;
  const int64_t xs = fp4_bf16_stride(I);  // the bf16 layouts' row stride
  const int64_t ahead = prefetch_ahead_rows(h);
  const int64_t gstride = std::max(G, 4 * steps);
  at::parallel_for(0, O, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> gs(gstride, 0.f);  // zeros past the row's groups (bf16 kernel steps)
    prefetch_first_rows(bp, begin, O, h, ahead);
    for (int64_t o = begin; o < end; ++o) {
      prefetch_row(bp, o, O, h, ahead);
      prefetch_row(sp, o, O, G, ahead);
      e8m0_row_scales(sp + o * G, G, e8m0, gs.data());
      if (i8) fp4_row_tokens_i8<16>(bp + o * h, h, T, xi, 0, gs.data(), yp + o, O);
      else fp4_row_tokens<16>(bp + o * h, h, T, bf16 ? xq.data() : nullptr, xqf.data(), xs, xe.data(), xo.data(),
                          gs.data(), yp + o, O);
    }
  });
  return y;
}

torch::Tensor nvfp4_gemv(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, double global_scale, PackedActs acts) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(),
              "packed must be contiguous uint8 [O, I/2]");
  const int64_t O = packed.size(0), I = packed.size(1) * 2, T = x.size(0), h = I / 2;
  TORCH_CHECK(I % 16 == 0, "NVFP4 needs in_features divisible by 16");
  TORCH_CHECK(scale.sizes() == torch::IntArrayRef({O, I / 16}) && scale.element_size() == 1 && scale.is_contiguous(),
              "scale must be contiguous e4m3 bytes [O, I/16]");
  check_x(x, I);
  float e4m3[256];
  for (int v = 0; v < 256; ++v) e4m3[v] = byte_tables().e4m3[v] * static_cast<float>(global_scale);
  const bool i8 = int8_acts(acts, "nvfp4_gemv");
  const bool bf16 = !i8 && bf16_kernels(x);
  std::vector<float> xe, xo, xqf;
  std::vector<uint16_t> xq;
  I8Acts xi;
  if (i8) int8_layout<E2M1Codec>(x, xi);
  else if (bf16) fp4_layouts(x, xq, xqf);
  else split_even_odd(as_fp32(x).data_ptr<float>(), T, I, xe, xo);
  auto y = torch::empty({T, O}, x.options().dtype(torch::kFloat32));
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const uint8_t* sp = static_cast<const uint8_t*>(scale.data_ptr());
  float* yp = y.data_ptr<float>();
  const int64_t G = I / 16, steps = (h + kFp4StepBytes - 1) / kFp4StepBytes;
  const int64_t xs = fp4_bf16_stride(I);
  const int64_t ahead = prefetch_ahead_rows(h);
  const int64_t gstride = std::max(G, 8 * steps);
  at::parallel_for(0, O, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> gs(gstride, 0.f);  // zeros past the row's groups (bf16 kernel steps)
    prefetch_first_rows(pp, begin, O, h, ahead);
    for (int64_t o = begin; o < end; ++o) {
      prefetch_row(pp, o, O, h, ahead);
      prefetch_row(sp, o, O, G, ahead);
      nvfp4_row_scales(sp + o * G, G, static_cast<float>(global_scale), e4m3, gs.data());
      if (i8) fp4_row_tokens_i8<8>(pp + o * h, h, T, xi, 0, gs.data(), yp + o, O);
      else fp4_row_tokens<8>(pp + o * h, h, T, bf16 ? xq.data() : nullptr, xqf.data(), xs, xe.data(), xo.data(),
                          gs.data(), yp + o, O);
    }
  });
  return y;
}

// INT4: packed = the int32 words [O, I/8] as bytes [O, I/2] (the FP4 nibble layout), scale [O, ceil(I/group)]
// fp32 / bf16 / fp16; group and I multiples of 16. The 4-bit row kernels with the INT4 table.
torch::Tensor int4_gemv(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, int64_t group, PackedActs acts) {
  TORCH_CHECK(packed.dim() == 2 && packed.scalar_type() == torch::kUInt8 && packed.is_contiguous(),
              "packed must be contiguous uint8 [O, I/2] (the int32 words as bytes)");
  const int64_t O = packed.size(0), I = packed.size(1) * 2, T = x.size(0), h = I / 2;
  TORCH_CHECK(group >= 16 && group % 16 == 0 && I % 16 == 0, "INT4 kernels need group_size and in_features divisible by 16, "
              "got group_size ", group, ", in_features ", I);
  const int64_t G = (I + group - 1) / group;
  TORCH_CHECK(scale.sizes() == torch::IntArrayRef({O, G}) && scale.is_contiguous(), "scale must be contiguous [O, ", G, "]");
  const int words = scale_words(scale);
  check_x(x, I);
  const bool i8 = int8_acts(acts, "int4_gemv");
  const bool bf16 = !i8 && bf16_kernels(x);
  std::vector<float> xe, xo, xqf;
  std::vector<uint16_t> xq;
  I8Acts xi;
  if (i8) int8_layout<Int4Codec>(x, xi);
  else if (bf16) fp4_layouts(x, xq, xqf);
  else split_even_odd(as_fp32(x).data_ptr<float>(), T, I, xe, xo);
  auto y = torch::empty({T, O}, x.options().dtype(torch::kFloat32));
  const uint8_t* pp = packed.data_ptr<uint8_t>();
  const uint8_t* sp = static_cast<const uint8_t*>(scale.data_ptr());
  const int64_t srow_bytes = G * scale.element_size();
  float* yp = y.data_ptr<float>();
  const int64_t kg = int4_kernel_group(group), n = (I + kg - 1) / kg, rep = group / kg;
  const int64_t steps = (h + kFp4StepBytes - 1) / kFp4StepBytes, per_step = kFp4StepElems / kg;
  const int64_t xs = fp4_bf16_stride(I);
  const int64_t ahead = prefetch_ahead_rows(h);
  const int64_t gstride = std::max(n, per_step * steps);
  at::parallel_for(0, O, 16, [&](int64_t begin, int64_t end) {
    std::vector<float> gs(gstride, 0.f);  // zeros past the row's groups (bf16 kernel steps)
    prefetch_first_rows(pp, begin, O, h, ahead);
    for (int64_t o = begin; o < end; ++o) {
      prefetch_row(pp, o, O, h, ahead);
      prefetch_row(sp, o, O, srow_bytes, ahead);
      int4_row_scales(sp + o * srow_bytes, words, n, rep, gs.data());
      if (i8 && kg == 32) fp4_row_tokens_i8<16, Int4Codec>(pp + o * h, h, T, xi, 0, gs.data(), yp + o, O);
      else if (i8) fp4_row_tokens_i8<8, Int4Codec>(pp + o * h, h, T, xi, 0, gs.data(), yp + o, O);
      else if (kg == 32)
        fp4_row_tokens<16, Int4Codec>(pp + o * h, h, T, bf16 ? xq.data() : nullptr, xqf.data(), xs, xe.data(), xo.data(),
                                      gs.data(), yp + o, O);
      else
        fp4_row_tokens<8, Int4Codec>(pp + o * h, h, T, bf16 ? xq.data() : nullptr, xqf.data(), xs, xe.data(), xo.data(),
                                     gs.data(), yp + o, O);
    }
  });
  return y;
}

torch::Tensor fp8_block_gemv(torch::Tensor x, torch::Tensor q, torch::Tensor scale_inv, int64_t b0, int64_t b1, PackedActs acts) {
  TORCH_CHECK(!int8_acts(acts, "fp8_block_gemv"), "fp8_block_gemv: int8 activations are for the 4-bit formats (MXFP4, NVFP4, "
              "INT4); FP8 weights take exact activations");
  TORCH_CHECK(q.dim() == 2 && q.element_size() == 1 && q.is_contiguous(), "q must be contiguous e4m3 bytes [O, I]");
  const int64_t O = q.size(0), I = q.size(1), T = x.size(0);
  const int64_t R = (O + b0 - 1) / b0, C = (I + b1 - 1) / b1;
  TORCH_CHECK(scale_inv.sizes() == torch::IntArrayRef({R, C}) && scale_inv.scalar_type() == torch::kFloat32 &&
                  scale_inv.is_contiguous(),
              "scale_inv must be contiguous float32 [ceil(O/b0), ceil(I/b1)]");
  check_x(x, I);
  // the bf16 kernel takes whole 32-element steps inside a scale block
  const bool bf16 = bf16_kernels(x) && b1 % kFp8StepElems == 0;
  std::vector<uint16_t> xq;
  std::vector<float> xqf;
  torch::Tensor x32;
  const float* xp = nullptr;
  if (bf16) {
    xq.resize(T * fp8_bf16_stride(I));
    fp8_bf16_acts(bf16_words(x), T, I, I, xq.data());
    if (T > 1) {
      xqf.resize(T * fp8_bf16_stride(I));
      fp8_f32_acts(bf16_words(x), T, I, I, xqf.data());
    }
  } else {
    x32 = as_fp32(x);
    xp = x32.data_ptr<float>();
  }
  const uint8_t* qp = static_cast<const uint8_t*>(q.data_ptr());
  const float* sp = scale_inv.data_ptr<float>();
  auto y = torch::empty({T, O}, x.options().dtype(torch::kFloat32));
  float* yp = y.data_ptr<float>();
  const float* lut = byte_tables().e4m3;
  [[maybe_unused]] const int64_t xs = fp8_bf16_stride(I);
  const int64_t ahead = prefetch_ahead_rows(I);
  at::parallel_for(0, O, 16, [&](int64_t begin, int64_t end) {
    prefetch_first_rows(qp, begin, O, I, ahead);
    for (int64_t o = begin; o < end; ++o) {
      prefetch_row(qp, o, O, I, ahead);
#if defined(DYNAMOE_PACKED_BF16)
      if (bf16) {
        dynamoe::for_token_chunks(T, [&]<int TT>(int64_t t0) {
          fp8_row_acts<TT>(qp + o * I, I, xq.data() + t0 * xs, xqf.data() + t0 * xs, xs, sp + (o / b0) * C, b1,
                           yp + t0 * O + o, O);
        });
        continue;
      }
#endif
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

bool has_avx512_vnni() { return kPackedInt8; }

bool has_avx512_bf16() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

// The ops run without the GIL (they take tensors and plain values only): the server's event loop keeps
// streaming while the engine thread is inside a kernel.
void register_grouped_gemm(pybind11::module& m);  // grouped_gemm_bf16.cpp
void register_dequantize(pybind11::module& m);     // dequantize.cpp
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  namespace py = pybind11;
  register_decode_stack(m);
  register_grouped_gemm(m);
  register_dequantize(m);
  m.def("has_avx512_vnni", &has_avx512_vnni, "whether the AVX512-VNNI int8 kernels were compiled in (else a scalar loop)");
  m.def("route_decode_out", &route_decode_out, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "router of a decode step: fp32 logits of x [T, D] @ W^T (+ bias), softmax (0) or DeepSeek sigmoid-group (1) "
        "top-k into ids [T, K] int64 and weights [T, K] fp32");
  m.def("moe_ffn_decode_out", &moe_ffn_decode_out, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "a decode step's routed FFN experts in Tutel's layout (T <= 16 rows, bf16 or fp32): out [T, O], load [E]");
  m.def("packed_moe_glu_decode_out", &packed_moe_glu_decode_out, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "a decode step's routed GLU experts with packed weights (0 FP8, 1 MXFP4, 2 NVFP4, 3 INT4; T <= 16; fp32 out; x fp32, "
        "or bf16 with bf16_acts: AVX512-BF16 dot products where compiled in, h rounded to bf16; acts PackedActs.int8: "
        "x and h quantized to int8 per 32 elements, VNNI dot products, 4-bit formats)");
  m.def("rope_out", &rope_out, pybind11::call_guard<pybind11::gil_scoped_release>(), "rotary embedding of x [B, H, T, d] (bf16 or fp32) with cos/sin [B, T, R/2] into out");
  m.def("rms_norm_out", &rms_norm_out, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "RMSNorm of x [N, dim] (bf16 or fp32) into out, fp32 statistics; zero_centered: the scale is 1 + w",
        pybind11::arg("x"), pybind11::arg("w"), pybind11::arg("eps"), pybind11::arg("weight_in_fp32"), pybind11::arg("out"),
        pybind11::arg("zero_centered") = false);
  m.def("moe_glu_decode_out", &moe_glu_decode_out, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "a decode step's routed GLU experts (T <= 16 rows, bf16 or fp32): out [T, O], load [E] filled; returns the max load");
  m.def("bf16_gemv_out", &bf16_gemv_out, pybind11::call_guard<pybind11::gil_scoped_release>(), "out [T, O] = x [T, I] @ W^T (+ bias): bf16 in and out, fp32 accumulation");
  m.def("bf16_grouped_gemv_out", &bf16_grouped_gemv_out, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "per group (expert e, row offset, rows 1..8): out[rows] = x[rows] @ W[e]^T (+ bias[e]); W bf16 [E, O, I]");
  m.def("has_avx512_bf16", &has_avx512_bf16, "whether the AVX512-BF16 path was compiled in");
  m.def("mxfp4_gemv", &mxfp4_gemv, py::arg("x"), py::arg("blocks"), py::arg("scales"), py::arg("acts") = PackedActs::kExact,
        pybind11::call_guard<pybind11::gil_scoped_release>(),
        "y [T, O] fp32 = x [T, I] (fp32 or bf16) @ W^T, W MXFP4 (blocks [O, I/32, 16], e8m0 scales [O, I/32])");
  m.def("nvfp4_gemv", &nvfp4_gemv, py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("global_scale"),
        py::arg("acts") = PackedActs::kExact, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "y [T, O] fp32 = x [T, I] (fp32 or bf16) @ W^T, W NVFP4 (packed [O, I/2], e4m3 scales [O, I/16], global)");
  m.def("int4_gemv", &int4_gemv, py::arg("x"), py::arg("packed"), py::arg("scale"), py::arg("group"),
        py::arg("acts") = PackedActs::kExact, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "y [T, O] fp32 = x [T, I] (fp32 or bf16) @ W^T, W INT4 (packed words as bytes [O, I/2], scales [O, ceil(I/group)] "
        "fp32/bf16/fp16, group)");
  m.def("fp8_block_gemv", &fp8_block_gemv, py::arg("x"), py::arg("q"), py::arg("scale_inv"), py::arg("b0"), py::arg("b1"),
        py::arg("acts") = PackedActs::kExact, pybind11::call_guard<pybind11::gil_scoped_release>(),
        "y [T, O] fp32 = x [T, I] (fp32 or bf16) @ W^T, W blockwise FP8 (e4m3 [O, I], fp32 scales)");
  m.def("has_avx512", &has_avx512, "whether the AVX-512 path was compiled in");
}
