"""Tencent Hy3 against transformers on tiny random checkpoints: per-head q/k norms, a dense first layer, fp32
sigmoid routing with a selection-only bias, always renormalised and scaled by router_scaling_factor, a shared MLP
(biases on the dense and shared MLPs with mlp_bias; as wide as the dense MLP when there are no shared experts)."""
import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_util import ids as _ids

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.base import DecoderLayer  # noqa: E402
from dynamoe.models.hy_v3 import HYV3ForCausalLM  # noqa: E402
from dynamoe.models.moe_block import GatedMLP, SparseMoeBlock  # noqa: E402
from dynamoe.ops import cpu_kernels  # noqa: E402

SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
             max_position_embeddings=256)
VARIANTS = {
    "plain": dict(),
    # biases everywhere but the routed experts, two shared experts, another scale and RoPE base, two dense layers
    "biased": dict(attention_bias=True, mlp_bias=True, num_shared_experts=2, router_scaling_factor=1.5,
                   mlp_layer_types=["dense", "sparse", "dense"],
                   rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
    # no shared experts: transformers' shared MLP is then intermediate_size wide
    "noshared": dict(num_shared_experts=0, enable_moe_fp32_combine=False),
}
SCALES = {"lm_head": 0.2}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    name = request.param
    torch.manual_seed(0)
    hf = transformers.HYV3ForCausalLM(transformers.HYV3Config(**SIZES, **VARIANTS[name])).eval()
    randomize_(hf, seed=1, scales=SCALES)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, b in hf.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"hy_v3_{name}"))
    return name, hf, dm.load(path, progress=False), path


def test_structure(pair):
    name, _, ours, _ = pair
    assert type(ours) is HYV3ForCausalLM
    layers = ours.model.layers
    assert all(type(layer) is DecoderLayer and layer.self_attn.q_norm is not None for layer in layers)
    dense = [0, 2] if name == "biased" else [0]
    assert [type(layer.mlp) for layer in layers] == [GatedMLP if i in dense else SparseMoeBlock for i in range(3)]
    for i, layer in enumerate(layers):
        assert (layer.self_attn.o_proj.bias is not None) == (name == "biased")
        if i in dense:
            assert (layer.mlp.gate_proj.bias is not None) == (name == "biased")
            continue
        gate, shared = layer.mlp.moe.config.gates[0], layer.mlp.moe.shared_experts
        assert (gate.type, gate.normalize, gate.n_group, gate.route_scale) == (
            "sigmoid", True, 1, 1.5 if name == "biased" else 2.826)
        assert shared.gate_proj.out_features == {"plain": 32, "biased": 64, "noshared": 96}[name]
        assert (shared.down_proj.bias is not None) == (name == "biased")
        assert layer.mlp.moe.experts.gate_up_proj_bias is None


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
    """Sanity of the test itself: the selection bias, the route scale, the q/k norms and (biased) the shared MLP's
    biases each change the logits (so parity above pins them)."""
    import dataclasses

    name, _, ours, _ = pair
    x = _ids()
    with torch.no_grad():
        ref = ours(x)

    def differs(undo, redo):
        undo()
        try:
            with torch.no_grad():
                return (ours(x) - ref).abs().max().item() > 1e-3
        finally:
            redo()

    blocks = [b for _, b in ours.moe_layers()]
    gates = [b.moe.gates[0] for b in blocks]
    kept = [g.e_score_correction_bias.clone() for g in gates]
    assert differs(lambda: [g.e_score_correction_bias.zero_() for g in gates],
                   lambda: [g.e_score_correction_bias.copy_(k) for g, k in zip(gates, kept)])
    cfgs = [g.routing_config for g in gates]
    assert differs(lambda: [setattr(g, "routing_config", dataclasses.replace(c, route_scale=1.0))
                            for g, c in zip(gates, cfgs)],
                   lambda: [setattr(g, "routing_config", c) for g, c in zip(gates, cfgs)])
    attns = [layer.self_attn for layer in ours.model.layers]
    norms = [a.q_norm.weight.detach().clone() for a in attns]
    assert differs(lambda: [a.q_norm.weight.data.fill_(1.0) for a in attns],
                   lambda: [a.q_norm.weight.data.copy_(w) for a, w in zip(attns, norms)])
    if name == "biased":
        downs = [b.moe.shared_experts.down_proj for b in blocks]
        kept = [d.bias.detach().clone() for d in downs]
        assert differs(lambda: [d.bias.data.zero_() for d in downs],
                       lambda: [d.bias.data.copy_(k) for d, k in zip(downs, kept)])


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels could not be built here")
def test_decode_runs_the_fused_kernels(pair):
    """Plain decoder layers: the attention and MoE blocks (shared MLP with biases included) take the fused kernels."""
    ours = pair[2]
    with torch.no_grad():
        for layer in ours.model.layers:
            fused = layer.self_attn.decode_fused(layer.input_layernorm, torch.float32)
            assert fused.weights is not None, fused.extra
            fused = layer.mlp.decode_fused(torch.zeros(1, 64), layer.post_attention_layernorm)
            assert fused.weights is not None, fused.extra


def test_refusals():
    base = {"model_type": "hy_v3", "vocab_size": 8, "hidden_size": 16, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "moe_intermediate_size": 8,
            "intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 1}
    with pytest.raises(ValueError, match="mlp_bias"):
        HYV3ForCausalLM(dm.ModelConfig.from_dict({**base, "mlp_bias": 1}))
    with pytest.raises(ValueError, match="intermediate_size"):
        HYV3ForCausalLM(dm.ModelConfig.from_dict({**base, "intermediate_size": None}))


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
