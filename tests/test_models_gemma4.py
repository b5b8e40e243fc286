"""Gemma 4's language model against transformers on tiny random checkpoints, alone (gemma4_text) and inside the
multimodal wrapper (gemma4: text only, the vision tower and its embedder skipped, images refused by the server):
sliding / full layers with their own head sizes, KV heads and RoPE ('proportional' on the full ones), value norms,
keys-as-values on the full layers, KV-shared last layers, per-layer embeddings, the MoE beside the dense MLP with its
normed-input router and per-expert scales, double-wide MLPs, layer scalars, softcapped logits."""
import logging

import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_util import ids as _ids

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.gemma4 import Gemma4DecoderLayer, Gemma4ForCausalLM, Gemma4MoE  # noqa: E402

LAYERS = ["sliding_attention", "sliding_attention", "full_attention", "sliding_attention", "full_attention",
          "sliding_attention", "full_attention"]
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=7, num_attention_heads=4,
            num_key_value_heads=2, head_dim=16, global_head_dim=32, sliding_window=6, layer_types=LAYERS,
            bos_token_id=None, eos_token_id=None, pad_token_id=None)
MOE = dict(enable_moe_block=True, num_experts=6, top_k_experts=2, moe_intermediate_size=16)
VARIANTS = {
    # everything at once: per-layer inputs, the last two layers KV-shared (double-wide MLPs), keys as values on the
    # full layers with one KV head, the MoE, softcapped logits
    "text": dict(**MOE, hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=2,
                 use_double_wide_mlp=True, attention_k_eq_v=True, num_global_key_value_heads=1,
                 final_logit_softcapping=30.0),
    # the dense model (no MoE) with per-layer inputs and its own RoPE bases
    "dense": dict(hidden_size_per_layer_input=8, vocab_size_per_layer_input=VOCAB, num_kv_shared_layers=3,
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 100.0},
                                   "full_attention": {"rope_type": "proportional", "partial_rotary_factor": 0.5,
                                                      "rope_theta": 1000.0}}),
    # inside the wrapper: the MoE model without per-layer inputs (as Gemma 4's MoE checkpoint), tied lm_head
    "wrapped": dict(**MOE, hidden_size_per_layer_input=0, pad_token_id=0),
}
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=2,
              head_dim=8, patch_size=4, position_embedding_size=64)
SCALES = {"lm_head": 0.2}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    name = request.param
    torch.manual_seed(0)
    text = transformers.Gemma4TextConfig(**{**TEXT, **VARIANTS[name]})
    if name == "wrapped":
        cfg = transformers.Gemma4Config(text_config=text.to_dict(), vision_config=VISION)
        hf = transformers.Gemma4ForConditionalGeneration(cfg).eval()
    else:
        hf = transformers.Gemma4ForCausalLM(text).eval()
    randomize_(hf, seed=1, scales=SCALES)
    with torch.no_grad():  # (transformers initialises the layer scalars to 1: make them matter)
        for n, b in hf.named_buffers():
            if n.endswith("layer_scalar"):
                b.uniform_(0.7, 1.1)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"gemma4_{name}"))
    return name, hf, dm.load(path, progress=False), path


def test_structure(pair):
    name, hf, ours, _ = pair
    assert type(ours) is Gemma4ForCausalLM and ours.config.text_config_nested == (name == "wrapped")
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight)
    shared = {"text": 2, "dense": 3, "wrapped": 0}[name]
    for i, layer in enumerate(ours.model.layers):
        assert type(layer) is Gemma4DecoderLayer
        attn, full = layer.self_attn, LAYERS[i] == "full_attention"
        assert attn.head_dim == (32 if full else 16) and attn.scale == 1.0
        assert attn.sliding_window == (None if full else 6)
        assert attn.num_kv_heads == (1 if full and name == "text" else 2)
        is_shared = i >= 7 - shared
        assert (attn.k_proj is None) == is_shared
        assert (attn.v_proj is None) == (is_shared or (full and name == "text"))
        assert attn.kv_source == (max(j for j in range(7 - shared) if LAYERS[j] == LAYERS[i]) if is_shared else i)
        assert layer.mlp.down_proj.in_features == 32 * (2 if is_shared and name == "text" else 1)
        assert (type(layer.moe_block) is Gemma4MoE) == (name != "dense")
        assert (layer.per_layer_input_gate is not None) == (name != "wrapped")
    assert [i for i, _ in ours.moe_layers()] == ([] if name == "dense" else list(range(7)))
    full = ours.model.rotary_emb["full_attention"]
    assert full.rope.rope_type == "proportional" and full.dim == 32
    moving = 8 if name == "dense" else 4   # (partial 0.5 / 0.25 of the 16 pairs)
    assert bool((full.inv_freq[:moving] > 0).all()) and bool((full.inv_freq[moving:] == 0).all())


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


def test_the_test_exercises_what_it_claims(pair):
    """Sanity of the test itself: the per-layer inputs, the layer scalars, the router's scales, the value norm's input
    (keys as values), and the source layer's keys for the KV-shared layers each change the logits."""
    name, _, ours, _ = pair
    x = _ids()
    with torch.no_grad():
        ref = ours(x)

    def differs(params, change):
        kept = [p.detach().clone() for p in params]
        for p in params:
            change(p.data)
        try:
            with torch.no_grad():
                return (ours(x) - ref).abs().max().item() > 1e-3
        finally:
            for p, k in zip(params, kept):
                p.data.copy_(k)

    layers = ours.model.layers
    assert differs([layer.layer_scalar for layer in layers], lambda t: t.fill_(1.0))
    if name != "wrapped":
        assert differs([ours.model.embed_tokens_per_layer.weight], lambda t: t.zero_())
        assert differs([layer.per_layer_projection.weight for layer in layers], lambda t: t.zero_())
    if name != "dense":
        routers = [layer.moe_block.router for layer in layers]
        assert differs([r.per_expert_scale for r in routers], lambda t: t.mul_(torch.linspace(0.2, 2, t.numel())))
        assert differs([r.scale for r in routers], lambda t: t.mul_(torch.linspace(0.2, 2, t.numel())))
    if name == "text":  # the full layers' values come from k_proj
        assert differs([layers[2].self_attn.k_proj.weight], lambda t: t[:, :8].mul_(-1))
    if name != "wrapped":  # the KV-shared layers read their source's keys: change what only they see of it
        src = layers[-1].self_attn.kv_source
        assert differs([layers[src].self_attn.k_norm.weight], lambda t: t.mul_(3.0))


@pytest.mark.parametrize("pair", ["wrapped"], indirect=True)
def test_wrapper_parts_are_skipped_and_logged(pair, caplog):
    name, *_, path = pair
    with caplog.at_level(logging.INFO, logger="dynamoe.models.loader"):
        dm.load(path, progress=False)
    notes = [r.getMessage() for r in caplog.records if "not loading" in r.getMessage()]
    assert len(notes) == 1 and notes[0].startswith("gemma4: not loading"), notes
    assert "model.vision_tower.*" in notes[0] and "model.embed_vision.*" in notes[0]


@pytest.mark.parametrize("pair", ["wrapped"], indirect=True)
def test_server_says_images_are_not_supported(pair, tmp_path):
    from serve_testing import image_refusal

    msg = image_refusal(pair[2], str(tmp_path), "gemma4-tiny")
    assert "images are not supported by the model 'gemma4-tiny' (gemma4): its vision and audio towers" in msg


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


def test_config_sizes_as_transformers():
    """Per-layer head sizes and KV heads from the hub's fields (global_head_dim, num_global_key_value_heads) and from
    transformers' saved per_layer_config agree with transformers' per-layer configs; KV sharing as its modes."""
    from dynamoe.models.family_fields import gemma4_attention_layers

    for extra in ({}, {"attention_k_eq_v": True, "num_global_key_value_heads": 1, "global_head_dim": 64},
                  {"num_kv_shared_layers": 1, "global_head_dim": 16}, {"attention_k_eq_v": False,
                                                                       "num_global_key_value_heads": 1}):
        hub = {"model_type": "gemma4_text", **{k: v for k, v in TEXT.items() if k != "layer_types"}, **extra}
        hf = transformers.Gemma4TextConfig(**{k: v for k, v in hub.items() if k != "model_type"})
        for d in (hub, {"model_type": "gemma4_text", **hf.to_dict()}):
            cfg = dm.ModelConfig.from_dict(d)
            got = gemma4_attention_layers(cfg)
            assert list(cfg.layer_types) == hf.layer_types
            modes = hf.kv_sharing_modes
            for i, g in enumerate(got):
                lc = hf.per_layer_config[i]
                assert (g.head_dim, g.num_key_value_heads) == (lc.head_dim, lc.num_key_value_heads), (extra, i)
                assert (g.kv_source != i) == (modes[i] == "reuse")
            assert cfg.kv_elements_per_position() == sum(2 * g.num_key_value_heads * g.head_dim
                                                         for i, g in enumerate(got) if g.kv_source == i)


def test_config_refusals():
    base = {"model_type": "gemma4_text", "vocab_size": 64, "hidden_size": 32, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1}
    for bad, field in (({"use_bidirectional_attention": "all"}, "use_bidirectional_attention"),
                       ({"enable_moe_block": True}, "enable_moe_block"),
                       ({"num_kv_shared_layers": 2}, "num_kv_shared_layers"),
                       ({"per_layer_config": {"1": {"intermediate_size": 8}}}, "per_layer_config.1")):
        with pytest.raises(ValueError, match=field):
            dm.ModelConfig.from_dict({**base, **bad})
    # (transformers forces the last layer to full attention: so here)
    cfg = dm.ModelConfig.from_dict({**base, "layer_types": ["full_attention", "sliding_attention"]})
    assert cfg.layer_types == ("full_attention", "full_attention")
