// What a decode step's fused sub-blocks read besides the step's own tensors, as named structs bound to
// Python (dynamoe.models.decode_kernels builds them once per module state): the attention block
// (AttentionWeights) and the MoE block (MoEWeights: norm, router, routed experts in any weight format).
// The codes shared with Python -- activations, router kinds, weight formats, expert kinds -- and the row
// limit are defined here once and bound as enums / a constant (decode_stack.cpp), so Python reads them
// from the module instead of repeating them.
#pragma once
#include <torch/extension.h>
#include <cstdint>
#include <vector>

namespace dynamoe::packed {
enum class PackedActs : int64_t;  // packed_int8.h: exact (0) or int8 (1) activations for the packed kernels
}

namespace dynamoe {

// the most rows (decode sequences or tokens) one fused call takes: one accumulator per row in registers
constexpr int64_t kMaxRows = 16;

// expert activations: the gate part of a GLU (act(gate) * up), or an FFN's activation; GLU only: gpt_oss, and
// silu_clamp (Step-3.5: min(silu(gate), limit) * clamp(up, +-limit)) / silu_clamp_in (DeepSeek-V4: silu(min(gate,
// limit)) * clamp(up, +-limit)); FFN only: relu2 (relu(x)^2, Nemotron-H)
enum Activation : int64_t { kSilu = 0, kGelu = 1, kGeluTanh = 2, kRelu = 3, kGptOss = 4, kSiluClamp = 5,
                            kSiluClampIn = 6, kReluSquared = 7 };
// routers: softmax top-k, or DeepSeek's sigmoid scores with selection bias and group-limited top-k
enum RouterKind : int64_t { kSoftmaxTopK = 0, kSigmoidGroupTopK = 1 };
// how expert weights are stored: packed formats (moe_decode_packed.cpp's codes), or plain bf16/fp32
enum WeightFormat : int64_t { kFp8Block = 0, kMxfp4 = 1, kNvfp4 = 2, kInt4 = 3, kDense = 4 };
// an output gate on the attention (per head or per channel, from the block's normed input x): none, sigmoid
// (AFMoE, Step-3.5, Qwen3-Next) or softplus (Laguna)
enum GateKind : int64_t { kNoGate = 0, kSigmoidGate = 1, kSoftplusGate = 2 };
// the experts' shape: GLU (gate_up [E, 2F, D], down [E, O, F]) or Tutel's FFN (fc1 [E, F, D], fc2 [E, F, O])
enum ExpertKind : int64_t { kGlu = 0, kFfn = 1 };

using OptTensor = c10::optional<torch::Tensor>;

// One Linear (y = x W^T + b, W [O, I]) as the decode kernels read it: dense (w of h's dtype, bias of h's
// dtype, through the GEMV of gemv_blocks.h) or packed (dynamoe.quant's fields, through packed_gemv.cpp's
// kernels: y in fp32, the fp32 bias added, rounded to h's dtype -- what QuantizedLinear computes).
//   fp8_block: w uint8 e4m3 [O, I], scale fp32 [O/blk0, I/blk1] (scale_inv), blk0 x blk1 blocks
//   mxfp4:     w uint8 blocks [O, I/32, 16], scale uint8 e8m0 [O, I/32]
//   nvfp4:     w uint8 [O, I/2], scale uint8 (e4m3 bytes) [O, I/16], global_scale
//   int4:      w uint8 (the int32 words' bytes) [O, I/2], scale bf16 [O, I/blk0], blk0 = the group size
struct LinearWeights {
  WeightFormat format = kDense;
  torch::Tensor w;
  OptTensor scale;
  double global_scale = 1.0;
  int64_t blk0 = 1, blk1 = 1;
  OptTensor bias;                // [O]: dense, of h's dtype; packed, fp32
  packed::PackedActs acts{};     // packed: exact activations, or int8 (4-bit formats)
  int64_t out_features() const { return w.size(0); }
};

// h -> h + o_proj(attention(RoPE(qk-norm(qkv(x)))) [* act(gate(x))]), x = RMSNorm(h) (csrc/attn_decode.cpp)
struct AttentionWeights {
  torch::Tensor norm_w;          // [D] of h's dtype
  double norm_eps = 1e-6;
  bool norm_fp32 = false;        // the norm weight applied in fp32 before the cast back (dynamoe.models.RMSNorm)
  bool norm_zero_centered = false;  // the scale is 1 + norm_w, in fp32 (Qwen3-Next, Step-3.5)
  std::vector<LinearWeights> qkv;  // one stacked [(H + 2K) d, D] projection, or q, k and v apart
  OptTensor q_norm, k_norm;      // [d] per-head RMSNorm weights (together or neither)
  double qk_eps = 1e-6;
  bool qk_fp32 = false, qk_zero_centered = false;  // as norm_fp32 / norm_zero_centered, for the q/k norms
  bool rope = true;              // false: a layer without position encoding (NoPE): q and k are not rotated
  bool interleaved = false;      // RoPE on (even, odd) pairs instead of halves
  int64_t window = 0;            // sliding window (0: none)
  OptTensor sinks;               // fp32 [H] per-head sink logits
  double scale = 1.0;            // softmax scale
  // the attention output (each head's d values, in h's dtype) times act(x W_gate^T (+ b)) rounded to h's dtype
  // before o: one gate per head (gate [H, D]) or per channel ([H d, D]); gate unread with kNoGate
  GateKind gate_kind = kNoGate;
  bool gate_per_head = false;
  LinearWeights gate;
  LinearWeights o;               // [D, H d]
};

// [out =] [h +] experts(route(norm(h))) [+ shared(norm(h))]: the MoE sub-block of a decoder layer (with
// the norm and the residual) or the MoE layer alone (neither); with routed = false a dense MLP block
// (the shared part alone); csrc/moe_block_decode.cpp
struct MoEWeights {
  OptTensor norm_w;              // RMSNorm before the router (none: x = h)
  double norm_eps = 1e-6;
  bool norm_fp32 = false;
  bool norm_zero_centered = false;  // the scale is 1 + norm_w, in fp32
  bool residual = false;         // out = h + y instead of y
  // router: logits = x W^T (+ bias) in fp32
  torch::Tensor gate_w;          // [E, D] of h's dtype or fp32
  OptTensor gate_bias;           // fp32 [E]
  OptTensor sel_bias;            // fp32 [E] selection-only bias (sigmoid routers)
  RouterKind router = kSoftmaxTopK;
  bool renormalize = true;
  double route_scale = 1.0;
  int64_t n_group = 1, topk_group = 1, top_k = 1;
  // routed experts
  ExpertKind kind = kGlu;
  WeightFormat format = kDense;
  Activation act = kSilu;
  double alpha = 1.702, limit = 7.0;  // gpt_oss's GLU
  // dense: w1 = gate_up / fc1, w2 = down / fc2 (h's dtype). Packed: the format's fields per projection
  // (w1a/b/c, w2a/b/c as dynamoe.ops.moe_decode reads them) and its two block sizes
  torch::Tensor w1, w2;
  OptTensor b1, b2;              // dense: the weights' dtype; packed: fp32
  torch::Tensor w1b, w1c, w2b, w2c;
  int64_t blk0 = 1, blk1 = 1;
  bool bf16_acts = false;        // packed with bf16 h: bf16 dot products (else the kernel runs in fp32)
  packed::PackedActs acts{};     // packed: exact activations, or int8 (act_quant='int8', 4-bit formats)
  // shared experts: a dense GLU MLP on every token, added to the routed experts' output (DeepSeek,
  // Qwen2-MoE, GLM); with routed = false, a dense layer's whole MLP. shared_w1 [1, 2S, D] (gate rows, then
  // up rows) and shared_w2 [1, O, S] of h's dtype, biases [1, 2S] / [1, O]; shared_gate [1, D]: the output
  // scaled per token by sigmoid(x . shared_gate), each step rounded to h's dtype (Qwen2-MoE)
  OptTensor shared_w1, shared_w2, shared_b1, shared_b2, shared_gate;
  Activation shared_act = kSilu;
  double shared_alpha = 1.702, shared_limit = 7.0;
  bool routed = true;            // false: no router or routed experts
  int64_t num_experts() const { return routed && w1.defined() ? w1.size(0) : 0; }
};

}  // namespace dynamoe
