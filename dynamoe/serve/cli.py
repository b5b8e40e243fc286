"""``dynamoe serve``: flags, model choice, and the uvicorn run.

The model path comes only from the command line: ``--model DIR``, else the first existing of the
``--try_path DIR`` flags (repeatable), else the embedded demo model (``dynamoe/assets/demo-moe/``) when
this build has it. FastAPI and the model code are imported only when the command runs.

Multi-rank (expert parallel) serving: under torchrun (``WORLD_SIZE`` > 1, ``RANK``, ``LOCAL_RANK``; or
``LOCAL_SIZE`` ranks per node, the launcher's name, when ``LOCAL_RANK`` is missing) every rank joins the
process group (NCCL on ``cuda:LOCAL_RANK``, else gloo on CPU) and loads 1/WORLD_SIZE of the routed
experts with everything else replicated; rank 0 serves HTTP, the other ranks bind no port and repeat
rank 0's forwards (:mod:`dynamoe.engine.distributed`). ``torchrun --standalone --nproc_per_node 2 -m
dynamoe.cli serve --model DIR``. Stopping rank 0 (Ctrl-C, SIGTERM to the torchrun job) stops them all.
"""
from __future__ import annotations

import argparse
import ipaddress
import os
import sys

__all__ = ["add_serve_parser", "serve_command", "resolve_model_path", "rank_environment", "build_engine", "server_config", "announce",
           "DEMO_MODEL_DIR"]

DEMO_MODEL_DIR = os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))), "assets", "demo-moe")


def _size(text: str) -> int:
    """'4GiB', '512MiB', '2G', '1.5GB', '1000000' -> bytes (K/M/G/T: powers of 1024 with or without 'iB')."""
    t = text.strip().lower().removesuffix("b").removesuffix("i")
    scale = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40}.get(t[-1:], 1)
    try:
        v = float(t[:-1] if scale > 1 else t)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a size such as 4GiB, 512MiB or a number of bytes, got {text!r}") from None
    if not v > 0:
        raise argparse.ArgumentTypeError(f"must be > 0, got {text!r}")
    return int(v * scale)


def _fraction(text: str) -> float:
    try:
        v = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number in (0, 1], got {text!r}") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1], got {text!r}")
    return v


def _nonnegative_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 0:
        raise argparse.ArgumentTypeError(f"must be >= 0, got {text!r}")
    return v


def _positive_int(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
    if v < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {text!r}")
    return v


def _port(text: str) -> int:
    try:
        v = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a port number, got {text!r}") from None
    if not 0 < v < 65536:
        raise argparse.ArgumentTypeError(f"must be in [1, 65535], got {text!r}")
    return v


def add_serve_parser(sub) -> argparse.ArgumentParser:
    from ..engine.engine import GenerationEngine
    from ..models.cache import DEFAULT_BLOCK_SIZE

    s = sub.add_parser("serve", help="serve a model over HTTP: /chat, OpenAI and Anthropic APIs, web UI, metrics",
                       description="Serve a Hugging Face checkpoint folder over HTTP with continuous batching: "
                                   "POST /chat (plain-text stream), OpenAI /v1/chat/completions, /v1/completions, "
                                   "/v1/models, Anthropic /v1/messages, /health, /metrics (Prometheus) and a web "
                                   "UI at /. Under torchrun (WORLD_SIZE > 1) the routed experts are split over "
                                   "the ranks (expert parallel): rank 0 serves HTTP, every rank runs the model, "
                                   "e.g. torchrun --standalone --nproc_per_node 2 -m dynamoe.cli serve --model DIR.")
    s.add_argument("--model", metavar="DIR", help="checkpoint folder (config.json, weights, tokenizer.json)")
    s.add_argument("--try_path", "--try-path", action="append", default=[], metavar="DIR",
                   help="candidate checkpoint folder; repeatable, the first that exists is served")
    s.add_argument("--served-model-name", "--served_model_name", metavar="NAME",
                   help="the model name clients use (default: the folder's name)")
    s.add_argument("--host", default="127.0.0.1", help="address to bind (default 127.0.0.1: this machine only)")
    s.add_argument("--listen_port", "--port", "--listen-port", dest="listen_port", type=_port, default=8000,
                   metavar="N", help="TCP port (default 8000)")
    s.add_argument("--max_seq_len", "--max-model-len", "--max-seq-len", dest="max_seq_len", type=_positive_int,
                   metavar="N", help="prompt + output tokens per sequence (default: the model's context, "
                                     "max_position_embeddings)")
    s.add_argument("--kv-cache-memory", "--kv_cache_memory", dest="kv_cache_memory", type=_size, metavar="SIZE",
                   help="memory of the paged KV cache, e.g. 4GiB, 512MiB or bytes (default: --kv-cache-fraction of "
                        "the RAM, or of the GPU's memory; never more than every sequence at max_seq_len needs)")
    s.add_argument("--kv-cache-fraction", "--kv_cache_fraction", dest="kv_cache_fraction", type=_fraction,
                   default=KV_CACHE_SHARE, metavar="F",
                   help=f"share of the memory for the KV cache when --kv-cache-memory is not given (default {KV_CACHE_SHARE})")
    s.add_argument("--block-size", "--block_size", dest="block_size", type=_positive_int, default=DEFAULT_BLOCK_SIZE,
                   metavar="N", help=f"positions per KV cache block (default {DEFAULT_BLOCK_SIZE})")
    s.add_argument("--max-num-batched-tokens", "--max_num_batched_tokens", "--token-budget", dest="token_budget",
                   type=_positive_int, default=None, metavar="N",
                   help="tokens per engine step while requests decode: their rows plus prefill chunks of new prompts "
                        "(default: as many as take about "
                        f"{GenerationEngine.stall_ratio:g} decode steps at the measured speeds, at most "
                        f"{GenerationEngine.default_token_budget}: a long prompt does not stall running streams)")
    s.add_argument("--serve", choices=["core", "webui"], default="webui",
                   help="core: the APIs only; webui: the APIs and the chat page at / (default)")
    s.add_argument("--thinking_effort", "--thinking-effort", choices=["low", "medium", "high"], default=None,
                   help="default reasoning effort, passed to chat templates as reasoning_effort (gpt-oss); "
                        "requests may override it")
    s.add_argument("--num-speculative-tokens", "--num_speculative_tokens", dest="speculative_tokens",
                   type=_nonnegative_int, default=0, metavar="K",
                   help="speculative decoding: up to K draft tokens per greedy request and step (from "
                        "--speculative-draft), verified in one forward; the same output as without (default 0: off)")
    s.add_argument("--speculative-draft", "--speculative_draft", dest="speculative_draft", choices=["ngram", "mtp"],
                   default="ngram",
                   help="where drafts come from: ngram (prompt lookup in the request's context, default) or mtp (the "
                        "model's multi-token-prediction head: DeepSeek-V3/R1, Kimi-K2, GLM-4.5+, Qwen3-Next / "
                        "Qwen3.5, MiMo-V2-Flash, K-EXAONE, MiniMax-M3 checkpoints that ship MTP layers)")
    s.add_argument("--prefix-caching", "--prefix_caching", dest="prefix_caching", action=argparse.BooleanOptionalAction,
                   default=True, help="share the KV cache blocks of equal prompt prefixes across requests, running ones "
                                      "included (a chat's next turn, a common system prompt)")
    s.add_argument("--max-num-seqs", "--max_num_seqs", dest="max_num_seqs", type=_positive_int, default=8,
                   metavar="N", help="sequences decoded together (batch slots); more requests wait (default 8)")
    s.add_argument("--api-key", "--api_key", dest="api_key", metavar="KEY",
                   help="require this key (Authorization: Bearer KEY or x-api-key: KEY) on every route but "
                        "/health; default: $DYNAMOE_API_KEY, else none")
    s.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="weight dtype (default: the loader's)")
    s.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu; under "
                                                  "torchrun cuda means cuda:LOCAL_RANK)")
    s.add_argument("--chat-template", "--chat_template", dest="chat_template", metavar="FILE",
                   help="chat template file (.jinja, or JSON with chat_template) instead of the checkpoint's")
    s.add_argument("--max-request-bytes", dest="max_request_bytes", type=_positive_int, default=32 * 2**20,
                   metavar="N", help="largest request body accepted (default 32 MiB); larger gets 413")
    s.add_argument("--log-level", dest="log_level", default="info",
                   choices=["critical", "error", "warning", "info", "debug"], help="uvicorn log level")
    return s


def resolve_model_path(model: str | None, try_paths: list[str], demo_dir: str | None = None) -> str:
    """The folder to serve (see the module docstring); ValueError with what to do when there is none."""
    demo_dir = DEMO_MODEL_DIR if demo_dir is None else demo_dir
    if model is not None:
        if not os.path.isdir(model):
            raise ValueError(f"--model {model!r} is not a directory")
        return model
    for path in try_paths:
        if os.path.isdir(path):
            return path
    if try_paths:
        raise ValueError(f"none of the --try_path folders exists: {', '.join(repr(p) for p in try_paths)}")
    if os.path.isdir(demo_dir):
        return demo_dir
    raise ValueError("no model to serve: pass --model DIR (a Hugging Face checkpoint folder with config.json and "
                     "tokenizer.json); this build has no embedded demo model (dynamoe/assets/demo-moe/)")


def _is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def _env_int(env, name: str) -> int | None:
    raw = env.get(name, "")
    if raw == "":
        return None
    try:
        return int(raw)
    except ValueError:
        raise ValueError(f"environment variable {name} must be an integer, got {raw!r}") from None


def rank_environment(env=None) -> tuple[int, int, int, int] | None:
    """``(rank, world_size, local_rank, local_size)`` from torchrun's (or dynamoe.launcher.run's)
    environment, or None for one process (``WORLD_SIZE`` unset or 1). ``LOCAL_SIZE`` (else
    ``LOCAL_WORLD_SIZE``) is the ranks per node; without ``LOCAL_RANK`` the local rank is
    ``RANK % LOCAL_SIZE``. ValueError naming the variable when something does not fit."""
    env = os.environ if env is None else env
    world = _env_int(env, "WORLD_SIZE")
    if world is None or world == 1:
        return None
    rank = _env_int(env, "RANK")
    if world < 1:
        raise ValueError(f"WORLD_SIZE must be >= 1, got {world}")
    if rank is None:
        raise ValueError(f"WORLD_SIZE={world} but RANK is not set: start the ranks with torchrun")
    if not 0 <= rank < world:
        raise ValueError(f"RANK must be in [0, {world}) for WORLD_SIZE={world}, got {rank}")
    local_size = _env_int(env, "LOCAL_SIZE") or _env_int(env, "LOCAL_WORLD_SIZE") or world
    if not 1 <= local_size <= world:
        raise ValueError(f"LOCAL_SIZE (ranks per node) must be in [1, {world}], got {local_size}")
    local_rank = _env_int(env, "LOCAL_RANK")
    local_rank = rank % local_size if local_rank is None else local_rank
    if not 0 <= local_rank < local_size:
        raise ValueError(f"LOCAL_RANK must be in [0, {local_size}) (LOCAL_SIZE ranks per node), got {local_rank}")
    return rank, world, local_rank, local_size


def serve_command(args, err=None) -> int:
    """Run ``dynamoe serve`` with parsed ``args`` until interrupted; returns the exit status. Under
    torchrun (WORLD_SIZE > 1) every rank runs it: see the module docstring."""
    err = err or sys.stderr
    try:
        ranks = rank_environment()
    except ValueError as e:
        print(f"dynamoe serve: error: {e}", file=err)
        return 2
    try:
        path = resolve_model_path(args.model, args.try_path)
    except ValueError as e:
        print(f"dynamoe serve: error: {e}", file=err)
        return 2
    for name in ("config.json", "tokenizer.json"):
        if not os.path.isfile(os.path.join(path, name)):
            print(f"dynamoe serve: error: {path!r} has no {name}", file=err)
            return 2
    if args.chat_template is not None and not os.path.isfile(args.chat_template):
        print(f"dynamoe serve: error: --chat-template {args.chat_template!r} is not a file", file=err)
        return 2
    api_key = args.api_key or os.environ.get("DYNAMOE_API_KEY") or None
    if ranks is not None:
        from .multirank import serve_ranks
        return serve_ranks(args, path, api_key, ranks, err)

    import torch
    import uvicorn

    from ..engine import load
    from .app import create_app

    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    try:
        model, tokenizer = load(path, dtype=args.dtype, device=device, chat_template=args.chat_template)
        engine, max_seq_len = build_engine(args, model, tokenizer, err)
    except (ValueError, OSError) as e:
        print(f"dynamoe serve: error: {e}", file=err)
        return 1
    config = server_config(args, path, api_key, max_seq_len)
    app = create_app(engine, tokenizer, config)
    freeze_startup_heap()
    announce(args, config, f"{sum(p.numel() for p in model.parameters()) / 1e6:.1f}M parameters, {device}", path, err)
    uvicorn.run(app, host=args.host, port=args.listen_port, log_level=args.log_level, timeout_graceful_shutdown=5)
    return 0


def freeze_startup_heap() -> None:
    """Move everything built so far (the model, the tokenizer, the app, the imported libraries: ~10^6 objects that
    live as long as the process) out of the cyclic garbage collector's reach (``gc.freeze``). Otherwise a request's
    allocations now and then trigger a full collection that walks all of them while holding the GIL: 60-150 ms in
    which no stream gets a token, whichever thread it runs on (measured with benchmarks/serving.py --scenario
    long-prompt). Collections then scan only what requests create."""
    import gc

    gc.collect()
    gc.freeze()


def build_engine(args, model, tokenizer, err=None):
    """(the GenerationEngine for ``model`` with the parsed flags, its max_seq_len): ``--max_seq_len``, else the
    model's context; a paged KV cache of :func:`kv_cache_blocks`. A ``--max_seq_len`` above
    max_position_embeddings is allowed (RoPE scaling, a config that undersells) with a warning on ``err``, and
    so is a cache too small for one whole sequence (requests are held to what it holds)."""
    from ..engine import GenerationEngine

    err = err if err is not None else sys.stderr
    mpe = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    max_seq_len = args.max_seq_len or default_max_seq_len(model)
    if mpe and max_seq_len > int(mpe):
        print(f"dynamoe serve: warning: --max_seq_len {max_seq_len} is above the model's max_position_embeddings "
              f"{int(mpe)}: positions past {int(mpe)} were not trained and output there may degrade", file=err)
    from ..models.cache import DEFAULT_BLOCK_SIZE

    block_size = getattr(args, "block_size", DEFAULT_BLOCK_SIZE)
    draft = getattr(args, "speculative_draft", "ngram")
    if draft == "mtp" and not getattr(model, "has_mtp", False):
        raise ValueError(f"--speculative-draft mtp needs a model with multi-token-prediction heads, and this "
                         f"{type(model).__name__} has none (its checkpoint has no MTP layers, or its family does "
                         f"not run them): use --speculative-draft ngram")
    if draft == "mtp" and not getattr(args, "speculative_tokens", 0):
        raise ValueError("--speculative-draft mtp needs --num-speculative-tokens K >= 1")
    blocks = kv_cache_blocks(model, max_seq_len, args.max_num_seqs, block_size, getattr(args, "kv_cache_memory", None),
                             getattr(args, "kv_cache_fraction", KV_CACHE_SHARE), extra_layers=int(draft == "mtp"))
    if blocks is not None and blocks * block_size < max_seq_len:
        print(f"dynamoe serve: warning: the KV cache holds {blocks * block_size} positions, fewer than max_seq_len "
              f"{max_seq_len}: a request gets at most that many (raise --kv-cache-memory)", file=err)
    engine = GenerationEngine(model, tokenizer, max_seq_len=max_seq_len, max_batch=args.max_num_seqs, prefill_chunk=2048,
                              prefix_caching=getattr(args, "prefix_caching", True), kv_cache_blocks=blocks,
                              block_size=block_size, token_budget=getattr(args, "token_budget", None),
                              speculative_tokens=getattr(args, "speculative_tokens", 0), draft=draft)
    return engine, max_seq_len


#: share of the memory (RAM, or the GPU's) that the KV cache takes by default
KV_CACHE_SHARE = 0.25
#: the default context length when the model does not say its own
FALLBACK_MAX_SEQ_LEN = 4096


def default_max_seq_len(model) -> int:
    """The model's context (max_position_embeddings), else 4096: the paged cache spends memory on the
    positions requests use, not on the longest one they could."""
    mpe = getattr(getattr(model, "config", None), "max_position_embeddings", None)
    return int(mpe) if mpe else FALLBACK_MAX_SEQ_LEN


def kv_cache_blocks(model, max_seq_len: int, num_slots: int, block_size: int, memory: int | None = None,
                    fraction: float = KV_CACHE_SHARE, extra_layers: int = 0) -> int | None:
    """Blocks of the KV cache's pool: ``memory`` bytes (default ``fraction`` of the RAM, or of the GPU's
    memory) over the bytes of a block, at most what ``num_slots`` sequences at ``max_seq_len`` need and at
    least one block per slot; None (every slot can fill up) where the model does not say its KV size."""
    import torch

    cfg = getattr(model, "config", None)
    per_position = getattr(cfg, "kv_elements_per_position", None)
    if per_position is None:
        return None
    param = next(iter(model.parameters()), None)
    dtype = getattr(model, "dtype", None) or (param.dtype if param is not None else torch.float32)
    device = param.device if param is not None else torch.device("cpu")
    per = per_position()
    if extra_layers:   # attention layers beside the config's (the MTP head's, drafting): as many elements as one
        # of the model's attention layers (a hybrid model's linear-attention layers cache no positions)
        linear = sum(t in ("linear_attention", "conv") for t in (getattr(cfg, "layer_types", None) or ()))
        per += extra_layers * per // max(1, getattr(cfg, "num_hidden_layers", 1) - linear)
    block_bytes = per * torch.empty((), dtype=dtype).element_size() * block_size
    budget = memory if memory is not None else int(_memory_bytes(device) * fraction)
    full = num_slots * -(-max_seq_len // block_size)
    return max(num_slots, min(full, budget // max(1, block_bytes)))


def _memory_bytes(device) -> int:
    import torch

    if getattr(device, "type", "cpu") == "cuda":
        return torch.cuda.get_device_properties(device).total_memory
    try:
        return os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    except (ValueError, OSError, AttributeError):  # not POSIX: assume a small machine
        return 8 << 30


def server_config(args, path: str, api_key: str | None, max_seq_len: int):
    """The :class:`ServerConfig` of the parsed flags."""
    from .state import ServerConfig

    name = args.served_model_name or os.path.basename(os.path.normpath(path))
    return ServerConfig(model_name=name, max_seq_len=max_seq_len, max_num_seqs=args.max_num_seqs, api_key=api_key,
                        webui=args.serve == "webui", thinking_effort=args.thinking_effort,
                        max_request_bytes=args.max_request_bytes)


def announce(args, config, what: str, path: str, err) -> None:
    """The start-up lines on ``err``: a warning when open to the network without a key, then the banner
    (``what``: the model's size and device, in parentheses)."""
    if not _is_loopback(args.host) and config.api_key is None:
        print(f"dynamoe serve: warning: listening on {args.host} without --api-key: anyone who can reach this "
              f"port can use the model", file=err)
    print(f"dynamoe serve: {config.model_name} ({what}) from {path}; max_seq_len "
          f"{config.max_seq_len}, max-num-seqs {args.max_num_seqs}, api key {'on' if config.api_key else 'off'}, "
          f"{'web UI and APIs' if config.webui else 'APIs only'} on http://{args.host}:{args.listen_port}",
          file=err, flush=True)
