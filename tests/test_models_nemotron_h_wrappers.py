"""Nemotron-H's text model from its two multimodal wrappers against transformers on tiny random checkpoints:
Nemotron-3-Nano-Omni (``nemotron_h_omni``: ``language_model.backbone.*``, the RADIO vision tower, the Parakeet audio
encoder and their projectors beside it; released configs under ``llm_config``) and Nemotron-3.5-Transcribe
(``nemo_speechlm``: NeMo's ``llm.model.*`` names beside the speech / diarization encoders and the word-timestamp head;
the released export's stacked experts). Logits, greedy generation and the engine equal transformers'; the wrapper's
other parts are skipped and logged, every tensor of the language model is read; images and audio are refused naming
the model; neither wrapper ties its lm_head."""
import json
import logging
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_greedy, check_logits, hf_logits, randomize_, save_tiny
from models_util import ids as _ids
from test_models_nemotron_h import SIZES

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models import loader  # noqa: E402
from dynamoe.models.nemotron_h import NemotronHForCausalLM, NemotronHMoE  # noqa: E402
from dynamoe.models.weights import PerExpertFFN, StackedFFN  # noqa: E402

# (the towers as small as their config classes allow)
VISION = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, patch_size=4, image_size=16, max_img_size=32,
              num_cls_tokens=1, num_registers=1, video_temporal_patch_size=2)
PARAKEET = dict(hidden_size=16, num_hidden_layers=1, num_attention_heads=2, intermediate_size=32,
                subsampling_conv_channels=4, num_mel_bins=16, projection_hidden_size=24, projection_bias=False)
ASR = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, num_mel_bins=16)
DIARIZATION = dict(audio_config=dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                     num_mel_bins=16),
                   head_config=dict(hidden_size=8, num_speakers=4, audio_hidden_size=16),
                   streaming_config=dict(num_speakers=4, speaker_cache_length=16))
WORD_TIMESTAMP = dict(hidden_size=16, intermediate_size=16, num_hidden_layers=1, num_attention_heads=2, vocab_size=11,
                      blank_token_id=10)
# where each wrapper keeps the language model, and its other parts (as transformers saves them)
LM_PREFIXES = {"nemotron_h_omni": ("language_model.",), "nemo_speechlm": ("llm.",)}
PARTS = {"nemotron_h_omni": ("vision_model.", "mlp1.", "sound_encoder.", "sound_projection."),
         "nemo_speechlm": ("perception.", "ctc_timestamp.")}


def _omni(**text):
    cfg = transformers.NemotronH_Omni_Reasoning_V3_Config(
        text_config={**SIZES, **text}, vision_config=VISION, audio_config=PARAKEET, projector_hidden_size=24,
        vision_hidden_size=16, image_token_id=5, audio_token_id=6)
    return transformers.NemotronH_Omni_Reasoning_V3(cfg)


def _transcribe(**text):
    # (the audio token past the vocabulary, as released: text-only inputs never hold it)
    cfg = transformers.Nemotron3_5TranscribeConfig(
        text_config={**SIZES, **text}, audio_config=dict(asr_config=ASR, diarization_config=DIARIZATION),
        word_timestamp_config=WORD_TIMESTAMP, audio_token_id=VOCAB)
    return transformers.Nemotron3_5TranscribeForConditionalGeneration(cfg)


WRAPPERS = {"nemotron_h_omni": _omni, "nemo_speechlm": _transcribe}


def _build(name, **text):
    torch.manual_seed(0)
    hf = WRAPPERS[name](**text).eval()
    randomize_(hf, seed=1)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():   # (a buffer: randomize_ leaves it at zero) a selection bias that changes the choice
        for n, b in hf.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    return hf


@pytest.fixture(scope="module", params=sorted(WRAPPERS))
def pair(request, tmp_path_factory):
    name = request.param
    hf = _build(name)
    path = save_tiny(hf, tmp_path_factory.mktemp(name))
    return name, hf, dm.load(path, progress=False), path


def _edit_config(path, edit) -> None:
    with open(os.path.join(path, "config.json")) as f:
        d = json.load(f)
    edit(d)
    with open(os.path.join(path, "config.json"), "w") as f:
        json.dump(d, f)


def _copy(src, dst, tensors=None, edit=None) -> str:
    """The checkpoint folder ``src`` copied to ``dst`` with ``tensors`` (default: src's) and ``edit`` applied to its
    config.json."""
    os.makedirs(dst, exist_ok=True)
    with open(os.path.join(src, "config.json")) as f:
        d = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(d, f)
    if edit is not None:
        _edit_config(dst, edit)
    save_file(load_file(os.path.join(src, "model.safetensors")) if tensors is None else tensors,
              os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    return str(dst)


def test_structure(pair):
    name, hf, ours, path = pair
    assert type(ours) is NemotronHForCausalLM and ours.config.model_type == name and ours.config.text_config_nested
    assert ours.config.layer_types == tuple(SIZES["layers_block_type"]) and not ours.config.tie_word_embeddings
    assert ours.lm_head.weight is not ours.model.embed_tokens.weight
    assert [i for i, layer in enumerate(ours.model.layers) if isinstance(layer.mixer, NemotronHMoE)] == [1, 5]
    where = {"nemotron_h_omni": ("language_model.backbone.embeddings.weight", "language_model.backbone.norm_f.weight",
                                 "language_model.backbone.layers.0.mixer.A_log", "language_model.lm_head.weight"),
             "nemo_speechlm": ("llm.model.embed_tokens.weight", "llm.model.norm.weight",
                               "llm.model.layers.0.mixer._fp32_params.A_log", "llm.lm_head.weight")}[name]
    assert tuple(ours.checkpoint_name(n) for n in ("model.embed_tokens.weight", "model.norm.weight",
                                                   "model.layers.0.mixer.A_log", "lm_head.weight")) == where
    assert ours.checkpoint_name("model.layers.1.mixer.moe.gates.0.wg.weight").endswith("layers.1.mixer.gate.weight")
    assert type(ours.expert_layout) is PerExpertFFN   # (what transformers saves: per expert)


def test_logits_match_transformers(pair):
    _, hf, ours, _ = pair
    check_logits(hf, ours, _ids())


def test_greedy_matches_generate(pair):
    _, hf, ours, _ = pair
    check_greedy(hf, ours, _ids(seed=1), new_tokens=32)


def test_engine_generation_matches_generate(pair):
    """The serving engine (continuous batching, chunked prefill, a reused slot) gives transformers' greedy tokens per
    prompt."""
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


def test_wrapper_parts_are_skipped_and_logged(pair, caplog, monkeypatch):
    """The log names each of the wrapper's other parts once; every tensor of the language model is read (and nothing
    else is)."""
    name, _, _, path = pair
    recordings = []
    real_init = loader._Recording.__init__

    def init(self, tensors):
        real_init(self, tensors)
        recordings.append(self)

    monkeypatch.setattr(loader._Recording, "__init__", init)
    with caplog.at_level(logging.INFO, logger="dynamoe.models.loader"):
        dm.load(path, progress=False)
    notes = [r.getMessage() for r in caplog.records if "not loading" in r.getMessage()]
    assert len(notes) == 1 and notes[0].startswith("nemotron_h: not loading"), notes
    assert all(f"{p}*" in notes[0] for p in PARTS[name]), notes
    names = set(load_file(os.path.join(path, "model.safetensors")))
    lm = {n for n in names if n.startswith(LM_PREFIXES[name])}
    assert lm and names - lm and all(n.startswith(PARTS[name]) for n in names - lm)
    assert recordings[0].read == lm


def test_an_unknown_language_model_tensor_is_an_error(pair, tmp_path):
    name, _, _, path = pair
    tensors = load_file(os.path.join(path, "model.safetensors"))
    extra = {"nemotron_h_omni": "language_model.backbone.layers.0.mixer.extra", "nemo_speechlm": "llm.model.extra"}[name]
    tensors[extra] = torch.zeros(2)
    with pytest.raises(ValueError, match=f"unexpected tensors .*{extra}"):
        dm.load(_copy(path, tmp_path / "extra", tensors), progress=False)


def test_server_says_images_and_audio_are_not_supported(pair, tmp_path):
    from serve_testing import AUDIO_PART, image_refusal

    name, _, ours, _ = pair
    towers = {"nemotron_h_omni": "its vision and audio encoders", "nemo_speechlm": "its speech encoders"}[name]
    msg = image_refusal(ours, str(tmp_path / "image"), "nemotron-tiny")
    assert f"images are not supported by the model 'nemotron-tiny' ({name}): {towers} are not loaded" in msg
    msg = image_refusal(ours, str(tmp_path / "audio"), "nemotron-tiny", AUDIO_PART)
    assert msg.startswith("messages[0].content[1] is an 'input_audio' part: audio is not supported by the model "
                          f"'nemotron-tiny' ({name}): {towers} are not loaded"), msg


@pytest.mark.parametrize("pair", ["nemotron_h_omni"], indirect=True)
def test_legacy_llm_config_loads(pair, tmp_path):
    """Nemotron-3-Nano-Omni's released config names: the text model under llm_config (and the towers' legacy names),
    read by transformers' config class as text_config; dynamoe loads it to the same logits."""
    _, hf, _, path = pair

    def legacy(d):
        for new, old in (("text_config", "llm_config"), ("audio_config", "sound_config"),
                         ("vision_hidden_size", "vit_hidden_size"), ("image_token_id", "img_context_token_id")):
            d[old] = d.pop(new)

    legacy_path = _copy(path, tmp_path / "legacy", edit=legacy)
    with open(os.path.join(legacy_path, "config.json")) as f:
        assert "text_config" not in json.load(f)
    theirs = transformers.AutoConfig.from_pretrained(legacy_path)
    assert theirs.text_config.to_dict() == hf.config.text_config.to_dict()
    ours = dm.load(legacy_path, progress=False)
    assert ours.config.layer_types == tuple(SIZES["layers_block_type"])
    check_logits(hf, ours, _ids())
    _edit_config(legacy_path, lambda d: d.update(llm_config=[1]))
    with pytest.raises(ValueError, match="'llm_config'"):
        dm.load(legacy_path, progress=False)


@pytest.mark.parametrize("pair", ["nemo_speechlm"], indirect=True)
def test_released_nemo_export_loads(pair, tmp_path):
    """Nemotron-3.5-Transcribe's released export (what transformers' conversion mapping reads): the routed experts
    stacked in->out as experts.gate_and_up_projs [E, D, F] / down_projs [E, F, D], TransformerEngine's _extra_state
    entries, MTP layers under llm.mtp. -- transformers reads it back to its logits, and so does dynamoe."""
    _, hf, _, path = pair
    tensors = load_file(os.path.join(path, "model.safetensors"))
    E = SIZES["n_routed_experts"]
    for i in (1, 5):
        prefix = f"llm.model.layers.{i}.mixer.experts"
        for proj, stacked in (("up_proj", "gate_and_up_projs"), ("down_proj", "down_projs")):
            per_expert = [tensors.pop(f"{prefix}.{e}.{proj}.weight") for e in range(E)]
            tensors[f"{prefix}.{stacked}"] = torch.stack([w.t() for w in per_expert]).contiguous()
        tensors[f"{prefix}._extra_state"] = torch.zeros(4, dtype=torch.uint8)
    tensors["llm.mtp.layers.0.norm.weight"] = torch.ones(SIZES["hidden_size"])
    released = _copy(path, tmp_path / "released", tensors)
    theirs = transformers.Nemotron3_5TranscribeForConditionalGeneration.from_pretrained(released).eval()
    torch.testing.assert_close(hf_logits(theirs, _ids()), hf_logits(hf, _ids()), atol=0, rtol=0)
    ours = dm.load(released, progress=False)
    assert ours.expert_layout == StackedFFN("gate_and_up_projs", "down_projs")
    check_logits(hf, ours, _ids())
    check_greedy(hf, ours, _ids(seed=1), new_tokens=8)
    tensors["llm.model.layers.1.mixer.experts.down_projs"] = torch.zeros(E, SIZES["hidden_size"], 16)  # out->in
    with pytest.raises(ValueError, match=r"'llm.model.layers.1.mixer.experts.down_projs': expected shape \(8, 16, 32\)"):
        dm.load(_copy(path, tmp_path / "wrong_shape", tensors), progress=False)


@pytest.mark.parametrize("name", sorted(WRAPPERS))
def test_lm_head_never_tied(name, tmp_path):
    """NemotronHForCausalLM has no tied weights and neither has the transcription model: a config saying
    tie_word_embeddings (at either level) still reads the checkpoint's own lm_head, as transformers does."""
    hf = _build(name, tie_word_embeddings=True)
    path = save_tiny(hf, tmp_path / "tied")
    _edit_config(path, lambda d: d.update(tie_word_embeddings=True))
    theirs = type(hf).from_pretrained(path).eval()   # (its logits: the saved lm_head's, not the embeddings')
    torch.testing.assert_close(hf_logits(theirs, _ids()), hf_logits(hf, _ids()), atol=0, rtol=0)
    ours = dm.load(path, progress=False)
    assert not ours.config.tie_word_embeddings and ours.lm_head.weight is not ours.model.embed_tokens.weight
    check_logits(hf, ours, _ids())


def test_config_errors_name_the_field():
    sizes = dict(vocab_size=128, hidden_size=64, num_attention_heads=8)
    for mt in sorted(WRAPPERS):
        with pytest.raises(ValueError, match="'text_config.model_type'.*'nemotron_h'"):
            dm.ModelConfig.from_dict({"model_type": mt, "text_config": {**sizes, "model_type": "jamba"}})
        with pytest.raises(ValueError, match="'text_config'"):
            dm.ModelConfig.from_dict({"model_type": mt, "text_config": [1]})
    # the legacy key only where the config class reads one
    with pytest.raises(ValueError, match="'text_config'"):
        dm.ModelConfig.from_dict({"model_type": "nemo_speechlm", "llm_config": sizes})
    for legacy in (sizes, {**sizes, "model_type": "nemotron_h"}):
        cfg = dm.ModelConfig.from_dict({"model_type": "nemotron_h_omni", "llm_config": legacy})
        assert cfg.family_type == "nemotron_h" and cfg.hidden_size == 64 and cfg.text_config_nested


def test_omni_with_mtp_layers_skips_them_and_the_vision_final_norm(tmp_path, caplog):
    """A language model with MTP layers (num_nextn_predict_layers): the Omni wrapper then builds a final norm for the
    vision features (saved as vision_projector.vision_final_layernorm), and the released checkpoint carries the MTP
    layers under language_model.mtp. -- neither is loaded, both are named in the log."""
    hf = _build("nemotron_h_omni", num_nextn_predict_layers=1)
    assert hf.vision_final_layernorm is not None
    path = save_tiny(hf, tmp_path / "saved")
    tensors = load_file(os.path.join(path, "model.safetensors"))
    assert any(n.startswith("vision_projector.vision_final_layernorm.") for n in tensors)
    tensors["language_model.mtp.layers.0.norm.weight"] = torch.ones(SIZES["hidden_size"])
    released = _copy(path, tmp_path / "released", tensors)
    with caplog.at_level(logging.INFO, logger="dynamoe.models.loader"):
        ours = dm.load(released, progress=False)
    notes = [r.getMessage() for r in caplog.records if "not loading" in r.getMessage()]
    assert len(notes) == 1 and "vision_projector.* (2 tensors)" in notes[0] and "language_model.mtp.* (1 tensors)" in notes[0]
    check_logits(hf, ours, _ids())


def test_stacked_ffn_experts_read_as_per_expert_ones():
    """StackedFFN (in->out, stacked by expert) reads the same experts as PerExpertFFN (out->in, one tensor each), and
    expert parallelism's contiguous range reads rows of the whole."""
    from dynamoe.models.weights import read_ffn_experts

    E, F_, D = 4, 6, 5
    g = torch.Generator().manual_seed(0)
    per = {f"x.{e}.{p}.weight": torch.randn(shape, generator=g) for e in range(E)
           for p, shape in (("up_proj", (F_, D)), ("down_proj", (D, F_)))}
    stacked = {"x.gate_and_up_projs": torch.stack([per[f"x.{e}.up_proj.weight"].t() for e in range(E)]),
               "x.down_projs": torch.stack([per[f"x.{e}.down_proj.weight"].t() for e in range(E)])}
    want = read_ffn_experts(per, None, "x", PerExpertFFN(), E, F_, D, torch.float32, "cpu")
    got = read_ffn_experts(stacked, None, "x", StackedFFN(), E, F_, D, torch.float32, "cpu")
    assert torch.equal(got.w1, want.w1) and torch.equal(got.w2, want.w2)
    part = read_ffn_experts(stacked, None, "x", StackedFFN(), E, F_, D, torch.float32, "cpu", local=range(1, 3))
    assert torch.equal(part.w1, want.w1[1:3]) and torch.equal(part.w2, want.w2[1:3])
    with pytest.raises(ValueError, match=r"'x.down_projs': expected shape \(4, 6, 5\)"):
        read_ffn_experts({**stacked, "x.down_projs": torch.zeros(E, D, F_)}, None, "x", StackedFFN(), E, F_, D,
                         torch.float32, "cpu")
