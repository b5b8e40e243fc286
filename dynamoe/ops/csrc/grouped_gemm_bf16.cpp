// Grouped bf16 GEMMs for the MoE layer on CPU: all experts' rows in one call, fp32 accumulation
// (AMX-BF16 tiles where the CPU has them and the call allows, else AVX512-BF16 dot products), the
// gather of each row's token fused into the A loads (AMX: into the per-thread A block), bias, ReLU and
// the combine weight into the epilogue, the scatter-add into each token's output row into the store.
// dynamoe/ops/routed_ffn.py composes these into an FFN-expert forward and backward.
//
// Legend: N routed rows (sorted by group = expert), K reduction, M x Nc output, KP = ceil(K / 2).
//
// Packed operand ("panels"): per panel of 64 columns, KP k-pairs x 64 columns x 2 values, zero padded:
// element (k, c) at ((c / 64) * KP + k / 2) * 128 + (c % 64) * 2 + k % 2. One zmm load is 16 columns x
// one k pair: what vdpbf16ps multiplies with a broadcast (A[m][k], A[m][k+1]) pair. Weights are packed
// once per version (pack_weight); the rows of a weight-gradient product per step (pack_rows).
//
// Rounding points are those of the torch path it replaces: bf16(acc + bias), ReLU, bf16(. * bf16(s)),
// index_add's bf16(y + v); weight gradients are rounded once after an fp32 sum over all of an expert's rows.
#include <torch/extension.h>
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cstdint>
#include <cstring>
#include <vector>
#include "panel_decode.h"
#if defined(__AVX512BF16__)
#include <immintrin.h>
#endif
#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
#include <cpuid.h>
#include <sys/syscall.h>
#include <unistd.h>
#endif

namespace {
using bf16 = c10::BFloat16;
constexpr int64_t kPanel = 64;     // columns per packed panel: 4 zmm of 16 fp32 accumulators
constexpr int64_t kPairStride = 2 * kPanel;
constexpr int kMR = 6;             // rows per micro tile: 6 x 4 accumulators + 4 B + 1 A register
constexpr int64_t kRowBlock = 96;  // rows of A that one tile keeps in L2 while it walks the panels

enum Epilogue : int64_t { kStore = 0, kScatterAdd = 1, kReluGrad = 2 };
enum Activation : int64_t { kNone = 0, kRelu = 1 };

int64_t panels(int64_t cols) { return (cols + kPanel - 1) / kPanel; }
int64_t pairs(int64_t k) { return (k + 1) / 2; }

// Offsets (in elements) of each group's packed rows, and the total, for pack_rows / weight_grad.
std::vector<int64_t> group_starts(const std::vector<int64_t>& counts, int64_t cols) {
  std::vector<int64_t> s(counts.size() + 1, 0);
  for (size_t g = 0; g < counts.size(); ++g) s[g + 1] = s[g] + panels(cols) * pairs(counts[g]) * kPairStride;
  return s;
}

std::vector<int64_t> row_offsets(const std::vector<int64_t>& counts) {
  std::vector<int64_t> o(counts.size() + 1, 0);
  for (size_t g = 0; g < counts.size(); ++g) o[g + 1] = o[g] + counts[g];
  return o;
}

inline float round_bf16(float v) { return static_cast<float>(static_cast<bf16>(v)); }

void check_bf16(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.device().is_cpu() && t.scalar_type() == at::kBFloat16, name, " must be a CPU bf16 tensor, got ",
              t.scalar_type(), " on ", t.device());
}

}  // namespace

// ---- bound argument structs (named fields across the Python/C++ boundary) ----------------------------
struct RowsGemm {
  at::Tensor a;                          // [S, K] bf16, rows contiguous
  c10::optional<at::Tensor> a_index;     // [N] int64: row n reads a[a_index[n]] (fused gather)
  at::Tensor b;                          // [E, NP, KP, 64, 2] bf16 from pack_weight; group g uses b[g % E]
  c10::optional<PackedCodes> packed_b;   // instead of b: E packed (quantized) weights [E, cols, K], each panel
                                         // decoded on the fly (panel_decode.h); store epilogue only
  int64_t cols = 0;                      // output columns (unpadded)
  std::vector<int64_t> counts;           // rows per group, summing to N
  c10::optional<at::Tensor> bias;        // [E, cols] bf16
  int64_t activation = kNone;            // kStore only
  c10::optional<at::Tensor> row_scale;   // [N] fp32 combine weight, used as bf16
  int64_t epilogue = kStore;
  at::Tensor out;                        // [N, cols] (store, relu grad) or [T, cols] (scatter-add) bf16
  c10::optional<at::Tensor> out_index;   // [N] int64: scatter-add row n into out[out_index[n]]
  c10::optional<at::Tensor> relu_out;    // [N, cols] bf16 h (relu grad): out = (h > 0) * bf16(bf16(acc) * s)
  c10::optional<at::Tensor> row_dot;     // [N] fp32 (relu grad): sum_c bf16(bf16(acc) * h)
  bool amx = true;                       // AMX tiles where the build and CPU have them (false: dot products)
};

struct PackRows {
  at::Tensor src;                        // [S, C] bf16, rows contiguous
  c10::optional<at::Tensor> index;       // [N] int64 rows of src
  c10::optional<at::Tensor> scale;       // [N] fp32, used as bf16: packs bf16(src * bf16(scale))
  std::vector<int64_t> counts;           // rows per group
  at::Tensor out;                        // 1-D bf16 of at least packed_rows_numel(counts, C) elements
  c10::optional<at::Tensor> col_sums;    // [G, C] fp32 out: each group's column sums of what was packed
};

struct WeightGrad {
  at::Tensor a;                          // pack_rows of the [N, M] left operand (its transpose is multiplied)
  at::Tensor b;                          // pack_rows of the [N, Nc] right operand
  int64_t m = 0, n = 0;                  // M and Nc
  std::vector<int64_t> counts;           // rows (the reduction) per group
  at::Tensor out;                        // [G, M, Nc] bf16: out[g] = A_g^T B_g; groups without rows get zeros
  bool amx = true;                       // as RowsGemm::amx
};

#if defined(__AVX512BF16__)
namespace {

inline __m512 load_bf16x16(const bf16* p, __mmask16 m) {
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32(_mm256_maskz_loadu_epi16(m, p)), 16));
}
inline void store_bf16x16(bf16* p, __m512 v, __mmask16 m) {
  _mm256_mask_storeu_epi16(p, m, (__m256i)_mm512_cvtneps_pbh(v));
}
inline __m512 round16(__m512 v) {  // fp32 -> nearest bf16 -> fp32
  return _mm512_castsi512_ps(_mm512_slli_epi32(_mm512_cvtepu16_epi32((__m256i)_mm512_cvtneps_pbh(v)), 16));
}
inline int32_t load_pair(const bf16* p) {
  int32_t v;
  std::memcpy(&v, p, 4);
  return v;
}

// acc[i][v] = sum_k A[i][k] * B[k][16 v + lane] over K = 2 KP (+1 with k_tail): A row i's k pair at
// arow[i] + kp * kp_stride, B one packed panel.
template <int MR, int NV>
void micro(const bf16* const* arow, int64_t kp_stride, int64_t KP, bool k_tail, const bf16* bp, __m512* out) {
  __m512 acc[MR][NV];
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_setzero_ps();
  for (int64_t kp = 0; kp < KP; ++kp) {
    const bf16* bk = bp + kp * kPairStride;
    _mm_prefetch(reinterpret_cast<const char*>(bk + 8 * kPairStride), _MM_HINT_T0);
    _mm_prefetch(reinterpret_cast<const char*>(bk + 8 * kPairStride) + 64, _MM_HINT_T0);
    __m512bh b[NV];
    for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(bk + 32 * v);
    for (int i = 0; i < MR; ++i) {
      const __m512bh av = (__m512bh)_mm512_set1_epi32(load_pair(arow[i] + kp * kp_stride));
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], av, b[v]);
    }
  }
  if (k_tail) {  // odd K, row-major A: its last element alone (the packed B's pair is zero padded)
    const bf16* bk = bp + KP * kPairStride;
    __m512bh b[NV];
    for (int v = 0; v < NV; ++v) b[v] = (__m512bh)_mm512_loadu_si512(bk + 32 * v);
    for (int i = 0; i < MR; ++i) {
      uint16_t lo;
      std::memcpy(&lo, arow[i] + KP * kp_stride, 2);
      const __m512bh av = (__m512bh)_mm512_set1_epi32(static_cast<int32_t>(lo));
      for (int v = 0; v < NV; ++v) acc[i][v] = _mm512_dpbf16_ps(acc[i][v], av, b[v]);
    }
  }
  for (int i = 0; i < MR; ++i)
    for (int v = 0; v < NV; ++v) out[i * 4 + v] = acc[i][v];
}

using MicroFn = void (*)(const bf16* const*, int64_t, int64_t, bool, const bf16*, __m512*);
template <int MR>
MicroFn micro_for(int nv) {
  switch (nv) {
    case 1: return &micro<MR, 1>;
    case 2: return &micro<MR, 2>;
    case 3: return &micro<MR, 3>;
    default: return &micro<MR, 4>;
  }
}
MicroFn micro_fn(int mr, int nv) {
  switch (mr) {
    case 1: return micro_for<1>(nv);
    case 2: return micro_for<2>(nv);
    case 3: return micro_for<3>(nv);
    case 4: return micro_for<4>(nv);
    case 5: return micro_for<5>(nv);
    default: return micro_for<6>(nv);
  }
}

inline __mmask16 col_mask(int64_t valid) {
  return valid >= 16 ? (__mmask16)0xFFFF : valid <= 0 ? (__mmask16)0 : (__mmask16)((1u << valid) - 1);
}

// The raw pointers and flags of a RowsGemm, checked once.
struct RowsPlan {
  const bf16* a;
  int64_t lda, K, KP, cols, NP;
  const int64_t* a_index;
  const bf16* b;    // (null with a packed b)
  int64_t b_group;  // elements per packed weight
  int64_t E;        // weights: group g uses weight g % E
  const bf16* bias;
  int64_t activation, epilogue;
  const float* scale;
  bf16* out;
  int64_t ldo;
  const int64_t* out_index;
  const bf16* h;
  float* row_dot;
};

// The epilogue of one output row n (group g) over columns c0 + [0, 16 nv): acc[v] holds columns c0 + 16 v.
void store_row(const RowsPlan& P, int64_t g, int64_t n, int64_t c0, int nv, const __m512* acc) {
  const __m512 s = _mm512_set1_ps(P.scale ? round_bf16(P.scale[n]) : 1.f);
  float dot = 0.f;
  for (int v = 0; v < nv; ++v) {
    const int64_t c = c0 + 16 * v;
    const __mmask16 mk = col_mask(P.cols - c);
    __m512 r = acc[v];
    if (P.bias) r = _mm512_add_ps(r, load_bf16x16(P.bias + (g % P.E) * P.cols + c, mk));
    if (P.epilogue == kReluGrad) {
      r = round16(r);
      const __m512 h = load_bf16x16(P.h + n * P.cols + c, mk);
      dot += _mm512_reduce_add_ps(round16(_mm512_mul_ps(r, h)));
      r = _mm512_mul_ps(r, s);
      r = _mm512_maskz_mov_ps(_mm512_cmp_ps_mask(h, _mm512_setzero_ps(), _CMP_GT_OQ), r);
      store_bf16x16(P.out + n * P.ldo + c, r, mk);
      continue;
    }
    if (P.activation == kRelu) r = _mm512_max_ps(r, _mm512_setzero_ps());
    if (P.scale) r = _mm512_mul_ps(round16(r), s);
    if (P.epilogue == kScatterAdd) {
      bf16* y = P.out + P.out_index[n] * P.ldo + c;
      r = _mm512_add_ps(load_bf16x16(y, mk), round16(r));
      store_bf16x16(y, r, mk);
    } else {
      store_bf16x16(P.out + n * P.ldo + c, r, mk);
    }
  }
  if (P.epilogue == kReluGrad) P.row_dot[n] += dot;
}

// rows [n0, n0 + rows) of group g (all of them in one group) times panels [p0, p1); bg: panel p0 (the rest
// follow it).
void rows_tile(const RowsPlan& P, int64_t g, const bf16* bg, int64_t n0, int64_t rows, int64_t p0, int64_t p1) {
  const bool k_tail = P.K % 2;
  const int64_t KPfull = P.K / 2;
  alignas(64) __m512 acc[kMR * 4];
  for (int64_t p = p0; p < p1; ++p) {
    const bf16* bp = bg + (p - p0) * P.KP * kPairStride;
    const int64_t c0 = p * kPanel, valid = std::min(kPanel, P.cols - c0);
    const int nv = static_cast<int>((valid + 15) / 16);
    for (int64_t m0 = 0; m0 < rows; m0 += kMR) {
      const int mr = static_cast<int>(std::min<int64_t>(kMR, rows - m0));
      const bf16* arow[kMR];
      for (int i = 0; i < mr; ++i) {
        const int64_t n = n0 + m0 + i;
        arow[i] = P.a + (P.a_index ? P.a_index[n] : n) * P.lda;
      }
      // the next micro tile's rows are random (gathered A rows, scattered output rows): fetch them now
      const int64_t nn = n0 + m0 + kMR, nmr = std::min<int64_t>(kMR, n0 + rows - nn);
      if (P.a_index && p == p0)
        for (int64_t i = 0; i < nmr; ++i) {
          const char* r = reinterpret_cast<const char*>(P.a + P.a_index[nn + i] * P.lda);
          for (int64_t off = 0; off < P.K * 2; off += 64) _mm_prefetch(r + off, _MM_HINT_T0);
        }
      if (P.epilogue == kScatterAdd)
        for (int64_t i = 0; i < nmr; ++i) {
          const char* r = reinterpret_cast<const char*>(P.out + P.out_index[nn + i] * P.ldo + c0);
          _mm_prefetch(r, _MM_HINT_T0);
          _mm_prefetch(r + 64, _MM_HINT_T0);
        }
      micro_fn(mr, nv)(arow, 2, KPfull, k_tail, bp, acc);
      for (int i = 0; i < mr; ++i) store_row(P, g, n0 + m0 + i, c0, nv, acc + i * 4);
    }
  }
}


// weight_grad's rows [r, r + rows) of out[g] = A_g^T B_g, both packed with k along the rows (count of them).
void weight_grad_rows(const bf16* ag, const bf16* bg, int64_t count, int64_t n, int64_t r, int64_t rows, bf16* og) {
  const int64_t KP = pairs(count), NPb = panels(n);
  alignas(64) __m512 acc[kMR * 4];
  for (int64_t p = 0; p < NPb; ++p) {
    const int64_t c0 = p * kPanel, valid = std::min(kPanel, n - c0);
    const int nv = static_cast<int>((valid + 15) / 16);
    for (int64_t m0 = 0; m0 < rows; m0 += kMR) {
      const int mr = static_cast<int>(std::min<int64_t>(kMR, rows - m0));
      const bf16* arow[kMR];
      for (int j = 0; j < mr; ++j) {
        const int64_t m = r + m0 + j;
        arow[j] = ag + (m / kPanel) * KP * kPairStride + (m % kPanel) * 2;
      }
      micro_fn(mr, nv)(arow, kPairStride, KP, false, bg + p * KP * kPairStride, acc);
      for (int j = 0; j < mr; ++j)
        for (int v = 0; v < nv; ++v) {
          const int64_t c = c0 + 16 * v;
          store_bf16x16(og + (r + m0 + j) * n + c, acc[j * 4 + v], col_mask(n - c));
        }
    }
  }
}

#if defined(__AMX_TILE__) && defined(__AMX_BF16__)
// ---- AMX-BF16 tiles (Sapphire Rapids and later) ---------------------------------------------------------
// The packed panels are already AMX's B layout: one tile is 16 k pairs x 16 columns x 2 values, rows
// kPairStride elements apart. A is copied (gathered, or transposed for weight gradients) into a
// zero-padded row-major block per thread; results go through an fp32 tile buffer into the same
// epilogues as the dot-product path. tmm0-3: 2 x 2 C tiles (32 rows x 32 columns), tmm4-5 A, tmm6-7 B.
constexpr int64_t kTileK = 32;     // bf16 values along k in one A tile row (64 bytes)
constexpr int64_t kTileRows = 16;  // rows of every tile
constexpr int64_t kBlockRows = 2 * kTileRows, kBlockCols = 32;
constexpr int64_t kCbufCols = kPanel;  // fp32 results of one row block of one panel
constexpr int64_t kKBlock = 256;       // k values of one pass over a panel's 32 rows: A and B blocks in L1

int64_t round_up(int64_t v, int64_t m) { return (v + m - 1) / m * m; }
// Row stride of an A block of kpad values: one cache line more than kpad, so that the 16 rows of a tile
// do not share a few L1 sets (a power-of-two stride maps them all to one or two).
int64_t a_stride(int64_t kpad) { return kpad + kTileK; }

// Whether this process may use the tiles: the CPU has AMX-TILE and AMX-BF16, and Linux granted the
// tile data state (asked once, for the whole process).
bool amx_granted() {
  static const bool ok = [] {
    unsigned a = 0, b = 0, c = 0, d = 0;
    if (!__get_cpuid_count(7, 0, &a, &b, &c, &d) || !(d & (1u << 22)) || !(d & (1u << 24))) return false;
    constexpr long kArchReqXcompPerm = 0x1023, kXfeatureXtiledata = 18;
    return syscall(SYS_arch_prctl, kArchReqXcompPerm, kXfeatureXtiledata) == 0;
  }();
  return ok;
}

struct alignas(64) TileConfig {
  uint8_t palette = 1, start_row = 0;
  uint8_t reserved[14] = {};
  uint16_t colsb[16] = {};
  uint8_t rows[16] = {};
};

// Configures this thread's tiles for its lifetime (one per parallel_for chunk) and releases them.
struct TileScope {
  TileScope() {
    TileConfig cfg;
    for (int t = 0; t < 8; ++t) {
      cfg.colsb[t] = 64;
      cfg.rows[t] = kTileRows;
    }
    _tile_loadconfig(&cfg);
  }
  ~TileScope() { _tile_release(); }
  TileScope(const TileScope&) = delete;
  TileScope& operator=(const TileScope&) = delete;
};

// GCC's _tile_loadd is an asm statement without a memory operand or clobber: to the compiler it reads
// nothing, so stores into a buffer that only tiles read (a zero-padded tail, a gathered A block) could be
// dropped or moved past it. This compiler barrier orders them; it emits no instruction.
inline void tile_loads_fence() { asm volatile("" ::: "memory"); }

// c[32 x 32] fp32 (rows kCbufCols apart; the halves that exist) (+)= a [32 x kpad] (row-major, lda apart, zero
// padded) x b (packed pairs, rows kPairStride elements apart) over k values [k_lo, k_hi) (multiples of kTileK,
// or kpad); accumulate: c holds the sum over the k before k_lo. b's k pairs from kp_valid on read as zero: the
// last step's rows are copied to a zero-padded tile instead of loaded past the packed pairs.
template <bool TWO_ROWS, bool TWO_COLS>
void amx_block(const bf16* a, int64_t lda, int64_t k_lo, int64_t k_hi, const bf16* b, int64_t kp_valid, float* c,
               bool accumulate) {
  tile_loads_fence();  // the caller's A block was just written
  const int64_t cs = kCbufCols * 4;
  if (accumulate) {
    _tile_loadd(0, c, cs);
    if (TWO_COLS) _tile_loadd(1, c + kTileRows, cs);
    if (TWO_ROWS) _tile_loadd(2, c + kTileRows * kCbufCols, cs);
    if (TWO_ROWS && TWO_COLS) _tile_loadd(3, c + kTileRows * kCbufCols + kTileRows, cs);
  } else {
    _tile_zero(0);
    if (TWO_COLS) _tile_zero(1);
    if (TWO_ROWS) _tile_zero(2);
    if (TWO_ROWS && TWO_COLS) _tile_zero(3);
  }
  auto step = [&](int64_t k0, const bf16* bt, int64_t bstride) {
    _tile_loadd(4, a + k0, lda * 2);
    _tile_loadd(6, bt, bstride);
    if (TWO_COLS) _tile_loadd(7, bt + 2 * kTileRows, bstride);
    _tile_dpbf16ps(0, 4, 6);
    if (TWO_COLS) _tile_dpbf16ps(1, 4, 7);
    if (TWO_ROWS) {
      _tile_loadd(5, a + kTileRows * lda + k0, lda * 2);
      _tile_dpbf16ps(2, 5, 6);
      if (TWO_COLS) _tile_dpbf16ps(3, 5, 7);
    }
  };
  const int64_t full = std::min(k_hi, kp_valid / kTileRows * kTileK);  // k values whose 16 pairs all exist in b
  for (int64_t k0 = k_lo; k0 < full; k0 += kTileK) step(k0, b + (k0 / 2) * kPairStride, kPairStride * 2);
  if (full < k_hi) {  // at most one step (the last block's): k_hi - full < kTileK + 2
    alignas(64) bf16 tail[kTileRows * 2 * kBlockCols];
    std::memset(tail, 0, sizeof(tail));
    const int64_t width = (TWO_COLS ? 2 : 1) * 2 * kTileRows;  // elements of one b row that the tiles read
    for (int64_t r = 0; r < kp_valid - full / 2; ++r)
      std::memcpy(tail + r * 2 * kBlockCols, b + (full / 2 + r) * kPairStride, sizeof(bf16) * width);
    tile_loads_fence();
    step(full, tail, sizeof(bf16) * 2 * kBlockCols);
  }
  _tile_stored(0, c, cs);
  if (TWO_COLS) _tile_stored(1, c + kTileRows, cs);
  if (TWO_ROWS) _tile_stored(2, c + kTileRows * kCbufCols, cs);
  if (TWO_ROWS && TWO_COLS) _tile_stored(3, c + kTileRows * kCbufCols + kTileRows, cs);
}

// cbuf [rows x kCbufCols] fp32 = a [rows x kpad] (row-major, lda apart, zero padded; rows <= kBlockRows)
// x the 16-column groups [0, nv) of one packed panel b (kp_valid k pairs exist), k in blocks of kKBlock: a
// block's A rows and B columns stay in L1 for all its steps (the C tiles go through cbuf between blocks).
void amx_panel(const bf16* a, int64_t lda, int64_t kpad, int64_t rows, const bf16* b, int64_t kp_valid, int nv,
               float* cbuf) {
  const bool two_rows = rows > kTileRows;
  for (int64_t k_lo = 0; k_lo < kpad; k_lo += kKBlock) {
    const int64_t k_hi = kpad - k_lo <= kKBlock + kTileK ? kpad : k_lo + kKBlock;  // (no lone step at the end)
    const bool acc = k_lo > 0;
    for (int v = 0; v < nv; v += 2) {
      const bool two_cols = v + 1 < nv;
      const bf16* bv = b + v * 2 * kTileRows;
      float* cv = cbuf + v * kTileRows;
      if (two_rows && two_cols) amx_block<true, true>(a, lda, k_lo, k_hi, bv, kp_valid, cv, acc);
      else if (two_rows) amx_block<true, false>(a, lda, k_lo, k_hi, bv, kp_valid, cv, acc);
      else if (two_cols) amx_block<false, true>(a, lda, k_lo, k_hi, bv, kp_valid, cv, acc);
      else amx_block<false, false>(a, lda, k_lo, k_hi, bv, kp_valid, cv, acc);
    }
    if (k_hi == kpad) break;
  }
}

// This thread's A block and result buffer, grown as needed.
bf16* amx_abuf(int64_t elements) {
  thread_local std::vector<bf16> buf;
  if (static_cast<int64_t>(buf.size()) < elements) buf.resize(elements);
  return buf.data();
}

// rows_tile on AMX tiles: the block's A rows gathered once into a zero-padded buffer, then every panel.
void rows_tile_amx(const RowsPlan& P, int64_t g, const bf16* bg, int64_t n0, int64_t rows, int64_t p0, int64_t p1) {
  const int64_t kpad = round_up(P.K, kTileK), rpad = round_up(rows, kTileRows), lda = a_stride(kpad);
  bf16* a = amx_abuf(rpad * lda);
  for (int64_t i = 0; i < rpad; ++i) {
    bf16* dst = a + i * lda;
    int64_t have = 0;
    if (i < rows) {
      const int64_t n = n0 + i;
      std::memcpy(dst, P.a + (P.a_index ? P.a_index[n] : n) * P.lda, sizeof(bf16) * P.K);
      have = P.K;
    }
    std::memset(dst + have, 0, sizeof(bf16) * (kpad - have));
  }
  alignas(64) float cbuf[kBlockRows * kCbufCols];
  // 32 rows at a time across every panel: their A rows stay in L1 while the panels stream from L2
  for (int64_t m0 = 0; m0 < rows; m0 += kBlockRows) {
    const int64_t mr = std::min(kBlockRows, rows - m0);
    for (int64_t p = p0; p < p1; ++p) {
      const int64_t c0 = p * kPanel, valid = std::min(kPanel, P.cols - c0);
      const int nv = static_cast<int>((valid + 15) / 16);
      amx_panel(a + m0 * lda, lda, kpad, mr, bg + (p - p0) * P.KP * kPairStride, P.KP, nv, cbuf);
      for (int64_t i = 0; i < mr; ++i) {
        __m512 acc[4];
        for (int v = 0; v < nv; ++v) acc[v] = _mm512_load_ps(cbuf + i * kCbufCols + v * 16);
        store_row(P, g, n0 + m0 + i, c0, nv, acc);
      }
    }
  }
}
// A [32 x kpad] row-major block (rows lda apart) from kp_count k pairs of mr <= 32 packed rows (src: pair kp's
// dwords for rows 0.. at src + kp * kPairStride): a[i] holds row i's pairs as dwords -- a dword transpose, in
// 16 x 16 blocks, the edges one by one --; the k values past the pairs and the rows past mr zero.
void transpose_pairs(const bf16* src, int64_t kp_count, int64_t mr, bf16* a, int64_t lda, int64_t kpad) {
  const int64_t kp16 = kp_count / 16 * 16, m16 = mr / 16 * 16;
  for (int64_t i0 = 0; i0 < m16; i0 += 16)
    for (int64_t kp0 = 0; kp0 < kp16; kp0 += 16) {
      __m512i r[16];
      for (int j = 0; j < 16; ++j) r[j] = _mm512_loadu_si512(src + (kp0 + j) * kPairStride + 2 * i0);
      dynamoe::transpose16x16_epi32(r);
      for (int i = 0; i < 16; ++i) _mm512_storeu_si512(a + (i0 + i) * lda + 2 * kp0, r[i]);
    }
  for (int64_t i = 0; i < mr; ++i)
    for (int64_t kp = i < m16 ? kp16 : 0; kp < kp_count; ++kp)
      std::memcpy(a + i * lda + 2 * kp, src + kp * kPairStride + 2 * i, 4);
  for (int64_t i = 0; i < kBlockRows; ++i) {
    const int64_t from = i < mr ? 2 * kp_count : 0;
    std::memset(a + i * lda + from, 0, sizeof(bf16) * (kpad - from));
  }
}

// weight_grad's rows [r, r + rows) of out[g] on AMX tiles: per 32 output rows, the packed A (k along the
// rows) transposed into a row-major [32 x kpad] block (its k pairs are dwords: a dword transpose),
// then every panel of the packed B.
void weight_grad_rows_amx(const bf16* ag, const bf16* bg, int64_t count, int64_t n, int64_t r, int64_t rows,
                          bf16* og) {
  const int64_t KP = pairs(count), kpad = round_up(count, kTileK), lda = a_stride(kpad);
  bf16* a = amx_abuf(kBlockRows * lda);
  alignas(64) float cbuf[kBlockRows * kCbufCols];
  const int64_t NPb = panels(n);
  for (int64_t m0 = 0; m0 < rows; m0 += kBlockRows) {
    const int64_t mr = std::min(kBlockRows, rows - m0), ma = r + m0;  // ma % 32 == 0: within one panel
    const bf16* src = ag + (ma / kPanel) * KP * kPairStride + (ma % kPanel) * 2;
    transpose_pairs(src, KP, mr, a, lda, kpad);
    for (int64_t p = 0; p < NPb; ++p) {
      const int64_t c0 = p * kPanel, valid = std::min(kPanel, n - c0);
      const int nv = static_cast<int>((valid + 15) / 16);
      amx_panel(a, lda, kpad, mr, bg + p * KP * kPairStride, KP, nv, cbuf);
      for (int64_t i = 0; i < mr; ++i)
        for (int v = 0; v < nv; ++v) {
          const int64_t c = c0 + 16 * v;
          store_bf16x16(og + (ma + i) * n + c, _mm512_load_ps(cbuf + i * kCbufCols + v * 16), col_mask(n - c));
        }
    }
  }
}
#define DYNAMOE_GROUPED_AMX 1
#endif  // AMX

// Runs body with this thread's AMX tiles configured when amx (a build and CPU that have them).
template <class F>
void with_tiles(bool amx, F&& body) {
#if defined(DYNAMOE_GROUPED_AMX)
  if (amx) {
    TileScope scope;
    body();
    return;
  }
#endif
  (void)amx;
  body();
}

// Whether a call asking for tiles gets them.
bool tiles_for(bool wanted) {
#if defined(DYNAMOE_GROUPED_AMX)
  return wanted && amx_granted();
#else
  (void)wanted;
  return false;
#endif
}

}  // namespace
#endif

namespace {

// Packed weight of one [R, C] matrix: with k_along_rows B[k][c] = w[k][c] (K = R), else B[k][c] = w[c][k]
// (K = C, the nn.Linear layout).
void pack_matrix(const bf16* w, int64_t R, int64_t C, bool k_along_rows, bf16* dst) {
  const int64_t K = k_along_rows ? R : C, Nc = k_along_rows ? C : R, KP = pairs(K), NP = panels(Nc);
  std::memset(dst, 0, sizeof(bf16) * NP * KP * kPairStride);
  for (int64_t n = 0; n < Nc; ++n) {
    bf16* col = dst + (n / kPanel) * KP * kPairStride + (n % kPanel) * 2;
    if (k_along_rows) {
      for (int64_t k = 0; k < K; ++k) col[(k / 2) * kPairStride + k % 2] = w[k * C + n];
    } else {
      const bf16* row = w + n * C;
      for (int64_t kp = 0; kp < K / 2; ++kp) std::memcpy(col + kp * kPairStride, row + 2 * kp, 4);
      if (K % 2) col[(K / 2) * kPairStride] = row[K - 1];
    }
  }
}

}  // namespace

at::Tensor pack_weight(const at::Tensor& w, bool k_along_rows) {
  check_bf16(w, "w");
  TORCH_CHECK(w.dim() == 3, "w must be [G, R, C], got ", w.sizes());
  const at::Tensor wc = w.contiguous();
  const int64_t G = wc.size(0), R = wc.size(1), C = wc.size(2);
  const int64_t K = k_along_rows ? R : C, Nc = k_along_rows ? C : R;
  at::Tensor out = at::empty({G, panels(Nc), pairs(K), kPanel, 2}, wc.options());
  const bf16* src = wc.data_ptr<bf16>();
  bf16* dst = out.data_ptr<bf16>();
  const int64_t per = panels(Nc) * pairs(K) * kPairStride;
  at::parallel_for(0, G, 1, [&](int64_t g0, int64_t g1) {
    for (int64_t g = g0; g < g1; ++g) pack_matrix(src + g * R * C, R, C, k_along_rows, dst + g * per);
  });
  return out;
}

bool has_grouped_gemm_amx() {
#if defined(DYNAMOE_GROUPED_AMX)
  return amx_granted();
#else
  return false;
#endif
}

int64_t packed_rows_numel(const std::vector<int64_t>& counts, int64_t cols) { return group_starts(counts, cols).back(); }

bool has_grouped_gemm_bf16() {
#if defined(__AVX512BF16__)
  return true;
#else
  return false;
#endif
}

#if defined(__AVX512BF16__)
void pack_rows(const PackRows& A) {
  check_bf16(A.src, "src");
  check_bf16(A.out, "out");
  TORCH_CHECK(A.src.dim() == 2 && A.src.stride(1) == 1, "src must be [S, C] with contiguous rows");
  const int64_t C = A.src.size(1), lds = A.src.stride(0), NP = panels(C);
  const std::vector<int64_t> starts = group_starts(A.counts, C), offs = row_offsets(A.counts);
  const int64_t G = static_cast<int64_t>(A.counts.size()), N = offs.back();
  TORCH_CHECK(A.out.is_contiguous() && A.out.numel() >= starts.back(), "out must hold ", starts.back(), " elements");
  const int64_t* index = nullptr;
  if (A.index) {
    TORCH_CHECK(A.index->scalar_type() == at::kLong && A.index->is_contiguous() && A.index->numel() == N,
                "index must be a contiguous int64 [", N, "]");
    index = A.index->data_ptr<int64_t>();
  } else {
    TORCH_CHECK(A.src.size(0) >= N, "src has fewer rows than the counts sum to");
  }
  const float* scale = nullptr;
  if (A.scale) {
    TORCH_CHECK(A.scale->scalar_type() == at::kFloat && A.scale->is_contiguous() && A.scale->numel() == N,
                "scale must be a contiguous fp32 [", N, "]");
    scale = A.scale->data_ptr<float>();
  }
  float* sums = nullptr;
  if (A.col_sums) {
    TORCH_CHECK(A.col_sums->scalar_type() == at::kFloat && A.col_sums->is_contiguous() && A.col_sums->numel() == G * C,
                "col_sums must be a contiguous fp32 [", G, ", ", C, "]");
    sums = A.col_sums->data_ptr<float>();
  }
  const bf16* src = A.src.data_ptr<bf16>();
  bf16* out = A.out.data_ptr<bf16>();
  const __m512i interleave = _mm512_set_epi16(31, 15, 30, 14, 29, 13, 28, 12, 27, 11, 26, 10, 25, 9, 24, 8, 23, 7, 22,
                                              6, 21, 5, 20, 4, 19, 3, 18, 2, 17, 1, 16, 0);
  // (group, k-pair chunk) work items, so that a few large groups still use every thread; with column
  // sums one item per group (its sums then belong to one thread, added in row order)
  const int64_t chunk = sums ? INT64_MAX / 4 : 64;
  std::vector<std::pair<int64_t, int64_t>> items;
  for (int64_t g = 0; g < G; ++g)
    for (int64_t kp = 0; kp < pairs(A.counts[g]); kp += chunk) items.emplace_back(g, kp);
  if (sums) std::fill(sums, sums + G * C, 0.f);
  at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
    for (int64_t it = i0; it < i1; ++it) {
      const int64_t g = items[it].first, kp0 = items[it].second;
      const int64_t KP = pairs(A.counts[g]), kp1 = std::min(KP, kp0 + chunk);
      bf16* dst = out + starts[g];
      float* acc = sums ? sums + g * C : nullptr;
      for (int64_t kp = kp0; kp < kp1; ++kp) {
        const int64_t r0 = offs[g] + 2 * kp, r1 = r0 + 1;
        const bool has1 = r1 < offs[g + 1];
        const bf16* p0 = src + (index ? index[r0] : r0) * lds;
        const bf16* p1 = has1 ? src + (index ? index[r1] : r1) * lds : nullptr;
        const __m512 s0 = _mm512_set1_ps(scale ? round_bf16(scale[r0]) : 1.f);
        const __m512 s1 = _mm512_set1_ps(scale && has1 ? round_bf16(scale[r1]) : 1.f);
        for (int64_t c = 0; c < NP * kPanel; c += 16) {
          const __mmask16 mk = col_mask(C - c);
          __m512 v0 = load_bf16x16(p0 + c, mk);
          __m512 v1 = has1 ? load_bf16x16(p1 + c, mk) : _mm512_setzero_ps();
          if (scale) {
            v0 = round16(_mm512_mul_ps(v0, s0));
            v1 = round16(_mm512_mul_ps(v1, s1));
          }
          if (acc && mk)
            _mm512_mask_storeu_ps(acc + c, mk, _mm512_add_ps(_mm512_add_ps(_mm512_maskz_loadu_ps(mk, acc + c), v0), v1));
          const __m512i both = (__m512i)_mm512_cvtne2ps_pbh(v1, v0);  // low 16: row r0, high 16: row r1
          _mm512_storeu_si512(dst + ((c / kPanel) * KP + kp) * kPairStride + (c % kPanel) * 2,
                              _mm512_permutexvar_epi16(interleave, both));
        }
      }
    }
  });
}

// This thread's buffers for one decoded panel of a packed b and its rows' scales.
static bf16* panel_buffer(int64_t elements) {
  thread_local std::vector<bf16> buf;
  if (static_cast<int64_t>(buf.size()) < elements) buf.resize(elements);
  return buf.data();
}
static float* panel_scales(int64_t elements) {
  thread_local std::vector<float> buf;
  if (static_cast<int64_t>(buf.size()) < elements) buf.resize(elements);
  return buf.data();
}

void grouped_rows_gemm(const RowsGemm& A) {
  check_bf16(A.a, "a");
  check_bf16(A.out, "out");
  TORCH_CHECK(A.a.dim() == 2 && A.a.stride(1) == 1, "a must be [S, K] with contiguous rows");
  const int64_t K = A.a.size(1), G = static_cast<int64_t>(A.counts.size());
  RowsPlan P{};
  dynamoe::CodesView packed{};
  if (A.packed_b) {
    TORCH_CHECK(A.epilogue == kStore, "a packed b takes the store epilogue only");
    packed = dynamoe::view_codes(*A.packed_b, K, "packed_b");
    TORCH_CHECK(packed.R == A.cols, "packed_b.codes has ", packed.R, " rows per weight, not cols=", A.cols);
    P.E = packed.E;
  } else {
    check_bf16(A.b, "b");
    TORCH_CHECK(A.b.dim() == 5 && A.b.size(3) == kPanel && A.b.size(4) == 2 && A.b.is_contiguous(),
                "b must be a packed weight [E, NP, KP, 64, 2] (pack_weight)");
    TORCH_CHECK(A.b.size(2) == pairs(K) && A.b.size(1) == panels(A.cols), "b packs K=", 2 * A.b.size(2), " x ",
                A.b.size(1) * kPanel, " columns, not K=", K, " x ", A.cols);
    P.E = A.b.size(0);
    P.b = A.b.data_ptr<bf16>();
    P.b_group = A.b.stride(0);
  }
  TORCH_CHECK(P.E >= 1 && G % P.E == 0, "counts has ", G, " groups, not a multiple of the ", P.E, " weights");
  const std::vector<int64_t> offs = row_offsets(A.counts);
  const int64_t N = offs.back();
  P.a = A.a.data_ptr<bf16>();
  P.lda = A.a.stride(0);
  P.K = K;
  P.KP = pairs(K);
  P.cols = A.cols;
  P.NP = panels(A.cols);
  P.activation = A.activation;
  P.epilogue = A.epilogue;
  TORCH_CHECK(A.epilogue >= kStore && A.epilogue <= kReluGrad, "epilogue must be 0 (store), 1 (scatter-add) or 2 (relu grad)");
  TORCH_CHECK(A.activation == kNone || A.activation == kRelu, "activation must be 0 (none) or 1 (relu)");
  auto index_ptr = [&](const c10::optional<at::Tensor>& t, const char* name) -> const int64_t* {
    if (!t) return nullptr;
    TORCH_CHECK(t->scalar_type() == at::kLong && t->is_contiguous() && t->numel() == N, name,
                " must be a contiguous int64 [", N, "]");
    return t->data_ptr<int64_t>();
  };
  P.a_index = index_ptr(A.a_index, "a_index");
  P.out_index = index_ptr(A.out_index, "out_index");
  if (!P.a_index) TORCH_CHECK(A.a.size(0) >= N, "a has fewer rows than the counts sum to");
  if (A.bias) {
    check_bf16(*A.bias, "bias");
    TORCH_CHECK(A.bias->is_contiguous() && A.bias->numel() == P.E * A.cols, "bias must be a contiguous [E, cols]");
    P.bias = A.bias->data_ptr<bf16>();
  }
  if (A.row_scale) {
    TORCH_CHECK(A.row_scale->scalar_type() == at::kFloat && A.row_scale->is_contiguous() && A.row_scale->numel() == N,
                "row_scale must be a contiguous fp32 [", N, "]");
    P.scale = A.row_scale->data_ptr<float>();
  }
  TORCH_CHECK(A.out.dim() == 2 && A.out.size(1) == A.cols && A.out.stride(1) == 1, "out must be [rows, cols]");
  P.out = A.out.data_ptr<bf16>();
  P.ldo = A.out.stride(0);
  if (A.epilogue == kScatterAdd) {
    TORCH_CHECK(P.out_index, "scatter-add needs out_index");
  } else {
    TORCH_CHECK(A.out.size(0) >= N, "out has fewer rows than the counts sum to");
  }
  if (A.epilogue == kReluGrad) {
    TORCH_CHECK(A.relu_out && A.row_dot && P.scale, "relu grad needs relu_out, row_dot and row_scale");
    check_bf16(*A.relu_out, "relu_out");
    TORCH_CHECK(A.relu_out->is_contiguous() && A.relu_out->size(0) >= N && A.relu_out->size(1) == A.cols,
                "relu_out must be a contiguous [N, cols]");
    TORCH_CHECK(A.row_dot->scalar_type() == at::kFloat && A.row_dot->is_contiguous() && A.row_dot->numel() == N,
                "row_dot must be a contiguous fp32 [N]");
    TORCH_CHECK(P.ldo == A.cols, "relu grad's out must be contiguous");
    P.h = A.relu_out->data_ptr<bf16>();
    P.row_dot = A.row_dot->data_ptr<float>();
    std::fill(P.row_dot, P.row_dot + N, 0.f);
  }
  const bool amx = tiles_for(A.amx);
#if defined(DYNAMOE_GROUPED_AMX)
  const auto tile = amx ? &rows_tile_amx : &rows_tile;
#else
  const auto tile = &rows_tile;
#endif
  if (A.packed_b) {
    // (weight, panel) items: each decodes its panel once into this thread's buffer, then every group of that
    // weight runs its rows over it
    std::vector<std::pair<int64_t, int64_t>> items;
    for (int64_t e = 0; e < P.E; ++e) {
      bool rows = false;
      for (int64_t g = e; g < G; g += P.E) rows = rows || A.counts[g] > 0;
      for (int64_t p = 0; rows && p < P.NP; ++p) items.emplace_back(e, p);
    }
    at::parallel_for(0, static_cast<int64_t>(items.size()), 1, [&](int64_t i0, int64_t i1) {
      bf16* panel = panel_buffer(P.KP * kPairStride);
      float* sbuf = panel_scales(16 * packed.scale_cols);
      with_tiles(amx, [&] {
        for (int64_t i = i0; i < i1; ++i) {
          const int64_t e = items[i].first, p = items[i].second;
          dynamoe::decode_panel(packed, e, p, reinterpret_cast<uint16_t*>(panel), sbuf);
          for (int64_t g = e; g < G; g += P.E)
            for (int64_t r = 0; r < A.counts[g]; r += kRowBlock)
              tile(P, g, panel, offs[g] + r, std::min(kRowBlock, A.counts[g] - r), p, p + 1);
        }
      });
    });
    return;
  }
  if (A.epilogue == kScatterAdd) {
    // Rows of one token land in several groups: each thread owns a range of columns, and walks every
    // group's rows in order (index_add's order, so the same bf16 sums)
    const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
    const int64_t per = (P.NP + threads - 1) / threads;
    at::parallel_for(0, (P.NP + per - 1) / per, 1, [&](int64_t t0, int64_t t1) {
      with_tiles(amx, [&] {
        for (int64_t t = t0; t < t1; ++t)
          for (int64_t g = 0; g < G; ++g)
            for (int64_t r = 0; r < A.counts[g]; r += kRowBlock)
              tile(P, g, P.b + (g % P.E) * P.b_group + t * per * P.KP * kPairStride, offs[g] + r,
                   std::min(kRowBlock, A.counts[g] - r), t * per, std::min(P.NP, (t + 1) * per));
      });
    });
    return;
  }
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (group, first row); each tile all panels
  for (int64_t g = 0; g < G; ++g)
    for (int64_t r = 0; r < A.counts[g]; r += kRowBlock) tiles.emplace_back(g, r);
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t i0, int64_t i1) {
    with_tiles(amx, [&] {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t g = tiles[i].first, r = tiles[i].second;
        tile(P, g, P.b + (g % P.E) * P.b_group, offs[g] + r, std::min(kRowBlock, A.counts[g] - r), 0, P.NP);
      }
    });
  });
}

void weight_grad(const WeightGrad& A) {
  check_bf16(A.a, "a");
  check_bf16(A.b, "b");
  check_bf16(A.out, "out");
  const int64_t G = static_cast<int64_t>(A.counts.size());
  const std::vector<int64_t> sa = group_starts(A.counts, A.m), sb = group_starts(A.counts, A.n);
  TORCH_CHECK(A.a.numel() >= sa.back() && A.b.numel() >= sb.back(), "a and b must be pack_rows of the counts");
  TORCH_CHECK(A.out.is_contiguous() && A.out.dim() == 3 && A.out.size(0) == G && A.out.size(1) == A.m &&
                  A.out.size(2) == A.n, "out must be a contiguous [G, m, n]");
  const bf16* pa = A.a.data_ptr<bf16>();
  const bf16* pb = A.b.data_ptr<bf16>();
  bf16* out = A.out.data_ptr<bf16>();
  std::vector<std::pair<int64_t, int64_t>> tiles;  // (group, first output row)
  for (int64_t g = 0; g < G; ++g) {
    if (A.counts[g] == 0) {
      std::memset(out + g * A.m * A.n, 0, sizeof(bf16) * A.m * A.n);
      continue;
    }
    for (int64_t r = 0; r < A.m; r += kRowBlock) tiles.emplace_back(g, r);
  }
#if defined(DYNAMOE_GROUPED_AMX)
  const auto rows_fn = tiles_for(A.amx) ? &weight_grad_rows_amx : &weight_grad_rows;
#else
  const auto rows_fn = &weight_grad_rows;
#endif
  const bool amx = rows_fn != &weight_grad_rows;
  at::parallel_for(0, static_cast<int64_t>(tiles.size()), 1, [&](int64_t i0, int64_t i1) {
    with_tiles(amx, [&] {
      for (int64_t i = i0; i < i1; ++i) {
        const int64_t g = tiles[i].first, r = tiles[i].second;
        rows_fn(pa + sa[g], pb + sb[g], A.counts[g], A.n, r, std::min(kRowBlock, A.m - r), out + g * A.m * A.n);
      }
    });
  });
}
#else
void pack_rows(const PackRows&) { TORCH_CHECK(false, "grouped bf16 GEMM: built without AVX512-BF16"); }
void grouped_rows_gemm(const RowsGemm&) { TORCH_CHECK(false, "grouped bf16 GEMM: built without AVX512-BF16"); }
void weight_grad(const WeightGrad&) { TORCH_CHECK(false, "grouped bf16 GEMM: built without AVX512-BF16"); }
#endif

void register_grouped_gemm(pybind11::module& m) {
  namespace py = pybind11;
  py::enum_<Epilogue>(m, "GemmEpilogue", "what grouped_rows_gemm does with each output value")
      .value("STORE", kStore)
      .value("SCATTER_ADD", kScatterAdd)
      .value("RELU_GRAD", kReluGrad);
  py::enum_<Activation>(m, "GemmActivation", "activation fused into grouped_rows_gemm's store")
      .value("NONE", kNone)
      .value("RELU", kRelu);
  py::class_<RowsGemm>(m, "RowsGemm", "arguments of grouped_rows_gemm (see csrc/grouped_gemm_bf16.cpp)")
      .def(py::init<>())
      .def_readwrite("a", &RowsGemm::a)
      .def_readwrite("a_index", &RowsGemm::a_index)
      .def_readwrite("b", &RowsGemm::b)
      .def_readwrite("packed_b", &RowsGemm::packed_b)
      .def_readwrite("cols", &RowsGemm::cols)
      .def_readwrite("counts", &RowsGemm::counts)
      .def_readwrite("bias", &RowsGemm::bias)
      .def_readwrite("activation", &RowsGemm::activation)
      .def_readwrite("row_scale", &RowsGemm::row_scale)
      .def_readwrite("epilogue", &RowsGemm::epilogue)
      .def_readwrite("out", &RowsGemm::out)
      .def_readwrite("out_index", &RowsGemm::out_index)
      .def_readwrite("relu_out", &RowsGemm::relu_out)
      .def_readwrite("row_dot", &RowsGemm::row_dot)
      .def_readwrite("amx", &RowsGemm::amx);
  py::class_<PackRows>(m, "PackRows", "arguments of pack_rows")
      .def(py::init<>())
      .def_readwrite("src", &PackRows::src)
      .def_readwrite("index", &PackRows::index)
      .def_readwrite("scale", &PackRows::scale)
      .def_readwrite("counts", &PackRows::counts)
      .def_readwrite("out", &PackRows::out)
      .def_readwrite("col_sums", &PackRows::col_sums);
  py::class_<WeightGrad>(m, "WeightGrad", "arguments of weight_grad")
      .def(py::init<>())
      .def_readwrite("a", &WeightGrad::a)
      .def_readwrite("b", &WeightGrad::b)
      .def_readwrite("m", &WeightGrad::m)
      .def_readwrite("n", &WeightGrad::n)
      .def_readwrite("counts", &WeightGrad::counts)
      .def_readwrite("out", &WeightGrad::out)
      .def_readwrite("amx", &WeightGrad::amx);
  m.def("has_grouped_gemm_amx", &has_grouped_gemm_amx,
        "whether grouped_rows_gemm / weight_grad run on AMX-BF16 tiles here (built in, CPU has them, Linux granted them)");
  m.def("has_grouped_gemm_bf16", &has_grouped_gemm_bf16, "whether the grouped bf16 GEMM (AVX512-BF16) was compiled in");
  m.def("pack_weight", &pack_weight, py::arg("w"), py::arg("k_along_rows"), py::call_guard<py::gil_scoped_release>(),
        "w [G, R, C] bf16 -> packed panels [G, NP, KP, 64, 2]: B[k][c] = w[k][c] (k_along_rows) or w[c][k]");
  m.def("packed_rows_numel", &packed_rows_numel, py::arg("counts"), py::arg("cols"),
        "elements pack_rows writes for these group row counts and columns");
  m.def("pack_rows", &pack_rows, py::arg("args"), py::call_guard<py::gil_scoped_release>(),
        "each group's rows (gathered, scaled) into packed panels, k along the rows");
  m.def("grouped_rows_gemm", &grouped_rows_gemm, py::arg("args"), py::call_guard<py::gil_scoped_release>(),
        "per group g: rows of a (gathered) @ packed b[g], with bias / ReLU / row scale / scatter-add / ReLU grad");
  m.def("weight_grad", &weight_grad, py::arg("args"), py::call_guard<py::gil_scoped_release>(),
        "per group g: out[g] = A_g^T B_g over the group's rows, both from pack_rows");
}
