"""OLMoE against transformers on tiny random checkpoints: q/k RMSNorm over the whole projection (GQA,
so q and k norms of different sizes), clip_qkv that clips, norm_topk_prob both ways, attention biases,
tied embeddings."""
import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_util import ids as _ids

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.olmoe import OlmoeForCausalLM  # noqa: E402

VARIANTS = {
    # clip_qkv small enough to clip many q/k/v entries, raw top-k weights
    "clip": dict(clip_qkv=1.5, norm_topk_prob=False),
    # no clip, renormalised top-k, biases on q/k/v/o, tied lm_head
    "bias_norm_topk": dict(norm_topk_prob=True, attention_bias=True, tie_word_embeddings=True),
}


def tiny_config(**overrides):
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
              bos_token_id=None, eos_token_id=None, pad_token_id=None)
    kw.update(overrides)
    return transformers.OlmoeConfig(**kw)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.OlmoeForCausalLM(tiny_config(**VARIANTS[request.param])).eval()
    randomize_(hf, seed=1)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"olmoe_{request.param}"))
    return request.param, hf, dm.load(path, progress=False)


def test_structure(pair):
    name, hf, ours = pair
    assert isinstance(ours, OlmoeForCausalLM)
    assert len(ours.moe_layers()) == 2
    for layer in ours.model.layers:
        a = layer.self_attn
        assert a.qk_norm_all and tuple(a.q_norm.weight.shape) == (64,) and tuple(a.k_norm.weight.shape) == (32,)
        assert a.clip_qkv == (1.5 if name == "clip" else None)
        assert (a.o_proj.bias is not None) == (name != "clip")
        assert "all heads" in a.decode_fused(layer.input_layernorm, torch.float32).extra  # the kernel norms per head


def test_logits_match_transformers(pair):
    _, hf, ours = pair
    check_logits(hf, ours, _ids())


def test_clip_qkv_matters(pair):
    """The clamp is exercised: toggling clip_qkv (off for the clipping variant, on at 1.5 for the other)
    moves the logits."""
    name, _, ours = pair
    attns = [layer.self_attn for layer in ours.model.layers]
    with torch.no_grad():
        ref = ours(_ids())
        try:
            for a in attns:
                a.clip_qkv = None if name == "clip" else 1.5
            toggled = ours(_ids())
        finally:
            for a in attns:
                a.clip_qkv = 1.5 if name == "clip" else None
    assert (toggled - ref).abs().max() > 1e-2


def test_greedy_matches_generate(pair):
    _, hf, ours = pair
    check_greedy(hf, ours, _ids(seed=1), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[2], _ids(seed=2), prefill=9)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[2])
