"""The demo model's export: the Hugging Face folder (bf16 safetensors, config, tokenizer, generation
config) and its model card, for :mod:`dynamoe.examples.train_demo`."""
from __future__ import annotations

import json
import os
import platform
import shlex

import torch
from torch import Tensor

from . import demo_data

__all__ = ["hf_state_dict", "export_hf", "card_command", "model_card", "CARD_SCORES_START", "CARD_SCORES_END",
           "cpu_name"]

CARD_SCORES_START, CARD_SCORES_END = "<!-- eval-scores:start -->", "<!-- eval-scores:end -->"


def hf_state_dict(model, dtype: torch.dtype = torch.bfloat16) -> dict[str, Tensor]:
    """Our parameters under Hugging Face's Qwen3-MoE names: the gate as ``mlp.gate.weight``, the fused
    experts split per expert (``mlp.experts.{e}.gate_proj|up_proj|down_proj.weight``); no tied head."""
    out = {}
    tied = model.config.tie_word_embeddings
    for name, p in model.state_dict().items():
        if name.endswith("_num_global_experts") or "rotary" in name or (tied and name == "lm_head.weight"):
            continue
        p = p.detach().to(dtype)
        if name.endswith(".moe.experts.gate_up_proj"):           # [E, 2F, D]: gate rows, then up rows
            prefix = model.checkpoint_name(name[: -len(".gate_up_proj")])
            F_ = p.size(1) // 2
            for e in range(p.size(0)):
                out[f"{prefix}.{e}.gate_proj.weight"] = p[e, :F_].contiguous()
                out[f"{prefix}.{e}.up_proj.weight"] = p[e, F_:].contiguous()
        elif name.endswith(".moe.experts.down_proj"):            # [E, D, F]
            prefix = model.checkpoint_name(name[: -len(".down_proj")])
            for e in range(p.size(0)):
                out[f"{prefix}.{e}.down_proj.weight"] = p[e].contiguous()
        else:
            out[model.checkpoint_name(name)] = p.contiguous()
    return out


def export_hf(model, config: dict, tokenizer_dir: str, out_dir: str, card: str) -> int:
    """Write the HF folder (see the module docstring); returns the size of model.safetensors in bytes."""
    import shutil

    from safetensors.torch import save_file

    os.makedirs(out_dir, exist_ok=True)
    tensors = hf_state_dict(model)
    weights = os.path.join(out_dir, "model.safetensors")
    tmp = weights + ".tmp"
    save_file(tensors, tmp, metadata={"format": "pt"})
    os.chmod(tmp, 0o644)
    os.replace(tmp, weights)
    with open(os.path.join(out_dir, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    gen = {"eos_token_id": [config["eos_token_id"]], "pad_token_id": config["pad_token_id"], "do_sample": False,
           "max_new_tokens": 256}
    with open(os.path.join(out_dir, "generation_config.json"), "w") as f:
        json.dump(gen, f, indent=2)
        f.write("\n")
    for name in ("tokenizer.json", "tokenizer_config.json"):
        shutil.copyfile(os.path.join(tokenizer_dir, name), os.path.join(out_dir, name))
    with open(os.path.join(out_dir, "README.md"), "w", encoding="utf-8") as f:
        f.write(card)
    return os.path.getsize(weights)


def card_command(run: dict, defaults: dict, threads: int) -> str:
    """The command that reproduces the run (``run``: the flags that shape it): the main flags always,
    the others where not the default."""
    always = ("steps", "batch_size", "seq_len", "seed", "dtype")
    parts = ["python -m dynamoe.examples.train_demo"]
    for k in list(always) + [k for k in run if k not in always and run[k] != defaults.get(k)]:
        parts += [f"--{k.replace('_', '-')}", shlex.quote(str(run[k]))]
    return " ".join(parts + ["--threads", str(threads)])


def model_card(args, config: dict, params: tuple[int, int], stats: dict, cmd: str) -> str:
    """The model card (README.md of the export); ``cmd`` reproduces the run (see :func:`card_command`)."""
    total, active = params
    counts = stats.get("skill_counts", {})
    skills = ", ".join(f"{k} {v}" for k, v in sorted(counts.items()))
    return f"""---
license: mit
library_name: dynamoe
pipeline_tag: text-generation
tags: [mixture-of-experts, qwen3_moe, demo, synthetic-data]
---

# dynamoe demo-moe

A small Mixture-of-Experts chat model that ships inside the `dynamoe` package, so `make serve` has a real
model to serve on a machine with no GPU and no downloads. It was trained from scratch by dynamoe's own
example, `python -m dynamoe.examples.train_demo`, with dynamoe's MoE layers and their balance loss.
It is a toy: it knows only the skills below, and only in the phrasings it was trained on or close to them.

## Model

| | |
| --- | --- |
| architecture | Qwen3-MoE (`Qwen3MoeForCausalLM`; loads with `dynamoe.models.load` and with transformers) |
| layers / hidden / heads (kv) | {config['num_hidden_layers']} / {config['hidden_size']} / {config['num_attention_heads']} ({config['num_key_value_heads']}) |
| experts | {config['num_experts']} routed experts per layer, top-{config['num_experts_per_tok']}, expert hidden size {config['moe_intermediate_size']} |
| parameters | {total / 1e6:.1f} M total, {active / 1e6:.1f} M active per token (tied embeddings) |
| vocabulary | {stats.get('vocab', '?')} byte-level BPE tokens (digits, and the letters of quoted words, one per token), ChatML chat template, eos `<|im_end|>` |
| context | {config['max_position_embeddings']} positions; {_window_text(config)} (trained on rows of {args.seq_len}{f" and, in the long-context stage, {args.long_seq_len}" if getattr(args, "long_steps", 0) else ""}) |
| weights | bf16 safetensors, {stats.get('export_mb', 0):.1f} MB |

## Data

Synthetic, generated by `dynamoe.examples.demo_data` ({_seed_text(args)}): {args.corpus_size} training
conversations{f" ({skills})" if skills else ""}, data version {demo_data.DATA_VERSION}. Skills: integer arithmetic (+ − × on
1–3 digit numbers; answers work column by column from the ones, carries and borrows written out,
differences compare the operands first, and products are long multiplication: one row per digit of the
multiplier with its carries, rows added by columns two at a time), sorting (when the list mixes 1- and
2-digit numbers, each number's length is written out first, then the numbers grouped by length) and
reversing lists, spelling words, reversing them and counting their letters,
unit conversions (km/m/cm, kg/g, hours/minutes, °C/°F rounded to one decimal, half away from zero), and
Python functions for quicksort, binary search, fibonacci, factorial, bubble sort and gcd.
The evaluation prompts are held out: their problems (for arithmetic, the operand pairs) never occur in
training.
{_long_data_text(args)}
**It does not use tools.** The chat template names the tools a client offers in the system block and
leaves their schemas out (an agent's tool list is tens of thousands of tokens); the model was trained
to ignore them: it never calls one, and it answers only the last user message, from what it was trained on.

## Training

```
{cmd}
```

{_training_text(args, stats)}

## Evaluation

Held-out prompts per skill, greedy decoding through dynamoe's engine, exact match on the final answer;
code answers are run in a subprocess against test inputs (`python -m dynamoe.examples.eval_demo`).
`GROUP@harness`: the target groups' questions again, each inside ~12k characters of what an agent harness
sends (`demo_context`, held-out seeds: system prompts, a system message after the user's turn, offered
tools, reminder blocks before -- or, one time in ten, after -- the question).

{CARD_SCORES_START}
Not evaluated yet: run `python -m dynamoe.examples.eval_demo --update-card`.
{CARD_SCORES_END}

## Use

```
make serve                                   # web UI at http://127.0.0.1:8000
python -c "import dynamoe; print(dynamoe.generate('dynamoe/assets/demo-moe', 'What is 47 + 38?', chat=True, temperature=0))"
```
"""



def cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


def _seed_text(args) -> str:
    """The main corpus's seed: this run's, or, for a run that started from an export, that run's."""
    return "the first stage's seed, see Training" if getattr(args, "init_from", None) else f"seed {args.seed}"


def _window_text(config: dict) -> str:
    w = config.get("sliding_window") if config.get("use_sliding_window") else None
    return (f"sliding-window attention over {w} positions on every layer, so the cost of a prompt grows "
            "linearly with its length" if w else "full attention")


def _long_data_text(args) -> str:
    if not getattr(args, "long_steps", 0):
        return ""
    return (f"\nLong-context stage: {args.long_corpus_size} more conversations (seed {args.seed + 2}), "
            f"{args.long_share:.0%} of them inside what agent harnesses send "
            f"(`dynamoe.examples.demo_context`, version {_harness_version()}): long synthetic system prompts, "
            "offered tools, reminder blocks before or after the question in the user's message, system "
            "messages after the user's turn (the chat template folds every system message into the leading "
            "system block and names the offered tools there); nothing of it is a real harness's text.\n")


def _harness_version() -> int:
    from .demo_context import HARNESS_VERSION

    return HARNESS_VERSION


def _training_text(args, stats: dict) -> str:
    threads = stats.get("threads", "?")
    hw = f"{threads} CPU thread{'' if threads == 1 else 's'} ({stats.get('cpu', '?')})"
    if stats.get("base_training"):
        stage1 = "Stage 1 is the model this run started from (`--init-from`); its card said:\n\n> " + \
            stats["base_training"].replace("\n", "\n> ")
    else:
        stage1 = (f"{steps_text(stats)} of {args.batch_size} × {args.seq_len} tokens ({stats.get('tokens', 0) / 1e6:.1f} M tokens, "
                  f"loss on assistant tokens only), AdamW (lr {args.lr:g}, warmup {args.warmup}, cosine to "
                  f"{args.lr * args.min_lr_ratio:g}, weight decay {args.weight_decay:g}), Switch balance loss × "
                  f"{args.aux_loss_coef:g}, {args.dtype}.")
    out = [stage1]
    if getattr(args, "long_steps", 0):
        out.append(f"Long-context stage: {stats.get('long_steps', 0)} steps of {args.long_batch_size} × {args.long_seq_len} "
                   f"tokens ({stats.get('long_tokens', 0) / 1e6:.1f} M tokens), lr {args.long_lr:g} (warmup, cosine to "
                   f"{args.long_lr * args.min_lr_ratio:g}); held-out loss of wrapped conversations "
                   f"{stats.get('long_eval_loss') or float('nan'):.4f}.")
    out.append(f"This run: {hw}, {stats.get('wall_min', 0):.0f} minutes. Training loss "
               f"{stats.get('train_loss', float('nan')):.4f} (mean of the last 50 steps), held-out loss "
               f"{stats.get('eval_loss', float('nan')):.4f}.")
    return "\n\n".join(out)


def steps_text(stats: dict) -> str:
    done, of = stats.get("steps", 0), stats.get("of_steps", stats.get("steps", 0))
    return f"{done} steps" if done >= of else f"{done} steps (a partial export: {done} of the run's {of})"
