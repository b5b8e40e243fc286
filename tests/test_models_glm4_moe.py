"""GLM-4.5 against transformers on tiny random checkpoints: GQA with q/k/v biases and per-head q/k
norm, partial (half) RoPE half-split, a dense first layer, DeepSeek routing (sigmoid, selection bias,
group-limited top-k, routed_scaling_factor) with shared experts."""
import json
import os

import pytest

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch
from models_mla_util import check_group_routing_differs, ids, make_pair

transformers = pytest.importorskip("transformers")

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.glm4_moe import Glm4MoeForCausalLM  # noqa: E402
from dynamoe.models.moe_block import GatedMLP, SparseMoeBlock  # noqa: E402

VARIANTS = {
    # GLM-4.5's shape: q/k/v bias, qk norm, half RoPE (the config default), groups that matter
    "bias_qknorm": dict(attention_bias=True, use_qk_norm=True, n_group=4, topk_group=2, routed_scaling_factor=2.5),
    # no bias, no qk norm, a quarter of each head rotates, one group (GLM-4.5's usual n_group=1), raw weights
    "plain": dict(attention_bias=False, use_qk_norm=False, norm_topk_prob=False, n_shared_experts=2,
                  rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "partial_rotary_factor": 0.25}),
}


def tiny_config(**overrides):
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
              first_k_dense_replace=1, n_shared_experts=1, max_position_embeddings=256, bos_token_id=None,
              eos_token_id=None)
    kw.update(overrides)
    return transformers.Glm4MoeConfig(**kw)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    hf, path = make_pair(transformers.Glm4MoeForCausalLM, tiny_config(**VARIANTS[request.param]),
                         tmp_path_factory.mktemp(f"glm4_{request.param}"))
    return request.param, hf, dm.load(path, progress=False), path


def test_structure(pair):
    name, _, ours, _ = pair
    assert isinstance(ours, Glm4MoeForCausalLM)
    assert [type(layer.mlp) for layer in ours.model.layers] == [GatedMLP, SparseMoeBlock, SparseMoeBlock]
    attn = ours.model.layers[0].self_attn
    assert all((proj.bias is not None) == (name != "plain") for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert attn.o_proj.bias is None
    assert (attn.q_norm is not None) == (name != "plain")
    assert ours.model.rotary_emb.dim == (8 if name != "plain" else 4)  # partial RoPE: 0.5 / 0.25 of head_dim 16
    for _, block in ours.moe_layers():
        gate = block.moe.config.gates[0]
        assert gate.type == "sigmoid" and gate.normalize == (name != "plain")
        assert (gate.n_group, gate.topk_group) == ((4, 2) if name != "plain" else (1, 1))
        assert block.moe.gates[0].e_score_correction_bias.abs().min() > 0


def test_logits_match_transformers(pair):
    _, hf, ours, _ = pair
    check_logits(hf, ours, ids())


def test_group_limited_routing_differs_from_plain_topk(pair):
    name, hf, _, _ = pair
    check_group_routing_differs(hf, ids(), expect_differ=name != "plain")  # one group: plain top-k


def test_greedy_matches_generate(pair):
    _, hf, ours, _ = pair
    check_greedy(hf, ours, ids(seed=1), new_tokens=16)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[2], ids(seed=2), prefill=9)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[2])


def test_partial_rotary_default_and_hub_style(pair):
    """GLM's RoPE covers half of each head when the config does not say (as transformers' Glm4MoeConfig
    defaults it), and a hub-style config (rope_theta and partial_rotary_factor at the top) parses the same."""
    name, _, _, path = pair
    with open(os.path.join(path, "config.json")) as f:
        d = json.load(f)
    saved = dm.load_config(path)
    rope = dict(d.pop("rope_parameters"))
    hub = {**d, "rope_theta": rope["rope_theta"], "partial_rotary_factor": rope["partial_rotary_factor"]}
    assert dm.ModelConfig.from_dict(hub).rope == saved.rope
    bare = dm.ModelConfig.from_dict({**d, "rope_theta": rope["rope_theta"]})
    assert bare.rope.partial_rotary_factor == 0.5
    assert transformers.Glm4MoeConfig(**{k: v for k, v in d.items() if k != "architectures"}).rope_parameters[
        "partial_rotary_factor"] == 0.5
