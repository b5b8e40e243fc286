"""Pure tensor ops of the MoE data flow, each with a plain reference beside its fast path.

Tutel-compatible names: ``qwen3_moe_scaled_topk``, ``deepseek_moe_sigmoid_scaled_topk``,
``fast_cumsum_sub_one``.
"""
from .slots import capacity, expert_slots, fast_cumsum_sub_one
from .grouped_matmul import grouped_mm, grouped_mm_reference
from .gemv import linear
from .scratch import release_scratch, scratch_bytes
from .routing import (
    check_top_k,
    deepseek_moe_sigmoid_scaled_topk,
    qwen3_moe_scaled_topk,
    sigmoid_group_topk,
    softmax_topk,
    softmax_topk_reference,
)

__all__ = [
    "capacity",
    "expert_slots",
    "fast_cumsum_sub_one",
    "grouped_mm",
    "grouped_mm_reference",
    "linear",
    "release_scratch",
    "scratch_bytes",
    "check_top_k",
    "softmax_topk",
    "softmax_topk_reference",
    "sigmoid_group_topk",
    "qwen3_moe_scaled_topk",
    "deepseek_moe_sigmoid_scaled_topk",
]
