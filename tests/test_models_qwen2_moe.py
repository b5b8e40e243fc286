"""Qwen1.5/2-MoE against transformers on tiny random checkpoints: q/k/v biases, the shared expert with
its sigmoid gate, dense layers (mlp_only_layers / decoder_sparse_step), sliding-window layers below
max_window_layers, norm_topk_prob both ways, tied embeddings."""
import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_util import ids as _ids

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.moe_block import GatedMLP, SparseMoeBlock  # noqa: E402
from dynamoe.models.qwen2_moe import Qwen2MoeForCausalLM  # noqa: E402

VARIANTS = {
    # q/k/v bias, layer 1 dense, layers 0 (and not 2: max_window_layers=2) slide over 6 keys, raw top-k weights
    "sliding": dict(qkv_bias=True, mlp_only_layers=[1], use_sliding_window=True, sliding_window=6, max_window_layers=2),
    # no bias, layers 0 and 2 dense (decoder_sparse_step=2), renormalised top-k, tied lm_head
    "norm_topk": dict(qkv_bias=False, decoder_sparse_step=2, norm_topk_prob=True, tie_word_embeddings=True),
}


def tiny_config(**overrides):
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
              shared_expert_intermediate_size=48, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
              num_experts=8, num_experts_per_tok=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None)
    kw.update(overrides)
    return transformers.Qwen2MoeConfig(**kw)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.Qwen2MoeForCausalLM(tiny_config(**VARIANTS[request.param])).eval()
    randomize_(hf, seed=1)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"qwen2_{request.param}"))
    return request.param, hf, dm.load(path, progress=False)


def test_structure(pair):
    name, hf, ours = pair
    assert isinstance(ours, Qwen2MoeForCausalLM)
    kinds = [type(layer.mlp) for layer in ours.model.layers]
    sliding = name == "sliding"
    assert kinds == ([SparseMoeBlock, GatedMLP, SparseMoeBlock] if sliding else [GatedMLP, SparseMoeBlock, GatedMLP])
    attn = [layer.self_attn for layer in ours.model.layers]
    assert [a.sliding_window for a in attn] == ([6, None, None] if sliding else [None] * 3)
    assert all((a.q_proj.bias is not None) == sliding and a.o_proj.bias is None and a.q_norm is None for a in attn)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == (not sliding)
    for i, block in ours.moe_layers():
        assert block.moe.config.gates[0].normalize == (not sliding)
        shared = block.moe.shared_experts
        assert shared.gate_proj.out_features == 48 and tuple(shared.gate.weight.shape) == (1, 64)
        torch.testing.assert_close(shared.gate.weight, hf.model.layers[i].mlp.shared_expert_gate.weight)


def test_logits_match_transformers(pair):
    _, hf, ours = pair
    check_logits(hf, ours, _ids())


def test_shared_expert_gate_matters(pair):
    """Without the sigmoid gate (the shared expert added whole) the logits move: the gate is exercised."""
    _, hf, ours = pair
    ids = _ids()
    with torch.no_grad():
        ref = ours(ids)
        saved = [(b.moe.shared_experts, b.moe.shared_experts.gate) for _, b in ours.moe_layers()]
        try:
            for shared, _ in saved:
                shared.gate = None
            ungated = ours(ids)
        finally:
            for shared, gate in saved:
                shared.gate = gate
    assert (ungated - ref).abs().max() > 1e-2


def test_greedy_matches_generate(pair):
    _, hf, ours = pair
    check_greedy(hf, ours, _ids(seed=1), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[2], _ids(seed=2), prefill=9)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[2])
