"""ERNIE-4.5-VL's text model from its multimodal checkpoint against transformers on tiny random checkpoints (the
hub's layout, which transformers saves): RoPE on interleaved pairs (the 3D mrope_section RoPE at text positions),
a dense first layer, softmax routing with a selection bias through the text expert group only -- the text router
read transposed, row 0 of the [text; vision] bias, experts 0..E-1 --, shared experts; the vision group, tower and
resampler skipped and logged, images refused by the server."""
import logging

import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_util import ids as _ids

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.ernie4_5_vl_moe import Ernie4_5_VLMoeForCausalLM  # noqa: E402
from dynamoe.models.moe_block import GatedMLP, SparseMoeBlock  # noqa: E402

TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, moe_intermediate_size=[16, 8], moe_k=2, moe_num_experts=4, moe_num_shared_experts=1,
            pad_token_id=0, rope_parameters={"rope_type": "default", "rope_theta": 500.0, "mrope_section": [2, 2, 4]})
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, patch_size=2, spatial_merge_size=2,
              temporal_merge_size=2)
VARIANTS = {
    # the default layer kinds (first dense), one shared expert, tied
    "tied": dict(),
    # every layer MoE, two shared experts, three of six experts, untied
    "untied": dict(mlp_layer_types=["sparse"] * 3, moe_num_shared_experts=2, moe_k=3, moe_num_experts=6,
                   moe_intermediate_size=[16, 24], tie_word_embeddings=False),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    name = request.param
    torch.manual_seed(0)
    text = {**TEXT, **VARIANTS[name]}
    tie = text.pop("tie_word_embeddings", True)
    cfg = transformers.Ernie4_5_VLMoeConfig(text_config=text, vision_config=VISION, tie_word_embeddings=tie)
    hf = transformers.Ernie4_5_VLMoeForConditionalGeneration(cfg).eval()
    randomize_(hf, seed=1, scales={"embed_tokens": 0.5, "lm_head": 0.5})
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():   # (randomize_ leaves it near zero) a selection bias that changes the choice, per group
        for n, p in hf.named_parameters():
            if n.endswith("e_score_correction_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"ernie4_5_vl_{name}"))
    return name, hf, dm.load(path, progress=False), path


def test_structure(pair):
    name, hf, ours, _ = pair
    tc = hf.config.text_config
    assert type(ours) is Ernie4_5_VLMoeForCausalLM and ours.config.text_config_nested
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == (name == "tied")
    for kind, layer in zip(tc.mlp_layer_types, ours.model.layers):
        assert layer.self_attn.rope_interleaved
        if kind == "dense":
            assert type(layer.mlp) is GatedMLP
            continue
        assert type(layer.mlp) is SparseMoeBlock
        moe = layer.mlp.moe
        assert moe.num_global_experts == tc.moe_num_experts and moe.config.gates[0].k == tc.moe_k
        assert moe.experts.hidden_size == tc.moe_intermediate_size[0]
        assert moe.shared_experts.down_proj.in_features == tc.moe_intermediate_size[0] * tc.moe_num_shared_experts


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


def test_the_text_group_is_what_routes(pair):
    """The text group's router, bias row and experts are what dynamoe loaded: they equal transformers' text_moe, not
    its vision_moe; and the bias matters (dropping it changes the logits)."""
    _, hf, ours, _ = pair
    for i, block in ours.moe_layers():
        theirs = hf.model.language_model.layers[i].mlp
        gate = block.moe.gates[0]
        torch.testing.assert_close(gate.wg.weight, theirs.text_moe.gate.weight.float(), atol=0, rtol=0)
        torch.testing.assert_close(gate.e_score_correction_bias, theirs.text_moe.gate.moe_statics.e_score_correction_bias,
                                   atol=0, rtol=0)
        torch.testing.assert_close(block.moe.experts.gate_up_proj, theirs.text_moe.experts.gate_up_proj, atol=0, rtol=0)
    x = _ids()
    with torch.no_grad():
        ref = ours(x)
        biases = [b.moe.gates[0].e_score_correction_bias for _, b in ours.moe_layers()]
        kept = [t.clone() for t in biases]
        for t in biases:
            t.zero_()
        try:
            assert (ours(x) - ref).abs().max() > 1e-3
        finally:
            for t, k in zip(biases, kept):
                t.copy_(k)


def test_vision_parts_are_skipped_and_logged(pair, caplog):
    path = pair[3]
    with caplog.at_level(logging.INFO, logger="dynamoe.models"):
        dm.load(path, progress=False)
    notes = [r.getMessage() for r in caplog.records if "not loading" in r.getMessage()]
    assert len(notes) == 2, notes
    E = pair[1].config.text_config.moe_num_experts
    assert f"vision expert group of the MoE layers (experts {E}..{2 * E - 1}" in notes[0]
    assert "model.vision_model.*" in notes[1] and "model.resampler_model.*" in notes[1]


def test_server_says_images_are_not_supported(pair, tmp_path):
    from serve_testing import image_refusal

    msg = image_refusal(pair[2], str(tmp_path), "ernie-vl-tiny")
    assert "images are not supported by the model 'ernie-vl-tiny' (ernie4_5_vl_moe): its vision tower" in msg


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


def test_config_refusals():
    base = {"model_type": "ernie4_5_vl_moe", "text_config": {"vocab_size": 64, "hidden_size": 32,
                                                             "num_hidden_layers": 2, "num_attention_heads": 2,
                                                             "num_key_value_heads": 1}}
    with pytest.raises(ValueError, match="moe_intermediate_size"):
        dm.ModelConfig.from_dict({**base, "text_config": {**base["text_config"], "moe_intermediate_size": 16}})
    from dynamoe.models.registry import builder_for

    bad = {**base["text_config"], "rope_parameters": {"rope_type": "default", "rope_theta": 1e4,
                                                      "mrope_section": [2, 3, 3]}}
    cfg = dm.ModelConfig.from_dict({**base, "text_config": bad})
    with pytest.raises(ValueError, match="mrope_section"):
        builder_for(cfg)(cfg)
    with pytest.raises(ValueError, match="^ernie4_5_vl_moe_text: the base language model"):
        dm.ModelConfig.from_dict({**base["text_config"], "model_type": "ernie4_5_vl_moe_text"})
