"""MiniMax-Text-01 against transformers on tiny random checkpoints: lightning attention (linear attention with a fixed
decay per head, ALiBi-like slopes by layer, a gated output norm) alternating with softmax attention (RoPE; a sliding
window in one variant), Mixtral's MoE, the re-normalised residual stream with alpha / beta factors; the lightning
recurrence's chunked form; and its state in the cache -- chunked prefill, decode, rows at different positions, a
reused slot, the engine."""
import copy

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
from dynamoe.models.lightning import LightningAttention, lightning_slopes  # noqa: E402

# lightning prefill chunks of 8 (the prompts cross chunk boundaries); factors away from 1
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, num_local_experts=4, num_experts_per_tok=2, block_size=8,
             full_attn_alpha_factor=0.7, full_attn_beta_factor=1.2, linear_attn_alpha_factor=0.8,
             linear_attn_beta_factor=1.3, mlp_alpha_factor=0.9, mlp_beta_factor=1.1, max_position_embeddings=256,
             bos_token_id=None, eos_token_id=None)
VARIANTS = {"plain": {}, "sliding": dict(sliding_window=6)}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.MiniMaxForCausalLM(transformers.MiniMaxConfig(**SIZES, **VARIANTS[request.param])).eval()
    randomize_(hf, seed=1)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"minimax_{request.param}"))
    return hf, dm.load(path, progress=False), path


def test_slopes_are_transformers():
    from transformers.models.minimax.modeling_minimax import MiniMaxLightningAttention

    cfg = transformers.MiniMaxConfig(**SIZES)
    for i in (1, 3):
        theirs = MiniMaxLightningAttention(cfg, i).get_slope_rate().flatten()
        torch.testing.assert_close(lightning_slopes(4, i, 4), theirs, atol=0, rtol=0)


def test_structure(pair):
    hf, ours, _ = pair
    cfg = ours.config
    assert type(ours).recurrent_state is True
    assert cfg.layer_types == ("full_attention", "linear_attention") * 2
    assert [type(layer.self_attn) for layer in ours.model.layers] == [Attention, LightningAttention] * 2
    assert ours.model.layers[0].self_attn.sliding_window == hf.config.sliding_window
    assert [layer.attn_factors for layer in ours.model.layers[:2]] == [(0.7, 1.2), (0.8, 1.3)]
    assert ours.model.layers[3].self_attn.block_size == 8
    assert cfg.kv_elements_per_position() == 2 * 2 * 2 * 8   # the two softmax layers' keys and values
    with torch.no_grad():
        cache = ours.new_cache(3, 8)
        ours(_ids(rows=1, tokens=2), cache=cache)
    sizes = {name: sum(layer[name][0].numel() for layer in cache.layers if name in layer)
             for name in ("conv_state", "recurrent_state")}
    assert cfg.state_elements_per_sequence() == sizes == {"conv_state": 0, "recurrent_state": 2 * 4 * 8 * 8}


def test_logits_match_transformers(pair):
    hf, ours, _ = pair
    check_logits(hf, ours, _ids())


def test_greedy_matches_generate(pair):
    hf, ours, _ = pair
    check_greedy(hf, ours, _ids(seed=1), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[1], _ids(seed=2), prefill=9)


def test_chunked_prefill_equals_one_pass(pair):
    check_chunked_prefill(pair[1], expect_states=2)   # two lightning layers, one state each


def test_block_size_does_not_change_the_logits(pair):
    ours = copy.deepcopy(pair[1])
    for layer in ours.model.layers:
        if isinstance(layer.self_attn, LightningAttention):
            layer.self_attn.block_size = 5
    with torch.no_grad():
        torch.testing.assert_close(ours(_ids(seed=4)), pair[1](_ids(seed=4)), atol=1e-5, rtol=0)


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
    """Dropping any of the particulars moves the logits far from transformers': the slopes' dependence on the layer,
    the output gate, the output norm, the residual factors."""
    hf, ours, _ = pair
    ids = _ids(seed=6)

    def far(edit):
        m = copy.deepcopy(ours)
        with torch.no_grad():
            for layer in m.model.layers:
                edit(layer)
            return float((m(ids) - hf(ids).logits).abs().max())

    def lightning(fn):
        return lambda layer: fn(layer.self_attn) if isinstance(layer.self_attn, LightningAttention) else None

    assert far(lambda layer: None) < 1e-4
    assert far(lightning(lambda a: a.slope.copy_(lightning_slopes(4, 0, 4)))) > 1e-2
    assert far(lightning(lambda a: a.output_gate.weight.zero_())) > 1e-2      # sigmoid(0) = 1/2 instead of the gate
    assert far(lightning(lambda a: a.norm.weight.fill_(1.0))) > 1e-2
    assert far(lambda layer: setattr(layer, "attn_factors", (1.0, 1.0))) > 1e-2
    assert far(lambda layer: setattr(layer, "mlp_factors", (1.0, 1.0))) > 1e-2


def test_bad_config():
    base = {"model_type": "minimax", **{k: v for k, v in SIZES.items() if v is not None}}
    with pytest.raises(ValueError, match="layer_types"):
        dm.ModelConfig.from_dict({**base, "layer_types": ["full_attention", "conv"] * 2})
    from dynamoe.models.registry import builder_for

    cfg = dm.ModelConfig.from_dict({**base, "mlp_beta_factor": "big"})
    with pytest.raises(ValueError, match="mlp_beta_factor"):
        builder_for(cfg)(cfg)
