"""INT4 (compressed-tensors pack-quantized, W4A16): the on-disk packing written here from the format's
description (not with dynamoe's packer), the reader and its errors, the config parsing and its errors,
and a tiny DeepSeek-V3 checkpoint with INT4 routed experts against the model of its dequantized weights."""
import json

import pytest
import torch

from int4_util import KIMI_QC, int4_qc as _qc, spec_pack, spec_weight
from dynamoe import quant
from dynamoe.quant.checkpoint import parse_quant_config, quant_config_from_dir, read_weight
from dynamoe.quant.int4 import INT4Weight, pack_int4, unpack_int4

@pytest.mark.parametrize("shape,group", [((5, 64), 32), ((3, 44), 32), ((4, 40), 16), ((2, 96), 128)])
def test_packing_matches_the_format(shape, group):
    q, scale, dense = spec_weight(*shape, group, seed=shape[1])
    packed = spec_pack(q)
    assert torch.equal(pack_int4(q), packed)
    assert torch.equal(unpack_int4(packed, shape[1]), q.to(torch.int8))
    w = INT4Weight(packed, scale, shape, group)
    assert torch.equal(w.dequantize(torch.float32), dense)
    # one element's place: q[0, 9] is word 1, nibble 1
    assert ((int(packed[0, 1]) >> 4) & 15) - 8 == int(q[0, 9])


def test_quantize_round_trip_and_rows():
    w = torch.randn(3, 7, 72)
    q = quant.quantize(w, "int4", group_size=32)
    assert q.shape == (3, 7, 72) and q.weight_packed.shape == (3, 7, 9) and q.weight_scale.shape == (3, 7, 3)
    err = (q.dequantize(torch.float32) - w).abs()
    step = q.weight_scale.float().repeat_interleave(32, -1)[..., :72]
    # the nearest of the 16 levels; +amax maps to 7.5 (and a little more, the scale being bf16), clamped to 7
    assert (err <= step * 0.56).all() and (err <= step * 0.5 + 1e-6).float().mean() > 0.9
    assert torch.equal(q[1].dequantize(torch.float32), q.dequantize(torch.float32)[1])
    assert q.bits_per_weight == pytest.approx(4 + 16 * 3 / 72)
    with pytest.raises(ValueError, match="group_size"):
        quant.quantize(w, "int4", group_size=0)
    with pytest.raises(ValueError, match="weight_scale must have shape"):
        INT4Weight(q.weight_packed, q.weight_scale[..., :2], q.shape, 32)
    with pytest.raises(ValueError, match="weight_packed must be int32"):
        INT4Weight(q.weight_packed.view(torch.float32), q.weight_scale, q.shape, 32)


# ---------------------------------------------------------------- config
def test_kimi_config_parses():
    q = parse_quant_config(KIMI_QC)
    assert (q.kind, q.group_size, q.exclude[0]) == ("int4-ct", 32, "lm_head")
    channel = json.loads(json.dumps(KIMI_QC))
    channel["config_groups"]["group_0"]["weights"].update(strategy="channel", group_size=None)
    assert parse_quant_config(channel).group_size is None


@pytest.mark.parametrize("qc,match", [
    (_qc(symmetric=False), r"symmetric.*asymmetric INT4.*weight_zero_point.*not supported"),
    (_qc(num_bits=8), r"num_bits is 8; supported: 4"),
    (_qc(type="float"), r"type is 'float'; supported: 'int'"),
    (_qc(strategy="tensor"), r"strategy is 'tensor'; supported: 'group', 'channel'"),
    (_qc(group_size=None), r"group_size is None"),
    (_qc(actorder="group"), r"actorder.*weight_g_idx.*not supported"),
    ({**KIMI_QC, "config_groups": {"group_0": {**KIMI_QC["config_groups"]["group_0"],
                                               "input_activations": {"num_bits": 8, "type": "int"}}}},
     "activation quantization is not supported"),
    ({**KIMI_QC, "config_groups": {"a": KIMI_QC["config_groups"]["group_0"],
                                   "b": _qc(group_size=64)["config_groups"]["group_0"]}}, "different group sizes"),
])
def test_bad_int4_configs_are_rejected(qc, match):
    with pytest.raises(ValueError, match=match):
        parse_quant_config(qc)


def test_quant_config_under_text_config(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "text_config": {
        "model_type": "deepseek_v3", "quantization_config": KIMI_QC}}))
    assert quant_config_from_dir(tmp_path).kind == "int4-ct"
    (tmp_path / "config.json").write_text(json.dumps({"model_type": "kimi_k25", "quantization_config": _qc(group_size=64),
                                                      "text_config": {"quantization_config": KIMI_QC}}))
    with pytest.raises(ValueError, match="differ"):
        quant_config_from_dir(tmp_path)


# ---------------------------------------------------------------- reader
def test_reader_builds_the_weight_and_names_bad_tensors():
    qcfg = parse_quant_config(KIMI_QC)
    q, scale, dense = spec_weight(6, 40, 32, seed=3)
    name = "model.layers.1.mlp.experts.0.up_proj.weight"
    base = name[: -len(".weight")]
    good = {base + ".weight_packed": spec_pack(q), base + ".weight_scale": scale,
            base + ".weight_shape": torch.tensor([6, 40])}
    w = read_weight(good, name, qcfg)
    assert isinstance(w, INT4Weight) and w.shape == (6, 40) and w.group_size == 32
    assert torch.equal(w.dequantize(torch.float32), dense)
    dense_name = "model.layers.0.self_attn.o_proj.weight"       # in `ignore`: stored bf16
    assert read_weight({dense_name: torch.ones(2, 2)}, dense_name, qcfg).shape == (2, 2)
    bad = [
        ({**good, base + ".weight_zero_point": torch.zeros(1, 2, dtype=torch.int32)}, "weight_zero_point.*asymmetric"),
        ({**good, base + ".weight_g_idx": torch.zeros(40, dtype=torch.int32)}, "weight_g_idx.*reordering"),
        ({k: v for k, v in good.items() if not k.endswith("weight_shape")}, "missing tensor.*weight_shape"),
        ({k: v for k, v in good.items() if not k.endswith("weight_packed")}, "missing tensor.*weight_packed"),
        ({**good, base + ".weight_shape": torch.tensor([6, 72])}, r"weight_shape.*ceil\(in/8\)=5"),
        ({**good, base + ".weight_scale": scale[:, :1]}, r"weight_scale.*expected shape \(6, 2\)"),
        ({**good, base + ".weight_packed": spec_pack(q).view(torch.float32)}, "weight_packed.*int32"),
    ]
    for tensors, match in bad:
        with pytest.raises(ValueError, match=match):
            read_weight(tensors, name, qcfg)
    # the channel strategy: one scale per row
    q, scale, dense = spec_weight(6, 40, 40, seed=4)
    channel = parse_quant_config(_qc(strategy="channel", group_size=None))
    w = read_weight({base + ".weight_packed": spec_pack(q), base + ".weight_scale": scale,
                     base + ".weight_shape": torch.tensor([6, 40])}, name, channel)
    assert w.group_size == 40 and torch.equal(w.dequantize(torch.float32), dense)
