"""GraniteMoE-SWA against transformers on a tiny random checkpoint: Granite's muP multipliers, sinks on
every layer (transformers' sigmoid(logsumexp - sink) output scaling), sliding-window layers with a window
shorter than the input, a RoPE base per layer with a NoPE layer (theta 0), stacked experts as
transformers saves them and an ungated shared MLP (or none)."""
import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import (VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, ids, randomize_,
                         save_tiny)

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.granitemoe_swa import GraniteMoeSWAForCausalLM  # noqa: E402

WINDOW = 6
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=5, num_attention_heads=4,
             num_key_value_heads=2, num_local_experts=8, num_experts_per_tok=2, sliding_window=WINDOW,
             max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None,
             embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.2, logits_scaling=2.0)
VARIANTS = {
    "shared": dict(shared_intermediate_size=48, layer_rope_theta=[0, 10000.0, 500.0, 10000.0, 0]),
    "plain": dict(rope_parameters={"rope_type": "default", "rope_theta": 1000.0}),   # no shared MLP, one base
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.GraniteMoeSWAForCausalLM(transformers.GraniteMoeSWAConfig(**SIZES, **VARIANTS[request.param]))
    randomize_(hf.eval(), seed=3, scales={"sinks": 1.0})
    path = save_tiny(hf, tmp_path_factory.mktemp(f"granitemoe_swa_{request.param}"))
    return request.param, hf, dm.load(path, progress=False)


def test_structure(pair):
    name, hf, ours = pair
    assert isinstance(ours, GraniteMoeSWAForCausalLM)
    assert ours.config.layer_types == tuple(hf.config.layer_types) == (
        "full_attention", "sliding_attention", "sliding_attention", "sliding_attention", "full_attention")
    attns = [layer.self_attn for layer in ours.model.layers]
    assert [a.sliding_window for a in attns] == [None, WINDOW, WINDOW, WINDOW, None]
    assert all(a.sinks is not None and a.scale == 0.2 for a in attns)
    if name == "shared":
        assert [a.use_rope for a in attns] == [False, True, True, True, False]
        assert attns[1].rotary is attns[3].rotary is not attns[2].rotary
        assert [r.rope.theta for r in ours.model.rotary_emb.tables] == [500.0, 10000.0]
    else:
        assert all(a.use_rope and a.rotary.rope.theta == 1000.0 for a in attns)
    shared = ours.model.layers[0].mlp.moe.shared_experts
    assert (shared is not None) == (name == "shared")


def test_sinks_and_window_matter(pair):
    ours = pair[2]
    x = ids()
    attn = ours.model.layers[1].self_attn
    with torch.no_grad():
        ref = ours(x)
        sinks, attn.sinks = attn.sinks, None
        no_sinks = ours(x)
        attn.sinks = sinks
        attn.sliding_window = None
        no_window = ours(x)
        attn.sliding_window = WINDOW
    assert (no_sinks - ref).abs().max() > 1e-2 and (no_window - ref).abs().max() > 1e-2


def test_logits_match_transformers(pair):
    _, hf, ours = pair
    check_logits(hf, ours, ids())


def test_greedy_matches_generate(pair):
    _, hf, ours = pair
    check_greedy(hf, ours, ids(seed=1), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[2], ids(seed=2), prefill=9)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[2])


def test_bad_layer_rope_theta():
    cfg = dm.ModelConfig.from_dict({"model_type": "granitemoe_swa", "vocab_size": 8, "hidden_size": 16,
                                    "num_hidden_layers": 2, "num_attention_heads": 2, "intermediate_size": 8,
                                    "layer_rope_theta": [1e4]})
    with pytest.raises(ValueError, match="layer_rope_theta"):
        GraniteMoeSWAForCausalLM(cfg)
