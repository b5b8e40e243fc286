"""GLM-4.7-Flash (glm4_moe_lite) against transformers on tiny random checkpoints: DeepSeek-V3's MLA
(interleaved and half-split RoPE, YaRN, with and without q_lora_rank) and routing (selection bias,
group-limited top-k, routed_scaling_factor, shared experts), dense layers from mlp_layer_types (the
default without one, only layer 0, is checked in test_models_config_defaults)."""
import pytest

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch
from models_mla_util import MLA, YARN, check_absorption, check_group_routing_differs, ids, make_pair

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.glm4_moe_lite import Glm4MoeLiteForCausalLM  # noqa: E402
from dynamoe.models.mla import MLAttention  # noqa: E402
from dynamoe.models.moe_block import GatedMLP, SparseMoeBlock  # noqa: E402

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
            max_position_embeddings=256, bos_token_id=None, eos_token_id=None, n_shared_experts=1)
VARIANTS = {
    # the default mlp_layer_types (layer 0 dense), interleaved RoPE with YaRN, 4 groups / 2 kept
    "groups": dict(**MLA, n_group=4, topk_group=2, rope_parameters=YARN),
    # q_proj, half-split plain RoPE, layers 0 and 1 dense, raw weights times 1.8 (the default scale)
    "q_proj": dict(**{**MLA, "q_lora_rank": None}, rope_interleave=False, norm_topk_prob=False,
                   mlp_layer_types=["dense", "dense", "sparse"]),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    hf, path = make_pair(transformers.Glm4MoeLiteForCausalLM, transformers.Glm4MoeLiteConfig(**{**BASE, **VARIANTS[request.param]}),
                         tmp_path_factory.mktemp(f"glm4_lite_{request.param}"))
    return request.param, hf, dm.load(path, progress=False), path


def test_structure(pair):
    name, _, ours, _ = pair
    assert isinstance(ours, Glm4MoeLiteForCausalLM)
    dense = [GatedMLP, SparseMoeBlock, SparseMoeBlock] if name == "groups" else [GatedMLP, GatedMLP, SparseMoeBlock]
    assert [type(layer.mlp) for layer in ours.model.layers] == dense
    attn = ours.model.layers[0].self_attn
    assert isinstance(attn, MLAttention) and attn.rope_interleaved == (name == "groups")
    for _, block in ours.moe_layers():
        gate = block.moe.config.gates[0]
        assert (gate.type, gate.normalize) == ("sigmoid", name == "groups")
        assert (gate.n_group, gate.topk_group, gate.route_scale) == ((4, 2, 1.8) if name == "groups" else (1, 1, 1.8))
        assert block.moe.gates[0].e_score_correction_bias.abs().min() > 0


def test_logits_match_transformers(pair):
    _, hf, ours, _ = pair
    check_logits(hf, ours, ids())


def test_group_limited_routing_differs_from_plain_topk(pair):
    name, hf, _, _ = pair
    check_group_routing_differs(hf, ids(), expect_differ=name == "groups")


def test_greedy_matches_generate(pair):
    _, hf, ours, _ = pair
    check_greedy(hf, ours, ids(seed=1), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[2], ids(seed=2), prefill=9)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[2])


def test_absorbed_equals_expanded(pair):
    check_absorption(pair[2], ids(seed=3))
