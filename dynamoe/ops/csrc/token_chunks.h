// Shared by the GEMV kernels: calls f.template operator()<TT>(t0) for row chunks of at most 8 tokens,
// so each chunk's accumulators are a compile-time count (registers, not memory).
#pragma once
#include <algorithm>
#include <cstdint>

namespace dynamoe {
template <typename F>
void for_token_chunks(int64_t T, F&& f) {
  for (int64_t t0 = 0; t0 < T; t0 += 8) {
    switch (std::min<int64_t>(8, T - t0)) {
      case 1: f.template operator()<1>(t0); break;
      case 2: f.template operator()<2>(t0); break;
      case 3: f.template operator()<3>(t0); break;
      case 4: f.template operator()<4>(t0); break;
      case 5: f.template operator()<5>(t0); break;
      case 6: f.template operator()<6>(t0); break;
      case 7: f.template operator()<7>(t0); break;
      default: f.template operator()<8>(t0); break;
    }
  }
}
}  // namespace dynamoe
