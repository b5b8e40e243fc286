"""Shared pieces of the examples: Tutel's flags (with Tutel's meaning), their validation, the model
wrapper, Tutel's data and seeds, the checkpoints (Tutel's ``--checkpoint_path`` alone: the model's
state dict, one file per rank through ``{rank}``/``{size}``; ``--save_load_checkpoint``: model and
optimizer, resumable) and the training/eval loop that prints Tutel's
``STEP-i: loss = ..., step_time = ..., perf = ...`` lines."""
from __future__ import annotations

import argparse
import contextlib
import math
import os
import pickle
import time
from typing import Callable, Iterable

import torch
import torch.nn.functional as F
from torch import Tensor, nn

from ..checkpoint.atomic import save_atomic
from ..moe import RoutingStats
from ..moe.config import parse_parallel_type

DTYPES = {"float32": torch.float32, "float64": torch.float64, "float16": torch.float16, "bfloat16": torch.bfloat16}
_SUMMARY_STEPS = 10  # Tutel averages the step time over the last 10 steps


def world() -> tuple[int, int]:
    """(rank, world size) of this example run: torchrun's environment, or (0, 1)."""
    from ..parallel import net
    return net.get_world_rank(), net.get_world_size()


def dist_print(*args, **kw) -> None:
    """print on rank 0 only (every rank runs the same loop)."""
    if world()[0] == 0:
        print(*args, **kw)


def _init_distributed(args) -> None:
    """Under torchrun (WORLD_SIZE > 1): join the process group; CUDA ranks use cuda:LOCAL_RANK."""
    if int(os.environ.get("WORLD_SIZE", "1")) <= 1:
        return
    from ..parallel import net
    if args.device.type == "cuda":
        args.device = torch.device("cuda", int(os.environ.get("LOCAL_RANK", "0")))
        torch.cuda.set_device(args.device)
    net.init_process_group("nccl" if args.device.type == "cuda" else "gloo")


def run_main(main: Callable[[], object]) -> None:
    """Entry point of a module run as a script: ``main()``, then, when it joined a process group
    (torchrun), a barrier and ``destroy_process_group``; a failing rank skips the barrier so it cannot
    hang on it. A rank that finished cleanly then leaves with ``os._exit(0)``: gloo's threads can abort
    the interpreter's own shutdown ("terminate called without an active exception", SIGABRT) now and
    then, after all the work and output are done -- seen on 2 ranks about once in a few dozen runs."""
    import sys

    import torch.distributed as dist
    ok = False
    try:
        main()
        ok = True
    finally:
        if dist.is_available() and dist.is_initialized():
            if ok:
                dist.barrier()
            dist.destroy_process_group()
            if ok:
                sys.stdout.flush()
                sys.stderr.flush()
                os._exit(0)


def _allreduce_degree(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value != -1 and value < 1:
        raise argparse.ArgumentTypeError(f"must be -1 (no gradient all-reduce) or an int >= 1, got {text!r}")
    return value


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be an int >= 1, got {value}")
    return value


def _nonzero_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value == 0:
        raise argparse.ArgumentTypeError(f"must be a non-zero int (-n: n ranks share each expert), got {text!r}")
    return value


def global_experts(num_local_experts: int, ranks: int) -> int:
    """E for --num_local_experts L on ``ranks`` ranks (L < 0: -L ranks share each expert)."""
    return num_local_experts * ranks if num_local_experts > 0 else ranks // -num_local_experts


def sharded_count(num_local_experts: int) -> int:
    return -num_local_experts if num_local_experts < 0 else 1


def _finite_float(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}") from None
    if not math.isfinite(value):
        raise argparse.ArgumentTypeError(f"must be a finite number, got {text!r}")
    return value


def build_parser(description: str, omit: Iterable[str] = (), **defaults) -> argparse.ArgumentParser:
    """Tutel's example flags (plus ``--seed``, ``--lr`` and ``--save_load_checkpoint``). ``omit`` drops
    flags an example does not use; ``defaults`` overrides default values (``checkpoint_path=`` names
    the file ``--save_load_checkpoint`` uses when ``--checkpoint_path`` is not given). The
    multi-process flags (``--local_rank``, ``--allreduce_degree``, ``--use_2dh``) are accepted so Tutel
    command lines run unchanged; on one process they have no effect."""
    omit = set(omit)
    defaults = dict(defaults)
    default_checkpoint = defaults.pop("checkpoint_path", "./dynamoe-helloworld.ckpt")
    p = argparse.ArgumentParser(description=description, formatter_class=argparse.ArgumentDefaultsHelpFormatter)

    def add(name, *aliases, **kw):
        if name not in omit:
            p.add_argument(f"--{name}", *aliases, **kw)

    add("local_rank", "--local-rank", type=int, default=-1,
        help="set by older distributed launchers; ignored (torchrun's LOCAL_RANK environment is used)")
    add("batch_size", type=_positive_int, default=16)
    add("num_tokens", type=_positive_int, default=512)
    add("model_dim", type=_positive_int, default=2048)
    add("hidden_size", type=_positive_int, default=2048)
    add("num_local_experts", type=_nonzero_int, default=2,
        help="experts per rank; -n: n ranks share each expert, split along its hidden dim")
    add("dtype", choices=list(DTYPES), default="float32")
    add("fp32_gate", action="store_true", help="compute the gate logits in fp32")
    add("top", type=_positive_int, default=2, help="experts per token (k)")
    add("l_aux_wt", type=_finite_float, default=0.0, help="weight of the balance loss")
    add("a2a_ffn_overlap_degree", type=_positive_int, default=1)
    add("allreduce_degree", type=_allreduce_degree, default=1,
        help="Tutel's: -1 leaves the replicated parameters' gradients un-averaged over the ranks; other "
             "values are accepted and average them (no effect on one process)")
    add("use_2dh", action="store_true",
        help="Tutel's 2D-hierarchical all-to-all (passed to moe_layer); no effect on one process")
    add("num_steps", type=_positive_int, default=100)
    add("parallel_type", default="adaptive:1", help="'data', 'model', 'auto' or 'adaptive:R' (R in 0..1 on one process)")
    add("device", default="cuda" if torch.cuda.is_available() else "cpu")
    add("eval", action="store_true", help="forward only, under torch.no_grad()")
    add("capacity_factor", "--cap_factor", type=_finite_float, default=1.0,
        help=">0 padded capacity, 0 dropless, <0 capped dropless")
    add("megablocks_size", type=int, default=None,
        help="0 forces the padded layout; >0 the ragged (dropless-style) one, with the capacity rounded up "
             "to a multiple of it (Tutel); unset lets the layer pick")
    add("expert_type", choices=["ffn", "glu", "llama_ffn"], default="ffn",
        help="ffn: fc1 -> relu -> fc2 (Tutel's); llama_ffn: relu(x W1) * (x W2) -> W3 (Tutel's, with its "
             "example's relu); glu: SwiGLU gate/up/down")
    add("use_tensorcore", action="store_true", help="allow TF32 matmuls on CUDA (Tutel's flag)")
    add("lr", type=_finite_float, default=1e-5, help="learning rate (default: Tutel's SGD one)")
    add("seed", type=int, default=0)
    add("save_load_checkpoint", action="store_true",
        help="load model+optimizer state from --checkpoint_path (default: " + default_checkpoint + ") at start "
             "if it exists; save it there at the end")
    add("checkpoint_path", default="",
        help="Tutel's: load the model's state dict from this file if it exists, save it there at the end; "
             "{rank} and {size} name one file per rank. With --save_load_checkpoint: model and optimizer")
    p.set_defaults(default_checkpoint=default_checkpoint, **defaults)
    return p


def parse_args(parser: argparse.ArgumentParser, argv=None) -> argparse.Namespace:
    """Parse and check the flags (a bad value exits through ``parser.error``, code 2, naming the flag),
    then seed torch with ``--seed``."""
    args = parser.parse_args(argv)
    err = parser.error
    ranks = max(1, int(os.environ.get("WORLD_SIZE", "1")))
    if hasattr(args, "num_local_experts") and args.num_local_experts < 0:
        n = -args.num_local_experts
        if ranks % n:
            err(f"argument --num_local_experts: {n} ranks sharing each expert needs a world size divisible by {n}, got {ranks}")
        if hasattr(args, "hidden_size") and args.hidden_size % n:
            err(f"argument --hidden_size: must be divisible by the {n} ranks sharing each expert, got {args.hidden_size}")
    # --top above the number of experts is Tutel's too: moe_layer then routes to all of them (one warning)
    if getattr(args, "megablocks_size", None) is not None and args.megablocks_size < 0:
        err(f"argument --megablocks_size: must be >= 0, got {args.megablocks_size}")
    if hasattr(args, "parallel_type"):
        try:
            r = parse_parallel_type(args.parallel_type, sharded_count(args.num_local_experts))
        except ValueError as e:
            err(f"argument --parallel_type: {e}")
        n = sharded_count(getattr(args, "num_local_experts", 1))
        if r > 1 and n % r:
            err(f"argument --parallel_type: the adaptive degree must be 0 or a divisor of the ranks sharing each expert "
                f"({n}), got {args.parallel_type!r}")
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
    if getattr(args, "save_load_checkpoint", False) and not args.checkpoint_path:
        args.checkpoint_path = args.default_checkpoint
    if getattr(args, "save_load_checkpoint", False):  # (Tutel's --checkpoint_path alone creates its folder)
        folder = os.path.dirname(os.path.abspath(args.checkpoint_path))
        if not os.path.isdir(folder):
            err(f"argument --checkpoint_path: folder {folder!r} does not exist")
        if os.path.isdir(args.checkpoint_path):
            err(f"argument --checkpoint_path: {args.checkpoint_path!r} is a folder, not a file")
    if hasattr(args, "device"):
        _init_distributed(args)
    if getattr(args, "use_tensorcore", False):
        torch.backends.cuda.matmul.allow_tf32 = True
    rank, size = world()
    if getattr(args, "checkpoint_path", ""):
        from ..system import apply_rank_size_from_pattern
        if "{rank}" in args.checkpoint_path or not getattr(args, "save_load_checkpoint", False):
            # Tutel's pattern (without {rank} every rank uses the same file, as in Tutel -- with a warning)
            args.checkpoint_path = apply_rank_size_from_pattern(args.checkpoint_path, rank, size)
        elif size > 1:
            # experts and optimizer shards differ per rank: one file each (dynamoe.checkpoint.gather joins them)
            args.checkpoint_path = f"{args.checkpoint_path}.rank{rank}-of-{size}"
    torch.manual_seed(args.seed)  # everything not seeded explicitly (layer init has its own seeds)
    return args


def layer_seeds(args) -> tuple[int, int, int]:
    """Tutel's example seeds ``(1, rank + 1, 1)`` for ``--seed 0``: gates, this rank's experts, after."""
    return args.seed + 1, args.seed + world()[0] + 1, args.seed + 1


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
    dist_print(f"[Statistics] param count for MoE local_experts = {local}, param count for MoE gate = {gate}.")


def make_data(args, dtype: torch.dtype) -> tuple[Tensor, Tensor]:
    """Tutel's data: after ``torch.manual_seed(--seed)``, x ~ N(0, 1) [batch, tokens, model_dim] drawn
    in float32 on the CPU (the same batch on every rank, as Tutel's examples do) and target class 0
    for every sample."""
    torch.manual_seed(args.seed)
    x = torch.randn(args.batch_size, args.num_tokens, args.model_dim, dtype=torch.float32).to(device=args.device, dtype=dtype)
    target = torch.zeros(args.batch_size, dtype=torch.long, device=args.device)
    return x, target


def moe_forward_flops(stats: RoutingStats, model_dim: int, expert_flops_per_row: int) -> int:
    """Matmul FLOPs of one MoE forward: the gate (2*T*D*E) plus the experts on the rows they kept
    (dropped assignments cost nothing; padding rows are not useful work and are not counted)."""
    gate = 2 * stats.num_tokens * model_dim * stats.load.numel()
    return gate + int(stats.kept.sum()) * expert_flops_per_row


def ffn_flops_per_row(model_dim: int, hidden_size: int, expert_type: str = "ffn") -> int:
    """2*D*F per [D, F] matmul: FFN has two (fc1, fc2), GLU and llama_ffn three (gate, up, down)."""
    return 2 * model_dim * hidden_size * (3 if expert_type in ("glu", "llama_ffn") else 2)


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def format_stats(s: RoutingStats) -> str:
    return (f"top_k = {s.top_k}, capacity_factor = {s.capacity_factor}, layout = {s.layout}, "
            f"capacity = {s.capacity}, dropped = {s.dropped}, load = {s.load.tolist()}")


def load_checkpoint(path: str, model: nn.Module, optimizer, scaler=None) -> int:
    """Restore what :func:`save_checkpoint` wrote, if ``path`` exists; returns the training steps it
    had taken (0 when there is no file). A file that does not fit the model exits with a message."""
    if not os.path.exists(path):
        dist_print(f"[Checkpoint] `{path}` not found: starting from fresh weights.")
        return 0
    try:
        state = torch.load(path, map_location=next(model.parameters()).device, weights_only=True)
        model.load_state_dict(state["model"])
        optimizer.load_state_dict(state["optimizer"])
        if scaler is not None and state.get("scaler"):
            scaler.load_state_dict(state["scaler"])
    except (RuntimeError, KeyError, TypeError, ValueError, EOFError, pickle.UnpicklingError) as e:
        raise SystemExit(f"error: checkpoint `{path}` does not fit this model (saved by another example or with "
                         f"other sizes?); delete it or pass another --checkpoint_path.\n{type(e).__name__}: {e}") from e
    steps = int(state.get("steps", 0))
    dist_print(f"[Checkpoint] loaded model and optimizer state from `{path}` ({steps} training steps so far).")
    return steps


def save_checkpoint(path: str, model: nn.Module, optimizer, scaler=None, steps: int = 0) -> None:
    """Write model + optimizer (+ GradScaler) state atomically: into a temporary file in the same
    folder, then ``os.replace`` -- a crash mid-write never leaves a truncated checkpoint at ``path``."""
    state = {"model": model.state_dict(), "optimizer": optimizer.state_dict(),
             "scaler": scaler.state_dict() if scaler is not None else None, "steps": steps}
    save_atomic(state, path)
    dist_print(f"[Checkpoint] saved model and optimizer state to `{path}` ({steps} training steps).")


def load_model_state(path: str, model: nn.Module) -> None:
    """Tutel's ``--checkpoint_path``: load the model's state dict if the file exists (one written by
    Tutel's example loads too), else say so."""
    if not os.path.exists(path):
        print(f"Checkpoint not loaded: file `{path}` is not found. Will train the model from start.")
        return
    try:
        model.load_state_dict(torch.load(path, map_location=next(model.parameters()).device, weights_only=True))
    except (RuntimeError, KeyError, TypeError, ValueError, EOFError, pickle.UnpicklingError) as e:
        raise SystemExit(f"error: checkpoint `{path}` does not fit this model (saved with other sizes or ranks?); "
                         f"delete it or pass another --checkpoint_path.\n{type(e).__name__}: {e}") from e
    dist_print(f"[Checkpoint] loaded the model state from `{path}`.")


def _average_gradients(model: nn.Module) -> None:
    """Tutel's data-parallel step: average the gradients of every parameter not tagged
    ``skip_allreduce`` (the experts, whose gradients the all-to-all already summed over ranks)."""
    rank, size = world()
    if size == 1:
        return
    from ..parallel import net
    for p in model.parameters():
        if p.grad is not None and not getattr(p, "skip_allreduce", False):
            p.grad /= size
            p.grad = net.simple_all_reduce(p.grad)


def _unwrap(model: nn.Module) -> nn.Module:
    """The model under a DistributedDataParallel wrapper (which does not forward plain attributes
    such as ``l_aux`` and ``routing_stats``), or the model itself."""
    return model.module if isinstance(model, nn.parallel.DistributedDataParallel) else model


def run_loop(args, model: nn.Module, x: Tensor, target: Tensor, flops_fn: Callable[[RoutingStats], int],
             switches: Callable[[int], dict] | dict | None = None, autocast_dtype: torch.dtype | None = None,
             after_step: Callable[[int, dict, RoutingStats], None] | None = None,
             make_optimizer: Callable[[Iterable[nn.Parameter]], object] | None = None,
             average_gradients: bool = True) -> list[float]:
    """Tutel's loop: SGD on nll_loss (+ l_aux_wt * l_aux), or forward only with ``--eval``. With
    ``--save_load_checkpoint`` the model and optimizer start from ``--checkpoint_path`` (if the file
    exists) and are saved there at the end.

    ``model(x, **switches)`` returns log-probs [batch, tokens] and leaves ``model.l_aux`` and
    ``model.routing_stats`` (``model`` may be wrapped in DistributedDataParallel); ``switches`` is a
    dict or a function of the step index. Returns the losses.

    ``make_optimizer(params)`` builds the optimizer from ``model.parameters()`` (default:
    ``torch.optim.SGD(params, lr=args.lr)``). ``average_gradients``: after backward, average the
    gradients of the parameters not tagged ``skip_allreduce`` over the ranks (Tutel's manual step);
    pass False when something else already does it (DistributedDataParallel, ZeroOptimizer).
    """
    device = x.device
    inner = _unwrap(model)
    optimizer = (make_optimizer or (lambda params: torch.optim.SGD(params, lr=args.lr)))(model.parameters())
    scaler = torch.amp.GradScaler(device.type) if autocast_dtype == torch.float16 and not args.eval else None
    checkpoint = getattr(args, "save_load_checkpoint", False)
    model_only = bool(getattr(args, "checkpoint_path", "")) and not checkpoint  # Tutel's --checkpoint_path
    if model_only:
        load_model_state(args.checkpoint_path, _unwrap(model))
    steps_before = load_checkpoint(args.checkpoint_path, model, optimizer, scaler) if checkpoint else 0
    # Tutel: --allreduce_degree -1 leaves the replicated parameters' gradients alone
    average_gradients = average_gradients and getattr(args, "allreduce_degree", 1) != -1
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
                    loss = loss + args.l_aux_wt * inner.l_aux
            if scaler is not None:
                scaler.scale(loss).backward()
                if average_gradients:  # averaging commutes with the loss scale
                    _average_gradients(model)
                scaler.step(optimizer)
                scaler.update()
            else:
                loss.backward()
                if average_gradients:
                    _average_gradients(model)
                optimizer.step()
        _sync(device)
        dt = time.perf_counter() - t0
        stats = inner.routing_stats
        flops = flops_fn(stats) * (1 if args.eval else 3)  # backward = 2x forward
        losses.append(float(loss.detach()))
        times.append(dt)
        dist_print(f"STEP-{i}: loss = {losses[-1]:.5f}, step_time = {dt:.6f} sec, perf = {flops / max(dt, 1e-9) * 1e-12:.2f} tflops.")
        if after_step is not None:
            after_step(i, kw, stats)
    last = times[-_SUMMARY_STEPS:]
    dist_print(f"\n[Summary] Average step_time over the last {len(last)} step(s) = {sum(last) / len(last):.6f} sec.")
    dist_print(f"[Routing] last step: {format_stats(inner.routing_stats)}")
    if checkpoint:
        save_checkpoint(args.checkpoint_path, model, optimizer, scaler, steps_before + (0 if args.eval else args.num_steps))
    elif model_only:
        save_atomic(_unwrap(model).state_dict(), args.checkpoint_path)
        dist_print(f"[Checkpoint] saved the model state to `{args.checkpoint_path}`.")
    return losses
