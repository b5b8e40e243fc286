"""DeepSeek-V2 against transformers on tiny random checkpoints: MLA with q_lora_rank and without,
YaRN with both mscales, a dense first layer, softmax routing greedy and group-limited greedy (which
picks other experts than plain top-k), routed_scaling_factor, shared experts; a config with
transformers' defaults (n_group / topk_group null) parses; unsupported routing settings are refused."""
import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_mla_util import MLA, YARN, check_absorption, ids, moe_inputs

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.deepseek_v2 import DeepseekV2ForCausalLM  # noqa: E402
from dynamoe.models.mla import MLAttention  # noqa: E402
from dynamoe.models.moe_block import GatedMLP, SparseMoeBlock  # noqa: E402
from dynamoe.moe.gates import route  # noqa: E402

BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
            bos_token_id=None, eos_token_id=None, first_k_dense_replace=1, n_shared_experts=1)
VARIANTS = {
    # q_lora_rank, YaRN (mscale != mscale_all_dim), 4 groups of 2 / the best one kept (with top-2 and 2 groups kept,
    # group-limited greedy always picks the plain top-2), weights scaled
    "group_limited": dict(**MLA, topk_method="group_limited_greedy", n_group=4, topk_group=1, routed_scaling_factor=2.5,
                          rope_parameters=YARN),
    # q_proj (no q_lora_rank), plain RoPE, greedy top-k (n_group / topk_group null), 2 shared experts
    "greedy": dict(**{**MLA, "q_lora_rank": None}, topk_method="greedy", n_shared_experts=2,
                   rope_parameters={"rope_type": "default", "rope_theta": 5000.0}),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    torch.manual_seed(1)
    hf = transformers.DeepseekV2ForCausalLM(transformers.DeepseekV2Config(**{**BASE, **VARIANTS[request.param]})).eval()
    randomize_(hf, seed=1)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"dsv2_{request.param}"))
    return request.param, hf, dm.load(path, progress=False), path


def test_structure(pair):
    name, hf, ours, _ = pair
    assert isinstance(ours, DeepseekV2ForCausalLM)
    assert [type(layer.mlp) for layer in ours.model.layers] == [GatedMLP, SparseMoeBlock, SparseMoeBlock]
    attn = ours.model.layers[0].self_attn
    assert isinstance(attn, MLAttention) and attn.rope_interleaved
    assert hasattr(attn, "q_a_proj") == (name == "group_limited")
    for _, block in ours.moe_layers():
        gate = block.moe.config.gates[0]
        assert (gate.type, gate.normalize, gate.capacity_factor) == ("top", False, 0)
        assert (gate.n_group, gate.topk_group, gate.route_scale) == ((4, 1, 2.5) if name == "group_limited" else (1, 1, 1.0))
        assert getattr(block.moe.gates[0], "e_score_correction_bias", None) is None
        assert block.moe.shared_experts.gate_proj.out_features == 32 * (1 if name == "group_limited" else 2)


def test_logits_match_transformers(pair):
    _, hf, ours, _ = pair
    check_logits(hf, ours, ids())


def test_group_limited_routing_differs_from_plain_topk(pair):
    """transformers' router picks, for some tokens, other experts than the plain top-k of the softmax
    (group-limited), and never for 'greedy'; our router's choice equals transformers' for every token."""
    name, hf, ours, _ = pair
    differ = 0
    for i, x in moe_inputs(hf, ids()).items():
        gate = hf.model.layers[i].mlp.gate
        with torch.no_grad():
            _, hf_weights, hf_ids = gate(x)
            plain = torch.softmax(x.float() @ gate.weight.float().t(), dim=-1).topk(2, dim=-1).indices
            routing = ours.model.layers[i].mlp.moe.gates[0]
            r = route(routing, routing.routing_config, x, 8, 2, True, False, need_scores=False)
        assert torch.equal(r.ids_TK.sort(-1).values, hf_ids.sort(-1).values)
        torch.testing.assert_close(r.weights_TK.gather(1, r.ids_TK.argsort(-1)),
                                   hf_weights.gather(1, hf_ids.argsort(-1)), atol=1e-6, rtol=0)
        differ += int((hf_ids.sort(-1).values != plain.sort(-1).values).any(-1).sum())
    assert (differ > 0) == (name == "group_limited")


def test_greedy_matches_generate(pair):
    _, hf, ours, _ = pair
    check_greedy(hf, ours, ids(seed=1), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[2], ids(seed=2), prefill=9)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[2])


def test_absorbed_equals_expanded(pair):
    check_absorption(pair[2], ids(seed=3))


SIZES = dict(model_type="deepseek_v2", vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4,
             intermediate_size=96, moe_intermediate_size=32, num_experts_per_tok=2)


def test_transformers_defaults_parse():
    """DeepseekV2Config's defaults save n_group / topk_group as null (greedy routing): they parse (they
    used to fail comparing None) and build."""
    d = transformers.DeepseekV2Config(**{k: v for k, v in SIZES.items() if k != "model_type"}).to_dict()
    assert d["n_group"] is None and d["topk_method"] == "greedy"
    cfg = dm.ModelConfig.from_dict(d)
    assert (cfg.n_group, cfg.topk_group, cfg.num_experts, cfg.n_shared_experts) == (1, 1, 64, 2)
    with torch.device("meta"):
        DeepseekV2ForCausalLM(cfg)


@pytest.mark.parametrize("extra,match", [
    (dict(topk_method="noaux_tc"), "topk_method"),
    (dict(topk_method="group_limited_greedy"), "n_group"),
    (dict(norm_topk_prob=True), "norm_topk_prob"),
    (dict(mlp_bias=True), "mlp_bias"),
])
def test_unsupported_routing_is_refused(extra, match):
    cfg = dm.ModelConfig.from_dict({**SIZES, **extra})
    with pytest.raises(ValueError, match=match), torch.device("meta"):
        DeepseekV2ForCausalLM(cfg)
