"""NVIDIA Nemotron-H (``model_type: nemotron_h``): a stack of single-sublayer blocks, h += mixer(norm(h)), each
block one of (``layer_types`` / the hub's ``hybrid_override_pattern``)

* 'linear_attention' (M) -- Mamba-2 (:class:`~dynamoe.models.mamba2.Mamba2Mixer`; dt clamped below at
  ``time_step_min``);
* 'full_attention' (*) -- GQA without position encoding and without biases;
* 'moe' (E) -- DeepSeek-V3's sigmoid routing (selection-only ``e_score_correction_bias``, groups, top-k
  renormalised by ``norm_topk_prob``, times ``routed_scaling_factor``) over non-gated relu2 experts,
  down(relu(up(x))^2), plus a non-gated relu2 shared expert of ``moe_shared_expert_intermediate_size``;
* 'mlp' (-) -- a dense non-gated relu2 MLP of ``intermediate_size``;

RMSNorms (eps ``layer_norm_epsilon``, the weight applied in fp32) before every block and at the end.

The routed experts are dynamoe's non-gated (FFN) experts with the 'relu2' activation: up_proj into
``batched_fc1_w``, down_proj (transposed) into ``batched_fc2_w``. At decode the MoE layer runs its experts through
the FFN expert kernel (relu2 is one of its activations) inside the block's own forward (no fused layer: the block has
its own forward and a non-gated shared expert); a packed (quantized) expert checkpoint is dequantized on load.

Checkpoint: ``backbone.embeddings``, ``backbone.layers.{i}.norm``, ``backbone.layers.{i}.mixer.*`` (Mamba:
``in_proj, conv1d, dt_bias, A_log, D, norm, out_proj``; attention: ``{q,k,v,o}_proj``; MoE: ``gate.weight``,
``gate.e_score_correction_bias``, ``experts.{e}.{up,down}_proj.weight``, ``shared_experts.{up,down}_proj``;
MLP: ``{up,down}_proj``), ``backbone.norm_f``, ``lm_head``. Multi-token-prediction tensors (``mtp.*``) are not
loaded (plain decoding does not run them; the loader names them once).

Multimodal wrappers (text only: their other parts are skipped and logged, the server refuses images and audio naming
the model):

* Nemotron-3-Nano-Omni (``nemotron_h_omni``, NemotronH_Omni_Reasoning_V3; the config nests the text model under
  ``text_config``, released ones under ``llm_config``): the text model under ``language_model.`` (``backbone.*`` and
  ``lm_head``, as above); not loaded: the RADIO vision tower ``vision_model.``, its projector ``mlp1.`` and final norm
  ``vision_projector.``, the Parakeet audio encoder ``sound_encoder.`` and its projector ``sound_projection.``, the
  MTP layers ``language_model.mtp.``.
* Nemotron-3.5-Transcribe (``nemo_speechlm``, Nemotron3_5TranscribeForConditionalGeneration): the text model under
  NeMo's names, ``llm.model.`` (``embed_tokens``, ``layers.{i}``, ``norm``; the Mamba blocks' ``A_log``, ``D``,
  ``dt_bias`` under ``mixer._fp32_params.``) and ``llm.lm_head``; the routed experts per expert (what transformers
  saves) or stacked in->out, ``experts.gate_and_up_projs`` [E, D, F] / ``experts.down_projs`` [E, F, D] (the
  released export); TransformerEngine's ``*._extra_state`` entries are not tensors of the model. Not loaded: the
  speech and diarization encoders and the projector ``perception.``, the word-timestamp head ``ctc_timestamp.``, the
  MTP layers ``llm.mtp.``.

Not supported (a ValueError naming the field): ``moe_latent_size`` (experts in a projected latent space),
``mlp_bias``, an ``mlp_hidden_act`` other than relu2. The model keeps per-sequence recurrent state
(``recurrent_state = True``: no prefix reuse).
"""
from __future__ import annotations

import torch.nn.functional as F
from torch import Tensor, nn

from .attention import Attention
from .base import CausalLM
from .cache import KVCache
from .config import ModelConfig
from .mamba2 import Mamba2Mixer
from .moe_block import SparseMoeBlock
from .norms import RMSNorm
from .rope import RotaryEmbedding
from .weights import PerExpertFFN, StackedFFN
from .wrapped import TextOfWrapper, WrapperLayout

__all__ = ["NemotronHForCausalLM", "NemotronHBlock", "NemotronHMoE", "ReluSquaredMLP"]


class ReluSquaredMLP(nn.Module):
    """down_proj(relu(up_proj(x))^2) (Nemotron-H's dense MLP and shared expert)."""

    def __init__(self, hidden_size: int, intermediate_size: int, dtype=None):
        super().__init__()
        self.up_proj = nn.Linear(hidden_size, intermediate_size, bias=False, dtype=dtype)
        self.down_proj = nn.Linear(intermediate_size, hidden_size, bias=False, dtype=dtype)

    def forward(self, x: Tensor) -> Tensor:
        return self.down_proj(F.relu(self.up_proj(x)).square())


class NemotronHMoE(SparseMoeBlock):
    """Sigmoid-routed non-gated relu2 experts plus ``shared_experts``."""

    def __init__(self, cfg: ModelConfig, dtype=None):
        super().__init__(cfg, "sigmoid", normalize=cfg.norm_topk_prob, ffn_activation="relu2", dtype=dtype)
        self.shared_experts = ReluSquaredMLP(cfg.hidden_size, cfg.shared_expert_intermediate_size, dtype=dtype)

    def forward(self, x_BTD: Tensor) -> Tensor:
        return super().forward(x_BTD) + self.shared_experts(x_BTD)

    decode_refusal = "a non-gated relu2 shared expert (the fused kernel's shared experts are GLUs)"


class NemotronHBlock(nn.Module):
    """h += mixer(norm(h)); ``mixer`` a Mamba-2 mixer, an attention, an MoE block or an MLP."""

    def __init__(self, mixer: nn.Module, norm: nn.Module):
        super().__init__()
        self.mixer, self.norm = mixer, norm
        self.takes_positions = isinstance(mixer, (Mamba2Mixer, Attention))

    @property
    def mlp(self) -> nn.Module | None:
        """The block's MoE (what :meth:`CausalLM.moe_layers` looks for), or None."""
        return self.mixer if isinstance(self.mixer, SparseMoeBlock) else None

    def forward(self, h_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                kv_len: int | None = None) -> Tensor:
        x = self.norm(h_BTD)
        return h_BTD + (self.mixer(x, positions_BT, cache, slots, kv_len) if self.takes_positions else self.mixer(x))


_MOE_RENAMES = ((".mixer.moe.gates.0.wg.", ".mixer.gate."), (".mixer.moe.gates.0.", ".mixer.gate."),
                (".mixer.moe.", ".mixer."))
# NeMo's names (Nemotron-3.5-Transcribe): embed_tokens and norm as ours, the Mamba parameters NeMo keeps in fp32 apart
_NEMO_RENAMES = _MOE_RENAMES + tuple((f".mixer.{n}", f".mixer._fp32_params.{n}") for n in ("A_log", "D", "dt_bias"))


class NemotronHForCausalLM(TextOfWrapper, CausalLM):
    """Nemotron-H (see the module docstring), alone or in a multimodal wrapper."""

    #: the Mamba layers' conv window and SSM state summarise a slot's whole prefix: no prefix reuse
    recurrent_state = True
    #: ... but speculative decoding can cut it back past rejected drafts: its layers record their state after every
    #: token of a verification forward (dynamoe.models.cache.KVCache.begin_history)
    recurrent_rollback = True
    checkpoint_renames = _MOE_RENAMES + (("model.embed_tokens.", "model.embeddings."), ("model.norm.", "model.norm_f."))
    expert_layout = PerExpertFFN("up_proj", "down_proj")
    wrapper_layouts = {
        "nemotron_h_omni": WrapperLayout("language_model.backbone.", "language_model.",
                                         unused=("vision_model.", "mlp1.", "vision_projector.", "sound_encoder.",
                                                 "sound_projection.", "language_model.mtp.")),
        "nemo_speechlm": WrapperLayout("llm.model.", "llm.", unused=("perception.", "ctc_timestamp.", "llm.mtp."),
                                       renames=_NEMO_RENAMES),
    }
    #: the released Nemotron-3.5-Transcribe export's routed experts (see adapt_to_checkpoint)
    nemo_expert_layout = StackedFFN("gate_and_up_projs", "down_projs")

    def __init__(self, config: ModelConfig, dtype=None):
        raw = config.raw
        if raw.get("moe_latent_size") is not None:
            raise ValueError(f"config field 'moe_latent_size' must be null for nemotron_h, got {raw['moe_latent_size']!r}"
                             " (experts in a projected latent space are not supported)")
        if raw.get("mlp_bias"):
            raise ValueError("config field 'mlp_bias' must be false for nemotron_h (MLP biases are not supported)")
        if raw.get("mlp_hidden_act", "relu2") != "relu2":
            raise ValueError(f"config field 'mlp_hidden_act' must be 'relu2' for nemotron_h, got "
                             f"{raw.get('mlp_hidden_act')!r}")
        super().__init__(config, dtype)

    @property
    def text_only_reason(self) -> str | None:
        """What the server tells a request with an image or audio: a wrapper's encoders are not loaded (Nemotron-H
        reads text)."""
        if self.config.model_type == "nemotron_h_omni":
            return "its vision and audio encoders are not loaded (dynamoe serves the Nemotron-H text model only)"
        if self.config.model_type == "nemo_speechlm":
            return ("its speech encoders are not loaded (dynamoe serves the Nemotron-H language model only, "
                    "without transcription)")
        return None

    @property
    def unused_checkpoint_prefixes(self) -> tuple:
        return ("mtp.",) if self.wrapper_layout() is None else self.wrapper_layout().unused

    def checkpoint_name(self, name: str) -> str:
        """Ours -> the checkpoint's: the renames, then ``model.`` -> ``backbone.`` (in a wrapper: where the wrapper
        keeps the stack and the head, :class:`TextOfWrapper`)."""
        name = super().checkpoint_name(name)
        if self.wrapper_layout() is None and name.startswith("model."):
            return "backbone." + name[len("model."):]
        return name

    def adapt_to_checkpoint(self, names) -> None:
        """Called by the loader with the checkpoint's tensor names: Nemotron-3.5-Transcribe's released export stacks
        the routed experts (``experts.gate_and_up_projs`` / ``down_projs``, in->out), what transformers saves keeps
        them per expert; the layout switches to what the checkpoint holds."""
        if self.config.model_type == "nemo_speechlm" and any(
                n.endswith(".mixer.experts." + self.nemo_expert_layout.up) for n in names):
            self.expert_layout = self.nemo_expert_layout

    def ignores_checkpoint_tensor(self, name: str) -> bool:
        """NeMo's export keeps TransformerEngine's ``_extra_state`` (metadata, not weights) beside the tensors of the
        language model (transformers leaves them unread too)."""
        return self.config.model_type == "nemo_speechlm" and name.endswith("._extra_state")

    def build_norm(self, cfg: ModelConfig, dim: int, dtype) -> nn.Module:
        return RMSNorm(dim, cfg.rms_norm_eps, weight_in_fp32=True, dtype=dtype)

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> NemotronHBlock:
        D, kind, ssm = cfg.hidden_size, cfg.layer_types[i], cfg.ssm
        if kind == "linear_attention":
            mixer: nn.Module = Mamba2Mixer(
                D, ssm.num_heads, ssm.head_dim, ssm.state_size, ssm.n_groups, ssm.conv_kernel, i,
                norm_eps=cfg.rms_norm_eps, conv_bias=ssm.conv_bias, proj_bias=ssm.proj_bias, activation=ssm.activation,
                chunk_size=ssm.chunk_size, time_step_limit=ssm.time_step_limit,
                checks_position=i == cfg.layer_types.index(kind), dtype=dtype)
        elif kind == "full_attention":
            mixer = Attention(D, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i, rotary,
                              use_rope=False, dtype=dtype)
        elif kind == "moe":
            if cfg.shared_expert_intermediate_size is None:
                raise ValueError("config field 'moe_shared_expert_intermediate_size' must be an int >= 1 for "
                                 "nemotron_h's MoE blocks")
            mixer = NemotronHMoE(cfg, dtype=dtype)
        elif kind == "mlp":
            if cfg.intermediate_size is None:
                raise ValueError(f"config field 'intermediate_size' is required: block {i} is an MLP")
            mixer = ReluSquaredMLP(D, cfg.intermediate_size, dtype=dtype)
        else:
            raise ValueError(f"config field 'layer_types' entry {i} must be one of 'linear_attention', "
                             f"'full_attention', 'moe', 'mlp' for nemotron_h, got {kind!r}")
        return NemotronHBlock(mixer, self.build_norm(cfg, D, dtype))
