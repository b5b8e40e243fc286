// Declarations of the ops defined across the extension's sources that other sources call (the decode
// kernels compose each other) or that packed_gemv.cpp registers.
#pragma once
#include <torch/extension.h>
#include <cstdint>
#include "decode_weights.h"


// bf16_gemv.cpp
void bf16_gemv_out(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias, torch::Tensor out);
void bf16_grouped_gemv_out(torch::Tensor x, torch::Tensor w, torch::Tensor groups, c10::optional<torch::Tensor> bias,
                           torch::Tensor out);

int64_t moe_glu_decode_out(torch::Tensor x, torch::Tensor ids, torch::Tensor weights, torch::Tensor w_gate_up,
                           torch::Tensor w_down, c10::optional<torch::Tensor> b_gate_up,
                           c10::optional<torch::Tensor> b_down, int64_t act, double alpha, double limit,
                           torch::Tensor out, torch::Tensor load);

void rms_norm_out(torch::Tensor x, torch::Tensor w, double eps, bool weight_in_fp32, torch::Tensor out,
                  bool zero_centered = false);

void rope_out(torch::Tensor x, torch::Tensor cos, torch::Tensor sin, bool interleaved, torch::Tensor out);

int64_t packed_moe_glu_decode_out(int64_t fmt, torch::Tensor x, torch::Tensor ids, torch::Tensor weights,
                                  torch::Tensor w1a, torch::Tensor w1b, torch::Tensor w1c, torch::Tensor w2a,
                                  torch::Tensor w2b, torch::Tensor w2c, int64_t blk0, int64_t blk1,
                                  c10::optional<torch::Tensor> b1, c10::optional<torch::Tensor> b2, int64_t act,
                                  double alpha, double limit, torch::Tensor out, torch::Tensor load, bool bf16_acts,
                                  dynamoe::packed::PackedActs acts);

int64_t moe_ffn_decode_out(torch::Tensor x, torch::Tensor ids, torch::Tensor weights, torch::Tensor w1, torch::Tensor w2,
                           c10::optional<torch::Tensor> b1, c10::optional<torch::Tensor> b2, int64_t act,
                           torch::Tensor out, torch::Tensor load);

void route_decode_out(torch::Tensor x, torch::Tensor w, c10::optional<torch::Tensor> bias,
                      c10::optional<torch::Tensor> sel_bias, int64_t kind, bool renormalize, double scale,
                      int64_t n_group, int64_t topk_group, torch::Tensor ids, torch::Tensor weights);

// packed_gemv.cpp: y [T, O] fp32 = x [T, I] W^T straight from a packed W (dynamoe.quant.matmul.packed_gemv)
torch::Tensor mxfp4_gemv(torch::Tensor x, torch::Tensor blocks, torch::Tensor scales, dynamoe::packed::PackedActs acts);
torch::Tensor nvfp4_gemv(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, double global_scale,
                         dynamoe::packed::PackedActs acts);
torch::Tensor int4_gemv(torch::Tensor x, torch::Tensor packed, torch::Tensor scale, int64_t group,
                        dynamoe::packed::PackedActs acts);
torch::Tensor fp8_block_gemv(torch::Tensor x, torch::Tensor q, torch::Tensor scale_inv, int64_t b0, int64_t b1,
                             dynamoe::packed::PackedActs acts);

// attn_decode.cpp: h [B, D] -> out = h + attention block (see decode_weights.h)
void attn_decode_out(torch::Tensor h, const dynamoe::AttentionWeights& w, torch::Tensor cos, torch::Tensor sin,
                     torch::Tensor k_cache, torch::Tensor v_cache, torch::Tensor block_table, torch::Tensor slots,
                     torch::Tensor positions, torch::Tensor out);

// moe_block_decode.cpp: h [T, D] -> out [T, O] = (h +) experts(route(norm(h))); load [E] filled; the max load
int64_t moe_decode_out(torch::Tensor h, const dynamoe::MoEWeights& w, torch::Tensor out, torch::Tensor load);

// decode_stack.cpp: the DecodeStack class
void register_decode_stack(pybind11::module& m);
