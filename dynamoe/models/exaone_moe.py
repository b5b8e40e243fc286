"""K-EXAONE (``model_type: exaone_moe``): GQA with per-head q/k RMSNorm, sliding-window and global
layers (``layer_types``; by default every ``sliding_window_pattern``-th layer is global) where, when
``sliding_window`` is set, only the sliding layers use RoPE (half-split) and the global ones none;
DeepSeek-V3's feed-forward blocks: dense layers (``mlp_layer_types``, else the first
``first_k_dense_replace``), sigmoid routing with a selection-only bias, group-limited top-k,
renormalised, ``routed_scaling_factor``, and ``num_shared_experts`` shared experts.

Checkpoint: as DeepSeek-V3's feed-forward names except the selection bias, saved as
``mlp.e_score_correction_bias`` [E]; attention ``q_proj``/``k_proj``/``v_proj``/``o_proj``,
``q_norm``/``k_norm``. Multi-token-prediction tensors (``mtp.*``) are skipped by the loader
(``unused_checkpoint_prefixes``).
"""
from __future__ import annotations

from .attention import Attention
from .base import CausalLM, DecoderLayer
from .config import ModelConfig
from .deepseek_v3 import DEEPSEEK_RENAMES, deepseek_mlp
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .weights import PerExpert

__all__ = ["ExaoneMoeForCausalLM"]


class ExaoneMoeForCausalLM(CausalLM):
    checkpoint_renames = ((".mlp.moe.gates.0.e_score_correction_bias", ".mlp.e_score_correction_bias"),
                          *DEEPSEEK_RENAMES)
    expert_layout = PerExpert("gate_proj", "up_proj", "down_proj")
    #: checkpoint names (regexes from the start) the loader skips: multi-token prediction, unused by plain decoding
    unused_checkpoint_prefixes = ("mtp.",)

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> DecoderLayer:
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        window = cfg.layer_sliding_window(i)
        # transformers' ExaoneMoeAttention reads config.sliding_window as saved: set = NoPE on the global layers
        use_rope = cfg.raw.get("sliding_window") is None or window is not None
        attn = Attention(D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i, rotary, qk_norm=True,
                         norm_eps=eps, sliding_window=window, use_rope=use_rope, dtype=dtype)
        return DecoderLayer(attn, deepseek_mlp(cfg, i, dtype), RMSNorm(D, eps, dtype=dtype), RMSNorm(D, eps, dtype=dtype))
