"""Inkling-2's language model against transformers on tiny random checkpoints (saved in the hub's layout, as
transformers saves them): block attention residuals (one query, three on full layers, the final one), full and
sliding layers with their own heads, per-token (dynamic) key / value convolutions on full layers, static ones on
sliding layers and both sublayer outputs, L2-clipped and log-scaled queries and relative states, per-token sinks,
the gated output, softcapped SwiGLU experts, unpadded and softcapped logits; and the conv windows in the cache --
chunked prefill, decode, rows at different positions, a reused slot, the engine, bf16."""
import copy

import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_util import ids as _ids
from recurrent_util import (check_bf16, check_chunked_prefill, check_engine, check_reused_slot,
                            check_rows_at_different_positions, check_truncated_slot_is_an_error)

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.inkling2 import (Inkling2Attention, Inkling2DynamicConv, Inkling2ForCausalLM,  # noqa: E402
                                     Inkling2MoE)

SIZES = dict(vocab_size=VOCAB, unpadded_vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, swa_num_attention_heads=2, swa_num_key_value_heads=1, swa_head_dim=8, sliding_window_size=6,
             d_rel=4, rel_extent=10, conv_kernel_size=3, moe_intermediate_size=16, n_routed_experts=6,
             num_experts_per_tok=2, route_scale=2.0, n_layers_per_attn_res_block=2, max_position_embeddings=256,
             bos_token_id=None, eos_token_id=None)
# caps and clips low enough that the random weights reach them
TIGHT = dict(qk_l2_clip_threshold=3.0, rel_l2_clip_threshold=1.0, mlp_gate_softcap=1.0, mlp_up_softcap=2.0,
             final_logit_softcapping=3.0, log_scaling_n_floor=4)
VARIANTS = {
    # sliding / full alternating, blocks of 2 layers, tight caps, log scaling from position 4, a padded head
    "tight": dict(layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid"], unpadded_vocab_size=120,
                  **TIGHT),
    # a full first layer (its dynamic convolutions check the slots' positions), blocks of 3, a wider conv, the
    # default caps and clips
    "full-first": dict(layer_types=["hybrid", "hybrid_sliding", "hybrid_sliding", "hybrid"], conv_kernel_size=4,
                       n_layers_per_attn_res_block=3, log_scaling_n_floor=8),
    # inside the multimodal wrapper (model.llm.*, model.visual.*)
    "wrapped": dict(layer_types=["hybrid_sliding", "hybrid_sliding", "hybrid", "hybrid_sliding"], pad_token_id=0,
                    **TIGHT),
}
VISION = dict(text_hidden_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
              projection_hidden_dim=16, posemb_grid_size=4)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    text = transformers.Inkling2TextConfig(**{**SIZES, **VARIANTS[request.param]})
    if request.param == "wrapped":
        cfg = transformers.Inkling2Config(text_config=text.to_dict(), vision_config=VISION)
        hf = transformers.Inkling2ForConditionalGeneration(cfg).eval()
    else:
        hf = transformers.Inkling2ForCausalLM(text).eval()
    randomize_(hf, seed=1, scales={"lm_head": 0.2})
    with torch.no_grad():  # (buffers: randomize_ leaves them at zero) a selection bias that changes the choice
        for n, b in hf.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(3)) * 0.3)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"inkling2_{request.param}"))
    return request.param, hf, dm.load(path, progress=False), path


def _text(hf):
    return getattr(hf.config, "text_config", hf.config)


def test_structure(pair):
    name, hf, ours, _ = pair
    cfg, hcfg = ours.config, _text(hf)
    assert ours.config.text_config_nested == (name == "wrapped")
    assert type(ours) is Inkling2ForCausalLM and type(ours).recurrent_state is True
    assert [t == "sliding_attention" for t in cfg.layer_types] == [t == "hybrid_sliding" for t in hcfg.layer_types]
    for i, (kind, layer) in enumerate(zip(cfg.layer_types, ours.model.layers)):
        attn = layer.self_attn
        sliding = kind == "sliding_attention"
        assert type(attn) is Inkling2Attention and attn.full is not sliding
        assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == ((2, 1, 8) if sliding else (4, 2, 16))
        assert attn.rel_logits_proj.proj.shape[-1] == (6 if sliding else 10) and attn.scale == attn.head_dim ** -0.5
        assert (type(attn.k_sconv) is Inkling2DynamicConv) is not sliding
        assert type(layer.mlp) is Inkling2MoE and layer.mlp.moe.experts.activation == "silu_softcap"
        assert layer.boundary == (i % hcfg.n_layers_per_attn_res_block == 0)
        assert (layer.attention_input is None) == (i == 0)
        if i:
            assert layer.attention_input.query.shape == ((64,) if sliding else (3, 64))
        assert layer.attn_sconv.conv1d.weight.dtype == torch.float32
    assert not cfg.tie_word_embeddings and ours.lm_head.weight is not ours.model.embed_tokens.weight
    assert ours.lm_head.keep == (None if hcfg.unpadded_vocab_size == VOCAB else hcfg.unpadded_vocab_size)
    sizes = [(2, 1, 8) if t == "sliding_attention" else (4, 2, 16) for t in cfg.layer_types]
    assert cfg.kv_elements_per_position() == sum(2 * kv * d for _, kv, d in sizes)
    with torch.no_grad():
        cache = ours.new_cache(2, 8)
        ours(_ids(rows=1, tokens=2), cache=cache)
    conv = sum(t[0].numel() for layer in cache.layers for n, t in layer.items() if n.startswith("conv_"))
    assert cfg.state_elements_per_sequence() == {"conv_state": conv, "recurrent_state": 0}


def test_logits_match_transformers(pair):
    _, hf, ours, _ = pair
    check_logits(hf, ours, _ids())


def test_greedy_matches_generate(pair):
    _, hf, ours, _ = pair
    check_greedy(hf, ours, _ids(seed=1), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[2], _ids(seed=2), prefill=9)


def test_chunked_prefill_equals_one_pass(pair):
    # chunks of 1 and 2 tokens: shorter than and equal to the conv windows (2 or 3)
    check_chunked_prefill(pair[2], cuts=((0, 13), (13, 14), (14, 16), (16, 28)), expect_states=16,
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


def test_long_prefill_in_query_chunks(pair, monkeypatch):
    """A prefill whose scores exceed the budget runs in chunks of queries (each over the keys its window reaches):
    the same logits."""
    import dynamoe.models.inkling2 as ink2

    ours, ids = pair[2], _ids(tokens=40, seed=6)
    with torch.no_grad():
        whole = ours(ids)
        monkeypatch.setattr(ink2, "_SCORE_BUDGET", 2 * 4 * 40 * 7)   # 7 queries per chunk
        torch.testing.assert_close(ours(ids), whole, atol=1e-5, rtol=0)


@pytest.mark.parametrize("pair", ["tight"], indirect=True)
def test_bf16_tracks_transformers_bf16(pair):
    # (transformers keeps the convolutions, the router and the block queries in fp32: so here)
    hf16 = transformers.Inkling2ForCausalLM.from_pretrained(pair[3], dtype=torch.bfloat16).eval()
    check_bf16(pair[1], pair[3], hf16=hf16)


def test_each_feature_matters(pair):
    """Dropping any of the particulars moves the logits far from transformers': the block queries, the dynamic taps,
    the static convolutions, the sinks, the relative bias, the output gate, the selection bias; with the tight caps
    also the clips, the log scaling, the experts' and the logits' softcaps."""
    name, hf, ours, _ = pair
    ids = _ids()

    def far(model):
        with torch.no_grad():
            return float((model(ids) - hf(ids).logits).abs().max())

    def edited(edit, full_only=False):
        m = copy.deepcopy(ours)
        for layer in m.model.layers:
            if not full_only or layer.self_attn.full:
                edit(layer)
        return m

    def model_edit(edit):
        m = copy.deepcopy(ours)
        edit(m)
        return m

    assert far(ours) < 1e-4
    assert far(edited(lambda layer: layer.mlp_input.query.data.zero_())) > 1e-2
    assert far(edited(lambda layer: layer.attention_input is not None and layer.attention_input.query.data.zero_())) > 1e-2
    assert far(model_edit(lambda m: m.model.norm.final_input.query.data.zero_())) > 1e-2
    assert far(edited(lambda layer: layer.self_attn.k_sconv.weight_proj.weight.data.zero_(), full_only=True)) > 1e-2
    assert far(edited(lambda layer: layer.attn_sconv.conv1d.weight.data.zero_())) > 1e-2
    assert far(edited(lambda layer: layer.self_attn.sink_proj.weight.data.zero_())) > 1e-2
    assert far(edited(lambda layer: layer.self_attn.rel_logits_proj.proj.data.zero_())) > 1e-2
    assert far(edited(lambda layer: layer.self_attn.gate_proj.weight.data.zero_())) > 1e-2
    assert far(edited(lambda layer: layer.mlp.moe.gates[0].e_score_correction_bias.zero_())) > 1e-2
    if name == "full-first":
        return
    assert far(edited(lambda layer: setattr(layer.self_attn, "qk_clip", 1e6))) > 1e-2
    assert far(edited(lambda layer: setattr(layer.self_attn, "rel_clip", 1e6))) > 1e-2
    assert far(edited(lambda layer: setattr(layer.self_attn, "log_alpha", 0.0), full_only=True)) > 1e-2
    assert far(edited(lambda layer: setattr(layer.mlp.moe.experts, "alpha", 1e6))) > 1e-2
    assert far(edited(lambda layer: setattr(layer.mlp.moe.experts, "limit", 1e6))) > 1e-2
    assert far(model_edit(lambda m: setattr(m.lm_head, "cap", 1e6))) > 1e-2


def test_decode_refusal_says_why(pair):
    from dynamoe.models.norms import RMSNorm

    block = pair[2].model.layers[0].mlp
    fused = block.decode_fused(torch.zeros(1, 64), RMSNorm(64))
    assert fused.weights is None and "softcapped SwiGLU" in fused.extra


@pytest.mark.parametrize("pair", ["tight"], indirect=True)
def test_block_quantized_experts_are_refused_by_name(pair, tmp_path):
    import shutil

    from safetensors.torch import load_file, save_file

    path = pair[3]
    tensors = load_file(f"{path}/model.safetensors")
    tensors["model.llm.layers.0.mlp.experts.w13_weight_scale"] = torch.zeros(6, 32, 2, dtype=torch.uint8)
    save_file(tensors, str(tmp_path / "model.safetensors"))
    shutil.copy(f"{path}/config.json", tmp_path / "config.json")
    with pytest.raises(ValueError, match=r"inkling2_text: the checkpoint's experts are block-quantized \(MXFP8 / NVFP4: "
                                         r"model\.llm\.layers\.0\.mlp\.experts\.w13_weight_scale and 0 more"):
        dm.load(str(tmp_path), progress=False)


@pytest.mark.parametrize("pair", ["wrapped"], indirect=True)
def test_wrapper_parts_are_skipped_and_logged(pair, caplog):
    import logging

    *_, path = pair
    with caplog.at_level(logging.INFO, logger="dynamoe.models.loader"):
        dm.load(path, progress=False)
    notes = [r.getMessage() for r in caplog.records if "not loading" in r.getMessage()]
    assert len(notes) == 1 and notes[0].startswith("inkling2_text: not loading"), notes
    assert "model.visual.*" in notes[0]


@pytest.mark.parametrize("pair", ["wrapped"], indirect=True)
def test_server_says_images_are_not_supported(pair, tmp_path):
    from serve_testing import image_refusal

    msg = image_refusal(pair[2], str(tmp_path), "inkling2-tiny")
    assert "images are not supported by the model 'inkling2-tiny' (inkling2): its vision tower is not loaded" in msg


def test_config_defaults_and_kinds():
    """A config with only the sizes: Inkling2TextConfig's defaults; the config class's other names
    (sconv_kernel_size, model_max_length, intermediate_size, routed_scaling_factor) read as transformers reads them."""
    sizes = dict(vocab_size=128, hidden_size=64, num_hidden_layers=7, num_attention_heads=8)
    for extra in ({}, {"sconv_kernel_size": 2, "model_max_length": 512, "intermediate_size": 32,
                       "routed_scaling_factor": 3.0}):
        t = transformers.Inkling2TextConfig(**sizes, **extra)
        cfg = dm.ModelConfig.from_dict({"model_type": "inkling2_text", **sizes, **extra})
        assert [x == "sliding_attention" for x in cfg.layer_types] == [x == "hybrid_sliding" for x in t.layer_types]
        assert all(cfg.is_moe_layer(i) for i in range(7))
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.sliding_window,
                cfg.max_position_embeddings, cfg.raw["conv_kernel_size"], cfg.head_dim, cfg.num_key_value_heads,
                cfg.bos_token_id, cfg.eos_token_id, cfg.tie_word_embeddings, cfg.rms_norm_eps) == \
            (t.n_routed_experts, t.num_experts_per_tok, t.moe_intermediate_size, t.sliding_window_size,
             t.max_position_embeddings, t.conv_kernel_size, t.head_dim, t.num_key_value_heads, t.bos_token_id,
             (t.eos_token_id,), False, t.rms_norm_eps)
        for f in ("swa_num_attention_heads", "swa_num_key_value_heads", "swa_head_dim", "d_rel", "rel_extent",
                  "log_scaling_n_floor", "log_scaling_alpha", "route_scale", "unpadded_vocab_size",
                  "qk_l2_clip_threshold", "rel_l2_clip_threshold", "n_layers_per_attn_res_block", "mlp_gate_softcap",
                  "mlp_up_softcap", "final_logit_softcapping", "scoring_func"):
            assert cfg.raw.get(f) == getattr(t, f), f


@pytest.mark.parametrize("field, value, match", [
    ("scoring_func", "softmax", "'scoring_func' must be 'sigmoid'"),
    ("n_layers_per_attn_res_block", 0, "'n_layers_per_attn_res_block' must be an int > 0"),
    ("mlp_gate_softcap", -1.0, "'mlp_gate_softcap' must be a number > 0"),
    ("unpadded_vocab_size", 500, r"'unpadded_vocab_size' must be an int in \[1, vocab_size=128\]"),
    ("tie_word_embeddings", True, None),   # (ignored, as transformers: never tied)
])
def test_bad_fields_are_named(field, value, match):
    cfg = dm.ModelConfig.from_dict({"model_type": "inkling2_text", **SIZES, "layer_types": ["hybrid"] * 4,
                                    field: value})
    if match is None:
        assert not cfg.tie_word_embeddings
        Inkling2ForCausalLM(cfg)
        return
    with pytest.raises(ValueError, match=match):
        Inkling2ForCausalLM(cfg)


def test_softcapped_swiglu_equals_transformers():
    """GLU kind 'silu_softcap' (alpha the gate's cap, limit up's) is transformers' Inkling2SoftcappedSwiGLU, also where
    the caps bite; in bf16 computed in fp32 and rounded once."""
    from transformers.models.inkling2.modeling_inkling2 import Inkling2SoftcappedSwiGLU

    from dynamoe.ops.activations import glu_activation

    act = Inkling2SoftcappedSwiGLU(transformers.Inkling2TextConfig(mlp_gate_softcap=3.0, mlp_up_softcap=5.0))
    g = torch.Generator().manual_seed(0)
    gate, up = torch.randn(64, 16, generator=g) * 8, torch.randn(64, 16, generator=g) * 8
    for dt in (torch.float32, torch.bfloat16):
        got = glu_activation(gate.to(dt), up.to(dt), "silu_softcap", alpha=3.0, limit=5.0)
        assert got.dtype == dt
        torch.testing.assert_close(got, act(gate.to(dt), up.to(dt)), atol=0, rtol=0)
    assert (glu_activation(gate, up, "silu_softcap", alpha=3.0, limit=5.0)
            - glu_activation(gate, up, "silu")).abs().max() > 1.0
