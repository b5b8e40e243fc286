"""Which experts each skill uses: a heatmap of routing share per layer x skill x expert.

Usage: python -m dynamoe.examples.expert_usage [--model DIR] --out expert_usage.png [--n-per-skill 30] [--json FILE]

Held-out conversations of every skill (:mod:`dynamoe.examples.demo_data`) go through the model, one
forward each (the prompt and the reference reply: the tokens the model reads while it answers; with
``--prompt-only`` just the prompt). After each forward the MoE layers' routing stats
(``model.moe_stats()``: assignments per expert) are added up per skill. The share of layer l, skill s,
expert e is its assignments over all of (l, s)'s assignments: each heatmap row sums to 1, and a
uniform router would give 1/E everywhere. Needs matplotlib (``pip install 'dynamoe[examples]'``).
"""
from __future__ import annotations

import argparse
import importlib.util
import json
import math
import os
from typing import Optional

import torch

from . import demo_data
from .train_demo import DEFAULT_OUT

__all__ = ["routing_shares", "plot_heatmap", "specialisation", "main", "USAGE_SKILLS"]

#: the skills shown, in row order (chat has no held-out prompts)
USAGE_SKILLS = tuple(s for s in demo_data.SKILLS if s != "chat")


@torch.no_grad()
def routing_shares(model, tokenizer, examples_by_skill: dict[str, list], prompt_only: bool = False) -> torch.Tensor:
    """float [L, S, E]: routing share of every MoE layer, skill (dict order) and expert."""
    layers = model.moe_layers()
    if not layers:
        raise ValueError("the model has no MoE layers")
    E = layers[0][1].num_experts
    counts = torch.zeros(len(layers), len(examples_by_skill), E, dtype=torch.float64)
    was = model.training
    model.eval()
    try:
        for s, (skill, examples) in enumerate(examples_by_skill.items()):
            for ex in examples:
                if prompt_only:
                    ids = tokenizer.encode_chat(ex.prompt)
                else:
                    ids = tokenizer.encode_chat(ex.messages, add_generation_prompt=False)
                model(torch.tensor([ids], dtype=torch.long, device=model.device))
                for li, st in enumerate(model.moe_stats()):
                    counts[li, s] += st.load.double().cpu()
    finally:
        model.train(was)
    return counts / counts.sum(-1, keepdim=True).clamp_min(1.0)


def specialisation(shares_LSE: torch.Tensor) -> torch.Tensor:
    """float [L]: per layer, 1 - mean over skills of (entropy of the skill's routing / log E):
    0 for uniform routing, 1 if every skill used a single expert."""
    E = shares_LSE.size(-1)
    p = shares_LSE.clamp_min(1e-12)
    ent = -(p * p.log()).sum(-1) / math.log(E)
    return 1 - ent.mean(-1)


def plot_heatmap(shares_LSE: torch.Tensor, skills: list[str], path: str, title: Optional[str] = None) -> None:
    """One panel per MoE layer: skills (rows) x experts (columns), colour = routing share."""
    import matplotlib
    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    L, S, E = shares_LSE.shape
    cols = min(L, 3)
    rows = -(-L // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(1.2 + cols * (0.28 * E + 1.6), rows * (0.3 * S + 1.3)),
                             squeeze=False, constrained_layout=True)
    vmax = float(shares_LSE.max())
    spec = specialisation(shares_LSE)
    im = None
    for i in range(rows * cols):
        ax = axes[i // cols][i % cols]
        if i >= L:
            ax.axis("off")
            continue
        im = ax.imshow(shares_LSE[i].numpy(), aspect="auto", cmap="viridis", vmin=0.0, vmax=vmax)
        ax.set_title(f"layer {i} (specialisation {float(spec[i]):.2f})", fontsize=9)
        ax.set_xticks(range(E))
        ax.set_xticklabels([str(e) for e in range(E)], fontsize=6)
        ax.set_xlabel("expert", fontsize=8)
        ax.set_yticks(range(S))
        ax.set_yticklabels(skills if i % cols == 0 else [""] * S, fontsize=7)
    fig.colorbar(im, ax=axes, shrink=0.8, label="share of the layer's routing")
    fig.suptitle(title or f"Expert routing share per skill (uniform = 1/{E} = {1 / E:.3f})", fontsize=11)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def main(argv=None) -> torch.Tensor:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    p.add_argument("--model", default=DEFAULT_OUT, help="HF folder of the demo model")
    p.add_argument("--out", default="expert_usage.png", help="PNG file to write")
    p.add_argument("--n-per-skill", type=int, default=30, help="held-out conversations per skill")
    p.add_argument("--seed", type=int, default=2000)
    p.add_argument("--prompt-only", action="store_true", help="route the prompts only, not the reference replies")
    p.add_argument("--json", default=None, help="also write the shares [layer][skill][expert] as JSON")
    args = p.parse_args(argv)
    if args.n_per_skill < 1:
        p.error(f"argument --n-per-skill: must be >= 1, got {args.n_per_skill}")
    if not os.path.isdir(args.model):
        p.error(f"argument --model: {args.model!r} is not a folder (train it first: python -m dynamoe.examples.train_demo)")
    if importlib.util.find_spec("matplotlib") is None:
        p.error("matplotlib is needed for the PNG: pip install 'dynamoe[examples]' (or pip install matplotlib)")
    from ..engine import load

    model, tokenizer = load(args.model)
    by_skill = {s: demo_data.generate(args.seed + i, args.n_per_skill, "held_out", skills=[s])
                for i, s in enumerate(USAGE_SKILLS)}
    shares = routing_shares(model, tokenizer, by_skill, args.prompt_only)
    plot_heatmap(shares, list(by_skill), args.out)
    spec = specialisation(shares)
    for li in range(shares.size(0)):
        top = ", ".join(f"{s}: e{int(shares[li, si].argmax())} ({float(shares[li, si].max()):.0%})"
                        for si, s in enumerate(by_skill))
        print(f"layer {li}: specialisation {float(spec[li]):.3f}; top expert per skill: {top}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"skills": list(by_skill), "shares": shares.tolist(), "specialisation": spec.tolist()}, f)
    print(f"[expert_usage] wrote {args.out}")
    return shares


if __name__ == "__main__":
    main()
