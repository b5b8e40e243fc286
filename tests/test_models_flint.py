"""Flint against transformers on a tiny random checkpoint: per-head q/k norms, sinks on every layer,
NoPE full-attention layers beside RoPE'd sliding-window ones (a window shorter than the input), dense
mlp_only_layers, a sigmoid router without selection bias (renormalised or not) and an ungated shared expert."""
import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import (VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, ids, randomize_,
                         save_tiny)

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.flint import FlintForCausalLM  # noqa: E402
from dynamoe.models.moe_block import GatedMLP, SparseMoeBlock  # noqa: E402

WINDOW = 6
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
             shared_expert_intermediate_size=48, num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, num_experts=8, num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=256,
             bos_token_id=None, eos_token_id=None, mlp_only_layers=[0])
VARIANTS = {"renormalised": dict(), "raw": dict(norm_topk_prob=False, attention_bias=True)}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.FlintForCausalLM(transformers.FlintConfig(**SIZES, **VARIANTS[request.param])).eval()
    randomize_(hf, seed=3, scales={"sinks": 1.0})
    path = save_tiny(hf, tmp_path_factory.mktemp(f"flint_{request.param}"))
    return request.param, hf, dm.load(path, progress=False)


def test_structure(pair):
    name, hf, ours = pair
    assert isinstance(ours, FlintForCausalLM)
    # transformers' rule for 5 layers: full on 0, 1, every 4th from 1 and the last
    assert ours.config.layer_types == tuple(hf.config.layer_types) == (
        "full_attention", "full_attention", "sliding_attention", "sliding_attention", "full_attention")
    attns = [layer.self_attn for layer in ours.model.layers]
    assert [a.sliding_window for a in attns] == [None, None, WINDOW, WINDOW, None]
    assert [a.use_rope for a in attns] == [False, False, True, True, False]
    assert all(a.sinks is not None and a.q_norm is not None for a in attns)
    assert (attns[0].q_proj.bias is not None) == (name == "raw")
    assert [type(layer.mlp) for layer in ours.model.layers] == [GatedMLP] + [SparseMoeBlock] * 4
    for _, block in ours.moe_layers():
        gate = block.moe.config.gates[0]
        assert (gate.type, gate.n_group, gate.route_scale, gate.normalize) == ("sigmoid", 1, 1.0, name == "renormalised")
        assert block.moe.gates[0].e_score_correction_bias is None
        assert block.moe.shared_experts.gate_proj.out_features == 48


def test_sinks_window_and_nope_matter(pair):
    """Sanity of the test itself: without sinks, without the window, or with RoPE on a full layer, the logits change."""
    ours = pair[2]
    x = ids()
    full, sliding = ours.model.layers[1].self_attn, ours.model.layers[2].self_attn
    with torch.no_grad():
        ref = ours(x)
        sinks, full.sinks = full.sinks, None
        no_sinks = ours(x)
        full.sinks = sinks
        sliding.sliding_window = None
        no_window = ours(x)
        sliding.sliding_window = WINDOW
        full.use_rope = True
        roped = ours(x)
        full.use_rope = False
    for other in (no_sinks, no_window, roped):
        assert (other - ref).abs().max() > 1e-2


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
