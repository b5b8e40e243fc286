"""Quantized checkpoints: config parsing, `dynamoe quantize` for every format on tiny Qwen3-MoE-like,
GPT-OSS-like and unaligned-FP8 checkpoints built here (no downloads), reading weights back, stacking
experts, and the error paths."""
import json
import os
import subprocess
import sys

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import save_file

from dynamoe.cli import main
from dynamoe.quant import BlockFP8Weight, INT4Weight, MXFP4Weight, NVFP4Weight, QuantizedWeight, quantize
from dynamoe.quant.checkpoint import (QuantConfig, concat_out, deinterleave_gate_up, parse_quant_config,
                                      quant_config_from_dir, read_weight, stack_experts)
from dynamoe.quant.checkpoint_files import CheckpointTensors
from dynamoe.quant.checkpoint_writer import write_quantized

FORMATS = ["fp8", "fp8-ue8m0", "mxfp4", "nvfp4-modelopt", "nvfp4-ct", "int4-ct"]
H, I, E, L, V = 64, 128, 4, 2, 96  # hidden, moe intermediate, experts, layers, vocab
HEADS, KV, HD = 4, 2, 16


# ---------------------------------------------------------------- tiny checkpoints
def _random_bf16(seed: int):
    g = torch.Generator().manual_seed(seed)

    def r(*shape, scale=0.05):
        return (torch.randn(*shape, generator=g) * scale).to(torch.bfloat16)

    return r


def _embeddings_and_head(r) -> dict:
    return {"model.embed_tokens.weight": r(V, H), "model.norm.weight": torch.ones(H, dtype=torch.bfloat16),
            "lm_head.weight": r(V, H)}


def qwen3_moe_tensors():
    r = _random_bf16(1)
    t = _embeddings_and_head(r)
    for layer in range(L):
        p = f"model.layers.{layer}."
        t[p + "input_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
        t[p + "post_attention_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
        t[p + "self_attn.q_proj.weight"] = r(HEADS * HD, H)
        t[p + "self_attn.k_proj.weight"] = r(KV * HD, H, scale=0.2)   # a different amax than q/v
        t[p + "self_attn.v_proj.weight"] = r(KV * HD, H)
        t[p + "self_attn.o_proj.weight"] = r(H, HEADS * HD)
        t[p + "self_attn.q_norm.weight"] = torch.ones(HD, dtype=torch.bfloat16)
        t[p + "self_attn.k_norm.weight"] = torch.ones(HD, dtype=torch.bfloat16)
        t[p + "mlp.gate.weight"] = r(E, H)
        for e in range(E):
            s = 0.02 * (e + 1)          # experts with very different magnitudes
            t[p + f"mlp.experts.{e}.gate_proj.weight"] = r(I, H, scale=s)
            t[p + f"mlp.experts.{e}.up_proj.weight"] = r(I, H, scale=2 * s)
            t[p + f"mlp.experts.{e}.down_proj.weight"] = r(H, I, scale=s)
    return t


QWEN_CONFIG = {"model_type": "qwen3_moe", "architectures": ["Qwen3MoeForCausalLM"], "hidden_size": H,
               "moe_intermediate_size": I, "num_experts": E, "num_experts_per_tok": 2, "num_hidden_layers": L,
               "num_attention_heads": HEADS, "num_key_value_heads": KV, "head_dim": HD, "vocab_size": V,
               "norm_topk_prob": True, "torch_dtype": "bfloat16"}


def gpt_oss_tensors():
    r = _random_bf16(2)
    t = _embeddings_and_head(r)
    for layer in range(L):
        p = f"model.layers.{layer}."
        t[p + "input_layernorm.weight"] = torch.ones(H, dtype=torch.bfloat16)
        for n, out in (("q", HEADS * HD), ("k", KV * HD), ("v", KV * HD)):
            t[p + f"self_attn.{n}_proj.weight"] = r(out, H)
            t[p + f"self_attn.{n}_proj.bias"] = r(out)
        t[p + "self_attn.o_proj.weight"] = r(H, HEADS * HD)
        t[p + "self_attn.o_proj.bias"] = r(H)
        t[p + "self_attn.sinks"] = r(HEADS)
        t[p + "mlp.router.weight"] = r(E, H)
        t[p + "mlp.router.bias"] = r(E)
        gate, up = r(E, H, I), r(E, H, I, scale=0.1)
        t[p + "mlp.experts.gate_up_proj"] = torch.stack([gate, up], -1).reshape(E, H, 2 * I)  # interleaved columns
        t[p + "mlp.experts.gate_up_proj_bias"] = r(E, 2 * I)
        t[p + "mlp.experts.down_proj"] = r(E, I, H)
        t[p + "mlp.experts.down_proj_bias"] = r(E, H)
    return t


GPT_OSS_CONFIG = {"model_type": "gpt_oss", "hidden_size": H, "intermediate_size": I, "num_local_experts": E,
                  "num_hidden_layers": L, "vocab_size": V, "torch_dtype": "bfloat16"}


def write_checkpoint(path, tensors, config, shards=1):
    os.makedirs(path, exist_ok=True)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(config, f)
    with open(os.path.join(path, "tokenizer_config.json"), "w") as f:
        json.dump({"chat_template": "{{ messages }}"}, f)
    names = list(tensors)
    if shards == 1:
        save_file(tensors, os.path.join(path, "model.safetensors"), metadata={"format": "pt"})
        return path
    weight_map = {}
    for s in range(shards):
        file = f"model-{s + 1:05d}-of-{shards:05d}.safetensors"
        part = {n: tensors[n] for n in names[s::shards]}
        save_file(part, os.path.join(path, file), metadata={"format": "pt"})
        weight_map.update({n: file for n in part})
    with open(os.path.join(path, "model.safetensors.index.json"), "w") as f:
        json.dump({"metadata": {"total_size": 0}, "weight_map": weight_map}, f)
    return path


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("ckpt")
    return {"qwen": (write_checkpoint(str(root / "qwen"), qwen3_moe_tensors(), QWEN_CONFIG), qwen3_moe_tensors()),
            "qwen_sharded": (write_checkpoint(str(root / "qwen_sharded"), qwen3_moe_tensors(), QWEN_CONFIG, shards=3),
                             qwen3_moe_tensors()),
            "gpt_oss": (write_checkpoint(str(root / "gpt_oss"), gpt_oss_tensors(), GPT_OSS_CONFIG), gpt_oss_tensors())}


def run_quantize(src, dst, fmt, *extra):
    assert main(["quantize", "--input", src, "--output", dst, "--format", fmt, *extra]) == 0
    return CheckpointTensors(dst), quant_config_from_dir(dst)


# ---------------------------------------------------------------- error bounds
def assert_close_to_original(q, w):
    """Elementwise error bound of each format, from the scales stored with it."""
    d, w = q.dequantize(torch.float32), w.float()
    assert d.shape == w.shape
    err = (d - w).abs()
    if isinstance(q, BlockFP8Weight):   # e4m3: 3 mantissa bits -> 2^-4 relative, + subnormal steps of the scale
        b0, b1 = q.block
        s = q.scales().repeat_interleave(b0, -2).repeat_interleave(b1, -1)[..., : w.shape[-2], : w.shape[-1]]
        assert (err <= w.abs() * 2 ** -4 + s * 2 ** -9 + 1e-12).all()
    elif isinstance(q, INT4Weight):     # the nearest of 16 levels of a bf16 scale = group amax / 7.5
        step = q.weight_scale.float().repeat_interleave(q.group_size, -1)[..., : w.shape[-1]]
        assert (err <= 0.56 * step).all()
        assert (err.norm() / w.norm()) < 0.15
    elif isinstance(q, MXFP4Weight):    # amax / 2^e in [4, 8): every element within 2 * 2^e
        step = torch.exp2(q.scales.float() - 127).repeat_interleave(32, -1)
        assert (err <= 2 * step + 1e-12).all()
        assert (err.norm() / w.norm()) < 0.2
    else:                               # e2m1 steps up to 2 (4 -> 6) in units of s ~ group amax / 6
        gamax = w.reshape(*w.shape[:-1], -1, 16).abs().amax(-1).repeat_interleave(16, -1)
        assert (err <= 0.25 * gamax + 1e-6).all()
        assert (err.norm() / w.norm()) < 0.15


# ---------------------------------------------------------------- config parsing
def test_quant_config_parsing(tmp_path):
    assert parse_quant_config(None) is None
    q = parse_quant_config({"quant_method": "fp8", "fmt": "e4m3", "activation_scheme": "dynamic",
                            "weight_block_size": [128, 128], "scale_fmt": "ue8m0"})
    assert (q.kind, q.block, q.scale_fmt, q.activation_scheme) == ("fp8", (128, 128), "ue8m0", "dynamic")
    q = parse_quant_config({"quant_method": "mxfp4", "modules_to_not_convert": ["lm_head"]})
    assert (q.kind, q.group_size, q.exclude) == ("mxfp4", 32, ("lm_head",))
    q = parse_quant_config({"quant_method": "compressed-tensors", "format": "nvfp4-pack-quantized", "ignore": ["lm_head"],
                            "config_groups": {"g": {"format": "nvfp4-pack-quantized", "weights": {
                                "num_bits": 4, "type": "float", "group_size": 16}}}})
    assert (q.kind, q.exclude) == ("nvfp4-ct", ("lm_head",))
    q = parse_quant_config({"quant_method": "modelopt", "quant_algo": "NVFP4", "exclude_modules": ["lm_head"]})
    assert (q.kind, q.group_size, q.exclude) == ("nvfp4-modelopt", 16, ("lm_head",))
    # a folder: bf16 -> None; ModelOpt from hf_quant_config.json alone
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "qwen3_moe"}))
    assert quant_config_from_dir(tmp_path) is None
    (tmp_path / "hf_quant_config.json").write_text(json.dumps(
        {"producer": {"name": "modelopt"}, "quantization": {"quant_algo": "NVFP4", "group_size": 16,
                                                             "exclude_modules": ["lm_head", "model.layers.*.mlp.gate"]}}))
    q = quant_config_from_dir(tmp_path)
    assert q.kind == "nvfp4-modelopt" and q.exclude == ("lm_head", "model.layers.*.mlp.gate")


@pytest.mark.parametrize("qc,match", [
    ({"quant_method": "gptq", "bits": 4}, r"'gptq'.*supported.*fp8.*mxfp4.*compressed-tensors.*modelopt"),
    ({"quant_method": "fp8", "fmt": "e4m3"}, "weight_block_size"),
    ({"quant_method": "compressed-tensors", "format": "int-quantized"}, "'int-quantized'.*supported"),
    ({"quant_method": "modelopt", "quant_algo": "FP8"}, "'FP8'.*supported"),
])
def test_unknown_quant_method_is_rejected(qc, match):
    with pytest.raises(ValueError, match=match):
        parse_quant_config(qc)


# ---------------------------------------------------------------- the CLI, every format, Qwen3-MoE-like
def expected_targets(fmt, names):
    if fmt in ("mxfp4", "int4-ct"):
        return {n for n in names if ".mlp.experts." in n}
    return {n for n in names if n.startswith("model.layers.") and "_proj.weight" in n}


@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_qwen3_moe(ckpts, tmp_path, fmt):
    src, orig = ckpts["qwen"]
    out, qcfg = run_quantize(src, str(tmp_path / "out"), fmt)
    targets = expected_targets(fmt, orig)
    assert targets and len(targets) < len(orig)
    on_disk = set(out)
    for name, w in orig.items():
        got = read_weight(out, name, qcfg)
        if name in targets:
            assert isinstance(got, QuantizedWeight), name
            assert tuple(got.shape) == tuple(w.shape)
            assert_close_to_original(got, w)
        else:   # router, norms, embeddings, lm_head (and non-expert Linears for MXFP4) stay as they were
            assert isinstance(got, torch.Tensor) and got.dtype == w.dtype and torch.equal(got, w), name
    companions = {"fp8": ["", "_scale_inv"], "fp8-ue8m0": ["", "_scale_inv"], "mxfp4": ["_blocks", "_scales"],
                  "nvfp4-modelopt": ["", "_scale", "_scale_2"], "nvfp4-ct": ["_packed", "_scale", "_global_scale"],
                  "int4-ct": ["_packed", "_scale", "_shape"]}[fmt]
    expected_names = {n for n in orig if n not in targets} | {n + c for n in targets for c in companions}
    assert on_disk == expected_names
    assert not any(n.endswith("input_scale") for n in on_disk)   # weight-only: nothing invented

    # config entries
    config = json.load(open(os.path.join(tmp_path, "out", "config.json")))
    assert config["model_type"] == "qwen3_moe" and config["num_experts"] == E
    qc = config["quantization_config"]
    assert os.path.exists(tmp_path / "out" / "tokenizer_config.json")
    assert os.path.exists(tmp_path / "out" / "hf_quant_config.json") == (fmt == "nvfp4-modelopt")
    router = "model.layers.0.mlp.gate"
    if fmt.startswith("fp8"):
        assert qc["quant_method"] == "fp8" and qc["weight_block_size"] == [128, 128] and qc["fmt"] == "e4m3"
        assert qc["activation_scheme"] == "dynamic" and (qc.get("scale_fmt") == "ue8m0") == (fmt == "fp8-ue8m0")
        assert qcfg.block == (128, 128)
        scale = out["model.layers.0.self_attn.q_proj.weight_scale_inv"]
        assert scale.dtype == (torch.float8_e8m0fnu if fmt == "fp8-ue8m0" else torch.float32)
        assert out["model.layers.0.self_attn.q_proj.weight"].dtype == torch.float8_e4m3fn
        assert router in qc["modules_to_not_convert"] and "lm_head" in qc["modules_to_not_convert"]
    elif fmt == "mxfp4":
        assert qc["quant_method"] == "mxfp4"
        assert {router, "lm_head", "model.layers.1.self_attn.o_proj"} <= set(qc["modules_to_not_convert"])
        assert out["model.layers.0.mlp.experts.2.down_proj.weight_blocks"].shape == (H, I // 32, 16)
    elif fmt == "int4-ct":
        assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "pack-quantized"
        weights = qc["config_groups"]["group_0"]["weights"]
        assert (weights["num_bits"], weights["type"], weights["symmetric"], weights["group_size"]) == (4, "int", True, 32)
        assert {router, "lm_head", "model.layers.1.self_attn.o_proj"} <= set(qc["ignore"])
        assert out["model.layers.0.mlp.experts.2.down_proj.weight_packed"].shape == (H, -(-I // 8))
        assert out["model.layers.0.mlp.experts.2.down_proj.weight_shape"].tolist() == [H, I]
    elif fmt == "nvfp4-modelopt":
        hf = json.load(open(tmp_path / "out" / "hf_quant_config.json"))
        assert hf["quantization"]["quant_algo"] == "NVFP4" and hf["quantization"]["group_size"] == 16
        assert router in hf["quantization"]["exclude_modules"] and "lm_head" in hf["quantization"]["exclude_modules"]
        assert "input_scale" in hf["quantization"]["comment"]
        assert qc["quant_method"] == "modelopt" and qc["quant_algo"] == "NVFP4"
    else:
        assert qc["quant_method"] == "compressed-tensors" and qc["format"] == "nvfp4-pack-quantized"
        group = qc["config_groups"]["group_0"]
        assert group["weights"]["group_size"] == 16 and group["weights"]["type"] == "float"
        assert group["input_activations"] is None and router in qc["ignore"]


@pytest.mark.parametrize("fmt", ["nvfp4-modelopt", "nvfp4-ct"])
def test_nvfp4_experts_have_their_own_global_scale_shared_by_gate_and_up(ckpts, tmp_path, fmt):
    src, orig = ckpts["qwen"]
    out, qcfg = run_quantize(src, str(tmp_path / "out"), fmt)
    p = "model.layers.1.mlp.experts."
    s2 = []
    for e in range(E):
        gate = read_weight(out, p + f"{e}.gate_proj.weight", qcfg)
        up = read_weight(out, p + f"{e}.up_proj.weight", qcfg)
        amax = max(orig[p + f"{e}.{n}_proj.weight"].float().abs().max() for n in ("gate", "up"))
        torch.testing.assert_close(gate.weight_scale_2, amax / (6 * 448))
        assert torch.equal(gate.weight_scale_2, up.weight_scale_2)
        if fmt == "nvfp4-ct":   # on disk: the reciprocal, per expert
            torch.testing.assert_close(out[p + f"{e}.gate_proj.weight_global_scale"], (6 * 448 / amax).reshape(1))
        s2.append(float(gate.weight_scale_2))
    assert len(set(s2)) == E    # one global scale per expert, not one for all
    # q/k/v share one; o_proj has its own
    qkv = [read_weight(out, f"model.layers.0.self_attn.{n}_proj.weight", qcfg).weight_scale_2 for n in "qkv"]
    assert torch.equal(qkv[0], qkv[1]) and torch.equal(qkv[0], qkv[2])
    # stacking all experts' gate+up keeps the per-expert scales: [E, 2I, H] == the originals
    w1 = stack_experts([concat_out([read_weight(out, p + f"{e}.{n}_proj.weight", qcfg) for n in ("gate", "up")])
                        for e in range(E)])
    assert w1.shape == (E, 2 * I, H) and w1.weight_scale_2.shape == (E,)
    dense = torch.stack([torch.cat([orig[p + f"{e}.{n}_proj.weight"] for n in ("gate", "up")]) for e in range(E)])
    assert_close_to_original(w1, dense)
    if fmt == "nvfp4-ct":
        # a loader that forgets the expert global scale (uses weight_scale alone) is far off
        forgot = NVFP4Weight(w1.weight, w1.weight_scale, torch.ones(E), w1.shape).dequantize(torch.float32)
        assert not torch.allclose(forgot, dense.float(), rtol=0.5, atol=1e-3)


@pytest.mark.parametrize("fmt", ["fp8", "nvfp4-ct"])
def test_sharded_input(ckpts, tmp_path, fmt):
    src, orig = ckpts["qwen_sharded"]
    dst = str(tmp_path / "out")
    out, qcfg = run_quantize(src, dst, fmt, "--exclude", r"layers\.1\.self_attn")
    index = json.load(open(os.path.join(dst, "model.safetensors.index.json")))
    files = sorted(f for f in os.listdir(dst) if f.endswith(".safetensors"))
    assert files == sorted(f for f in os.listdir(src) if f.endswith(".safetensors")) and len(files) == 3
    # every tensor of every shard is in the index, under its file; total_size is the data bytes
    seen, total = {}, 0
    for file in files:
        with safe_open(os.path.join(dst, file), "pt") as f:
            for k in f.keys():
                seen[k] = file
                t = f.get_tensor(k)
                total += t.numel() * t.element_size()
    assert seen == index["weight_map"] and index["metadata"]["total_size"] == total
    for name, w in orig.items():
        got = read_weight(out, name, qcfg)
        if "layers.1.self_attn" in name or not expected_targets(fmt, [name]):
            assert torch.equal(got, w), name
        else:
            assert_close_to_original(got, w)
    skip = qcfg.exclude
    assert "model.layers.1.self_attn.q_proj" in skip and "model.layers.0.self_attn.q_proj" not in skip


# ---------------------------------------------------------------- GPT-OSS-like
@pytest.mark.parametrize("fmt", FORMATS)
def test_quantize_gpt_oss(ckpts, tmp_path, fmt):
    src, orig = ckpts["gpt_oss"]
    out, qcfg = run_quantize(src, str(tmp_path / "out"), fmt)
    p = "model.layers.0."
    for name in ("mlp.router.weight", "mlp.router.bias", "self_attn.sinks", "mlp.experts.gate_up_proj_bias",
                 "mlp.experts.down_proj_bias", "self_attn.q_proj.bias", "input_layernorm.weight"):
        assert torch.equal(read_weight(out, p + name, qcfg), orig[p + name]), name
    gate_up = read_weight(out, p + "mlp.experts.gate_up_proj", qcfg)
    q = read_weight(out, p + "self_attn.q_proj.weight", qcfg)
    if fmt == "int4-ct":   # experts only, and no public INT4 layout of fused 3D experts: nothing quantized
        assert torch.equal(gate_up, orig[p + "mlp.experts.gate_up_proj"]) and torch.equal(q, orig[p + "self_attn.q_proj.weight"])
        assert {p + "mlp.experts.gate_up_proj", p + "mlp.router"} <= set(qcfg.exclude)
        return
    if fmt != "mxfp4":
        # FP8 / NVFP4: the Linears; the fused 3D experts stay dense (stored in->out, as they were)
        assert torch.equal(gate_up, orig[p + "mlp.experts.gate_up_proj"])
        assert isinstance(q, QuantizedWeight)
        assert_close_to_original(q, orig[p + "self_attn.q_proj.weight"])
        assert {p + "mlp.experts.gate_up_proj", p + "mlp.router"} <= set(qcfg.exclude)
        return
    assert torch.equal(q, orig[p + "self_attn.q_proj.weight"])   # MXFP4: experts only
    assert out[p + "mlp.experts.gate_up_proj_blocks"].shape == (E, 2 * I, H // 32, 16)
    assert out[p + "mlp.experts.gate_up_proj_scales"].shape == (E, 2 * I, H // 32)
    assert out[p + "mlp.experts.down_proj_blocks"].shape == (E, H, I // 32, 16)
    assert p + "mlp.experts.gate_up_proj" not in out
    # stored out->in: the transpose of the in->out original
    assert isinstance(gate_up, MXFP4Weight) and gate_up.shape == (E, 2 * I, H)
    assert_close_to_original(gate_up, orig[p + "mlp.experts.gate_up_proj"].transpose(1, 2))
    down = read_weight(out, p + "mlp.experts.down_proj", qcfg)
    assert_close_to_original(down, orig[p + "mlp.experts.down_proj"].transpose(1, 2))
    # interleaved columns: gate = [..., ::2] -> rows 0::2; deinterleaved to gate-then-up exactly
    gu = deinterleave_gate_up(gate_up).dequantize(torch.float32)
    d = gate_up.dequantize(torch.float32)
    assert torch.equal(gu[:, :I], d[:, 0::2]) and torch.equal(gu[:, I:], d[:, 1::2])
    gate = orig[p + "mlp.experts.gate_up_proj"][..., ::2].transpose(1, 2).float()   # [E, I, H]
    assert (gu[:, :I] - gate).norm() / gate.norm() < 0.2
    assert set(qcfg.exclude) >= {p + "mlp.router", p + "self_attn.q_proj", "lm_head"}


# ---------------------------------------------------------------- unaligned FP8 (DeepSeek kv_a_proj_with_mqa)
@pytest.mark.parametrize("fmt", ["fp8", "fp8-ue8m0"])
def test_unaligned_fp8_576x7168(tmp_path, fmt):
    name = "model.layers.0.self_attn.kv_a_proj_with_mqa.weight"
    w = torch.randn(576, 7168, generator=torch.Generator().manual_seed(3)).to(torch.bfloat16)
    w[512:] *= 20   # the partial last block row has its own (larger) scale
    src = write_checkpoint(str(tmp_path / "src"), {name: w}, {"model_type": "deepseek_v3"})
    out, qcfg = run_quantize(src, str(tmp_path / "out"), fmt)
    assert out[name + "_scale_inv"].shape == (5, 56)
    q = read_weight(out, name, qcfg)
    assert isinstance(q, BlockFP8Weight) and q.shape == (576, 7168) and q.block == (128, 128)
    assert_close_to_original(q, w)
    s = q.scales()
    assert not torch.equal(s[4], s[3])
    # the rows // scale_rows inference (576 // 5 = 115 rows a block) mis-dequantizes the same bytes
    rows = (torch.arange(576) // 115).clamp(max=4)
    inferred = q.weight.float() * s[rows].repeat_interleave(128, 1)
    assert (inferred - w.float()).abs().max() > 10 * (q.dequantize(torch.float32) - w.float()).abs().max()


# ---------------------------------------------------------------- stacking and fusing
@pytest.mark.parametrize("fmt", ["fp8_block", "mxfp4", "nvfp4"])
def test_stack_and_concat(fmt):
    gate, up = torch.randn(E, 128, 64), torch.randn(E, 128, 64)
    parts = []
    for e in range(E):
        if fmt == "nvfp4":   # a shared global scale, as the writer fuses gate/up
            both = write_quantized({"model.layers.0.mlp.experts.0.gate_proj.weight": gate[e],
                                    "model.layers.0.mlp.experts.0.up_proj.weight": up[e]}, "nvfp4-modelopt",
                                   global_amax={n: float(torch.cat([gate[e], up[e]]).abs().max()) for n in (
                                       "model.layers.0.mlp.experts.0.gate_proj.weight",
                                       "model.layers.0.mlp.experts.0.up_proj.weight")})
            qc = QuantConfig("nvfp4-modelopt", "modelopt")
            g, u = (read_weight(both, f"model.layers.0.mlp.experts.0.{n}_proj.weight", qc) for n in ("gate", "up"))
        else:
            g, u = quantize(gate[e], fmt), quantize(up[e], fmt)
        parts.append(concat_out([g, u]))
        assert parts[-1].shape == (256, 64)
        torch.testing.assert_close(parts[-1].dequantize(torch.float32),
                                   torch.cat([g.dequantize(torch.float32), u.dequantize(torch.float32)]))
    w = stack_experts(parts)
    assert w.shape == (E, 256, 64)
    for e in range(E):
        torch.testing.assert_close(w[e].dequantize(torch.float32), parts[e].dequantize(torch.float32))


def test_nvfp4_writer_with_its_own_amax_matches_the_format_quantizer():
    name = "model.layers.0.self_attn.o_proj.weight"
    w = torch.randn(32, 64) * 3
    for fmt in ("nvfp4-modelopt", "nvfp4-ct"):
        qc = QuantConfig(fmt, "")
        got = read_weight(write_quantized({name: w}, fmt, global_amax={name: float(w.abs().max())}), name, qc)
        plain = read_weight(write_quantized({name: w}, fmt), name, qc)
        ref = NVFP4Weight.quantize(w)
        for q in (got, plain):
            assert torch.equal(q.weight, ref.weight) and torch.equal(q.weight_scale.view(torch.uint8),
                                                                     ref.weight_scale.view(torch.uint8))
            torch.testing.assert_close(q.weight_scale_2, ref.weight_scale_2)


def test_stack_and_concat_refuse_what_they_cannot_do_exactly():
    a, b = NVFP4Weight.quantize(torch.randn(32, 64)), NVFP4Weight.quantize(torch.randn(32, 64) * 3)
    with pytest.raises(ValueError, match="weight_scale_2"):
        concat_out([a, b])
    f1, f2 = BlockFP8Weight.quantize(torch.randn(96, 256)), BlockFP8Weight.quantize(torch.randn(96, 256))
    with pytest.raises(ValueError, match="multiple of the block"):
        concat_out([f1, f2])
    assert concat_out([BlockFP8Weight.quantize(torch.randn(128, 256)), f2]).shape == (224, 256)
    with pytest.raises(ValueError, match="shape"):
        stack_experts([a, NVFP4Weight.quantize(torch.randn(16, 64))])
    with pytest.raises(ValueError, match="MXFP4Weight"):
        stack_experts([a, MXFP4Weight.quantize(torch.randn(32, 64))])
    with pytest.raises(ValueError, match="cannot be reordered"):
        deinterleave_gate_up(f1)


# ---------------------------------------------------------------- read errors
def test_read_weight_errors():
    name = "model.layers.0.mlp.experts.0.down_proj.weight"
    fp8 = QuantConfig("fp8", "fp8", block=(128, 128))
    t = write_quantized({name: torch.randn(576, 256)}, "fp8")
    with pytest.raises(ValueError, match=r"weight_scale_inv.*missing|missing.*weight_scale_inv"):
        read_weight({name: t[name]}, name, fp8)
    with pytest.raises(ValueError, match=r"'model\.layers\.0\.mlp\.experts\.0\.down_proj\.weight_scale_inv'.*expected shape "
                                         r"\(5, 2\).*found \(4, 2\)"):
        read_weight({name: t[name], name + "_scale_inv": t[name + "_scale_inv"][:4]}, name, fp8)
    with pytest.raises(ValueError, match="not found"):
        read_weight(t, "model.layers.0.mlp.experts.1.down_proj.weight", fp8)
    with pytest.raises(ValueError, match="pass the checkpoint's QuantConfig"):
        read_weight({name + "_blocks": torch.zeros(1)}, name, None)

    mx = write_quantized({name: torch.randn(64, 128)}, "mxfp4")
    mxq = QuantConfig("mxfp4", "mxfp4")
    with pytest.raises(ValueError, match="missing tensor '.*weight_scales'"):
        read_weight({name + "_blocks": mx[name + "_blocks"]}, name, mxq)
    with pytest.raises(ValueError, match=r"weight_scales.*expected shape \(64, 4\).*found \(64, 3\)"):
        read_weight({name + "_blocks": mx[name + "_blocks"], name + "_scales": mx[name + "_scales"][:, :3]}, name, mxq)

    mo = write_quantized({name: torch.randn(64, 128)}, "nvfp4-modelopt")
    moq = QuantConfig("nvfp4-modelopt", "modelopt")
    with pytest.raises(ValueError, match="missing tensor '.*weight_scale_2'"):
        read_weight({k: v for k, v in mo.items() if not k.endswith("_scale_2")}, name, moq)
    with pytest.raises(ValueError, match=r"weight_scale'.*expected shape \(64, 8\).*found \(64, 4\)"):
        read_weight({**mo, name + "_scale": mo[name + "_scale"][:, :4]}, name, moq)

    ct = write_quantized({name: torch.randn(64, 128)}, "nvfp4-ct")
    ctq = QuantConfig("nvfp4-ct", "compressed-tensors")
    with pytest.raises(ValueError, match="missing tensor '.*weight_global_scale'"):
        read_weight({k: v for k, v in ct.items() if not k.endswith("_global_scale")}, name, ctq)
    with pytest.raises(ValueError, match=r"weight_global_scale'.*expected shape.*found \(2,\)"):
        read_weight({**ct, name + "_global_scale": torch.ones(2)}, name, ctq)
    w = read_weight(ct, name, ctq)
    torch.testing.assert_close(w.weight_scale_2, 1 / ct[name + "_global_scale"].reshape(()))


# ---------------------------------------------------------------- CLI bad arguments
def test_cli_bad_arguments(ckpts, tmp_path, capsys):
    src, _ = ckpts["qwen"]
    busy = tmp_path / "busy"
    busy.mkdir()
    (busy / "x").write_text("x")
    bad = [
        [],                                                                          # no subcommand
        ["quantize", "--input", src, "--output", str(tmp_path / "o")],               # no format
        ["quantize", "--input", str(tmp_path / "nope"), "--output", str(tmp_path / "o"), "--format", "fp8"],
        ["quantize", "--input", src, "--output", str(tmp_path / "o"), "--format", "int4"],
        ["quantize", "--input", src, "--output", str(busy), "--format", "fp8"],
        ["quantize", "--input", src, "--output", str(tmp_path / "o"), "--format", "fp8", "--exclude", "("],
        ["quantize", "--input", str(tmp_path), "--output", str(tmp_path / "o"), "--format", "fp8"],  # no config
    ]
    for argv in bad:
        with pytest.raises(SystemExit) as exc:
            main(argv)
        assert exc.value.code == 2, argv
        err = capsys.readouterr().err
        assert "error" in err and "Traceback" not in err
    assert not (tmp_path / "o").exists()
    # an already quantized input is refused too
    done = str(tmp_path / "done")
    assert main(["quantize", "--input", src, "--output", done, "--format", "mxfp4"]) == 0
    with pytest.raises(SystemExit) as exc:
        main(["quantize", "--input", done, "--output", str(tmp_path / "o2"), "--format", "fp8"])
    assert exc.value.code == 2 and "already quantized" in capsys.readouterr().err


def test_python_m_entry_point(tmp_path):
    r = subprocess.run([sys.executable, "-m", "dynamoe.cli", "quantize", "--input", str(tmp_path / "nope"),
                        "--output", str(tmp_path / "o"), "--format", "mxfp4"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "is not a directory" in r.stderr and "Traceback" not in r.stderr


@pytest.mark.parametrize("fmt", FORMATS)
@pytest.mark.parametrize("kinds", ["lm_head", "attention,lm_head", "experts,attention,mlp,lm_head"])
def test_modules_select_what_is_quantized(ckpts, tmp_path, fmt, kinds):
    """--modules picks the kinds of weights (routed experts, attention projections, other layer Linears, the
    head); routers, norms and embeddings stay dense whatever is asked, and the config lists what stayed dense."""
    src, orig = ckpts["qwen"]
    out, qcfg = run_quantize(src, str(tmp_path / "out"), fmt, "--modules", kinds)
    want = set()
    for name in orig:
        if "lm_head" in kinds and name == "lm_head.weight":
            want.add(name)
        if "attention" in kinds and ".self_attn." in name and name.endswith("_proj.weight"):
            want.add(name)
        if "experts" in kinds and ".mlp.experts." in name:
            want.add(name)
    for name, w in orig.items():
        got = read_weight(out, name, qcfg)
        assert isinstance(got, QuantizedWeight) == (name in want), name
        if name in want:
            assert_close_to_original(got, w)
    qc = json.load(open(tmp_path / "out" / "config.json"))["quantization_config"]
    dense = set(qc.get("modules_to_not_convert", qc.get("ignore", qc.get("exclude_modules", []))))
    assert ("lm_head" in dense) is False and "model.layers.0.mlp.gate" in dense
    assert ("model.layers.0.self_attn.q_proj" in dense) == ("attention" not in kinds)


def test_modules_errors_and_tied_heads(ckpts, tmp_path, capsys):
    src, _ = ckpts["qwen"]
    for bad in ("experts,router", "", "embeddings"):
        with pytest.raises(SystemExit) as exc:
            main(["quantize", "--input", src, "--output", str(tmp_path / "o"), "--format", "fp8", "--modules", bad])
        assert exc.value.code == 2
        err = capsys.readouterr().err
        assert "--modules" in err and "['experts', 'attention', 'mlp', 'lm_head']" in err, err
    # a head tied to the embeddings is the embedding table: kept dense, and said so
    tied = str(tmp_path / "tied")
    write_checkpoint(tied, qwen3_moe_tensors(), {**QWEN_CONFIG, "tie_word_embeddings": True})
    out, qcfg = run_quantize(tied, str(tmp_path / "tied_q"), "nvfp4-ct", "--modules", "experts,lm_head")
    assert "lm_head is tied to the embeddings" in capsys.readouterr().out
    assert not isinstance(read_weight(out, "lm_head.weight", qcfg), QuantizedWeight)
