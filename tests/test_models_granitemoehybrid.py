"""GraniteMoE-Hybrid against transformers on tiny random checkpoints: Mamba-2 layers (the SSD recurrence with grouped
B/C, a group-wise gated RMSNorm) and attention layers by the hub's legacy layer names, GraniteMoE-Shared's routed
experts plus shared MLP (or the shared MLP alone), muP multipliers, attention with or without RoPE; the SSD's
chunked form against its recurrence; and the Mamba state in the cache -- chunked prefill, decode, rows at different
positions, a reused slot, the engine."""
import copy
import json
import os

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
from dynamoe.models.granitemoehybrid import FusedGateUpMLP  # noqa: E402
from dynamoe.models.mamba2 import Mamba2Mixer, ssd_chunked, ssd_recurrent  # noqa: E402
from dynamoe.models.moe_block import SparseMoeBlock  # noqa: E402

# hub-style legacy layer names; 4 heads in 2 groups; SSD chunks of 8 (the prompts cross chunk boundaries)
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=24, shared_intermediate_size=40, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, num_experts_per_tok=2,
             layer_types=["mamba", "attention", "mamba", "mamba"], mamba_n_heads=4, mamba_d_state=8, mamba_n_groups=2,
             mamba_chunk_size=8, embedding_multiplier=2.0, residual_multiplier=0.5, attention_multiplier=0.3,
             logits_scaling=2.0, max_position_embeddings=256, bos_token_id=None, eos_token_id=None)
VARIANTS = {
    "moe": dict(num_local_experts=4),                                           # no position encoding
    "shared-only-rope": dict(num_local_experts=0, position_embedding_type="rope"),
}


def _build(variant, **extra):
    torch.manual_seed(0)
    hf = transformers.GraniteMoeHybridForCausalLM(
        transformers.GraniteMoeHybridConfig(**{**SIZES, **VARIANTS[variant], **extra})).eval()
    randomize_(hf, seed=1)
    return hf


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    hf = _build(request.param)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"granitemoehybrid_{request.param}"))
    return hf, dm.load(path, progress=False), path


# ------------------------------------------------------------------------------ the SSD
@pytest.mark.parametrize("chunk", [1, 3, 8, 64])
def test_chunked_ssd_equals_recurrent(chunk):
    """fp64: the chunked SSD is the recurrence, with and without a start state; two calls carrying the state
    equal one."""
    g = torch.Generator().manual_seed(0)
    B, T, H, P, G, N = 2, 29, 4, 3, 2, 5
    x = torch.randn(B, T, H, P, generator=g, dtype=torch.float64)
    dt = torch.nn.functional.softplus(torch.randn(B, T, H, generator=g, dtype=torch.float64))
    A = -torch.rand(H, generator=g, dtype=torch.float64) * 2
    Bm, Cm = (torch.randn(B, T, G, N, generator=g, dtype=torch.float64) for _ in range(2))
    for s0 in (None, torch.randn(B, H, P, N, generator=g, dtype=torch.float64)):
        y_ref, s_ref = ssd_recurrent(x, dt, A, Bm, Cm, s0)
        y, s = ssd_chunked(x, dt, A, Bm, Cm, s0, chunk_size=chunk)
        assert y.dtype == torch.float64 and y.shape == (B, T, H, P) and s.shape == (B, H, P, N)
        torch.testing.assert_close(y, y_ref, atol=1e-12, rtol=0)
        torch.testing.assert_close(s, s_ref, atol=1e-12, rtol=0)
    y1, s1 = ssd_chunked(x[:, :11], dt[:, :11], A, Bm[:, :11], Cm[:, :11], chunk_size=chunk)
    y2, s2 = ssd_chunked(x[:, 11:], dt[:, 11:], A, Bm[:, 11:], Cm[:, 11:], s1, chunk_size=chunk)
    y_ref, s_ref = ssd_recurrent(x, dt, A, Bm, Cm)
    torch.testing.assert_close(torch.cat([y1, y2], 1), y_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(s2, s_ref, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="chunk_size"):
        ssd_chunked(x, dt, A, Bm, Cm, chunk_size=0)


# ------------------------------------------------------------------------------ the model
def test_structure(pair):
    _, ours, _ = pair
    cfg = ours.config
    moe = cfg.num_experts > 0
    assert type(ours).recurrent_state is True
    assert cfg.layer_types == ("linear_attention", "full_attention", "linear_attention", "linear_attention")
    assert [type(layer.mixer) for layer in ours.model.layers] == [Mamba2Mixer, Attention, Mamba2Mixer, Mamba2Mixer]
    assert all(type(layer.mlp) is (SparseMoeBlock if moe else FusedGateUpMLP) for layer in ours.model.layers)
    attn = ours.model.layers[1].self_attn
    assert attn.use_rope is (not moe) and attn.scale == 0.3
    ssm = cfg.ssm
    assert (ssm.kind, ssm.num_heads, ssm.head_dim, ssm.n_groups, ssm.state_size, ssm.chunk_size) == \
        ("mamba2", 4, 16, 2, 8, 8)
    with torch.no_grad():
        cache = ours.new_cache(3, 8)
        ours(_ids(rows=1, tokens=2), cache=cache)
    sizes = {name: sum(layer[name][0].numel() for layer in cache.layers if name in layer)
             for name in ("conv_state", "recurrent_state")}
    assert cfg.state_elements_per_sequence() == sizes == {"conv_state": 3 * (64 + 2 * 2 * 8) * 3,
                                                           "recurrent_state": 3 * 4 * 16 * 8}


def test_logits_match_transformers(pair):
    hf, ours, _ = pair
    check_logits(hf, ours, _ids())


def test_greedy_matches_generate(pair):
    hf, ours, _ = pair
    check_greedy(hf, ours, _ids(seed=1), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[1], _ids(seed=2), prefill=9)


def test_chunked_prefill_equals_one_pass(pair):
    check_chunked_prefill(pair[1], expect_states=6)   # three Mamba layers, two states each


def test_ssd_chunk_length_does_not_change_the_logits(pair):
    ours = copy.deepcopy(pair[1])
    for layer in ours.model.layers:
        if hasattr(layer, "mamba"):
            layer.mamba.chunk_size = 5
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


def test_time_step_limit_is_read(tmp_path):
    """A clamping time_step_limit (saved by transformers as [low, {"__float__": "Infinity"}] or a finite pair)
    gives transformers' prefill logits (its one-token update does not clamp, so only the prefill compares)."""
    hf = _build("moe", time_step_limit=(0.6, 0.9))
    path = save_tiny(hf, tmp_path / "limit")
    ours = dm.load(path, progress=False)
    assert ours.config.ssm.time_step_limit == (0.6, 0.9)
    check_logits(hf, ours, _ids())
    hf = _build("moe", time_step_limit=(0.7, float("inf")))
    path = save_tiny(hf, tmp_path / "limit_inf")
    with open(os.path.join(path, "config.json")) as f:
        assert json.load(f)["time_step_limit"][1] == {"__float__": "Infinity"}
    ours = dm.load(path, progress=False)
    assert ours.config.ssm.time_step_limit == (0.7, float("inf"))
    check_logits(hf, ours, _ids())


def test_each_feature_matters(pair):
    """Dropping any of the particulars moves the logits far from transformers': the norm's groups, the D skip,
    the residual multiplier, the RoPE switch, the dt clamp."""
    hf, ours, _ = pair
    ids = _ids(seed=6)

    def far(edit):
        m = copy.deepcopy(ours)
        with torch.no_grad():
            for layer in m.model.layers:
                edit(layer)
            return float((m(ids) - hf(ids).logits).abs().max())

    assert far(lambda layer: setattr(layer.mamba.norm, "groups", 1) if hasattr(layer, "mamba") else None) > 1e-2
    assert far(lambda layer: layer.mamba.D.zero_() if hasattr(layer, "mamba") else None) > 1e-2
    assert far(lambda layer: setattr(layer, "residual_multiplier", 1.0)) > 1e-2
    assert far(lambda layer: setattr(layer.self_attn, "use_rope", not layer.self_attn.use_rope)
               if hasattr(layer, "self_attn") else None) > 1e-2
    assert far(lambda layer: setattr(layer.mamba, "time_step_limit", (0.0, 0.05))
               if hasattr(layer, "mamba") else None) > 1e-2


def test_bad_config():
    base = {"model_type": "granitemoehybrid", **{k: v for k, v in SIZES.items() if v is not None}}
    with pytest.raises(ValueError, match="mamba_n_heads"):
        dm.ModelConfig.from_dict({**base, "mamba_n_heads": 5})
    with pytest.raises(ValueError, match="mamba_n_groups"):
        dm.ModelConfig.from_dict({**base, "mamba_n_groups": 3})
    with pytest.raises(ValueError, match="position_embedding_type"):
        dm.ModelConfig.from_dict({**base, "position_embedding_type": "alibi"})
    with pytest.raises(ValueError, match="time_step_limit"):
        dm.ModelConfig.from_dict({**base, "time_step_limit": [1.0]})
    with pytest.raises(ValueError, match="layer_types"):
        dm.ModelConfig.from_dict({**base, "layer_types": ["mamba", "conv", "mamba", "mamba"]})
