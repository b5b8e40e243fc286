"""GLM-4.5V's text model against transformers' Glm4vMoeForConditionalGeneration on tiny random checkpoints
(text only): multimodal RoPE sections with equal t/h/w positions on half of each head, q/k/v biases, a dense
first layer, DeepSeek-style sigmoid routing with a selection bias and a shared expert; the vision tower
skipped, images refused by the server."""
import logging

import pytest

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch
from models_mla_util import ids, make_pair

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.glm4v_moe import Glm4vMoeForCausalLM  # noqa: E402
from dynamoe.models.moe_block import GatedMLP, SparseMoeBlock  # noqa: E402

TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2,
            max_position_embeddings=256, bos_token_id=None, eos_token_id=None)
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4)
VARIANTS = {
    # GLM-4.5V's shape: half RoPE (the default) in sections, q/k/v biases, one group, renormalised
    "half": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [1, 1, 2],
                                  "partial_rotary_factor": 0.5}),
    # groups that matter, raw weights scaled, no biases, RoPE over whole heads, a tied lm_head
    "groups": dict(n_group=4, topk_group=2, routed_scaling_factor=2.5, norm_topk_prob=False, attention_bias=False,
                   n_shared_experts=2, tie_word_embeddings=True,
                   rope_parameters={"rope_type": "default", "rope_theta": 5000.0, "mrope_section": [2, 3, 3],
                                    "partial_rotary_factor": 1.0}),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    text = {**TEXT, **VARIANTS[request.param]}
    tie = text.pop("tie_word_embeddings", False)
    cfg = transformers.Glm4vMoeConfig(text_config=text, vision_config=VISION, tie_word_embeddings=tie)
    hf, path = make_pair(transformers.Glm4vMoeForConditionalGeneration, cfg, tmp_path_factory.mktemp(request.param))
    return request.param, hf, dm.load(path, progress=False), path


def test_structure(pair):
    name, _, ours, _ = pair
    assert type(ours) is Glm4vMoeForCausalLM and ours.config.text_config_nested
    assert ours.config.tie_word_embeddings == (name == "groups")
    assert [type(layer.mlp) for layer in ours.model.layers] == [GatedMLP, SparseMoeBlock, SparseMoeBlock]
    attn = ours.model.layers[0].self_attn
    assert all((proj.bias is not None) == (name == "half") for proj in (attn.q_proj, attn.k_proj, attn.v_proj))
    assert attn.o_proj.bias is None and attn.q_norm is None
    assert ours.model.rotary_emb.dim == (8 if name == "half" else 16)
    for _, block in ours.moe_layers():
        gate = block.moe.config.gates[0]
        assert gate.type == "sigmoid" and gate.normalize == (name == "half")
        assert (gate.n_group, gate.topk_group) == ((4, 2) if name == "groups" else (1, 1))
        assert block.moe.gates[0].e_score_correction_bias.abs().min() > 0


def test_logits_match_transformers(pair):
    _, hf, ours, _ = pair
    check_logits(hf, ours, ids())


def test_greedy_matches_generate(pair):
    _, hf, ours, _ = pair
    check_greedy(hf, ours, ids(seed=1), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[2], ids(seed=2), prefill=9)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[2])


def test_vision_tower_is_skipped_and_logged(pair, caplog):
    *_, path = pair
    with caplog.at_level(logging.INFO, logger="dynamoe.models.loader"):
        dm.load(path, progress=False)
    notes = [r.getMessage() for r in caplog.records if "not loading" in r.getMessage()]
    assert len(notes) == 1 and notes[0].startswith("glm4v_moe: not loading") and "model.visual.*" in notes[0], notes


def test_text_config_defaults_as_transformers():
    """A glm4v_moe config whose text_config gives only the sizes: transformers' defaults, and its rule that a
    text config's own tie_word_embeddings: true ties the wrapper's lm_head (configs saved before v5)."""
    sizes = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=8)
    cfg = dm.ModelConfig.from_dict({"model_type": "glm4v_moe", "text_config": {**sizes, "use_qk_norm": True}})
    t = transformers.Glm4vMoeConfig(text_config=sizes).text_config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.intermediate_size) == \
        (t.n_routed_experts, t.num_experts_per_tok, t.moe_intermediate_size, t.intermediate_size)
    assert (cfg.num_key_value_heads, cfg.max_position_embeddings, cfg.rms_norm_eps, cfg.attention_bias) == \
        (t.num_key_value_heads, t.max_position_embeddings, t.rms_norm_eps, t.attention_bias)
    assert (cfg.n_shared_experts, cfg.first_k_dense_replace, cfg.norm_topk_prob, cfg.routed_scaling_factor) == \
        (t.n_shared_experts, t.first_k_dense_replace, t.norm_topk_prob, t.routed_scaling_factor)
    assert cfg.rope.partial_rotary_factor == t.rope_parameters["partial_rotary_factor"] == 0.5
    assert cfg.rope.theta == t.rope_parameters["rope_theta"] and cfg.use_qk_norm is False
    for outer, inner in ((None, None), (None, True), (False, True), (True, False)):
        d = {"model_type": "glm4v_moe", "text_config": dict(sizes) if inner is None else
             {**sizes, "tie_word_embeddings": inner}}
        if outer is not None:
            d["tie_word_embeddings"] = outer
        hf = transformers.Glm4vMoeConfig.from_dict({k: v for k, v in d.items() if k != "model_type"})
        assert dm.ModelConfig.from_dict(d).tie_word_embeddings is hf.tie_word_embeddings, (outer, inner)


def test_server_says_images_are_not_supported(pair, tmp_path):
    from serve_testing import image_refusal

    msg = image_refusal(pair[2], str(tmp_path), "glm-v-tiny")
    assert "images are not supported by the model 'glm-v-tiny' (glm4v_moe): its vision tower is not loaded" in msg
