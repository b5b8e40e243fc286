"""INT4 checkpoints for the tests, written from the format's description (compressed-tensors
pack-quantized, see dynamoe/quant/int4.py) without dynamoe's own packer: the packing, random INT4
weights, and a tiny dense checkpoint rewritten with INT4 routed experts (and its dequantized twin)."""
import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

# Kimi-K2.5's quantization_config (config.json, under text_config), as published
KIMI_QC = {
    "config_groups": {"group_0": {"input_activations": None, "output_activations": None, "targets": ["Linear"],
                                  "weights": {"actorder": None, "block_structure": None, "dynamic": False,
                                              "group_size": 32, "num_bits": 4, "observer": "minmax",
                                              "observer_kwargs": {}, "strategy": "group", "symmetric": True,
                                              "type": "int"}}},
    "format": "pack-quantized", "ignore": ["lm_head", "re:.*self_attn.*", "re:.*shared_experts.*",
                                           "re:.*mlp\\.(gate|up|gate_up|down)_proj.*"],
    "kv_cache_scheme": None, "quant_method": "compressed-tensors", "quantization_status": "compressed",
}


def int4_qc(**weights) -> dict:
    """KIMI_QC with its weights scheme changed by ``weights``."""
    qc = json.loads(json.dumps(KIMI_QC))
    qc["config_groups"]["group_0"]["weights"].update(weights)
    return qc


def spec_pack(q: torch.Tensor) -> torch.Tensor:
    """[out, in] integers in -8..7 -> int32 [out, ceil(in/8)]: word k = sum_i (q[8k+i] + 8) << 4i (the first
    element in the lowest bits), rows zero-padded to whole words; the uint32 seen as int32."""
    out_f, in_f = q.shape
    words = -(-in_f // 8)
    u = torch.zeros(out_f, words * 8, dtype=torch.int64)
    u[:, :in_f] = q.long() + 8
    packed = torch.zeros(out_f, words, dtype=torch.int64)
    for i in range(8):
        packed |= u[:, i::8] << (4 * i)
    return torch.where(packed >= 2**31, packed - 2**32, packed).to(torch.int32)


def spec_weight(out_f, in_f, group, seed, scale_dtype=torch.bfloat16):
    """(q [out, in] int, scale [out, ceil(in/group)], the dequantized fp32 weight) -- random."""
    g = torch.Generator().manual_seed(seed)
    q = torch.randint(-8, 8, (out_f, in_f), generator=g)
    scale = (torch.rand(out_f, -(-in_f // group), generator=g) * 0.05 + 0.01).to(scale_dtype)
    dense = q.float() * scale.float().repeat_interleave(group, 1)[:, :in_f]
    return q, scale, dense


def write_int4_experts(src: str, dst: str, group: int = 32, prefix: str = "", extra: dict | None = None,
                       config_edit=None) -> dict:
    """Copy the tiny dense checkpoint ``src`` to ``dst`` with every routed expert Linear stored INT4
    (the packing of :func:`spec_pack`, random codes and bf16 scales), names under ``prefix``; returns the
    dequantized fp32 expert weights by (unprefixed) name -- the reference model's."""
    os.makedirs(dst, exist_ok=True)
    for f in os.listdir(src):
        if f.endswith((".json", ".txt", ".jinja")) and f != "model.safetensors.index.json":
            shutil.copy(os.path.join(src, f), dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out, dense = {}, {}
    for i, (name, t) in enumerate(sorted(tensors.items())):
        if ".mlp.experts." in name and name.endswith(".weight"):
            q, scale, w = spec_weight(*t.shape, group, seed=i)
            base = prefix + name[: -len(".weight")]
            out[base + ".weight_packed"], out[base + ".weight_scale"] = spec_pack(q), scale
            out[base + ".weight_shape"] = torch.tensor(list(t.shape), dtype=torch.int32)
            dense[name] = w
        else:
            out[prefix + name] = t.contiguous()
    out.update(extra or {})
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(dst, "config.json")) as f:
        cfg = json.load(f)
    qc = int4_qc(group_size=group)
    cfg = config_edit(cfg, qc) if config_edit else {**cfg, "quantization_config": qc}
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    return dense


def write_dense_reference(src: str, dst: str, dense: dict) -> None:
    """``src`` with the expert weights replaced by ``dense`` (fp32), no quantization_config."""
    shutil.copytree(src, dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    tensors.update({k: v.to(tensors[k].dtype) for k, v in dense.items()})
    save_file({k: v.contiguous() for k, v in tensors.items()}, os.path.join(dst, "model.safetensors"),
              metadata={"format": "pt"})
