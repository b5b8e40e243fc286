"""A decode step's decoder layers as fused kernel calls back to back, their weights worked out once.

On the CPU a decode step through a decoder layer is two kernel calls: the attention block
(:meth:`Attention.decode_step`: norm, q/k/v, RoPE, cache write, attention, o_proj and residual) and the
MoE block (:meth:`SparseMoeBlock.decode_block`: norm, router, routed experts in any weight format and
residual). Each sub-block's kernel reads a bound weight struct that its module builds and caches
(``decode_fused``, a :class:`~dynamoe.ops.fused.Fused` that knows what its decision read and when it is
stale). A :class:`DecodePlan` lays the model's layers out once: each run of consecutive layers whose two
sub-blocks both have a kernel goes to one C++ ``DecodeStack`` (csrc/decode_stack.cpp) that holds their
structs -- the parameters themselves, so in-place updates such as ``load_state_dict`` reach it -- and
runs the whole run in one call; the other layers run as modules between the runs, and why is logged
once per plan (:meth:`DecodePlan.describe`).

There are no process-wide hooks: a plan is current while every layer it holds is still where it was
(the model's layer list, each layer's sub-modules) and every sub-block's Fused -- fused or not -- is
current; ``CausalLM`` drops it on conversion (``.to()``...). The layer-by-layer path runs the same
kernels with the same structs, so the results are the same bit for bit (tests/test_decode_plan.py).
"""
from __future__ import annotations

import logging
import weakref

import torch
from torch import Tensor

from ..ops.fused import MAX_ROWS, Fused, Holds
from .attention import decode_rows

__all__ = ["DecodePlan"]

log = logging.getLogger(__name__)


class _Layer:
    """One decoder layer in a plan: its sub-blocks' Fused (None for a layer the plan cannot look into)."""

    __slots__ = ("layer", "attn", "block", "attn_fused", "moe_fused", "holds", "reason")

    def __init__(self, layer, h_BD: Tensor):
        from .base import DecoderLayer
        from .moe_block import GatedMLP, SparseMoeBlock

        holds = Holds()
        self.layer, self.attn_fused, self.moe_fused, self.reason = layer, None, None, None
        self.attn = holds.module(layer, "self_attn")
        self.block = holds.module(layer, "mlp")
        norm1, norm2 = holds.module(layer, "input_layernorm"), holds.module(layer, "post_attention_layernorm")
        self.holds = Fused(None, holds)
        if type(layer).forward is not DecoderLayer.forward:
            self.reason = f"{type(layer).__name__} has its own forward"
        elif not hasattr(self.attn, "decode_fused"):
            self.reason = f"{type(self.attn).__name__} attention has no fused kernel"
        elif not isinstance(self.block, (SparseMoeBlock, GatedMLP)):
            self.reason = f"{type(self.block).__name__} MLP has no fused kernel"
        else:
            self.attn_fused = self.attn.decode_fused(norm1, h_BD.dtype)
            self.moe_fused = self.block.decode_fused(h_BD, norm2)
            self.reason = (None if self.fused else "attention: " + self.attn_fused.extra
                           if self.attn_fused.weights is None else "MoE block: " + self.moe_fused.extra)

    @property
    def fused(self) -> bool:
        return (self.attn_fused is not None and self.attn_fused.weights is not None
                and self.moe_fused.weights is not None)

    def current(self) -> bool:
        return self.holds.current() and (self.attn_fused is None or (self.attn_fused.current()
                                                                    and self.moe_fused.current()))


class _FusedRun:
    """Consecutive fused layers (the same rotary embedding, KV shape and expert count) as one DecodeStack."""

    def __init__(self, layers: list[_Layer]):
        kernels = layers[0].attn_fused.extra
        self.layers, self.stack = layers, kernels.DecodeStack()
        for e in layers:
            self.stack.add_layer(e.attn_fused.weights, e.moe_fused.weights)
        a = layers[0].attn
        self.rotary, self.kv_shape = a.rotary, (a.num_kv_heads, a.head_dim)
        self.experts = self.stack.experts  # the routed layers' (0: only dense layers)
        self._cache = self._buffers = None

    @staticmethod
    def joins(run: list[_Layer], e: _Layer) -> bool:
        a, b = run[-1], e
        E = max(x.moe_fused.weights.num_experts for x in run)
        Eb = b.moe_fused.weights.num_experts
        return (a.attn.rotary is b.attn.rotary and (E == 0 or Eb == 0 or E == Eb)
                and (a.attn.num_kv_heads, a.attn.head_dim) == (b.attn.num_kv_heads, b.attn.head_dim))

    def _caches(self, cache) -> tuple[list, list]:
        """Each layer's k and v buffers of ``cache`` (created where missing; a cache never replaces them)."""
        if self._cache is None or self._cache() is not cache:
            K, d = self.kv_shape
            self._buffers = ([cache.kv_pool(e.attn.layer_idx, "k", K, d) for e in self.layers],
                             [cache.kv_pool(e.attn.layer_idx, "v", K, d) for e in self.layers])
            self._cache = weakref.ref(cache)  # (not a strong reference: a dropped cache is freed)
        return self._buffers

    def run(self, h_BD: Tensor, positions_BT: Tensor, cache, slots: Tensor) -> Tensor:
        cos, sin, pos = decode_rows(self.rotary, positions_BT, h_BD.dtype)
        k, v = self._caches(cache)
        loads = torch.empty(len(self.layers), self.experts, dtype=torch.long)
        out = torch.empty_like(h_BD)
        max_loads = self.stack.run(h_BD, cos, sin, slots, pos, k, v, cache.block_tables, loads, out)
        for i, e in enumerate(self.layers):  # what SparseMoeBlock.decode_block records
            if e.moe_fused.weights.routed:
                e.block.__dict__["last_stats"] = e.block.moe.decode_done(loads[i], max_loads[i])
        return out


class DecodePlan:
    """The decoder layers of ``model`` for decode steps of 1..MAX_ROWS rows of dtype ``h_BD.dtype`` into a
    cache of that dtype on the CPU (see the module docstring); build with :meth:`build`."""

    def __init__(self, model, key: tuple, entries: list[_Layer]):
        self.key, self.entries = key, entries
        holds = Holds()
        layers = holds.module(model.model, "layers")
        holds.value(lambda: len(layers))
        for i in range(len(layers)):
            holds.module(layers, str(i))
        self._model = Fused(None, holds)
        self.steps = []  # runs of fused layers (one C++ call each) and layers that run as modules
        for e in entries:
            if not e.fused:
                self.steps.append(e.layer)
            elif self.steps and type(self.steps[-1]) is list and _FusedRun.joins(self.steps[-1], e):
                self.steps[-1].append(e)
            else:
                self.steps.append([e])
        self.steps = [_FusedRun(s) if type(s) is list else s for s in self.steps]

    @staticmethod
    def key_for(h_BD: Tensor, cache) -> tuple:
        return h_BD.dtype, cache.dtype

    @classmethod
    def build(cls, model, h_BD: Tensor, cache) -> DecodePlan | None:
        """The plan (:attr:`useful` when a layer is fused; else the layers run one by one), or None where the
        cache's dtype is not the steps' (the kernels write it in theirs). Layers that run as modules are logged."""
        if cache.dtype != h_BD.dtype:
            return None
        plan = cls(model, cls.key_for(h_BD, cache), [_Layer(layer, h_BD) for layer in model.model.layers])
        if any(not e.fused for e in plan.entries):
            log.info("dynamoe: decode plan for %s (%s steps): %s", type(model).__name__, h_BD.dtype, plan.describe())
        return plan

    @property
    def useful(self) -> bool:
        """Whether any layer runs fused (else the plan only watches for the model to change)."""
        return any(e.fused for e in self.entries)

    @property
    def fully_fused(self) -> bool:
        """Whether every layer runs in the native calls (none as a module): a step of rows that share a slot
        (:meth:`CausalLM.forward_rows`) needs it -- only the kernels take them."""
        return all(type(s) is _FusedRun for s in self.steps)

    def describe(self) -> str:
        """Which layers run fused and, for the others, why not (one line per distinct reason)."""
        fused = [i for i, e in enumerate(self.entries) if e.fused]
        why: dict[str, list[int]] = {}
        for i, e in enumerate(self.entries):
            if not e.fused:
                why.setdefault(e.reason, []).append(i)
        parts = [f"{len(fused)} of {len(self.entries)} layers fused"]
        parts += [f"layers {_spans(idx)} run as modules: {reason}" for reason, idx in why.items()]
        return "; ".join(parts)

    def current(self) -> bool:
        return self._model.current() and all(e.current() for e in self.entries)

    def run(self, h_BD: Tensor, positions_BT: Tensor, cache, slots: Tensor, kv_len: int) -> Tensor:
        """h [B, D] after every layer; slots int64 [B] on the CPU, positions [B, 1]."""
        B = h_BD.size(0)
        if not 1 <= B <= MAX_ROWS:
            raise ValueError(f"a decode plan takes 1..{MAX_ROWS} rows, got {B}")
        for s in self.steps:
            if type(s) is _FusedRun:
                h_BD = s.run(h_BD, positions_BT, cache, slots)
            else:
                h_BD = s(h_BD.view(B, 1, -1), positions_BT, cache, slots, kv_len).reshape(B, -1)
        return h_BD


def _spans(idx: list[int]) -> str:
    """[0, 1, 2, 5] -> '0-2, 5'."""
    out, start = [], idx[0]
    for a, b in zip(idx, idx[1:] + [None]):
        if b != a + 1:
            out.append(str(start) if start == a else f"{start}-{a}")
            start = b
    return ", ".join(out)
