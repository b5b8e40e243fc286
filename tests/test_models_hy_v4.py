"""Hy4 and Hy4-VL's text model against transformers' HYV4ForCausalLM / HYV4VLForConditionalGeneration on tiny random
checkpoints: MLA through the DSA indexer (RoPE on the last dims of its heads, 'shared' indexer layers), learned sinks
and a sigmoid output gate on MLA, independent hyper-connections over the residual streams, a dense first layer and
DeepSeek-style MoE with clamped routed experts and an unclamped shared expert; Hy4-VL's vision tower skipped, images
refused by the server."""
import logging

import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import check_engine_with_shared_prefix
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_
from models_util import ids as _ids
from models_util import save_tiny

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.hy_v4 import HyV4ForCausalLM  # noqa: E402
from dynamoe.models.hyper_connections import IndependentHyperDecoderLayer  # noqa: E402
from dynamoe.models.moe_block import GatedMLP, SparseMoeBlock  # noqa: E402

TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=32, q_lora_rank=24,
            qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, index_topk=6, index_head_dim=16, index_n_heads=8,
            max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)
VISION = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, out_hidden_size=64)
VARIANTS = {
    # Hy4: two streams, a clamp that bites, the default indexer pattern (full, full, shared, shared)
    "hy_v4": dict(hc_mult=2, swiglu_limit=1.0),
    # Hy4-VL's text model: three streams, groups, a multimodal RoPE section, YaRN, explicit indexer kinds
    "hy_v4_vl": dict(hc_mult=3, n_group=4, topk_group=2, n_shared_experts=2, hc_magnitude=1.5,
                     indexer_types=["full", "shared", "full", "shared"],
                     rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                      "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 1.0,
                                      "mrope_section": [2, 1, 1]}),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    name = request.param
    text = {**TEXT, **VARIANTS[name]}
    torch.manual_seed(0)
    if name == "hy_v4":
        hf = transformers.HYV4ForCausalLM(transformers.HYV4Config(**text)).eval()
    else:
        hf = transformers.HYV4VLForConditionalGeneration(transformers.HYV4VLConfig(text_config=text,
                                                                                  vision_config=VISION)).eval()
    randomize_(hf, seed=1, scales={"lm_head": 0.2, "sinks": 1.0})
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, b in hf.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)
        for n, p in hf.named_parameters():
            if n.endswith("k_norm.bias"):  # (near 1, most index scores would relu to exactly 0 and tie)
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
    path = save_tiny(hf, tmp_path_factory.mktemp(name))
    return name, hf, dm.load(path, progress=False), path


def test_structure(pair):
    name, _, ours, _ = pair
    assert type(ours) is HyV4ForCausalLM and ours.config.text_config_nested == (name == "hy_v4_vl")
    layers = ours.model.layers
    assert all(type(layer) is IndependentHyperDecoderLayer for layer in layers)
    assert ours.streams == (2 if name == "hy_v4" else 3)
    attns = [layer.self_attn for layer in layers]
    assert all(a.sinks is not None and a.gate_proj is not None for a in attns)
    assert all(a.rope_interleaved == (name == "hy_v4_vl") for a in attns)
    assert [a.indexer is not None for a in attns] == ([True, True, False, False] if name == "hy_v4"
                                                     else [True, False, True, False])
    assert all(a.indexer.rope_at_end for a in attns if a.indexer is not None)
    assert [type(layer.mlp) for layer in layers] == [GatedMLP] + [SparseMoeBlock] * 3
    for _, block in ours.moe_layers():
        experts, shared = block.moe.experts, block.moe.shared_experts
        assert experts.activation == "silu_clamp_in" and shared.activation == "silu"
        assert experts.limit == (1.0 if name == "hy_v4" else 10.0)
        assert (block.moe.config.gates[0].n_group, block.moe.config.gates[0].topk_group) == \
            ((1, 1) if name == "hy_v4" else (4, 2))


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
    """Sanity of the test itself: the sinks, the output gate, the indexer's selection, the streams' post weights and
    (Hy4) the routed experts' clamp each change the logits (so parity above pins them)."""
    name, _, ours, _ = pair
    x = _ids(tokens=30)
    with torch.no_grad():
        ref = ours(x)
    layers = ours.model.layers
    attns = [layer.self_attn for layer in layers]

    def differs(undo, redo):
        undo()
        try:
            with torch.no_grad():
                return (ours(x) - ref).abs().max().item() > 1e-3
        finally:
            redo()

    def zeroed(params, value=0.0):
        kept = [p.detach().clone() for p in params]
        return (lambda: [p.data.fill_(value) for p in params], lambda: [p.data.copy_(k) for p, k in zip(params, kept)])

    assert differs(*zeroed([a.sinks for a in attns], -1e4))
    assert differs(*zeroed([a.gate_proj.weight for a in attns]))               # sigmoid(0) = 1/2 everywhere
    indexers = [a.indexer for a in attns if a.indexer is not None]
    old = [i.topk for i in indexers]
    assert differs(lambda: [setattr(i, "topk", 1000) for i in indexers],
                   lambda: [setattr(i, "topk", t) for i, t in zip(indexers, old)])
    assert differs(*zeroed([layer.ffn_hc.base for layer in layers]))
    if name == "hy_v4":
        experts = [b.moe.experts for _, b in ours.moe_layers()]
        assert differs(lambda: [setattr(e, "limit", 1e4) for e in experts],
                       lambda: [setattr(e, "limit", 1.0) for e in experts])


def test_vision_tower_is_skipped_and_logged(pair, caplog):
    name, *_, path = pair
    with caplog.at_level(logging.INFO, logger="dynamoe.models.loader"):
        dm.load(path, progress=False)
    notes = [r.getMessage() for r in caplog.records if "not loading" in r.getMessage()]
    if name == "hy_v4":  # (a text model: nothing to skip)
        assert notes == []
    else:
        assert len(notes) == 1 and notes[0].startswith("hy_v4_vl: not loading") and "vit.*" in notes[0], notes


def test_server_says_images_are_not_supported(pair, tmp_path):
    from serve_testing import image_refusal

    name, _, ours, _ = pair
    msg = image_refusal(ours, str(tmp_path), "hy4-tiny")
    reason = ("dynamoe serves it as a text model" if name == "hy_v4" else
              "its vision tower is not loaded (dynamoe serves the Hy4-VL text model only)")
    assert f"images are not supported by the model 'hy4-tiny' ({name}): {reason};" in msg


def test_config_defaults_and_refusals():
    base = {"model_type": "hy_v4", "vocab_size": 8, "hidden_size": 16, "num_hidden_layers": 6, "num_attention_heads": 2}
    cfg = dm.ModelConfig.from_dict(base)
    assert cfg.indexer_types == ("full", "full", "shared", "shared", "shared", "full")
    assert [cfg.is_moe_layer(i) for i in range(6)] == [False] + [True] * 5
    assert cfg.head_dim == cfg.qk_rope_head_dim == 64 and cfg.num_key_value_heads == 2
    with pytest.raises(ValueError, match="indexer_types"):
        HyV4ForCausalLM(dm.ModelConfig.from_dict({**base, "indexer_types": ["shared"] + ["full"] * 5}))
    with pytest.raises(ValueError, match="hc_mult"):
        HyV4ForCausalLM(dm.ModelConfig.from_dict({**base, "hc_mult": 0}))
