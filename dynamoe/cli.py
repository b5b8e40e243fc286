"""The ``dynamoe`` command line.

``dynamoe quantize --input DIR --output DIR --format {fp8,fp8-ue8m0,mxfp4,nvfp4-modelopt,nvfp4-ct,int4-ct}
[--modules experts,attention,mlp,lm_head] [--exclude REGEX ...]`` converts a bf16/fp32 Hugging Face checkpoint
folder into a quantized one, tensor by tensor (memory: about one tensor), in the on-disk layouts of
:mod:`dynamoe.quant.checkpoint`; the config's ``quantization_config`` lists the Linears left dense.
NVFP4 output is weight-only (no ``input_scale``: that needs calibration data).

``dynamoe generate --model DIR --prompt TEXT [--chat] [--system S] [--max-tokens N] [--temperature T]
[--top-p P] [--top-k K] [--min-p P] [--repetition-penalty R] [--seed S] [--stop STR ...]
[--dtype float32|bfloat16|float16] [--device DEV] [--max-seq-len N] [--chat-template FILE]
[--thinking/--no-thinking] [--stats]`` streams the generated text to stdout (``--prompt -`` reads stdin).

``dynamoe serve [--model DIR | --try_path DIR ...] [--served-model-name N] [--host H] [--port N]
[--max_seq_len N] [--serve core|webui] [--thinking_effort low|medium|high] [--max-num-seqs N]
[--api-key K] [--dtype ...] [--chat-template FILE]`` serves the model over HTTP (OpenAI and Anthropic
APIs, /chat, /metrics, a web UI); see :mod:`dynamoe.serve.cli`. Under torchrun (``torchrun --nproc_per_node W
-m dynamoe.cli serve ...``) the routed experts are split over the W ranks and rank 0 serves HTTP.
Also runs as ``python -m dynamoe.cli``.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import shutil
import sys

_SKIP_FILES = {"config.json", "model.safetensors.index.json", "hf_quant_config.json",
               "pytorch_model.bin.index.json"}


def _module_kinds(text: str) -> frozenset:
    from .quant.checkpoint_writer import check_modules

    try:
        return check_modules(k.strip() for k in text.split(",") if k.strip())
    except ValueError as err:
        raise argparse.ArgumentTypeError(str(err)) from None


def _parser() -> argparse.ArgumentParser:
    from .quant.checkpoint import FORMATS

    p = argparse.ArgumentParser(prog="dynamoe", description="dynamoe command line tools")
    sub = p.add_subparsers(dest="command", metavar="COMMAND")
    sub.required = True
    q = sub.add_parser("quantize", help="convert a bf16/fp32 Hugging Face checkpoint into a quantized one",
                       description="Convert a bf16/fp32 Hugging Face checkpoint folder into FP8 (blockwise, "
                                   "DeepSeek layout), MXFP4 (GPT-OSS layout, experts only) or weight-only NVFP4 "
                                   "(ModelOpt or compressed-tensors layout), one tensor at a time.")
    q.add_argument("--input", required=True, metavar="DIR", help="dense checkpoint folder (config.json + safetensors)")
    q.add_argument("--output", required=True, metavar="DIR", help="new folder (must not exist, or be empty)")
    q.add_argument("--format", required=True, choices=FORMATS)
    q.add_argument("--modules", type=_module_kinds, default=None, metavar="KINDS",
                   help="comma-separated kinds of weights to quantize: experts (routed), attention, mlp (dense MLPs, "
                        "shared experts), lm_head (default: experts,attention,mlp for fp8/nvfp4, experts for "
                        "mxfp4/int4-ct); routers, norms and embeddings stay dense")
    q.add_argument("--exclude", action="append", default=[], metavar="REGEX",
                   help="keep tensors whose name matches REGEX (re.search) dense; repeatable")

    g = sub.add_parser("generate", help="generate text with a checkpoint, streamed to stdout",
                       description="Load a Hugging Face checkpoint folder and stream the text generated for a "
                                   "prompt (raw, or as one chat turn with --chat).")
    g.add_argument("--model", required=True, metavar="DIR",
                   help="checkpoint folder (config.json, weights, tokenizer.json)")
    g.add_argument("--prompt", required=True, metavar="TEXT", help="the prompt; '-' reads it from stdin")
    g.add_argument("--chat", action="store_true", help="wrap the prompt as a user message in the chat template")
    g.add_argument("--system", metavar="S", help="system message (with --chat)")
    g.add_argument("--max-tokens", type=_int_at_least(1), default=256, metavar="N",
                   help="tokens to generate at most (default 256)")
    g.add_argument("--temperature", type=_float_range(0, None), default=None, metavar="T",
                   help="sampling temperature >= 0; 0 = greedy (default: the checkpoint's generation_config.json, "
                        "greedy unless it sets do_sample)")
    g.add_argument("--top-p", type=_float_range(0, 1, lo_open=True), default=None, metavar="P",
                   help="nucleus sampling mass in (0, 1]")
    g.add_argument("--top-k", type=_int_at_least(0), default=None, metavar="K", help="keep the K likeliest; 0 = off")
    g.add_argument("--min-p", type=_float_range(0, 1), default=None, metavar="P",
                   help="drop tokens below P * p_max; in [0, 1]")
    g.add_argument("--repetition-penalty", type=_float_range(0, None, lo_open=True), default=None, metavar="R",
                   help="HF repetition penalty > 0; 1 = off")
    g.add_argument("--seed", type=_int_at_least(0), default=None, metavar="S", help="sampling seed")
    g.add_argument("--stop", action="extend", nargs="+", default=[], metavar="STR",
                   help="stop strings (output ends before the first one)")
    g.add_argument("--dtype", choices=["float32", "bfloat16", "float16"], default=None,
                   help="weight dtype (default: the loader's)")
    g.add_argument("--device", default=None, help="torch device (default: cuda if available, else cpu)")
    g.add_argument("--max-seq-len", type=_int_at_least(2), default=None, metavar="N",
                   help="KV-cache length (default: prompt + max tokens, capped by the model's context)")
    g.add_argument("--chat-template", metavar="FILE", help="chat template file (.jinja, or JSON with chat_template)")
    g.add_argument("--thinking", action=argparse.BooleanOptionalAction, default=None,
                   help="turn the template's thinking mode on/off (enable_thinking / thinking)")
    g.add_argument("--stats", action="store_true", help="print token counts and speeds to stderr at the end")

    from .serve.cli import add_serve_parser
    add_serve_parser(sub)
    return p


def _float_range(lo, hi, lo_open=False):
    def parse(text):
        try:
            v = float(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected a number, got {text!r}") from None
        bad = v != v or v in (float("inf"), float("-inf")) or (v <= lo if lo_open else v < lo) \
            or (hi is not None and v > hi)
        if bad:
            lo_s = f"> {lo}" if lo_open else f">= {lo}"
            raise argparse.ArgumentTypeError(f"must be {lo_s}{'' if hi is None else f' and <= {hi}'}, got {text!r}")
        return v
    return parse


def _int_at_least(lo):
    def parse(text):
        try:
            v = int(text)
        except ValueError:
            raise argparse.ArgumentTypeError(f"expected an integer, got {text!r}") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"must be >= {lo}, got {text!r}")
        return v
    return parse


def _check_args(p: argparse.ArgumentParser, args) -> None:
    if not os.path.isdir(args.input):
        p.error(f"--input {args.input!r} is not a directory")
    if not os.path.exists(os.path.join(args.input, "config.json")):
        p.error(f"--input {args.input!r} has no config.json (expected a Hugging Face checkpoint folder)")
    if not (os.path.exists(os.path.join(args.input, "model.safetensors"))
            or os.path.exists(os.path.join(args.input, "model.safetensors.index.json"))):
        p.error(f"--input {args.input!r} has neither model.safetensors nor model.safetensors.index.json")
    if os.path.exists(args.output) and (not os.path.isdir(args.output) or os.listdir(args.output)):
        p.error(f"--output {args.output!r} exists and is not an empty directory")
    for pattern in args.exclude:
        try:
            re.compile(pattern)
        except re.error as err:
            p.error(f"--exclude {pattern!r} is not a valid regular expression: {err}")
    try:
        with open(os.path.join(args.input, "config.json")) as f:
            config = json.load(f)
    except (OSError, ValueError) as err:
        p.error(f"cannot read {os.path.join(args.input, 'config.json')}: {err}")
    if not isinstance(config, dict):
        p.error(f"{os.path.join(args.input, 'config.json')} is not a JSON object")
    if config.get("quantization_config") or os.path.exists(os.path.join(args.input, "hf_quant_config.json")):
        p.error(f"--input {args.input!r} is already quantized; quantize takes a bf16/fp32 checkpoint")
    args.config = config


def quantize_checkpoint(src: str, dst: str, fmt: str, exclude=(), log=print, modules=None) -> dict:
    """Convert the checkpoint folder ``src`` into ``fmt`` under ``dst`` (see the module docstring);
    ``modules``: the kinds of weights to quantize (dynamoe.quant.checkpoint_writer.MODULE_KINDS; None: the
    format's default). Returns a summary: quantized and dense tensor names, output files."""
    from . import __version__
    from .quant.nvfp4 import finite_amax
    from .quant.checkpoint_files import CheckpointTensors, SafetensorsWriter
    from .models.loader import load_config
    from .quant.checkpoint_writer import (_ROUTED_FUSED, MODULE_KINDS, check_modules, default_modules, fusion_group,
                                          is_quant_target, quant_config_entries, write_quantized)

    exclude = tuple(exclude)
    modules = default_modules(fmt) if modules is None else check_modules(modules)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
    if "lm_head" in modules and load_config(src).tie_word_embeddings:
        log("dynamoe quantize: lm_head is tied to the embeddings (tie_word_embeddings): kept dense")
        modules = modules - {"lm_head"}
    tensors = CheckpointTensors(src)
    sharded = os.path.exists(os.path.join(src, "model.safetensors.index.json"))

    # NVFP4: fused groups (q/k/v, gate/up) share a global scale -- one pass of amax over them first
    global_amax: dict = {}
    if fmt.startswith("nvfp4"):
        groups: dict = {}
        for name in tensors:
            group = fusion_group(name)
            if group is not None:
                t = tensors[name]
                if is_quant_target(name, t, fmt, exclude, modules):
                    groups.setdefault(group, []).append((name, float(finite_amax(t))))
                del t
        for members in groups.values():
            amax = max(a for _, a in members)
            global_amax.update({n: amax for n, _ in members})

    os.makedirs(dst, exist_ok=True)
    quantized, dense, not_converted = [], [], []
    weight_map: dict = {}
    total = 0
    for file in tensors.files:
        writer = SafetensorsWriter(os.path.join(dst, file))
        try:
            for name in tensors.names_in(file):
                t = tensors[name]
                if is_quant_target(name, t, fmt, exclude, modules):
                    quantized.append(name)
                else:
                    dense.append(name)
                    linear_like = t.is_floating_point() and (t.dim() >= 2 and name.endswith(".weight")
                                                             or t.dim() == 3 and _ROUTED_FUSED.search(name))
                    if linear_like:
                        not_converted.append(name[: -len(".weight")] if name.endswith(".weight") else name)
                for k, v in write_quantized({name: t}, fmt, exclude=exclude, global_amax=global_amax,
                                            modules=modules).items():
                    writer.add(k, v)
                    weight_map[k] = file
                del t
        except BaseException:
            writer.abort()
            raise
        writer.close()
        total += writer.nbytes
    tensors.close()

    qc, hf = quant_config_entries(fmt, not_converted, producer_version=__version__)
    config["quantization_config"] = qc
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(config, f, indent=2)
        f.write("\n")
    if hf is not None:
        with open(os.path.join(dst, "hf_quant_config.json"), "w") as f:
            json.dump(hf, f, indent=2)
            f.write("\n")
    if sharded:
        index = {"metadata": {"total_size": total}, "weight_map": dict(sorted(weight_map.items()))}
        with open(os.path.join(dst, "model.safetensors.index.json"), "w") as f:
            json.dump(index, f, indent=2)
            f.write("\n")
    copied, skipped = [], []
    for entry in sorted(os.listdir(src)):
        path = os.path.join(src, entry)
        if entry in _SKIP_FILES or entry.endswith((".safetensors", ".bin", ".pt", ".pth")):
            continue
        if os.path.isfile(path):
            shutil.copy2(path, os.path.join(dst, entry))
            copied.append(entry)
        else:
            skipped.append(entry)
    log(f"dynamoe quantize: {fmt} ({', '.join(k for k in MODULE_KINDS if k in modules)}): "
        f"{len(quantized)} tensors quantized, {len(dense)} kept as they were; "
        f"{total / 2**20:.1f} MiB of weights in {len(tensors.files)} file(s) under {dst}")
    if fmt.startswith("nvfp4"):
        log("  weight-only NVFP4: no input_scale written (activation scales need calibration data)")
    if skipped:
        log(f"  not copied (folders): {', '.join(skipped)}")
    return {"quantized": quantized, "dense": dense, "not_converted": not_converted, "files": list(tensors.files),
            "copied": copied, "total_size": total}


def _check_generate_args(p: argparse.ArgumentParser, args) -> None:
    if not os.path.isdir(args.model):
        p.error(f"--model {args.model!r} is not a directory")
    for name in ("config.json", "tokenizer.json"):
        if not os.path.exists(os.path.join(args.model, name)):
            p.error(f"--model {args.model!r} has no {name}")
    if args.chat_template is not None and not os.path.isfile(args.chat_template):
        p.error(f"--chat-template {args.chat_template!r} is not a file")
    if args.system is not None and not args.chat:
        p.error("--system needs --chat")
    if args.prompt == "-":
        args.prompt = sys.stdin.read()


def generate_command(args, out=None, err=None) -> int:
    """Run ``dynamoe generate`` with parsed ``args``; text goes to ``out`` as it is produced."""
    import torch

    from .engine import GenerationEngine, SamplingParams, encode_prompt, load

    out = out or sys.stdout
    err = err or sys.stderr
    device = args.device or ("cuda" if torch.cuda.is_available() else "cpu")
    model, tokenizer = load(args.model, dtype=args.dtype, device=device, chat_template=args.chat_template)
    params = SamplingParams.from_generation_config(
        tokenizer.generation_config, temperature=args.temperature, top_p=args.top_p, top_k=args.top_k,
        min_p=args.min_p, repetition_penalty=args.repetition_penalty, seed=args.seed)
    ids = encode_prompt(tokenizer, args.prompt, chat=args.chat, system=args.system, thinking=args.thinking)
    max_seq_len = args.max_seq_len
    if max_seq_len is None:
        mpe = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        max_seq_len = len(ids) + args.max_tokens
        if mpe and max_seq_len > int(mpe):
            max_seq_len = int(mpe)
    engine = GenerationEngine(model, tokenizer, max_seq_len=max_seq_len, max_batch=1)
    last = None
    for ev in engine.stream(ids, args.max_tokens, stop=args.stop, params=params):
        if ev.text:
            out.write(ev.text)
            out.flush()
        last = ev
    out.write("\n")
    out.flush()
    if args.stats and last is not None:
        st = engine.totals
        print(f"dynamoe generate: {st['prompt_tokens']} prompt + {st['output_tokens']} generated tokens, "
              f"finish_reason={last.finish_reason}; prefill {st['prompt_tokens'] / max(st['prefill_s'], 1e-9):.1f} "
              f"tok/s, decode {1000 * st['decode_s'] / max(st['output_tokens'] - 1, 1):.1f} ms/token", file=err)
    return 0


def main(argv=None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.command == "serve":
        from .serve.cli import serve_command
        return serve_command(args)
    if args.command == "generate":
        _check_generate_args(p, args)
        try:
            return generate_command(args)
        except (ValueError, OSError) as err:
            print(f"dynamoe generate: error: {err}", file=sys.stderr)
            return 1
    if args.command == "quantize":
        _check_args(p, args)
        try:
            quantize_checkpoint(args.input, args.output, args.format, args.exclude, modules=args.modules)
        except (ValueError, OSError) as err:
            print(f"dynamoe quantize: error: {err}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
