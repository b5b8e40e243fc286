"""Inkling-2-Loop's language model (``model_type: inkling2_loop_text``; the text model of the ``inkling2_loop``
wrapper): Inkling-2's decoder (:mod:`dynamoe.models.inkling2`) whose layers ``loop_layer_index_start``..``end`` - 1
run ``loop_num_passes`` times.

Legend: B batch rows, T new tokens, N residual blocks, D model dim, n loop layers, r the message gates' rank.

* Pass 1 runs the loop layers as plain Inkling-2 layers. Each later pass restarts from the state before the loop
  (the same finished blocks and partial sum) and gives loop layer j messages from the previous pass: attention of
  four learned queries of layer j (``message_input``) over the unit-RMS blocks that pass closed (the loop's first
  block, its input, left out) and its last partial sum -- one message each for the query, key, value and MLP inputs.
* A loop layer mixes each of those inputs with its message before its norm: ``{q,k,v,mlp}_message_gate``,
  (1 - tanh(f)) * x + tanh(g) * m with [f | g] from ``down_proj`` [r, 2 D] over [unit-RMS x | unit-RMS m]
  (``forget_gate_proj`` / ``message_gate_proj`` [D, r] in fp32).
* The layers after the loop continue from the last pass's state.

Every pass keeps its own keys, values and conv windows: the cache holds the model's layers, then the loop layers
once more for each pass after the first (``config.kv_elements_per_position`` counts them). The hub's names
(``controllers.{attn,k,v,mlp}.{down,forget,gain}_weight``, the message queries as ``middle_cycle_cross_pass_queries``
[2 n, D] -- rows 2 j, 2 j + 1 the query and MLP messages' -- and ``middle_cycle_cross_pass_kv_queries`` -- the key
and value messages') are read as transformers saves them.
"""
from __future__ import annotations

import re

import torch
from torch import Tensor, nn

from .cache import KVCache
from .config import ModelConfig
from .family_fields import inkling2_loop_layers
from .inkling2 import Inkling2DecoderLayer, Inkling2ForCausalLM, _unit_rms, block_attention
from .wrapped import WrapperLayout

__all__ = ["Inkling2LoopForCausalLM", "MessageGate", "MessageInput"]


class MessageGate(nn.Module):
    """(1 - tanh(f)) * x + tanh(g) * m, [f | g] from the low-rank ``down_proj`` over [unit-RMS x | unit-RMS m]:
    ``forward(x [B, T, D], m [B, T, D]) -> [B, T, D]`` (fp32)."""

    def __init__(self, hidden_size: int, rank: int, eps: float, dtype=None):
        super().__init__()
        self.eps = eps
        self.down_proj = nn.Linear(2 * hidden_size, rank, bias=False, dtype=dtype)
        self.forget_gate_proj = nn.Linear(rank, hidden_size, bias=False, dtype=torch.float32)
        self.message_gate_proj = nn.Linear(rank, hidden_size, bias=False, dtype=torch.float32)

    def forward(self, x: Tensor, message: Tensor) -> Tensor:
        x, message = x.float(), message.float()
        g = torch.cat([_unit_rms(x, self.eps), _unit_rms(message, self.eps)], dim=-1)
        g = self.down_proj(g.to(self.down_proj.weight.dtype)).float()
        return (1 - torch.tanh(self.forget_gate_proj(g))) * x + torch.tanh(self.message_gate_proj(g)) * message


class MessageInput(nn.Module):
    """The loop layers' message queries as the hub stores them (fp32): ``query_qm`` [2 n, D] (rows 2 j, 2 j + 1: loop
    layer j's query and MLP messages) and ``query_kv`` [2 n, D] (its key and value messages). ``forward(blocks
    [B, T, N, D], partial [B, T, D], j) -> [B, T, 4, D]``: loop layer j's query, key, value and MLP messages."""

    def __init__(self, loop_layers: int, hidden_size: int):
        super().__init__()
        self.query_qm = nn.Parameter(torch.zeros(2 * loop_layers, hidden_size, dtype=torch.float32))
        self.query_kv = nn.Parameter(torch.zeros(2 * loop_layers, hidden_size, dtype=torch.float32))

    def forward(self, blocks_BTND: Tensor, partial_BTD: Tensor, j: int) -> Tensor:
        qm, kv = self.query_qm[2 * j:2 * j + 2], self.query_kv[2 * j:2 * j + 2]
        return block_attention(blocks_BTND, partial_BTD, torch.stack([qm[0], kv[0], kv[1], qm[1]]))


class _PassCache:
    """A later pass's view of the cache: layer i's keys, values and windows at cache layer i + ``offset``."""

    def __init__(self, cache: KVCache, offset: int):
        self._cache, self._offset = cache, offset

    def buffer(self, layer: int, *args, **kwargs) -> Tensor:
        return self._cache.buffer(layer + self._offset, *args, **kwargs)

    def write(self, layer: int, *args, **kwargs) -> dict:
        return self._cache.write(layer + self._offset, *args, **kwargs)

    def put(self, layer: int, *args, **kwargs) -> dict:
        return self._cache.put(layer + self._offset, *args, **kwargs)

    def kv_pool(self, layer: int, *args, **kwargs) -> Tensor:
        return self._cache.kv_pool(layer + self._offset, *args, **kwargs)

    def __getattr__(self, name: str):
        return getattr(self._cache, name)


_GATES = {"q": "attn", "k": "k", "v": "v", "mlp": "mlp"}
_GATE_WEIGHTS = {"down_proj": "down", "forget_gate_proj": "forget", "message_gate_proj": "gain"}
_MESSAGE_GATE = re.compile(r"model\.layers\.(\d+)\.(q|k|v|mlp)_message_gate\.(down_proj|forget_gate_proj|"
                           r"message_gate_proj)\.weight$")


class Inkling2LoopForCausalLM(Inkling2ForCausalLM):
    """Inkling-2-Loop's language model (see the module docstring); from an ``inkling2_loop`` checkpoint, text only."""

    wrapper_layouts = {"inkling2_loop": WrapperLayout("model.llm.", "", unused=("model.visual.",))}
    text_only_reason = "its vision tower is not loaded (dynamoe serves the Inkling-2-Loop text model only)"

    def __init__(self, config: ModelConfig, dtype=None):
        loop = inkling2_loop_layers(config)
        object.__setattr__(self, "loop", loop)
        super().__init__(config, dtype)
        self.model.message_input = MessageInput(loop.end - loop.start, config.hidden_size)

    def build_layer(self, cfg: ModelConfig, i: int, rotary, dtype) -> Inkling2DecoderLayer:
        layer = super().build_layer(cfg, i, rotary, dtype)
        if self.loop.start <= i < self.loop.end:
            for kind in _GATES:
                setattr(layer, f"{kind}_message_gate",
                        MessageGate(cfg.hidden_size, self.loop.gate_rank, cfg.rms_norm_eps, dtype=dtype))
        return layer

    def new_cache(self, num_slots: int, max_seq_len: int, dtype=None, device=None, **paging) -> KVCache:
        """An empty cache with a layer for each layer run: the model's, then the loop's once per later pass."""
        return KVCache(num_slots, max_seq_len, self.config.num_hidden_layers + self.loop.extra_layers,
                       dtype or self.dtype, self.device if device is None else device, **paging)

    def run_layers(self, h: Tensor, positions_BT: Tensor, cache: KVCache | None, slots: Tensor | None,
                   kv_len: int | None) -> Tensor:
        layers, (s, e) = self.model.layers, (self.loop.start, self.loop.end)
        for layer in layers[:e]:
            h = layer(h, positions_BT, cache, slots, kv_len)
            if layer.layer_idx == s - 1:
                before = h   # [B, T, N + 1, D]: the state every pass starts from
        for p in range(1, self.loop.passes):
            # the blocks the previous pass closed (after the loop's first block, its input) and its partial sum
            blocks, partial = h[:, :, before.size(2):-1], h[:, :, -1]
            pass_cache = None if cache is None else _PassCache(
                cache, self.config.num_hidden_layers + (p - 1) * (e - s) - s)
            h = before
            for j, layer in enumerate(layers[s:e]):
                messages = self.model.message_input(blocks, partial, j)
                h = layer(h, positions_BT, pass_cache, slots, kv_len, messages=messages)
        for layer in layers[e:]:
            h = layer(h, positions_BT, cache, slots, kv_len)
        return h

    def checkpoint_name(self, name: str) -> str:
        m = _MESSAGE_GATE.match(name)
        if m:
            i, kind, weight = m.groups()
            return f"{self.stack}layers.{i}.controllers.{_GATES[kind]}.{_GATE_WEIGHTS[weight]}_weight"
        if name == "model.message_input.query_qm":
            return self.stack + "middle_cycle_cross_pass_queries"
        if name == "model.message_input.query_kv":
            return self.stack + "middle_cycle_cross_pass_kv_queries"
        return super().checkpoint_name(name)
