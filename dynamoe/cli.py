"""The ``dynamoe`` command line.

``dynamoe quantize --input DIR --output DIR --format {fp8,fp8-ue8m0,mxfp4,nvfp4-modelopt,nvfp4-ct}
[--exclude REGEX ...]`` converts a bf16/fp32 Hugging Face checkpoint folder into a quantized one,
tensor by tensor (memory: about one tensor), in the on-disk layouts of :mod:`dynamoe.quant.checkpoint`.
NVFP4 output is weight-only (no ``input_scale``: that needs calibration data).
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
    q.add_argument("--exclude", action="append", default=[], metavar="REGEX",
                   help="keep tensors whose name matches REGEX (re.search) dense; repeatable")
    return p


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


def quantize_checkpoint(src: str, dst: str, fmt: str, exclude=(), log=print) -> dict:
    """Convert the checkpoint folder ``src`` into ``fmt`` under ``dst`` (see the module docstring).
    Returns a summary: quantized and dense tensor names, output files."""
    from . import __version__
    from .quant.nvfp4 import finite_amax
    from .quant.checkpoint_files import CheckpointTensors, SafetensorsWriter
    from .quant.checkpoint_writer import (_ROUTED_FUSED, fusion_group, is_quant_target, quant_config_entries,
                                          write_quantized)

    exclude = tuple(exclude)
    with open(os.path.join(src, "config.json")) as f:
        config = json.load(f)
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
                if is_quant_target(name, t, fmt, exclude):
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
                if is_quant_target(name, t, fmt, exclude):
                    quantized.append(name)
                else:
                    dense.append(name)
                    linear_like = t.is_floating_point() and (t.dim() >= 2 and name.endswith(".weight")
                                                             or t.dim() == 3 and _ROUTED_FUSED.search(name))
                    if linear_like:
                        not_converted.append(name[: -len(".weight")] if name.endswith(".weight") else name)
                for k, v in write_quantized({name: t}, fmt, exclude=exclude, global_amax=global_amax).items():
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
    log(f"dynamoe quantize: {fmt}: {len(quantized)} tensors quantized, {len(dense)} kept as they were; "
        f"{total / 2**20:.1f} MiB of weights in {len(tensors.files)} file(s) under {dst}")
    if fmt.startswith("nvfp4"):
        log("  weight-only NVFP4: no input_scale written (activation scales need calibration data)")
    if skipped:
        log(f"  not copied (folders): {', '.join(skipped)}")
    return {"quantized": quantized, "dense": dense, "not_converted": not_converted, "files": list(tensors.files),
            "copied": copied, "total_size": total}


def main(argv=None) -> int:
    p = _parser()
    args = p.parse_args(argv)
    if args.command == "quantize":
        _check_args(p, args)
        try:
            quantize_checkpoint(args.input, args.output, args.format, args.exclude)
        except (ValueError, OSError) as err:
            print(f"dynamoe quantize: error: {err}", file=sys.stderr)
            return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
