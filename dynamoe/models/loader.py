"""``dynamoe.models.load(path)``: a Hugging Face checkpoint folder -> a model in eval mode.

The model is built on the meta device (no memory), then every parameter is read from the
memory-mapped safetensors files (single file or shards listed by ``model.safetensors.index.json``)
one tensor at a time, cast to the compute dtype and put in place; peak memory is about the model's
size. Quantized checkpoints (``quantization_config``: blockwise fp8, mxfp4, compressed-tensors NVFP4;
ModelOpt NVFP4 via ``hf_quant_config.json``) keep their packed weights packed: routed experts become
:class:`~dynamoe.quant.QuantizedExperts`, quantized Linears :class:`~dynamoe.quant.QuantizedLinear`.

Every checkpoint tensor must be used and every parameter found: a missing, unexpected or
mis-shaped tensor is a ValueError naming the tensor (and the expected and found shapes). Two family
hooks: ``model.adapt_to_checkpoint(names)`` (called on the meta-device model with the checkpoint's
tensor names before any is read: e.g. Qwen3-Next builds its ``mtp`` module when there are ``mtp.*``
tensors) and ``unused_checkpoint_prefixes`` (tensors the family knowingly does not load, such as a
multimodal checkpoint's vision tower for a text model: named in the family's docstring, never guessed,
logged once by prefix). Multi-token-prediction layers (``model.layers.{i}``, i >= num_hidden_layers, or a
family's own prefix: DeepSeek-V4's ``mtp.{j}``, Hy4's ``model.mtp_layers.{j}``) load as the ``mtp`` heads of the
families with :class:`~dynamoe.models.mtp.MTPHeads`; other families' are left unread and logged with their count.
Heads under a prefix of their own built by the family's ``adapt_to_checkpoint`` (``mtp.``, ``model.mtp.``:
Qwen3-Next / Qwen3.5, K-EXAONE, MiMo-V2-Flash, MiniMax-M3) come from :mod:`dynamoe.models.mtp_prefixed`.

Expert parallelism (``group`` of W ranks): every MoE block keeps E/W routed experts -- rank r the
global experts [r*E/W, (r+1)*E/W), as the MoE layer's all-to-all expects -- and reads only theirs
(per-expert tensors of other experts are skipped; stacked ones are read row range only); everything
else (embeddings, attention, norms, router, shared experts, lm_head) is loaded whole on every rank.
The other ranks' expert tensors count as used. Every rank must then run the same forwards.
"""
from __future__ import annotations

import glob
import json
import logging
import os
import re
import sys
from collections.abc import Mapping
from typing import Union

import torch
from torch import nn

from ..moe.experts import FFNExperts
from ..quant.base import QuantizedWeight
from ..quant.checkpoint import quant_config_from_dir, read_weight
from ..quant.checkpoint_files import CheckpointTensors, release_unreferenced_pages
from ..quant.modules import QuantizedExperts, QuantizedLinear
from .base import CausalLM
from .config import ModelConfig
from .linear import use_fast_linears_
from .moe_block import SparseMoeBlock
from .registry import builder_for, family_for
from .weights import check_shape, read_experts, read_ffn_experts

__all__ = ["load", "load_config", "DTYPES"]

DTYPES = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
          "float16": torch.float16, "fp16": torch.float16}
# buffers the model derives itself (never in a checkpoint)
_DERIVED_BUFFERS = ("_num_global_experts",)
log = logging.getLogger(__name__)


def _check_folder(path: str) -> None:
    if not os.path.isdir(path):
        raise ValueError(f"checkpoint path {path!r} is not a folder")
    if not os.path.exists(os.path.join(path, "config.json")):
        raise ValueError(f"no config.json in {path!r}")
    if os.path.exists(os.path.join(path, "model.safetensors")) or os.path.exists(
            os.path.join(path, "model.safetensors.index.json")):
        return
    bins = sorted(os.path.basename(p) for p in glob.glob(os.path.join(path, "*.bin")) + glob.glob(os.path.join(path, "*.pt")))
    if bins:
        raise ValueError(f"{path!r} holds only PyTorch pickle weights ({', '.join(bins[:3])}); dynamoe loads safetensors "
                         "only: convert them (e.g. save_pretrained with transformers) to model.safetensors")
    raise ValueError(f"no model.safetensors or model.safetensors.index.json in {path!r}")


def _check_dtype(dtype) -> torch.dtype:
    if isinstance(dtype, str) and dtype in DTYPES:
        return DTYPES[dtype]
    if dtype not in (torch.float32, torch.bfloat16, torch.float16):
        raise ValueError(f"dtype must be torch.float32, torch.bfloat16 or torch.float16 (or one of {sorted(DTYPES)}), got {dtype!r}")
    return dtype


def load_config(path) -> ModelConfig:
    """The :class:`ModelConfig` of a checkpoint folder."""
    path = os.fspath(path)
    with open(os.path.join(path, "config.json")) as f:
        return ModelConfig.from_dict(json.load(f))


class _Recording(Mapping):
    """The checkpoint's name -> tensor mapping, remembering which tensors were read."""

    def __init__(self, tensors: CheckpointTensors):
        self.tensors, self.read = tensors, set()

    def __getitem__(self, name):
        t = self.tensors[name]
        self.read.add(name)
        return t

    def get_slice(self, name):
        t = self.tensors.get_slice(name)
        self.read.add(name)
        return t

    def __contains__(self, name) -> bool:
        return name in self.tensors

    def __iter__(self):
        return iter(self.tensors)

    def __len__(self) -> int:
        return len(self.tensors)


class _Filler:
    def __init__(self, model: CausalLM, tensors: _Recording, qcfg, dtype: torch.dtype, device: torch.device,
                 file_paths: list[str] = ()):
        self.model, self.tensors, self.qcfg, self.dtype, self.device = model, tensors, qcfg, dtype, device
        self.file_paths = file_paths
        self.released = 0
        # expert parallelism: checkpoint prefix of a block's per-expert tensors -> (E, this rank's experts)
        self.partial_experts: dict[str, tuple[int, range]] = {}

    def read(self, ours: str, expected_shape, allow_quantized: bool = False):
        name = self.model.checkpoint_name(ours)
        rows = self.model.checkpoint_rows(ours)
        try:
            t = read_weight(self.tensors, name, self.qcfg if allow_quantized else None)
        except ValueError as err:
            if "not found in the checkpoint" in str(err):
                raise ValueError(f"missing tensor {name!r} in the checkpoint (for {ours!r}, expected shape "
                                 f"{tuple(expected_shape)})") from None
            raise
        if rows is not None:  # our tensor is a row range of the checkpoint's (a fused q/k/v on disk)
            if isinstance(t, QuantizedWeight):
                raise ValueError(f"tensor {name!r} is quantized: dynamoe reads {ours!r} as rows {rows[0]}..{rows[1] - 1} "
                                 "of it, which it does for dense tensors only")
            start, stop, total = rows
            check_shape(name, t.shape, (total, *expected_shape[1:]))
            t = t[start:stop]
        if self.model.checkpoint_transposed(ours):  # stored in->out (ERNIE-4.5-VL's router): ours is its transpose
            if isinstance(t, QuantizedWeight) or t.dim() != 2:
                raise ValueError(f"tensor {name!r}: dynamoe reads {ours!r} as its transpose, which it does for dense 2D "
                                 f"tensors only, found {type(t).__name__} of shape {tuple(t.shape)}")
            t = t.t()
        part = self.model.checkpoint_slice(ours) if rows is None else None
        if part is not None:  # our tensor is a strided part of the checkpoint's along one dim (interleaved gate / up)
            dim, sl, size = part
            if isinstance(t, QuantizedWeight):
                raise ValueError(f"tensor {name!r} is quantized: dynamoe reads {ours!r} as a part of it along dim "
                                 f"{dim}, which it does for dense tensors only")
            if t.dim() <= dim or t.shape[dim] != size:
                raise ValueError(f"tensor {name!r}: expected {size} entries along dim {dim}, found shape "
                                 f"{tuple(t.shape)}")
            t = t[(slice(None),) * dim + (sl,)]
        check_shape(name, t.shape, expected_shape)
        return t

    def param(self, t: torch.Tensor, like: torch.Tensor) -> nn.Parameter:
        return nn.Parameter(t.to(device=self.device, dtype=like.dtype), requires_grad=False)

    def linear(self, name: str, module: nn.Linear) -> None:
        w = self.read(name + ".weight", module.weight.shape, allow_quantized=True)
        bias = None
        if module.bias is not None:
            bias = self.read(name + ".bias", module.bias.shape).to(device=self.device, dtype=module.bias.dtype)
        if isinstance(w, QuantizedWeight):
            parent, _, attr = name.rpartition(".")
            setattr(self.model.get_submodule(parent), attr, QuantizedLinear(w.to(self.device), bias))
            return
        module.weight = self.param(w, module.weight)
        if bias is not None:
            module.bias = nn.Parameter(bias, requires_grad=False)

    def direct(self, name: str, module: nn.Module) -> None:
        prefix = name + "." if name else ""
        for pname, p in list(module._parameters.items()):
            if p is not None:
                module._parameters[pname] = self.param(self.read(prefix + pname, p.shape), p)
        for bname, b in list(module._buffers.items()):
            if b is None or bname in module._non_persistent_buffers_set or bname in _DERIVED_BUFFERS:
                continue
            module._buffers[bname] = self.read(prefix + bname, b.shape).to(device=self.device, dtype=b.dtype)

    def experts(self, name: str, block: SparseMoeBlock) -> None:
        model, experts = self.model, block.moe.experts
        prefix, local = model.checkpoint_name(name + ".moe.experts"), block.local_experts
        if len(local) != block.num_experts:
            self.partial_experts[prefix] = (block.num_experts, local)
        if isinstance(experts, FFNExperts):  # non-gated experts (Nemotron-H): up -> fc1, down transposed -> fc2
            ew = read_ffn_experts(self.tensors, self.qcfg, prefix, model.expert_layout, block.num_experts,
                                  experts.hidden_size, experts.model_dim, self.dtype, self.device, local=local)
            for pname, t in (("batched_fc1_w", ew.w1), ("batched_fc2_w", ew.w2.transpose(1, 2).contiguous())):
                p = nn.Parameter(t, requires_grad=False)
                p._dynamoe_expert = True
                setattr(experts, pname, p)
            return
        ew = read_experts(self.tensors, self.qcfg, prefix, model.expert_layout, block.num_experts, experts.hidden_size,
                          experts.model_dim, self.dtype, self.device, bias=model.expert_bias, local=local)
        if ew.quantized:
            block.moe.experts = QuantizedExperts(ew.w1, ew.w2, "glu", ew.b1, ew.b2, glu_kind=experts.activation,
                                                 alpha=experts.alpha, limit=experts.limit,
                                                 names=("gate_up_proj_", "down_proj_"))
            return
        for pname, t in (("gate_up_proj", ew.w1), ("down_proj", ew.w2), ("gate_up_proj_bias", ew.b1),
                         ("down_proj_bias", ew.b2)):
            if getattr(experts, pname) is not None:
                p = nn.Parameter(t, requires_grad=False)
                p._dynamoe_expert = True
                setattr(experts, pname, p)

    def run(self, progress: bool) -> None:
        model = self.model
        modules = list(model.named_modules())
        skip: list[str] = []
        tied = model.config.tie_word_embeddings
        bar = _progress(len(modules), progress)
        try:
            for name, module in modules:
                bar.update(1)
                if any(name == s or name.startswith(s + ".") for s in skip):
                    continue
                if isinstance(module, SparseMoeBlock):
                    self.experts(name, module)
                    skip.append(name + ".moe.experts")
                    self.release_copied_pages()   # the bulk of the bytes: keep the resident set at what is kept
                elif isinstance(module, nn.Linear):
                    if not (tied and module is model.lm_head):
                        self.linear(name, module)
                    elif module.bias is not None:  # a tied lm_head's own bias (ZAYA's lm_head_bias)
                        module.bias = nn.Parameter(self.read(name + ".bias", module.bias.shape).to(
                            device=self.device, dtype=module.bias.dtype), requires_grad=False)
                else:
                    self.direct(name, module)
        finally:
            bar.close()
        model.tie_weights()
        for module in model.modules():
            if hasattr(module, "materialize_buffers"):
                module.materialize_buffers(self.device)
        left = [n for n, t in list(model.named_parameters()) + list(model.named_buffers()) if t.is_meta]
        if left:
            raise ValueError(f"not loaded (no rule maps them to checkpoint tensors): {left[:8]}")


    def release_copied_pages(self) -> None:
        """Unmap the checkpoint pages read so far that no loaded tensor reads in place (copies' sources)."""
        if self.file_paths:
            self.released += release_unreferenced_pages(
                self.file_paths, [t for t in (*self.model.parameters(), *self.model.buffers()) if not t.is_meta])


class _NoBar:
    def update(self, n: int) -> None:
        pass

    def close(self) -> None:
        pass


def _progress(total: int, enabled: bool):
    if not enabled:
        return _NoBar()
    try:
        from tqdm import tqdm
    except ImportError:
        return _NoBar()
    return tqdm(total=total, desc="loading", unit="module", file=sys.stderr, leave=False)


_EXPERT_NAME = re.compile(r"(.*)\.(\d+)\.")   # "<prefix>.<expert>." -- the last numeric component
_LAYER = re.compile(r"model\.layers\.(\d+)\.")


def _other_ranks_expert(name: str, partial: dict) -> bool:
    """Whether ``name`` is a per-expert tensor of an expert another rank holds (expert parallelism)."""
    m = _EXPERT_NAME.match(name)
    if m is None or m.group(1) not in partial:
        return False
    E, local = partial[m.group(1)]
    return int(m.group(2)) < E and int(m.group(2)) not in local


def _ignorable(name: str, config: ModelConfig, model: CausalLM) -> bool:
    prefix = model.checkpoint_prefix
    if prefix:
        if not name.startswith(prefix):
            return False
        name = name[len(prefix):]
    if name.endswith("rotary_emb.inv_freq"):
        return True
    if config.tie_word_embeddings and name == "lm_head.weight":
        return True
    return model.ignores_checkpoint_tensor(name)


def _unloaded_mtp_layers(model: CausalLM, names, read: set, family: str) -> set:
    """The checkpoint tensors of ``model.layers.{i}`` past ``num_hidden_layers`` that were not read: a family's
    multi-token-prediction layers it builds no head for (families with :class:`~dynamoe.models.mtp.MTPHeads`
    load them); logged once with their count."""
    prefix, N = model.checkpoint_prefix, model.config.num_hidden_layers
    if getattr(model, "has_mtp", False):
        N += len(model.mtp)   # (an unread tensor of a layer it built a head for is unexpected)
    left, layers = set(), set()
    for n in names:
        if n in read or not n.startswith(prefix):
            continue
        m = _LAYER.match(n, len(prefix))
        if m and int(m.group(1)) >= N:
            left.add(n)
            layers.add(int(m.group(1)))
    if left:
        log.info("%s: not loading %d tensors of the multi-token-prediction layers model.layers.%s: this model "
                 "builds no head for them", family, len(left), sorted(layers))
    return left


def _unused_parts(model: CausalLM, names, family: str) -> set:
    """The checkpoint tensors under the model's ``unused_checkpoint_prefixes`` (a vision-language wrapper's
    vision tower), logged once with their count per prefix."""
    prefixes = tuple(model.unused_checkpoint_prefixes)
    if not prefixes:
        return set()
    unused = {n for n in names if n.startswith(prefixes)}
    if unused:
        counts = ", ".join(f"{p}* ({sum(n.startswith(p) for n in unused)} tensors)" for p in prefixes
                           if any(n.startswith(p) for n in unused))
        log.info("%s: not loading %d tensors the text model does not use: %s", family, len(unused), counts)
    return unused


def _world_size(group) -> int:
    if group is None:
        return 1
    import torch.distributed as dist

    if not (dist.is_available() and dist.is_initialized()):
        raise ValueError("group was given but torch.distributed is not initialised (call init_process_group first)")
    return dist.get_world_size(group)


def load(path, dtype: Union[torch.dtype, str] = torch.float32, device=None, progress: bool = True,
         group=None) -> CausalLM:
    """Load a Hugging Face checkpoint folder as a dynamoe model in eval mode.

    path: folder with config.json and model.safetensors (or shards + model.safetensors.index.json).
    dtype: compute dtype (float32, bfloat16, float16). device: where the weights go (default CPU).
    progress: a tqdm bar on stderr.
    group: a torch.distributed process group (e.g. ``dist.group.WORLD``) of W > 1 ranks for expert
    parallelism (see the module docstring): every rank of the group calls ``load`` alike and then runs
    the same forwards, whose outputs equal the one-process model's. num_experts must be divisible by W.
    """
    path = os.fspath(path)
    _check_folder(path)
    dtype = _check_dtype(dtype)
    device = torch.device(device if device is not None else "cpu")
    config = load_config(path)
    world = _world_size(group)
    if world > 1 and config.num_experts and config.num_experts % world:
        raise ValueError(f"num_experts={config.num_experts} of {path!r} is not divisible by the world size {world}: "
                         f"expert parallelism gives every rank num_experts / world size experts")
    qcfg = quant_config_from_dir(path)
    builder = builder_for(config)
    files = CheckpointTensors(path)
    file_paths = files.file_paths()
    try:
        with torch.device("meta"):
            model = builder(config, dtype=dtype)
            adapt = getattr(model, "adapt_to_checkpoint", None)
            if adapt is not None:  # e.g. modules for optional tensors (Qwen3-Next's mtp.*) when the checkpoint has them
                adapt(list(files))
            if world > 1:
                for _, block in model.moe_layers():
                    block.expert_parallel_(group)
    except BaseException:
        files.close()
        raise
    tensors = _Recording(files)
    try:
        filler = _Filler(model, tensors, qcfg, dtype, device, file_paths)
        filler.run(progress)
        unused = _unused_parts(model, files, family_for(config))
        unused |= _unloaded_mtp_layers(model, files, tensors.read, family_for(config))
        unexpected = sorted(n for n in files if n not in tensors.read and n not in unused
                            and not _ignorable(n, config, model)
                            and not _other_ranks_expert(n, filler.partial_experts))
    finally:
        files.close()
    if unexpected:
        more = f" and {len(unexpected) - 8} more" if len(unexpected) > 8 else ""
        raise ValueError(f"unexpected tensors in {path!r}, not used by the {family_for(config)} model: "
                         f"{unexpected[:8]}{more}")
    share = getattr(model, "share_mtp_tensors_", None)
    if share is not None and share():
        log.info("%s: the multi-token-prediction heads share the model's embeddings / lm_head (equal copies)",
                 family_for(config))
    use_fast_linears_(model)  # bf16 decode GEMV on CPU (dynamoe.ops.linear)
    # the mapped pages of tensors copied while loading (stacked, de-interleaved, converted) leave the resident set
    filler.release_copied_pages()
    if filler.released:
        log.info("released %.2f GB of checkpoint pages the model does not read in place", filler.released / 1e9)
    return model.eval()
