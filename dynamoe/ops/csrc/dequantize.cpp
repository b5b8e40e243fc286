// Packed weights to dense, for the work too large for the decode kernels (training forward, fp32 prefill):
// out[e][r][c] = round(value(e, r, c)) into bf16 or fp32 for a PackedCodes (packed_codes.h) -- the value and the
// fp32 product that the formats' torch dequantize() computes, so the same bits, at memory speed instead of a
// chain of torch passes (30-80 ms per 2880 x 2880 weight on the SPR VM).
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include <vector>
#include "panel_decode.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

#if defined(__AVX512F__)
// fp32 -> bf16 bits (c10::BFloat16's rounding: denormals kept, NaN quiet), packed to 16-bit words
inline __m256i bf16_round(__m512 v) { return _mm512_cvtepi32_epi16(dynamoe::panel_round_bf16(v)); }

// 32 columns from 16 bytes of nibbles: the code table in one register, the two 16-column halves
// scaled by s_lo / s_hi.
template <class T>
inline void nibbles32(const uint8_t* bytes, __m512 table, __m512 s_lo, __m512 s_hi, T* out) {
  const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(bytes)));
  const __m512 lo = _mm512_permutexvar_ps(_mm512_and_si512(b, _mm512_set1_epi32(15)), table);  // even columns
  const __m512 hi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), table);                     // odd columns
  const __m512i first = _mm512_set_epi32(23, 7, 22, 6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  const __m512i second = _mm512_set_epi32(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8);
  const __m512 v0 = _mm512_mul_ps(_mm512_permutex2var_ps(lo, first, hi), s_lo);
  const __m512 v1 = _mm512_mul_ps(_mm512_permutex2var_ps(lo, second, hi), s_hi);
  if constexpr (std::is_same_v<T, float>) {
    _mm512_storeu_ps(out, v0);
    _mm512_storeu_ps(out + 16, v1);
  } else {
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out), bf16_round(v0));
    _mm256_storeu_si256(reinterpret_cast<__m256i*>(out + 16), bf16_round(v1));
  }
}
#endif

template <class T>
void dequantize_rows(const dynamoe::CodesView& S, T* out) {
  const bool nibbles = S.bits == 4;
  const int64_t C = S.C;
  at::parallel_for(0, S.E * S.R, 16, [&](int64_t r0, int64_t r1) {
    std::vector<float> sbuf(S.scale_cols);
    for (int64_t er = r0; er < r1; ++er) {
      const int64_t e = er / S.R, r = er % S.R;
      const uint8_t* row = S.codes + er * S.row_bytes;
      const float* srow = S.scale_row(e, r, sbuf.data());
      T* orow = out + er * C;
      int64_t done = 0;  // columns written by the vector loop
#if defined(__AVX512F__)
      if (nibbles && (S.group % 32 == 0 || S.group == 16)) {
        const __m512 table = _mm512_loadu_ps(S.lut);
        for (; done + 32 <= C; done += 32) {
          const float s0 = srow[done / S.group], s1 = srow[(done + 16) / S.group];
          nibbles32(row + done / 2, table, _mm512_set1_ps(s0), _mm512_set1_ps(s1), orow + done);
        }
      }
#endif
      for (int64_t g = done / S.group; g * S.group < C; ++g) {
        const float s = srow[g];
        const int64_t c1 = std::min(C, (g + 1) * S.group), c0 = std::max(done, g * S.group);
        if (nibbles) {
          for (int64_t c = c0; c < c1; ++c) orow[c] = static_cast<T>(S.lut[(row[c >> 1] >> ((c & 1) * 4)) & 15] * s);
        } else {
          for (int64_t c = c0; c < c1; ++c) orow[c] = static_cast<T>(S.lut[row[c]] * s);
        }
      }
    }
  });
}

void dequantize(const PackedCodes& w, const at::Tensor& out) {
  TORCH_CHECK(out.device().is_cpu() && out.dim() == 3 && out.is_contiguous() &&
                  (out.scalar_type() == at::kBFloat16 || out.scalar_type() == at::kFloat),
              "out must be a contiguous CPU bf16 or fp32 [E, R, C]");
  const dynamoe::CodesView S = dynamoe::view_codes(w, out.size(2), "w");
  TORCH_CHECK(out.size(0) == S.E && out.size(1) == S.R, "out ", out.sizes(), " is not [", S.E, ", ", S.R, ", C] as ",
              "w.codes ", w.codes.sizes());
  if (out.scalar_type() == at::kBFloat16) dequantize_rows(S, out.data_ptr<c10::BFloat16>());
  else dequantize_rows(S, out.data_ptr<float>());
}

}  // namespace

void register_dequantize(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<PackedCodes>(m, "PackedCodes", "a stack of packed weights for the native decoders (csrc/packed_codes.h)")
      .def(py::init<>())
      .def_readwrite("codes", &PackedCodes::codes)
      .def_readwrite("bits", &PackedCodes::bits)
      .def_readwrite("lut", &PackedCodes::lut)
      .def_readwrite("scales", &PackedCodes::scales)
      .def_readwrite("scale_lut", &PackedCodes::scale_lut)
      .def_readwrite("scale_mul", &PackedCodes::scale_mul)
      .def_readwrite("group", &PackedCodes::group)
      .def_readwrite("block_rows", &PackedCodes::block_rows);
  m.def("dequantize", &dequantize, py::arg("w"), py::arg("out"), py::call_guard<py::gil_scoped_release>(),
        "out [E, R, C] = w's values (lut[code] times its scale), rounded to out's dtype");
}
