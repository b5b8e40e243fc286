"""K-EXAONE (exaone_moe) against transformers on tiny random checkpoints: per-head q/k norm, sliding
layers with RoPE and global NoPE layers (sliding_window_pattern, or layer_types all global);
DeepSeek-V3 MoE blocks (dense first layer, selection bias, group-limited top-k, scale, shared experts);
the multi-token-prediction layers (mtp.*): tests/test_models_mtp_prefixed.py."""

import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch
from models_mla_util import check_group_routing_differs, ids, make_pair

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.exaone_moe import ExaoneMoeForCausalLM  # noqa: E402
from dynamoe.models.moe_block import GatedMLP, SparseMoeBlock  # noqa: E402

VARIANTS = {
    # layers 0, 2 slide over 6 keys with RoPE, 1, 3 global without; 4 groups / 2 kept
    "sliding_nope": dict(sliding_window=6, sliding_window_pattern=2, n_group=4, topk_group=2),
    # every layer global (layer_types given): with sliding_window set (ExaoneMoeConfig requires an int) none
    # has RoPE; raw weights, 2 shared experts
    "all_global": dict(sliding_window=4096, layer_types=["full_attention"] * 4, norm_topk_prob=False,
                       num_shared_experts=2),
}


def tiny_config(**overrides):
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
              max_position_embeddings=256, pad_token_id=None, bos_token_id=None, eos_token_id=None)
    kw.update(overrides)
    return transformers.ExaoneMoeConfig(**kw)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    hf, path = make_pair(transformers.ExaoneMoeForCausalLM, tiny_config(**VARIANTS[request.param]),
                         tmp_path_factory.mktemp(f"exaone_{request.param}"))
    return request.param, hf, dm.load(path, progress=False)


def test_structure(pair):
    name, hf, ours = pair
    assert isinstance(ours, ExaoneMoeForCausalLM)
    assert [type(layer.mlp) for layer in ours.model.layers] == [GatedMLP] + [SparseMoeBlock] * 3
    attn = [layer.self_attn for layer in ours.model.layers]
    if name == "sliding_nope":
        assert [a.sliding_window for a in attn] == [6, None, 6, None]
        assert [a.use_rope for a in attn] == [True, False, True, False]
    else:
        assert all(a.sliding_window is None and not a.use_rope for a in attn)
    for _, block in ours.moe_layers():
        gate = block.moe.config.gates[0]
        assert (gate.type, gate.route_scale, gate.normalize) == ("sigmoid", 2.5, name == "sliding_nope")
        assert block.moe.shared_experts.gate_proj.out_features == 32 * (1 if name == "sliding_nope" else 2)
        assert block.moe.gates[0].e_score_correction_bias.abs().min() > 0


def test_logits_match_transformers(pair):
    _, hf, ours = pair
    check_logits(hf, ours, ids())


def test_group_limited_routing_differs_from_plain_topk(pair):
    name, hf, _ = pair
    check_group_routing_differs(hf, ids(), expect_differ=name == "sliding_nope")


def test_greedy_matches_generate(pair):
    _, hf, ours = pair
    check_greedy(hf, ours, ids(seed=1), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[2], ids(seed=2), prefill=9)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[2])


@pytest.mark.parametrize("extra", [{"sliding_window": None}, {"sliding_window_pattern": "LLLG"}])
def test_layer_types_needed_without_an_int_pattern(extra):
    """transformers derives layer_types only from an int pattern and a window (else it raises too)."""
    d = {**tiny_config().to_dict(), "layer_types": None, **extra}
    with pytest.raises(ValueError, match="layer_types"):
        dm.ModelConfig.from_dict(d)


def test_nope_matters(pair):
    """Rotating the global layers too gives other logits: the NoPE layers are exercised."""
    name, _, ours = pair
    attns = [layer.self_attn for layer in ours.model.layers if not layer.self_attn.use_rope]
    assert attns
    with torch.no_grad():
        ref = ours(ids())
        try:
            for a in attns:
                a.use_rope = True
            roped = ours(ids())
        finally:
            for a in attns:
                a.use_rope = False
    assert (roped - ref).abs().max() > 1e-3
