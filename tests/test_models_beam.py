"""Reflection Beam against transformers on tiny random checkpoints: sliding RoPE layers and full NoPE layers with the
scalable-softmax query scale, per-head q/k norms, a sigmoid output gate with per-head biases, sandwich norms with
depth-scaled residual adds, dense first layers, DeepSeek-V3 routing (groups, selection bias, scale) without shared
experts, softcapped logits."""
import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_util import ids as _ids

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.beam import BeamAttention, BeamForCausalLM, DepthScaledSandwichLayer  # noqa: E402
from dynamoe.models.moe_block import GatedMLP, SparseMoeBlock  # noqa: E402
from dynamoe.ops import cpu_kernels  # noqa: E402

WINDOW = 6
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=7,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
             n_group=4, topk_group=2, sliding_window=WINDOW, max_position_embeddings=256)
VARIANTS = {
    # layers 5 and 6 full NoPE, the others sliding; 3 dense layers; softcap 30
    "plain": dict(),
    # RoPE on the full layers too (their own base), one dense layer, no renormalisation, a strong softcap, biases
    "roped": dict(mlp_layer_types=["dense"] + ["sparse"] * 6, norm_topk_prob=False, final_logit_softcapping=2.0,
                  attention_bias=True, routed_scaling_factor=1.0,
                  rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": 500.0},
                                   "full_attention": {"rope_type": "default", "rope_theta": 1e4}}),
}
SCALES = {"lm_head": 0.3, "gate_bias": 1.0}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    name = request.param
    torch.manual_seed(0)
    hf = transformers.BeamForCausalLM(transformers.BeamConfig(**SIZES, **VARIANTS[name])).eval()
    randomize_(hf, seed=1, scales=SCALES)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, b in hf.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"beam_{name}"))
    return name, hf, dm.load(path, progress=False), path


def test_structure(pair):
    name, _, ours, _ = pair
    assert type(ours) is BeamForCausalLM
    layers = ours.model.layers
    attns = [layer.self_attn for layer in layers]
    assert all(type(layer) is DepthScaledSandwichLayer and type(a) is BeamAttention for layer, a in zip(layers, attns))
    assert ours.config.layer_types == ("sliding_attention",) * 5 + ("full_attention",) * 2
    assert [a.sliding_window for a in attns] == [WINDOW] * 5 + [None] * 2
    assert [a.use_rope for a in attns] == [True] * 5 + [name == "roped"] * 2
    dense = 1 if name == "roped" else 3
    assert [type(layer.mlp) for layer in layers] == [GatedMLP] * dense + [SparseMoeBlock] * (7 - dense)
    assert [layer.attn_add for layer in layers] == [2, 4, 6, 8, 10, 12, 14]
    for _, block in ours.moe_layers():
        gate = block.moe.config.gates[0]
        assert (gate.type, gate.n_group, gate.topk_group, gate.normalize, gate.route_scale) == (
            "sigmoid", 4, 2, name == "plain", 2.5 if name == "plain" else 1.0)
        assert block.moe.shared_experts is None
    assert ours.lm_head.softcap == (2.0 if name == "roped" else 30.0)


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
    """Sanity of the test itself: the gate and its biases, the depth-scaled adds, the NoPE query scale, the softcap
    and the selection bias each change the logits (so parity above pins them)."""
    import dynamoe.models.beam as beam

    name, _, ours, _ = pair
    x = _ids(tokens=40)
    with torch.no_grad():
        ref = ours(x)
    layers = ours.model.layers
    attns = [layer.self_attn for layer in layers]

    def differs(undo, redo):
        undo()
        try:
            with torch.no_grad():
                return (ours(x) - ref).abs().max().item() > 1e-3
        finally:
            redo()

    biases = [a.gate_bias.detach().clone() for a in attns]
    assert differs(lambda: [a.gate_bias.data.zero_() for a in attns],
                   lambda: [a.gate_bias.data.copy_(b) for a, b in zip(attns, biases)])
    adds = [layer.attn_add for layer in layers]
    assert differs(lambda: [setattr(layer, "attn_add", 2) for layer in layers],
                   lambda: [setattr(layer, "attn_add", n) for layer, n in zip(layers, adds)])
    cap = ours.lm_head.softcap
    assert differs(lambda: setattr(ours.lm_head, "softcap", 1e4), lambda: setattr(ours.lm_head, "softcap", cap))
    gates = [b.moe.gates[0] for _, b in ours.moe_layers()]
    kept = [g.e_score_correction_bias.clone() for g in gates]
    assert differs(lambda: [g.e_score_correction_bias.zero_() for g in gates],
                   lambda: [g.e_score_correction_bias.copy_(k) for g, k in zip(gates, kept)])
    if name == "plain":
        scale = beam.nope_query_scale
        assert differs(lambda: setattr(beam, "nope_query_scale", lambda p: torch.ones(p.shape)[:, None, :, None]),
                       lambda: setattr(beam, "nope_query_scale", scale))


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels could not be built here")
def test_attention_kernel_refuses_with_reason(pair):
    layer = pair[2].model.layers[0]
    fused = layer.self_attn.decode_fused(layer.input_layernorm, torch.float32)
    assert fused.weights is None and "gate" in fused.extra


def test_refusals():
    base = {"model_type": "beam", "vocab_size": 8, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 2, "head_dim": 8, "moe_intermediate_size": 8, "intermediate_size": 16,
            "num_experts": 4, "num_experts_per_tok": 1, "n_group": 1, "topk_group": 1}
    with pytest.raises(ValueError, match="final_logit_softcapping"):
        BeamForCausalLM(dm.ModelConfig.from_dict({**base, "final_logit_softcapping": -1}))
    with pytest.raises(ValueError, match="rope_parameters"):   # a kind of layer_types without an entry
        dm.ModelConfig.from_dict({**base, "rope_parameters": {"sliding_attention": None}})
    cfg = dm.ModelConfig.from_dict({**base, "final_logit_softcapping": None})
    assert type(BeamForCausalLM(cfg).lm_head) is torch.nn.Linear


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
