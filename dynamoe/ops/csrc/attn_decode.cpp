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
#include <vector>
#include "decode_rows.h"
#include "gemv_blocks.h"
#include "paged_attention.h"

namespace {
using dynamoe::paged::Paged;

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
  dynamoe::paged::attend(q.data(), kc, vc, pg, sp, pp, window, B, H, K, static_cast<float>(scale), sk, attn.data());
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
