"""dots3_note's text model against transformers' Dots3NoteForCausalLM / Dots3NoteForConditionalGeneration on tiny random
checkpoints: MLA with LoRA-scaled queries and latents, a norm on the rotary key, a sigmoid gate per head, DSA layers
(or plain causal ones without use_dsa) and sliding-window layers with their own MLA sizes and RoPE base, a dense
first layer and DeepSeek-style MoE with wide shared experts; the wrapper's towers skipped, images refused."""
import logging

import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import check_engine_with_shared_prefix
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch
from models_mla_util import edit_config, ids, make_pair

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.dots3_note import Dots3NoteForCausalLM  # noqa: E402
from dynamoe.models.moe_block import GatedMLP, SparseMoeBlock  # noqa: E402

WINDOW = 5
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=32,
            q_lora_rank=24, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, head_dim=24,
            max_position_embeddings=256, index_topk=6, index_head_dim=16, index_n_heads=8,
            shared_experts_intermediate_size=24, sliding_window=WINDOW, swa_num_attention_heads=2,
            swa_num_key_value_heads=2, swa_q_lora_rank=16, swa_kv_lora_rank=20, swa_head_dim=20,
            swa_qk_nope_head_dim=12, swa_v_head_dim=10, bos_token_id=None, eos_token_id=None, pad_token_id=None)
VISION = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, moe_intermediate_size=16,
              num_local_experts=4, num_experts_per_tok=2, adapter_in_dim=32, adapter_out_dim=64, mlp_layer_types=["dense"])
AUDIO = dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, downsample_hidden_size=16,
             adapter_input_size=32, adapter_out_dim=64)
VARIANTS = {
    # DSA on layers 0, 1, sliding windows on 2, 3 (smaller MLA), groups; the hub's per-layer moe_layer_freq list
    "text": dict(n_group=4, topk_group=2, routed_scaling_factor=2.0),
    # the vision / audio wrapper: plain causal layers instead of DSA (use_dsa false), two shared experts
    "wrapper": dict(use_dsa=False, n_shared_experts=2, swa_rope_theta=1000.0),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    name = request.param
    text = {**TEXT, **VARIANTS[name]}
    if name == "text":
        hf, path = make_pair(transformers.Dots3NoteForCausalLM, transformers.Dots3NoteTextConfig(**text),
                             tmp_path_factory.mktemp(name))
        edit_config(path, mlp_layer_types=None, moe_layer_freq=[0, 1, 1, 1])
    else:
        cfg = transformers.Dots3NoteConfig(text_config=text, vision_config=VISION, audio_config=AUDIO)
        hf, path = make_pair(transformers.Dots3NoteForConditionalGeneration, cfg, tmp_path_factory.mktemp(name))
    return name, hf, dm.load(path, progress=False), path


def test_structure(pair):
    name, _, ours, _ = pair
    assert type(ours) is Dots3NoteForCausalLM and ours.config.text_config_nested == (name == "wrapper")
    full = "indexed_attention" if name == "text" else "full_attention"
    assert ours.config.layer_types == (full, full, "sliding_attention", "sliding_attention")
    attns = [layer.self_attn for layer in ours.model.layers]
    assert [a.num_heads for a in attns] == [4, 4, 2, 2] and [a.kv_lora_rank for a in attns] == [32, 32, 20, 20]
    assert [a.sliding_window for a in attns] == [None, None, WINDOW, WINDOW]
    assert [a.indexer is not None for a in attns] == [name == "text"] * 2 + [False] * 2
    assert all(a.g_proj is not None and a.k_rope_only_layernorm is not None and a.lora_scales for a in attns)
    assert [type(layer.mlp) for layer in ours.model.layers] == [GatedMLP] + [SparseMoeBlock] * 3
    assert ours.moe_layers()[0][1].moe.shared_experts.gate_proj.out_features == 24 * (1 if name == "text" else 2)


def test_logits_match_transformers(pair):
    _, hf, ours, _ = pair
    check_logits(hf, ours, ids(tokens=30))


def test_greedy_matches_generate(pair):
    _, hf, ours, _ = pair
    check_greedy(hf, ours, ids(seed=1), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[2], ids(tokens=30, seed=2), prefill=9, chunk=6)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[2], lengths=(10, 19), decode_steps=8)


def test_engine_generation_matches_generate(pair):
    """The serving engine (continuous batching, chunked prefill, prefix reuse of a shared prompt head) gives
    transformers' greedy tokens per prompt."""
    check_engine_with_shared_prefix(pair[1], pair[2], VOCAB)


def test_the_test_exercises_what_it_claims(pair):
    """Sanity of the test itself: the window, the per-head gates, the rotary key's norm, the LoRA scales and (DSA)
    the indexer's selection each change the logits (so parity above pins them)."""
    name, _, ours, _ = pair
    x = ids(tokens=30)
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

    def setting(objs, attr, value):
        old = [getattr(o, attr) for o in objs]
        return (lambda: [setattr(o, attr, value) for o in objs], lambda: [setattr(o, attr, v) for o, v in zip(objs, old)])

    assert differs(*setting(attns[2:], "sliding_window", None))
    gates = [a.g_proj.weight for a in attns]
    kept = [w.detach().clone() for w in gates]
    assert differs(lambda: [w.data.zero_() for w in gates], lambda: [w.data.copy_(k) for w, k in zip(gates, kept)])
    norms = [a.k_rope_only_layernorm.weight for a in attns]
    kept = [w.detach().clone() for w in norms]
    assert differs(lambda: [w.data.fill_(1.0) for w in norms], lambda: [w.data.copy_(k) for w, k in zip(norms, kept)])
    assert differs(*setting(attns, "lora_scales", (1.0, 1.0)))
    if name == "text":
        assert differs(*setting([a.indexer for a in attns[:2]], "topk", 1000))


def test_towers_are_skipped_and_logged(pair, caplog):
    name, *_, path = pair
    with caplog.at_level(logging.INFO, logger="dynamoe.models.loader"):
        dm.load(path, progress=False)
    notes = [r.getMessage() for r in caplog.records if "not loading" in r.getMessage()]
    if name == "text":
        assert notes == []
    else:
        assert len(notes) == 1 and "vision_encoder.*" in notes[0] and "audio_encoder.*" in notes[0], notes


def test_server_says_images_are_not_supported(pair, tmp_path):
    from serve_testing import image_refusal

    name, _, ours, _ = pair
    msg = image_refusal(ours, str(tmp_path), "dots3-tiny")
    assert (f"images are not supported by the model 'dots3-tiny' ({'dots3_note_text' if name == 'text' else 'dots3_note'})"
            ": its vision and audio towers are not loaded") in msg
