"""Qwen3-Omni-MoE's thinker text model against transformers' Qwen3OmniMoeThinkerForConditionalGeneration on a
tiny random checkpoint (text only): Qwen3-MoE layers with interleaved multimodal RoPE at equal t/h/w
positions, a dense layer, biases; the thinker's own checkpoint and the full Omni layout (the thinker under
``thinker.`` beside a speech talker and code2wav, built by hand as the released checkpoints are), the
encoders and speech parts skipped, images refused by the server."""
import json
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
from dynamoe.models.qwen3_omni_moe import Qwen3OmniMoeForCausalLM  # noqa: E402

TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
            mlp_only_layers=[1], norm_topk_prob=False, attention_bias=True, max_position_embeddings=256,
            bos_token_id=None, eos_token_id=None,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3],
                             "mrope_interleaved": True})
VISION = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4,
              num_position_embeddings=16, deepstack_visual_indexes=[0])
AUDIO = dict(encoder_layers=1, d_model=16, encoder_attention_heads=2, encoder_ffn_dim=32, output_dim=64, num_mel_bins=16,
             downsample_hidden_size=8)
SPEECH = {"talker.model.layers.0.self_attn.q_proj.weight": torch.randn(8, 8), "talker.codec_head.weight": torch.randn(4, 8),
          "code2wav.decoder.0.conv.weight": torch.randn(4, 4, 3)}


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen3_omni")
    torch.manual_seed(0)
    cfg = transformers.Qwen3OmniMoeThinkerConfig(text_config=TEXT, vision_config=VISION, audio_config=AUDIO)
    cfg.vision_start_token_id = 151652  # (the released config's; transformers' generate reads it, its class has none)
    hf = transformers.Qwen3OmniMoeThinkerForConditionalGeneration(cfg).eval()
    randomize_(hf, seed=1, scales={"lm_head": 0.05, "embed_tokens": 0.5})
    thinker = save_tiny(hf, root / "thinker")
    # the full model's layout: {"model_type": "qwen3_omni_moe", "thinker_config": ..., "talker_config": ...}
    os.makedirs(root / "omni")
    tensors = {"thinker." + k: v for k, v in load_file(os.path.join(thinker, "model.safetensors")).items()}
    save_file({**tensors, **SPEECH}, str(root / "omni" / "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(thinker, "config.json")) as f:
        thinker_cfg = json.load(f)
    with open(root / "omni" / "config.json", "w") as f:
        json.dump({"architectures": ["Qwen3OmniMoeForConditionalGeneration"], "model_type": "qwen3_omni_moe",
                   "enable_audio_output": True, "thinker_config": {k: v for k, v in thinker_cfg.items()
                                                                   if k not in ("architectures", "dtype")},
                   "talker_config": {"model_type": "qwen3_omni_moe_talker"}, "code2wav_config": {}}, f)
    return hf, {"thinker": thinker, "omni": str(root / "omni")}


@pytest.fixture(scope="module", params=["thinker", "omni"])
def pair(request, ckpts):
    hf, paths = ckpts
    return request.param, hf, dm.load(paths[request.param], progress=False), paths[request.param]


def test_structure(pair):
    kind, _, ours, _ = pair
    assert type(ours) is Qwen3OmniMoeForCausalLM and ours.config.text_config_nested
    assert ours.config.model_type == {"thinker": "qwen3_omni_moe_thinker", "omni": "qwen3_omni_moe"}[kind]
    assert [i for i, _ in ours.moe_layers()] == [0, 2]
    assert not any(b.moe.config.gates[0].normalize for _, b in ours.moe_layers())
    assert ours.model.layers[0].self_attn.o_proj.bias is not None


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


def test_other_parts_are_skipped_and_logged(pair, caplog):
    kind, *_, path = pair
    with caplog.at_level(logging.INFO, logger="dynamoe.models.loader"):
        dm.load(path, progress=False)
    notes = [r.getMessage() for r in caplog.records if "not loading" in r.getMessage()]
    want = ["visual.*", "audio_tower.*"] if kind == "thinker" else ["thinker.visual.*", "thinker.audio_tower.*",
                                                                     "talker.* (2 tensors)", "code2wav.* (1 tensors)"]
    assert len(notes) == 1 and all(w in notes[0] for w in want), notes


def test_text_config_defaults_as_transformers():
    sizes = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=8)
    cfg = dm.ModelConfig.from_dict({"model_type": "qwen3_omni_moe", "thinker_config": {"text_config": {
        **sizes, "sliding_window": 16, "use_sliding_window": True}}})
    t = transformers.Qwen3OmniMoeThinkerConfig(text_config=sizes).text_config
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.moe_intermediate_size, cfg.intermediate_size) == \
        (t.num_experts, t.num_experts_per_tok, t.moe_intermediate_size, t.intermediate_size)
    assert (cfg.num_key_value_heads, cfg.max_position_embeddings, cfg.rms_norm_eps, cfg.norm_topk_prob) == \
        (t.num_key_value_heads, t.max_position_embeddings, t.rms_norm_eps, t.norm_topk_prob)
    assert cfg.rope.theta == t.rope_parameters["rope_theta"] and cfg.sliding_window is None
    assert cfg.tie_word_embeddings is False
    with pytest.raises(ValueError, match=r"'thinker_config.text_config' must be a dict"):
        dm.ModelConfig.from_dict({"model_type": "qwen3_omni_moe", "thinker_config": {}})


def test_server_says_images_are_not_supported(pair, tmp_path):
    from serve_testing import image_refusal

    kind, _, ours, _ = pair
    msg = image_refusal(ours, str(tmp_path), "omni-tiny")
    assert (f"images are not supported by the model 'omni-tiny' ({ours.config.model_type}): its vision and audio "
            "encoders are not loaded") in msg
