"""DeepSeek-OCR-2's text model from its multimodal checkpoint against transformers on tiny random checkpoints:
Llama attention (GQA, RoPE over the whole head), DeepSeek-V2's routing (softmax, greedy or group-limited, times the
route scale, not renormalised) with shared experts, dense layers by mlp_layer_types; the vision encoders skipped and
logged, images refused by the server."""
import dataclasses
import logging

import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_util import ids as _ids

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.base import DecoderLayer  # noqa: E402
from dynamoe.models.deepseek_ocr2 import DeepseekOcr2ForCausalLM  # noqa: E402
from dynamoe.models.moe_block import GatedMLP, SparseMoeBlock  # noqa: E402
from dynamoe.ops import cpu_kernels  # noqa: E402

TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            mlp_layer_types=["dense", "sparse", "sparse"], routed_scaling_factor=1.5)
VISION = dict(sam_config=dict(hidden_size=16, output_channels=16, num_hidden_layers=1, num_attention_heads=2, image_size=32,
                              patch_size=16, global_attn_indexes=[0]),
              encoder_config=dict(vocab_size=8, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, num_key_value_heads=1))
VARIANTS = {
    # greedy top-2 of 4, one shared expert, untied (the wrapper's default)
    "greedy": dict(),
    # group-limited greedy (2 groups, the best one kept), two shared experts, every layer MoE, tied
    "grouped": dict(topk_method="group_limited_greedy", n_group=2, topk_group=1, n_routed_experts=6,
                    num_experts_per_tok=2, n_shared_experts=2, mlp_layer_types=["sparse"] * 3, routed_scaling_factor=1.0),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    name = request.param
    torch.manual_seed(0)
    cfg = transformers.DeepseekOcr2Config(text_config={**TEXT, **VARIANTS[name]}, vision_config=VISION,
                                          tie_word_embeddings=name == "grouped")
    hf = transformers.DeepseekOcr2ForConditionalGeneration(cfg).eval()
    randomize_(hf, seed=1, scales={"lm_head": 0.5, "embed_tokens": 0.5})
    path = save_tiny(hf, tmp_path_factory.mktemp(f"deepseek_ocr2_{name}"))
    return name, hf, dm.load(path, progress=False), path


def test_structure(pair):
    name, hf, ours, _ = pair
    tc = hf.config.text_config
    assert type(ours) is DeepseekOcr2ForCausalLM and ours.config.text_config_nested
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == (name == "grouped")
    assert ours.config.head_dim == 16
    for kind, layer in zip(tc.mlp_layer_types, ours.model.layers):
        assert type(layer) is DecoderLayer and not layer.self_attn.rope_interleaved and layer.self_attn.q_norm is None
        assert type(layer.mlp) is (SparseMoeBlock if kind == "sparse" else GatedMLP)
        if kind == "sparse":
            gate = layer.mlp.moe.config.gates[0]
            assert (gate.type, gate.k, gate.normalize, gate.route_scale) == ("top", 2, False, tc.routed_scaling_factor)
            assert (gate.n_group, gate.topk_group) == ((2, 1) if name == "grouped" else (1, 1))
            assert layer.mlp.moe.shared_experts.down_proj.in_features == 16 * tc.n_shared_experts


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


def test_the_test_exercises_what_it_claims(pair):
    """The route scale, the shared experts and (grouped) the group limit each change the logits."""
    name, _, ours, _ = pair
    x = _ids()
    with torch.no_grad():
        ref = ours(x)
        blocks = [b for _, b in ours.moe_layers()]
        downs = [b.moe.shared_experts.down_proj.weight for b in blocks]
        kept = [p.clone() for p in downs]
        for p in downs:
            p.zero_()
        try:
            assert (ours(x) - ref).abs().max() > 1e-3
        finally:
            for p, k in zip(downs, kept):
                p.copy_(k)
    # the route scale (greedy: 1.5) and the group limit (grouped): a model built without them differs
    change = {"routed_scaling_factor": 1.0} if name == "greedy" else {"topk_method": "greedy"}
    other = type(ours)(dataclasses.replace(ours.config, **change)).eval()
    other.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert (other(x) - ref).abs().max() > 1e-3


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels could not be built here")
def test_decode_runs_the_fused_kernels(pair):
    ours = pair[2]
    with torch.no_grad():
        for layer in ours.model.layers:
            fused = layer.self_attn.decode_fused(layer.input_layernorm, torch.float32)
            assert fused.weights is not None, fused.extra


def test_vision_parts_are_skipped_and_logged(pair, caplog):
    path = pair[3]
    with caplog.at_level(logging.INFO, logger="dynamoe.models.loader"):
        dm.load(path, progress=False)
    notes = [r.getMessage() for r in caplog.records if "not loading" in r.getMessage()]
    assert len(notes) == 1 and notes[0].startswith("deepseek_ocr2: not loading"), notes
    assert "model.sam_model.*" in notes[0] and "model.qwen2_model.*" in notes[0]


def test_server_says_images_are_not_supported(pair, tmp_path):
    from serve_testing import image_refusal

    msg = image_refusal(pair[2], str(tmp_path), "ocr-tiny")
    assert "images are not supported by the model 'ocr-tiny' (deepseek_ocr2): its vision encoders" in msg


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
    from dynamoe.models.registry import builder_for

    text = {k: v for k, v in TEXT.items() if k != "mlp_layer_types"}
    cfg = dm.ModelConfig.from_dict({"model_type": "deepseek_ocr2", "text_config": text})
    with pytest.raises(ValueError, match="mlp_layer_types"):
        builder_for(cfg)(cfg)
    cfg = dm.ModelConfig.from_dict({"model_type": "deepseek_ocr2", "text_config": {**TEXT, "head_dim": 7}})
    assert cfg.head_dim == 16   # (its config class derives it from the heads, whatever the file says)
    with pytest.raises(ValueError, match="^deepseek_ocr2_text: the base language model"):
        dm.ModelConfig.from_dict({**TEXT, "model_type": "deepseek_ocr2_text"})
