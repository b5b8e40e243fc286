"""Llama 4 against transformers on tiny random checkpoints: the text model (Llama4ForCausalLM) and the text tower
of the vision wrapper (Llama4ForConditionalGeneration). Chunked local attention with a chunk shorter than the
inputs on the RoPE layers (interleaved 'llama3' RoPE, L2 q/k norm), NoPE full-attention layers with temperature
tuning that changes within the inputs (floor_scale 4), interleaved MoE/dense layers, a sigmoid top-k router whose
score scales the expert's input, a shared expert; cached decode across chunk boundaries; the fused MoE kernel
refused for input-scaled experts."""
import dataclasses
import logging

import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import (VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, ids, randomize_,
                         save_tiny)

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.llama4 import Llama4Attention, Llama4ForCausalLM  # noqa: E402
from dynamoe.models.moe_block import GatedMLP, SparseMoeBlock  # noqa: E402

CHUNK = 8
LLAMA3 = {"rope_type": "llama3", "rope_theta": 10000.0, "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
          "original_max_position_embeddings": 32}
# F = 32: 2F = D, which the expert reader must not take for out->in (Llama-4 stores them in->out)
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, intermediate_size_mlp=96, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_local_experts=4, num_experts_per_tok=1,
            interleave_moe_layer_step=2, no_rope_layer_interval=2, attention_chunk_size=CHUNK, floor_scale=4,
            attn_scale=0.5, max_position_embeddings=256, bos_token_id=None, eos_token_id=None, rope_parameters=LLAMA3)
VISION = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32, vision_output_dim=32,
              image_size=28, patch_size=14, projector_input_dim=32, projector_output_dim=32)
VARIANTS = {
    # Scout's shape: every layer MoE (top-1), NoPE every 2nd layer, L2 q/k norm
    "text": dict(interleave_moe_layer_step=1),
    # Maverick's: MoE every 2nd layer (top-2 here), no q/k norm, explicit moe_layers and no_rope_layers, biases
    "text_top2": dict(num_experts_per_tok=2, use_qk_norm=False, moe_layers=[1, 3], no_rope_layers=[1, 1, 0, 1],
                      attention_bias=True),
    # the vision wrapper's text tower
    "wrapper": dict(),
}


def _hf(name):
    text = {**TEXT, **VARIANTS[name]}
    if name == "wrapper":
        return transformers.Llama4ForConditionalGeneration(transformers.Llama4Config(text_config=text,
                                                                                    vision_config=VISION))
    return transformers.Llama4ForCausalLM(transformers.Llama4TextConfig(**text))


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = _hf(request.param).eval()
    randomize_(hf, seed=3)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"llama4_{request.param}"))
    # the wrapper's own text-only forward fails in transformers 5.24 (it reads outputs.image_outputs of its
    # language model's output): its language model, the same weights, is the reference
    ref = hf.language_model if request.param == "wrapper" else hf
    return request.param, ref, dm.load(path, progress=False), path


def test_structure(pair):
    name, hf, ours, _ = pair
    assert type(ours) is Llama4ForCausalLM and ours.config.text_config_nested == (name == "wrapper")
    text = hf.config
    assert ours.config.layer_types == tuple(text.layer_types)
    attns = [layer.self_attn for layer in ours.model.layers]
    assert all(type(a) is Llama4Attention for a in attns)
    rope = [bool(r) for r in text.no_rope_layers]
    assert [a.use_rope for a in attns] == rope
    assert [a.chunk for a in attns] == [CHUNK if r else None for r in rope]
    assert [a.temperature for a in attns] == [None if r else (4.0, 0.5) for r in rope]
    assert [a.l2_qk_norm for a in attns] == [r and name != "text_top2" for r in rope]
    moe = [i in text.moe_layers for i in range(4)]
    assert [type(layer.mlp) for layer in ours.model.layers] == [SparseMoeBlock if m else GatedMLP for m in moe]
    for _, block in ours.moe_layers():
        cfg = block.moe.config
        assert not cfg.is_postscore and cfg.gates[0].type == "sigmoid" and cfg.gates[0].normalize is False
        assert block.moe.gates[0].e_score_correction_bias is None


def test_chunks_temperature_norm_and_prescale_matter(pair):
    """Sanity of the test itself: without the chunk, the temperature, the L2 norm, or with the routing weights
    on the experts' outputs instead of their inputs, the logits change."""
    ours = pair[2]
    x = ids(tokens=24)
    roped = next(a for a in (layer.self_attn for layer in ours.model.layers) if a.use_rope)
    nope = next(a for a in (layer.self_attn for layer in ours.model.layers) if not a.use_rope)
    moe = ours.moe_layers()[0][1].moe
    with torch.no_grad():
        ref = ours(x)
        roped.chunk = None
        unchunked = ours(x)
        roped.chunk = CHUNK
        nope.temperature, t = None, nope.temperature
        cold = ours(x)
        nope.temperature = t
        roped.l2_qk_norm, n = not roped.l2_qk_norm, roped.l2_qk_norm
        renormed = ours(x)
        roped.l2_qk_norm = n
        moe.config = dataclasses.replace(moe.config, is_postscore=True)
        postscored = ours(x)
        moe.config = dataclasses.replace(moe.config, is_postscore=False)
        assert torch.equal(ours(x), ref)
    for other in (unchunked, cold, renormed, postscored):
        assert (other - ref).abs().max() > 1e-2


def test_logits_match_transformers(pair):
    _, hf, ours, _ = pair
    check_logits(hf, ours, ids(tokens=24))


def test_greedy_matches_generate(pair):
    _, hf, ours, _ = pair
    check_greedy(hf, ours, ids(seed=1), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[2], ids(seed=2, tokens=30), prefill=9)   # chunks end at 8, 16, 24 within the steps


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[2])


def test_long_prefill_attends_per_chunk_span(pair):
    """A prefill much longer than the chunk (the span-by-span path) gives the same logits as one masked pass
    over all keys, with and without cached keys before it."""
    ours = pair[2]
    x = ids(rows=2, tokens=40, seed=7)
    with torch.no_grad():
        full = ours(x)
        cache = ours.new_cache(2, 40)
        parts = torch.cat([ours(x[:, :5], cache=cache), ours(x[:, 5:], cache=cache)], dim=1)
    from dynamoe.models import attention

    q = torch.randn(2, 4, 40, 16)
    k, v = torch.randn(2, 2, 40, 16), torch.randn(2, 2, 40, 16)
    pos = torch.arange(40).expand(2, 40)
    spans = attention.attend(q, k, v, pos, None, 0.25, chunk=CHUNK)
    masked = attention._masked(q, k, v, pos, pos, 0.25, None, None, CHUNK)
    torch.testing.assert_close(spans, masked, atol=1e-6, rtol=0)
    torch.testing.assert_close(parts, full, atol=1e-4, rtol=0)


def test_moe_kernels_and_input_scaled_experts(pair, caplog, monkeypatch):
    """The fused MoE layer kernel scales the experts' outputs: for Llama-4's blocks it must say no (and the decode
    plan runs them as modules, naming why), not compute expert(x) * w; a decode step's experts still run in the
    experts' kernel, on rows prescaled by their weights."""
    from spying import record_calls

    from dynamoe.ops import moe_decode

    ours = pair[2]
    _, block = ours.moe_layers()[0]
    h = torch.randn(2, 64)
    fused = block.decode_fused(h, ours.model.layers[0].post_attention_layernorm)
    assert fused.weights is None and "is_postscore=False" in fused.extra
    assert block.moe.decode_fused(h).weights is None
    attn = ours.model.layers[0].self_attn.decode_fused(ours.model.layers[0].input_layernorm, torch.float32)
    assert attn.weights is None and "chunked local attention" in attn.extra
    ours.__dict__.pop("_plan", None)  # (built by an earlier test's decode steps)
    used = record_calls(monkeypatch, moe_decode, "glu_decode")
    x = ids(rows=2, tokens=5, seed=3)
    with caplog.at_level(logging.INFO, logger="dynamoe.models.decode_plan"), torch.no_grad():
        cache = ours.new_cache(2, 8)
        ours(x, cache=cache)
        used.clear()
        steps = ours(x[:, :1], cache=cache)
        assert used == [True] * len(ours.moe_layers())   # every MoE layer of the decode step
        full = ours(torch.cat([x, x[:, :1]], dim=1))[:, -1:]
    notes = [r.getMessage() for r in caplog.records if "run as modules" in r.getMessage()]
    assert len(notes) == 1 and "chunked local attention" in notes[0], notes
    torch.testing.assert_close(steps, full, atol=1e-4, rtol=0)


@pytest.mark.parametrize("pair", ["wrapper"], indirect=True)
def test_vision_tower_is_skipped_and_logged(pair, caplog):
    *_, path = pair
    with caplog.at_level(logging.INFO, logger="dynamoe.models.loader"):
        dm.load(path, progress=False)
    notes = [r.getMessage() for r in caplog.records if "not loading" in r.getMessage()]
    assert len(notes) == 1 and notes[0].startswith("llama4: not loading") and "vision_model.*" in notes[0], notes


@pytest.mark.parametrize("pair", ["wrapper"], indirect=True)
def test_server_says_images_are_not_supported(pair, tmp_path):
    from serve_testing import image_refusal

    msg = image_refusal(pair[2], str(tmp_path), "llama4-tiny")
    assert "images are not supported by the model 'llama4-tiny' (llama4): its vision tower is not loaded" in msg


@pytest.mark.parametrize("outer,inner", [(None, None), (False, True), (True, False), (True, True)])
def test_wrapper_ties_by_its_text_config(outer, inner):
    """transformers' Llama-4 language model ties its lm_head by its own (text) config, whatever the wrapper says."""
    text = TEXT if inner is None else {**TEXT, "tie_word_embeddings": inner}
    kw = {} if outer is None else {"tie_word_embeddings": outer}
    hf = transformers.Llama4ForConditionalGeneration(transformers.Llama4Config(text_config=text, vision_config=VISION,
                                                                              **kw))
    lm = hf.language_model
    tied = lm.lm_head.weight.data_ptr() == lm.model.embed_tokens.weight.data_ptr()
    assert tied == bool(inner)
    assert dm.ModelConfig.from_dict(hf.config.to_dict()).tie_word_embeddings is tied


def test_config_refuses_chunked_layers_elsewhere_and_without_a_chunk():
    sizes = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=8, moe_intermediate_size=8)
    with pytest.raises(ValueError, match="layer_types"):
        dm.ModelConfig.from_dict({"model_type": "qwen3_moe", **sizes,
                                  "layer_types": ["chunked_attention", "full_attention"]})
    with pytest.raises(ValueError, match="attention_chunk_size"):
        dm.ModelConfig.from_dict({"model_type": "llama4_text", **sizes, "attention_chunk_size": None,
                                  "layer_types": ["chunked_attention", "full_attention"]})
    cfg = dm.ModelConfig.from_dict({"model_type": "llama4_text", **sizes, "attention_chunk_size": None})
    assert cfg.layer_types == ("full_attention",) * 2 and cfg.layer_attention_chunk(0) is None


def test_engine_generation_matches_generate(pair):
    """The serving engine (continuous batching, prefill in chunks of 5 tokens that straddle the attention chunks)
    gives transformers' greedy tokens for each prompt."""
    from dynamoe.engine import GenerationEngine, SamplingParams

    _, hf, ours, _ = pair
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (6, 19, 30)]
    engine = GenerationEngine(ours, None, max_seq_len=64, max_batch=3, prefill_chunk=5)
    reqs = [engine.add_request(p, SamplingParams(temperature=0), 12, ignore_eos=True) for p in prompts]
    engine.run_until_done()
    for p, r in zip(prompts, reqs):
        want = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=12, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert r.output_ids == want
