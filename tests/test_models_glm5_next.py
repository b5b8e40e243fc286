"""GLM-5.3's text model against transformers' Glm5NextForConditionalGeneration on tiny random checkpoints (text
only): Kimi Delta Attention layers with the bounded ("safe") or softplus decay, NoPE MLA layers sparse through the
pooled indexer (pools of index_kpool keys, the best index_topk / index_kpool kept plus the query's open pool; a
'shared' layer reusing the previous selection), hyper-connected residual streams, clamped SwiGLU dense MLPs and
DeepSeek-style MoE; the vision tower skipped, images refused by the server, a text-only config loaded alike."""
import json
import logging
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, greedy, randomize_
from models_util import ids as _ids
from models_util import save_tiny

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.glm5_next import Glm5NextForCausalLM  # noqa: E402
from dynamoe.models.kda import KimiDeltaAttention  # noqa: E402
from dynamoe.models.kpool_indexer import KPoolIndexer  # noqa: E402
from dynamoe.models.mla import MLAttention  # noqa: E402
from dynamoe.models.moe_block import GatedMLP, SparseMoeBlock  # noqa: E402

POOL = 4
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2, kv_lora_rank=32,
            q_lora_rank=24, qk_nope_head_dim=16, v_head_dim=12, index_topk=8, index_head_dim=16, index_n_heads=8,
            index_kpool=POOL, linear_head_dim=8, linear_num_heads=4, max_position_embeddings=256, pad_token_id=None)
VISION = dict(depth=1, hidden_size=32, num_heads=2, out_hidden_size=64, intermediate_size=32,
              projection_intermediate_size=32)
VARIANTS = {
    # KDA, MLA, KDA, MLA; a dense first layer; the default bounded decay; two streams; a clamp that bites
    "bounded": dict(layer_types=["linear_attention", "indexed_attention", "linear_attention", "indexed_attention"],
                    mlp_layer_types=["dense", "sparse", "sparse", "sparse"], hc_mult=2, swiglu_limit=2.0),
    # the softplus decay, a 'shared' indexer layer right after a full one, groups, three streams, fewer pools kept
    "shared": dict(layer_types=["linear_attention", "indexed_attention", "full_attention", "linear_attention"],
                   indexer_types=["full", "full", "shared", "full"], mlp_layer_types=["dense", "dense", "sparse", "sparse"],
                   linear_lower_bound=None, hc_mult=3, n_group=4, topk_group=2, index_topk=4, n_shared_experts=2,
                   routed_scaling_factor=1.5),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    name = request.param
    cfg = transformers.Glm5NextConfig(text_config={**TEXT, **VARIANTS[name]}, vision_config=VISION)
    torch.manual_seed(0)
    hf = transformers.Glm5NextForConditionalGeneration(cfg).eval()
    randomize_(hf, seed=1, scales={"lm_head": 0.1})
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, b in hf.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)
        for n, p in hf.named_parameters():
            if n.endswith("k_norm.bias"):  # (near 1, most index scores would relu to exactly 0 and tie)
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)
            elif n.endswith("A_log"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"glm5_next_{name}"))
    return name, hf, dm.load(path, progress=False), path


def test_structure(pair):
    name, _, ours, _ = pair
    assert type(ours) is Glm5NextForCausalLM and ours.config.text_config_nested and ours.recurrent_state
    layers = ours.model.layers
    kinds = [type(layer.self_attn) for layer in layers]
    assert kinds == ([KimiDeltaAttention, MLAttention] * 2 if name == "bounded"
                     else [KimiDeltaAttention, MLAttention, MLAttention, KimiDeltaAttention])
    assert ours.fields.hc_mult == (2 if name == "bounded" else 3)
    kda = layers[0].self_attn
    assert kda.gate_lower_bound == (-5.0 if name == "bounded" else None) and kda.A_log.shape == (4,)
    mla = [layer.self_attn for layer in layers if isinstance(layer.self_attn, MLAttention)]
    assert isinstance(mla[0].indexer, KPoolIndexer) and mla[0].rope == 0 and mla[0].rotary is None
    if name == "shared":
        assert mla[1].indexer is None and mla[1].shared_index is ours.shared_index
    dense = 1 if name == "bounded" else 2
    assert [type(layer.mlp) for layer in layers] == [GatedMLP] * dense + [SparseMoeBlock] * (4 - dense)
    assert layers[0].mlp.glu == "silu_clamp_in" and layers[0].mlp.limit == (2.0 if name == "bounded" else 10.0)
    for _, block in ours.moe_layers():
        gate = block.moe.config.gates[0]
        assert (gate.n_group, gate.topk_group) == ((4, 2) if name == "shared" else (1, 1))


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


def test_engine_generates_transformers_tokens(pair):
    """dynamoe's engine (prefix reuse off: recurrent state) with 2 slots for 3 requests: chunked prefill, rows at
    different positions and a reused slot give each request transformers' greedy tokens."""
    from dynamoe.engine import GenerationEngine, SamplingParams

    hf, ours = pair[1], pair[2]
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (7, 18, 4)]
    engine = GenerationEngine(ours, None, max_seq_len=48, max_batch=2, prefill_chunk=5)
    reqs = [engine.add_request(p, SamplingParams(temperature=0), 10, ignore_eos=True) for p in prompts]
    engine.run_until_done()
    for p, r in zip(prompts, reqs):
        want = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=10, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert r.output_ids == want


def test_the_test_exercises_what_it_claims(pair):
    """Sanity of the test itself: the pooled selection, the pools' gates, the decay's form, the stream mixing and
    the SwiGLU clamp each change the logits (so parity above pins them)."""
    name, _, ours, _ = pair
    x = _ids(tokens=30)
    with torch.no_grad():
        ref = ours(x)
    layers = ours.model.layers

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

    indexers = [layer.self_attn.indexer for layer in layers if getattr(layer.self_attn, "indexer", None) is not None]
    assert differs(*setting(indexers, "topk", 1000))                   # every complete pool instead of the best
    apes = [i.index_kpool_compress_ape for i in indexers]
    kept = [a.detach().clone() for a in apes]
    assert differs(lambda: [a.data.mul_(5.0) for a in apes], lambda: [a.data.copy_(k) for a, k in zip(apes, kept)])
    kdas = [layer.self_attn for layer in layers if isinstance(layer.self_attn, KimiDeltaAttention)]
    assert differs(*setting(kdas, "gate_lower_bound", None if name == "bounded" else -5.0))
    hcs = [layer.ffn_hc for layer in layers]
    kept = [h.base.detach().clone() for h in hcs]
    assert differs(lambda: [h.base.data.zero_() for h in hcs], lambda: [h.base.data.copy_(k) for h, k in zip(hcs, kept)])
    if name == "bounded":
        assert differs(*setting([layers[0].mlp], "limit", 1e4))


def test_vision_tower_is_skipped_and_logged(pair, caplog):
    *_, path = pair
    with caplog.at_level(logging.INFO, logger="dynamoe.models.loader"):
        dm.load(path, progress=False)
    notes = [r.getMessage() for r in caplog.records if "not loading" in r.getMessage()]
    assert len(notes) == 1 and notes[0].startswith("glm5_next: not loading") and "model.visual.*" in notes[0], notes


def test_text_config_loads_alike(pair, tmp_path):
    """A glm5_next_text config.json (the text model alone, our names) loads to the same model."""
    _, _, ours, path = pair
    with open(os.path.join(path, "config.json")) as f:
        text = json.load(f)["text_config"]
    (tmp_path / "config.json").write_text(json.dumps(text))
    tensors = load_file(os.path.join(path, "model.safetensors"))
    save_file({k.replace("model.language_model.", "model."): v for k, v in tensors.items()
               if not k.startswith("model.visual.")}, str(tmp_path / "model.safetensors"))
    again = dm.load(str(tmp_path), progress=False)
    assert again.config.model_type == "glm5_next_text" and not again.config.text_config_nested
    x = _ids()
    with torch.no_grad():
        torch.testing.assert_close(again(x), ours(x), atol=0, rtol=0)
    assert greedy(again, x[:1], 3).shape == (1, 27)


def test_server_says_images_are_not_supported(pair, tmp_path):
    from serve_testing import image_refusal

    msg = image_refusal(pair[2], str(tmp_path), "glm5-tiny")
    assert "images are not supported by the model 'glm5-tiny' (glm5_next): its vision tower is not loaded" in msg


def test_config_refusals():
    base = {"model_type": "glm5_next_text", "vocab_size": 8, "hidden_size": 16, "num_hidden_layers": 4,
            "num_attention_heads": 2, "num_key_value_heads": 2, "kv_lora_rank": 8, "q_lora_rank": 8,
            "qk_nope_head_dim": 8, "v_head_dim": 8, "moe_intermediate_size": 8, "n_routed_experts": 4,
            "num_experts_per_tok": 1, "index_topk": 8, "index_head_dim": 8, "index_n_heads": 2, "index_kpool": 4,
            "linear_head_dim": 4, "linear_num_heads": 2, "intermediate_size": 16}
    cfg = dm.ModelConfig.from_dict(base)
    assert cfg.layer_types == ("linear_attention",) * 3 + ("indexed_attention",)
    assert [cfg.is_moe_layer(i) for i in range(4)] == [False, False, False, True]
    for bad, field in (({"layer_types": ["sliding_attention"] * 4}, "layer_types"),
                       ({"qk_rope_head_dim": 8}, "qk_rope_head_dim"), ({"index_topk": 6}, "index_topk"),
                       ({"index_kpool_always_select_tail": False}, "index_kpool_always_select_tail"),
                       ({"linear_lower_bound": 1.0}, "linear_lower_bound")):
        with pytest.raises(ValueError, match=field):
            Glm5NextForCausalLM(dm.ModelConfig.from_dict({**base, **bad}))
