"""dots.llm1 against transformers on tiny random checkpoints: Qwen3 attention (per-head q/k norm, GQA,
sliding layers from max_window_layers on) with DeepSeek-V3 MoE blocks (dense first layer, selection
bias, group-limited top-k, routed_scaling_factor, shared experts)."""
import pytest

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch
from models_mla_util import check_group_routing_differs, ids, make_pair

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.dots1 import Dots1ForCausalLM  # noqa: E402
from dynamoe.models.moe_block import GatedMLP, SparseMoeBlock  # noqa: E402

VARIANTS = {
    # 4 groups / 2 kept, renormalised, scaled; layer 2 slides over 6 keys (max_window_layers=2)
    "groups_sliding": dict(n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5, sliding_window=6,
                           max_window_layers=2, layer_types=None),
    # one group, raw weights, q/k/v/o biases, 2 shared experts, no window
    "bias": dict(attention_bias=True, n_shared_experts=2, sliding_window=None),
}


def tiny_config(**overrides):
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
              n_shared_experts=1, first_k_dense_replace=1, max_position_embeddings=256, bos_token_id=None,
              eos_token_id=None)
    kw.update(overrides)
    return transformers.Dots1Config(**kw)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    hf, path = make_pair(transformers.Dots1ForCausalLM, tiny_config(**VARIANTS[request.param]),
                         tmp_path_factory.mktemp(f"dots1_{request.param}"))
    return request.param, hf, dm.load(path, progress=False)


def test_structure(pair):
    name, hf, ours = pair
    assert isinstance(ours, Dots1ForCausalLM)
    assert [type(layer.mlp) for layer in ours.model.layers] == [GatedMLP, SparseMoeBlock, SparseMoeBlock]
    attn = [layer.self_attn for layer in ours.model.layers]
    assert [a.sliding_window for a in attn] == ([None, None, 6] if name == "groups_sliding" else [None] * 3)
    assert all(a.q_norm is not None and (a.o_proj.bias is not None) == (name == "bias") for a in attn)
    for _, block in ours.moe_layers():
        gate = block.moe.config.gates[0]
        assert gate.type == "sigmoid" and gate.normalize == (name != "bias")
        assert (gate.n_group, gate.topk_group, gate.route_scale) == ((4, 2, 2.5) if name != "bias" else (1, 1, 1.0))
        assert block.moe.shared_experts.gate_proj.out_features == 32 * (2 if name == "bias" else 1)


def test_logits_match_transformers(pair):
    _, hf, ours = pair
    check_logits(hf, ours, ids())


def test_group_limited_routing_differs_from_plain_topk(pair):
    name, hf, _ = pair
    check_group_routing_differs(hf, ids(), expect_differ=name != "bias")


def test_greedy_matches_generate(pair):
    _, hf, ours = pair
    check_greedy(hf, ours, ids(seed=1), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[2], ids(seed=2), prefill=9)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[2])
