"""Qwen3-VL-MoE's text model against transformers' Qwen3VLMoeForConditionalGeneration on tiny random
checkpoints (text only): interleaved multimodal RoPE with equal t/h/w positions, always-renormalised top-k,
a dense layer (mlp_only_layers), fused experts as transformers 5 saves them and as the released
checkpoints store them (in->out), the vision tower skipped, images refused by the server."""
import logging
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_util import ids as _ids

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.qwen3_vl_moe import Qwen3VLMoeForCausalLM  # noqa: E402

# F = 24: neither 2F nor F equals D = 64, so the two expert orientations are told apart by shape
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=24, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
            mlp_only_layers=[1], max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                             "mrope_interleaved": True})
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4,
              num_position_embeddings=16, deepstack_visual_indexes=[0])
VARIANTS = {"plain": {}, "tied_bias": dict(tie_word_embeddings=True, attention_bias=True)}
SCALES = {"lm_head": 0.05, "embed_tokens": 0.5}


def _hf(name):
    text = dict(TEXT)
    tie = VARIANTS[name].get("tie_word_embeddings", False)
    text.update({k: v for k, v in VARIANTS[name].items() if k != "tie_word_embeddings"})
    cfg = transformers.Qwen3VLMoeConfig(text_config=text, vision_config=VISION, tie_word_embeddings=tie)
    return transformers.Qwen3VLMoeForConditionalGeneration(cfg)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = _hf(request.param).eval()
    randomize_(hf, seed=1, scales=SCALES)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"qwen3_vl_moe_{request.param}"))
    return request.param, hf, dm.load(path, progress=False), path


def test_structure(pair):
    name, hf, ours, _ = pair
    assert type(ours) is Qwen3VLMoeForCausalLM and ours.config.text_config_nested
    assert ours.config.tie_word_embeddings == (name == "tied_bias")
    assert [i for i, _ in ours.moe_layers()] == [0, 2]
    assert all(b.moe.config.gates[0].normalize for _, b in ours.moe_layers())
    assert all(layer.self_attn.sliding_window is None for layer in ours.model.layers)


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


def test_mrope_is_plain_rope_for_text(pair):
    """transformers' interleaved mrope cos/sin with its three position grids equal (what text gets) are the
    plain RoPE tables dynamoe uses."""
    _, hf, ours, _ = pair
    rot = hf.model.language_model.rotary_emb
    pos = torch.arange(40)[None]
    x = torch.zeros(1, 40, 16)
    cos, sin = rot(x, pos[None].expand(3, 1, 40))
    freqs = pos[0, :, None].float() * ours.model.rotary_emb.inv_freq
    torch.testing.assert_close(cos[0], torch.cat([freqs.cos()] * 2, -1), atol=1e-6, rtol=0)
    torch.testing.assert_close(sin[0], torch.cat([freqs.sin()] * 2, -1), atol=1e-6, rtol=0)
    # and different grids (an image's positions) would not be: the sections matter there
    cos_img, _ = rot(x, torch.stack([pos, pos // 2, pos % 5])[:, :1].expand(3, 1, 40))
    assert (cos_img - cos).abs().max() > 0.1


def test_vision_tower_is_skipped_and_logged(pair, caplog):
    *_, path = pair
    with caplog.at_level(logging.INFO, logger="dynamoe.models.loader"):
        dm.load(path, progress=False)
    notes = [r.getMessage() for r in caplog.records if "not loading" in r.getMessage()]
    assert len(notes) == 1 and "model.visual.*" in notes[0], notes


def test_released_expert_layout_loads(pair, tmp_path):
    """The released checkpoints store gate_up_proj [E, D, 2F] and down_proj [E, F, D] (in->out): the same model."""
    _, hf, ours, path = pair
    tensors = load_file(os.path.join(path, "model.safetensors"))
    for k in [k for k in tensors if k.endswith(("experts.gate_up_proj", "experts.down_proj"))]:
        tensors[k] = tensors[k].transpose(1, 2).contiguous()
    assert tensors["model.language_model.layers.0.mlp.experts.gate_up_proj"].shape == (8, 64, 48)
    os.makedirs(tmp_path / "released")
    save_file(tensors, str(tmp_path / "released" / "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f, open(tmp_path / "released" / "config.json", "w") as g:
        g.write(f.read())
    released = dm.load(tmp_path / "released", progress=False)
    x = _ids(seed=3)
    with torch.no_grad():
        assert torch.equal(released(x), ours(x))
    bad = dict(tensors, **{"model.language_model.layers.0.mlp.experts.down_proj": torch.zeros(8, 64, 25)})
    save_file(bad, str(tmp_path / "released" / "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match=r"experts\.down_proj'.*\(8, 64, 24\) \(out->in\) or \(8, 24, 64\)"):
        dm.load(tmp_path / "released", progress=False)


def test_text_config_defaults_as_transformers():
    """A qwen3_vl_moe config whose text_config gives only the sizes: transformers' defaults (the wrapper's
    tie flag, the text config's RoPE base and expert counts, always-renormalised top-k, no window)."""
    sizes = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=16)  # 16 KV heads by default
    cfg = dm.ModelConfig.from_dict({"model_type": "qwen3_vl_moe", "text_config": {**sizes, "norm_topk_prob": False,
                                                                                   "sliding_window": 16}})
    hf = transformers.Qwen3VLMoeConfig(text_config=sizes)
    t = hf.text_config
    assert cfg.tie_word_embeddings is hf.tie_word_embeddings is False
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.intermediate_size) == \
        (t.num_experts, t.num_experts_per_tok, t.moe_intermediate_size, t.intermediate_size)
    assert (cfg.num_key_value_heads, cfg.max_position_embeddings, cfg.rms_norm_eps, cfg.head_dim) == \
        (t.num_key_value_heads, t.max_position_embeddings, t.rms_norm_eps, t.head_dim)
    assert cfg.rope.theta == t.rope_parameters["rope_theta"] and cfg.rope.rope_type == "default"
    assert cfg.norm_topk_prob is True and cfg.sliding_window is None
    flat = dm.ModelConfig.from_dict({"model_type": "qwen3_vl_moe_text", **sizes})
    assert flat.tie_word_embeddings is t.tie_word_embeddings is True
    # the outer level's token ids win; a quantization_config at both levels must agree
    d = {"model_type": "qwen3_vl_moe", "eos_token_id": 5, "text_config": {**sizes, "eos_token_id": 6, "bos_token_id": 1}}
    assert (dm.ModelConfig.from_dict(d).eos_token_id, dm.ModelConfig.from_dict(d).bos_token_id) == ((5,), 1)
    q = {"quant_method": "fp8", "weight_block_size": [128, 128]}
    assert dm.ModelConfig.from_dict({**d, "quantization_config": q}).quantization_config == q
    with pytest.raises(ValueError, match=r"'quantization_config', 'text_config.quantization_config'\] are all given"):
        dm.ModelConfig.from_dict({**d, "quantization_config": q,
                                  "text_config": {**d["text_config"], "quantization_config": {"quant_method": "mxfp4"}}})


def test_server_says_images_are_not_supported(pair, tmp_path):
    from serve_testing import image_refusal

    msg = image_refusal(pair[2], str(tmp_path), "qwen3-vl-tiny")
    assert "images are not supported by the model 'qwen3-vl-tiny' (qwen3_vl_moe): its vision tower is not loaded" in msg
