"""Jamba against transformers on a tiny random checkpoint: Mamba-1 layers (selective scan with RMSNorms on dt, B
and C) and position-free attention layers by period/offset, softmax top-k MoE without renormalisation on every
other layer, dense SwiGLU MLPs elsewhere; the selective scan's chunked form against its recurrence; and the
Mamba state in the cache -- chunked prefill, decode, rows at different positions, a reused slot, the engine."""
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
from dynamoe.models.mamba import (MambaMixer, conv_with_state, selective_scan_chunked,  # noqa: E402
                                  selective_scan_recurrent)
from dynamoe.models.moe_block import GatedMLP, SparseMoeBlock  # noqa: E402

# five layers: attention on 1 and 4 (period 3, offset 1), MoE on 0, 2, 4 (period 2, offset 0): every pairing of
# mixer and MLP kind
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=48, num_hidden_layers=5, num_attention_heads=4,
             num_key_value_heads=2, num_experts=4, num_experts_per_tok=2, attn_layer_period=3, attn_layer_offset=1,
             expert_layer_period=2, expert_layer_offset=0, mamba_d_state=8, mamba_dt_rank=4, mamba_d_conv=4,
             max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.JambaForCausalLM(transformers.JambaConfig(**SIZES)).eval()
    randomize_(hf, seed=1)
    path = save_tiny(hf, tmp_path_factory.mktemp("jamba"))
    return hf, dm.load(path, progress=False), path


# ------------------------------------------------------------------------------ the scan
@pytest.mark.parametrize("parallel", [True, False])
@pytest.mark.parametrize("chunk", [1, 3, 8, 64])
def test_chunked_scan_equals_recurrent(chunk, parallel):
    """fp64: the chunked scan (the doubling steps, or the per-token sweep) is the recurrence, with and without a
    start state; two calls carrying the state equal one."""
    g = torch.Generator().manual_seed(0)
    B, I, T, N = 2, 5, 29, 4
    x = torch.randn(B, I, T, generator=g, dtype=torch.float64)
    dt = torch.nn.functional.softplus(torch.randn(B, I, T, generator=g, dtype=torch.float64))
    A = -torch.rand(I, N, generator=g, dtype=torch.float64) * 2
    Bm, Cm = (torch.randn(B, T, N, generator=g, dtype=torch.float64) for _ in range(2))
    for h0 in (None, torch.randn(B, I, N, generator=g, dtype=torch.float64)):
        y_ref, h_ref = selective_scan_recurrent(x, dt, A, Bm, Cm, h0)
        y, h = selective_scan_chunked(x, dt, A, Bm, Cm, h0, chunk_size=chunk, parallel=parallel)
        assert y.dtype == torch.float64 and y.shape == (B, I, T) and h.shape == (B, I, N)
        torch.testing.assert_close(y, y_ref, atol=1e-12, rtol=0)
        torch.testing.assert_close(h, h_ref, atol=1e-12, rtol=0)
    y1, h1 = selective_scan_chunked(x[..., :11], dt[..., :11], A, Bm[:, :11], Cm[:, :11], chunk_size=chunk,
                                    parallel=parallel)
    y2, h2 = selective_scan_chunked(x[..., 11:], dt[..., 11:], A, Bm[:, 11:], Cm[:, 11:], h1, chunk_size=chunk,
                                    parallel=parallel)
    y_ref, h_ref = selective_scan_recurrent(x, dt, A, Bm, Cm)
    torch.testing.assert_close(torch.cat([y1, y2], -1), y_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(h2, h_ref, atol=1e-12, rtol=0)
    with pytest.raises(ValueError, match="chunk_size"):
        selective_scan_chunked(x, dt, A, Bm, Cm, chunk_size=0)


def test_conv_with_bias_continues():
    g = torch.Generator().manual_seed(1)
    conv = torch.nn.Conv1d(5, 5, 4, groups=5, padding=3, dtype=torch.float64)
    x = torch.randn(2, 5, 11, generator=g, dtype=torch.float64)
    with torch.no_grad():
        ref = conv(x)[..., :11]
        whole, end = conv_with_state(x, conv, None)
        state, parts = None, []
        for a, b in ((0, 2), (2, 3), (3, 9), (9, 11)):
            y, state = conv_with_state(x[..., a:b], conv, state)
            parts.append(y)
    torch.testing.assert_close(whole, ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(torch.cat(parts, -1), ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(state, end, atol=0, rtol=0)


# ------------------------------------------------------------------------------ the model
def test_structure(pair):
    _, ours, _ = pair
    cfg = ours.config
    assert type(ours).recurrent_state is True
    assert cfg.layer_types == ("linear_attention", "full_attention", "linear_attention", "linear_attention",
                               "full_attention")
    assert [type(layer.mixer) for layer in ours.model.layers] == [MambaMixer, Attention, MambaMixer, MambaMixer,
                                                                   Attention]
    assert [type(layer.mlp) for layer in ours.model.layers] == [SparseMoeBlock, GatedMLP] * 2 + [SparseMoeBlock]
    assert not any(layer.self_attn.use_rope for layer in ours.model.layers if hasattr(layer, "self_attn"))
    assert not ours.model.layers[0].mlp.moe.config.gates[0].normalize
    assert cfg.ssm.kind == "mamba1" and (cfg.ssm.intermediate_size, cfg.ssm.state_size, cfg.ssm.dt_rank) == (64, 8, 4)
    assert cfg.kv_elements_per_position() == 2 * 2 * 2 * 8   # the two attention layers' keys and values
    with torch.no_grad():
        cache = ours.new_cache(3, 8)
        ours(_ids(rows=1, tokens=2), cache=cache)
    sizes = {name: sum(layer[name][0].numel() for layer in cache.layers if name in layer)
             for name in ("conv_state", "recurrent_state")}
    assert cfg.state_elements_per_sequence() == sizes == {"conv_state": 3 * 64 * 3, "recurrent_state": 3 * 64 * 8}
    assert cache.layers[0]["recurrent_state"].dtype == torch.float32


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


def test_scan_chunk_length_does_not_change_the_logits(pair):
    """The prefill crosses scan chunk boundaries (chunks of 5 over 24 tokens) and gives the one-chunk logits."""
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


def _far_from(hf, model, ids) -> float:
    with torch.no_grad():
        return float((model(ids) - hf(ids).logits).abs().max())


def test_each_feature_matters(pair):
    """Dropping any of Jamba's particulars moves the logits far from transformers': the dt/B/C norms, the D skip,
    the gate, the un-renormalised routing weights, the attention without RoPE."""
    hf, ours, _ = pair
    ids = _ids(seed=6)
    variants = {}
    m = copy.deepcopy(ours)
    for layer in m.model.layers:
        if hasattr(layer, "mamba"):
            layer.mamba.dt_layernorm = layer.mamba.b_layernorm = layer.mamba.c_layernorm = None
    variants["no dt/B/C norms"] = m
    m = copy.deepcopy(ours)
    with torch.no_grad():
        for layer in m.model.layers:
            if hasattr(layer, "mamba"):
                layer.mamba.D.zero_()
    variants["no D skip"] = m
    m = copy.deepcopy(ours)
    for layer in m.model.layers:
        if hasattr(layer, "self_attn"):
            layer.self_attn.use_rope = True
    variants["RoPE in attention"] = m
    m = copy.deepcopy(ours)
    for i, layer in enumerate(m.model.layers):
        if isinstance(layer.mlp, SparseMoeBlock):
            renorm = SparseMoeBlock(m.config, "softmax", normalize=True)
            renorm.load_state_dict(layer.mlp.state_dict())
            layer.mlp = renorm
    variants["renormalised top-k"] = m
    for name, model in variants.items():
        assert _far_from(hf, model, ids) > 1e-2, name


def test_bad_config():
    base = {"model_type": "jamba", **{k: v for k, v in SIZES.items() if v is not None}}
    with pytest.raises(ValueError, match="attn_layer_offset"):
        dm.ModelConfig.from_dict({**base, "attn_layer_offset": 3})
    with pytest.raises(ValueError, match="mamba_dt_rank"):
        dm.ModelConfig.from_dict({**base, "mamba_dt_rank": "big"})
    with pytest.raises(ValueError, match="hidden_act"):
        MambaMixer(32, 64, 8, 4, 4, 0, activation="gelu")
