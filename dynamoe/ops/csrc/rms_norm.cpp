// RMSNorm over the last dim for inference on CPU, one call instead of ~9 small ops:
//   h = x / sqrt(mean(x^2) + eps) in fp32; out = w * h rounded as torch does it: the weight multiplies
//   h after h is rounded to x's dtype (Llama/Qwen/DeepSeek), or before, in fp32 (GPT-OSS); zero_centered:
//   the scale is 1 + w in fp32 (Qwen3-Next, Step-3.5).
// Rows are independent: x [N, dim] with unit stride along dim (any row stride), out [N, dim] contiguous.
#include <torch/extension.h>
#include "decode_ops.h"
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <cmath>
#include <cstdint>
#include "decode_rows.h"

namespace {
template <typename scalar_t>
void rms_rows(const scalar_t* x, int64_t xs, const scalar_t* w, int64_t N, int64_t dim, float eps, bool weight_fp32,
              bool zero_centered, scalar_t* out) {
  auto body = [&](int64_t begin, int64_t end) {
    for (int64_t n = begin; n < end; ++n) {
      dynamoe::rms_row(x + n * xs, w, dim, eps, weight_fp32, out + n * dim, zero_centered);
    }
  };
  // rows of a decode step are few and short: one thread unless there is real work
  if (N * dim < (int64_t{1} << 16)) body(0, N);
  else at::parallel_for(0, N, std::max<int64_t>(1, (int64_t{1} << 14) / dim), body);
}
}  // namespace

void rms_norm_out(torch::Tensor x, torch::Tensor w, double eps, bool weight_in_fp32, torch::Tensor out,
                  bool zero_centered) {
  TORCH_CHECK(x.dim() == 2 && x.stride(1) == 1, "x must be [N, dim] with unit stride along dim");
  const int64_t N = x.size(0), dim = x.size(1);
  TORCH_CHECK(w.dim() == 1 && w.size(0) == dim && w.is_contiguous() && w.scalar_type() == x.scalar_type(),
              "w must be contiguous [", dim, "] of x's dtype");
  TORCH_CHECK(out.is_contiguous() && out.numel() == N * dim && out.scalar_type() == x.scalar_type(),
              "out must be contiguous with N*dim elements of x's dtype");
  const float e = static_cast<float>(eps);
  switch (x.scalar_type()) {
    case torch::kBFloat16:
      rms_rows(x.data_ptr<c10::BFloat16>(), x.stride(0), w.data_ptr<c10::BFloat16>(), N, dim, e, weight_in_fp32,
               zero_centered, out.data_ptr<c10::BFloat16>());
      break;
    case torch::kFloat:
      rms_rows(x.data_ptr<float>(), x.stride(0), w.data_ptr<float>(), N, dim, e, weight_in_fp32, zero_centered,
               out.data_ptr<float>());
      break;
    default:
      TORCH_CHECK(false, "x must be bf16 or fp32, got ", x.scalar_type());
  }
}
