// Rotary position embedding for inference on CPU in one call (instead of ~7 small ops per tensor),
// with torch's rounding: for bf16 every product and sum is rounded to bf16 as the op-by-op path does.
//   half-split pairs (i, i + R/2), or interleaved pairs (2i, 2i + 1) written out half-split (as
//   transformers does for DeepSeek); dims past R = 2 * half pass through (partial rotary).
// x [B, H, T, d] with unit stride along d (any other strides), cos/sin [B, T, half] contiguous,
// out [B, H, T, d] contiguous.
#include <torch/extension.h>
#include "decode_ops.h"
#include <c10/util/BFloat16.h>
#include <cstdint>
#include "decode_rows.h"

namespace {
template <typename scalar_t>
void rope_rows(const torch::Tensor& x, const scalar_t* c, const scalar_t* s, int64_t half, bool interleaved,
               scalar_t* out) {
  const int64_t B = x.size(0), H = x.size(1), T = x.size(2), d = x.size(3);
  const int64_t s0 = x.stride(0), s1 = x.stride(1), s2 = x.stride(2);
  const scalar_t* xp = x.data_ptr<scalar_t>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t h = 0; h < H; ++h)
      for (int64_t t = 0; t < T; ++t)
        dynamoe::rope_row(xp + b * s0 + h * s1 + t * s2, c + (b * T + t) * half, s + (b * T + t) * half, half, d,
                          interleaved, out + ((b * H + h) * T + t) * d);
}
}  // namespace

void rope_out(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, bool interleaved, torch::Tensor out) {
  TORCH_CHECK(x.dim() == 4 && x.stride(3) == 1, "x must be [B, H, T, d] with unit stride along d");
  const int64_t B = x.size(0), T = x.size(2), d = x.size(3);
  TORCH_CHECK(cos.dim() == 3 && cos.size(0) == B && cos.size(1) == T && cos.is_contiguous() && sin.sizes() == cos.sizes() &&
              sin.is_contiguous() && cos.scalar_type() == x.scalar_type() && sin.scalar_type() == x.scalar_type(),
              "cos and sin must be contiguous [B, T, R/2] of x's dtype");
  const int64_t half = cos.size(2);
  TORCH_CHECK(2 * half <= d, "rotary dims 2 * ", half, " exceed the head dim ", d);
  TORCH_CHECK(out.is_contiguous() && out.sizes() == x.sizes() && out.scalar_type() == x.scalar_type(),
              "out must be contiguous like x");
  switch (x.scalar_type()) {
    case torch::kBFloat16:
      rope_rows(x, cos.data_ptr<c10::BFloat16>(), sin.data_ptr<c10::BFloat16>(), half, interleaved,
                out.data_ptr<c10::BFloat16>());
      break;
    case torch::kFloat:
      rope_rows(x, cos.data_ptr<float>(), sin.data_ptr<float>(), half, interleaved, out.data_ptr<float>());
      break;
    default:
      TORCH_CHECK(false, "x must be bf16 or fp32, got ", x.scalar_type());
  }
}
