"""Experts sharded over ranks along their hidden dimension (``num_experts_per_device = -n``).

With ``-n``, n consecutive ranks share one expert: rank ``s`` of the n holds the hidden columns
``[s*F/n, (s+1)*F/n)`` of every hidden-dim parameter and the slice ``[s*c, (s+1)*c)`` (c = ceil(O/n))
of the output bias (Tutel's layout: the output bias is sharded too, so that the bias, added once
per partial result and scaled by 1/r, gets a gradient summed over every rank that used it).

Each built-in expert module names its parameters' roles in ``shard_spec``:
  * ``(dim, parts)`` -- a hidden-dim parameter: the hidden axis is ``dim``, made of ``parts`` equal
    blocks sharded separately (GLU's fused gate|up rows: parts = 2);
  * ``OUTPUT_BIAS`` -- the output bias, sharded along its last dim.

The functions here are pure tensor code shared by the layer (gathering shards at run time) and
by checkpoint re-sharding.
"""
from __future__ import annotations

from typing import Union

import torch
from torch import Tensor

__all__ = ["OUTPUT_BIAS", "FLAT", "ShardRole", "FFN_SHARD_SPEC", "GLU_SHARD_SPEC", "LLAMA_SHARD_SPEC",
           "BUILTIN_SHARD_SPEC", "OUTPUT_DIM_OF", "merge_shards", "split_shard", "shard_spec_of"]

OUTPUT_BIAS = "output_bias"
# Tutel's llama_ffn layout: the flattened weight cut into n equal slices (the last one zero-padded);
# whole again only when gathered (adaptive_r = 1), never a hidden-dim slice
FLAT = "flat"
ShardRole = Union[tuple, str]

FFN_SHARD_SPEC = {"batched_fc1_w": (1, 1), "batched_fc1_bias": (1, 1), "batched_fc2_w": (1, 1),
                  "batched_fc2_bias": OUTPUT_BIAS}
GLU_SHARD_SPEC = {"gate_up_proj": (1, 2), "gate_up_proj_bias": (1, 2), "down_proj": (2, 1),
                  "down_proj_bias": OUTPUT_BIAS}
LLAMA_SHARD_SPEC = {"W_fc1": FLAT, "W_fc2": FLAT, "W_fc3": FLAT}
# by parameter name, for code that sees state dicts rather than modules (checkpoint re-sharding)
BUILTIN_SHARD_SPEC = {**FFN_SHARD_SPEC, **GLU_SHARD_SPEC}
# an output bias is padded to a multiple of n: its true length is this weight's dim
OUTPUT_DIM_OF = {"batched_fc2_bias": ("batched_fc2_w", 2), "down_proj_bias": ("down_proj", 1)}


def shard_spec_of(experts) -> dict:
    """The module's ``shard_spec`` ({parameter name: role}); a clear error for modules without one."""
    spec = getattr(experts, "shard_spec", None)
    if spec is None:
        raise ValueError(f"sharding experts over ranks (num_experts_per_device < 0) needs the built-in 'ffn' or 'glu' "
                         f"experts; {type(experts).__name__} has no shard_spec")
    return spec


def merge_shards(stacked: Tensor, role: ShardRole, output_dim: int | None = None) -> Tensor:
    """``stacked`` [n, *param_shape]: the n shards of one parameter in shard order -> the whole
    parameter (hidden axis n times longer; an output bias cut back to ``output_dim``)."""
    n = stacked.size(0)
    if role == OUTPUT_BIAS:
        full = stacked.movedim(0, -2).reshape(*stacked.shape[1:-1], n * stacked.size(-1))
        return full[..., :output_dim] if output_dim is not None else full
    dim, parts = role
    shape = list(stacked.shape[1:])
    h = shape[dim] // parts
    split = stacked.reshape(n, *shape[:dim], parts, h, *shape[dim + 1:])   # [n, ..., parts, h, ...]
    merged = split.movedim(0, dim + 1)                                     # [..., parts, n, h, ...]
    return merged.reshape(*shape[:dim], parts * n * h, *shape[dim + 1:])


def split_shard(full: Tensor, role: ShardRole, n: int, s: int) -> Tensor:
    """The inverse of :func:`merge_shards` for one shard: shard ``s`` of ``n`` of a whole parameter."""
    if role == OUTPUT_BIAS:
        c = -(-full.size(-1) // n)
        padded = torch.nn.functional.pad(full, (0, n * c - full.size(-1)))
        return padded[..., s * c:(s + 1) * c].clone()
    dim, parts = role
    shape = list(full.shape)
    if shape[dim] % (parts * n):
        raise ValueError(f"a hidden dim of {shape[dim] // parts} cannot be split into {n} equal shards")
    h = shape[dim] // (parts * n)
    split = full.reshape(*shape[:dim], parts, n, h, *shape[dim + 1:])
    return split.select(dim + 1, s).reshape(*shape[:dim], parts * h, *shape[dim + 1:]).clone()
