"""Mistral-Large-4's text model against transformers' MistralLarge4ForConditionalGeneration on tiny random checkpoints
(text only): MLA without query LoRA, LeRoPE (YaRN with learned frequency scales) on interleaved pairs and NoPE
layers, per-head log-position query scaling, the DSA indexer reading LayerNorm(x), 'shared' indexer layers, layers
attending to an earlier layer's latents, Mistral's group-limited softmax routing with shared experts, soft-capped
logits; the vision parts skipped, images refused by the server, a text-only config loaded alike."""
import json
import logging
import os

import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import check_engine_with_shared_prefix
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_
from models_util import ids as _ids
from models_util import save_tiny

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.mistral_large4 import LeRotaryEmbedding, MistralLarge4ForCausalLM  # noqa: E402
from dynamoe.models.moe_block import GatedMLP, SparseMoeBlock  # noqa: E402

YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 32,
        "beta_fast": 32.0, "beta_slow": 1.0, "attention_factor": 1.0}
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=32,
            qk_nope_head_dim=16, qk_rope_head_dim=8, head_dim=8, v_head_dim=12, index_topk=6, index_head_dim=16,
            index_n_heads=8, max_position_embeddings=256, bos_token_id=None, eos_token_id=None, rope_parameters=YARN)
VISION = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
              image_size=16, head_dim=16)
VARIANTS = {
    # layers 2 and 3 attend to layers 0 and 1's latents (RoPE, NoPE); a 'shared' indexer layer
    "shared_kv": dict(kv_source_layers=[0, 1, 0, 1], no_rope_layers=[1, 0, 1, 0],
                      indexer_types=["full", "full", "full", "shared"]),
    # every layer its own latents, the default NoPE pattern (every 4th), groups, two dense layers, another cap
    "groups": dict(n_group=4, topk_group=2, routed_scaling_factor=2.0, first_k_dense_replace=2, n_shared_experts=2,
                   final_logit_softcapping=5.0),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    name = request.param
    cfg = transformers.MistralLarge4Config(text_config={**TEXT, **VARIANTS[name]}, vision_config=VISION)
    torch.manual_seed(0)
    hf = transformers.MistralLarge4ForConditionalGeneration(cfg).eval()
    randomize_(hf, seed=1, scales={"lm_head": 0.3, "alpha": 0.3, "softmax_scaling.scale": 0.3})
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("k_norm.bias") or n.endswith("q_input_norm.bias"):  # (near 1, index scores would tie at 0)
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            elif n.endswith("softmax_scaling.bias"):
                p.copy_(1 + torch.randn(p.shape, generator=g) * 0.2)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"mistral_large4_{name}"))
    return name, hf, dm.load(path, progress=False), path


def test_structure(pair):
    name, _, ours, _ = pair
    assert type(ours) is MistralLarge4ForCausalLM and ours.config.text_config_nested
    assert type(ours.model.rotary_emb) is LeRotaryEmbedding and ours.model.rotary_emb.alpha.abs().min() > 0
    attns = [layer.self_attn for layer in ours.model.layers]
    rope = [1, 0, 1, 0] if name == "shared_kv" else [1, 1, 1, 0]
    assert [int(a.rotary is not None) for a in attns] == rope
    assert [a.rope for a in attns] == [8 * r for r in rope] and [a.nope for a in attns] == [16 + 8 * (1 - r) for r in rope]
    assert all(a.q_lora_rank is None and a.softmax_scaling is not None for a in attns)
    if name == "shared_kv":
        assert [a.latent_source for a in attns] == [None, None, 0, 1]
        assert not hasattr(attns[2], "kv_a_proj_with_mqa") and attns[3].indexer is None
    dense = 1 if name == "shared_kv" else 2
    assert [type(layer.mlp) for layer in ours.model.layers] == [GatedMLP] * dense + [SparseMoeBlock] * (4 - dense)
    for _, block in ours.moe_layers():
        gate = block.moe.config.gates[0]
        assert gate.type == "top" and gate.normalize and gate.group_rank == "top2_sum"
        assert (gate.n_group, gate.topk_group) == ((4, 2) if name == "groups" else (1, 1))
    assert ours.lm_head.cap == (5.0 if name == "groups" else 30.0)


def test_logits_match_transformers(pair):
    _, hf, ours, _ = pair
    check_logits(hf, ours, _ids(tokens=30))


def test_greedy_matches_generate(pair):
    _, hf, ours, _ = pair
    check_greedy(hf, ours, _ids(seed=1), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[2], _ids(tokens=30, seed=2), prefill=9, chunk=6)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[2], lengths=(10, 19), decode_steps=8)


def test_engine_generation_matches_generate(pair):
    """The serving engine (continuous batching, chunked prefill, prefix reuse of a shared prompt head) gives
    transformers' greedy tokens per prompt."""
    check_engine_with_shared_prefix(pair[1], pair[2], VOCAB)


def test_the_test_exercises_what_it_claims(pair):
    """Sanity of the test itself: LeRoPE's scales, the query scaling, the indexer's selection and the soft cap each
    change the logits (so parity above pins them)."""
    _, _, ours, _ = pair
    x = _ids(tokens=30)
    with torch.no_grad():
        ref = ours(x)
    attns = [layer.self_attn for layer in ours.model.layers]

    def differs(undo, redo):
        undo()
        try:
            with torch.no_grad():
                return (ours(x) - ref).abs().max().item() > 1e-3
        finally:
            redo()

    alpha = ours.model.rotary_emb.alpha
    kept = alpha.detach().clone()
    assert differs(lambda: (alpha.data.zero_(), ours.model.rotary_emb.__setattr__("_last", None)),
                   lambda: (alpha.data.copy_(kept), ours.model.rotary_emb.__setattr__("_last", None)))
    scales = [a.softmax_scaling.scale for a in attns]
    kept = [s.detach().clone() for s in scales]
    assert differs(lambda: [s.data.zero_() for s in scales], lambda: [s.data.copy_(k) for s, k in zip(scales, kept)])
    indexers = [a.indexer for a in attns if a.indexer is not None]
    old = [i.topk for i in indexers]
    assert differs(lambda: [setattr(i, "topk", 1000) for i in indexers],
                   lambda: [setattr(i, "topk", t) for i, t in zip(indexers, old)])
    cap = ours.lm_head.cap
    assert differs(lambda: setattr(ours.lm_head, "cap", 1e6), lambda: setattr(ours.lm_head, "cap", cap))


def test_vision_parts_are_skipped_and_logged(pair, caplog):
    *_, path = pair
    with caplog.at_level(logging.INFO, logger="dynamoe.models.loader"):
        dm.load(path, progress=False)
    notes = [r.getMessage() for r in caplog.records if "not loading" in r.getMessage()]
    assert len(notes) == 1 and notes[0].startswith("mistral_large4: not loading") and "vision_encoder.*" in notes[0]


def test_text_config_loads_alike(pair, tmp_path):
    """A mistral_large4_text config.json (the text model alone: the same tensor names) loads to the same model."""
    import shutil

    _, _, ours, path = pair
    with open(os.path.join(path, "config.json")) as f:
        (tmp_path / "config.json").write_text(json.dumps(json.load(f)["text_config"]))
    shutil.copy(os.path.join(path, "model.safetensors"), tmp_path / "model.safetensors")
    again = dm.load(str(tmp_path), progress=False)
    assert again.config.model_type == "mistral_large4_text"
    x = _ids()
    with torch.no_grad():
        torch.testing.assert_close(again(x), ours(x), atol=0, rtol=0)


def test_server_says_images_are_not_supported(pair, tmp_path):
    from serve_testing import image_refusal

    msg = image_refusal(pair[2], str(tmp_path), "ml4-tiny")
    assert "images are not supported by the model 'ml4-tiny' (mistral_large4): its vision tower is not loaded" in msg


def test_config_refusals():
    base = {"model_type": "mistral_large4_text", "vocab_size": 8, "hidden_size": 16, "num_hidden_layers": 4,
            "num_attention_heads": 2, "kv_lora_rank": 8, "qk_nope_head_dim": 8, "qk_rope_head_dim": 4,
            "v_head_dim": 8, "moe_intermediate_size": 8, "intermediate_size": 16, "n_routed_experts": 4,
            "num_experts_per_tok": 1, "index_topk": 8, "index_head_dim": 8, "index_n_heads": 2}
    cfg = dm.ModelConfig.from_dict(base)
    assert [cfg.layer_uses_rope(i) for i in range(4)] == [True, True, True, False] and cfg.head_dim == 4
    for bad, field in (({"kv_source_layers": [0, 0, 3, 3]}, "kv_source_layers"),
                       ({"kv_source_layers": [0, 1, 2, 0]}, "kv_source_layers"),   # RoPE layer 0 for NoPE layer 3
                       ({"q_lora_rank": 8}, "q_lora_rank"), ({"final_logit_softcapping": 0}, "final_logit_softcapping"),
                       ({"indexer_types": ["shared", "full", "full", "full"]}, "indexer_types")):
        with pytest.raises(ValueError, match=field):
            MistralLarge4ForCausalLM(dm.ModelConfig.from_dict({**base, **bad}))
