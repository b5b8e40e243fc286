// A decode step (B <= 16 rows: one new token of each of several sequences, and consecutive positions of one
// sequence's prompt chunk beside them) through a decoder layer's attention block in one call (CPU, bf16 or fp32),
// reading the layer's AttentionWeights (decode_weights.h). Per row b:
//   x = RMSNorm(h_b) (scale w or 1 + w); q, k, v = x W_qkv^T (+ b); q/k RMSNorm per head (optional); RoPE on q and k at
//   position pos_b (none on a NoPE layer); k, v written into the paged cache at (slot_b, pos_b) -- block
//   table[slot_b][pos_b / bs], offset pos_b % bs; per query head, softmax(q k_j^T * scale) over the keys j
//   of its KV head in [pos_b - window + 1, pos_b] (all of 0..pos_b without a
//   window), with an optional per-head sink logit in the softmax's denominator (GPT-OSS); an optional
//   output gate: each head's attention output times act(x W_gate^T (+ b)), one gate per head or per channel,
//   act sigmoid or softplus (AFMoE, Step-3.5, Qwen3-Next, Laguna);
//   every row's k and v are written before any row attends, so a chunk's row sees the chunk's earlier rows;
//   out_b = h_b + (attention W_o^T (+ b)). The projections run as GEMVs over all B rows at once: dense ones
//   through gemv_blocks.h, packed ones (LinearWeights, decode_weights.h) through packed_gemv.cpp's kernels.
// It replaces ~40 small ops per layer and step. Roundings follow the op-by-op path where it rounds
// (projections, norms, RoPE, the attention output and the residual sum in x's dtype); the attention
// itself is fp32 (scores, softmax, weighted sum), as SDPA computes it on CPU.
// Registered in packed_gemv.cpp's module.
#include <torch/extension.h>
#include "decode_ops.h"
#include <ATen/Parallel.h>
#include <c10/util/BFloat16.h>
#include <algorithm>
#include <cmath>
#include <cstdint>
#include <limits>
#include <type_traits>
#include <utility>
#include <vector>
#include "decode_rows.h"
#include "gemv_blocks.h"

namespace {

// out [B, O] = x [B, I] W^T [O, I] (+ bias), fp32 accumulation, rounded to the dtype
template <typename scalar_t>
void gemv(const scalar_t* x, int64_t B, const scalar_t* w, int64_t O, int64_t I, const scalar_t* bias, scalar_t* out) {
  const int64_t blocks = (O + dynamoe::kGemvRowBlock - 1) / dynamoe::kGemvRowBlock;
  at::parallel_for(0, blocks, dynamoe::grain_blocks(I, sizeof(scalar_t)), [&](int64_t begin, int64_t end) {
    for (int64_t b = begin; b < end; ++b)
      dynamoe::row_block(w, O, I, b * dynamoe::kGemvRowBlock, x, I, B, bias, out, O);
  });
}

// one projection: out [B, ld] columns [col, col + O) = x [B, I] W^T + b, rounded to the dtype. Dense: the
// GEMV above; packed: the format's kernel (fp32 y), the fp32 bias added, then rounded (QuantizedLinear)
template <typename scalar_t>
int64_t linear_rows(const scalar_t* x, int64_t B, int64_t I, const dynamoe::LinearWeights& lw, c10::ScalarType dt,
                    const char* name, scalar_t* out, int64_t ld, int64_t col) {
  const torch::Tensor& w = lw.w;
  TORCH_CHECK(w.defined() && w.dim() >= 2 && w.is_contiguous() && w.device().is_cpu(), name,
              ": the weight must be a contiguous CPU tensor");
  const int64_t O = w.size(0);
  TORCH_CHECK(col + O <= ld, name, ": ", O, " outputs at column ", col, " overrun the ", ld, " of the block");
  if (lw.format == dynamoe::kDense) {
    TORCH_CHECK(w.dim() == 2 && w.size(1) == I && w.scalar_type() == dt, name, ": a dense weight must be [", O, ", ", I,
                "] of h's dtype");
    const scalar_t* bias = nullptr;
    if (lw.bias.has_value()) {
      TORCH_CHECK(lw.bias->numel() == O && lw.bias->is_contiguous() && lw.bias->scalar_type() == dt, name,
                  ": a dense bias must be contiguous [", O, "] of h's dtype");
      bias = lw.bias->data_ptr<scalar_t>();
    }
    if (col == 0 && O == ld) {
      gemv(x, B, w.data_ptr<scalar_t>(), O, I, bias, out);
    } else {
      std::vector<scalar_t> y(B * O);
      gemv(x, B, w.data_ptr<scalar_t>(), O, I, bias, y.data());
      for (int64_t b = 0; b < B; ++b) std::copy(y.data() + b * O, y.data() + (b + 1) * O, out + b * ld + col);
    }
    return O;
  }
  TORCH_CHECK(lw.scale.has_value(), name, ": a packed weight needs its scale");
  const torch::Tensor xt = torch::from_blob(const_cast<scalar_t*>(x), {B, I}, torch::TensorOptions().dtype(dt));
  torch::Tensor y;
  switch (lw.format) {
    case dynamoe::kFp8Block: y = fp8_block_gemv(xt, w, *lw.scale, lw.blk0, lw.blk1, lw.acts); break;
    case dynamoe::kMxfp4: y = mxfp4_gemv(xt, w, *lw.scale, lw.acts); break;
    case dynamoe::kNvfp4: y = nvfp4_gemv(xt, w, *lw.scale, lw.global_scale, lw.acts); break;
    case dynamoe::kInt4: y = int4_gemv(xt, w, *lw.scale, lw.blk0, lw.acts); break;
    default: TORCH_CHECK(false, name, ": unknown weight format ", static_cast<int64_t>(lw.format));
  }
  TORCH_CHECK(y.size(0) == B && y.size(1) == O, name, ": the packed kernel gave ", y.sizes(), " for ", O, " outputs");
  const float* bias = nullptr;
  if (lw.bias.has_value()) {
    TORCH_CHECK(lw.bias->numel() == O && lw.bias->is_contiguous() && lw.bias->scalar_type() == torch::kFloat, name,
                ": a packed weight's bias must be contiguous fp32 [", O, "]");
    bias = lw.bias->data_ptr<float>();
  }
  const float* yp = y.data_ptr<float>();
  for (int64_t b = 0; b < B; ++b)
    for (int64_t o = 0; o < O; ++o)
      out[b * ld + col + o] = static_cast<scalar_t>(bias ? yp[b * O + o] + bias[o] : yp[b * O + o]);
  return O;
}

// The paged cache: [K, NB, bs, d] blocks of bs positions; a row's position j is in block table[slot][j / bs].
struct Paged {
  int64_t blocks, bs, d, width;  // NB, positions per block, head dim, table entries per slot
  const int64_t* table;          // [slots, width]
  // offset of (KV head kv, position j) of slot s, in elements
  int64_t at(int64_t s, int64_t kv, int64_t j) const {
    return ((kv * blocks + table[s * width + j / bs]) * bs + j % bs) * d;
  }
};

// The rows of keys j0, j0 + 1, ... of (slot, KV head kv) in one cache tensor, block by block (no division per key).
template <typename scalar_t>
struct KeyWalk {
  const scalar_t* cache;
  const Paged& pg;
  const int64_t* table;  // the slot's block table
  int64_t kv, block, off;
  KeyWalk(const scalar_t* c, const Paged& p, int64_t slot, int64_t kv_, int64_t j0)
      : cache(c), pg(p), table(p.table + slot * p.width), kv(kv_), block(j0 / p.bs), off(j0 % p.bs) {}
  const scalar_t* row() const { return cache + ((kv * pg.blocks + table[block]) * pg.bs + off) * pg.d; }
  void next() {
    if (++off == pg.bs) {
      off = 0;
      ++block;
    }
  }
};

// A cache row as fp32: the row itself for an fp32 cache, else converted into buf.
inline const float* row_f32(const float* src, float*, int64_t) { return src; }
inline const float* row_f32(const c10::BFloat16* src, float* buf, int64_t d) {
  int64_t i = 0;
#if defined(__AVX512F__)
  for (; i + 16 <= d; i += 16)
    _mm512_storeu_ps(buf + i, _mm512_castsi512_ps(_mm512_slli_epi32(
                                  _mm512_cvtepu16_epi32(_mm256_loadu_si256(reinterpret_cast<const __m256i*>(src + i))), 16)));
#endif
  for (; i < d; ++i) buf[i] = static_cast<float>(src[i]);
  return buf;
}

// One row's attention, query heads of KV head kv: the softmax-weighted sum of the keys [j0, pos] of its slot.
// Its G query heads share every key and value row, converted to fp32 once; scores by 16-lane dot products,
// the softmax's exponentials 16 at a time (decode_rows.h), the weighted sum of values over fp32 arrays.
struct RowScratch {
  std::vector<float> p, acc, qf, row, den;
};

template <typename scalar_t>
void attend_row(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, const Paged& pg, int64_t slot,
                int64_t pos, int64_t kv, int64_t window, int64_t H, int64_t G, float scale, const float* sinks,
                scalar_t* out, RowScratch& s) {
  const int64_t d = pg.d;
  const int64_t j0 = window > 0 ? std::max<int64_t>(0, pos - window + 1) : 0, n = pos + 1 - j0;
  s.p.resize(G * n);
  s.acc.assign(G * d, 0.f);
  s.qf.resize(G * d);
  s.row.resize(d);
  s.den.resize(G);
  float* p = s.p.data();
  float* row = s.row.data();
  for (int64_t i = 0; i < G * d; ++i) s.qf[i] = static_cast<float>(q[kv * G * d + i]);
  KeyWalk<scalar_t> keys(k_cache, pg, slot, kv, j0);
  for (int64_t j = 0; j < n; ++j, keys.next()) {
    const float* kf = row_f32(keys.row(), row, d);
    for (int64_t g = 0; g < G; ++g) p[g * n + j] = dynamoe::dot_rows(s.qf.data() + g * d, kf, d) * scale;
  }
  for (int64_t g = 0; g < G; ++g) {
    float* pg_ = p + g * n;
    const int64_t h = kv * G + g;
    float mx = -std::numeric_limits<float>::infinity();
    for (int64_t j = 0; j < n; ++j) mx = std::max(mx, pg_[j]);
    if (sinks) mx = std::max(mx, sinks[h]);
    s.den[g] = dynamoe::exp_shifted(pg_, n, mx) + (sinks ? std::exp(sinks[h] - mx) : 0.f);
  }
  KeyWalk<scalar_t> vals(v_cache, pg, slot, kv, j0);
  for (int64_t j = 0; j < n; ++j, vals.next()) {
    const float* vf = row_f32(vals.row(), row, d);
    for (int64_t g = 0; g < G; ++g) {
      const float wj = p[g * n + j] / s.den[g];
      float* __restrict__ ag = s.acc.data() + g * d;
      const float* __restrict__ vr = vf;
      for (int64_t i = 0; i < d; ++i) ag[i] += wj * vr[i];
    }
  }
  scalar_t* o = out + kv * G * d;
  for (int64_t i = 0; i < G * d; ++i) o[i] = static_cast<scalar_t>(s.acc[i]);
}

// R > 1 rows of one slot at consecutive positions pos0 + r (a prefill chunk decoded beside other rows), KV head
// kv: row r's G query heads over the keys [j0_r, pos0 + r] (its own and the earlier rows' keys were written
// before). Its Q = R * G queries share each key and value row. q and out: row r's heads at r * H * d.
#if defined(__AVX512F__)
// Which keys each query lane sees: row[q] (-1: a padding lane) and the first key first[q] its window keeps;
// key j (relative to the first key read) is seen by lane q when j - base <= row[q] and j >= first[q].
struct LaneBounds {
  const int32_t* row;
  const int32_t* first;
  int64_t base;
};

// Scores of the n keys from lo + jstart of (slot, kv) for NV * 16 query lanes (qt: the queries transposed,
// [d][ldq]): p[j * ldq + lane] = q . k_(jstart + j) * scale where seen, else -inf; mx[v] the running maxima.
template <int NV, typename scalar_t>
void scores_pass(const scalar_t* k_cache, const Paged& pg, int64_t slot, int64_t kv, int64_t lo, int64_t jstart,
                 int64_t n, int64_t d, const float* qt, int64_t ldq, float scale, const LaneBounds& lanes, float* p,
                 __m512* mx) {
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), sc = _mm512_set1_ps(scale);
  __m512 m[NV];
  __m512i row[NV], first[NV];
  for (int v = 0; v < NV; ++v) {
    m[v] = mx[v];
    row[v] = _mm512_loadu_si512(lanes.row + 16 * v);
    first[v] = _mm512_loadu_si512(lanes.first + 16 * v);
  }
  constexpr int64_t KU = NV <= 2 ? 4 : 2;  // keys at a time: independent multiply-add chains
  KeyWalk<scalar_t> keys(k_cache, pg, slot, kv, lo + jstart);
  for (int64_t j0 = 0; j0 < n; j0 += KU) {
    const int64_t nk = std::min(KU, n - j0);
    const scalar_t* kr[KU];
    for (int64_t u = 0; u < KU; ++u) {
      kr[u] = u < nk ? keys.row() : kr[u - 1];
      if (u < nk) keys.next();
    }
    __m512 acc[KU][NV];
    for (int64_t u = 0; u < KU; ++u)
      for (int v = 0; v < NV; ++v) acc[u][v] = _mm512_setzero_ps();
    for (int64_t i = 0; i < d; ++i) {
      __m512 qv[NV];
      for (int v = 0; v < NV; ++v) qv[v] = _mm512_loadu_ps(qt + i * ldq + 16 * v);
      for (int64_t u = 0; u < KU; ++u) {
        const __m512 kb = _mm512_set1_ps(static_cast<float>(kr[u][i]));
        for (int v = 0; v < NV; ++v) acc[u][v] = _mm512_fmadd_ps(kb, qv[v], acc[u][v]);
      }
    }
    for (int64_t u = 0; u < nk; ++u) {
      const int64_t j = j0 + u;
      const __m512i jr = _mm512_set1_epi32(static_cast<int32_t>(jstart + j - lanes.base));
      const __m512i jj = _mm512_set1_epi32(static_cast<int32_t>(jstart + j));
      for (int v = 0; v < NV; ++v) {
        const __mmask16 seen = _mm512_cmpge_epi32_mask(row[v], jr) & _mm512_cmple_epi32_mask(first[v], jj);
        const __m512 sv = _mm512_mask_mul_ps(ninf, seen, acc[u][v], sc);
        _mm512_storeu_ps(p + j * ldq + 16 * v, sv);
        m[v] = _mm512_max_ps(m[v], sv);
      }
    }
  }
  for (int v = 0; v < NV; ++v) mx[v] = m[v];
}

// acc[0, 16 DV) += sum over j < count of w[j * ldw] * vals[j * 16 DV ...] (fp32 value rows, zero padded)
template <int DV>
void weighted_values_n(const float* w, int64_t ldw, int64_t count, const float* vals, float* acc) {
  __m512 o[DV];
  for (int c = 0; c < DV; ++c) o[c] = _mm512_loadu_ps(acc + 16 * c);
  for (int64_t j = 0; j < count; ++j) {
    const __m512 wj = _mm512_set1_ps(w[j * ldw]);
    const float* vr = vals + j * DV * 16;
    for (int c = 0; c < DV; ++c) o[c] = _mm512_fmadd_ps(wj, _mm512_loadu_ps(vr + 16 * c), o[c]);
  }
  for (int c = 0; c < DV; ++c) _mm512_storeu_ps(acc + 16 * c, o[c]);
}

template <int... DVs>
void weighted_values_any(int64_t DV, const float* w, int64_t ldw, int64_t count, const float* vals, float* acc,
                         std::integer_sequence<int, DVs...>) {
  ((DV == DVs + 1 ? (weighted_values_n<DVs + 1>(w, ldw, count, vals, acc), true) : false) || ...);
}

// the value accumulators of one query in registers: DV = ceil(head dim / 16) <= 16
inline void weighted_values(int64_t DV, const float* w, int64_t ldw, int64_t count, const float* vals, float* acc) {
  weighted_values_any(DV, w, ldw, count, vals, acc, std::make_integer_sequence<int, 16>{});
}

// scores_pass for any number of lane vectors NV: 1-4 at once, more four at a time
template <typename scalar_t>
void scores_block(int64_t NV, const scalar_t* k_cache, const Paged& pg, int64_t slot, int64_t kv, int64_t lo,
                  int64_t jstart, int64_t n, int64_t d, const float* qt, int64_t ldq, float scale,
                  const LaneBounds& lanes, float* p, __m512* mx) {
  for (int64_t v0 = 0; v0 < NV; v0 += 4) {
    const int64_t nv = std::min<int64_t>(4, NV - v0);
    const LaneBounds part{lanes.row + 16 * v0, lanes.first + 16 * v0, lanes.base};
    auto run = [&](auto tag) {
      scores_pass<decltype(tag)::value, scalar_t>(k_cache, pg, slot, kv, lo, jstart, n, d, qt + 16 * v0, ldq, scale,
                                                  part, p + 16 * v0, mx + v0);
    };
    if (nv == 4) run(std::integral_constant<int, 4>{});
    else if (nv == 3) run(std::integral_constant<int, 3>{});
    else if (nv == 2) run(std::integral_constant<int, 2>{});
    else run(std::integral_constant<int, 1>{});
  }
}

// With AVX-512 the queries are the vector lanes: scores of one key for 16 queries per multiply-add (the
// queries transposed once, [d][Qp]); keys in blocks of kBlock with an online softmax (per lane: the running
// maximum and sum, the weighted values rescaled as the maximum grows), so that only the keys and values stream
// from memory; value rows converted to fp32 once per block.
template <typename scalar_t>
void attend_rows_of_slot(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, const Paged& pg,
                         int64_t slot, int64_t pos0, int64_t R, int64_t kv, int64_t window, int64_t H, int64_t G,
                         float scale, const float* sinks, scalar_t* out, RowScratch& s) {
  constexpr int64_t kBlock = 64;   // keys per block: its scores and fp32 value rows stay in L1
  constexpr int64_t kMaxDV = 16;   // value accumulators of one query in registers: head dims up to 256
  const int64_t d = pg.d, Q = R * G, Qp = (Q + 15) / 16 * 16, NV = Qp / 16, DV = (d + 15) / 16;
  if (DV > kMaxDV) {  // (no such head yet) each row as a decode row of its own
    for (int64_t r = 0; r < R; ++r)
      attend_row(q + r * H * d, k_cache, v_cache, pg, slot, pos0 + r, kv, window, H, G, scale, sinks, out + r * H * d, s);
    return;
  }
  const int64_t lo = window > 0 ? std::max<int64_t>(0, pos0 - window + 1) : 0, n = pos0 + R - lo;
  s.qf.assign(d * Qp, 0.f);   // queries transposed: qf[i * Qp + qi]
  s.p.resize(kBlock * Qp);    // one block's scores, then weights: p[j * Qp + qi]
  s.acc.assign(Q * DV * 16, 0.f);
  s.row.resize(kBlock * DV * 16);
  for (int64_t qi = 0; qi < Q; ++qi) {
    const scalar_t* qr = q + (qi / G) * H * d + (kv * G + qi % G) * d;
    for (int64_t i = 0; i < d; ++i) s.qf[i * Qp + qi] = static_cast<float>(qr[i]);
  }
  // per lane: its row (for the causal bound), the first key its window keeps (padding lanes: row -1)
  std::vector<int32_t> rows(Qp, -1), firsts(Qp, 0);
  std::vector<float> m0(Qp, -std::numeric_limits<float>::infinity()), alpha(Qp), den(Qp);
  for (int64_t qi = 0; qi < Q; ++qi) {
    rows[qi] = static_cast<int32_t>(qi / G);
    firsts[qi] = static_cast<int32_t>((window > 0 ? std::max<int64_t>(0, pos0 + qi / G - window + 1) : 0) - lo);
    if (sinks) m0[qi] = sinks[kv * G + qi % G];  // the sink's logit: in every lane's maximum from the start
  }
  const int64_t base = pos0 - lo;  // row r sees keys up to base + r
  const LaneBounds lanes{rows.data(), firsts.data(), base};
  const __m512 ninf = _mm512_set1_ps(-std::numeric_limits<float>::infinity()), zero = _mm512_setzero_ps();
  // online softmax over blocks of keys: running maxima m, sums l, and weighted values scaled as m grows
  std::vector<__m512> m(NV), l(NV, zero), bm(NV), safe(NV);
  for (int64_t v = 0; v < NV; ++v) m[v] = _mm512_loadu_ps(m0.data() + 16 * v);
  float* p = s.p.data();
  float* vb = s.row.data();
  KeyWalk<scalar_t> vals(v_cache, pg, slot, kv, lo);
  for (int64_t j0 = 0; j0 < n; j0 += kBlock) {
    const int64_t nb = std::min(kBlock, n - j0);
    for (int64_t v = 0; v < NV; ++v) bm[v] = ninf;
    scores_block(NV, k_cache, pg, slot, kv, lo, j0, nb, d, s.qf.data(), Qp, scale, lanes, p, bm.data());
    for (int64_t v = 0; v < NV; ++v) {
      const __m512 mn = _mm512_max_ps(m[v], bm[v]);
      // (a lane that has seen nothing yet keeps -inf: subtract 0 there, so its exponentials are 0, not NaN)
      safe[v] = _mm512_mask_blend_ps(_mm512_cmp_ps_mask(mn, ninf, _CMP_EQ_OQ), mn, zero);
      const __m512 al = dynamoe::exp16(_mm512_sub_ps(m[v], safe[v]));
      _mm512_storeu_ps(alpha.data() + 16 * v, al);
      l[v] = _mm512_mul_ps(l[v], al);
      m[v] = mn;
    }
    for (int64_t j = 0; j < nb; ++j)
      for (int64_t v = 0; v < NV; ++v) {
        const __m512 e = dynamoe::exp16(_mm512_sub_ps(_mm512_loadu_ps(p + j * Qp + 16 * v), safe[v]));
        _mm512_storeu_ps(p + j * Qp + 16 * v, e);
        l[v] = _mm512_add_ps(l[v], e);
      }
    for (int64_t l_ = 0; l_ < nb; ++l_, vals.next()) {
      float* dst = vb + l_ * DV * 16;
      const float* vf = row_f32(vals.row(), dst, d);
      if (vf != dst) std::copy(vf, vf + d, dst);
      for (int64_t i = d; i < DV * 16; ++i) dst[i] = 0.f;
    }
    for (int64_t qi = 0; qi < Q; ++qi) {
      float* ag = s.acc.data() + qi * DV * 16;
      if (alpha[qi] != 1.f) {
        const __m512 al = _mm512_set1_ps(alpha[qi]);
        for (int64_t c = 0; c < DV; ++c) _mm512_storeu_ps(ag + 16 * c, _mm512_mul_ps(_mm512_loadu_ps(ag + 16 * c), al));
      }
      // the keys of this block query qi sees (the rest weigh 0: skip them)
      const int64_t a = std::max<int64_t>(j0, firsts[qi]), b = std::min<int64_t>(j0 + nb, base + rows[qi] + 1);
      if (a < b) weighted_values(DV, p + (a - j0) * Qp + qi, Qp, b - a, vb + (a - j0) * DV * 16, ag);
    }
  }
  for (int64_t v = 0; v < NV; ++v) {  // + the sink's share of the denominator
    if (sinks) l[v] = _mm512_add_ps(l[v], dynamoe::exp16(_mm512_sub_ps(_mm512_loadu_ps(m0.data() + 16 * v), safe[v])));
    _mm512_storeu_ps(den.data() + 16 * v, l[v]);
  }
  for (int64_t qi = 0; qi < Q; ++qi) {
    scalar_t* o = out + (qi / G) * H * d + (kv * G + qi % G) * d;
    const float* ag = s.acc.data() + qi * DV * 16;
    const float inv = 1.f / den[qi];
    for (int64_t i = 0; i < d; ++i) o[i] = static_cast<scalar_t>(ag[i] * inv);
  }
}
#else
// Without AVX-512: each row as a decode row of its own (the keys it sees are its slot's, written before).
template <typename scalar_t>
void attend_rows_of_slot(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, const Paged& pg,
                         int64_t slot, int64_t pos0, int64_t R, int64_t kv, int64_t window, int64_t H, int64_t G,
                         float scale, const float* sinks, scalar_t* out, RowScratch& s) {
  for (int64_t r = 0; r < R; ++r)
    attend_row(q + r * H * pg.d, k_cache, v_cache, pg, slot, pos0 + r, kv, window, H, G, scale, sinks,
               out + r * H * pg.d, s);
}
#endif

// Every row's attention. Rows of distinct slots: one work item per (row, KV head) (attend_row). Consecutive rows
// of one slot at consecutive positions (a prefill chunk beside decoding rows): one item per (run of rows, KV
// head), the rows sharing each key (attend_rows_of_slot).
template <typename scalar_t>
void attend(const scalar_t* q, const scalar_t* k_cache, const scalar_t* v_cache, const Paged& pg, const int64_t* slots,
            const int64_t* pos, int64_t window, int64_t B, int64_t H, int64_t K, float scale, const float* sinks,
            scalar_t* out) {
  const int64_t G = H / K, d = pg.d;
  std::vector<std::pair<int64_t, int64_t>> runs;  // [first row, rows)
  for (int64_t b = 0; b < B; ++b) {
    if (!runs.empty() && slots[b] == slots[runs.back().first]) ++runs.back().second;
    else runs.emplace_back(b, 1);
  }
  int64_t longest = 1;
  for (int64_t b = 0; b < B; ++b) longest = std::max(longest, pos[b] + 1);
  const int64_t items = static_cast<int64_t>(runs.size()) * K;
  const int64_t grain = std::max<int64_t>(1, (int64_t{1} << 15) / (longest * d * G));
  at::parallel_for(0, items, grain, [&](int64_t begin, int64_t end) {
    RowScratch s;
    for (int64_t item = begin; item < end; ++item) {
      const auto [b, R] = runs[item / K];
      const int64_t kv = item % K;
      if (R == 1) {
        attend_row(q + b * H * d, k_cache, v_cache, pg, slots[b], pos[b], kv, window, H, G, scale, sinks,
                   out + b * H * d, s);
      } else {
        attend_rows_of_slot(q + b * H * d, k_cache, v_cache, pg, slots[b], pos[b], R, kv, window, H, G, scale, sinks,
                            out + b * H * d, s);
      }
    }
  });
}

// the gate's activation in fp32, as torch computes sigmoid and softplus (beta 1, threshold 20)
inline float gate_act(dynamoe::GateKind kind, float g) {
  if (kind == dynamoe::kSoftplusGate) return g > 20.f ? g : std::log1p(std::exp(g));
  return 1.f / (1.f + std::exp(-g));
}

template <typename scalar_t>
const scalar_t* opt_ptr(const c10::optional<torch::Tensor>& t, int64_t n, c10::ScalarType dtype, const char* name) {
  if (!t.has_value()) return nullptr;
  TORCH_CHECK(t->numel() == n && t->is_contiguous() && t->scalar_type() == dtype, name, " must be contiguous ", dtype,
              " with ", n, " elements");
  return t->data_ptr<scalar_t>();
}

template <typename scalar_t>
void attn_decode(const torch::Tensor& h, const torch::Tensor& norm_w, double norm_eps, bool norm_weight_fp32,
                 bool norm_zero_centered, const std::vector<dynamoe::LinearWeights>& w_qkv,
                 const c10::optional<torch::Tensor>& q_norm, const c10::optional<torch::Tensor>& k_norm, double qk_eps,
                 bool qk_fp32, bool qk_zero_centered,
                 const torch::Tensor& cos, const torch::Tensor& sin, bool interleaved, torch::Tensor& k_cache,
                 torch::Tensor& v_cache, const torch::Tensor& block_table, const torch::Tensor& slots,
                 const torch::Tensor& positions, int64_t window,
                 const c10::optional<torch::Tensor>& sinks, double scale, bool rope, dynamoe::GateKind gate_kind,
                 bool gate_per_head, const dynamoe::LinearWeights& w_gate, const dynamoe::LinearWeights& w_o,
                 torch::Tensor& out) {
  const c10::ScalarType dt = h.scalar_type();
  TORCH_CHECK(h.dim() == 2 && h.size(0) >= 1 && h.size(0) <= dynamoe::kMaxRows,
              "h must be [B, D] with 1 <= B <= ", dynamoe::kMaxRows);
  const int64_t B = h.size(0), D = h.size(1);
  TORCH_CHECK(k_cache.dim() == 4 && k_cache.is_contiguous() && v_cache.sizes() == k_cache.sizes() &&
              v_cache.is_contiguous() && k_cache.scalar_type() == dt && v_cache.scalar_type() == dt,
              "k_cache and v_cache must be contiguous [K, blocks, block_size, d] of h's dtype");
  const int64_t K = k_cache.size(0), d = k_cache.size(3);
  TORCH_CHECK(block_table.dim() == 2 && block_table.is_contiguous() && block_table.scalar_type() == torch::kLong,
              "block_table must be contiguous int64 [slots, blocks per slot]");
  const Paged pg{k_cache.size(1), k_cache.size(2), d, block_table.size(1), block_table.data_ptr<int64_t>()};
  const int64_t S = block_table.size(0), L = pg.width * pg.bs;
  TORCH_CHECK(w_qkv.size() == 1 || w_qkv.size() == 3, "qkv must hold one stacked projection, or q, k and v");
  int64_t Q = 0;
  for (const auto& lw : w_qkv) {
    TORCH_CHECK(lw.w.defined() && lw.w.dim() >= 2, "qkv: every projection needs its weight");
    Q += lw.w.size(0);
  }
  TORCH_CHECK(w_o.w.defined() && w_o.w.dim() >= 2 && w_o.w.size(0) == D, "o must project to ", D, " features");
  TORCH_CHECK(Q % d == 0 && (Q / d - 2 * K) >= K, "qkv gives ", Q, " outputs: not (H + 2 K) heads of ", d);
  const int64_t H = Q / d - 2 * K;
  TORCH_CHECK(H % K == 0, "query heads ", H, " must be a multiple of the KV heads ", K);
  TORCH_CHECK(norm_w.numel() == D && norm_w.is_contiguous() && norm_w.scalar_type() == dt, "norm_w must be [", D, "]");
  TORCH_CHECK(slots.numel() == B && positions.numel() == B && slots.scalar_type() == torch::kLong &&
              positions.scalar_type() == torch::kLong && slots.is_contiguous() && positions.is_contiguous(),
              "slots and positions must be contiguous int64 [", B, "]");
  const int64_t* sp = slots.data_ptr<int64_t>();
  const int64_t* pp = positions.data_ptr<int64_t>();
  for (int64_t b = 0; b < B; ++b) {
    TORCH_CHECK(sp[b] >= 0 && sp[b] < S && pp[b] >= 0 && pp[b] < L, "slot ", sp[b], " / position ", pp[b],
                " outside the cache [", S, ", ", L, "]");
    // a slot's rows come one after the other, at consecutive positions (a chunk of its prompt)
    if (b > 0 && sp[b - 1] == sp[b]) {
      TORCH_CHECK(pp[b] == pp[b - 1] + 1, "rows of slot ", sp[b], " must be at consecutive positions, got ", pp[b - 1],
                  " then ", pp[b]);
    } else {
      for (int64_t c = 0; c < b; ++c)
        TORCH_CHECK(sp[c] != sp[b], "the rows of slot ", sp[b], " must come one after the other");
    }
    for (int64_t i = 0; i <= pp[b] / pg.bs; ++i) {
      const int64_t blk = pg.table[sp[b] * pg.width + i];
      TORCH_CHECK(blk >= 0 && blk < pg.blocks, "slot ", sp[b], "'s block ", i, " is ", blk, ", outside the pool of ",
                  pg.blocks);
    }
  }
  TORCH_CHECK(window >= 0, "window must be >= 0 (0: none)");
  TORCH_CHECK(cos.dim() == 2 && cos.size(0) == B && sin.sizes() == cos.sizes() && 2 * cos.size(1) <= d &&
              cos.is_contiguous() && sin.is_contiguous() && cos.scalar_type() == dt && sin.scalar_type() == dt,
              "cos and sin must be contiguous [B, R/2 <= d/2] of h's dtype");
  const int64_t half = cos.size(1);
  TORCH_CHECK(out.numel() == B * D && out.is_contiguous() && out.scalar_type() == dt, "out must be contiguous [B, ", D, "]");
  const float* sk = nullptr;
  if (sinks.has_value()) {
    TORCH_CHECK(sinks->numel() == H && sinks->is_contiguous() && sinks->scalar_type() == torch::kFloat,
                "sinks must be contiguous fp32 [", H, "]");
    sk = sinks->data_ptr<float>();
  }
  const scalar_t* qn = opt_ptr<scalar_t>(q_norm, d, dt, "q_norm");
  const scalar_t* kn = opt_ptr<scalar_t>(k_norm, d, dt, "k_norm");
  TORCH_CHECK((qn == nullptr) == (kn == nullptr), "q_norm and k_norm go together");
  TORCH_CHECK(gate_kind == dynamoe::kNoGate || gate_kind == dynamoe::kSigmoidGate ||
                  gate_kind == dynamoe::kSoftplusGate,
              "unknown gate kind ", static_cast<int64_t>(gate_kind));
  const int64_t G = gate_kind == dynamoe::kNoGate ? 0 : gate_per_head ? H : H * d;  // gates per row
  TORCH_CHECK(G == 0 || (w_gate.w.defined() && w_gate.w.dim() >= 2 && w_gate.w.size(0) == G), "gate must give ", G,
              gate_per_head ? " outputs (one per head)" : " outputs (one per channel)");

  const scalar_t* hp = h.data_ptr<scalar_t>();
  std::vector<scalar_t> x(B * D), qkv(B * Q), tmp(d), q(B * H * d), attn(B * H * d), o(B * D);
  for (int64_t b = 0; b < B; ++b)
    dynamoe::rms_row(hp + b * D, norm_w.data_ptr<scalar_t>(), D, static_cast<float>(norm_eps), norm_weight_fp32,
                     x.data() + b * D, norm_zero_centered);
  for (int64_t i = 0, col = 0; i < static_cast<int64_t>(w_qkv.size()); ++i)
    col += linear_rows(x.data(), B, D, w_qkv[i], dt, "qkv", qkv.data(), Q, col);
  const float qe = static_cast<float>(qk_eps);
  scalar_t* kc = k_cache.data_ptr<scalar_t>();
  scalar_t* vc = v_cache.data_ptr<scalar_t>();
  for (int64_t b = 0; b < B; ++b) {
    const scalar_t* c = cos.data_ptr<scalar_t>() + b * half;
    const scalar_t* s = sin.data_ptr<scalar_t>() + b * half;
    const scalar_t* row = qkv.data() + b * Q;
    for (int64_t i = 0; i < H + K; ++i) {  // query heads, then key heads: norm, RoPE
      const scalar_t* src = row + i * d;
      if (qn) {
        dynamoe::rms_row(src, i < H ? qn : kn, d, qe, qk_fp32, tmp.data(), qk_zero_centered);
        src = tmp.data();
      }
      scalar_t* dst = i < H ? q.data() + (b * H + i) * d : kc + pg.at(sp[b], i - H, pp[b]);
      dynamoe::rope_row(src, c, s, rope ? half : 0, d, interleaved, dst);  // (half 0: a copy)
    }
    for (int64_t g = 0; g < K; ++g)
      std::copy(row + (H + K + g) * d, row + (H + K + g + 1) * d, vc + pg.at(sp[b], g, pp[b]));
  }
  attend(q.data(), kc, vc, pg, sp, pp, window, B, H, K, static_cast<float>(scale), sk, attn.data());
  if (G > 0) {  // gate = act(x W_gate^T) rounded to the dtype; attention * gate rounded, as the op-by-op path
    std::vector<scalar_t> gate(B * G);
    linear_rows(x.data(), B, D, w_gate, dt, "gate", gate.data(), G, 0);
    for (int64_t b = 0; b < B; ++b)
      for (int64_t i = 0; i < H * d; ++i) {
        const float g = static_cast<float>(gate[b * G + (gate_per_head ? i / d : i)]);
        scalar_t& a = attn[b * H * d + i];
        a = static_cast<scalar_t>(static_cast<float>(a) * dynamoe::round_to<scalar_t>(gate_act(gate_kind, g)));
      }
  }
  linear_rows(attn.data(), B, H * d, w_o, dt, "o", o.data(), D, 0);
  scalar_t* op = out.data_ptr<scalar_t>();
  for (int64_t i = 0; i < B * D; ++i) op[i] = static_cast<scalar_t>(static_cast<float>(hp[i]) + static_cast<float>(o[i]));
}
}  // namespace

void attn_decode_out(torch::Tensor h, const dynamoe::AttentionWeights& w, torch::Tensor cos, torch::Tensor sin,
                     torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_table, torch::Tensor slots,
                     torch::Tensor positions, torch::Tensor out) {
  TORCH_CHECK(h.is_contiguous() && h.device().is_cpu(), "h must be a contiguous CPU tensor [B, D]");
  TORCH_CHECK(w.norm_w.defined(), "AttentionWeights needs norm_w");
  switch (h.scalar_type()) {
    case torch::kBFloat16:
      attn_decode<c10::BFloat16>(h, w.norm_w, w.norm_eps, w.norm_fp32, w.norm_zero_centered, w.qkv, w.q_norm, w.k_norm,
                                 w.qk_eps, w.qk_fp32, w.qk_zero_centered, cos, sin,
                                 w.interleaved, k_cache, v_cache, block_table, slots, positions, w.window, w.sinks,
                                 w.scale, w.rope, w.gate_kind, w.gate_per_head, w.gate, w.o, out);
      break;
    case torch::kFloat:
      attn_decode<float>(h, w.norm_w, w.norm_eps, w.norm_fp32, w.norm_zero_centered, w.qkv, w.q_norm, w.k_norm, w.qk_eps,
                         w.qk_fp32, w.qk_zero_centered, cos, sin,
                         w.interleaved, k_cache, v_cache, block_table, slots, positions, w.window, w.sinks, w.scale,
                         w.rope, w.gate_kind, w.gate_per_head, w.gate, w.o, out);
      break;
    default:
      TORCH_CHECK(false, "h must be bf16 or fp32, got ", h.scalar_type());
  }
}
