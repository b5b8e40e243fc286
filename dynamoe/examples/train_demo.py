"""Train the embedded demo model: a small Qwen3-MoE chat model, on dynamoe's MoE layers, from scratch.

Usage: python -m dynamoe.examples.train_demo [--steps N] [--batch-size B] [--seq-len S] [--out DIR]
           [--ckpt-dir DIR] [--dtype fp32|bf16] [--seed N] [--fresh]

What it does, in order:

1. data: :mod:`dynamoe.examples.demo_data` generates ``--corpus-size`` training conversations and a
   held-out set (prompts disjoint from training); a byte-level BPE is trained on the first 20k
   (:mod:`dynamoe.examples.demo_tokenizer`); conversations are rendered with the chat template,
   encoded, and packed whole into rows of ``seq-len + 1`` tokens. The loss counts assistant tokens only.
2. model: a Qwen3-MoE config (``architectures: Qwen3MoeForCausalLM``, so transformers loads the result)
   built as dynamoe's :class:`~dynamoe.models.qwen3_moe.Qwen3MoeForCausalLM` in train mode; every MoE
   layer adds its Switch balance loss (``y.l_aux``), weighted by ``--aux-loss-coef``, to the LM loss.
3. training: AdamW, linear warmup then cosine decay, gradient clipping, a tqdm bar, the held-out loss
   every ``--eval-every`` steps. Checkpoints (model, optimizer, RNG, step, log) are written atomically to
   ``--ckpt-dir`` every ``--ckpt-every`` steps; a run started again with the same flags resumes from the
   last one and continues bit-identically (the batch of step s depends only on s and the seed).
4. export: ``--out`` gets an HF folder: config.json, model.safetensors (bf16), tokenizer files,
   generation_config.json (greedy) and a model card README.md (its scores section is filled in by
   ``python -m dynamoe.examples.eval_demo --update-card``).

Same flags and thread count -> the same weights. The checkpoint folder is not part of the export.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import math
import os
import random
import sys
import time
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from ..checkpoint.atomic import save_atomic
from . import demo_context, demo_data, demo_tokenizer
from .demo_export import CARD_SCORES_END, CARD_SCORES_START, cpu_name, export_hf, hf_state_dict, model_card
from .demo_export import card_command

__all__ = ["main", "build_parser", "model_config", "build_model", "init_weights", "enable_balance_loss",
           "moe_aux_loss", "lm_loss", "hf_state_dict", "export_hf", "lr_at", "DEFAULT_OUT", "CARD_SCORES_START",
           "CARD_SCORES_END"]

DEFAULT_OUT = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "demo-moe")
MAX_EXPORT_BYTES = 40 * 1024 * 1024
TOKENIZER_SAMPLE = 20_000       # conversations the BPE is trained on
HELD_OUT_CONVERSATIONS = 512    # for the eval loss (fewer for small corpora: a tenth of --corpus-size)


# ------------------------------------------------------------------------------------ flags
def build_parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0], formatter_class=argparse.ArgumentDefaultsHelpFormatter)
    g = p.add_argument_group("run")
    g.add_argument("--steps", type=int, default=2600, help="optimizer steps (~45 min on 2 idle CPU cores)")
    g.add_argument("--batch-size", type=int, default=16, help="rows per step")
    g.add_argument("--seq-len", type=int, default=256, help="tokens per row (whole conversations are packed into rows)")
    g.add_argument("--out", default=DEFAULT_OUT, help="where the HF folder is written at the end")
    g.add_argument("--ckpt-dir", default=None, help="checkpoints, tokenizer and data cache (default: runs/demo-moe-train "
                   "in the current folder for the default --out, else OUT + '-train'; never inside the export)")
    g.add_argument("--ckpt-every", type=int, default=100, help="steps between checkpoints")
    g.add_argument("--eval-every", type=int, default=200, help="steps between held-out evaluations (0: only at the end)")
    g.add_argument("--fresh", action="store_true", help="ignore an existing checkpoint and start over")
    g.add_argument("--stop-after", type=int, default=None,
                   help="stop (after checkpointing) once this many steps are done, without exporting: "
                        "a later run with the same flags resumes (for tests and time-sliced training)")
    g.add_argument("--seed", type=int, default=0, help="seeds data, weights and everything else")
    g.add_argument("--dtype", choices=["fp32", "bf16"], default="fp32",
                   help="compute dtype: fp32, or bf16 autocast (fp32 master weights); the export is bf16 either way")
    g.add_argument("--threads", type=int, default=None, help="torch threads (default: torch's choice)")
    g.add_argument("--progress", action=argparse.BooleanOptionalAction, default=None,
                   help="tqdm progress bar (default: when stderr is a terminal)")
    g.add_argument("--no-export", dest="export", action="store_false", help="skip the HF export at the end")
    g.add_argument("--export-partial", action="store_true",
                   help="with --stop-after: export the weights reached so far too (to look at them with eval_demo "
                        "mid-run; the card says how many steps)")
    g.add_argument("--no-samples", dest="samples", action="store_false",
                   help="skip the few greedy sample replies printed after the export")
    d = p.add_argument_group("data")
    d.add_argument("--corpus-size", type=int, default=200_000, help="training conversations generated")
    d.add_argument("--vocab-size", type=int, default=3072, help="BPE vocabulary target (the trainer may stop earlier)")
    m = p.add_argument_group("model (Qwen3-MoE)")
    m.add_argument("--layers", type=int, default=6)
    m.add_argument("--hidden", type=int, default=256)
    m.add_argument("--heads", type=int, default=4)
    m.add_argument("--kv-heads", type=int, default=2)
    m.add_argument("--experts", type=int, default=16)
    m.add_argument("--top-k", type=int, default=2)
    m.add_argument("--moe-intermediate", type=int, default=192)
    m.add_argument("--max-position", type=int, default=32768, help="positions the model takes (its context length)")
    m.add_argument("--sliding-window", type=int, default=512,
                   help="sliding-window attention on every layer over this many positions (0: full attention); "
                        "with it the cost of a long prompt grows linearly and no position is unseen in training")
    lc = p.add_argument_group("long-context stage (after --steps: harness-style prompts, demo_context)")
    lc.add_argument("--long-steps", type=int, default=120, help="optimizer steps of the long-context stage (0: none)")
    lc.add_argument("--long-seq-len", type=int, default=2048, help="tokens per row in that stage")
    lc.add_argument("--long-batch-size", type=int, default=4, help="rows per step in that stage")
    lc.add_argument("--long-corpus-size", type=int, default=8000, help="conversations generated for that stage")
    lc.add_argument("--long-share", type=float, default=0.6,
                    help="share of them wrapped in a long system prompt / tools / reminders (demo_context.wrap)")
    lc.add_argument("--long-lr", type=float, default=5e-4, help="peak learning rate of that stage (warmup, cosine)")
    lc.add_argument("--init-from", default=None,
                    help="start the long-context stage from this exported model folder (weights and tokenizer) "
                         "instead of training the first --steps steps")
    o = p.add_argument_group("optimizer")
    o.add_argument("--lr", type=float, default=2e-3, help="peak learning rate")
    o.add_argument("--min-lr-ratio", type=float, default=0.1, help="final lr = lr * this (cosine decay)")
    o.add_argument("--warmup", type=int, default=100, help="linear warmup steps")
    o.add_argument("--weight-decay", type=float, default=0.1)
    o.add_argument("--grad-clip", type=float, default=1.0)
    o.add_argument("--aux-loss-coef", type=float, default=0.01, help="weight of the MoE balance loss")
    return p


def _check_args(p: argparse.ArgumentParser, args) -> None:
    for name in ("steps", "batch_size", "seq_len", "ckpt_every", "corpus_size", "layers", "hidden", "heads",
                 "kv_heads", "experts", "top_k", "moe_intermediate", "max_position", "long_seq_len", "long_batch_size",
                 "long_corpus_size"):
        if getattr(args, name) < 1:
            p.error(f"argument --{name.replace('_', '-')}: must be >= 1, got {getattr(args, name)}")
    if args.eval_every < 0:
        p.error(f"argument --eval-every: must be >= 0, got {args.eval_every}")
    if args.top_k > args.experts:
        p.error(f"argument --top-k: must be <= --experts ({args.experts}), got {args.top_k}")
    if args.hidden % args.heads or args.heads % args.kv_heads:
        p.error(f"--hidden ({args.hidden}) must be divisible by --heads ({args.heads}), and --heads by --kv-heads ({args.kv_heads})")
    if args.seq_len > args.max_position:
        p.error(f"argument --seq-len: must be <= --max-position ({args.max_position}), got {args.seq_len}")
    if args.long_seq_len > args.max_position:
        p.error(f"argument --long-seq-len: must be <= --max-position ({args.max_position}), got {args.long_seq_len}")
    if args.sliding_window < 0 or args.long_steps < 0:
        p.error(f"--sliding-window and --long-steps must be >= 0, got {args.sliding_window}, {args.long_steps}")
    if not 0 <= args.long_share <= 1 or not args.long_lr > 0:
        p.error(f"--long-share must be in [0, 1] and --long-lr > 0, got {args.long_share}, {args.long_lr}")
    if args.init_from is not None and not args.long_steps:
        p.error("argument --init-from: needs --long-steps >= 1 (it starts the long-context stage)")
    if args.vocab_size < 300:
        p.error(f"argument --vocab-size: must be >= 300 (256 bytes + special tokens + merges), got {args.vocab_size}")
    if not args.lr > 0 or not 0 <= args.min_lr_ratio <= 1:
        p.error(f"--lr must be > 0 and --min-lr-ratio in [0, 1], got {args.lr}, {args.min_lr_ratio}")
    if args.stop_after is not None and args.stop_after < 1:
        p.error(f"argument --stop-after: must be >= 1, got {args.stop_after}")
    if args.threads is not None and args.threads < 1:
        p.error(f"argument --threads: must be >= 1, got {args.threads}")


# ------------------------------------------------------------------------------------ model
def model_config(args, vocab_size: int, pad_id: int, eos_id: int) -> dict:
    """The HF ``config.json`` of the demo model (Qwen3-MoE, every layer sparse, tied embeddings)."""
    vocab = -(-vocab_size // 64) * 64  # rows for every token id, rounded up for the matmuls
    head_dim = args.hidden // args.heads
    return {
        "architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe",
        "vocab_size": vocab, "hidden_size": args.hidden, "num_hidden_layers": args.layers,
        "num_attention_heads": args.heads, "num_key_value_heads": args.kv_heads, "head_dim": head_dim,
        "intermediate_size": 4 * args.hidden,  # dense MLP size: unused, every layer is an MoE layer
        "moe_intermediate_size": args.moe_intermediate, "num_experts": args.experts,
        "num_experts_per_tok": args.top_k, "norm_topk_prob": True, "decoder_sparse_step": 1, "mlp_only_layers": [],
        "hidden_act": "silu", "max_position_embeddings": args.max_position, "rms_norm_eps": 1e-6,
        "rope_theta": 10000.0, "rope_scaling": None, "attention_bias": False, "attention_dropout": 0.0,
        "use_sliding_window": bool(args.sliding_window), "sliding_window": args.sliding_window or None,
        "tie_word_embeddings": True,
        "router_aux_loss_coef": args.aux_loss_coef, "output_router_logits": False, "initializer_range": 0.02,
        "bos_token_id": None, "eos_token_id": eos_id, "pad_token_id": pad_id, "use_cache": True,
        "dtype": "bfloat16",
    }


def build_model(config: dict, dtype: Optional[torch.dtype] = None):
    """dynamoe's Qwen3-MoE model for an HF config dict (parameters uninitialised: see :func:`init_weights`)."""
    from ..models import ModelConfig
    from ..models.registry import builder_for

    cfg = ModelConfig.from_dict(config)
    return builder_for(cfg)(cfg, dtype=dtype)


@torch.no_grad()
def init_weights(model, seed: int, std: float = 0.02) -> None:
    """GPT-2 style: N(0, std) everywhere, output projections (o_proj, expert down_proj) scaled by
    1/sqrt(2 * layers), norms at 1. Drawn from one generator in parameter order: deterministic."""
    g = torch.Generator().manual_seed(seed)
    layers = model.config.num_hidden_layers
    for name, p in model.named_parameters():
        if "norm" in name:
            p.fill_(1.0)
            continue
        s = std / math.sqrt(2 * layers) if name.endswith(("o_proj.weight", "down_proj")) else std
        p.copy_(torch.randn(p.shape, generator=g, dtype=torch.float32) * s)


def enable_balance_loss(model, kind: str = "switch") -> None:
    """Make every MoE layer compute its balance loss ``kind`` (see dynamoe.moe.losses).

    The models build their MoE layers for inference (``aux_loss='none'``: no score tensor kept); the
    layer reads ``config.aux_loss`` at every forward, so switching it on for training is free (a new,
    frozen config per layer)."""
    from ..moe.config import AUX_LOSSES

    if kind not in AUX_LOSSES:
        raise ValueError(f"kind must be one of {list(AUX_LOSSES)}, got {kind!r}")
    for _, block in model.moe_layers():
        block.moe.config = dataclasses.replace(block.moe.config, aux_loss=kind)


def moe_aux_loss(model) -> Tensor:
    """Mean over the MoE layers of the last forward's balance loss (``MoELayer.l_aux``)."""
    losses = [block.moe.l_aux for _, block in model.moe_layers() if block.moe.l_aux is not None]
    return torch.stack([l.float() for l in losses]).mean() if losses else torch.zeros(())


def lm_loss(logits_BSV: Tensor, targets_BS: Tensor, mask_BS: Tensor) -> Tensor:
    """Mean cross-entropy over the masked (assistant) target tokens, in fp32."""
    ce = F.cross_entropy(logits_BSV.float().flatten(0, 1), targets_BS.flatten(), reduction="none")
    m = mask_BS.flatten().float()
    return (ce * m).sum() / m.sum().clamp_min(1.0)


def lr_at(step: int, args) -> float:
    """Linear warmup to ``--lr`` over ``--warmup`` steps, then cosine to ``lr * min_lr_ratio``; from step
    ``--steps`` on (the long-context stage) the same shape again with ``--long-lr`` over ``--long-steps``."""
    peak, warmup, steps = args.lr, args.warmup, args.steps
    if step >= args.steps:
        step, peak, warmup, steps = step - args.steps, args.long_lr, max(1, args.long_steps // 10), args.long_steps
    if step < warmup:
        return peak * (step + 1) / warmup
    t = (step - warmup) / max(1, steps - warmup)
    t = min(t, 1.0)
    lo = peak * args.min_lr_ratio
    return lo + 0.5 * (peak - lo) * (1 + math.cos(math.pi * t))


def count_params(model) -> tuple[int, int]:
    """(total, active per token) parameters (active: top-k of the routed experts, embeddings once)."""
    total = sum(p.numel() for p in model.parameters())
    expert = sum(p.numel() for n, p in model.named_parameters() if ".experts." in n)
    c = model.config
    active = total - expert + expert * c.num_experts_per_tok // max(c.num_experts, 1)
    return total, active


# ------------------------------------------------------------------------------------ data
def pack(encoded, seq_len: int, pad_id: int) -> tuple[Tensor, Tensor]:
    """Whole conversations packed in order into rows of ``seq_len + 1`` tokens (padded, mask 0);
    a conversation longer than a row is dropped. Returns ids, mask: int64/bool [R, seq_len + 1]."""
    width = seq_len + 1
    rows_ids, rows_mask, cur_ids, cur_mask = [], [], [], []
    for ids, mask in encoded:
        if len(ids) > width:
            continue
        if len(cur_ids) + len(ids) > width:
            rows_ids.append(cur_ids + [pad_id] * (width - len(cur_ids)))
            rows_mask.append(cur_mask + [0] * (width - len(cur_mask)))
            cur_ids, cur_mask = [], []
        cur_ids += ids
        cur_mask += mask
    if cur_ids:
        rows_ids.append(cur_ids + [pad_id] * (width - len(cur_ids)))
        rows_mask.append(cur_mask + [0] * (width - len(cur_mask)))
    return torch.tensor(rows_ids, dtype=torch.long), torch.tensor(rows_mask, dtype=torch.bool)


def batch_at(step: int, ids: Tensor, mask: Tensor, batch_size: int, seed: int) -> tuple[Tensor, Tensor, Tensor]:
    """The batch of ``step``: rows of a seeded permutation per epoch, so it depends on ``step`` only."""
    R = ids.size(0)
    idx = []
    for i in range(step * batch_size, (step + 1) * batch_size):
        epoch, j = divmod(i, R)
        idx.append(int(_perm(R, seed, epoch)[j]))
    rows, m = ids[idx], mask[idx]
    return rows[:, :-1], rows[:, 1:], m[:, 1:]


_PERMS: dict = {}


def _perm(R: int, seed: int, epoch: int) -> Tensor:
    key = (R, seed, epoch)
    if key not in _PERMS:
        _PERMS.clear()
        _PERMS[key] = torch.randperm(R, generator=torch.Generator().manual_seed(seed * 1_000_003 + epoch))
    return _PERMS[key]


def prepare_data(args, ckpt_dir: str, log) -> dict:
    """Tokenizer (trained, or reloaded from ``ckpt_dir``) and packed train / held-out rows, cached in
    ``ckpt_dir/data.pt`` for the same data flags."""
    from tokenizers import Tokenizer as HFTokenizer

    tok_dir = os.path.join(ckpt_dir, "tokenizer")
    data_key = {"seed": args.seed, "corpus_size": args.corpus_size, "seq_len": args.seq_len,
                "vocab_size": args.vocab_size, "format": 1, "data_version": demo_data.DATA_VERSION}
    cache = os.path.join(ckpt_dir, "data.pt")
    if os.path.exists(cache) and os.path.exists(os.path.join(tok_dir, "tokenizer.json")):
        data = torch.load(cache, weights_only=True)
        if data.get("key") == data_key:
            data["tokenizer"] = HFTokenizer.from_file(os.path.join(tok_dir, "tokenizer.json"))
            log(f"[data] cached: {data['train_ids'].size(0)} training rows, {data['eval_ids'].size(0)} held-out rows")
            return data
    t0 = time.perf_counter()
    train = demo_data.generate(args.seed, args.corpus_size, "train")
    held = demo_data.generate(args.seed + 1, min(HELD_OUT_CONVERSATIONS, max(32, args.corpus_size // 10)), "held_out")
    tok = demo_tokenizer.train_tokenizer((demo_tokenizer.render(e.messages) for e in train[:TOKENIZER_SAMPLE]),
                                         vocab_size=args.vocab_size)
    demo_tokenizer.save_tokenizer(tok, tok_dir, model_max_length=args.max_position)
    pad_id = tok.token_to_id(demo_tokenizer.PAD)
    train_ids, train_mask = pack(demo_tokenizer.encode_conversations(tok, [e.messages for e in train]), args.seq_len, pad_id)
    eval_ids, eval_mask = pack(demo_tokenizer.encode_conversations(tok, [e.messages for e in held]), args.seq_len, pad_id)
    counts: dict = {}
    for e in train:
        counts[e.skill] = counts.get(e.skill, 0) + 1
    data = {"key": data_key, "train_ids": train_ids, "train_mask": train_mask, "eval_ids": eval_ids,
            "eval_mask": eval_mask, "skill_counts": counts}
    save_atomic(data, cache)
    data["tokenizer"] = tok
    log(f"[data] {len(train)} training conversations -> {train_ids.size(0)} rows of {args.seq_len + 1} tokens "
        f"({int(train_mask.sum())} assistant tokens), {len(held)} held-out -> {eval_ids.size(0)} rows, "
        f"vocab {tok.get_vocab_size()}, {time.perf_counter() - t0:.0f}s")
    return data


def prepare_init_data(args, ckpt_dir: str, log) -> dict:
    """For ``--init-from``: that model's tokenizer, and held-out rows (``--seq-len``) for the eval loss."""
    from tokenizers import Tokenizer as HFTokenizer

    path = os.path.join(args.init_from, "tokenizer.json")
    if not os.path.exists(path):
        raise SystemExit(f"error: --init-from {args.init_from!r} has no tokenizer.json")
    tok = HFTokenizer.from_file(path)
    held = demo_data.generate(args.seed + 1, min(HELD_OUT_CONVERSATIONS, max(32, args.corpus_size // 10)), "held_out")
    eval_ids, eval_mask = pack(demo_tokenizer.encode_conversations(tok, [e.messages for e in held]), args.seq_len,
                               tok.token_to_id(demo_tokenizer.PAD))
    log(f"[data] --init-from {args.init_from}: its tokenizer (vocab {tok.get_vocab_size()}), {eval_ids.size(0)} held-out rows")
    return {"tokenizer": tok, "eval_ids": eval_ids, "eval_mask": eval_mask, "skill_counts": {}}


def _base_training(folder: str) -> str:
    """The "Training" section of the model card of ``folder`` (what a --init-from run started from)."""
    try:
        with open(os.path.join(folder, "README.md"), encoding="utf-8") as f:
            card = f.read()
    except OSError:
        return f"(the model in {folder}; it has no model card)"
    a, b = card.find("## Training"), card.find("## Evaluation")
    return card[a + len("## Training"):b].strip() if 0 <= a < b else f"(the model in {folder})"


def prepare_long_data(args, tok, ckpt_dir: str, log) -> dict:
    """Rows of ``--long-seq-len`` tokens for the long-context stage: corpus conversations (a new seed),
    ``--long-share`` of them inside a harness context (:func:`demo_context.wrap`: system prompts, tools,
    reminders, system messages after the user's turn), plus held-out ones wrapped the same way for its
    eval loss. Cached in ``ckpt_dir/long_data.pt`` for the same flags and tokenizer."""
    key = {"seed": args.seed, "n": args.long_corpus_size, "seq_len": args.long_seq_len, "share": args.long_share,
           "vocab": tok.get_vocab_size(), "data_version": demo_data.DATA_VERSION,
           "harness_version": demo_context.HARNESS_VERSION}
    cache = os.path.join(ckpt_dir, "long_data.pt")
    if os.path.exists(cache):
        data = torch.load(cache, weights_only=True)
        if data.get("key") == key:
            log(f"[data] long-context rows cached: {data['ids'].size(0)} training, {data['eval_ids'].size(0)} held-out")
            return data
    t0 = time.perf_counter()
    pad_id = tok.token_to_id(demo_tokenizer.PAD)
    # harness text of up to ~1.6 characters per token of the row: the demo BPE reads such text at ~1.95
    # characters a token, so most wrapped conversations fit a row (pack drops the few, ~4 %, that do not)
    max_chars = int(args.long_seq_len * 1.6)

    def build(examples, seed):
        rng = random.Random(seed)
        convs, tools = [], []
        for e in examples:
            if rng.random() < args.long_share:
                m, t = demo_context.wrap(rng, e.messages, max_chars=max_chars)
            else:
                m, t = e.messages, None
            convs.append(m)
            tools.append(t)
        return pack(demo_tokenizer.encode_conversations(tok, convs, tools), args.long_seq_len, pad_id), len(convs)

    (ids, mask), n = build(demo_data.generate(args.seed + 2, args.long_corpus_size, "train"), args.seed + 3)
    (eval_ids, eval_mask), _ = build(demo_data.generate(args.seed + 4, 128, "held_out"), args.seed + 5)
    data = {"key": key, "ids": ids, "mask": mask, "eval_ids": eval_ids, "eval_mask": eval_mask}
    save_atomic(data, cache)
    log(f"[data] long-context stage: {n} conversations -> {ids.size(0)} rows of {args.long_seq_len + 1} tokens "
        f"({int(mask.sum())} assistant tokens), {eval_ids.size(0)} held-out rows, {time.perf_counter() - t0:.0f}s")
    return data


def load_export(model, folder: str) -> None:
    """Copy the weights of an exported model folder (read by :func:`dynamoe.models.load`) into ``model``,
    whose parameters must have the same names and shapes (its config may differ in context length and
    attention window)."""
    from ..models import load

    src = load(folder, dtype=torch.float32).state_dict()
    own = model.state_dict()
    bad = sorted(k for k in own if k not in src or src[k].shape != own[k].shape)
    if bad:
        raise SystemExit(f"error: --init-from {folder!r} does not match this model's parameters: {bad[:4]}")
    model.load_state_dict({k: src[k] for k in own})


# ------------------------------------------------------------------------------------ checkpoints
def _command(args, stats: dict) -> str:
    flags = {k: v for k, v in _run_key(args).items() if k != "data_version"}
    return card_command(flags, vars(build_parser().parse_args([])), stats.get("threads", torch.get_num_threads()))


def _run_key(args) -> dict:
    """What a checkpoint must agree with to be resumed: every flag that shapes the run, and the data
    version (a checkpoint trained on other replies must not continue on these)."""
    skip = {"out", "ckpt_dir", "ckpt_every", "eval_every", "fresh", "stop_after", "threads", "progress", "export",
            "samples", "export_partial"}
    key = {k: v for k, v in sorted(vars(args).items()) if k not in skip}
    return {**key, "data_version": demo_data.DATA_VERSION}


def save_checkpoint(path: str, model, optimizer, step: int, history: list, args) -> None:
    save_atomic({"model": model.state_dict(), "optimizer": optimizer.state_dict(), "step": step,
                  "torch_rng": torch.get_rng_state(), "python_rng": random.getstate(), "history": history,
                  "run": _run_key(args)}, path)


def load_checkpoint(path: str, model, optimizer, args) -> tuple[int, list]:
    state = torch.load(path, weights_only=True)
    if state.get("run") != _run_key(args):
        diff = sorted(k for k in set(state.get("run", {})) | set(_run_key(args))
                      if state.get("run", {}).get(k) != _run_key(args).get(k))
        raise SystemExit(f"error: checkpoint {path!r} was written with other flags or data ({', '.join(diff)}); "
                         f"pass the same flags to resume, --fresh to start over, or another --ckpt-dir")
    model.load_state_dict(state["model"])
    optimizer.load_state_dict(state["optimizer"])
    torch.set_rng_state(state["torch_rng"])
    random.setstate(state["python_rng"])
    return int(state["step"]), list(state["history"])


# ------------------------------------------------------------------------------------ loop
@torch.no_grad()
def eval_loss(model, ids: Tensor, mask: Tensor, batch_size: int, amp) -> float:
    was = model.training
    model.eval()
    total, n = 0.0, 0.0
    for i in range(0, ids.size(0), batch_size):
        rows, m = ids[i:i + batch_size], mask[i:i + batch_size]
        with amp():
            logits = model(rows[:, :-1])
        k = float(m[:, 1:].sum())
        total += float(lm_loss(logits, rows[:, 1:], m[:, 1:])) * k
        n += k
    model.train(was)
    return total / max(n, 1.0)


def _progress(total: int, initial: int, enabled: Optional[bool]):
    if enabled is None:
        enabled = sys.stderr.isatty()
    from tqdm import tqdm
    return tqdm(total=total, initial=initial, disable=not enabled, unit="step", dynamic_ncols=True, file=sys.stderr)


def sample_replies(model, tokenizer_dir: str, prompts: list[str], max_tokens: int = 160) -> list[str]:
    """Greedy replies through dynamoe's engine (for the end-of-training printout)."""
    from ..engine import GenerationEngine, Tokenizer

    tok = Tokenizer.from_dir(tokenizer_dir)
    was = model.training
    model.eval()
    try:
        engine = GenerationEngine(model, tok, max_seq_len=model.config.max_position_embeddings, max_batch=1)
        return [engine.generate([{"role": "user", "content": p}], max_tokens, temperature=0.0, clip_max_tokens=True)
                for p in prompts]
    finally:
        model.train(was)


def main(argv=None) -> dict:
    """Train (or resume), export; returns a summary dict (losses, paths, timings)."""
    argv = list(sys.argv[1:] if argv is None else argv)
    parser = build_parser()
    args = parser.parse_args(argv)
    _check_args(parser, args)
    if args.threads:
        torch.set_num_threads(args.threads)
    args.out = os.path.abspath(args.out)
    if args.ckpt_dir is None:  # the default export lies inside the package: keep the checkpoints out of it
        args.ckpt_dir = (os.path.join("runs", "demo-moe-train") if args.out == os.path.abspath(DEFAULT_OUT)
                         else args.out.rstrip(os.sep) + "-train")
    ckpt_dir = os.path.abspath(args.ckpt_dir)
    if os.path.commonpath([ckpt_dir, args.out]) == args.out:
        parser.error(f"argument --ckpt-dir: {ckpt_dir!r} is inside --out {args.out!r}; the export must hold only the model")
    os.makedirs(ckpt_dir, exist_ok=True)
    ckpt = os.path.join(ckpt_dir, "checkpoint.pt")

    def log(msg: str) -> None:
        print(msg, flush=True)

    torch.manual_seed(args.seed)
    random.seed(args.seed)
    data = prepare_init_data(args, ckpt_dir, log) if args.init_from else prepare_data(args, ckpt_dir, log)
    tok = data["tokenizer"]
    # the exported tokenizer config carries this run's chat template and context length
    demo_tokenizer.save_tokenizer(tok, os.path.join(ckpt_dir, "tokenizer"), model_max_length=args.max_position)
    long = prepare_long_data(args, tok, ckpt_dir, log) if args.long_steps else None
    pad_id, eos_id = tok.token_to_id(demo_tokenizer.PAD), tok.token_to_id(demo_tokenizer.IM_END)
    config = model_config(args, tok.get_vocab_size(), pad_id, eos_id)
    model = build_model(config)
    init_weights(model, args.seed)
    if args.init_from:
        load_export(model, args.init_from)
    enable_balance_loss(model, "switch")
    model.train()
    total_params, active_params = count_params(model)
    log(f"[model] qwen3_moe: {args.layers} layers, hidden {args.hidden}, {args.experts} experts top-{args.top_k} "
        f"(F={args.moe_intermediate}), vocab {config['vocab_size']}: {total_params / 1e6:.2f} M parameters, "
        f"{active_params / 1e6:.2f} M active per token; {torch.get_num_threads()} thread{'' if torch.get_num_threads() == 1 else 's'}, {args.dtype}")

    decay = [p for n, p in model.named_parameters() if p.dim() >= 2]
    no_decay = [p for n, p in model.named_parameters() if p.dim() < 2]
    optimizer = torch.optim.AdamW([{"params": decay, "weight_decay": args.weight_decay},
                                   {"params": no_decay, "weight_decay": 0.0}], lr=args.lr, betas=(0.9, 0.95), eps=1e-8)
    step, history = (args.steps if args.init_from else 0), []
    if os.path.exists(ckpt) and not args.fresh:
        step, history = load_checkpoint(ckpt, model, optimizer, args)
        log(f"[checkpoint] resumed from {ckpt} at step {step}")

    def amp():
        return torch.autocast("cpu", dtype=torch.bfloat16) if args.dtype == "bf16" else contextlib.nullcontext()

    total = args.steps + args.long_steps
    stop = min(total, args.stop_after) if args.stop_after else total
    bar = _progress(total, step, args.progress)
    t_start = time.perf_counter()
    steps_this_run, tokens_this_run = 0, 0
    last = {}

    def evaluate_now(last: dict) -> None:
        last["eval_loss"] = round(eval_loss(model, data["eval_ids"], data["eval_mask"], max(args.batch_size, 32), amp), 5)
        msg = f"[eval] step {step}: train loss {last['loss']:.4f}, held-out loss {last['eval_loss']:.4f}"
        if long is not None and step > args.steps:
            last["long_eval_loss"] = round(eval_loss(model, long["eval_ids"], long["eval_mask"], args.long_batch_size, amp), 5)
            msg += f", long-context held-out loss {last['long_eval_loss']:.4f}"
        bar.write(msg)

    try:
        while step < stop:
            if step < args.steps:
                x, y, m = batch_at(step, data["train_ids"], data["train_mask"], args.batch_size, args.seed)
            else:
                x, y, m = batch_at(step - args.steps, long["ids"], long["mask"], args.long_batch_size, args.seed)
            tokens_per_step = x.numel()
            lr = lr_at(step, args)
            for group in optimizer.param_groups:
                group["lr"] = lr
            t0 = time.perf_counter()
            with amp():
                logits = model(x)
                loss = lm_loss(logits, y, m)
                aux = moe_aux_loss(model)
            (loss + args.aux_loss_coef * aux).backward()
            grad_norm = torch.nn.utils.clip_grad_norm_(model.parameters(), args.grad_clip)
            optimizer.step()
            optimizer.zero_grad(set_to_none=True)
            step += 1
            steps_this_run += 1
            dt = time.perf_counter() - t0
            last = {"step": step, "loss": round(float(loss.detach()), 5), "aux": round(float(aux.detach()), 5), "lr": lr,
                    "grad_norm": round(float(grad_norm), 4), "step_s": round(dt, 4)}
            tokens_this_run += tokens_per_step
            if args.eval_every and (step % args.eval_every == 0 or step in (args.steps, total)):
                evaluate_now(last)
            history.append(last)
            bar.set_postfix(loss=f"{last['loss']:.3f}", aux=f"{last['aux']:.3f}", lr=f"{lr:.2e}",
                            tok_s=f"{tokens_per_step / dt:.0f}")
            bar.update(1)
            if step % args.ckpt_every == 0 or step == stop:
                save_checkpoint(ckpt, model, optimizer, step, history, args)
    finally:
        bar.close()
    wall = time.perf_counter() - t_start
    summary = {"step": step, "ckpt": ckpt, "history": history, "wall_s": wall, "steps_this_run": steps_this_run,
               "s_per_step": wall / max(steps_this_run, 1), "params": (total_params, active_params), "model": model,
               "config": config, "tokenizer_dir": os.path.join(ckpt_dir, "tokenizer")}
    if steps_this_run:
        log(f"[time] {steps_this_run} steps in {wall:.1f}s: {wall / steps_this_run:.3f} s/step, "
            f"{tokens_this_run / wall:.0f} tokens/s")
    if step < total:
        log(f"[stop] {step}/{total} steps done; run the same command again to resume")
        if not (args.export_partial and args.export):
            return summary
    if "eval_loss" not in last:
        evaluate_now(last)
    summary["eval_loss"] = last["eval_loss"]
    if args.export:
        train_losses = [h["loss"] for h in history[-50:]]
        wall_total = sum(h["step_s"] for h in history)
        stage1 = 0 if args.init_from else min(step, args.steps)
        long_done = max(0, step - args.steps)
        stats = {"skill_counts": data.get("skill_counts", {}), "vocab": tok.get_vocab_size(), "steps": stage1,
                 "of_steps": args.steps, "long_steps": long_done,
                 "tokens": stage1 * args.batch_size * args.seq_len, "train_loss": sum(train_losses) / len(train_losses),
                 "long_tokens": long_done * args.long_batch_size * args.long_seq_len,
                 "eval_loss": last["eval_loss"], "long_eval_loss": last.get("long_eval_loss"),
                 "threads": torch.get_num_threads(), "cpu": cpu_name(), "wall_min": wall_total / 60,
                 "base_training": _base_training(args.init_from) if args.init_from else None}
        card_args = argparse.Namespace(**vars(args))
        stats["export_mb"] = 0.0
        size = export_hf(model, config, summary["tokenizer_dir"], args.out,
                         model_card(card_args, config, (total_params, active_params), stats, _command(card_args, stats)))
        stats["export_mb"] = size / 2**20
        with open(os.path.join(args.out, "README.md"), "w", encoding="utf-8") as f:  # now with the size
            f.write(model_card(card_args, config, (total_params, active_params), stats, _command(card_args, stats)))
        log(f"[export] {args.out}: model.safetensors {size / 2**20:.1f} MB")
        if size > MAX_EXPORT_BYTES:
            log(f"[export] WARNING: the weights exceed the {MAX_EXPORT_BYTES / 2**20:.0f} MB the package may ship")
        summary["export_bytes"] = size
        if args.samples:
            prompts = ["What is 47 + 38?", "Sort [5, 3, 9, 1].", "Write a Python code of the Quicksort algorithm."]
            for p, r in zip(prompts, sample_replies(model, summary["tokenizer_dir"], prompts)):
                log(f"[sample] {p!r} -> {r!r}")
    return summary


if __name__ == "__main__":
    main()
