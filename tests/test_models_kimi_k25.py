"""Kimi-K2.5 (``kimi_k25``): a vision-language config.json around a DeepSeek-V3 text config, tensors under
``language_model.`` beside a vision tower. Tiny checkpoints in the public layout (config.json shape of
moonshotai/Kimi-K2.5, built by hand from a tiny transformers DeepSeek-V3 and a few dummy vision tensors):
the dense one against transformers' DeepseekV3ForCausalLM of the same text weights, the INT4 one
(compressed-tensors pack-quantized routed experts, as the released checkpoints) against the DeepSeek-V3
model of its dequantized weights -- in dynamoe and in transformers, logits and 32 greedy tokens."""
import json
import logging
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from int4_util import write_dense_reference, write_int4_experts
from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import check_greedy, check_logits, greedy
from models_mla_util import BASE, GROUPS, MLA, ids, make_pair

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.config import ModelConfig  # noqa: E402
from dynamoe.models.deepseek_v3 import DeepseekV3ForCausalLM  # noqa: E402
from dynamoe.models.kimi_k25 import KimiK25ForCausalLM  # noqa: E402
from dynamoe.quant import INT4Weight, QuantizedExperts  # noqa: E402

EOS = 7
VISION = {  # a few tensors of the vision tower and its projector (names as in the released checkpoint)
    "vision_tower.patch_embed.proj.weight": torch.randn(8, 3, 2, 2),
    "vision_tower.encoder.blocks.0.wqkv.weight": torch.randn(24, 8),
    "vision_tower.encoder.blocks.0.norm0.weight": torch.ones(8),
    "mm_projector.pre_norm.weight": torch.ones(8),
    "mm_projector.proj.0.weight": torch.randn(16, 32),
}


def kimi_config(text: dict, text_model_type: str) -> dict:
    """config.json of a Kimi-K2.5 checkpoint (its public shape) around the text config ``text``."""
    text = {k: v for k, v in text.items() if k not in ("architectures", "transformers_version", "dtype", "torch_dtype")}
    return {
        "architectures": ["KimiK25ForConditionalGeneration"],
        "auto_map": {"AutoConfig": "configuration_kimi_k25.KimiK25Config",
                     "AutoModel": "modeling_kimi_k25.KimiK25ForConditionalGeneration"},
        "bos_token_id": 1, "eos_token_id": EOS, "pad_token_id": 0, "ignore_index": -100,
        "media_placeholder_token_id": 100, "model_type": "kimi_k25", "tie_word_embeddings": False,
        "use_unified_vision_chunk": True, "video_placeholder": "<|kimi_k25_video_placeholder|>",
        "text_config": {**text, "model_type": text_model_type},
        "vision_config": {"init_pos_emb_height": 4, "init_pos_emb_width": 4, "init_pos_emb_time": 2,
                          "merge_kernel_size": [2, 2], "mm_hidden_size": 8, "mm_projector_type": "patchmerger",
                          "patch_size": 2, "text_hidden_size": BASE["hidden_size"], "vt_hidden_size": 8,
                          "vt_num_attention_heads": 2, "vt_num_hidden_layers": 1, "vt_intermediate_size": 16},
    }


def write_dense_kimi(src: str, dst: str) -> None:
    os.makedirs(dst)
    tensors = load_file(os.path.join(src, "model.safetensors"))
    out = {"language_model." + k: v.contiguous() for k, v in tensors.items()}
    save_file({**out, **VISION}, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(src, "config.json")) as f:
        text = json.load(f)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(kimi_config(text, "deepseek_v3"), f)


@pytest.fixture(scope="module")
def ckpts(tmp_path_factory):
    root = tmp_path_factory.mktemp("kimi_k25")
    hf, text = make_pair(transformers.DeepseekV3ForCausalLM,
                         transformers.DeepseekV3Config(**{**BASE, **MLA, **GROUPS}), root / "text")
    write_dense_kimi(text, str(root / "dense"))
    # the INT4 checkpoint: quantization_config under text_config, as Kimi-K2.5's config.json has it
    dense = write_int4_experts(text, str(root / "int4"), group=32, prefix="language_model.", extra=VISION,
                               config_edit=lambda cfg, qc: kimi_config({**cfg, "quantization_config": qc}, "kimi_k2"))
    write_dense_reference(text, str(root / "int4_ref"), dense)
    return {"hf": hf, "text": text, "dense": str(root / "dense"), "int4": str(root / "int4"),
            "ref": str(root / "int4_ref")}


def test_config_is_the_text_config_with_the_outer_fields(ckpts):
    with open(os.path.join(ckpts["int4"], "config.json")) as f:
        raw = json.load(f)
    cfg = ModelConfig.from_dict(raw)
    text = dm.load_config(ckpts["text"])
    assert cfg.model_type == "kimi_k25" and cfg.architectures == ("KimiK25ForConditionalGeneration",)
    assert (cfg.eos_token_id, cfg.bos_token_id, cfg.pad_token_id, cfg.tie_word_embeddings) == ((EOS,), 1, 0, False)
    assert cfg.quantization_config["format"] == "pack-quantized"
    for f in ("hidden_size", "num_hidden_layers", "kv_lora_rank", "q_lora_rank", "num_experts", "n_group", "topk_group",
              "routed_scaling_factor", "first_k_dense_replace", "rope", "rope_interleave", "moe_intermediate_size"):
        assert getattr(cfg, f) == getattr(text, f), f
    with pytest.raises(ValueError, match=r"'text_config.model_type'.*deepseek_v3.*got 'llama'"):
        ModelConfig.from_dict({**raw, "text_config": {**raw["text_config"], "model_type": "llama"}})
    with pytest.raises(ValueError, match="'text_config'.*a dict"):
        ModelConfig.from_dict({k: v for k, v in raw.items() if k != "text_config"})


def test_minimal_config_gets_the_text_family_defaults():
    """A kimi_k25 config whose text_config gives only the sizes: the DeepSeek-V3 defaults apply (as transformers'
    Kimi_K25Config's text config has them), not ModelConfig's own."""
    sizes = dict(vocab_size=128, hidden_size=64, num_hidden_layers=4, num_attention_heads=8, intermediate_size=96,
                 moe_intermediate_size=32)
    cfg = ModelConfig.from_dict({"model_type": "kimi_k25", "text_config": {"model_type": "kimi_k2", **sizes}})
    flat = ModelConfig.from_dict({"model_type": "deepseek_v3", **sizes})
    hf = transformers.Kimi_K25Config(text_config={"model_type": "kimi_k2", **sizes}).text_config
    for f in ("kv_lora_rank", "q_lora_rank", "qk_rope_head_dim", "v_head_dim", "n_group", "topk_group",
              "first_k_dense_replace", "n_shared_experts", "routed_scaling_factor", "rms_norm_eps"):
        assert getattr(cfg, f) == getattr(flat, f) == getattr(hf, f), f
    assert cfg.num_experts == flat.num_experts == hf.n_routed_experts and cfg.rope_interleave is True


def test_dense_kimi_matches_transformers_deepseek(ckpts, caplog):
    with caplog.at_level(logging.INFO, logger="dynamoe.models.loader"):
        ours = dm.load(ckpts["dense"], progress=False)
    assert type(ours) is KimiK25ForCausalLM
    notes = [r.getMessage() for r in caplog.records if "not loading" in r.getMessage()]
    assert notes == ["kimi_k25: not loading 5 tensors the text model does not use: vision_tower.* (3 tensors), "
                     "mm_projector.* (2 tensors)"]
    check_logits(ckpts["hf"], ours, ids())
    check_greedy(ckpts["hf"], ours, ids(seed=1), new_tokens=32)


def test_int4_kimi_equals_the_dequantized_deepseek(ckpts):
    ours = dm.load(ckpts["int4"], progress=False)
    ref = dm.load(ckpts["ref"], progress=False)
    assert type(ours) is KimiK25ForCausalLM and type(ref) is DeepseekV3ForCausalLM
    blocks = ours.moe_layers()
    assert blocks and all(isinstance(b.moe.experts, QuantizedExperts) and b.moe.experts.format == "int4"
                          for _, b in blocks)
    w1 = blocks[0][1].moe.experts.w1
    assert isinstance(w1, INT4Weight) and w1.group_size == 32 and w1.weight_packed.dtype == torch.int32
    x = ids()
    with torch.no_grad():
        got, want = ours(x), ref(x)
    assert want.abs().max() > 1.0
    torch.testing.assert_close(got, want, atol=1e-5, rtol=0)
    hf_ref = transformers.DeepseekV3ForCausalLM.from_pretrained(ckpts["ref"]).eval()
    check_logits(hf_ref, ours, x)
    check_greedy(hf_ref, ours, ids(seed=1), new_tokens=32)   # decode steps run the INT4 CPU kernels
    assert torch.equal(greedy(ours, ids(rows=1, seed=2), 8), greedy(ref, ids(rows=1, seed=2), 8))


def test_kimi_k2_thinking_layout(ckpts, tmp_path):
    """Kimi-K2-Thinking's layout: a plain kimi_k2 config with quantization_config at the top, INT4 experts
    under model.layers (no wrapper): the DeepSeek-V3 model of the dequantized weights."""
    dense = write_int4_experts(ckpts["text"], str(tmp_path / "k2"), group=32, config_edit=lambda cfg, qc: {
        **cfg, "model_type": "kimi_k2", "quantization_config": qc})
    write_dense_reference(ckpts["text"], str(tmp_path / "ref"), dense)
    ours, ref = dm.load(tmp_path / "k2", progress=False), dm.load(tmp_path / "ref", progress=False)
    assert type(ours) is DeepseekV3ForCausalLM and all(b.moe.experts.format == "int4" for _, b in ours.moe_layers())
    x = ids(seed=3)
    with torch.no_grad():
        torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=0)


def test_int4_kimi_in_bf16_keeps_experts_packed(ckpts):
    """bf16 compute with the experts still INT4: near the fp32 model of the dequantized weights (bf16 rounding
    through three random layers; the dense bf16 model of the same weights is no closer)."""
    ours = dm.load(ckpts["int4"], dtype=torch.bfloat16, progress=False)
    assert all(b.moe.experts.format == "int4" for _, b in ours.moe_layers())
    x = ids()
    with torch.no_grad():
        got, want = ours(x).float(), dm.load(ckpts["ref"], progress=False)(x)
    err = (got - want).abs()
    assert err.max() < 0.1 * want.abs().max() and err.mean() < 0.01 * want.abs().max()


def test_unknown_and_missing_text_tensors_still_fail(ckpts, tmp_path):
    for name, edit, match in (
        ("extra", lambda t: {**t, "language_model.model.layers.0.foo": torch.ones(2)},
         r"unexpected tensors.*language_model\.model\.layers\.0\.foo"),
        ("other_part", lambda t: {**t, "audio_tower.w": torch.ones(2)}, r"unexpected tensors.*audio_tower\.w"),
        ("missing", lambda t: {k: v for k, v in t.items() if k != "language_model.model.norm.weight"},
         r"missing tensor 'language_model\.model\.norm\.weight'"),
    ):
        dst = tmp_path / name
        shutil.copytree(ckpts["dense"], dst)
        tensors = load_file(os.path.join(dst, "model.safetensors"))
        save_file(edit(tensors), os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
        with pytest.raises(ValueError, match=match):
            dm.load(dst, progress=False)


def test_server_says_images_are_not_supported_by_this_model(ckpts, tmp_path):
    """An image part (OpenAI) or block (Anthropic) sent to a served Kimi-K2.5 is a 400 that names the model
    and says why: its vision tower is not loaded."""
    import httpx
    from engine_testing import write_tokenizer_dir
    from serve_testing import InProcessServer

    from dynamoe.engine import GenerationEngine, Tokenizer

    tok = Tokenizer.from_dir(write_tokenizer_dir(str(tmp_path / "tok")))
    engine = GenerationEngine(dm.load(ckpts["dense"], progress=False), tok, max_seq_len=64, max_batch=2)
    srv = InProcessServer(engine, tok, model_name="kimi-tiny")
    try:
        image = {"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA"}}
        r = httpx.post(srv.url + "/v1/chat/completions", timeout=30, json={"messages": [
            {"role": "user", "content": [{"type": "text", "text": "what is this?"}, image]}]})
        assert r.status_code == 400
        msg = r.json()["error"]["message"]
        assert "messages[0].content[1] is an 'image_url' part: images are not supported by the model 'kimi-tiny' " \
               "(kimi_k25): its vision tower is not loaded" in msg
        r = httpx.post(srv.url + "/v1/messages", timeout=30, json={"max_tokens": 4, "messages": [
            {"role": "user", "content": [{"type": "image", "source": {"type": "base64", "media_type": "image/png",
                                                                       "data": "AAAA"}}]}]})
        assert r.status_code == 400
        assert "images are not supported by the model 'kimi-tiny' (kimi_k25)" in r.json()["error"]["message"]
    finally:
        srv.stop()
