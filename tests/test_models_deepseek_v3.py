"""DeepSeek-V3 (and Kimi-K2) against transformers on tiny random checkpoints: MLA with q_lora_rank and
without, interleaved and half-split RoPE, YaRN with both mscales, a dense first layer, sigmoid routing
with a selection bias and group-limited top-k, shared experts; the latent-only KV cache and weight
absorption; MTP layers loaded as heads; a blockwise-FP8 checkpoint with unaligned shapes."""
import json
import os
import shutil

import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import check_cached_decode, check_greedy, check_logits, check_ragged_batch
from models_mla_util import (BASE, GROUPS, MLA, YARN, add_mtp_layers, check_absorption, check_group_routing_differs,
                             dequantized_reference, edit_config, ids, make_pair)

transformers = pytest.importorskip("transformers")

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.deepseek_v3 import DeepseekV3ForCausalLM  # noqa: E402
from dynamoe.models.mla import MLAttention  # noqa: E402
from dynamoe.models.moe_block import GatedMLP, SparseMoeBlock  # noqa: E402

VARIANTS = {
    # q_lora_rank set, interleaved RoPE, YaRN (mscale != mscale_all_dim), 4 groups / 2 kept, renormalised
    "q_lora": dict(**MLA, **GROUPS, rope_parameters=YARN),
    # q_proj (q_lora_rank null), half-split RoPE, plain RoPE, 2 groups / 1 kept, raw weights, 2 shared experts
    "q_proj": dict(**{**MLA, "q_lora_rank": None}, n_group=2, topk_group=1, rope_interleave=False, norm_topk_prob=False,
                   n_shared_experts=2, rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
}


def tiny_config(**overrides):
    return transformers.DeepseekV3Config(**{**BASE, **overrides})


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    hf, path = make_pair(transformers.DeepseekV3ForCausalLM, tiny_config(**VARIANTS[request.param]),
                         tmp_path_factory.mktemp(f"dsv3_{request.param}"))
    return request.param, hf, dm.load(path, progress=False), path


def test_structure_and_latent_cache(pair):
    name, hf, ours, _ = pair
    assert isinstance(ours, DeepseekV3ForCausalLM)
    assert [type(layer.mlp) for layer in ours.model.layers] == [GatedMLP, SparseMoeBlock, SparseMoeBlock]
    attn = ours.model.layers[0].self_attn
    assert isinstance(attn, MLAttention) and attn.rope_interleaved == (name == "q_lora")
    assert hasattr(attn, "q_a_proj") != hasattr(attn, "q_proj")
    assert hasattr(attn, "q_a_proj") == (name == "q_lora")
    for _, block in ours.moe_layers():
        gate = block.moe.config.gates[0]
        assert (gate.type, gate.route_scale, gate.capacity_factor) == ("sigmoid", 2.5, 0)
        assert (gate.n_group, gate.topk_group) == ((4, 2) if name == "q_lora" else (2, 1))
        assert block.moe.gates[0].e_score_correction_bias.abs().min() > 0
        assert block.moe.shared_experts.gate_proj.out_features == 32 * (1 if name == "q_lora" else 2)
    # the cache holds the compressed latent and the roped key only: C + r numbers per token and layer
    # ([1 head, blocks, block_size, dim]: 2 slots of 16 positions = 2 blocks of 16)
    cache = ours.new_cache(2, 16)
    with torch.no_grad():
        ours(ids(tokens=5), cache=cache)
    for layer in cache.layers:
        assert {k: tuple(v.shape) for k, v in layer.items()} == {"latent": (1, 2, 16, 32), "k_rope": (1, 2, 16, 8)}


def test_logits_match_transformers(pair):
    _, hf, ours, _ = pair
    check_logits(hf, ours, ids())


def test_group_limited_routing_differs_from_plain_topk(pair):
    check_group_routing_differs(pair[1], ids())


def test_greedy_matches_generate(pair):
    _, hf, ours, _ = pair
    check_greedy(hf, ours, ids(seed=1), new_tokens=16)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[2], ids(seed=2), prefill=9)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[2])


def test_weight_absorption_equals_expansion(pair):
    """Absorbed (kv_b folded into q and o) and expanded attention agree, prefill and decode."""
    ours = pair[2]
    check_absorption(ours, ids(seed=3))
    attn = ours.model.layers[0].self_attn
    assert attn._use_absorption(1, 20) and not attn._use_absorption(20, 20)  # by cost: decode absorbs, prefill expands


def test_kimi_k2_and_mtp_layers(pair, tmp_path):
    """``model_type: kimi_k2`` is DeepSeek-V3; a multi-token-prediction layer past num_hidden_layers loads as the
    ``mtp`` head (its embedding / lm_head copies shared with the model's) and leaves the model's output as is."""
    _, _, ours, path = pair
    kimi = str(tmp_path / "kimi")
    shutil.copytree(path, kimi)
    edit_config(kimi, model_type="kimi_k2", num_nextn_predict_layers=1)
    add_mtp_layers(kimi)
    cfg = dm.load_config(kimi)
    assert (cfg.model_type, dm.family_for(cfg), cfg.num_nextn_predict_layers) == ("kimi_k2", "deepseek_v3", 1)
    model = dm.load(kimi, progress=False)
    assert type(model) is DeepseekV3ForCausalLM and len(model.model.layers) == 3 and len(model.mtp) == 1
    assert model.mtp[0].embed_tokens is model.model.embed_tokens and model.mtp[0].shared_head.head is model.lm_head
    assert not ours.has_mtp
    x = ids()
    with torch.no_grad():
        torch.testing.assert_close(model(x), ours(x), atol=0, rtol=0)


def test_bf16_follows_transformers_bf16(pair):
    """In bf16 (fp32 router and selection bias) we follow transformers' own bf16 run; both drift from
    fp32 alike (a random tiny model amplifies rounding), so bf16 is compared with bf16."""
    _, _, _, path = pair
    ours = dm.load(path, dtype=torch.bfloat16, progress=False)
    ref = transformers.DeepseekV3ForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    assert ours.model.layers[1].mlp.moe.gates[0].wg.weight.dtype == torch.float32
    x = ids()
    with torch.no_grad():
        got, want = ours(x).float(), ref(x).logits.float()
        steps = torch.cat([ours(x[:, :20], cache=(c := ours.new_cache(2, 24)))] +
                          [ours(x[:, t:t + 1], cache=c) for t in range(20, 24)], 1).float()
    assert (got - want).abs().mean() < 0.01 * want.abs().max()
    assert (got.argmax(-1) == want.argmax(-1)).float().mean() > 0.9
    assert (steps - got).abs().mean() < 0.01 * want.abs().max()  # bf16 absorbed decode vs expanded prefill


def test_hub_style_config_parses_the_same(pair):
    """A hub config.json (rope_scaling with 'type', rope_theta at the top, no head_dim) gives the same model."""
    name, _, _, path = pair
    with open(os.path.join(path, "config.json")) as f:
        d = json.load(f)
    rope = dict(d.pop("rope_parameters"))
    d.pop("head_dim")
    d["rope_theta"] = rope.pop("rope_theta")
    d["rope_scaling"] = None if rope["rope_type"] == "default" else {("type" if k == "rope_type" else k): v
                                                                     for k, v in rope.items()}
    hub, saved = dm.ModelConfig.from_dict(d), dm.load_config(path)
    assert hub.rope == saved.rope and hub.q_lora_rank == saved.q_lora_rank
    assert (hub.kv_lora_rank, hub.qk_rope_head_dim, hub.n_group, hub.topk_group) == \
           (saved.kv_lora_rank, saved.qk_rope_head_dim, saved.n_group, saved.topk_group)


def test_missing_fields_take_transformers_defaults():
    cfg = dm.ModelConfig.from_dict({"model_type": "deepseek_v3", "vocab_size": 64, "hidden_size": 64,
                                    "num_hidden_layers": 1, "num_attention_heads": 4, "n_routed_experts": 8,
                                    "num_experts_per_tok": 2, "moe_intermediate_size": 16})
    assert (cfg.q_lora_rank, cfg.kv_lora_rank, cfg.qk_nope_head_dim, cfg.qk_rope_head_dim, cfg.v_head_dim) == \
           (1536, 512, 128, 64, 128)
    assert (cfg.n_group, cfg.topk_group, cfg.routed_scaling_factor, cfg.first_k_dense_replace) == (8, 4, 2.5, 3)
    assert cfg.rope_interleave and cfg.norm_topk_prob
    null_q = dm.ModelConfig.from_dict({**cfg.raw, "q_lora_rank": None})
    assert null_q.q_lora_rank is None  # an explicit null means q_proj


# ---------------------------------------------------------------------------------------- FP8
def test_fp8_unaligned_checkpoint(tmp_path):
    """`dynamoe quantize --format fp8` of a DeepSeek whose dims are not multiples of 128 (partial edge
    blocks everywhere: 144 x 144 q_a/kv_a, 200-wide dense MLP) loads with every decoder Linear packed
    and matches the dequantize-then-fp32 reference."""
    from dynamoe.cli import quantize_checkpoint
    from dynamoe.quant.modules import QuantizedExperts, QuantizedLinear

    cfg = tiny_config(**{**MLA, **GROUPS, "q_lora_rank": 136, "kv_lora_rank": 136, "hidden_size": 144,
                         "intermediate_size": 200, "moe_intermediate_size": 128, "rope_parameters": YARN})
    hf, dense = make_pair(transformers.DeepseekV3ForCausalLM, cfg, tmp_path / "dense", seed=4)
    qdir = str(tmp_path / "fp8")
    quantize_checkpoint(dense, qdir, "fp8", log=lambda *a: None)
    model = dm.load(qdir, progress=False)
    attn, dense_mlp, moe = model.model.layers[0].self_attn, model.model.layers[0].mlp, model.model.layers[1].mlp
    for lin in (attn.q_a_proj, attn.q_b_proj, attn.kv_a_proj_with_mqa, attn.kv_b_proj, attn.o_proj, dense_mlp.gate_proj,
                dense_mlp.up_proj, dense_mlp.down_proj, moe.moe.shared_experts.gate_proj):
        assert isinstance(lin, QuantizedLinear) and lin.format == "fp8_block"
    assert isinstance(moe.moe.experts, QuantizedExperts)           # F = 128: gate/up fuse packed
    assert not isinstance(moe.moe.gates[0].wg, QuantizedLinear)     # the router stays dense
    ref = transformers.DeepseekV3ForCausalLM.from_pretrained(
        dequantized_reference(qdir, dense, str(tmp_path / "ref")), dtype=torch.float32).eval()
    x = ids()
    with torch.no_grad():
        got, want, orig = model(x), ref(x).logits, hf(x).logits
    assert (want - orig).abs().max() > 1e-3  # the quantization did change the model
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
    # decode steps (absorption: kv_b dequantized once) agree with the full recompute
    cache = model.new_cache(2, 24)
    with torch.no_grad():
        steps = [model(x[:, :20], cache=cache)] + [model(x[:, t:t + 1], cache=cache) for t in range(20, 24)]
    torch.testing.assert_close(torch.cat(steps, 1), got, atol=1e-4, rtol=0)
