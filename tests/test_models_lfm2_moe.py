"""LFM2-MoE against transformers on tiny random checkpoints: gated short-convolution layers and attention layers
(per-head q/k norms, RoPE), a dense first layer, sigmoid routing with a selection-only expert bias, renormalised and
scaled; with and without the expert bias and the conv biases, tied and untied embeddings; and the conv windows in
the cache -- chunked prefill, decode, rows at different positions, a reused slot, the engine."""
import copy
import dataclasses

import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_util import ids as _ids
from recurrent_util import (check_bf16, check_chunked_prefill, check_engine, check_reused_slot, check_rows_at_different_positions,
                            check_truncated_slot_is_an_error)

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.attention import Attention  # noqa: E402
from dynamoe.models.moe_block import GatedMLP, SparseMoeBlock  # noqa: E402
from dynamoe.models.short_conv import ShortConv  # noqa: E402

SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, moe_intermediate_size=16, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, num_experts=8, num_experts_per_tok=2, num_dense_layers=1,
             layer_types=["conv", "full_attention", "conv", "conv"], routed_scaling_factor=2.0,
             max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)
VARIANTS = {
    "expert-bias-tied": dict(use_expert_bias=True),
    "no-expert-bias-conv-bias": dict(use_expert_bias=False, conv_bias=True, tie_word_embeddings=False),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.Lfm2MoeForCausalLM(transformers.Lfm2MoeConfig(**SIZES, **VARIANTS[request.param])).eval()
    randomize_(hf, seed=1)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():   # (a buffer: randomize_ leaves it at zero) a selection bias that changes the choice
        for layer in hf.model.layers:
            if getattr(layer.feed_forward, "expert_bias", None) is not None:
                layer.feed_forward.expert_bias.copy_(torch.randn(8, generator=g) * 0.3)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"lfm2_moe_{request.param}"))
    return hf, dm.load(path, progress=False), path


def test_structure(pair):
    hf, ours, _ = pair
    cfg = ours.config
    assert type(ours).recurrent_state is True
    assert cfg.layer_types == ("conv", "full_attention", "conv", "conv")
    assert [type(layer.mixer if hasattr(layer, "mixer") else layer.self_attn) for layer in ours.model.layers] == \
        [ShortConv, Attention, ShortConv, ShortConv]
    assert [type(layer.mlp) for layer in ours.model.layers] == [GatedMLP] + [SparseMoeBlock] * 3
    assert cfg.tie_word_embeddings == hf.config.tie_word_embeddings == (ours.lm_head.weight is ours.model.embed_tokens.weight)
    assert cfg.rope.theta == 1e6 and ours.model.layers[1].self_attn.q_norm is not None
    gate = ours.model.layers[1].mlp.moe.gates[0]
    assert (gate.e_score_correction_bias is not None) == hf.config.use_expert_bias
    assert ours.model.layers[0].conv.conv.bias is not None if hf.config.conv_bias else ours.model.layers[0].conv.conv.bias is None
    assert cfg.kv_elements_per_position() == 2 * 2 * 8   # one attention layer's keys and values
    with torch.no_grad():
        cache = ours.new_cache(3, 8)
        ours(_ids(rows=1, tokens=2), cache=cache)
    sizes = {name: sum(layer[name][0].numel() for layer in cache.layers if name in layer)
             for name in ("conv_state", "recurrent_state")}
    assert cfg.state_elements_per_sequence() == sizes == {"conv_state": 3 * 32 * 2, "recurrent_state": 0}


def test_logits_match_transformers(pair):
    hf, ours, _ = pair
    check_logits(hf, ours, _ids())


def test_greedy_matches_generate(pair):
    hf, ours, _ = pair
    check_greedy(hf, ours, _ids(seed=1), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[1], _ids(seed=2), prefill=9)


def test_chunked_prefill_equals_one_pass(pair):
    # chunks of 1 and 2 tokens: shorter than and equal to the window of 2
    check_chunked_prefill(pair[1], cuts=((0, 13), (13, 14), (14, 16), (16, 28)), expect_states=3)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[1])


def test_rows_at_different_positions_in_one_chunk(pair):
    check_rows_at_different_positions(pair[1])


def test_reused_slot_starts_from_zero_state(pair):
    check_reused_slot(pair[1])


def test_truncated_slot_is_an_error(pair):
    check_truncated_slot_is_an_error(pair[1])


def test_engine_generates_each_requests_own_continuation(pair):
    check_engine(pair[1])


def test_bf16_tracks_transformers_bf16(pair):
    check_bf16(pair[0], pair[2])


def test_each_feature_matters(pair):
    """Dropping any of the particulars moves the logits far from transformers': the gates around the conv, the
    q/k norms, the route scale, the selection bias (where there is one)."""
    hf, ours, _ = pair
    ids = _ids(seed=6)

    def far(model):
        with torch.no_grad():
            return float((model(ids) - hf(ids).logits).abs().max())

    def edited(edit):
        m = copy.deepcopy(ours)
        for layer in m.model.layers:
            edit(layer)
        return m

    def ungated(layer):
        if hasattr(layer, "conv"):
            conv = layer.conv
            conv.forward = lambda x, *a, c=conv, **k: c.out_proj(
                c.conv(x.transpose(1, 2))[..., :x.size(1)].transpose(1, 2))

    assert far(ours) < 1e-4
    assert far(edited(ungated)) > 1e-2
    assert far(edited(lambda layer: setattr(layer.self_attn, "q_norm", None) or setattr(layer.self_attn, "k_norm", None)
                      if hasattr(layer, "self_attn") else None)) > 1e-2
    unscaled = type(ours)(dataclasses.replace(ours.config, routed_scaling_factor=1.0)).eval()
    unscaled.load_state_dict(ours.state_dict())
    assert far(unscaled) > 1e-2
    if hf.config.use_expert_bias:
        with torch.no_grad():
            assert far(edited(lambda layer: layer.mlp.moe.gates[0].e_score_correction_bias.zero_()
                              if isinstance(layer.mlp, SparseMoeBlock) else None)) > 1e-2


def test_config_needs_the_layer_kinds():
    from dynamoe.models.registry import builder_for

    base = {"model_type": "lfm2_moe", **{k: v for k, v in SIZES.items() if v is not None and k != "layer_types"}}
    with pytest.raises(ValueError, match="layer_types"):
        dm.ModelConfig.from_dict(base)
    assert dm.ModelConfig.from_dict({**base, "full_attn_idxs": [1, 3]}).layer_types == ("conv", "full_attention") * 2
    with pytest.raises(ValueError, match="full_attn_idxs"):
        dm.ModelConfig.from_dict({**base, "full_attn_idxs": [4]})
    with pytest.raises(ValueError, match="layer_types"):
        dm.ModelConfig.from_dict({**base, "layer_types": ["conv", "lightning", "conv", "conv"]})
    cfg = dm.ModelConfig.from_dict({**base, "layer_types": ["conv", "sliding_attention", "conv", "conv"], "sliding_window": 4})
    with pytest.raises(ValueError, match="'conv' or 'full_attention' for lfm2_moe"):
        builder_for(cfg)(cfg)
    assert dm.ModelConfig.from_dict({**base, "full_attn_idxs": [1], "tie_embedding": False}).tie_word_embeddings is False
