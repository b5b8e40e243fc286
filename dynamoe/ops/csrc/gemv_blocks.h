// GEMV building blocks (bf16_gemv.cpp, f32_gemv.cpp) shared with the fused decode kernels.
#pragma once
#include <c10/util/BFloat16.h>
#include <cstdint>

namespace dynamoe {
constexpr int kGemvRowBlock = 4;
// out rows [o0, o0 + 4) (fewer at the end) of W [O, I] for the T <= 8 rows of x (stride xs), plus bias
// (may be null), written into op (row stride os). bf16: AVX512-BF16 dot products; fp32: AVX-512 FMAs.
// Accumulation is fp32 in both.
void row_block(const c10::BFloat16* wp, int64_t O, int64_t I, int64_t o0, const c10::BFloat16* xp, int64_t xs,
               int64_t T, const c10::BFloat16* bp, c10::BFloat16* op, int64_t os);
void row_block(const float* wp, int64_t O, int64_t I, int64_t o0, const float* xp, int64_t xs, int64_t T,
               const float* bp, float* op, int64_t os);
// row blocks per parallel work item: at least ~1 MiB of weights per item (elem: bytes per weight)
int64_t grain_blocks(int64_t I, int64_t elem = 2);
}  // namespace dynamoe
