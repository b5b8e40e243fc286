"""The causal LM shared by every family: embeddings, pre-norm decoder layers, final norm, lm_head.

Legend: B batch rows, T tokens, D model dim, V vocab.

A family subclasses :class:`CausalLM` and says how to build layer i (:meth:`CausalLM.build_layer`)
and how its checkpoint names differ from ours (``checkpoint_renames``, ``expert_layout``; see
:mod:`dynamoe.models.weights`). Module names follow Hugging Face's (``model.embed_tokens``,
``model.layers.{i}.self_attn.q_proj``, ``model.layers.{i}.mlp``, ``model.norm``, ``lm_head``), so
most tensors load by name; a sparse block's router and experts live in a dynamoe MoELayer
(``mlp.moe``) and are mapped.
"""
from __future__ import annotations

import contextlib
import logging
from dataclasses import dataclass
from typing import Optional

import torch
from torch import Tensor, nn

from ..ops.fused import MAX_ROWS
from .cache import DEFAULT_BLOCK_SIZE, KVCache
from .config import ModelConfig
from .decode_plan import DecodePlan
from .moe_block import SparseMoeBlock
from .rope import RotaryEmbedding, rotary_dims

log = logging.getLogger(__name__)

__all__ = ["CausalLM", "DecoderLayer", "DecoderStack", "LayerRun", "MoELayerStats"]


class DecoderLayer(nn.Module):
    """h += attn(norm1(h)); h += mlp(norm2(h))."""

    def __init__(self, self_attn: nn.Module, mlp: nn.Module, input_layernorm: nn.Module,
                 post_attention_layernorm: nn.Module):
        super().__init__()
        self.self_attn, self.mlp = self_attn, mlp
        self.input_layernorm, self.post_attention_layernorm = input_layernorm, post_attention_layernorm

    def forward(self, h_BTD: Tensor, positions_BT: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                kv_len: int | None = None) -> Tensor:
        decode = cache is not None and h_BTD.size(1) == 1 and h_BTD.size(0) <= MAX_ROWS and not torch.is_grad_enabled()
        fused = None
        if decode:
            step = getattr(self.self_attn, "decode_step", None)  # one kernel call for the attention block
            fused = None if step is None else step(h_BTD, self.input_layernorm, positions_BT, cache, slots, kv_len)
        if fused is not None:
            h_BTD = fused
        else:
            h_BTD = h_BTD + self.self_attn(self.input_layernorm(h_BTD), positions_BT, cache, slots, kv_len)
        if decode:
            block = getattr(self.mlp, "decode_block", None)  # and one for norm + MLP (+ experts) + residual
            out = None if block is None else block(h_BTD, self.post_attention_layernorm)
            if out is not None:
                return out
        return h_BTD + self.mlp(self.post_attention_layernorm(h_BTD))


class DecoderStack(nn.Module):
    """Hugging Face's ``model``: embed_tokens, layers, norm (and the shared rotary tables)."""

    def __init__(self, embed_tokens: nn.Embedding, layers: list, norm: nn.Module, rotary_emb: RotaryEmbedding):
        super().__init__()
        self.embed_tokens = embed_tokens
        self.layers = nn.ModuleList(layers)
        self.norm = norm
        self.rotary_emb = rotary_emb


@dataclass
class MoELayerStats:
    """One MoE layer's routing in the last forward: ``load`` int64 [E] assignments per expert (on the
    model's device), ``dropped`` assignments over capacity (always 0: inference is dropless)."""

    layer: int
    load: Tensor
    dropped: int


@dataclass
class LayerRun:
    """One forward between :meth:`CausalLM.begin_forward` and :meth:`CausalLM.end_forward`: the hidden states
    ``h`` after ``next_layer`` layers, and what every layer takes (positions, cache, slots, kv_len); the
    rows' prompt lengths for dynamic NTK RoPE (None: not needed)."""

    h: Tensor
    positions: Tensor
    cache: KVCache | None
    slots: Tensor | None
    kv_len: int | None
    T: int
    logits_to_keep: int
    return_hidden: bool
    prompt_lengths: Tensor | None
    next_layer: int = 0
    rows_of_slots: dict | None = None   # (CausalLM.begin_rows) each slot's rows: what its cache advances by


class CausalLM(nn.Module):
    """Decoder-only LM over a :class:`ModelConfig`.

    ``forward(input_ids [B, T], cache=None, slots=None, logits_to_keep=0, return_hidden=False) -> logits [B, T, V]``
    (with ``return_hidden``: ``(logits, hidden [B, T, D])``, the final-normed hidden states of every position
    fed -- before the norm with ``hidden_before_norm`` --, whatever ``logits_to_keep``: what multi-token-prediction
    heads read, :mod:`dynamoe.models.mtp`). With a
    cache, row b continues slot ``slots[b]`` (default: slots 0..B-1) at position
    ``cache.lengths[slot]``, and the cache advances by T once, after all layers. ``logits_to_keep``
    n > 0 computes the logits of the last n positions only ([B, n, V]): a prefill needs just the
    last one, and the lm_head over every prompt position can cost as much as the layers.
    """

    #: (ours, theirs) substring renames from our state-dict names to the checkpoint's; first match wins
    checkpoint_renames: tuple = ()
    #: extension point: a prefix every checkpoint name of the model carries (a vision-language wrapper's
    #: text model: Kimi-K2.5's ``language_model.``), put before the renamed name
    checkpoint_prefix: str = ""
    #: extension point: checkpoint name prefixes of parts the model does not load (a wrapper's vision tower,
    #: multi-token-prediction layers plain decoding does not run): the loader skips those tensors and says so
    #: once, by prefix
    unused_checkpoint_prefixes: tuple = ()
    def ignores_checkpoint_tensor(self, name: str) -> bool:
        """Extension point: True for a checkpoint tensor the family knows it has no use for, though it sits among
        the names it loads (LongCat-Flash: transformers saves gate/up rows for its zero-computation experts)."""
        return False

    #: how the routed experts are stored on disk (dynamoe.models.weights.PerExpert / FusedInterleaved)
    expert_layout = None
    #: whether the routed experts have biases (GPT-OSS)
    expert_bias = False
    #: whether keys and values after the prompt depend on where the prompt ended (a layer reads the cache's
    #: ``prompt_lengths``: Unlimited-OCR): the engine's prefix cache then keys blocks past a prompt by its length
    kv_depends_on_prompt_length = False
    #: ``forward(..., return_hidden=True)`` gives the states before the final norm (DeepSeek-V4: the residual
    #: streams [B, T, N, D] its MTP heads read) instead of the final-normed ones
    hidden_before_norm = False
    #: decode steps on the CPU run the layers through a cached :class:`~dynamoe.models.decode_plan.DecodePlan`
    #: (the same numbers, less Python per step); False runs them one by one
    use_decode_plan = True

    def __init__(self, config: ModelConfig, dtype: Optional[torch.dtype] = None):
        super().__init__()
        if not isinstance(config, ModelConfig):
            raise ValueError(f"config must be a ModelConfig, got {type(config).__name__}")
        self.config = config
        rotary = self.build_rotary(config)
        layers = [self.build_layer(config, i, rotary, dtype) for i in range(config.num_hidden_layers)]
        self.model = DecoderStack(nn.Embedding(config.vocab_size, config.hidden_size, dtype=dtype), layers,
                                  self.build_norm(config, config.hidden_size, dtype), rotary)
        self.lm_head = nn.Linear(config.hidden_size, config.vocab_size, bias=False, dtype=dtype)
        self.tie_weights()

    # ---- what a family provides -----------------------------------------------------------------
    def build_rotary(self, cfg: ModelConfig) -> RotaryEmbedding:
        return RotaryEmbedding(cfg.rope, rotary_dims(cfg.rope, cfg.head_dim), cfg.max_position_embeddings)

    def build_norm(self, cfg: ModelConfig, dim: int, dtype) -> nn.Module:
        from .norms import RMSNorm

        return RMSNorm(dim, cfg.rms_norm_eps, dtype=dtype)

    def build_layer(self, cfg: ModelConfig, i: int, rotary: RotaryEmbedding, dtype) -> DecoderLayer:
        raise NotImplementedError

    # ---- API --------------------------------------------------------------------------------------
    def tie_weights(self) -> None:
        if self.config.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight

    @property
    def device(self) -> torch.device:
        return self.model.embed_tokens.weight.device

    @property
    def dtype(self) -> torch.dtype:
        return self.model.embed_tokens.weight.dtype

    def new_cache(self, num_slots: int, max_seq_len: int, dtype: Optional[torch.dtype] = None, device=None, *,
                  block_size: int = DEFAULT_BLOCK_SIZE, num_blocks: int | None = None) -> KVCache:
        """An empty KV cache for this model (defaults: the model's dtype and device; enough blocks for every
        slot to reach ``max_seq_len``). When every layer is sliding-window attention, the cache knows the
        widest window and gives back the blocks out of it (:meth:`KVCache.trim`)."""
        return KVCache(num_slots, max_seq_len, self.config.num_hidden_layers, dtype or self.dtype,
                       self.device if device is None else device, block_size=block_size, num_blocks=num_blocks,
                       window=self.attention_window())

    def attention_window(self) -> int | None:
        """The widest sliding window when every layer's attention has one (no layer reads further back), else None."""
        from .attention import Attention

        wins = [getattr(layer, "self_attn", None) for layer in self.model.layers]
        if not wins or not all(type(a) is Attention and a.sliding_window for a in wins):
            return None
        return max(a.sliding_window for a in wins)

    def forward(self, input_ids: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                logits_to_keep: int = 0, return_hidden: bool = False):
        run = self.begin_forward(input_ids, cache, slots, logits_to_keep, return_hidden)
        B = input_ids.size(0)
        plan = None if cache is None or run.T != 1 else self._decode_plan(run.h, cache, run.slots)
        if plan is not None:
            with self._rope_prompt(run):
                try:
                    run.h = plan.run(run.h.view(B, -1), run.positions, cache, run.slots, run.kv_len).view(B, 1, -1)
                    run.next_layer = len(self.model.layers)
                except RuntimeError as exc:  # a kernel refused what the plan's checks did not see: the layers decide
                    log.warning("dynamoe: the decode plan of %s failed (%s); this state decodes layer by layer",
                                type(self).__name__, exc)
                    self.__dict__["_plan"] = (plan.key, None, plan)
        if run.next_layer == 0:
            with self._rope_prompt(run):
                run.h = self.run_layers(run.h, run.positions, cache, run.slots, run.kv_len)
            run.next_layer = len(self.model.layers)
        return self.end_forward(run)

    def rows_plan(self, cache: KVCache, slots: Tensor | None = None) -> DecodePlan | None:
        """The decode plan that runs every layer natively for this model's dtype and ``cache`` (for rows of
        ``slots``, int64: a family's plan may hold only for some of its sequences) -- what :meth:`forward_rows`
        runs on --, or None: a family with a forward of its own, a layer without a fused kernel, training, another
        device (the plan's conditions, :meth:`_decode_plan`)."""
        if not self.runs_in_steps:   # (the shared forward and layer loop: what the plan stands for)
            return None
        h = torch.empty(1, 1, self.model.embed_tokens.weight.size(-1), dtype=self.dtype, device=self.device)
        with torch.no_grad():   # (the question is about inference steps, whoever asks)
            plan = self._decode_plan(h, cache, torch.zeros(1, dtype=torch.long) if slots is None else slots)
        return plan if plan is not None and plan.fully_fused else None

    def forward_rows(self, input_ids: Tensor, cache: KVCache, slots: Tensor, logits_rows: list[int]) -> Tensor:
        """One token per row through every layer in one native call of the decode plan (:meth:`rows_plan`; raises
        without one): rows of distinct sequences, one token each at its slot's next position (a decode step), and
        consecutive rows of one slot at its next positions -- a prompt chunk beside them, each of whose rows sees
        the chunk's earlier rows. ``input_ids``, ``slots``: int64 [N], 1 <= N <= MAX_ROWS, a slot's rows one after
        the other. Returns the logits [len(logits_rows), V] of the rows ``logits_rows``; each slot's cache advances
        by its rows. (:meth:`begin_rows` / :meth:`run_some_layers` / :meth:`end_rows`: the same a few layers at a
        time, each layer's fused kernels.)"""
        run, plan = self._rows_run(input_ids, cache, slots)
        with self._rope_prompt(run):
            run.h = plan.run(run.h.view(run.h.size(0), -1), run.positions, cache, run.slots, run.kv_len)[:, None]
        run.next_layer = len(self.model.layers)
        return self.end_rows(run, logits_rows)

    def begin_rows(self, input_ids: Tensor, cache: KVCache, slots: Tensor) -> "LayerRun":
        """The first part of :meth:`forward_rows` (its arguments checked, the slots' blocks reserved, positions and
        embeddings) as a :class:`LayerRun` of N rows of one token for :meth:`run_some_layers`: every layer runs its
        fused decode kernels, which take such rows (:meth:`rows_plan` must hold)."""
        return self._rows_run(input_ids, cache, slots)[0]

    def _rows_run(self, input_ids: Tensor, cache: KVCache, slots: Tensor) -> tuple["LayerRun", DecodePlan]:
        """:meth:`begin_rows`'s run, and the plan that holds for it."""
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 1 or input_ids.dtype != torch.long:
            raise ValueError(f"input_ids must be an int64 tensor [rows], got {getattr(input_ids, 'shape', input_ids)}")
        if not isinstance(slots, Tensor) or slots.shape != input_ids.shape or slots.dtype != torch.long:
            raise ValueError(f"slots must be an int64 tensor of input_ids' shape {tuple(input_ids.shape)}, "
                             f"got {getattr(slots, 'shape', slots)}")
        if torch.is_grad_enabled():
            raise RuntimeError("forward_rows runs inference kernels: call it under torch.inference_mode() or no_grad()")
        N = input_ids.numel()
        if not 1 <= N <= MAX_ROWS:
            raise ValueError(f"forward_rows takes 1..{MAX_ROWS} rows, got {N}")
        slot_list = slots.tolist()
        if min(slot_list) < 0 or max(slot_list) >= cache.num_slots:
            raise ValueError(f"slots must be in [0, {cache.num_slots}), got {slot_list}")
        plan = self.rows_plan(cache, slots)
        if plan is None:
            raise RuntimeError(f"{type(self).__name__}: no decode plan runs every layer natively here (rows_plan)")
        counts: dict[int, int] = {}
        offsets = []
        for i, s in enumerate(slot_list):
            if s in counts and slot_list[i - 1] != s:
                raise ValueError(f"the rows of slot {s} must come one after the other, got slots {slot_list}")
            offsets.append(counts.get(s, 0))
            counts[s] = counts.get(s, 0) + 1
        for s, c in counts.items():
            if int(cache.lengths[s]) + c > cache.max_seq_len:
                raise ValueError(f"sequence length {int(cache.lengths[s]) + c} exceeds max_seq_len={cache.max_seq_len}")
            cache.reserve(s, int(cache.lengths[s]) + c)
        positions = (cache.lengths[slots] + torch.tensor(offsets, dtype=torch.long)).to(self.device)[:, None]
        prompt = None
        rotary = getattr(self.model, "rotary_emb", None)
        if getattr(getattr(rotary, "rope", None), "rope_type", None) == "dynamic":
            prompt = cache.prompt_lengths_for(slots, positions)
        h = self.model.embed_tokens(input_ids.to(self.device)[:, None])
        return LayerRun(h, positions, cache, slots.to(self.device), int(positions.max()) + 1, 1, 0, False, prompt,
                        rows_of_slots=counts), plan

    def end_rows(self, run: "LayerRun", logits_rows: list[int]) -> Tensor:
        """The last part of :meth:`forward_rows`: the logits [len(logits_rows), V] of those rows; each slot's cache
        advances by its rows."""
        logits = self.lm_head(self.model.norm(run.h[logits_rows, 0]))
        for s, c in run.rows_of_slots.items():
            run.cache.lengths[s] += c
        return logits

    def begin_forward(self, input_ids: Tensor, cache: KVCache | None = None, slots: Tensor | None = None,
                      logits_to_keep: int = 0, return_hidden: bool = False) -> "LayerRun":
        """The first part of :meth:`forward`: the arguments checked, positions and the embeddings, as a
        :class:`LayerRun` that :meth:`run_some_layers` takes through the layers (a few at a time if the caller
        wants: the engine spreads a long prefill chunk over several steps) and :meth:`end_forward` finishes."""
        if not isinstance(input_ids, Tensor) or input_ids.dim() != 2 or input_ids.dtype not in (torch.long, torch.int32):
            got = f"{input_ids.dtype} {tuple(input_ids.shape)}" if isinstance(input_ids, Tensor) else type(input_ids).__name__
            raise ValueError(f"input_ids must be an int64 (or int32) tensor [batch, tokens], got {got}")
        B, T = input_ids.shape
        if isinstance(logits_to_keep, bool) or not isinstance(logits_to_keep, int) or logits_to_keep < 0:
            raise ValueError(f"logits_to_keep must be an int >= 0 (0 = every position), got {logits_to_keep!r}")
        dev = input_ids.device
        steps = torch.arange(T, device=dev)
        kv_len = None
        if cache is None:
            if slots is not None:
                raise ValueError("slots are only meaningful with a cache")
            positions = steps.expand(B, T)
        else:
            if slots is None:
                slots = torch.arange(B, device=cache.lengths.device)
            elif not isinstance(slots, Tensor):
                slots = torch.tensor(slots, dtype=torch.long, device=cache.lengths.device)
            if slots.dim() != 1 or slots.numel() != B:
                raise ValueError(f"slots must be a LongTensor [{B}] (one per row), got shape {tuple(slots.shape)}")
            starts = cache.check_room(slots, T)
            positions = starts.to(dev)[:, None] + steps
            kv_len = int(starts.max()) + T if B else T
            slots = slots.to(dev)
        rotary = getattr(self.model, "rotary_emb", None)
        prompt = None
        if cache is not None and getattr(getattr(rotary, "rope", None), "rope_type", None) == "dynamic":
            prompt = cache.prompt_lengths_for(slots, positions)   # dynamic NTK rotates a prompt with its length
        return LayerRun(self.model.embed_tokens(input_ids), positions, cache, slots, kv_len, T, logits_to_keep,
                        return_hidden, prompt)

    @property
    def runs_in_steps(self) -> bool:
        """Whether :meth:`run_some_layers` can take a forward a few layers at a time: the model's layers run one
        after the other through the shared forward (a family with a forward or layer loop of its own: no)."""
        return type(self).forward is CausalLM.forward and type(self).run_layers is CausalLM.run_layers

    def run_some_layers(self, run: "LayerRun", count: int) -> bool:
        """The next ``count`` (>= 1) layers of ``run``; whether it has been through every layer."""
        layers = self.model.layers
        stop = min(len(layers), run.next_layer + max(1, count))
        with self._rope_prompt(run):
            for i in range(run.next_layer, stop):
                run.h = layers[i](run.h, run.positions, run.cache, run.slots, run.kv_len)
        run.next_layer = stop
        return stop == len(layers)

    def end_forward(self, run: "LayerRun"):
        """The last part of :meth:`forward` (``run`` through every layer): logits (and the hidden states with
        return_hidden); the cache advances past the positions."""
        h, T = run.h, run.T
        # with return_hidden, the final-normed states of every position fed (the MTP heads read each one; with
        # hidden_before_norm the states before the norm); the logits as without (the same ops on the same rows:
        # bit for bit the same numbers)
        normed = self.model.norm(h) if run.return_hidden and not self.hidden_before_norm else None
        hidden = (h if self.hidden_before_norm else normed) if run.return_hidden else None
        if 0 < run.logits_to_keep < T:
            logits = self.lm_head(self.model.norm(h[:, -run.logits_to_keep:]))
        else:
            logits = self.lm_head(self.model.norm(h) if normed is None else normed)
        if run.cache is not None:
            run.cache.advance(run.slots.to(run.cache.lengths.device), T)
        return (logits, hidden) if run.return_hidden else logits

    @contextlib.contextmanager
    def _rope_prompt(self, run: "LayerRun"):
        """The rows' prompt lengths on the shared rotary embedding while ``run``'s layers run (dynamic NTK)."""
        if run.prompt_lengths is None:
            yield
            return
        rotary = self.model.rotary_emb
        rotary.prompt_lengths = run.prompt_lengths
        try:
            yield
        finally:
            rotary.prompt_lengths = None

    def positions_independent_of_prompt(self, prompt_tokens: int) -> int | None:
        """How many leading positions' keys and values a sequence with a prompt of ``prompt_tokens`` tokens computes
        whatever the prompt's length is (so the prefix cache may share them with requests whose prompts end
        elsewhere: :mod:`dynamoe.engine.prefix`); None: all of them. Unlimited-OCR's attention keeps the prompt in
        sight (:attr:`kv_depends_on_prompt_length`): the prompt's positions. Dynamic NTK past
        max_position_embeddings rotates the prompt with its length: none."""
        if self.kv_depends_on_prompt_length:
            return prompt_tokens
        rotary = getattr(self.model, "rotary_emb", None)
        if (getattr(getattr(rotary, "rope", None), "rope_type", None) == "dynamic"
                and prompt_tokens > rotary.max_position_embeddings):
            return 0
        return None

    def run_layers(self, h: Tensor, positions_BT: Tensor, cache: KVCache | None, slots: Tensor | None,
                   kv_len: int | None) -> Tensor:
        """The decoder layers over the embeddings, in order (extension point: a family that runs some layers more
        than once, Inkling-2-Loop, says how)."""
        for layer in self.model.layers:
            h = layer(h, positions_BT, cache, slots, kv_len)
        return h

    def _decode_plan(self, h_BTD: Tensor, cache: KVCache, slots: Tensor) -> DecodePlan | None:
        """The :class:`~dynamoe.models.decode_plan.DecodePlan` for this decode step, or None (the layers
        run one by one): inference on the CPU, 1..16 rows, int64 slots, no autocast."""
        B = h_BTD.size(0)
        if (not self.use_decode_plan or not 1 <= B <= MAX_ROWS or torch.is_grad_enabled() or h_BTD.device.type != "cpu"
                or slots.dtype != torch.long or slots.device.type != "cpu" or torch.is_autocast_enabled("cpu")):
            return None
        h = h_BTD.view(B, -1)
        key = DecodePlan.key_for(h, cache)
        cached = self.__dict__.get("_plan")  # (key, plan or None, what decided it: a plan, or None)
        if cached is None or cached[0] != key or (cached[2] is not None and not cached[2].current()):
            plan = DecodePlan.build(self, h, cache)
            cached = (key, plan if plan is not None and plan.useful else None, plan)
            self.__dict__["_plan"] = cached  # (not a module attribute: no registration, no state dict)
        return cached[1]

    def __getstate__(self):
        state = dict(super().__getstate__())
        state.pop("_plan", None)  # (copies and pickles build their own)
        return state

    def _apply(self, fn, recurse=True):
        self.__dict__.pop("_plan", None)  # .to(), .float(), ...: the parameters' data may move
        return super()._apply(fn, recurse)

    def moe_layers(self) -> list[tuple[int, SparseMoeBlock]]:
        return [(i, layer.mlp) for i, layer in enumerate(self.model.layers) if isinstance(layer.mlp, SparseMoeBlock)]

    def moe_stats(self) -> list[MoELayerStats]:
        """Per MoE layer, the last forward's routing: expert load and dropped assignments."""
        out = []
        for i, block in self.moe_layers():
            s = block.last_stats
            if s is not None:
                out.append(MoELayerStats(i, s.load, int(s.dropped)))
        return out

    # ---- checkpoint names -------------------------------------------------------------------------
    def checkpoint_rows(self, name: str) -> tuple[int, int, int] | None:
        """Extension point: (start, stop, total) when our tensor ``name`` is rows start..stop-1 (dim 0) of the
        checkpoint's tensor of ``total`` rows that :meth:`checkpoint_name` gives -- one tensor on disk for several of
        ours (Sarvam's fused ``query_key_value`` [q | k | v]) --, else None (the whole tensor). Dense checkpoints
        only: the loader refuses a packed one."""
        return None

    def checkpoint_transposed(self, name: str) -> bool:
        """Extension point: True when the checkpoint stores our 2D tensor ``name`` transposed (in->out: ERNIE-4.5-VL's
        router, [D, E]). Dense checkpoints only; applied after :meth:`checkpoint_rows`, before :meth:`checkpoint_slice`."""
        return False

    def checkpoint_slice(self, name: str) -> tuple[int, slice, int] | None:
        """Extension point: (dim, slice, size) when our tensor ``name`` is the ``slice`` along dim ``dim`` (of
        ``size`` entries on disk) of the checkpoint's tensor that :meth:`checkpoint_name` gives -- a strided part, such
        as the gate rows of interleaved gate / up rows (Inkling's hub layout: rows 0::2) --, else None. Dense
        checkpoints only; :meth:`checkpoint_rows` wins where both answer."""
        return None

    def checkpoint_name(self, name: str) -> str:
        """Our parameter name -> the checkpoint's (first matching rename of ``checkpoint_renames``, after
        ``checkpoint_prefix``)."""
        for ours, theirs in self.checkpoint_renames:
            if ours in name:
                return self.checkpoint_prefix + name.replace(ours, theirs, 1)
        return self.checkpoint_prefix + name
