"""Aleph Alpha Kolibri-1 against transformers on tiny random checkpoints: sliding RoPE layers and full NoPE layers,
per-head q/k norms, sandwich norms, sigmoid routing whose selection bias goes on the logits, a shared expert."""
import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_util import ids as _ids

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.afmoe import SandwichDecoderLayer  # noqa: E402
from dynamoe.models.kolibri1 import Kolibri1ForCausalLM  # noqa: E402
from dynamoe.models.moe_block import SparseMoeBlock  # noqa: E402
from dynamoe.ops import cpu_kernels  # noqa: E402
from dynamoe.ops.routing import sigmoid_group_topk  # noqa: E402

WINDOW = 6
SIZES = dict(vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48,
             num_hidden_layers=5, num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8,
             num_experts_per_tok=2, max_position_embeddings=256)
VARIANTS = {
    # layers 0-3 sliding with RoPE, layer 4 full NoPE (the default pattern), no renormalisation
    "plain": dict(sliding_window=WINDOW),
    # a pattern of its own, renormalised weights, another RoPE base
    "pattern": dict(sliding_window=WINDOW, norm_topk_prob=True,
                    layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention",
                                 "sliding_attention"],
                    rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
}
SCALES = {"lm_head": 0.2}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    name = request.param
    torch.manual_seed(0)
    hf = transformers.Kolibri1ForCausalLM(transformers.Kolibri1Config(**SIZES, **VARIANTS[name])).eval()
    randomize_(hf, seed=1, scales=SCALES)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, b in hf.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 1.0)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"kolibri1_{name}"))
    return name, hf, dm.load(path, progress=False), path


def test_structure(pair):
    name, _, ours, _ = pair
    assert type(ours) is Kolibri1ForCausalLM
    layers = ours.model.layers
    attns = [layer.self_attn for layer in layers]
    assert all(type(layer) is SandwichDecoderLayer and type(layer.mlp) is SparseMoeBlock for layer in layers)
    sliding = [True] * 4 + [False] if name == "plain" else [False, True, True, False, True]
    assert ours.config.layer_types == tuple("sliding_attention" if s else "full_attention" for s in sliding)
    assert [a.sliding_window for a in attns] == [WINDOW if s else None for s in sliding]
    assert [a.use_rope for a in attns] == sliding
    for _, block in ours.moe_layers():
        gate = block.moe.config.gates[0]
        assert (gate.type, gate.bias_on_logits, gate.normalize, gate.route_scale) == (
            "sigmoid", True, name == "pattern", 1.0)


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
    """Sanity of the test itself: where the selection bias goes (logits vs scores), the bias itself, the post norms
    and (plain) the window and NoPE each change the logits (so parity above pins them)."""
    import dataclasses

    name, _, ours, _ = pair
    x = _ids()
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

    gates = [b.moe.gates[0] for _, b in ours.moe_layers()]
    cfgs = [g.routing_config for g in gates]
    assert differs(lambda: [setattr(g, "routing_config", dataclasses.replace(c, bias_on_logits=False))
                            for g, c in zip(gates, cfgs)],
                   lambda: [setattr(g, "routing_config", c) for g, c in zip(gates, cfgs)])
    kept = [g.e_score_correction_bias.clone() for g in gates]
    assert differs(lambda: [g.e_score_correction_bias.zero_() for g in gates],
                   lambda: [g.e_score_correction_bias.copy_(k) for g, k in zip(gates, kept)])
    norms = [layer.post_attention_layernorm.weight.detach().clone() for layer in layers]
    assert differs(lambda: [layer.post_attention_layernorm.weight.data.fill_(1.0) for layer in layers],
                   lambda: [layer.post_attention_layernorm.weight.data.copy_(w) for layer, w in zip(layers, norms)])
    windows = [a.sliding_window for a in attns]
    assert differs(lambda: [setattr(a, "sliding_window", None) for a in attns],
                   lambda: [setattr(a, "sliding_window", w) for a, w in zip(attns, windows)])
    full = next(a for a in attns if not a.use_rope)
    assert differs(lambda: setattr(full, "use_rope", True), lambda: setattr(full, "use_rope", False))


def test_bias_on_logits_routing():
    """The routing op: top-k of logits + bias, weighted by the chosen logits' sigmoids."""
    logits = torch.tensor([[2.0, 1.0, 0.0, -1.0]])
    bias = torch.tensor([0.0, 0.0, 1.5, 0.0])
    w, ids, _ = sigmoid_group_topk(logits, 2, bias, renormalize=False, bias_on_logits=True)
    assert ids.tolist() == [[0, 2]]   # 2.0 and 0.0 + 1.5 beat 1.0 (on the scores: 0.88, 0.5 + 1.5 -> [2, 0])
    torch.testing.assert_close(w, torch.sigmoid(torch.tensor([[2.0, 0.0]])))
    w, ids, _ = sigmoid_group_topk(logits, 2, bias, renormalize=False)
    assert ids.tolist() == [[2, 0]]


def test_refusals():
    base = {"model_type": "kolibri1", "vocab_size": 8, "hidden_size": 16, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "moe_intermediate_size": 8,
            "num_experts": 4, "num_experts_per_tok": 1, "layer_types": ["full_attention"] * 2}
    with pytest.raises(ValueError, match="sliding_window"):
        Kolibri1ForCausalLM(dm.ModelConfig.from_dict({**base, "sliding_window": None}))
    with pytest.raises(ValueError, match="shared_expert_intermediate_size"):
        Kolibri1ForCausalLM(dm.ModelConfig.from_dict({**base, "shared_expert_intermediate_size": None}))


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels could not be built here")
def test_kernels_take_attention_and_refuse_the_router_with_reasons(pair):
    name, _, ours, _ = pair
    with torch.no_grad():
        for layer in ours.model.layers:
            fused = layer.self_attn.decode_fused(layer.input_layernorm, torch.float32)
            assert fused.weights is not None, fused.extra     # RoPE'd sliding layers and NoPE full ones alike
            fused = layer.mlp.decode_fused(torch.zeros(1, 64), layer.pre_mlp_layernorm)
            assert fused.weights is None and "logits" in fused.extra


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
