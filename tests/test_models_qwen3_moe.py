"""Qwen3-MoE against transformers on tiny random checkpoints: q/k norm, a dense layer
(mlp_only_layers / decoder_sparse_step), norm_topk_prob both ways, tied embeddings."""
import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_util import ids as _ids

transformers = pytest.importorskip("transformers")

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.moe_block import GatedMLP, SparseMoeBlock  # noqa: E402

VARIANTS = {
    # layer 1 dense via mlp_only_layers, renormalised top-k, tied lm_head
    "norm_topk": dict(norm_topk_prob=True, mlp_only_layers=[1], tie_word_embeddings=True),
    # layers 0 and 2 dense via decoder_sparse_step=2, raw softmax weights
    "raw_topk": dict(norm_topk_prob=False, decoder_sparse_step=2),
}


def tiny_config(**overrides):
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
              rope_theta=10000.0, max_position_embeddings=256, bos_token_id=None, eos_token_id=None)
    kw.update(overrides)
    return transformers.Qwen3MoeConfig(**kw)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(tiny_config(**VARIANTS[request.param])).eval()
    randomize_(hf, seed=1)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"qwen3_{request.param}"))
    return request.param, hf, dm.load(path, progress=False)


def test_structure(pair):
    name, hf, ours = pair
    kinds = [type(layer.mlp) for layer in ours.model.layers]
    expected = [SparseMoeBlock, GatedMLP, SparseMoeBlock] if name == "norm_topk" else [GatedMLP, SparseMoeBlock, GatedMLP]
    assert kinds == expected
    assert all(layer.self_attn.q_norm is not None for layer in ours.model.layers)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == (name == "norm_topk")
    for _, block in ours.moe_layers():
        assert block.moe.config.gates[0].normalize == (name == "norm_topk")
        assert block.moe.config.gates[0].capacity_factor == 0


def test_logits_match_transformers(pair):
    _, hf, ours = pair
    check_logits(hf, ours, _ids())


def test_greedy_matches_generate(pair):
    _, hf, ours = pair
    check_greedy(hf, ours, _ids(seed=1), new_tokens=16)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[2], _ids(seed=2), prefill=9)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[2])


def test_moe_stats(pair):
    _, _, ours = pair
    with torch.no_grad():
        ours(_ids(rows=2, tokens=5))
    stats = ours.moe_stats()
    assert [s.layer for s in stats] == [i for i, _ in ours.moe_layers()]
    for s in stats:
        assert s.load.shape == (8,) and int(s.load.sum()) == 2 * 5 * 2 and s.dropped == 0
