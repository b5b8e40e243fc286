"""Shared pieces of the examples: Tutel's flags, their validation, the model wrapper and the
training/eval loop that prints Tutel's ``STEP-i: loss = ..., step_time = ..., perf = ...`` lines."""
from __future__ import annotations

import argparse
import contextlib
import math
import time
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..moe.config import parse_parallel_type
from ..moe.dispatch import RoutingStats

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}
_SUMMARY_STEPS = 10  # Tutel averages the step time over the last 10 steps


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {value}")
    return value


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def build_parser(description: str, omit: Iterable[str] = (), **defaults) -> argparse.ArgumentParser:
    """Tutel's example flags (plus ``--seed`` and ``--lr``). ``omit`` drops flags an example does not
    use; ``defaults`` overrides default values."""
    omit = set(omit)
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)

    def add(name, *aliases, **kw):
        if name not in omit:
            p.add_argument(f"--{name}", *aliases, **kw)

    add("batch_size", type=_positive_int, default=16)
    add("num_tokens", type=_positive_int, default=512)
    add("model_dim", type=_positive_int, default=2048)
    add("hidden_size", type=_positive_int, default=2048)
    add("num_local_experts", type=_positive_int, default=2)
    add("dtype", choices=list(DTYPES), default="float32")
    add("fp32_gate", action="store_true", help="compute the gate logits in fp32")
    add("top", type=_positive_int, default=2, help="experts per token (k)")
    add("l_aux_wt", type=_finite_float, default=0.0, help="weight of the balance loss")
    add("a2a_ffn_overlap_degree", type=_positive_int, default=1)
    add("num_steps", type=_positive_int, default=100)
    add("parallel_type", default="adaptive:1", help="'data', 'model', 'auto' or 'adaptive:R' (R in 0..1 on one process)")
    add("device", default="cuda" if torch.cuda.is_available() else "cpu")
    add("eval", action="store_true", help="forward only, under torch.no_grad()")
    add("capacity_factor", "--cap_factor", type=_finite_float, default=1.0,
        help=">0 padded capacity, 0 dropless, <0 capped dropless")
    add("megablocks_size", type=int, default=None,
        help="0 forces the padded layout, >0 the ragged (dropless-style) one; unset lets the layer pick")
    add("expert_type", choices=["ffn", "glu"], default="ffn")
    add("lr", type=_finite_float, default=1e-5, help="SGD learning rate (Tutel's default)")
    add("seed", type=int, default=0)
    p.set_defaults(**defaults)
    return p


def parse_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Parse and check the flags (a bad value exits through ``parser.error``, code 2, naming the flag),
    then seed torch with ``--seed``."""
    args = parser.parse_args(argv)
    err = parser.error
    if hasattr(args, "top") and hasattr(args, "num_local_experts") and args.top > args.num_local_experts:
        err(f"argument --top: must be <= --num_local_experts ({args.num_local_experts}), got {args.top}")
    if getattr(args, "megablocks_size", None) is not None and args.megablocks_size < 0:
        err(f"argument --megablocks_size: must be >= 0, got {args.megablocks_size}")
    if hasattr(args, "parallel_type"):
        try:
            r = parse_parallel_type(args.parallel_type)
        except ValueError as e:
            err(f"argument --parallel_type: {e}")
        if r > 1:
            err(f"argument --parallel_type: adaptive degree must be 0 or 1 on a single process, got {args.parallel_type!r}")
    if hasattr(args, "device"):
        try:
            device = torch.device(args.device)
        except (RuntimeError, ValueError):
            err(f"argument --device: not a torch device: {args.device!r}")
        if device.type == "cuda":
            if not torch.cuda.is_available():
                err("argument --device: CUDA is not available on this machine; use --device cpu")
            if device.index is not None and device.index >= torch.cuda.device_count():
                err(f"argument --device: {args.device!r} but only {torch.cuda.device_count()} CUDA device(s) exist")
        args.device = device
    torch.manual_seed(args.seed)  # everything not seeded explicitly (layer init has its own seeds)
    return args


class ExampleModel(nn.Module):
    """Tutel's example model: ``log_softmax(sum(moe(x), dim=2), dim=1)``, i.e. a token classifier
    over the summed MoE output. Keeps the last call's ``l_aux`` and ``routing_stats``."""

    def __init__(self, moe: nn.Module):
        super().__init__()
        self._moe_layer = moe
        self.l_aux: Tensor | None = None
        self.routing_stats: RoutingStats | None = None

    def forward(self, x: Tensor, **switches) -> Tensor:
        y = self._moe_layer(x, **switches)
        self.l_aux, self.routing_stats = y.l_aux, y.routing_stats
        return F.log_softmax(torch.sum(y, dim=2), dim=1)


def print_param_counts(moe) -> None:
    local = sum(p.numel() for _, p in moe.get_parameter_iterator("local_experts"))
    gate = sum(p.numel() for _, p in moe.get_parameter_iterator("gate"))
    print(f"[Statistics] param count for MoE local_experts = {local}, param count for MoE gate = {gate}.")


def make_data(args, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Tutel's data: x ~ N(0, 1) [batch, tokens, model_dim] and target class 0 for every sample."""
    g = torch.Generator().manual_seed(args.seed)
    x = torch.randn(args.batch_size, args.num_tokens, args.model_dim, generator=g).to(device=args.device, dtype=dtype)
    target = torch.zeros(args.batch_size, dtype=torch.long, device=args.device)
    return x, target


def moe_forward_flops(stats: RoutingStats, model_dim: int, expert_flops_per_row: int) -> int:
    """Matmul FLOPs of one MoE forward: the gate (2*T*D*E) plus the experts on the rows they kept
    (dropped assignments cost nothing; padding rows are not useful work and are not counted)."""
    gate = 2 * stats.num_tokens * model_dim * stats.load.numel()
    return gate + int(stats.kept.sum()) * expert_flops_per_row


def ffn_flops_per_row(model_dim: int, hidden_size: int, expert_type: str = "ffn") -> int:
    """2*D*F per [D, F] matmul: FFN has two (fc1, fc2), GLU three (gate, up, down)."""
    return 2 * model_dim * hidden_size * (3 if expert_type == "glu" else 2)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def format_stats(s: RoutingStats) -> str:
    return (f"top_k = {s.top_k}, capacity_factor = {s.capacity_factor}, layout = {s.layout}, "
            f"capacity = {s.capacity}, dropped = {s.dropped}, load = {s.load.tolist()}")


def run_loop(args, model: nn.Module, x: Tensor, target: Tensor, flops_fn: Callable[[RoutingStats], int],
             switches: Callable[[int], dict] | dict | None = None, autocast_dtype: torch.dtype | None = None,
             after_step: Callable[[int, dict, RoutingStats], None] | None = None) -> list[float]:
    """Tutel's loop: SGD on nll_loss (+ l_aux_wt * l_aux), or forward only with ``--eval``.

    ``model(x, **switches)`` returns log-probs [batch, tokens] and leaves ``model.l_aux`` and
    ``model.routing_stats``; ``switches`` is a dict or a function of the step index. Returns the losses.
    """
    device = x.device
    optimizer = torch.optim.SGD(model.parameters(), lr=args.lr)
    scaler = torch.amp.GradScaler(device.type) if autocast_dtype == torch.float16 and not args.eval else None
    model.train(not args.eval)
    losses, times = [], []
    for i in range(args.num_steps):
        kw = switches(i) if callable(switches) else dict(switches or {})
        amp = torch.autocast(device.type, dtype=autocast_dtype) if autocast_dtype else contextlib.nullcontext()
        _sync(device)
        t0 = time.perf_counter()
        if args.eval:
            with torch.no_grad(), amp:
                loss = F.nll_loss(model(x, **kw).float(), target)
        else:
            optimizer.zero_grad(set_to_none=True)
            with amp:
                loss = F.nll_loss(model(x, **kw).float(), target)
                if args.l_aux_wt:
                    loss = loss + args.l_aux_wt * model.l_aux
            if scaler is not None:
                scaler.scale(loss).backward()
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                optimizer.step()
        _sync(device)
        dt = time.perf_counter() - t0
        stats = model.routing_stats
        flops = flops_fn(stats) * (1 if args.eval else 3)  # backward = 2x forward
        losses.append(float(loss.detach()))
        times.append(dt)
        print(f"STEP-{i}: loss = {losses[-1]:.5f}, step_time = {dt:.6f} sec, perf = {flops / max(dt, 1e-9) * 1e-12:.3f} tflops.")
        if after_step is not None:
            after_step(i, kw, stats)
    last = times[-_SUMMARY_STEPS:]
    print(f"\n[Summary] Average step_time over the last {len(last)} step(s) = {sum(last) / len(last):.6f} sec.")
    print(f"[Routing] last step: {format_stats(model.routing_stats)}")
    return losses
