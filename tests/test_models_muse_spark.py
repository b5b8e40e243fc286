"""Muse Spark's text model from its multimodal checkpoint against transformers on tiny random checkpoints: sliding
RoPE / full NoPE layers, weightless q/k and output norms with the query scale and the output gate, zero-centred and
input-scaled norms, sigmoid residual gates, the MoE pooled to its own width with a norm on each expert's output,
softcapped logits; the vision and audio parts skipped and logged, images refused by the server.

(The query scale makes attention sharp, and transformers' own eager and SDPA logits then differ by ~1e-3 on random
weights: the checkpoints here use a scale of 1 and 1.5, where both stay within 1e-4 of each other, and the scale's
effect is checked apart.)"""
import logging

import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_util import ids as _ids

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.moe_block import GatedMLP  # noqa: E402
from dynamoe.models.muse_spark import MuseSparkAttention, MuseSparkForCausalLM, MuseSparkMoE  # noqa: E402

TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=5, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, moe_intermediate_size=16, num_local_experts=4, num_experts_per_tok=2,
            moe_hidden_size=32, sliding_window=6, bos_token_id=None, eos_token_id=None, output_multiplier=1.0,
            qk_scale_factor=1.0)
VISION = dict(patch_size=2, pos_emb_height=4, pos_emb_width=4, num_attention_heads=2, num_hidden_layers=1, hidden_size=16,
              intermediate_size=32)
AUDIO = dict(patch_sizes=[2, 2], hidden_sizes=[8, 16], depths=[1, 1], num_hidden_layers=2, out_hidden_size=64)
VARIANTS = {
    # the default kinds (layers 0 and 4 full NoPE), a dense first layer
    "default": dict(mlp_layer_types=["dense"] + ["sparse"] * 4),
    # RoPE on every layer but 2 (layer_rope_theta), every layer MoE, three of six experts, a route scale, a cap
    "theta": dict(layer_rope_theta=[1000.0, 1000.0, 0, 1000.0, 1000.0], num_local_experts=6, num_experts_per_tok=3,
                  routed_scaling_factor=2.0, final_logit_softcapping=10.0, qk_scale_factor=1.5,
                  rope_parameters={"rope_type": "default", "rope_theta": 1000.0}),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    name = request.param
    torch.manual_seed(0)
    cfg = transformers.MuseSparkConfig(text_config={**TEXT, **VARIANTS[name]}, vision_config=VISION, audio_config=AUDIO,
                                       out_hidden_size=64, projector_hidden_size=32)
    hf = transformers.MuseSparkForConditionalGeneration(cfg).eval()
    randomize_(hf, seed=1, std=0.1, scales={"lm_head": 1.0})
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():   # (a buffer: randomize_ leaves it at zero) a selection bias that changes the choice
        for n, b in hf.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"muse_spark_{name}"))
    return name, hf, dm.load(path, progress=False), path


def test_structure(pair):
    name, hf, ours, _ = pair
    tc = hf.config.text_config
    assert type(ours) is MuseSparkForCausalLM and ours.config.text_config_nested
    assert ours.lm_head.weight is not ours.model.embed_tokens.weight
    for i, layer in enumerate(ours.model.layers):
        attn = layer.self_attn
        assert type(attn) is MuseSparkAttention and attn.use_rope == bool(tc.layer_rope_theta[i])
        assert attn.sliding_window == (6 if tc.layer_types[i] == "sliding_attention" else None)
        assert type(layer.mlp) is (MuseSparkMoE if tc.mlp_layer_types[i] == "sparse" else GatedMLP)
        assert layer.post_attention_residual_gate.gate.dtype == torch.float32
    assert (ours.lm_head.cap, ours.lm_head.multiplier) == (tc.final_logit_softcapping, tc.output_multiplier)


def test_logits_match_transformers(pair):
    _, hf, ours, _ = pair
    check_logits(hf, ours, _ids())


def test_greedy_matches_generate(pair):
    _, hf, ours, _ = pair
    check_greedy(hf, ours, _ids(seed=1), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[2], _ids(seed=2), prefill=9)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[2])


def test_each_feature_matters(pair):
    """The query scale, the per-head output norm's input (the gate), the residual gates, the post-expert norm and the
    selection bias each change the logits."""
    _, _, ours, _ = pair
    x = _ids()
    with torch.no_grad():
        ref = ours(x)

    def differs(change, undo):
        change()
        try:
            with torch.no_grad():
                return (ours(x) - ref).abs().max().item() > 1e-3
        finally:
            undo()

    layers = list(ours.model.layers)
    scales = [layer.self_attn.qk_scale for layer in layers]

    def set_scale(v):
        for layer, s in zip(layers, scales):
            layer.self_attn.qk_scale = s * v if v is not None else s

    assert differs(lambda: set_scale(3.0), lambda: set_scale(None))
    for get in (lambda layer: layer.self_attn.gate_proj.weight, lambda layer: layer.post_attention_residual_gate.gate,
                lambda layer: layer.post_feedforward_residual_gate.gate):
        params = [get(layer) for layer in layers]
        kept = [p.detach().clone() for p in params]
        assert differs(lambda: [p.data.zero_() for p in params], lambda: [p.data.copy_(k) for p, k in zip(params, kept)])
    moes = [layer.mlp for layer in layers if isinstance(layer.mlp, MuseSparkMoE)]
    for get in (lambda m: m.experts.post_expert_norm.weight, lambda m: m.gate.e_score_correction_bias):
        params = [get(m) for m in moes]
        kept = [p.detach().clone() for p in params]
        assert differs(lambda: [p.data.fill_(1.0) for p in params], lambda: [p.data.copy_(k) for p, k in zip(params, kept)])


def test_wrapper_parts_are_skipped_and_logged(pair, caplog):
    path = pair[3]
    with caplog.at_level(logging.INFO, logger="dynamoe.models.loader"):
        dm.load(path, progress=False)
    notes = [r.getMessage() for r in caplog.records if "not loading" in r.getMessage()]
    assert len(notes) == 1 and notes[0].startswith("muse_spark: not loading"), notes
    assert "model.vision_tower.*" in notes[0] and "model.audio_tower.*" in notes[0]


def test_server_says_images_are_not_supported(pair, tmp_path):
    from serve_testing import image_refusal

    msg = image_refusal(pair[2], str(tmp_path), "muse-tiny")
    assert "images are not supported by the model 'muse-tiny' (muse_spark): its vision and audio towers" in msg


def test_engine_generation_matches_generate(pair):
    """The serving engine (continuous batching, chunked prefill, a prompt sharing another's head) gives
    transformers' greedy tokens per prompt."""
    from dynamoe.engine import GenerationEngine, SamplingParams

    hf, ours = pair[1], pair[2]
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (6, 19)]
    prompts.append(prompts[1][:16] + [3, 4])
    engine = GenerationEngine(ours, None, max_seq_len=48, max_batch=2, prefill_chunk=8)
    reqs = [engine.add_request(p, SamplingParams(temperature=0), 10, ignore_eos=True) for p in prompts]
    engine.run_until_done()
    for p, r in zip(prompts, reqs):
        want = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=10, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert r.output_ids == want


def test_config_defaults_and_refusals():
    """MuseSparkTextConfig's defaults (its layer kinds and NoPE layers); the text type alone is refused."""
    sizes = dict(vocab_size=128, hidden_size=64, num_hidden_layers=6, num_attention_heads=32)
    t = transformers.MuseSparkTextConfig(**sizes)
    cfg = dm.ModelConfig.from_dict({"model_type": "muse_spark", "text_config": dict(sizes)})
    assert list(cfg.layer_types) == t.layer_types
    assert [cfg.layer_uses_rope(i) for i in range(6)] == [bool(x) for x in t.layer_rope_theta]
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.head_dim, cfg.num_key_value_heads, cfg.sliding_window,
            cfg.rope.theta, cfg.rms_norm_eps, cfg.tie_word_embeddings) == \
        (t.num_local_experts, t.num_experts_per_tok, t.head_dim, t.num_key_value_heads, t.sliding_window,
         t.rope_parameters["rope_theta"], t.rms_norm_eps, False)
    for f in ("qk_scale_factor", "output_multiplier", "post_norm_eps", "moe_hidden_size", "residual_gate_temperature",
              "final_logit_softcapping"):
        assert cfg.raw[f] == getattr(t, f), f
    with pytest.raises(ValueError, match="layer_rope_theta"):
        dm.ModelConfig.from_dict({"model_type": "muse_spark", "text_config": {**sizes, "layer_rope_theta": [0]}})
    with pytest.raises(ValueError, match="^muse_spark_text: the base language model"):
        dm.ModelConfig.from_dict({**sizes, "model_type": "muse_spark_text"})
