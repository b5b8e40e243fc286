"""Unlimited-OCR's language model, from its multimodal checkpoint (``model_type: unlimited_ocr``; the text model
``unlimited_ocr_text``): DeepSeek-OCR-2's decoder (:mod:`dynamoe.models.deepseek_ocr2`: Llama GQA with RoPE over
the whole head, DeepSeek-V2's softmax routing with shared experts, dense layers by ``mlp_layer_types``) whose
'reference_sliding_attention' layers keep the prompt in sight and slide over what is generated.

Reference sliding-window attention (transformers' ``create_reference_sliding_window_causal_mask`` over its
``UnlimitedOcrDynamicReferenceSlidingWindowLayer``): the query at position p sees key position j when j <= p and
(j < P or j > p - W), W = ``sliding_window``, P = the sequence's *prompt length* -- what transformers' cache
holds as prefill: the length ``generate`` declares before its first forward (the whole input, image tokens and
padding included), else the first forward's length. Every prompt token thus attends causally to the whole prompt
(nothing slides inside it), and a generated token sees the prompt plus the last W positions. A forward without a
cache is all prompt: plain causal attention.

dynamoe carries P per sequence in the KV cache (:attr:`~dynamoe.models.cache.KVCache.prompt_lengths`): the engine
declares each request's prompt length when it starts or restarts (:meth:`KVCache.declare_prompt`); a slot used
without declaring one takes its first forward as the prompt, as transformers does. Prefill in chunks, prefix-cached
starts, decode batches of rows with different prompts and the recompute of prompt plus output after a preemption
then all attend as transformers' generation did -- the recompute too: its mask is the decode steps' (the cache
keeps every position; it gives back no blocks out of the window, since the prompt's stay visible). Since keys and
values after the prompt depend on P, the engine's prefix cache shares blocks past a prompt only between requests
with the same prompt length (``kv_depends_on_prompt_length``, :mod:`dynamoe.engine.prefix`).

Decode steps run the fused CPU decode kernels (:class:`~dynamoe.models.decode_plan.DecodePlan`) while no row has
reached W positions past its prompt: until then every key is visible, which the kernel's plain causal attention
computes. Past that the kernel's window cannot keep the prompt in sight, and the reference-sliding layers' attention
runs op by op (the MoE blocks still fused).

Checkpoint: as DeepSeek-OCR-2's (``model.embed_tokens``, ``model.layers.{i}.self_attn.{q,k,v,o}_proj``,
``mlp.gate.weight``, ``mlp.experts.{e}.{gate,up,down}_proj``, ``mlp.shared_experts.*``, ``model.norm``, ``lm_head``);
the SAM and CLIP vision encoders (``model.sam_model.*``, ``model.vision_model.*``), the projector, the image newline
and the view separator are not loaded (the server refuses images naming the model).
"""
from __future__ import annotations

from torch import Tensor

from .attention import Attention
from .cache import KVCache
from .config import ModelConfig
from .deepseek_ocr2 import DeepseekOcr2ForCausalLM
from .rope import RotaryEmbedding
from .wrapped import WrapperLayout

__all__ = ["UnlimitedOcrForCausalLM", "ReferenceSlidingAttention"]


class ReferenceSlidingAttention(Attention):
    """GQA over the whole prompt of its row and a window of ``reference_window`` positions (see the module
    docstring): key j is visible to the query at position p when j <= p and (j < P or j > p - W), P the row's
    prompt length from the cache (:meth:`KVCache.prompt_lengths_for`). Without a cache every token is prompt."""

    def __init__(self, *args, reference_window: int, **kwargs):
        if isinstance(reference_window, bool) or not isinstance(reference_window, int) or reference_window < 1:
            raise ValueError(f"reference_window must be an int >= 1, got {reference_window!r}")
        if kwargs.get("sliding_window") is not None:
            raise ValueError("ReferenceSlidingAttention takes reference_window, not sliding_window")
        super().__init__(*args, **kwargs)
        self.reference_window = reference_window

    def sees_every_key(self, positions_BT: Tensor, prompt_B: Tensor) -> bool:
        """Whether every query of the rows (positions [B, T], prompt lengths [B]) sees all its keys 0..position: no
        row has reached W positions past its prompt, so the attention is plain causal."""
        return not bool((positions_BT[:, -1].to(prompt_B.device) >= prompt_B + self.reference_window).any())

    def decode_step(self, h_BTD: Tensor, norm, positions_BT: Tensor, cache: KVCache, slots: Tensor,
                    kv_len: int | None = None) -> Tensor | None:
        # the fused kernel (built with no window: plain causal attention) only while that is what the mask is
        if slots is None or not self.sees_every_key(positions_BT, cache.prompt_lengths_for(slots, positions_BT)):
            return None
        return super().decode_step(h_BTD, norm, positions_BT, cache, slots, kv_len)

    def forward(self, x_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                kv_len: int | None = None) -> Tensor:
        B, T, _ = x_BTD.shape
        q, k, v = self.heads(x_BTD, positions_BT)
        window = prompt_B = None
        if cache is not None:
            if slots is None:
                raise ValueError("attention with a cache needs slots (LongTensor [B])")
            prompt_B = cache.prompt_lengths_for(slots, positions_BT).to(positions_BT.device)
            # the window hides a key only from a query W or more positions past its prompt: until one is, the
            # mask is plain causal (every prompt chunk, the first W generated tokens)
            if self.sees_every_key(positions_BT, prompt_B):
                prompt_B = None
            else:
                window = self.reference_window
        out = self.attend_cached(q, k, v, positions_BT, cache, slots, kv_len, window, prefix_B=prompt_B)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, self.num_heads * self.head_dim))

    def extra_repr(self) -> str:
        return super().extra_repr() + f", reference_window={self.reference_window}"


class UnlimitedOcrForCausalLM(DeepseekOcr2ForCausalLM):
    """Unlimited-OCR's text model (see the module docstring)."""

    wrapper_layouts = {"unlimited_ocr": WrapperLayout("model.", "", unused=(
        "model.sam_model.", "model.vision_model.", "model.projector.", "model.view_seperator", "model.image_newline"))}
    text_only_reason = "its vision encoders are not loaded (dynamoe serves the Unlimited-OCR text model only)"
    text_type = "unlimited_ocr_text"
    group_fields_required = False   # (UnlimitedOcrTextConfig: one group, one kept, unless the file says otherwise)
    #: keys and values after the prompt depend on where it ended (the engine's prefix cache keys them by it)
    kv_depends_on_prompt_length = True

    def _decode_plan(self, h_BTD: Tensor, cache: KVCache, slots: Tensor):
        # the plan's fused attention is plain causal: only while no row is W past its prompt (a row whose prompt is
        # not declared yet starts here, with its first token: nothing hidden)
        P_B = cache.prompt_lengths[slots.to(cache.prompt_lengths.device)]
        W = min((a.reference_window for a in (layer.self_attn for layer in self.model.layers)
                 if isinstance(a, ReferenceSlidingAttention)), default=None)
        if W is not None and bool(((P_B > 0) & (cache.lengths[slots.to(cache.lengths.device)] >= P_B + W)).any()):
            return None
        return super()._decode_plan(h_BTD, cache, slots)

    def check_config(self, config: ModelConfig) -> None:
        super().check_config(config)
        if config.layer_types and "reference_sliding_attention" in config.layer_types and not config.sliding_window:
            raise ValueError("config field 'sliding_window' is required for unlimited_ocr_text's "
                             "'reference_sliding_attention' layers")

    def build_attention(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> Attention:
        args = (cfg.hidden_size, cfg.num_attention_heads, cfg.num_key_value_heads, cfg.head_dim, i, rotary)
        kw = dict(qkv_bias=cfg.attention_bias, o_bias=cfg.attention_bias, dtype=dtype)
        window = cfg.layer_reference_window(i)
        if window is not None:
            return ReferenceSlidingAttention(*args, reference_window=window, **kw)
        return Attention(*args, **kw)
