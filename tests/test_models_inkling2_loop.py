"""Inkling-2-Loop's language model against transformers on tiny random checkpoints (the hub's layout, as
transformers saves it): the loop layers run several passes, each later pass restarting from the state before the
loop with messages from the previous pass (message queries over the blocks it closed, low-rank message gates on the
query, key, value and MLP inputs); every pass with its own keys, values and conv windows in the cache -- chunked
prefill, decode, rows at different positions, a reused slot, the engine."""
import copy
import dataclasses

import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_util import ids as _ids
from recurrent_util import (check_bf16, check_chunked_prefill, check_engine, check_reused_slot,
                            check_rows_at_different_positions, check_truncated_slot_is_an_error)

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.inkling2_loop import Inkling2LoopForCausalLM  # noqa: E402

SIZES = dict(vocab_size=VOCAB, unpadded_vocab_size=VOCAB, hidden_size=64, num_hidden_layers=6, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, swa_num_attention_heads=2, swa_num_key_value_heads=1, swa_head_dim=8,
             sliding_window_size=6, d_rel=4, rel_extent=10, conv_kernel_size=3, moe_intermediate_size=16,
             n_routed_experts=6, num_experts_per_tok=2, route_scale=2.0, max_position_embeddings=256,
             log_scaling_n_floor=4, loop_gate_rank=8, bos_token_id=None, eos_token_id=None)
VARIANTS = {
    # one layer a block: the previous pass's closed blocks reach the messages; layers after the loop; 3 passes
    "blocks-of-1": dict(layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid", "hybrid_sliding",
                                     "hybrid"], n_layers_per_attn_res_block=1, loop_layer_index_start=2,
                        loop_layer_index_end=4, loop_num_passes=3, qk_l2_clip_threshold=3.0),
    # inside the multimodal wrapper: blocks of 2, the loop to the last layer, 2 passes
    "wrapped": dict(layer_types=["hybrid_sliding", "hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid_sliding",
                                 "hybrid"], n_layers_per_attn_res_block=2, loop_layer_index_start=2,
                    loop_layer_index_end=6, loop_num_passes=2),
}
VISION = dict(text_hidden_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
              projection_hidden_dim=16, posemb_grid_size=4)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    text = transformers.Inkling2LoopTextConfig(**{**SIZES, **VARIANTS[request.param]})
    if request.param == "wrapped":
        cfg = transformers.Inkling2LoopConfig(text_config=text.to_dict(), vision_config=VISION)
        hf = transformers.Inkling2LoopForConditionalGeneration(cfg).eval()
    else:
        hf = transformers.Inkling2LoopForCausalLM(text).eval()
    # (std 0.1: with 0.2 the looped layers amplify fp32 rounding past 1e-4 over ten layer runs, in either model)
    randomize_(hf, seed=1, std=0.1, scales={"lm_head": 0.2, "message_input": 0.5})
    with torch.no_grad():  # (buffers: randomize_ leaves them at zero) a selection bias that changes the choice
        for n, b in hf.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(3)) * 0.3)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"inkling2_loop_{request.param}"))
    return request.param, hf, dm.load(path, progress=False), path


def _text(hf):
    return getattr(hf.config, "text_config", hf.config)


def test_structure(pair):
    name, hf, ours, _ = pair
    cfg, hcfg = ours.config, _text(hf)
    assert type(ours) is Inkling2LoopForCausalLM and ours.config.text_config_nested == (name == "wrapped")
    loop = ours.loop
    assert (loop.start, loop.end, loop.passes, loop.gate_rank) == (
        hcfg.loop_layer_index_start, hcfg.loop_layer_index_end, hcfg.loop_num_passes, hcfg.loop_gate_rank)
    for i, layer in enumerate(ours.model.layers):
        assert hasattr(layer, "q_message_gate") == (loop.start <= i < loop.end)
    runs = hcfg.total_num_hidden_layers
    cache = ours.new_cache(2, 8)
    assert len(cache.layers) == runs
    sizes = [(2, 1, 8) if t == "sliding_attention" else (4, 2, 16) for t in cfg.layer_types]
    sizes += sizes[loop.start:loop.end] * (loop.passes - 1)
    assert cfg.kv_elements_per_position() == sum(2 * kv * d for _, kv, d in sizes)
    with torch.no_grad():
        ours(_ids(rows=1, tokens=2), cache=cache)
    conv = sum(t[0].numel() for layer in cache.layers for n, t in layer.items() if n.startswith("conv_"))
    assert cfg.state_elements_per_sequence() == {"conv_state": conv, "recurrent_state": 0}
    assert all(any(n.startswith("conv_") for n in layer) for layer in cache.layers)   # every pass keeps its windows


def test_logits_match_transformers(pair):
    _, hf, ours, _ = pair
    check_logits(hf, ours, _ids())


def test_greedy_matches_generate(pair):
    _, hf, ours, _ = pair
    check_greedy(hf, ours, _ids(seed=1), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[2], _ids(seed=2), prefill=9)


def test_chunked_prefill_equals_one_pass(pair):
    runs = pair[2].config.num_hidden_layers + pair[2].loop.extra_layers
    check_chunked_prefill(pair[2], cuts=((0, 13), (13, 14), (14, 16), (16, 28)), expect_states=4 * runs,
                          state_names=("conv_k", "conv_v", "conv_attn", "conv_mlp"))


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[2])


def test_rows_at_different_positions_in_one_chunk(pair):
    check_rows_at_different_positions(pair[2])


def test_reused_slot_starts_from_zero_state(pair):
    check_reused_slot(pair[2])


def test_truncated_slot_is_an_error(pair):
    check_truncated_slot_is_an_error(pair[2])


def test_engine_generates_each_requests_own_continuation(pair):
    check_engine(pair[2])


@pytest.mark.parametrize("pair", ["blocks-of-1"], indirect=True)
def test_bf16_tracks_transformers_bf16(pair):
    # (transformers keeps the convolutions, the router, the block and message queries and the gates in fp32: so here)
    hf16 = transformers.Inkling2LoopForCausalLM.from_pretrained(pair[3], dtype=torch.bfloat16).eval()
    check_bf16(pair[1], pair[3], hf16=hf16)


def test_each_feature_matters(pair):
    """The later passes, the message gates and (with closed blocks to attend over) the message queries each move the
    logits far from transformers'."""
    name, hf, ours, _ = pair
    ids = _ids()

    def far(edit):
        m = copy.deepcopy(ours)
        edit(m)
        with torch.no_grad():
            return float((m(ids) - hf(ids).logits).abs().max())

    def gates(m, kind):
        for layer in m.model.layers[m.loop.start:m.loop.end]:
            getattr(layer, f"{kind}_message_gate").message_gate_proj.weight.data.zero_()

    assert far(lambda m: None) < 1e-4
    assert far(lambda m: object.__setattr__(m, "loop", dataclasses.replace(m.loop, passes=1))) > 1e-2
    for kind in ("q", "k", "v", "mlp"):
        assert far(lambda m: gates(m, kind)) > 1e-3, kind
    if name == "blocks-of-1":
        assert far(lambda m: m.model.message_input.query_kv.data.zero_()) > 1e-3


@pytest.mark.parametrize("pair", ["wrapped"], indirect=True)
def test_wrapper_parts_are_skipped_and_logged(pair, caplog):
    import logging

    *_, path = pair
    with caplog.at_level(logging.INFO, logger="dynamoe.models.loader"):
        dm.load(path, progress=False)
    notes = [r.getMessage() for r in caplog.records if "not loading" in r.getMessage()]
    assert len(notes) == 1 and notes[0].startswith("inkling2_loop_text: not loading"), notes
    assert "model.visual.*" in notes[0]


@pytest.mark.parametrize("pair", ["wrapped"], indirect=True)
def test_server_says_images_are_not_supported(pair, tmp_path):
    from serve_testing import image_refusal

    msg = image_refusal(pair[2], str(tmp_path), "loop-tiny")
    assert "images are not supported by the model 'loop-tiny' (inkling2_loop): its vision tower is not loaded" in msg


def test_config_defaults_and_loop_config():
    """A config with only the sizes: Inkling2LoopTextConfig's defaults; the hub's loop_config wins over the flat
    loop fields, as the config class reads it."""
    from dynamoe.models.family_fields import inkling2_loop_layers

    sizes = dict(vocab_size=128, hidden_size=64, num_hidden_layers=24, num_attention_heads=8)
    for extra in ({}, {"loop_config": {"core_start": 12, "core_end": 24, "num_passes": 2, "gate_rank": 16},
                       "loop_num_passes": 5}):
        t = transformers.Inkling2LoopTextConfig(**sizes, **extra)
        cfg = dm.ModelConfig.from_dict({"model_type": "inkling2_loop_text", **sizes, **extra})
        loop = inkling2_loop_layers(cfg)
        assert (loop.start, loop.end, loop.passes, loop.gate_rank) == (
            t.loop_layer_index_start, t.loop_layer_index_end, t.loop_num_passes, t.loop_gate_rank)
        assert cfg.num_hidden_layers + loop.extra_layers == t.total_num_hidden_layers
        assert (cfg.num_experts, cfg.moe_intermediate_size, cfg.raw["log_scaling_n_floor"], cfg.raw["swa_num_attention_heads"]) == \
            (t.n_routed_experts, t.moe_intermediate_size, t.log_scaling_n_floor, t.swa_num_attention_heads)
        assert [x == "sliding_attention" for x in cfg.layer_types] == [x == "hybrid_sliding" for x in t.layer_types]


@pytest.mark.parametrize("extra, match", [
    ({"loop_layer_index_start": 3}, "'loop_layer_index_start' must be a multiple of n_layers_per_attn_res_block=6"),
    ({"loop_layer_index_start": 0}, "'loop_layer_index_start' must be an int >= 1"),
    ({"loop_layer_index_end": 30}, r"'loop_layer_index_end' must be a multiple of n_layers_per_attn_res_block=6 in "
                                   r"\[loop_layer_index_start=6, num_hidden_layers=24\]"),
    ({"loop_num_passes": 0}, "'loop_num_passes' must be an int >= 1"),
    ({"loop_config": [6, 18]}, "'loop_config' must be a dict"),
])
def test_bad_loop_fields_are_named(extra, match):
    cfg = dm.ModelConfig.from_dict({"model_type": "inkling2_loop_text", "vocab_size": 128, "hidden_size": 64,
                                    "num_hidden_layers": 24, "num_attention_heads": 8, **extra})
    with pytest.raises(ValueError, match=match):
        Inkling2LoopForCausalLM(cfg)
