"""FlexOlmo against transformers on tiny random checkpoints: OLMo-2 post-norm layers (no pre-norm),
q/k RMSNorm over the whole projection (GQA: two sizes), norm_topk_prob both ways, attention biases,
tied embeddings."""
import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_util import ids as _ids

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.flex_olmo import FlexOlmoForCausalLM, PostNormDecoderLayer  # noqa: E402

VARIANTS = {
    "raw_topk": dict(norm_topk_prob=False, num_experts_per_tok=3),
    "bias_norm_topk": dict(norm_topk_prob=True, attention_bias=True, tie_word_embeddings=True),
}


def tiny_config(**overrides):
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
    kw.update(overrides)
    return transformers.FlexOlmoConfig(**kw)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.FlexOlmoForCausalLM(tiny_config(**VARIANTS[request.param])).eval()
    randomize_(hf, seed=1)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"flex_olmo_{request.param}"))
    return request.param, hf, dm.load(path, progress=False)


def test_structure(pair):
    name, hf, ours = pair
    assert isinstance(ours, FlexOlmoForCausalLM) and len(ours.moe_layers()) == 2
    for i, layer in enumerate(ours.model.layers):
        assert isinstance(layer, PostNormDecoderLayer) and not hasattr(layer, "input_layernorm")
        torch.testing.assert_close(layer.post_feedforward_layernorm.weight, hf.model.layers[i].post_feedforward_layernorm.weight)
        a = layer.self_attn
        assert a.qk_norm_all and tuple(a.q_norm.weight.shape) == (64,) and tuple(a.k_norm.weight.shape) == (32,)
        assert (a.o_proj.bias is not None) == (name == "bias_norm_topk")
        assert layer.mlp.moe.config.gates[0].normalize == (name == "bias_norm_topk")


def test_logits_match_transformers(pair):
    _, hf, ours = pair
    check_logits(hf, ours, _ids())


def test_greedy_matches_generate(pair):
    _, hf, ours = pair
    check_greedy(hf, ours, _ids(seed=1), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[2], _ids(seed=2), prefill=9)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[2])
