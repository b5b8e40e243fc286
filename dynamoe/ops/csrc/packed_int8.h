// int8 activations for the 4-bit row kernels (MXFP4, NVFP4, INT4), as llama.cpp's Q8 activations: each token's
// activation is quantized once per call to int8 per block of 32 elements with an fp32 scale
// (d = amax / 127, q = round-half-even(x * (127 / amax)), |q| <= 127), the weights' nibbles become int8 through
// a 16-entry table, and AVX512-VNNI (vpdpbusd) sums four byte products per int32 lane; each lane's integer sum
// is converted to fp32 and scaled by the product of its weight group's and activation block's scales.
// This changes the numerics (the activations lose precision: a relative error of at most 1/254 of the block's
// largest element each), so it runs only when asked for (PackedActs::kInt8); dynamoe/quant/act_quant.py has
// the plain Python emulation the tests compare against (exact up to fp32 summation order).
//
// vpdpbusd multiplies unsigned by signed bytes: the weights go in as unsigned codes u = value / unit + offset
// (Codec::i8: e2m1 -> 2v + 12 in 0..24, unit 1/2; INT4 -> the nibble n itself, value n - 8), the activations
// as signed q. The offset's share, offset * sum(q), is taken off by starting each lane's sum at
// -offset * (its eight q's), precomputed with the activations (corr), so sum(u q) + corr = sum((value/unit) q).
#pragma once
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include "packed_rows.h"

#if defined(__AVX512VNNI__) && defined(__AVX512BW__)
#define DYNAMOE_PACKED_INT8 1
#endif

namespace dynamoe::packed {

// How a packed kernel takes its activations; bound to Python as the kernels' PackedActs (dynamoe.ops.packed_acts).
enum class PackedActs : int64_t {
  kExact = 0,  // as given: fp32 x through the fp32 kernels, bf16 x through the bf16 ones; exact products
  kInt8 = 1,   // x quantized to int8 per 32 elements, VNNI dot products (4-bit formats only)
};

#if defined(DYNAMOE_PACKED_INT8)
inline constexpr bool kPackedInt8 = true;
#else
inline constexpr bool kPackedInt8 = false;
#endif

inline constexpr int64_t kI8Block = 32;  // activation elements per int8 scale

// The unsigned codes of a 4-bit codec: u = values[n] / unit + offset (0..255), four times (vpshufb's lanes)
template <class Codec> struct I8Codes;
template <> struct I8Codes<E2M1Codec> {
  static constexpr int offset = 12;
  static constexpr float unit = 0.5f;
  static constexpr uint8_t codes[16] = {12, 13, 14, 15, 16, 18, 20, 24, 12, 11, 10, 9, 8, 6, 4, 0};  // 2v + 12
};
template <> struct I8Codes<Int4Codec> {
  static constexpr int offset = 8;
  static constexpr float unit = 1.f;
  static constexpr uint8_t codes[16] = {0, 1, 2, 3, 4, 5, 6, 7, 8, 9, 10, 11, 12, 13, 14, 15};  // n = q + 8
};
template <class Codec>
inline uint8_t i8_code(int n) { return I8Codes<Codec>::codes[n]; }

// One token's int8 activations in the kernels' layout, per step of 128 elements (64 packed bytes):
// q [128]: the 64 even elements (the low nibbles' partners), then the 64 odd ones; corr [16]: lane L's
// -offset * (q[4L..4L+3] + q[64+4L..64+4L+3]); dx [16]: lane L's block scale times the codec's unit
// (lanes 4b..4b+3 hold block b of the step). Zero past I (zero q, corr and scale).
struct I8Acts {
  std::vector<int8_t> q;
  std::vector<int32_t> corr;
  std::vector<float> dx;
  int64_t steps = 0;  // per token
  const int8_t* qt(int64_t t) const { return q.data() + t * steps * 128; }
  const int32_t* ct(int64_t t) const { return corr.data() + t * steps * 16; }
  const float* dt(int64_t t) const { return dx.data() + t * steps * 16; }
};

// The quantization of one block of n <= 32 values (a plain loop: the same fp32 operations as the emulation).
// A block holding NaN or Inf gets q = 0 and a NaN scale: its products are NaN, as the exact kernels' would be.
inline float i8_quantize_block(const float* x, int64_t n, int8_t* q) {
  float amax = 0.f;
  bool finite = true;
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::fabs(x[i]);
    finite = finite && v <= 3.4028234663852886e38f;
    amax = std::max(amax, v);
  }
  if (!finite) {
    for (int64_t i = 0; i < n; ++i) q[i] = 0;
    return NAN;
  }
  const float inv = amax > 0.f ? 127.f / amax : 0.f;
  for (int64_t i = 0; i < n; ++i) {
    const float v = std::nearbyint(x[i] * inv);  // round half to even (the default rounding mode)
    q[i] = static_cast<int8_t>(std::max(-127.f, std::min(127.f, v)));
  }
  return amax / 127.f;
}

// x [T, I] (fp32 values, row stride xs) -> int8 activations for Codec's weights
template <class Codec>
void i8_acts(const float* x, int64_t T, int64_t I, int64_t xs, I8Acts& a) {
  a.steps = (I + kFp4StepElems - 1) / kFp4StepElems;
  const int64_t S = a.steps;
  a.q.assign(T * S * 128, 0);
  a.corr.assign(T * S * 16, 0);
  a.dx.assign(T * S * 16, 0.f);
  for (int64_t t = 0; t < T; ++t) {
    int8_t* q = a.q.data() + t * S * 128;
    float* dx = a.dx.data() + t * S * 16;
    int8_t blk[kI8Block];
    for (int64_t b0 = 0; b0 < I; b0 += kI8Block) {
      const int64_t n = std::min(kI8Block, I - b0);
      const float d = i8_quantize_block(x + t * xs + b0, n, blk);
      for (int64_t i = 0; i < n; ++i) {
        const int64_t e = b0 + i, s = e / kFp4StepElems, j = (e % kFp4StepElems) / 2;
        q[s * 128 + (e & 1) * 64 + j] = blk[i];
      }
      const int64_t s = b0 / kFp4StepElems, lane0 = 4 * ((b0 % kFp4StepElems) / kI8Block);
      for (int L = 0; L < 4; ++L) dx[s * 16 + lane0 + L] = d * I8Codes<Codec>::unit;
    }
    int32_t* corr = a.corr.data() + t * S * 16;
    for (int64_t s = 0; s < S; ++s)
      for (int L = 0; L < 16; ++L) {
        int32_t sum = 0;
        for (int k = 0; k < 4; ++k) sum += q[s * 128 + 4 * L + k] + q[s * 128 + 64 + 4 * L + k];
        corr[s * 16 + L] = -I8Codes<Codec>::offset * sum;
      }
  }
}

#if defined(DYNAMOE_PACKED_INT8)
template <class Codec>
inline __m512i i8_table() {  // the 16 codes in each 128-bit lane (vpshufb looks up within lanes)
  return _mm512_broadcast_i32x4(_mm_loadu_si128(reinterpret_cast<const __m128i*>(I8Codes<Codec>::codes)));
}

// One output row of a 4-bit weight for TT tokens with int8 activations `a` (tokens t0..t0+TT-1): `packed`
// holds h bytes (h % 8 == 0), `gs` the row's fp32 group scales zero-padded to whole steps (as fp4_row_bf16).
// A partial last step is read with a masked load: its zero bytes meet zero activations and scales.
template <int TT, int kBytesPerGroup, class Codec = E2M1Codec>
void fp4_row_i8(const uint8_t* packed, int64_t h, const I8Acts& a, int64_t t0, const float* gs, float* out,
                int64_t out_stride) {
  static_assert(kBytesPerGroup == 16 || kBytesPerGroup == 8, "MXFP4 (16 bytes) or NVFP4 (8 bytes) groups");
  const __m512i tab = i8_table<Codec>(), low4 = _mm512_set1_epi8(15);
  const __m512i lane_group = kBytesPerGroup == 16 ? _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)
                                                  : _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  const int8_t* q[TT];
  const int32_t* c[TT];
  const float* d[TT];
  __m512 acc[TT];
  for (int t = 0; t < TT; ++t) {
    q[t] = a.qt(t0 + t);
    c[t] = a.ct(t0 + t);
    d[t] = a.dt(t0 + t);
    acc[t] = _mm512_setzero_ps();
  }
  auto step = [&](__m512i b, int64_t s) {
    const __m512i lo = _mm512_shuffle_epi8(tab, _mm512_and_si512(b, low4));
    const __m512i hi = _mm512_shuffle_epi8(tab, _mm512_and_si512(_mm512_srli_epi16(b, 4), low4));
    const __m512 sc = _mm512_permutexvar_ps(lane_group, kBytesPerGroup == 16
        ? _mm512_castps128_ps512(_mm_loadu_ps(gs + 4 * s)) : _mm512_castps256_ps512(_mm256_loadu_ps(gs + 8 * s)));
    for (int t = 0; t < TT; ++t) {
      const int8_t* qs = q[t] + s * 128;
      __m512i dot = _mm512_dpbusd_epi32(_mm512_loadu_si512(c[t] + s * 16), lo, _mm512_loadu_si512(qs));
      dot = _mm512_dpbusd_epi32(dot, hi, _mm512_loadu_si512(qs + 64));
      acc[t] = _mm512_fmadd_ps(_mm512_cvtepi32_ps(dot), _mm512_mul_ps(sc, _mm512_loadu_ps(d[t] + s * 16)), acc[t]);
    }
  };
  const int64_t full = h / kFp4StepBytes, rest = h % kFp4StepBytes;
  for (int64_t s = 0; s < full; ++s) step(_mm512_loadu_si512(packed + s * kFp4StepBytes), s);
  if (rest) step(_mm512_maskz_loadu_epi8(~uint64_t{0} >> (64 - rest), packed + full * kFp4StepBytes), full);
  for (int t = 0; t < TT; ++t) out[t * out_stride] = _mm512_reduce_add_ps(acc[t]);
}
#endif  // DYNAMOE_PACKED_INT8

#if defined(DYNAMOE_AVX2) && !defined(DYNAMOE_PACKED_INT8)
// fp4_row_i8 on AVX2 (no VNNI): a step's 16 lanes as two halves of 8; vpmaddubsw sums two byte products into
// an int16 (at most 2 * 24 * 127: no saturation), vpmaddwd two of those into the lane's int32 -- the same
// integer sums per lane as the VNNI kernel, then the same fp32 scaling.
template <int TT, int kBytesPerGroup, class Codec = E2M1Codec>
void fp4_row_i8_avx2(const uint8_t* packed, int64_t h, const I8Acts& a, int64_t t0, const float* gs, float* out,
                     int64_t out_stride) {
  static_assert(kBytesPerGroup == 16 || kBytesPerGroup == 8, "MXFP4 (16 bytes) or NVFP4 (8 bytes) groups");
  const __m256i tab = _mm256_broadcastsi128_si256(_mm_loadu_si128(reinterpret_cast<const __m128i*>(I8Codes<Codec>::codes)));
  const __m256i low4 = _mm256_set1_epi8(15), ones = _mm256_set1_epi16(1);
  const __m256i pairs = _mm256_setr_epi32(0, 0, 1, 1, 2, 2, 3, 3);
  __m256 acc[TT];
  for (int t = 0; t < TT; ++t) acc[t] = _mm256_setzero_ps();
  auto half = [&](const uint8_t* bytes, int64_t s, int hh) {  // lanes 8 hh .. 8 hh + 7 of step s
    const __m256i b = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(bytes));
    const __m256i lo = _mm256_shuffle_epi8(tab, _mm256_and_si256(b, low4));
    const __m256i hi = _mm256_shuffle_epi8(tab, _mm256_and_si256(_mm256_srli_epi16(b, 4), low4));
    const __m256 sc = kBytesPerGroup == 16
        ? _mm256_set_m128(_mm_set1_ps(gs[4 * s + 2 * hh + 1]), _mm_set1_ps(gs[4 * s + 2 * hh]))
        : _mm256_permutevar8x32_ps(_mm256_castps128_ps256(_mm_loadu_ps(gs + 8 * s + 4 * hh)), pairs);
    for (int t = 0; t < TT; ++t) {
      const int8_t* qs = a.qt(t0 + t) + s * 128 + 32 * hh;
      const __m256i dl = _mm256_madd_epi16(_mm256_maddubs_epi16(lo, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs))), ones);
      const __m256i dh = _mm256_madd_epi16(_mm256_maddubs_epi16(hi, _mm256_loadu_si256(reinterpret_cast<const __m256i*>(qs + 64))), ones);
      const __m256i c = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(a.ct(t0 + t) + s * 16 + 8 * hh));
      const __m256i dot = _mm256_add_epi32(c, _mm256_add_epi32(dl, dh));
      acc[t] = _mm256_fmadd_ps(_mm256_cvtepi32_ps(dot), _mm256_mul_ps(sc, _mm256_loadu_ps(a.dt(t0 + t) + s * 16 + 8 * hh)), acc[t]);
    }
  };
  const int64_t full = h / kFp4StepBytes, rest = h % kFp4StepBytes;
  for (int64_t s = 0; s < full; ++s) {
    half(packed + s * kFp4StepBytes, s, 0);
    half(packed + s * kFp4StepBytes + 32, s, 1);
  }
  if (rest) {  // the last step's bytes zero-padded (zero codes meet zero activations and scales)
    alignas(32) uint8_t tail[kFp4StepBytes] = {};
    std::memcpy(tail, packed + full * kFp4StepBytes, rest);
    half(tail, full, 0);
    if (rest > 32) half(tail + 32, full, 1);
  }
  for (int t = 0; t < TT; ++t) out[t * out_stride] = dynamoe::avx2::reduce_add(acc[t]);
}
#endif

// Portable reference of fp4_row_i8 (the same integer sums per lane, the same fp32 scaling; the sum over
// lanes in order): builds without VNNI or AVX2 run this.
template <int kBytesPerGroup, class Codec = E2M1Codec>
void fp4_row_i8_scalar(const uint8_t* packed, int64_t h, const I8Acts& a, int64_t t, const float* gs, float* out) {
  const int8_t* q = a.qt(t);
  const int32_t* c = a.ct(t);
  const float* d = a.dt(t);
  float sum = 0.f;
  for (int64_t s = 0; s * kFp4StepBytes < h; ++s)
    for (int L = 0; L < 16; ++L) {
      int32_t dot = c[s * 16 + L];
      for (int k = 0; k < 4; ++k) {
        const int64_t j = s * kFp4StepBytes + 4 * L + k;
        if (j >= h) break;
        dot += i8_code<Codec>(packed[j] & 15) * q[s * 128 + 4 * L + k] + i8_code<Codec>(packed[j] >> 4) * q[s * 128 + 64 + 4 * L + k];
      }
      const float sc = gs[(s * kFp4StepBytes + 4 * L) / kBytesPerGroup];
      sum += static_cast<float>(dot) * (sc * d[s * 16 + L]);
    }
  *out = sum;
}

// One 4-bit output row for T tokens (chunks of at most 8) with int8 activations
template <int kBytesPerGroup, class Codec = E2M1Codec>
void fp4_row_tokens_i8(const uint8_t* packed, int64_t h, int64_t T, const I8Acts& a, int64_t t_first, const float* gs,
                       float* out, int64_t out_stride) {
#if defined(DYNAMOE_PACKED_INT8)
  dynamoe::for_token_chunks(T, [&]<int TT>(int64_t t0) {
    fp4_row_i8<TT, kBytesPerGroup, Codec>(packed, h, a, t_first + t0, gs, out + t0 * out_stride, out_stride);
  });
#elif defined(DYNAMOE_AVX2)
  dynamoe::for_token_chunks(T, [&]<int TT>(int64_t t0) {
    fp4_row_i8_avx2<TT, kBytesPerGroup, Codec>(packed, h, a, t_first + t0, gs, out + t0 * out_stride, out_stride);
  });
#else
  for (int64_t t = 0; t < T; ++t) fp4_row_i8_scalar<kBytesPerGroup, Codec>(packed, h, a, t_first + t, gs, out + t * out_stride);
#endif
}
}  // namespace dynamoe::packed
