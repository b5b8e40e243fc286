"""dynamoe.models.load: sharded checkpoints, clear errors (missing / unexpected / mis-shaped tensors,
.bin-only folders, unknown families, bad config fields), bf16, both config styles, and quantized
checkpoints (made by ``dynamoe quantize``) against the dense model of their dequantized weights."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, randomize_, save_tiny

transformers = pytest.importorskip("transformers")

import dynamoe.models as dm  # noqa: E402
from dynamoe.cli import quantize_checkpoint  # noqa: E402
from dynamoe.models import ModelConfig  # noqa: E402
from dynamoe.quant import QuantizedExperts, QuantizedLinear, QuantizedWeight  # noqa: E402
from dynamoe.quant.checkpoint import quant_config_from_dir, read_weight  # noqa: E402
from dynamoe.quant.checkpoint_files import CheckpointTensors  # noqa: E402


def qwen3(moe_intermediate=32, seed=1, **kw):
    cfg = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=96,
                                      moe_intermediate_size=moe_intermediate, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, num_experts=4, num_experts_per_tok=2,
                                      norm_topk_prob=True, max_position_embeddings=256, **kw)
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(cfg).eval()
    randomize_(hf, seed=seed)
    return hf


def gpt_oss(seed=3):
    cfg = transformers.GptOssConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, num_hidden_layers=2,
                                    num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4,
                                    num_experts_per_tok=2, sliding_window=8, max_position_embeddings=256)
    torch.manual_seed(0)
    hf = transformers.GptOssForCausalLM(cfg).eval()
    randomize_(hf, seed=seed, scales={"experts.gate_up_proj": 0.3, "experts.down_proj": 0.05, "sinks": 1.0})
    return hf


IDS = torch.randint(0, VOCAB, (2, 24), generator=torch.Generator().manual_seed(0))


@pytest.fixture(scope="module")
def qwen3_dir(tmp_path_factory):
    hf = qwen3()
    return hf, save_tiny(hf, tmp_path_factory.mktemp("qwen3"))


def _logits(model, ids=IDS):
    with torch.no_grad():
        return model(ids).logits if hasattr(model, "generate") else model(ids)


def _copy(src, dst, edit=None):
    """A copy of checkpoint folder src with its (single) safetensors file edited by edit(dict)."""
    shutil.copytree(src, dst)
    if edit is not None:
        path = os.path.join(dst, "model.safetensors")
        tensors = load_file(path)
        edit(tensors)
        save_file(tensors, path, metadata={"format": "pt"})
    return str(dst)


# ---------------------------------------------------------------------------------------- files
def test_sharded_checkpoint(qwen3_dir, tmp_path):
    hf, single = qwen3_dir
    sharded = save_tiny(hf, tmp_path / "sharded", max_shard_size="40KB")
    index = json.load(open(os.path.join(sharded, "model.safetensors.index.json")))
    assert len(set(index["weight_map"].values())) > 3
    ref = _logits(dm.load(single, progress=False))
    torch.testing.assert_close(_logits(dm.load(sharded, progress=False)), ref, atol=0, rtol=0)
    torch.testing.assert_close(ref, _logits(hf), atol=1e-4, rtol=0)


def test_missing_tensor(qwen3_dir, tmp_path):
    name = "model.layers.1.self_attn.k_proj.weight"
    path = _copy(qwen3_dir[1], tmp_path / "ck", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=rf"missing tensor '{name}'.*expected shape \(32, 64\)"):
        dm.load(path, progress=False)


def test_missing_expert_tensor(qwen3_dir, tmp_path):
    name = "model.layers.0.mlp.experts.3.up_proj.weight"
    path = _copy(qwen3_dir[1], tmp_path / "ck", lambda t: t.pop(name))
    with pytest.raises(ValueError, match=name):
        dm.load(path, progress=False)


@pytest.mark.parametrize("name,shape,expected", [
    ("model.layers.0.self_attn.q_proj.weight", (64, 63), (64, 64)),
    ("model.layers.1.mlp.experts.2.down_proj.weight", (64, 16), (64, 32)),
    ("model.layers.0.self_attn.q_norm.weight", (8,), (16,)),
])
def test_misshaped_tensor(qwen3_dir, tmp_path, name, shape, expected):
    def edit(t):
        t[name] = torch.zeros(shape)

    path = _copy(qwen3_dir[1], tmp_path / "ck", edit)
    with pytest.raises(ValueError, match=rf"'{name}': expected shape \({expected[0]}, ?{expected[1] if len(expected) > 1 else ''}\), found \({shape[0]}"):
        dm.load(path, progress=False)


def test_unexpected_tensor(qwen3_dir, tmp_path):
    def edit(t):
        t["model.layers.0.mlp.shared_expert.weight"] = torch.zeros(4)

    path = _copy(qwen3_dir[1], tmp_path / "ck", edit)
    with pytest.raises(ValueError, match=r"unexpected tensors.*model\.layers\.0\.mlp\.shared_expert\.weight"):
        dm.load(path, progress=False)


def test_bin_only_folder(qwen3_dir, tmp_path):
    folder = tmp_path / "bin"
    folder.mkdir()
    shutil.copy(os.path.join(qwen3_dir[1], "config.json"), folder)
    torch.save({}, folder / "pytorch_model.bin")
    with pytest.raises(ValueError, match=r"pytorch_model\.bin.*safetensors only"):
        dm.load(folder, progress=False)


def test_bf16(qwen3_dir):
    hf, path = qwen3_dir
    model = dm.load(path, dtype=torch.bfloat16, progress=False)
    assert model.dtype == torch.bfloat16 and model.model.layers[0].mlp.moe.experts.gate_up_proj.dtype == torch.bfloat16
    assert model.model.layers[0].mlp.moe.gates[0].wg.weight.dtype == torch.float32  # fp32 router
    got, ref = _logits(model).float(), _logits(hf)
    # bf16 rounding (and the odd routing flip it causes): close on average, same top-1 almost everywhere
    assert (got - ref).abs().mean() < 0.02 * ref.abs().max()
    assert (got.argmax(-1) == ref.argmax(-1)).float().mean() > 0.9
    cache = model.new_cache(2, 30)
    assert cache.dtype == torch.bfloat16
    with torch.no_grad():
        model(IDS, cache=cache)


# ---------------------------------------------------------------------------------------- config
def test_config_styles_agree():
    base = dict(model_type="gpt_oss", vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, head_dim=16, intermediate_size=64, num_local_experts=4, num_experts_per_tok=2,
                max_position_embeddings=4096, rms_norm_eps=1e-5, sliding_window=128)
    yarn = {"factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False, "original_max_position_embeddings": 4096}
    hub = ModelConfig.from_dict({**base, "rope_theta": 150000, "rope_scaling": {"type": "yarn", **yarn}})
    tf5 = ModelConfig.from_dict({**base, "rope_parameters": {"rope_type": "yarn", "rope_theta": 150000.0, **yarn}})
    assert hub == tf5 and hub.rope.rope_type == "yarn" and hub.rope.theta == 150000
    # expert-count aliases
    counts = {ModelConfig.from_dict({**{k: v for k, v in base.items() if k != "num_local_experts"}, key: 4}).num_experts
              for key in ("num_experts", "num_local_experts", "n_routed_experts")}
    assert counts == {4}
    # GPT-OSS defaults (as transformers fills them in): YaRN, alternating sliding/full layers
    d = ModelConfig.from_dict(base)
    assert d.rope == tf5.rope and d.layer_types == ("sliding_attention", "full_attention")
    # hub style with no rope_scaling at all: default RoPE at rope_theta
    plain = ModelConfig.from_dict({**base, "model_type": "qwen3_moe", "rope_theta": 1e6, "rope_scaling": None})
    assert plain.rope.rope_type == "default" and plain.rope.theta == 1e6


def test_saved_configs_parse(qwen3_dir):
    cfg = dm.load_config(qwen3_dir[1])
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.norm_topk_prob) == (4, 2, 32, True)
    assert cfg.layer_types == ("full_attention",) * 2 and cfg.rope.rope_type == "default"


@pytest.mark.parametrize("field,value", [("num_attention_heads", 0), ("num_key_value_heads", 3), ("num_experts_per_tok", 9),
                                         ("rope_scaling", {"type": "nope"}), ("layer_types", ["full_attention"]),
                                         ("tie_word_embeddings", "yes"), ("rms_norm_eps", -1.0)])
def test_bad_config_field(field, value):
    d = dict(model_type="qwen3_moe", vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             num_key_value_heads=2, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2)
    d[field] = value
    with pytest.raises(ValueError, match="rope_type" if field == "rope_scaling" else field):
        ModelConfig.from_dict(d)


def test_unknown_family(qwen3_dir, tmp_path):
    path = _copy(qwen3_dir[1], tmp_path / "ck")
    cfg = json.load(open(os.path.join(path, "config.json")))
    cfg["model_type"], cfg["architectures"] = "llama4_moe", ["Llama4MoeForCausalLM"]
    json.dump(cfg, open(os.path.join(path, "config.json"), "w"))
    with pytest.raises(ValueError, match=r"unsupported model_type 'llama4_moe'.*supported: ") as err:
        dm.load(path, progress=False)
    assert str(err.value).endswith(", ".join(dm.supported_families()))
    assert {"gpt_oss", "kimi_k2", "mixtral", "qwen3_moe"} <= set(dm.supported_families())


def test_progress_bar_goes_to_stderr(qwen3_dir, capsys):
    dm.load(qwen3_dir[1], progress=True)
    out, err = capsys.readouterr()
    assert out == "" and "loading" in err


# ---------------------------------------------------------------------------------------- quantized
def _dequantized_copy(qdir: str, dense_dir: str, dst) -> str:
    """The dense checkpoint whose weights are the quantized checkpoint's, dequantized (fp32), under
    the dense checkpoint's names and layouts -- the reference a quantized model must match."""
    os.makedirs(dst)
    qcfg = quant_config_from_dir(qdir)
    qt, names = CheckpointTensors(qdir), list(CheckpointTensors(dense_dir))
    out = {}
    for name in names:
        w = read_weight(qt, name, qcfg)
        if isinstance(w, QuantizedWeight):
            w = w.dequantize(torch.float32)
            if name.endswith(("experts.gate_up_proj", "experts.down_proj")):  # GPT-OSS: MXFP4 out->in, dense in->out
                w = w.transpose(-1, -2)
        out[name] = w.float().contiguous()
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(os.path.join(dense_dir, "config.json"), dst)
    return str(dst)


ALL = frozenset({"experts", "attention", "mlp", "lm_head"})
QUANT_CASES = [  # (family, format, moe_intermediate, experts class, --modules, packed Linears)
    ("qwen3_moe", "fp8", 128, QuantizedExperts, None, 8),   # FP8 experts fused (F = one block of rows)
    ("qwen3_moe", "fp8", 32, None, None, 8),                # F not a block multiple: dense experts, packed Linears
    ("qwen3_moe", "mxfp4", 32, QuantizedExperts, None, 0),
    ("qwen3_moe", "nvfp4-modelopt", 32, QuantizedExperts, None, 8),
    ("qwen3_moe", "nvfp4-ct", 32, QuantizedExperts, None, 8),
    ("qwen3_moe", "int4-ct", 32, QuantizedExperts, None, 0),  # compressed-tensors pack-quantized INT4, experts only
    ("gpt_oss", "mxfp4", None, QuantizedExperts, None, 0),
    ("gpt_oss", "fp8", None, None, None, 8),                 # GPT-OSS fp8: attention packed, fused experts dense
    # --modules: the attention and the head too (4-bit models read about half their bytes in a bf16 head)
    ("qwen3_moe", "mxfp4", 32, QuantizedExperts, ALL, 9),
    ("qwen3_moe", "int4-ct", 32, QuantizedExperts, ALL, 9),
    ("qwen3_moe", "nvfp4-ct", 32, QuantizedExperts, ALL, 9),
    ("qwen3_moe", "fp8", 128, QuantizedExperts, {"experts", "lm_head"}, 1),
    ("gpt_oss", "mxfp4", None, QuantizedExperts, ALL, 9),
]


@pytest.mark.parametrize("family,fmt,moe_intermediate,experts_cls,modules,n_linear", QUANT_CASES)
def test_quantized_matches_dequantized(tmp_path, family, fmt, moe_intermediate, experts_cls, modules, n_linear):
    hf = qwen3(moe_intermediate) if family == "qwen3_moe" else gpt_oss()
    dense = save_tiny(hf, tmp_path / "dense")
    qdir = str(tmp_path / "q")
    quantize_checkpoint(dense, qdir, fmt, log=lambda *a: None, modules=modules)
    model = dm.load(qdir, progress=False)
    experts = model.model.layers[0].mlp.moe.experts
    if experts_cls is not None:
        assert isinstance(experts, experts_cls)
    else:
        assert not isinstance(experts, QuantizedExperts)
    assert sum(isinstance(m, QuantizedLinear) for m in model.modules()) == n_linear
    assert isinstance(model.lm_head, QuantizedLinear) == (modules is not None and "lm_head" in modules)
    qc = json.load(open(os.path.join(qdir, "config.json")))["quantization_config"]
    dense_list = qc.get("modules_to_not_convert", qc.get("ignore", qc.get("exclude_modules", [])))
    assert ("lm_head" in dense_list) != isinstance(model.lm_head, QuantizedLinear)  # the config says which
    ref_dir = _dequantized_copy(qdir, dense, tmp_path / "ref")
    ref = transformers.AutoModelForCausalLM.from_pretrained(ref_dir, dtype=torch.float32).eval()
    got, want = _logits(model), _logits(ref)
    assert (want - _logits(hf)).abs().max() > 1e-3  # the quantization did change the model
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    # decode-sized steps (the packed-weight kernels) agree with the full recompute
    cache = model.new_cache(2, 24)
    with torch.no_grad():
        steps = [model(IDS[:, :20], cache=cache)] + [model(IDS[:, t:t + 1], cache=cache) for t in range(20, 24)]
    torch.testing.assert_close(torch.cat(steps, 1), got, atol=1e-4, rtol=0)
