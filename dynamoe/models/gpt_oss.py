"""GPT-OSS (``model_type: gpt_oss``): GQA with q/k/v/o biases and a learned per-head sink logit,
sliding-window and full layers alternating (``layer_types``), YaRN RoPE (half-split), a biased
router (top-k on the logits, softmax over the k), clamped SwiGLU experts with biases
(``swiglu_limit``, ``swiglu_alpha``), RMSNorm weights applied in fp32.

Checkpoint: ``mlp.router.weight`` [E, D] + ``.bias`` [E]; fused experts
``mlp.experts.gate_up_proj`` [E, D, 2F] (in->out, gate/up interleaved) + ``gate_up_proj_bias``,
``down_proj`` [E, F, D] + ``down_proj_bias``; MXFP4 checkpoints keep the expert weights packed
(``*_blocks`` / ``*_scales``, out->in), and so does the model (dynamoe.quant.QuantizedExperts).
"""
from __future__ import annotations

from .attention import Attention
from .base import CausalLM, DecoderLayer
from .config import ModelConfig
from .moe_block import SparseMoeBlock
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .weights import FusedInterleaved

__all__ = ["GptOssForCausalLM"]


class GptOssForCausalLM(CausalLM):
    checkpoint_renames = ((".mlp.moe.gates.0.", ".mlp.router."), (".mlp.moe.", ".mlp."))
    expert_layout = FusedInterleaved()
    expert_bias = True

    def build_norm(self, cfg: ModelConfig, dim: int, dtype) -> RMSNorm:
        return RMSNorm(dim, cfg.rms_norm_eps, weight_in_fp32=True, dtype=dtype)

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> DecoderLayer:
        D = cfg.hidden_size
        attn = Attention(D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i, rotary,
                         qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, sinks=True,
                         sliding_window=cfg.layer_sliding_window(i), dtype=dtype)
        mlp = SparseMoeBlock(cfg, "softmax_bias", normalize=True, glu="gpt_oss", expert_bias=True, dtype=dtype)
        return DecoderLayer(attn, mlp, self.build_norm(cfg, D, dtype), self.build_norm(cfg, D, dtype))
