"""An MoE layer assembled from dynamoe's low-level pieces, trained like helloworld.

Usage: python -m dynamoe.examples.helloworld_from_scratch --batch_size 4 --num_tokens 256 \
           --model_dim 256 --hidden_size 512 --num_local_experts 4 --top 2 --num_steps 10 [--megablocks_size 0]

The data flow of one forward (T tokens, D model dim, E experts, K per token, N kept rows, F hidden):

    x [T, D] --gate Linear--> logits [T, E] --softmax_topk--> ids [T, K], weights [T, K], probs [T, E]
    build_plan(ids, weights, E, capacity_factor)   capacity rule, slots, drops, rows sorted by expert
    dispatch_ragged(x, plan)         -> x_N [N, D]  (rows grouped by expert: counts[e] rows for e)
    grouped_mm(fc1) -> relu -> grouped_mm(fc2) -> y_N [N, D]   one matmul per expert
    combine_ragged(y_N, plan)        -> y [T, D] = sum over kept choices of weight * expert output
    plan.stats(...)                  -> y.routing_stats (load, kept, dropped, capacity, layout)

The padded layout (``--megablocks_size 0``) swaps the middle for dispatch_padded -> [E, C, D]
(empty slots are zeros) -> one batched matmul per FFN layer -> combine_padded; padding rows are
computed but never combined, so both layouts give the same y. Here ``--megablocks_size`` only picks
the layout (0 padded, else ragged); the capacity is rounded up to the overlap degree alone.
``dynamoe.moe.MoELayer`` does exactly this (plus other gates, experts, losses and Tutel's alignment).
"""
from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..moe import build_plan, combine_padded, combine_ragged, dispatch_padded, dispatch_ragged, gshard_loss
from ..ops import grouped_mm, softmax_topk
from ._common import (run_main, DTYPES, ExampleModel, build_parser, ffn_flops_per_row, make_data, moe_forward_flops, parse_args,
                      run_loop)


class ScratchMoE(nn.Module):
    """Top-k softmax gate + FFN experts, on the ragged (row per kept assignment, the default) or the
    padded ([E, C, D]) layout."""

    def __init__(self, model_dim: int, hidden_size: int, num_experts: int, top_k: int, capacity_factor: float,
                 fp32_gate: bool = False, dtype=None, device=None):
        super().__init__()
        E, D, F_ = num_experts, model_dim, hidden_size
        kw = dict(dtype=dtype, device=device)
        self.num_experts, self.top_k, self.capacity_factor, self.fp32_gate = E, top_k, capacity_factor, fp32_gate
        self.wg = nn.Linear(D, E, bias=False, dtype=torch.float32 if fp32_gate else dtype, device=device)
        self.fc1_w = nn.Parameter(torch.empty(E, F_, D, **kw))  # nn.Linear layout: used with trans_w=True
        self.fc1_b = nn.Parameter(torch.empty(E, F_, **kw))
        self.fc2_w = nn.Parameter(torch.empty(E, F_, D, **kw))  # [in, out] layout: used as is
        self.fc2_b = nn.Parameter(torch.empty(E, D, **kw))
        with torch.no_grad():
            for t, fan_in in ((self.fc1_w, D), (self.fc1_b, D), (self.fc2_w, F_), (self.fc2_b, F_)):
                t.uniform_(-1 / math.sqrt(fan_in), 1 / math.sqrt(fan_in))

    def forward(self, x: Tensor, top_k: int | None = None, capacity_factor: float | None = None,
                a2a_ffn_overlap_degree: int = 1, layout: str = "ragged") -> Tensor:
        if layout not in ("ragged", "padded"):
            raise ValueError(f"layout must be 'ragged' or 'padded', got {layout!r}")
        k = self.top_k if top_k is None else top_k
        cf = self.capacity_factor if capacity_factor is None else capacity_factor
        x_TD = x.reshape(-1, x.size(-1))

        # 1. gate: logits, then top-k experts and their (renormalised when k > 1) weights, in fp32
        w = self.wg.weight
        logits_TE = F.linear(x_TD.float(), w.float()) if self.fp32_gate else F.linear(x_TD.to(w.dtype), w)
        weights_TK, ids_TK, probs_TE = softmax_topk(logits_TE, k, renormalize=k > 1)
        l_aux = gshard_loss(probs_TE, ids_TK)

        # 2. plan: capacity (rounded up to a multiple of the overlap degree), slots, drops
        plan = build_plan(ids_TK, weights_TK, self.num_experts, float(cf), alignment=a2a_ffn_overlap_degree)

        # 3+4. experts, then combine: each token's weighted sum of its kept expert outputs
        if layout == "ragged":  # rows grouped by expert: counts[e] rows belong to expert e
            x_ND = dispatch_ragged(x_TD, plan)
            h_NF = F.relu(grouped_mm(x_ND, self.fc1_w, plan.counts, self.fc1_b, trans_w=True))
            y_TD = combine_ragged(grouped_mm(h_NF, self.fc2_w, plan.counts, self.fc2_b), plan)
        else:  # [E, C, D]: slot c of expert e, zeros where no token landed
            x_ECD = dispatch_padded(x_TD, plan)
            h_ECF = F.relu(torch.baddbmm(self.fc1_b.unsqueeze(1), x_ECD, self.fc1_w.transpose(1, 2)))
            y_TD = combine_padded(torch.baddbmm(self.fc2_b.unsqueeze(1), h_ECF, self.fc2_w), plan)

        y = y_TD.view(x.shape).to(x.dtype)
        y.l_aux = l_aux
        y.routing_stats = plan.stats(capacity_factor=float(cf), layout=layout, losses={"gshard": l_aux})
        return y


def main(argv=None) -> list[float]:
    parser = build_parser(__doc__.splitlines()[0], omit=("expert_type", "parallel_type"),
                          checkpoint_path="./dynamoe-helloworld_from_scratch.ckpt")
    args = parse_args(parser, argv)
    dtype = DTYPES[args.dtype]
    moe = ScratchMoE(args.model_dim, args.hidden_size, args.num_local_experts, args.top, args.capacity_factor,
                     args.fp32_gate, dtype=dtype, device=args.device)
    model = ExampleModel(moe)
    print(model)
    print(f"[Statistics] param count = {sum(p.numel() for p in model.parameters())}")
    x, target = make_data(args, dtype)
    per_row = ffn_flops_per_row(args.model_dim, args.hidden_size)
    switches = dict(capacity_factor=args.capacity_factor, a2a_ffn_overlap_degree=args.a2a_ffn_overlap_degree,
                    layout="padded" if args.megablocks_size == 0 else "ragged")
    return run_loop(args, model, x, target, lambda s: moe_forward_flops(s, args.model_dim, per_row), switches)


if __name__ == "__main__":
    run_main(main)
