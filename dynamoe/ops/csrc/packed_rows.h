// The packed-weight row kernels (MXFP4, NVFP4, INT4, blockwise FP8) shared by the GEMVs (packed_gemv.cpp)
// and the fused MoE decode (moe_decode_packed.cpp): one output row for TT tokens, decoded in registers.
// MXFP4, NVFP4 and INT4 are one family of 4-bit row kernels: two elements per byte, low nibble = even
// element, one scale per group of bytes; they differ only in the table of a nibble's 16 values (Codec).
#pragma once
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <cstring>
#include <vector>
#include "simd_avx2.h"
#include "token_chunks.h"
#if defined(__AVX512F__)
#include <immintrin.h>
#endif

// The bf16-activation kernels (fp4_row_acts, fp8_row_acts; see "bf16 activations" below): weights decoded
// straight into bf16 words, AVX512-BF16 dot products for one token, fp32 FMAs on the widened words for
// several. Without AVX512-BF16 (kPackedBf16 false) the callers widen bf16 activations to fp32 and run the
// fp32 kernels (fp4_row, fp8_row).
#if defined(__AVX512BF16__) && defined(__AVX512BW__) && defined(__AVX512VL__)
#define DYNAMOE_PACKED_BF16 1
#endif

namespace dynamoe::packed {
// The 4-bit element codecs: `values` by nibble, `bf16` the same values' bf16 bit patterns (all exact), twice
// (the 32-word table of vpermw, which ignores bit 4 of the index: see Fp4Bf16Decoder).
struct E2M1Codec {  // MXFP4, NVFP4
  static constexpr float values[16] = {0.f, .5f, 1.f, 1.5f, 2.f, 3.f, 4.f, 6.f, -0.f, -.5f, -1.f, -1.5f, -2.f, -3.f, -4.f, -6.f};
  static constexpr uint16_t bf16[32] = {
      0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,   // 0, .5, 1, 1.5, 2, 3, 4, 6
      0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0,   // and their negatives
      0x0000, 0x3F00, 0x3F80, 0x3FC0, 0x4000, 0x4040, 0x4080, 0x40C0,
      0x8000, 0xBF00, 0xBF80, 0xBFC0, 0xC000, 0xC040, 0xC080, 0xC0C0};
};
// compressed-tensors pack-quantized INT4 (dynamoe/quant/int4.py): nibble n holds q = n - 8. Its int32 words
// are little-endian, so as bytes they have the FP4 layout (byte j = elements 2j, 2j + 1).
struct Int4Codec {
  static constexpr float values[16] = {-8.f, -7.f, -6.f, -5.f, -4.f, -3.f, -2.f, -1.f, 0.f, 1.f, 2.f, 3.f, 4.f, 5.f, 6.f, 7.f};
  static constexpr uint16_t bf16[32] = {
      0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,   // -8 .. -1
      0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0,   // 0 .. 7
      0xC100, 0xC0E0, 0xC0C0, 0xC0A0, 0xC080, 0xC040, 0xC000, 0xBF80,
      0x0000, 0x3F80, 0x4000, 0x4040, 0x4080, 0x40A0, 0x40C0, 0x40E0};
};

// A codec's values as int8 multiples of `unit` (E2M1: halves; INT4: ones) -- exact for both -- for the AVX2
// rows' byte-shuffle lookup
template <class Codec>
struct Int8Values {
  static constexpr float unit = Codec::values[1] == 0.5f ? 0.5f : 1.f;
  struct Table {
    int8_t v[16];
  };
  static constexpr Table make() {
    Table t{};
    for (int i = 0; i < 16; ++i) t.v[i] = static_cast<int8_t>(Codec::values[i] / unit);
    return t;
  }
  static constexpr Table table = make();
  static_assert([] {
    for (int i = 0; i < 16; ++i)
      if (static_cast<float>(table.v[i]) * unit != Codec::values[i]) return false;
    return true;
  }(), "the codec's values are not int8 multiples of its unit");
};

inline float e4m3_value(uint8_t b) {
  const int s = b >> 7, e = (b >> 3) & 15, m = b & 7;
  if (e == 15 && m == 7) return NAN;
  const float v = e == 0 ? std::ldexp(static_cast<float>(m), -9) : std::ldexp(1.f + m / 8.f, e - 7);
  return s ? -v : v;
}

inline float e8m0_value(uint8_t b) { return b == 255 ? NAN : std::ldexp(1.f, static_cast<int>(b) - 127); }

// the 256-entry decode tables, built once
struct ByteTables {
  float e4m3[256], e8m0[256];
  ByteTables() {
    for (int v = 0; v < 256; ++v) {
      e4m3[v] = e4m3_value(static_cast<uint8_t>(v));
      e8m0[v] = e8m0_value(static_cast<uint8_t>(v));
    }
  }
};
inline const ByteTables& byte_tables() {
  static const ByteTables t;
  return t;
}

#if defined(DYNAMOE_PACKED_BF16)
inline constexpr bool kPackedBf16 = true;
#else
inline constexpr bool kPackedBf16 = false;
#endif

// Software prefetch of the weight rows ahead: decoding takes so few instructions per byte that the
// hardware prefetchers alone leave much of the memory latency of weights not in cache exposed; about
// 8 KiB ahead keeps enough lines in flight. prefetch_row: the row `ahead` rows after row o (of `rows`
// rows of `row_bytes` bytes from `base`).
inline constexpr int64_t kPrefetchBytes = 8192;
inline int64_t prefetch_ahead_rows(int64_t row_bytes) { return std::max<int64_t>(1, kPrefetchBytes / std::max<int64_t>(row_bytes, 1)); }
inline void prefetch_row(const uint8_t* base, int64_t o, int64_t rows, int64_t row_bytes, int64_t ahead) {
  if (o + ahead >= rows) return;
  const uint8_t* p = base + (o + ahead) * row_bytes;
  for (int64_t c = 0; c < row_bytes; c += 64) __builtin_prefetch(p + c, 0, 3);
}
// at the start of a run of rows from o0: the first `ahead` rows at once (more misses in flight than
// demand loads make)
inline void prefetch_first_rows(const uint8_t* base, int64_t o0, int64_t rows, int64_t row_bytes, int64_t ahead) {
  const uint8_t* p = base + o0 * row_bytes;
  const int64_t n = std::min(ahead, rows - o0) * row_bytes;
  for (int64_t c = 0; c < n; c += 64) __builtin_prefetch(p + c, 0, 3);
}

// bf16 <-> fp32 bit patterns: round to nearest even, NaN stays NaN (as c10::BFloat16)
inline uint16_t bf16_bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  if ((u & 0x7FFFFFFFu) > 0x7F800000u) return static_cast<uint16_t>((u >> 16) | 0x40);
  return static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
}
inline float bf16_float(uint16_t b) {
  const uint32_t u = static_cast<uint32_t>(b) << 16;
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// x split into even and odd elements: the low nibble of byte j holds element 2j, the high one 2j+1.
inline void split_even_odd(const float* x, int64_t T, int64_t I, std::vector<float>& xe, std::vector<float>& xo) {
  const int64_t h = I / 2;
  xe.resize(T * h);
  xo.resize(T * h);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t j = 0; j < h; ++j) {
      xe[t * h + j] = x[t * I + 2 * j];
      xo[t * h + j] = x[t * I + 2 * j + 1];
    }
}

// One output row of a 4-bit weight for TT tokens (a compile-time count, so the accumulators live in
// registers): `packed` holds I/2 bytes, `gscale[g]` is the scale of group g, a group spanning
// `bytes_per_group` bytes (16 for MXFP4's 32 elements, 8 for NVFP4's 16; INT4 either, see int4_row_scales).
template <int TT, int kBytesPerGroup, class Codec = E2M1Codec>
void fp4_row(const uint8_t* packed, int64_t h, const float* xe, const float* xo, int64_t x_stride,
             const float* gscale, float* out, int64_t out_stride) {
  float acc_s[TT];
  for (int t = 0; t < TT; ++t) acc_s[t] = 0.f;
  int64_t j = 0;
#if defined(__AVX512F__)
  const __m512 lut = _mm512_loadu_ps(Codec::values);
  __m512 acc[TT];
  for (int t = 0; t < TT; ++t) acc[t] = _mm512_setzero_ps();
  const __m512i low4 = _mm512_set1_epi32(15);
  // lanes 0-7 take group scale 0, lanes 8-15 group scale 1 (NVFP4: two 8-byte groups per step)
  const __m512i two_groups = _mm512_set_epi32(1, 1, 1, 1, 1, 1, 1, 1, 0, 0, 0, 0, 0, 0, 0, 0);
  for (; j + 16 <= h; j += 16) {
    const __m512i b = _mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + j)));
    const __m512 vlo = _mm512_permutexvar_ps(_mm512_and_si512(b, low4), lut);
    const __m512 vhi = _mm512_permutexvar_ps(_mm512_srli_epi32(b, 4), lut);
    const __m512 scale = kBytesPerGroup >= 16
        ? _mm512_set1_ps(gscale[j / kBytesPerGroup])
        : _mm512_permutexvar_ps(two_groups, _mm512_castps128_ps512(_mm_castsi128_ps(
              _mm_loadl_epi64(reinterpret_cast<const __m128i*>(gscale + j / 8)))));
    for (int t = 0; t < TT; ++t) {  // unscaled dot of the step, then one scaled accumulate
      const __m512 g = _mm512_fmadd_ps(vhi, _mm512_loadu_ps(xo + t * x_stride + j),
                                       _mm512_mul_ps(vlo, _mm512_loadu_ps(xe + t * x_stride + j)));
      acc[t] = _mm512_fmadd_ps(g, scale, acc[t]);
    }
  }
  for (int t = 0; t < TT; ++t) acc_s[t] = _mm512_reduce_add_ps(acc[t]);
#elif defined(DYNAMOE_AVX2)
  // 16 bytes (32 elements) a step: the nibbles' values as int8 by one byte shuffle (the codec's values are
  // small integers times kInt8Unit), widened to fp32 8 at a time; bytes 0-7 and 8-15 take their own group's
  // scale (groups are 8 or 16 bytes)
  const __m128i lut = _mm_loadu_si128(reinterpret_cast<const __m128i*>(Int8Values<Codec>::table.v));
  const __m128i low4 = _mm_set1_epi8(15);
  __m256 acc[TT];
  for (int t = 0; t < TT; ++t) acc[t] = _mm256_setzero_ps();
  auto widen = [](__m128i v8) { return _mm256_cvtepi32_ps(_mm256_cvtepi8_epi32(v8)); };
  for (; j + 16 <= h; j += 16) {
    const __m128i b = _mm_loadu_si128(reinterpret_cast<const __m128i*>(packed + j));
    const __m128i lo = _mm_shuffle_epi8(lut, _mm_and_si128(b, low4));
    const __m128i hi = _mm_shuffle_epi8(lut, _mm_and_si128(_mm_srli_epi16(b, 4), low4));
    const __m256 lo0 = widen(lo), lo1 = widen(_mm_srli_si128(lo, 8));
    const __m256 hi0 = widen(hi), hi1 = widen(_mm_srli_si128(hi, 8));
    const __m256 s0 = _mm256_set1_ps(gscale[j / kBytesPerGroup] * Int8Values<Codec>::unit);
    const __m256 s1 = _mm256_set1_ps(gscale[(j + 8) / kBytesPerGroup] * Int8Values<Codec>::unit);
    for (int t = 0; t < TT; ++t) {
      const float* e = xe + t * x_stride + j;
      const float* o = xo + t * x_stride + j;
      const __m256 g0 = _mm256_fmadd_ps(hi0, _mm256_loadu_ps(o), _mm256_mul_ps(lo0, _mm256_loadu_ps(e)));
      const __m256 g1 = _mm256_fmadd_ps(hi1, _mm256_loadu_ps(o + 8), _mm256_mul_ps(lo1, _mm256_loadu_ps(e + 8)));
      acc[t] = _mm256_fmadd_ps(g1, s1, _mm256_fmadd_ps(g0, s0, acc[t]));
    }
  }
  for (int t = 0; t < TT; ++t) acc_s[t] = dynamoe::avx2::reduce_add(acc[t]);
#endif
  for (; j < h; ++j) {
    const float s = gscale[j / kBytesPerGroup];
    const float lo = Codec::values[packed[j] & 15] * s, hi = Codec::values[packed[j] >> 4] * s;
    for (int t = 0; t < TT; ++t) acc_s[t] += lo * xe[t * x_stride + j] + hi * xo[t * x_stride + j];
  }
  for (int t = 0; t < TT; ++t) out[t * out_stride] = acc_s[t];
}

template <int TT>
void fp8_row(const uint8_t* row, int64_t I, const float* xp, const float* srow, int64_t b1, const float* lut,
             float* out, int64_t out_stride) {
  float acc_s[TT];
  for (int t = 0; t < TT; ++t) acc_s[t] = 0.f;
  int64_t i = 0;
#if defined(__AVX512F__)
  if (b1 % 16 == 0) {
    __m512 acc[TT];
    for (int t = 0; t < TT; ++t) acc[t] = _mm512_setzero_ps();
    // e4m3 -> fp16 is a shift: fp16 bits = sign << 8 | (e, m) << 7, worth 2^-8 of the e4m3 value
    // (exactly, subnormals included); the 2^8 goes into the block scale. The e4m3 NaN byte would
    // decode as a finite value here: our quantizer never writes it (a NaN block has a NaN scale).
    const __m256i sign_mask = _mm256_set1_epi16(0x80), body_mask = _mm256_set1_epi16(0x7F);
    for (int64_t blk = 0; blk + b1 <= I; blk += b1) {  // whole scale blocks; b1 % 16 == 0
      const __m512 sv = _mm512_set1_ps(srow[blk / b1] * 256.f);
      for (i = blk; i < blk + b1; i += 16) {
        const __m256i b = _mm256_cvtepu8_epi16(_mm_loadu_si128(reinterpret_cast<const __m128i*>(row + i)));
        const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, sign_mask), 8),
                                          _mm256_slli_epi16(_mm256_and_si256(b, body_mask), 7));
        const __m512 v = _mm512_mul_ps(_mm512_cvtph_ps(h), sv);
        for (int t = 0; t < TT; ++t) acc[t] = _mm512_fmadd_ps(v, _mm512_loadu_ps(xp + t * I + i), acc[t]);
      }
    }
    for (int t = 0; t < TT; ++t) acc_s[t] = _mm512_reduce_add_ps(acc[t]);
  }
#elif defined(DYNAMOE_AVX2)
  if (b1 % 8 == 0) {  // as the AVX-512 path, 8 elements a step (vcvtph2ps: F16C)
    __m256 acc[TT];
    for (int t = 0; t < TT; ++t) acc[t] = _mm256_setzero_ps();
    const __m128i sign_mask = _mm_set1_epi16(0x80), body_mask = _mm_set1_epi16(0x7F);
    for (int64_t blk = 0; blk + b1 <= I; blk += b1) {
      const __m256 sv = _mm256_set1_ps(srow[blk / b1] * 256.f);
      for (i = blk; i < blk + b1; i += 8) {
        const __m128i b = _mm_cvtepu8_epi16(_mm_loadl_epi64(reinterpret_cast<const __m128i*>(row + i)));
        const __m128i h = _mm_or_si128(_mm_slli_epi16(_mm_and_si128(b, sign_mask), 8),
                                       _mm_slli_epi16(_mm_and_si128(b, body_mask), 7));
        const __m256 v = _mm256_mul_ps(_mm256_cvtph_ps(h), sv);
        for (int t = 0; t < TT; ++t) acc[t] = _mm256_fmadd_ps(v, _mm256_loadu_ps(xp + t * I + i), acc[t]);
      }
    }
    for (int t = 0; t < TT; ++t) acc_s[t] = dynamoe::avx2::reduce_add(acc[t]);
  }
#endif
  for (; i < I; ++i) {
    const float w = lut[row[i]] * srow[i / b1];
    for (int t = 0; t < TT; ++t) acc_s[t] += w * xp[t * I + i];
  }
  for (int t = 0; t < TT; ++t) out[t * out_stride] = acc_s[t];
}

// The fp32 scales of one NVFP4 row: e4m3 bytes [G] times the global scale, 16 at a time through fp16
// (see fp8_row); NaN scales (0x7F) take the table ``e4m3`` (e4m3 value * global, 256 entries).
inline void nvfp4_row_scales(const uint8_t* srow, int64_t G, float global_scale, const float* e4m3, float* gs) {
  int64_t g = 0;
#if defined(__AVX512F__)
  const __m512 sv = _mm512_set1_ps(global_scale * 256.f);
  for (; g + 16 <= G; g += 16) {
    const __m128i raw = _mm_loadu_si128(reinterpret_cast<const __m128i*>(srow + g));
    const __m256i b = _mm256_cvtepu8_epi16(raw);
    const __m256i h = _mm256_or_si256(_mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x80)), 8),
                                      _mm256_slli_epi16(_mm256_and_si256(b, _mm256_set1_epi16(0x7F)), 7));
    // e4m3 NaN bytes (0x7F, 0xFF) -> NaN, as the table has them
    const __mmask16 nan = _mm512_cmpeq_epi32_mask(_mm512_and_si512(_mm512_cvtepu8_epi32(raw), _mm512_set1_epi32(0x7F)),
                                                  _mm512_set1_epi32(0x7F));
    _mm512_storeu_ps(gs + g, _mm512_mask_mov_ps(_mm512_mul_ps(_mm512_cvtph_ps(h), sv), nan, _mm512_set1_ps(NAN)));
  }
#endif
  for (; g < G; ++g) gs[g] = e4m3[srow[g]];
}

// The fp32 scales of one MXFP4 row: e8m0 bytes [G] -> 2^(b - 127) (the fp32 bits b << 23; 0 -> 2^-127,
// 255 -> NaN), 16 at a time; ``e8m0`` is the 256-entry table for the rest.
inline void e8m0_row_scales(const uint8_t* srow, int64_t G, const float* e8m0, float* gs) {
  int64_t g = 0;
#if defined(__AVX512F__)
  for (; g + 16 <= G; g += 16) {
    __m512i bits = _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_loadu_si128(reinterpret_cast<const __m128i*>(srow + g))), 23);
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(bits, _mm512_setzero_si512()), _mm512_set1_epi32(0x00400000));
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(bits, _mm512_set1_epi32(0x7F800000)),
                                 _mm512_set1_epi32(0x7FC00000));
    _mm512_storeu_si512(gs + g, bits);
  }
  if (g < G) {  // the last 1..15 groups with masked loads and stores
    const __mmask16 m = static_cast<__mmask16>((1u << (G - g)) - 1);
    __m512i bits = _mm512_slli_epi32(_mm512_cvtepu8_epi32(_mm_maskz_loadu_epi8(m, srow + g)), 23);
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(bits, _mm512_setzero_si512()), _mm512_set1_epi32(0x00400000));
    bits = _mm512_mask_mov_epi32(bits, _mm512_cmpeq_epi32_mask(bits, _mm512_set1_epi32(0x7F800000)),
                                 _mm512_set1_epi32(0x7FC00000));
    _mm512_mask_storeu_epi32(gs + g, m, bits);
    g = G;
  }
#endif
  for (; g < G; ++g) gs[g] = e8m0[srow[g]];
}

// fp16 bits -> fp32 (exact; subnormals, infinities and NaN kept)
inline float fp16_float(uint16_t h) {
  const uint32_t sign = static_cast<uint32_t>(h & 0x8000u) << 16, e = (h >> 10) & 31, m = h & 0x3FFu;
  if (e == 0) {
    const float v = std::ldexp(static_cast<float>(m), -24);
    return sign ? -v : v;
  }
  const uint32_t u = sign | (e == 31 ? 0x7F800000u | (m << 13) : ((e + 112) << 23) | (m << 13));
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}

// INT4 scales: the words of a checkpoint's weight_scale row (codes shared with dynamoe/quant/int4.py's dtypes)
enum ScaleWords : int { kScaleF32 = 0, kScaleBF16 = 1, kScaleF16 = 2 };
// The 4-bit kernels' group for an INT4 group size (a multiple of 16): 32 elements (16 bytes) when it divides
// the group, else 16 (8 bytes); a checkpoint group is then `group / kernel group` kernel groups.
inline int64_t int4_kernel_group(int64_t group) { return group % 32 == 0 ? 32 : 16; }
// The fp32 scales of one INT4 row for the 4-bit kernels: n kernel groups, kernel group k taking the
// checkpoint scale srow[k / rep]; srow holds fp32, bf16 or fp16 words (ScaleWords). rep == 1 (the
// checkpoint group is the kernel group: Kimi's 32) converts 16 words at a time.
inline void int4_row_scales(const void* srow, int words, int64_t n, int64_t rep, float* gs) {
  const uint16_t* s16 = static_cast<const uint16_t*>(srow);
  const float* s32 = static_cast<const float*>(srow);
  if (rep == 1) {
    if (words == kScaleF32) {
      std::memcpy(gs, s32, n * sizeof(float));
      return;
    }
    int64_t k = 0;
#if defined(__AVX512F__)
    for (; k + 16 <= n; k += 16) {
      const __m256i w = _mm256_loadu_si256(reinterpret_cast<const __m256i*>(s16 + k));
      _mm512_storeu_ps(gs + k, words == kScaleBF16 ? _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(w), 16))
                                                   : _mm512_cvtph_ps(w));
    }
#endif
    if (words == kScaleBF16)
      for (; k < n; ++k) gs[k] = bf16_float(s16[k]);
    else
      for (; k < n; ++k) gs[k] = fp16_float(s16[k]);
    return;
  }
  for (int64_t g = 0, k = 0; k < n; ++g) {  // each checkpoint scale spans rep kernel groups
    const float v = words == kScaleF32 ? s32[g] : words == kScaleBF16 ? bf16_float(s16[g]) : fp16_float(s16[g]);
    for (int64_t r = 0; r < rep && k < n; ++r) gs[k++] = v;
  }
}

// ---------------------------------------------------------------------------------------------------
// bf16 activations. The weights are decoded into bf16 words (FP4 values are exact in bf16; e4m3 too, up
// to a power of two); for one token they are multiplied with AVX512-BF16 dot products (32 products per
// instruction, fp32 accumulation; for several, see fp4_row_wide below). The activations are converted once
// per call into a bf16 buffer laid out in the order in which the decoded words come out, zero-padded to
// whole steps; rows of that buffer are `x_stride` apart.
//
// FP4: 64 packed bytes (128 weights, byte j = element 2j in its low nibble, 2j+1 in its high one) per
// step, seen as 32 words of four nibbles: word k holds elements 4k..4k+3 in bits 0-3, 4-7, 8-11, 12-15.
// vpermw looks up the low 5 bits of each word in a 32-word table of bf16 patterns, entry i that of
// E2M1 value i & 15: the word itself and the word shifted right by 4, 8, 12 give four vectors, vector s
// holding element 4k + s in word k -- no masking (bit 4 of the index is ignored by the periodic table).
// fp32 lane i of a dot product sums words 2i, 2i+1, i.e. packed bytes 4i..4i+3 of the step: lanes
// 4L..4L+3 make one MXFP4 group (16 bytes), lanes 2g, 2g+1 one NVFP4 group (8 bytes).
inline constexpr int64_t kFp4StepBytes = 64, kFp4StepElems = 128;
inline int64_t fp4_bf16_stride(int64_t I) { return (I + kFp4StepElems - 1) / kFp4StepElems * kFp4StepElems; }
// the element of a step that position q (0..127) of the activation layout holds: vector q / 32, word q % 32
inline int64_t fp4_bf16_element(int64_t q) { return 4 * (q % 32) + q / 32; }
// out [T, fp4_bf16_stride(I)] = bf16 words x [T, I] (row stride xs) in the FP4 step order, zero-padded
inline void fp4_bf16_acts(const uint16_t* x, int64_t T, int64_t I, int64_t xs, uint16_t* out) {
  const int64_t S = fp4_bf16_stride(I);
  int64_t pos[kFp4StepElems];
  for (int64_t q = 0; q < kFp4StepElems; ++q) pos[q] = fp4_bf16_element(q);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < S; b += kFp4StepElems)
      for (int64_t q = 0; q < kFp4StepElems; ++q) {
        const int64_t i = b + pos[q];
        out[t * S + b + q] = i < I ? x[t * xs + i] : uint16_t{0};
      }
}

// FP8 (e4m3): 32 bytes per step, in order. bf16 bits = sign << 15 | (b & 0x7F) << 4 (the e4m3 exponent
// and mantissa land in the low bits of bf16's), worth 2^-120 of the e4m3 value. So that the products stay
// normal fp32 (the dot product flushes denormals), the activations are stored times 2^64 (exact) and the
// block scale takes the remaining 2^56. The dot product also reads denormal bf16 inputs as zero: e4m3
// subnormals (|value| < 2^-6, under 3.5e-5 of the largest e4m3 value 448) count as 0 here. The e4m3 NaN
// byte would decode as a finite value: our quantizer never writes it (a NaN block has a NaN scale).
inline constexpr int64_t kFp8StepElems = 32;
inline constexpr float kFp8ActScale = 18446744073709551616.f;  // 2^64
inline constexpr float kFp8RestScale = 72057594037927936.f;    // 2^56
inline int64_t fp8_bf16_stride(int64_t I) { return (I + kFp8StepElems - 1) / kFp8StepElems * kFp8StepElems; }
// out [T, fp8_bf16_stride(I)] = bf16 words x [T, I] (row stride xs) times 2^64, zero-padded
inline void fp8_bf16_acts(const uint16_t* x, int64_t T, int64_t I, int64_t xs, uint16_t* out) {
  const int64_t S = fp8_bf16_stride(I);
  for (int64_t t = 0; t < T; ++t) {
    for (int64_t i = 0; i < I; ++i) out[t * S + i] = bf16_bits(bf16_float(x[t * xs + i]) * kFp8ActScale);
    for (int64_t i = I; i < S; ++i) out[t * S + i] = 0;
  }
}

// Several tokens: on Intel VDPBF16PS costs about four fp32 FMAs (its 32 products take twice the issue time of
// two FMAs' 32), so there from two tokens on the decoded bf16 words are widened to fp32 (a shift or a mask per
// 16) and multiplied with fp32 FMAs against fp32 activations (see dots_for_tokens) -- the same products (bf16 x FP4 or e4m3 is
// exact in fp32), fp32 sums. Their layout: per 32 words of a decoded vector, the 16 even words' elements,
// then the 16 odd words' (the fp32 lanes of the two widened vectors). Same strides as the bf16 layouts.
inline int64_t fp4_f32_element(int64_t q) {  // position q of a step: widened vector q / 16, lane q % 16
  const int64_t u = q / 16, k = 2 * (q % 16) + (u & 1);  // decoded vector u / 2, word k
  return 4 * k + u / 2;
}
inline void fp4_f32_acts(const uint16_t* x, int64_t T, int64_t I, int64_t xs, float* out) {
  const int64_t S = fp4_bf16_stride(I);
  int64_t pos[kFp4StepElems];
  for (int64_t q = 0; q < kFp4StepElems; ++q) pos[q] = fp4_f32_element(q);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < S; b += kFp4StepElems)
      for (int64_t q = 0; q < kFp4StepElems; ++q) {
        const int64_t i = b + pos[q];
        out[t * S + b + q] = i < I ? bf16_float(x[t * xs + i]) : 0.f;
      }
}
inline void fp8_f32_acts(const uint16_t* x, int64_t T, int64_t I, int64_t xs, float* out) {
  const int64_t S = fp8_bf16_stride(I);
  for (int64_t t = 0; t < T; ++t)
    for (int64_t b = 0; b < S; b += kFp8StepElems)
      for (int64_t q = 0; q < kFp8StepElems; ++q) {
        const int64_t i = b + 2 * (q % 16) + q / 16;
        out[t * S + b + q] = i < I ? bf16_float(x[t * xs + i]) : 0.f;
      }
}

#if defined(DYNAMOE_PACKED_BF16)
// 64 packed 4-bit bytes -> four vectors of 32 bf16 words (the order above), values from Codec's table
template <class Codec = E2M1Codec>
struct Fp4Bf16Decoder {
  __m512i tab;
  Fp4Bf16Decoder() { tab = _mm512_loadu_si512(Codec::bf16); }
  void operator()(__m512i b, __m512i v[4]) const {
    v[0] = _mm512_permutexvar_epi16(b, tab);
    v[1] = _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 4), tab);
    v[2] = _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 8), tab);
    v[3] = _mm512_permutexvar_epi16(_mm512_srli_epi16(b, 12), tab);
  }
};

inline __m512 dp_bf16(__m512 acc, __m512i w, const uint16_t* x) {
  return _mm512_dpbf16_ps(acc, (__m512bh)w, (__m512bh)_mm512_loadu_si512(x));
}

// One output row of an FP4 weight for TT tokens with bf16 activations: `packed` holds h bytes (h % 8 == 0),
// `xq` the activations in the FP4 step order (fp4_bf16_acts; row stride x_stride), `gs` the fp32 group
// scales zero-padded to whole steps (4 per step for MXFP4, 8 for NVFP4). A partial last step is read
// with a masked load: its missing bytes are zero weights, against zero activations and scales.
template <int TT, int kBytesPerGroup, class Codec = E2M1Codec>
void fp4_row_bf16(const uint8_t* packed, int64_t h, const uint16_t* xq, int64_t x_stride, const float* gs,
                  float* out, int64_t out_stride) {
  static_assert(kBytesPerGroup == 16 || kBytesPerGroup == 8, "MXFP4 (16 bytes) or NVFP4 (8 bytes) groups");
  const Fp4Bf16Decoder<Codec> decode;
  __m512 acc[TT];
  for (int t = 0; t < TT; ++t) acc[t] = _mm512_setzero_ps();
  // fp32 lane i takes the scale of group i / 4 of the step (MXFP4) or i / 2 (NVFP4)
  const __m512i lane_group = kBytesPerGroup == 16 ? _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)
                                                  : _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  auto step = [&](__m512i b, int64_t s) {
    __m512i v[4];
    decode(b, v);
    const uint16_t* xs = xq + s * kFp4StepElems;
    const __m512 sc = _mm512_permutexvar_ps(lane_group, kBytesPerGroup == 16
        ? _mm512_castps128_ps512(_mm_loadu_ps(gs + 4 * s)) : _mm512_castps256_ps512(_mm256_loadu_ps(gs + 8 * s)));
    for (int t = 0; t < TT; ++t) {  // the step's unscaled dot (two chains), then one scaled accumulate
      const uint16_t* x = xs + t * x_stride;
      const __m512 d0 = dp_bf16(dp_bf16(_mm512_setzero_ps(), v[0], x), v[2], x + 64);
      const __m512 d1 = dp_bf16(dp_bf16(_mm512_setzero_ps(), v[1], x + 32), v[3], x + 96);
      acc[t] = _mm512_fmadd_ps(_mm512_add_ps(d0, d1), sc, acc[t]);
    }
  };
  const int64_t full = h / kFp4StepBytes, rest = h % kFp4StepBytes;
  for (int64_t s = 0; s < full; ++s) step(_mm512_loadu_si512(packed + s * kFp4StepBytes), s);
  if (rest) step(_mm512_maskz_loadu_epi8(~uint64_t{0} >> (64 - rest), packed + full * kFp4StepBytes), full);
  for (int t = 0; t < TT; ++t) out[t * out_stride] = _mm512_reduce_add_ps(acc[t]);
}

// One output row of a blockwise FP8 weight for TT tokens with bf16 activations: `xq` from fp8_bf16_acts
// (row stride x_stride), `srow` the row's block scales, b1 % 32 == 0. A partial last step is read with a
// masked load (zero weights against zero activations).
template <int TT>
void fp8_row_bf16(const uint8_t* row, int64_t I, const uint16_t* xq, int64_t x_stride, const float* srow, int64_t b1,
                  float* out, int64_t out_stride) {
  const __m512i keep = _mm512_set1_epi16(static_cast<short>(0x87F0));
  const __m512 rest_scale = _mm512_set1_ps(kFp8RestScale);
  __m512 acc[TT];
  for (int t = 0; t < TT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t c = 0, i0 = 0; i0 < I; ++c, i0 += b1) {
    const int64_t i1 = std::min(I, i0 + b1);
    __m512 d[TT];
    for (int t = 0; t < TT; ++t) d[t] = _mm512_setzero_ps();
    auto step = [&](__m256i raw, int64_t i) {
      // sign-extended to 16 bits and shifted: bit 15 the sign, bits 10-4 exponent and mantissa
      const __m512i w = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(raw), 4), keep);
      for (int t = 0; t < TT; ++t) d[t] = dp_bf16(d[t], w, xq + t * x_stride + i);
    };
    int64_t i = i0;
    for (; i + kFp8StepElems <= i1; i += kFp8StepElems) step(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + i)), i);
    if (i < i1) step(_mm256_maskz_loadu_epi8(~uint32_t{0} >> (32 - (i1 - i)), row + i), i);
    const __m512 sv = _mm512_set1_ps(srow[c]);
    for (int t = 0; t < TT; ++t) acc[t] = _mm512_fmadd_ps(_mm512_mul_ps(d[t], rest_scale), sv, acc[t]);
  }
  for (int t = 0; t < TT; ++t) out[t * out_stride] = _mm512_reduce_add_ps(acc[t]);
}

// fp4_row_bf16 for TT >= 2 tokens: the decoded words widened to fp32, fp32 FMAs against `xf`
// (fp4_f32_acts; row stride x_stride)
template <int TT, int kBytesPerGroup, class Codec = E2M1Codec>
void fp4_row_wide(const uint8_t* packed, int64_t h, const float* xf, int64_t x_stride, const float* gs, float* out,
                  int64_t out_stride) {
  static_assert(kBytesPerGroup == 16 || kBytesPerGroup == 8, "MXFP4 (16 bytes) or NVFP4 (8 bytes) groups");
  const Fp4Bf16Decoder<Codec> decode;
  const __m512i high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 acc[TT];
  for (int t = 0; t < TT; ++t) acc[t] = _mm512_setzero_ps();
  const __m512i lane_group = kBytesPerGroup == 16 ? _mm512_set_epi32(3, 3, 3, 3, 2, 2, 2, 2, 1, 1, 1, 1, 0, 0, 0, 0)
                                                  : _mm512_set_epi32(7, 7, 6, 6, 5, 5, 4, 4, 3, 3, 2, 2, 1, 1, 0, 0);
  auto step = [&](__m512i b, int64_t s) {
    __m512i v[4];
    decode(b, v);
    __m512 w[8];
    for (int k = 0; k < 4; ++k) {  // fp32 lane i: word 2i (even) or 2i + 1 (odd) -- bytes 4i..4i+3 either way
      w[2 * k] = _mm512_castsi512_ps(_mm512_slli_epi32(v[k], 16));
      w[2 * k + 1] = _mm512_castsi512_ps(_mm512_and_si512(v[k], high));
    }
    const __m512 sc = _mm512_permutexvar_ps(lane_group, kBytesPerGroup == 16
        ? _mm512_castps128_ps512(_mm_loadu_ps(gs + 4 * s)) : _mm512_castps256_ps512(_mm256_loadu_ps(gs + 8 * s)));
    const float* xs = xf + s * kFp4StepElems;
    for (int t = 0; t < TT; ++t) {
      const float* x = xs + t * x_stride;
      __m512 d0 = _mm512_mul_ps(w[0], _mm512_loadu_ps(x)), d1 = _mm512_mul_ps(w[1], _mm512_loadu_ps(x + 16));
      for (int u = 2; u < 8; u += 2) {
        d0 = _mm512_fmadd_ps(w[u], _mm512_loadu_ps(x + 16 * u), d0);
        d1 = _mm512_fmadd_ps(w[u + 1], _mm512_loadu_ps(x + 16 * u + 16), d1);
      }
      acc[t] = _mm512_fmadd_ps(_mm512_add_ps(d0, d1), sc, acc[t]);
    }
  };
  const int64_t full = h / kFp4StepBytes, rest = h % kFp4StepBytes;
  for (int64_t s = 0; s < full; ++s) step(_mm512_loadu_si512(packed + s * kFp4StepBytes), s);
  if (rest) step(_mm512_maskz_loadu_epi8(~uint64_t{0} >> (64 - rest), packed + full * kFp4StepBytes), full);
  for (int t = 0; t < TT; ++t) out[t * out_stride] = _mm512_reduce_add_ps(acc[t]);
}

// fp8_row_bf16 for TT >= 2 tokens: the bf16 words re-biased to the e4m3 values themselves (exponent + 120;
// subnormals -> 0, as on the dot-product path, and no denormal fp32 operands), widened to fp32, fp32 FMAs
// against `xf` (fp8_f32_acts; row stride x_stride). b1 % 32 == 0.
template <int TT>
void fp8_row_wide(const uint8_t* row, int64_t I, const float* xf, int64_t x_stride, const float* srow, int64_t b1,
                  float* out, int64_t out_stride) {
  const __m512i keep = _mm512_set1_epi16(static_cast<short>(0x87F0)), exponent = _mm512_set1_epi16(0x0780);
  const __m512i rebias = _mm512_set1_epi16(120 << 7), high = _mm512_set1_epi32(static_cast<int>(0xFFFF0000u));
  __m512 acc[TT];
  for (int t = 0; t < TT; ++t) acc[t] = _mm512_setzero_ps();
  for (int64_t c = 0, i0 = 0; i0 < I; ++c, i0 += b1) {
    const int64_t i1 = std::min(I, i0 + b1);
    __m512 d[TT];
    for (int t = 0; t < TT; ++t) d[t] = _mm512_setzero_ps();
    auto step = [&](__m256i raw, int64_t i) {
      __m512i v = _mm512_and_si512(_mm512_slli_epi16(_mm512_cvtepi8_epi16(raw), 4), keep);
      v = _mm512_maskz_add_epi16(_mm512_test_epi16_mask(v, exponent), v, rebias);
      const __m512 we = _mm512_castsi512_ps(_mm512_slli_epi32(v, 16)), wo = _mm512_castsi512_ps(_mm512_and_si512(v, high));
      for (int t = 0; t < TT; ++t) {
        const float* x = xf + t * x_stride + i;
        d[t] = _mm512_fmadd_ps(wo, _mm512_loadu_ps(x + 16), _mm512_fmadd_ps(we, _mm512_loadu_ps(x), d[t]));
      }
    };
    int64_t i = i0;
    for (; i + kFp8StepElems <= i1; i += kFp8StepElems) step(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(row + i)), i);
    if (i < i1) step(_mm256_maskz_loadu_epi8(~uint32_t{0} >> (32 - (i1 - i)), row + i), i);
    const __m512 sv = _mm512_set1_ps(srow[c]);
    for (int t = 0; t < TT; ++t) acc[t] = _mm512_fmadd_ps(d[t], sv, acc[t]);
  }
  for (int t = 0; t < TT; ++t) out[t * out_stride] = _mm512_reduce_add_ps(acc[t]);
}

// Which kernels take several tokens. Where VDPBF16PS is slow against FMAs (Intel: one port, twice the issue
// time of two FMAs' products) the widened kernels win; on AMD Zen 4 (VDPBF16PS as cheap as an FMA) the dot
// products are 2-2.7x the widened kernels' rate at 2..8 tokens (docs/benchmarks.md). Both multiply exactly
// and sum in fp32; only the order of the sums differs. Decided once per process from the CPU's vendor.
inline bool dots_for_tokens() {
  static const bool amd = [] {
    __builtin_cpu_init();
    return __builtin_cpu_is("amd") != 0;
  }();
  return amd;
}

// The bf16-activation rows for TT tokens: the dot-product kernels for one token (and for several where
// dots_for_tokens), the widened ones for more. q / xf: the two layouts of the same activations (row stride xs).
template <int TT, int kBytesPerGroup, class Codec = E2M1Codec>
void fp4_row_acts(const uint8_t* packed, int64_t h, const uint16_t* q, const float* xf, int64_t xs, const float* gs,
                  float* out, int64_t out_stride) {
  if (TT == 1 || dots_for_tokens()) fp4_row_bf16<TT, kBytesPerGroup, Codec>(packed, h, q, xs, gs, out, out_stride);
  else fp4_row_wide<TT, kBytesPerGroup, Codec>(packed, h, xf, xs, gs, out, out_stride);
}
template <int TT>
void fp8_row_acts(const uint8_t* row, int64_t I, const uint16_t* q, const float* xf, int64_t xs, const float* srow,
                  int64_t b1, float* out, int64_t out_stride) {
  if (TT == 1 || dots_for_tokens()) fp8_row_bf16<TT>(row, I, q, xs, srow, b1, out, out_stride);
  else fp8_row_wide<TT>(row, I, xf, xs, srow, b1, out, out_stride);
}
#endif  // DYNAMOE_PACKED_BF16

// One 4-bit output row for T tokens (chunks of at most 8): the bf16-activation kernels when `q` is given
// (q / qf: its two layouts, row stride qs), else the fp32 ones on the even/odd split (xe / xo, row stride h).
template <int kBytesPerGroup, class Codec = E2M1Codec>
void fp4_row_tokens(const uint8_t* packed, int64_t h, int64_t T, const uint16_t* q, const float* qf, int64_t qs,
                    const float* xe, const float* xo, const float* gs, float* out, int64_t out_stride) {
#if defined(DYNAMOE_PACKED_BF16)
  if (q) {
    dynamoe::for_token_chunks(T, [&]<int TT>(int64_t t0) {
      fp4_row_acts<TT, kBytesPerGroup, Codec>(packed, h, q + t0 * qs, qf + t0 * qs, qs, gs, out + t0 * out_stride, out_stride);
    });
    return;
  }
#endif
  dynamoe::for_token_chunks(T, [&]<int TT>(int64_t t0) {
    fp4_row<TT, kBytesPerGroup, Codec>(packed, h, xe + t0 * h, xo + t0 * h, h, gs, out + t0 * out_stride, out_stride);
  });
}
}  // namespace dynamoe::packed
