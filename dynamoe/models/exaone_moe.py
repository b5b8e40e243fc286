"""K-EXAONE (``model_type: exaone_moe``): GQA with per-head q/k RMSNorm, sliding-window and global
layers (``layer_types``; by default every ``sliding_window_pattern``-th layer is global) where, when
``sliding_window`` is set, only the sliding layers use RoPE (half-split) and the global ones none;
DeepSeek-V3's feed-forward blocks: dense layers (``mlp_layer_types``, else the first
``first_k_dense_replace``), sigmoid routing with a selection-only bias, group-limited top-k,
renormalised, ``routed_scaling_factor``, and ``num_shared_experts`` shared experts.

Checkpoint: as DeepSeek-V3's feed-forward names except the selection bias, saved as
``mlp.e_score_correction_bias`` [E]; attention ``q_proj``/``k_proj``/``v_proj``/``o_proj``,
``q_norm``/``k_norm``.

Multi-token prediction: the hub's ``mtp.{fc, pre_fc_norm_embedding, pre_fc_norm_hidden, layers.{j}, norm}`` load into
``mtp``, an :class:`~dynamoe.models.mtp_prefixed.FcPredictor` (plain RMSNorms; the model's embedding and lm_head
shared) that the engine drafts with (``draft="mtp"``), as vLLM's ExaoneMoeMTP builds it
(vllm/model_executor/models/exaone_moe_mtp.py): depth j's layer has a dense MLP of ``intermediate_size`` and the
attention of kind ``mtp_layer_types[j]`` (window ``mtp_sliding_windows[j]``) when the config has them, else that of
decoder layer j (vLLM builds it from the layer index j); RoPE as on the decoder layers of its kind.
"""
from __future__ import annotations

from .attention import Attention
from .base import CausalLM, DecoderLayer
from .config import ModelConfig
from .deepseek_v3 import DEEPSEEK_RENAMES, deepseek_mlp
from .moe_block import GatedMLP, glu_kind
from .mtp_prefixed import FcPredictor, PrefixedMTPHeads, mtp_depths
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .weights import PerExpert

__all__ = ["ExaoneMoeForCausalLM"]


class ExaoneMoeForCausalLM(PrefixedMTPHeads, CausalLM):
    checkpoint_renames = ((".mlp.moe.gates.0.e_score_correction_bias", ".mlp.e_score_correction_bias"),
                          *DEEPSEEK_RENAMES)
    expert_layout = PerExpert("gate_proj", "up_proj", "down_proj")

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> DecoderLayer:
        return self._layer(cfg, i, cfg.layer_sliding_window(i), rotary, deepseek_mlp(cfg, i, dtype), dtype)

    @staticmethod
    def _layer(cfg: ModelConfig, i: int, window: int | None, rotary: RotaryEmbedding, mlp, dtype) -> DecoderLayer:
        D, eps = cfg.hidden_size, cfg.rms_norm_eps
        # transformers' ExaoneMoeAttention reads config.sliding_window as saved: set = NoPE on the global layers
        use_rope = cfg.raw.get("sliding_window") is None or window is not None
        attn = Attention(D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i, rotary, qk_norm=True,
                         norm_eps=eps, sliding_window=window, use_rope=use_rope, dtype=dtype)
        return DecoderLayer(attn, mlp, RMSNorm(D, eps, dtype=dtype), RMSNorm(D, eps, dtype=dtype))

    def build_mtp_layer(self, cfg: ModelConfig, j: int, dtype) -> DecoderLayer:
        """MTP depth j's decoder layer (layer index N + j): see the module docstring."""
        kinds, windows = cfg.raw.get("mtp_layer_types"), cfg.raw.get("mtp_sliding_windows")
        for field, v in (("mtp_layer_types", kinds), ("mtp_sliding_windows", windows)):
            if v is not None and (not isinstance(v, (list, tuple)) or len(v) <= j):
                raise ValueError(f"config field {field!r} must list a value for each of the checkpoint's "
                                 f"multi-token-prediction layers (at least {j + 1}), got {v!r}")
        kind = kinds[j] if kinds is not None else cfg.layer_types[j] if cfg.layer_types else "full_attention"
        if kind not in ("full_attention", "sliding_attention"):
            raise ValueError(f"config field 'mtp_layer_types' entry {j} must be 'full_attention' or "
                             f"'sliding_attention', got {kind!r}")
        window = None
        if kind == "sliding_attention":
            window = windows[j] if windows is not None and windows[j] else cfg.sliding_window
            if window is None:
                raise ValueError("config field 'sliding_window' is required: multi-token-prediction layer "
                                 f"{j} is a sliding-window layer")
        if cfg.intermediate_size is None:
            raise ValueError("config field 'intermediate_size' is required: the multi-token-prediction layers have a "
                             "dense MLP")
        mlp = GatedMLP(cfg.hidden_size, cfg.intermediate_size, glu_kind(cfg.hidden_act), dtype=dtype)
        return self._layer(cfg, cfg.num_hidden_layers + j, window, self.model.rotary_emb, mlp, dtype)

    def adapt_to_checkpoint(self, names) -> None:
        """Called by the loader with the checkpoint's tensor names before it reads them: builds the MTP head
        ``mtp`` with as many layers as the ``mtp.layers.{j}`` there."""
        if not any(n.startswith("mtp.") for n in names):
            return
        count = mtp_depths(names, "mtp.")
        if not count:
            raise ValueError("the checkpoint has mtp.* tensors but no mtp.layers.{j} (the head's decoder layers)")
        cfg, dtype, D = self.config, self.dtype, self.config.hidden_size
        want = cfg.raw.get("num_nextn_predict_layers")
        if want and want != count:
            raise ValueError(f"the checkpoint has {count} mtp.layers but config field 'num_nextn_predict_layers' "
                             f"says {want}")
        self.mtp = FcPredictor([self.build_mtp_layer(cfg, j, dtype) for j in range(count)], D,
                               lambda: RMSNorm(D, cfg.rms_norm_eps, dtype=dtype), self.model.embed_tokens,
                               self.lm_head, dtype=dtype)
