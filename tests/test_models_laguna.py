"""Laguna against transformers on tiny random checkpoints: full and sliding layers with a RoPE each (partial on the
full ones), a query-head count per layer, per-head q/k norms, a softplus output gate per head or per channel, a dense
first layer, sigmoid routing with a selection-only bias (optionally on softcapped logits), a routed scale and an
ungated shared expert."""
import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_util import ids as _ids

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.laguna import LagunaAttention, LagunaForCausalLM, SoftcappedLinearGate  # noqa: E402
from dynamoe.models.moe_block import GatedMLP, SparseMoeBlock  # noqa: E402
from dynamoe.ops import cpu_kernels  # noqa: E402

WINDOW = 6
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
             shared_expert_intermediate_size=48, num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, num_experts=8, num_experts_per_tok=2, sliding_window=WINDOW, max_position_embeddings=256)
VARIANTS = {
    # every layer full attention (the default), the default RoPEs (base 5e5 on half of each head)
    "plain": dict(),
    # sliding / full layers, 2 or 4 query heads, gates per channel, softcapped logits, routed scale 2, other RoPEs
    "mixed": dict(layer_types=["sliding_attention", "full_attention"] * 2, num_attention_heads_per_layer=[2, 4, 4, 2],
                  gating="per-element", moe_router_logit_softcapping=1.5, moe_routed_scaling_factor=2.0,
                  attention_bias=True,
                  rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4,
                                                      "partial_rotary_factor": 0.25},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}}),
}
SCALES = {"lm_head": 0.2}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    name = request.param
    torch.manual_seed(0)
    hf = transformers.LagunaForCausalLM(transformers.LagunaConfig(**SIZES, **VARIANTS[name])).eval()
    randomize_(hf, seed=1, scales=SCALES)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("e_score_correction_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"laguna_{name}"))
    return name, hf, dm.load(path, progress=False), path


def test_structure(pair):
    name, _, ours, _ = pair
    assert type(ours) is LagunaForCausalLM
    layers = ours.model.layers
    attns = [layer.self_attn for layer in layers]
    assert all(type(a) is LagunaAttention for a in attns)
    assert [type(layer.mlp) for layer in layers] == [GatedMLP] + [SparseMoeBlock] * 3
    if name == "plain":
        assert ours.config.layer_types == ("full_attention",) * 4
        assert [a.sliding_window for a in attns] == [None] * 4 and [a.num_heads for a in attns] == [4] * 4
        assert all(a.gate_per_head and a.g_proj.out_features == 4 for a in attns)
        assert attns[0].rotary.inv_freq.numel() == 4   # half of 16 dims rotate
        assert all(type(b.moe.gates[0]) is not SoftcappedLinearGate for _, b in ours.moe_layers())
    else:
        assert [a.sliding_window for a in attns] == [WINDOW, None] * 2 and [a.num_heads for a in attns] == [2, 4, 4, 2]
        assert not any(a.gate_per_head for a in attns) and attns[0].g_proj.out_features == 2 * 16
        assert [a.rotary.inv_freq.numel() for a in attns[:2]] == [8, 2]
        assert all(b.moe.gates[0].softcap == 1.5 for _, b in ours.moe_layers())
    for _, block in ours.moe_layers():
        gate = block.moe.config.gates[0]
        assert (gate.type, gate.normalize, gate.route_scale) == ("sigmoid", True, 2.0 if name == "mixed" else 1.0)
        assert block.moe.shared_experts.gate_proj.out_features == 48 and block.moe.shared_experts.gate is None


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
    """Sanity of the test itself: the output gate, the selection bias, the RoPE of each kind, and (mixed) the window
    and the softcap each change the logits (so parity above pins them)."""
    name, _, ours, _ = pair
    x = _ids()
    with torch.no_grad():
        ref = ours(x)
    attns = [layer.self_attn for layer in ours.model.layers]

    def differs(undo, redo):
        undo()
        try:
            with torch.no_grad():
                return (ours(x) - ref).abs().max().item() > 1e-3
        finally:
            redo()

    saved = [a.g_proj.weight.detach().clone() for a in attns]
    assert differs(lambda: [a.g_proj.weight.data.zero_() for a in attns],   # softplus(0) = ln 2 everywhere
                   lambda: [a.g_proj.weight.data.copy_(w) for a, w in zip(attns, saved)])
    gates = [b.moe.gates[0] for _, b in ours.moe_layers()]
    kept = [g.e_score_correction_bias.clone() for g in gates]
    assert differs(lambda: [g.e_score_correction_bias.zero_() for g in gates],
                   lambda: [g.e_score_correction_bias.copy_(k) for g, k in zip(gates, kept)])
    tables = ours.model.rotary_emb.tables
    for kind in set(ours.config.layer_types):
        inv = tables[kind].inv_freq.clone()
        assert differs(lambda: tables[kind].inv_freq.mul_(0.5), lambda: tables[kind].inv_freq.copy_(inv))
    if name == "mixed":
        assert differs(lambda: [setattr(a, "sliding_window", None) for a in attns],
                       lambda: [setattr(a, "sliding_window", WINDOW if i % 2 == 0 else None) for i, a in enumerate(attns)])
        assert differs(lambda: [setattr(g, "softcap", 1e6) for g in gates], lambda: [setattr(g, "softcap", 1.5) for g in gates])


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels could not be built here")
def test_kernels_apply_or_refuse_with_reasons(pair):
    """The attention kernel takes every layer (its softplus gate per head or per channel); the MoE kernel refuses
    softcapped router logits only."""
    name, _, ours, _ = pair
    with torch.no_grad():
        for layer in ours.model.layers:
            fused = layer.self_attn.decode_fused(layer.input_layernorm, torch.float32)
            assert fused.weights is not None, fused.extra
            assert fused.weights.gate_kind == fused.extra.GateKind.softplus
            assert fused.weights.gate_per_head == (name == "plain")
            fused = layer.mlp.decode_fused(torch.zeros(1, 64), layer.post_attention_layernorm)
            softcapped = isinstance(layer.mlp, SparseMoeBlock) and name == "mixed"
            assert (fused.weights is None) == softcapped, fused.extra


def test_refusals():
    base = {"model_type": "laguna", "vocab_size": 8, "hidden_size": 16, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "moe_intermediate_size": 8,
            "intermediate_size": 16, "num_experts": 4, "num_experts_per_tok": 1}
    for extra, field in (({"gating": "per-token"}, "gating"), ({"moe_apply_router_weight_on_input": True},
                                                               "moe_apply_router_weight_on_input"),
                         ({"num_attention_heads_per_layer": [2, 3]}, "num_attention_heads_per_layer"),
                         ({"num_attention_heads_per_layer": [2]}, "num_attention_heads_per_layer"),
                         ({"moe_router_logit_softcapping": -1}, "moe_router_logit_softcapping")):
        with pytest.raises(ValueError, match=field):
            LagunaForCausalLM(dm.ModelConfig.from_dict({**base, **extra}))
    with pytest.raises(ValueError, match="rope_parameters"):   # one RoPE for all kinds: transformers reads none
        dm.ModelConfig.from_dict({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})


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
