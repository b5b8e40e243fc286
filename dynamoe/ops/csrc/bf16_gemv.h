// The bf16 GEMV building blocks (bf16_gemv.cpp) shared with the fused decode kernels.
#pragma once
#include <c10/util/BFloat16.h>
#include <cstdint>

namespace dynamoe {
constexpr int kGemvRowBlock = 4;
// out rows [o0, o0 + 4) (fewer at the end) of W [O, I] for the T <= 8 rows of x (stride xs), plus bias
// (may be null), written as bf16 into op (row stride os).
void row_block(const c10::BFloat16* wp, int64_t O, int64_t I, int64_t o0, const c10::BFloat16* xp, int64_t xs,
               int64_t T, const c10::BFloat16* bp, c10::BFloat16* op, int64_t os);
// row blocks per parallel work item: at least ~1 MiB of weights per item
int64_t grain_blocks(int64_t I);
}  // namespace dynamoe
