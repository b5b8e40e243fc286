"""Rhymes Aria's text model against transformers on tiny random checkpoints, alone (aria_text) and inside the
vision-language wrapper (aria: text only, the vision tower and projector skipped, images refused by the server):
Llama attention, top-k of the router logits with a softmax over the k, in->out fused experts on disk, shared
experts (with biases when mlp_bias)."""
import logging

import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_util import ids as _ids

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.aria import AriaTextForCausalLM  # noqa: E402
from dynamoe.models.base import DecoderLayer  # noqa: E402
from dynamoe.models.moe_block import SparseMoeBlock  # noqa: E402
from dynamoe.ops import cpu_kernels  # noqa: E402

TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
            num_key_value_heads=2, moe_num_experts=8, moe_topk=2, max_position_embeddings=256, bos_token_id=None,
            eos_token_id=None, pad_token_id=None)
VISION = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, image_size=28,
              patch_size=14)
VARIANTS = {
    # the text model alone: biases on the attention and the shared experts, two shared experts, another RoPE base
    "text": dict(attention_bias=True, mlp_bias=True, moe_num_shared_experts=2,
                 rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
    # inside the wrapper: one shared expert, three of eight experts, the lm_head tied (by the wrapper's flag)
    "wrapped": dict(moe_num_shared_experts=1, moe_topk=3),
}
SCALES = {"lm_head": 0.2}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    name = request.param
    torch.manual_seed(0)
    text = transformers.AriaTextConfig(**{**TEXT, **VARIANTS[name]})
    if name == "text":
        hf = transformers.AriaTextForCausalLM(text).eval()
    else:
        cfg = transformers.AriaConfig(text_config=text.to_dict(), vision_config=VISION, tie_word_embeddings=True,
                                      projector_patch_to_query_dict={4: 2})
        hf = transformers.AriaForConditionalGeneration(cfg).eval()
    randomize_(hf, seed=1, scales=SCALES)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"aria_{name}"))
    return name, hf, dm.load(path, progress=False), path


def test_structure(pair):
    name, _, ours, _ = pair
    assert type(ours) is AriaTextForCausalLM and ours.config.text_config_nested == (name == "wrapped")
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == (name == "wrapped")
    for layer in ours.model.layers:
        assert type(layer) is DecoderLayer and type(layer.mlp) is SparseMoeBlock
        attn, moe = layer.self_attn, layer.mlp.moe
        assert (attn.o_proj.bias is not None) == (name == "text") and attn.q_norm is None
        gate = moe.config.gates[0]
        assert (gate.type, gate.k, gate.normalize) == ("top", 3 if name == "wrapped" else 2, True)
        assert moe.shared_experts.gate_proj.out_features == 32 * (2 if name == "text" else 1)
        assert (moe.shared_experts.down_proj.bias is not None) == (name == "text")
        assert moe.experts.gate_up_proj_bias is None


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
    """Sanity of the test itself: the experts' gate/up columns (read in->out), the shared experts and (text) their
    biases each change the logits (so parity above pins them)."""
    name, _, ours, _ = pair
    x = _ids()
    with torch.no_grad():
        ref = ours(x)
    blocks = [b for _, b in ours.moe_layers()]

    def differs(undo, redo):
        undo()
        try:
            with torch.no_grad():
                return (ours(x) - ref).abs().max().item() > 1e-3
        finally:
            redo()

    w = [b.moe.experts.gate_up_proj for b in blocks]
    kept = [p.detach().clone() for p in w]
    assert differs(lambda: [p.data.copy_(p.data.view(8, 2, 32, 64).flip(1).reshape(8, 64, 64)) for p in w],  # gate <-> up
                   lambda: [p.data.copy_(k) for p, k in zip(w, kept)])
    downs = [b.moe.shared_experts.down_proj.weight for b in blocks]
    kept = [p.detach().clone() for p in downs]
    assert differs(lambda: [p.data.zero_() for p in downs], lambda: [p.data.copy_(k) for p, k in zip(downs, kept)])
    if name == "text":
        biases = [b.moe.shared_experts.up_proj.bias for b in blocks]
        kept = [p.detach().clone() for p in biases]
        assert differs(lambda: [p.data.zero_() for p in biases], lambda: [p.data.copy_(k) for p, k in zip(biases, kept)])


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels could not be built here")
def test_decode_runs_the_fused_kernels(pair):
    ours = pair[2]
    with torch.no_grad():
        for layer in ours.model.layers:
            fused = layer.self_attn.decode_fused(layer.input_layernorm, torch.float32)
            assert fused.weights is not None, fused.extra
            fused = layer.mlp.decode_fused(torch.zeros(1, 64), layer.post_attention_layernorm)
            assert fused.weights is not None, fused.extra


@pytest.mark.parametrize("pair", ["wrapped"], indirect=True)
def test_vision_parts_are_skipped_and_logged(pair, caplog):
    name, *_, path = pair
    with caplog.at_level(logging.INFO, logger="dynamoe.models.loader"):
        dm.load(path, progress=False)
    notes = [r.getMessage() for r in caplog.records if "not loading" in r.getMessage()]
    assert len(notes) == 1 and notes[0].startswith("aria: not loading"), notes
    assert "vision_tower.*" in notes[0] and "multi_modal_projector.*" in notes[0]


def test_config_defaults_as_transformers():
    """An aria config whose text_config gives only the sizes, and an aria_text config: transformers' defaults (its
    own names for the expert count, top-k and shared experts); the wrapper's flag alone ties the lm_head."""
    sizes = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=8)
    t = transformers.AriaTextConfig(**sizes)
    for d in ({"model_type": "aria_text", **sizes}, {"model_type": "aria", "text_config": dict(sizes)}):
        cfg = dm.ModelConfig.from_dict(d)
        assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.n_shared_experts, cfg.intermediate_size) == \
            (t.moe_num_experts, t.moe_topk, t.moe_num_shared_experts, t.intermediate_size)
        assert (cfg.num_key_value_heads, cfg.head_dim, cfg.max_position_embeddings, cfg.rms_norm_eps) == \
            (t.num_key_value_heads, t.head_dim, t.max_position_embeddings, t.rms_norm_eps)
        assert (cfg.rope.theta, cfg.attention_bias, cfg.raw["mlp_bias"], cfg.eos_token_id, cfg.bos_token_id) == \
            (t.rope_parameters["rope_theta"], t.attention_bias, t.mlp_bias, (t.eos_token_id,), t.bos_token_id)
    for outer, inner in ((None, None), (True, None), (None, True), (True, False)):
        d = {"model_type": "aria", "text_config": dict(sizes) if inner is None else
             {**sizes, "tie_word_embeddings": inner}}
        if outer is not None:
            d["tie_word_embeddings"] = outer
        hf = transformers.AriaConfig.from_dict({k: v for k, v in d.items() if k != "model_type"})
        assert dm.ModelConfig.from_dict(d).tie_word_embeddings is hf.tie_word_embeddings, (outer, inner)


@pytest.mark.parametrize("pair", ["wrapped"], indirect=True)
def test_server_says_images_are_not_supported(pair, tmp_path):
    from serve_testing import image_refusal

    msg = image_refusal(pair[2], str(tmp_path), "aria-tiny")
    assert "images are not supported by the model 'aria-tiny' (aria): its vision tower is not loaded" in msg


def test_engine_generation_matches_generate(pair):
    """The serving engine (continuous batching, chunked prefill) gives transformers' greedy tokens per prompt."""
    from dynamoe.engine import GenerationEngine, SamplingParams

    hf, ours = pair[1], pair[2]
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (6, 19)]
    engine = GenerationEngine(ours, None, max_seq_len=48, max_batch=2, prefill_chunk=8)
    reqs = [engine.add_request(p, SamplingParams(temperature=0), 10, ignore_eos=True) for p in prompts]
    engine.run_until_done()
    for p, r in zip(prompts, reqs):
        want = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=10, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert r.output_ids == want
