"""A decode step's decoder layers as fused kernel calls back to back, their arguments worked out once.

On the CPU a decode step through a decoder layer is two kernel calls (:meth:`Attention.decode_step`:
norm, q/k/v, RoPE, cache write, attention, o_proj and residual; :meth:`MoELayer.decode_block`: norm,
router, experts and residual). Finding out which weights they take and whether they apply at all
costs about 0.1 ms of Python per layer and step -- a tenth of a 0.5B-parameter model's step, more once
the weights streaming through have evicted the interpreter's own data from the caches. A
:class:`DecodePlan` does that once and hands each run of consecutive fused layers to a C++
``DecodeStack`` (csrc/decode_stack.cpp) that holds their arguments -- the parameters themselves, so
in-place updates such as ``load_state_dict`` reach it -- and runs the whole run in one call. Layers the
fused calls do not cover (dense MLPs, MLA, shared experts, packed experts, expert parallelism) run as
modules between the runs.

A plan is rebuilt when it may be stale: a module, parameter or buffer was (re)assigned anywhere in
the process (torch's global registration hooks), the model was converted (``CausalLM._apply``:
``.to()``, ``.float()``...), a layer's fused q/k/v weight no longer backs q/k/v_proj, the source of an
fp32 copy it holds (attention sinks, router biases) changed, or an MoE layer's routing configuration
or training flag changed (:meth:`MoELayer.decode_key`). The results are those of the layer-by-layer
path, bit for bit (tests/test_decode_plan.py).
"""
from __future__ import annotations

import weakref

import torch
from torch import Tensor
from torch.nn.modules import module as _torch_module

from ..ops import cpu_kernels
from .norms import RMSNorm

__all__ = ["DecodePlan", "invalidate_plans"]

_generation = 0


def invalidate_plans(*_args) -> None:
    """Make every :class:`DecodePlan` stale (they are rebuilt on their next step)."""
    global _generation
    _generation += 1


# any (re)assignment of a module, parameter or buffer anywhere: plans may hold the old one
_torch_module.register_module_module_registration_hook(invalidate_plans)
_torch_module.register_module_parameter_registration_hook(invalidate_plans)
_torch_module.register_module_buffer_registration_hook(invalidate_plans)


def _source(t: Tensor | None):
    """(tensor, version, data_ptr) of a tensor whose fp32 copy a plan holds; None when there is no
    copy (absent or already fp32) -- False when its changes cannot be tracked (an inference tensor)."""
    if t is None or t.dtype == torch.float32:
        return None
    try:
        return t, t._version, t.data_ptr()
    except RuntimeError:  # inference tensors have no version counter
        return False


class _FusedLayer:
    __slots__ = ("attn", "attn_args", "qkv", "block", "moe", "moe_args", "moe_key", "sources", "ptrs")

    def __init__(self, attn, attn_args, block, moe_args, sources):
        self.attn, self.attn_args, self.qkv = attn, attn_args, attn._qkv
        self.block, self.moe, self.moe_args = block, block.moe, moe_args
        self.moe_key = self.moe.decode_key()
        self.sources = sources
        # q/k/v_proj's parameters are views of the fused weight the plan holds (Attention._still_fused, checked
        # when built); a new .data (not seen by the registration hooks) moves them
        self.ptrs = tuple((t, t.data_ptr()) for name in ("q_proj", "k_proj", "v_proj")
                          for t in attn._modules[name]._parameters.values() if t is not None)

    def current(self) -> bool:
        if self.attn._qkv is not self.qkv or self.moe.decode_key() != self.moe_key:
            return False
        return (all(t.data_ptr() == p for t, p in self.ptrs)
                and all(t._version == v and t.data_ptr() == p for t, v, p in self.sources))


def _fuse(layer, h_BD: Tensor) -> _FusedLayer | None:
    """The fused calls of one decoder layer for steps like ``h_BD``, or None (the layer runs as a module)."""
    from .base import DecoderLayer
    from .moe_block import SparseMoeBlock

    if type(layer).forward is not DecoderLayer.forward:
        return None
    attn, block, norm2 = layer.self_attn, layer.mlp, layer.post_attention_layernorm
    decode_args = getattr(attn, "decode_args", None)
    if (decode_args is None or not isinstance(block, SparseMoeBlock) or type(norm2) is not RMSNorm
            or norm2.zero_centered):
        return None
    if type(block).decode_block is not SparseMoeBlock.decode_block:
        return None
    a = decode_args(layer.input_layernorm)
    if a is None or a[0] != h_BD.dtype:
        return None
    m = block.moe.decode_block_args(h_BD, norm2._parameters["weight"], norm2.eps, norm2.weight_in_fp32)
    if m is None:
        return None
    gate = block.moe.gates[0]
    lin = gate.fp32_linear()
    sources = [_source(attn._parameters.get("sinks")), _source(lin[1] if lin else None),
               _source(getattr(gate, "e_score_correction_bias", None))]
    if any(s is False for s in sources):
        return None
    return _FusedLayer(attn, a, block, m, tuple(s for s in sources if s))


class _FusedRun:
    """Consecutive fused layers (the same rotary embedding and expert count) as one C++ DecodeStack."""

    def __init__(self, kernels, layers: list[_FusedLayer]):
        self.layers, self.stack = layers, kernels.DecodeStack()
        for e in layers:
            self.stack.add_layer(*e.attn_args[1:], *e.moe_args)
        a = layers[0].attn
        self.rotary, self.kv_shape = a.rotary, (a.num_kv_heads, a.head_dim)
        self.experts = layers[0].moe_args[12].size(0)
        self._cache = self._buffers = None

    @staticmethod
    def joins(run: list[_FusedLayer], e: _FusedLayer) -> bool:
        a, b = run[-1], e
        return (a.attn.rotary is b.attn.rotary and a.moe_args[12].size(0) == b.moe_args[12].size(0)
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
        cos, sin, pos = self.rotary.decode_rows(positions_BT, h_BD.dtype)
        k, v = self._caches(cache)
        loads = torch.empty(len(self.layers), self.experts, dtype=torch.long)
        out = torch.empty_like(h_BD)
        max_loads = self.stack.run(h_BD, cos, sin, slots, pos, k, v, cache.block_tables, loads, out)
        for i, e in enumerate(self.layers):  # what MoELayer.decode_block_with / SparseMoeBlock.decode_block record
            e.block.__dict__["last_stats"] = e.moe.decode_done(loads[i], max_loads[i])
        return out


class DecodePlan:
    """The decoder layers of ``model`` for decode steps of 1..16 rows of dtype ``h_BD.dtype`` into a
    cache of that dtype on the CPU (see the module docstring); build with :meth:`build`."""

    def __init__(self, key: tuple, entries: list, kernels):
        self.key, self.entries = key, entries
        self.steps = []  # runs of fused layers (one C++ call each) and layers that run as modules
        for e in entries:
            if type(e) is not _FusedLayer:
                self.steps.append(e)
            elif self.steps and type(self.steps[-1]) is list and _FusedRun.joins(self.steps[-1], e):
                self.steps[-1].append(e)
            else:
                self.steps.append([e])
        self.steps = [_FusedRun(kernels, s) if type(s) is list else s for s in self.steps]

    @staticmethod
    def key_for(h_BD: Tensor, cache) -> tuple:
        return _generation, h_BD.dtype, cache.dtype

    @classmethod
    def build(cls, model, h_BD: Tensor, cache) -> DecodePlan | None:
        """A plan, or None where no layer has the fused calls (then nothing is gained) or the CPU
        kernels are unavailable."""
        kernels = cpu_kernels.load()
        if kernels is None or cache.dtype != h_BD.dtype:
            return None
        entries = [_fuse(layer, h_BD) or layer for layer in model.model.layers]
        if not any(isinstance(e, _FusedLayer) for e in entries):
            return None
        return cls(cls.key_for(h_BD, cache), entries, kernels)

    def current(self) -> bool:
        return all(e.current() for e in self.entries if type(e) is _FusedLayer)

    def run(self, h_BD: Tensor, positions_BT: Tensor, cache, slots: Tensor, kv_len: int) -> Tensor:
        """h [B, D] after every layer; slots int64 [B] on the CPU, positions [B, 1]."""
        B = h_BD.size(0)
        for s in self.steps:
            if type(s) is _FusedRun:
                h_BD = s.run(h_BD, positions_BT, cache, slots)
            else:
                h_BD = s(h_BD.view(B, 1, -1), positions_BT, cache, slots, kv_len).reshape(B, -1)
        return h_BD
