// Packed weights to dense, for the work too large for the decode kernels (prefill, training forward):
// out[r][c] = round(lut[code(r, c)] * scales[r / block_rows][c / group]) into bf16 or fp32 -- the
// value and the fp32 product that the formats' torch dequantize() computes, so the same bits, at memory
// speed instead of a chain of torch passes (30-80 ms per 2880 x 2880 weight on the SPR VM).
//
// Codes: 4-bit (two per byte, the even column in the low nibble) or 8-bit, one row of row_bytes each.
// The caller (dynamoe/quant/dequantize.py) gives each format's code table and its fp32 scale grid.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cstdint>
#include <type_traits>
#include "panel_decode.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

namespace {

struct Dequantize {
  at::Tensor codes;        // uint8 [R, row_bytes], contiguous
  int64_t bits = 4;        // 4 (nibbles) or 8 (bytes)
  at::Tensor lut;          // fp32 [2^bits]: the value of each code
  at::Tensor scales;       // fp32 [ceil(R / block_rows), ceil(C / group)], contiguous
  int64_t group = 32;      // columns per scale
  int64_t block_rows = 1;  // rows per scale
  at::Tensor out;          // bf16 or fp32 [R, C], contiguous
};

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
void dequantize_rows(const Dequantize& A, int64_t R, int64_t C) {
  const uint8_t* codes = A.codes.data_ptr<uint8_t>();
  const int64_t row_bytes = A.codes.size(1), ns = A.scales.size(1);
  const float* lut = A.lut.data_ptr<float>();
  const float* scales = A.scales.data_ptr<float>();
  T* out = A.out.data_ptr<T>();
  const bool nibbles = A.bits == 4;
  at::parallel_for(0, R, 16, [&](int64_t r0, int64_t r1) {
    for (int64_t r = r0; r < r1; ++r) {
      const uint8_t* row = codes + r * row_bytes;
      const float* srow = scales + (r / A.block_rows) * ns;
      T* orow = out + r * C;
      int64_t done = 0;  // columns written by the vector loop
#if defined(__AVX512F__)
      if (nibbles && (A.group % 32 == 0 || A.group == 16)) {
        const __m512 table = _mm512_loadu_ps(lut);
        for (; done + 32 <= C; done += 32) {
          const float s0 = srow[done / A.group], s1 = srow[(done + 16) / A.group];
          nibbles32(row + done / 2, table, _mm512_set1_ps(s0), _mm512_set1_ps(s1), orow + done);
        }
      }
#endif
      for (int64_t g = done / A.group; g * A.group < C; ++g) {
        const float s = srow[g];
        const int64_t c1 = std::min(C, (g + 1) * A.group), c0 = std::max(done, g * A.group);
        if (nibbles) {
          for (int64_t c = c0; c < c1; ++c) orow[c] = static_cast<T>(lut[(row[c >> 1] >> ((c & 1) * 4)) & 15] * s);
        } else {
          for (int64_t c = c0; c < c1; ++c) orow[c] = static_cast<T>(lut[row[c]] * s);
        }
      }
    }
  });
}

void dequantize(const Dequantize& A) {
  TORCH_CHECK(A.bits == 4 || A.bits == 8, "bits must be 4 or 8, got ", A.bits);
  TORCH_CHECK(A.group >= 1 && A.block_rows >= 1, "group and block_rows must be >= 1");
  TORCH_CHECK(A.codes.device().is_cpu() && A.codes.scalar_type() == at::kByte && A.codes.dim() == 2 &&
                  A.codes.is_contiguous(), "codes must be a contiguous CPU uint8 [R, row_bytes]");
  TORCH_CHECK(A.out.device().is_cpu() && A.out.dim() == 2 && A.out.is_contiguous() &&
                  (A.out.scalar_type() == at::kBFloat16 || A.out.scalar_type() == at::kFloat),
              "out must be a contiguous CPU bf16 or fp32 [R, C]");
  const int64_t R = A.out.size(0), C = A.out.size(1);
  TORCH_CHECK(A.codes.size(0) == R && A.codes.size(1) * (8 / A.bits) >= C, "codes [", A.codes.size(0), ", ",
              A.codes.size(1), "] do not hold ", R, " rows of ", C, " ", A.bits, "-bit codes");
  TORCH_CHECK(A.lut.scalar_type() == at::kFloat && A.lut.is_contiguous() && A.lut.numel() == (int64_t{1} << A.bits),
              "lut must be a contiguous fp32 [", (1 << A.bits), "]");
  TORCH_CHECK(A.scales.scalar_type() == at::kFloat && A.scales.is_contiguous() && A.scales.dim() == 2 &&
                  A.scales.size(0) == (R + A.block_rows - 1) / A.block_rows &&
                  A.scales.size(1) == (C + A.group - 1) / A.group,
              "scales must be a contiguous fp32 [ceil(R / block_rows), ceil(C / group)], got ", A.scales.sizes());
  if (A.out.scalar_type() == at::kBFloat16) dequantize_rows<c10::BFloat16>(A, R, C);
  else dequantize_rows<float>(A, R, C);
}

}  // namespace

void register_dequantize(pybind11::module& m) {
  namespace py = pybind11;
  py::class_<Dequantize>(m, "Dequantize", "arguments of dequantize (see csrc/dequantize.cpp)")
      .def(py::init<>())
      .def_readwrite("codes", &Dequantize::codes)
      .def_readwrite("bits", &Dequantize::bits)
      .def_readwrite("lut", &Dequantize::lut)
      .def_readwrite("scales", &Dequantize::scales)
      .def_readwrite("group", &Dequantize::group)
      .def_readwrite("block_rows", &Dequantize::block_rows)
      .def_readwrite("out", &Dequantize::out);
  m.def("dequantize", &dequantize, py::arg("args"), py::call_guard<py::gil_scoped_release>(),
        "out = lut[code] * scales[row / block_rows][col / group], rounded to out's dtype");
}
