"""GraniteMoE and GraniteMoE-Shared against transformers on tiny random checkpoints: the muP multipliers
(embedding, residual, attention softmax scale, logits scaling) at Granite-3's values, top-k on the
logits then softmax, stacked expert tensors, the ungated shared MLP with its fused input_linear, tied
embeddings."""
import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_util import ids as _ids

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.granitemoe import GraniteMoeForCausalLM, ScaledResidualLayer  # noqa: E402

# granite-3.0-1b-a400m's multipliers (attention_multiplier 1/64 for its head_dim 64; ours is 16)
MULTIPLIERS = dict(embedding_multiplier=12.0, residual_multiplier=0.22, attention_multiplier=0.0625, logits_scaling=6.0)
VARIANTS = {
    "granitemoe": ("GraniteMoeConfig", "GraniteMoeForCausalLM", dict(**MULTIPLIERS)),
    "granitemoeshared": ("GraniteMoeSharedConfig", "GraniteMoeSharedForCausalLM",
                         dict(**MULTIPLIERS, shared_intermediate_size=48, tie_word_embeddings=True, num_experts_per_tok=3)),
}


def tiny_config(config_cls, **overrides):
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, max_position_embeddings=256,
              bos_token_id=None, eos_token_id=None)
    kw.update(overrides)
    return getattr(transformers, config_cls)(**kw)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    config_cls, model_cls, overrides = VARIANTS[request.param]
    torch.manual_seed(0)
    hf = getattr(transformers, model_cls)(tiny_config(config_cls, **overrides)).eval()
    randomize_(hf, seed=1, scales={"lm_head": 1.0, "embed_tokens": 1.0})  # logits / 6 must still be O(1)
    path = save_tiny(hf, tmp_path_factory.mktemp(request.param))
    return request.param, hf, dm.load(path, progress=False)


def test_structure(pair):
    name, hf, ours = pair
    assert isinstance(ours, GraniteMoeForCausalLM) and ours.config.model_type == name
    assert ours.model.embed_tokens.multiplier == 12.0 and ours.lm_head.divisor == 6.0
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == (name == "granitemoeshared")
    for i, layer in enumerate(ours.model.layers):
        assert isinstance(layer, ScaledResidualLayer) and layer.residual_multiplier == 0.22
        assert layer.self_attn.scale == 0.0625
        moe = layer.mlp.moe
        torch.testing.assert_close(moe.experts.gate_up_proj, hf.model.layers[i].block_sparse_moe.experts.gate_up_proj)
        if name == "granitemoeshared":
            torch.testing.assert_close(moe.shared_experts.gate_up_proj.weight, hf.model.layers[i].shared_mlp.input_linear.weight)
        else:
            assert moe.shared_experts is None


def test_logits_match_transformers(pair):
    _, hf, ours = pair
    check_logits(hf, ours, _ids())


def test_multipliers_matter(pair):
    """Each multiplier moves the logits (set to 1, the model differs): all four are exercised."""
    _, _, ours = pair
    ids = _ids()
    with torch.no_grad():
        ref = ours(ids)
        for obj, attr in [(ours.model.embed_tokens, "multiplier"), (ours.lm_head, "divisor"),
                          (ours.model.layers[0], "residual_multiplier"), (ours.model.layers[0].self_attn, "scale")]:
            saved = getattr(obj, attr)
            setattr(obj, attr, 1.0)
            try:
                assert (ours(ids) - ref).abs().max() > 1e-3, attr
            finally:
                setattr(obj, attr, saved)


def test_greedy_matches_generate(pair):
    _, hf, ours = pair
    check_greedy(hf, ours, _ids(seed=1), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[2], _ids(seed=2), prefill=9)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[2])
