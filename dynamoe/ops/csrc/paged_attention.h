// The attention of decode rows over the paged KV cache (CPU, fp32 arithmetic; csrc/attn_decode.cpp calls
// attend after writing every row's keys and values): rows of distinct sequences one by one, and consecutive rows
// of one sequence at consecutive positions -- a prompt chunk beside them -- together, sharing each key.
#pragma once
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

namespace dynamoe::paged {

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
#elif defined(DYNAMOE_AVX2)
  for (; i + 8 <= d; i += 8) _mm256_storeu_ps(buf + i, avx2::bf16x8(src + i));
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

}  // namespace dynamoe::paged
