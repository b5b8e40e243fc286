"""Inkling's language model against transformers on tiny random checkpoints: full and sliding layers with their own
heads, short convolutions on keys, values and both sublayer outputs, the relative position bias, the full layers'
log scaling, the router whose shared experts are a softmax sink, dense MLPs with an output scale, normed embeddings,
muP-divided and unpadded logits; and the conv windows in the cache -- chunked prefill, decode, rows at different
positions, a reused slot, the engine, bf16."""
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
from dynamoe.models.inkling import InklingAttention, InklingForCausalLM, InklingMLP, InklingMoE  # noqa: E402

SIZES = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, swa_num_attention_heads=2, swa_num_key_value_heads=1, swa_head_dim=8, sliding_window_size=6,
             d_rel=4, rel_extent=10, conv_kernel_size=3, intermediate_size=48, moe_intermediate_size=16,
             n_routed_experts=6, num_experts_per_tok=2, n_shared_experts=2, route_scale=2.0,
             logits_mup_width_multiplier=2.0, max_position_embeddings=256, bos_token_id=None, eos_token_id=None)
VARIANTS = {
    # layers 1 and 3 full with log scaling, a dense first layer, a padded head
    "log-scaled": dict(local_layer_ids=[0, 2], log_scaling_n_floor=4, unpadded_vocab_size=120, dense_mlp_idx=1),
    # the default kinds (all sliding at 4 layers but one full by layer_types), every layer MoE, one shared expert
    "plain": dict(layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding", "hybrid_sliding"], n_shared_experts=1,
                  conv_kernel_size=4, route_scale=8.0),
    # inside the multimodal wrapper, saved in the hub's layout (model.llm.*, interleaved w13): a dense first layer
    "wrapped": dict(local_layer_ids=[0, 2, 3], dense_mlp_idx=1, log_scaling_n_floor=8, pad_token_id=0),
}
VISION = dict(text_hidden_size=64, hidden_size=16, num_hidden_layers=1, num_attention_heads=2, patch_size=4)
AUDIO = dict(text_hidden_size=64, n_mel_bins=4, mel_vocab_size=8)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    text = transformers.InklingTextConfig(**{**SIZES, **VARIANTS[request.param]})
    if request.param == "wrapped":
        cfg = transformers.InklingConfig(text_config=text.to_dict(), vision_config=VISION, audio_config=AUDIO)
        hf = transformers.InklingForConditionalGeneration(cfg).eval()
    else:
        hf = transformers.InklingForCausalLM(text).eval()
    randomize_(hf, seed=1, scales={"lm_head": 0.2})
    with torch.no_grad():  # (buffers: randomize_ leaves them at zero) a selection bias that changes the choice
        for n, b in hf.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=torch.Generator().manual_seed(3)) * 0.3)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"inkling_{request.param}"))
    return request.param, hf, dm.load(path, progress=False), path


def _text(hf):
    return getattr(hf.config, "text_config", hf.config)


def test_structure(pair):
    name, hf, ours, _ = pair
    cfg, hcfg = ours.config, _text(hf)
    assert ours.config.text_config_nested == (name == "wrapped") and ours.hub_names == (name == "wrapped")
    assert type(ours) is InklingForCausalLM and type(ours).recurrent_state is True
    assert [t == "sliding_attention" for t in cfg.layer_types] == [t == "hybrid_sliding" for t in hcfg.layer_types]
    for kind, mlp_kind, layer in zip(cfg.layer_types, hcfg.mlp_layer_types, ours.model.layers):
        attn = layer.self_attn
        assert type(attn) is InklingAttention
        sliding = kind == "sliding_attention"
        assert (attn.num_heads, attn.num_kv_heads, attn.head_dim) == ((2, 1, 8) if sliding else (4, 2, 16))
        assert attn.rel_logits_proj.proj.shape[-1] == (6 if sliding else 10) and attn.scale == 1 / attn.head_dim
        assert attn.log_floor == (None if sliding else hcfg.log_scaling_n_floor)
        assert type(layer.mlp) is (InklingMoE if mlp_kind == "sparse" else InklingMLP)
        assert layer.attn_sconv.conv1d.weight.dtype == torch.float32
    assert not cfg.tie_word_embeddings and ours.lm_head.weight is not ours.model.embed_tokens.weight
    assert ours.lm_head.keep == hcfg.unpadded_vocab_size
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
    # chunks of 1 and 2 tokens: shorter than and equal to the conv window (2 or 3)
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


def test_bf16_tracks_transformers_bf16(pair):
    # (transformers keeps the short convolutions, the selection bias and the router's scale in fp32: so here)
    cls = transformers.InklingForConditionalGeneration if pair[0] == "wrapped" else transformers.InklingForCausalLM
    hf16 = cls.from_pretrained(pair[3], dtype=torch.bfloat16).eval()
    check_bf16(pair[1], pair[3], hf16=hf16)


def test_each_feature_matters(pair):
    """Dropping any of the particulars moves the logits far from transformers': the relative bias, the short
    convolutions (keys / values and outputs), the shared experts' sink weights, the selection bias, the log scaling."""
    name, hf, ours, _ = pair
    ids = _ids()

    def far(model):
        with torch.no_grad():
            return float((model(ids) - hf(ids).logits).abs().max())

    def edited(edit):
        m = copy.deepcopy(ours)
        for layer in m.model.layers:
            edit(layer)
        return m

    assert far(ours) < 1e-4
    assert far(edited(lambda layer: layer.self_attn.rel_logits_proj.proj.data.zero_())) > 1e-2
    assert far(edited(lambda layer: layer.self_attn.k_sconv.conv1d.weight.data.zero_())) > 1e-2
    assert far(edited(lambda layer: layer.mlp_sconv.conv1d.weight.data.zero_())) > 1e-2
    moe = [layer.mlp for layer in ours.model.layers if isinstance(layer.mlp, InklingMoE)]
    assert moe
    assert far(edited(lambda layer: layer.mlp.router.shared_weight.data.sub_(5.0)
                      if isinstance(layer.mlp, InklingMoE) else None)) > 1e-2
    assert far(edited(lambda layer: layer.mlp.moe.gates[0].e_score_correction_bias.zero_()
                      if isinstance(layer.mlp, InklingMoE) else None)) > 1e-2
    if name != "plain":
        assert far(edited(lambda layer: setattr(layer.self_attn, "log_floor", None))) > 1e-2


@pytest.mark.parametrize("pair", ["wrapped"], indirect=True)
def test_wrapper_parts_are_skipped_and_logged(pair, caplog):
    import logging

    name, *_, path = pair
    with caplog.at_level(logging.INFO, logger="dynamoe.models.loader"):
        dm.load(path, progress=False)
    notes = [r.getMessage() for r in caplog.records if "not loading" in r.getMessage()]
    assert len(notes) == 1 and notes[0].startswith("inkling_text: not loading"), notes
    assert "model.visual.*" in notes[0] and "model.audio.*" in notes[0]


@pytest.mark.parametrize("pair", ["wrapped"], indirect=True)
def test_server_says_images_are_not_supported(pair, tmp_path):
    from serve_testing import image_refusal

    msg = image_refusal(pair[2], str(tmp_path), "inkling-tiny")
    assert "images are not supported by the model 'inkling-tiny' (inkling_mm_model): its vision and audio towers" in msg


def test_config_defaults_and_kinds():
    """A config with only the sizes: InklingTextConfig's defaults; the hub's names (sconv_kernel_size,
    model_max_length, dense_intermediate_size, dense_mlp_idx, local_layer_ids) read as transformers reads them."""
    sizes = dict(vocab_size=128, hidden_size=64, num_hidden_layers=7, num_attention_heads=8)
    for extra in ({}, {"sconv_kernel_size": 2, "model_max_length": 512, "dense_intermediate_size": 32,
                       "intermediate_size": 16, "dense_mlp_idx": 2, "local_layer_ids": [1, 2]}):
        t = transformers.InklingTextConfig(**sizes, **extra)
        cfg = dm.ModelConfig.from_dict({"model_type": "inkling_text", **sizes, **extra})
        assert [x == "sliding_attention" for x in cfg.layer_types] == [x == "hybrid_sliding" for x in t.layer_types]
        assert [cfg.is_moe_layer(i) for i in range(7)] == [x == "sparse" for x in t.mlp_layer_types]
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.n_shared_experts, cfg.moe_intermediate_size,
                cfg.intermediate_size, cfg.sliding_window, cfg.max_position_embeddings, cfg.raw["conv_kernel_size"],
                cfg.head_dim, cfg.num_key_value_heads, cfg.bos_token_id, cfg.eos_token_id, cfg.tie_word_embeddings) == \
            (t.n_routed_experts, t.num_experts_per_tok, t.n_shared_experts, t.moe_intermediate_size,
             t.intermediate_size, t.sliding_window_size, t.max_position_embeddings, t.conv_kernel_size,
             t.head_dim, t.num_key_value_heads, t.bos_token_id, (t.eos_token_id,), False)
        for f in ("swa_num_attention_heads", "swa_num_key_value_heads", "swa_head_dim", "d_rel", "rel_extent",
                  "log_scaling_n_floor", "log_scaling_alpha", "route_scale", "logits_mup_width_multiplier"):
            assert cfg.raw.get(f) == getattr(t, f), f
