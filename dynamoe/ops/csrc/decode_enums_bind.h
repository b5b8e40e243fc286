// The enums and the row limit of decode_weights.h bound to Python, in one place: the main extension and any
// partial build (the scalar-path test binds a few sources compiled with -march=x86-64-v3) call this, so
// Python reads the same names and values from either. module_local: two such modules in one process (the
// test's beside the main one) each hold their own Python types for the same C++ enums.
#pragma once
#include <torch/extension.h>
#include "decode_weights.h"
#include "packed_int8.h"

inline void bind_decode_enums(pybind11::module& m) {
  namespace py = pybind11;
  m.attr("MAX_ROWS") = py::int_(dynamoe::kMaxRows);
  py::enum_<dynamoe::Activation>(m, "Activation", py::module_local(),
                                 "expert activations (the gate part of a GLU, or an FFN's)")
      .value("silu", dynamoe::kSilu).value("gelu", dynamoe::kGelu).value("gelu_tanh", dynamoe::kGeluTanh)
      .value("relu", dynamoe::kRelu).value("gpt_oss", dynamoe::kGptOss).value("silu_clamp", dynamoe::kSiluClamp)
      .value("silu_clamp_in", dynamoe::kSiluClampIn).value("relu2", dynamoe::kReluSquared);
  py::enum_<dynamoe::RouterKind>(m, "RouterKind", py::module_local(),
                                 "softmax top-k, or DeepSeek's sigmoid group-limited top-k")
      .value("softmax", dynamoe::kSoftmaxTopK).value("sigmoid", dynamoe::kSigmoidGroupTopK);
  py::enum_<dynamoe::WeightFormat>(m, "WeightFormat", py::module_local(), "how expert weights are stored")
      .value("fp8_block", dynamoe::kFp8Block).value("mxfp4", dynamoe::kMxfp4).value("nvfp4", dynamoe::kNvfp4)
      .value("int4", dynamoe::kInt4).value("dense", dynamoe::kDense);
  py::enum_<dynamoe::GateKind>(m, "GateKind", py::module_local(),
                               "an output gate on the attention: none, sigmoid, softplus")
      .value("none", dynamoe::kNoGate).value("sigmoid", dynamoe::kSigmoidGate)
      .value("softplus", dynamoe::kSoftplusGate);
  py::enum_<dynamoe::ExpertKind>(m, "ExpertKind", py::module_local(), "GLU or Tutel's FFN experts")
      .value("glu", dynamoe::kGlu).value("ffn", dynamoe::kFfn);
  using dynamoe::packed::PackedActs;
  py::enum_<PackedActs>(m, "PackedActs", py::module_local(),
                        "how the packed-weight kernels take their activations (csrc/packed_int8.h)")
      .value("exact", PackedActs::kExact, "as given (fp32, or bf16 where the AVX512-BF16 kernels are built): exact products")
      .value("int8", PackedActs::kInt8, "quantized to int8 per 32 elements with fp32 scales, VNNI dot products (4-bit formats)");
}
