"""Upstage Solar-Open against transformers on tiny random checkpoints: Llama attention (q/k/v biases, none on
o_proj), DeepSeek-style sigmoid routing on every layer with a selection-only bias, group-limited top-k, a route
scale and shared experts; a hub config's GLM-only fields (dense layers, q/k norm) are not read."""
import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_util import ids as _ids

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.attention import Attention  # noqa: E402
from dynamoe.models.base import DecoderLayer  # noqa: E402
from dynamoe.models.moe_block import SparseMoeBlock  # noqa: E402
from dynamoe.models.solar_open import SolarOpenForCausalLM  # noqa: E402
from dynamoe.ops import cpu_kernels  # noqa: E402

SIZES = dict(vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, n_routed_experts=8, num_experts_per_tok=2, max_position_embeddings=256)
VARIANTS = {
    "plain": dict(),
    # q/k/v biases, 4 groups of which 2 are kept, no renormalisation, scale 2.5, two shared experts, another base
    "grouped": dict(attention_bias=True, n_group=4, topk_group=2, norm_topk_prob=False, routed_scaling_factor=2.5,
                    n_shared_experts=2, rope_parameters={"rope_type": "default", "rope_theta": 1e4}),
}
SCALES = {"lm_head": 0.2}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    name = request.param
    torch.manual_seed(0)
    hf = transformers.SolarOpenForCausalLM(transformers.SolarOpenConfig(**SIZES, **VARIANTS[name])).eval()
    randomize_(hf, seed=1, scales=SCALES)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, b in hf.named_buffers():
            if n.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"solar_open_{name}"))
    return name, hf, dm.load(path, progress=False), path


def test_structure(pair):
    name, _, ours, _ = pair
    assert type(ours) is SolarOpenForCausalLM
    for layer in ours.model.layers:
        assert type(layer) is DecoderLayer and type(layer.self_attn) is Attention
        attn = layer.self_attn
        assert attn.q_norm is None and attn.o_proj.bias is None and (attn.q_proj.bias is not None) == (name == "grouped")
        assert type(layer.mlp) is SparseMoeBlock
        gate = layer.mlp.moe.config.gates[0]
        want = (4, 2, False, 2.5) if name == "grouped" else (1, 1, True, 1.0)
        assert (gate.type, gate.n_group, gate.topk_group, gate.normalize, gate.route_scale) == ("sigmoid", *want)
    assert ours.model.rotary_emb.inv_freq.numel() == 8   # (the whole head of 16)
    assert ours.config.rope.theta == (1e4 if name == "grouped" else 1e6)


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
    """Sanity of the test itself: the selection bias, the groups, the route scale and the q/k/v biases each change
    the logits (so parity above pins them)."""
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

    gates = [b.moe.gates[0] for _, b in ours.moe_layers()]
    kept = [g.e_score_correction_bias.clone() for g in gates]
    assert differs(lambda: [g.e_score_correction_bias.zero_() for g in gates],
                   lambda: [g.e_score_correction_bias.copy_(k) for g, k in zip(gates, kept)])
    if name == "grouped":
        import dataclasses

        cfgs = [g.routing_config for g in gates]
        assert differs(lambda: [setattr(g, "routing_config", dataclasses.replace(c, n_group=1, topk_group=1))
                                for g, c in zip(gates, cfgs)],
                       lambda: [setattr(g, "routing_config", c) for g, c in zip(gates, cfgs)])
        assert differs(lambda: [setattr(g, "routing_config", dataclasses.replace(c, route_scale=1.0))
                                for g, c in zip(gates, cfgs)],
                       lambda: [setattr(g, "routing_config", c) for g, c in zip(gates, cfgs)])
        attns = [layer.self_attn for layer in ours.model.layers]
        biases = [a.k_proj.bias.detach().clone() for a in attns]
        assert differs(lambda: [a.k_proj.bias.data.zero_() for a in attns],
                       lambda: [a.k_proj.bias.data.copy_(b) for a, b in zip(attns, biases)])


def test_hub_fields_solar_does_not_read():
    """GLM-4.5's fields in a Solar config.json (a dense first layer, q/k norms, MTP) are not read: transformers'
    Solar model has none of them, and neither does the model dynamoe builds."""
    cfg = {"model_type": "solar_open", "vocab_size": 8, "hidden_size": 16, "num_hidden_layers": 2,
           "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "moe_intermediate_size": 8,
           "n_routed_experts": 4, "num_experts_per_tok": 1, "first_k_dense_replace": 1, "use_qk_norm": True,
           "intermediate_size": 96, "num_nextn_predict_layers": 1}
    ours = SolarOpenForCausalLM(dm.ModelConfig.from_dict(cfg))
    assert all(type(layer.mlp) is SparseMoeBlock and layer.self_attn.q_norm is None for layer in ours.model.layers)


def test_refusals():
    base = {"model_type": "solar_open", "vocab_size": 8, "hidden_size": 16, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "moe_intermediate_size": 8,
            "n_routed_experts": 4, "num_experts_per_tok": 1}
    with pytest.raises(ValueError, match="partial_rotary_factor"):   # (transformers' Llama attention fails on it)
        SolarOpenForCausalLM(dm.ModelConfig.from_dict({**base, "partial_rotary_factor": 0.5}))


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels could not be built here")
def test_decode_runs_the_fused_kernels(pair):
    """Plain GQA layers: the attention and MoE blocks take the fused decode kernels."""
    layer = pair[2].model.layers[0]
    h = torch.zeros(1, 64)
    assert layer.self_attn.decode_fused(layer.input_layernorm, torch.float32).weights is not None
    with torch.no_grad():
        assert layer.mlp.decode_fused(h, layer.post_attention_layernorm).weights is not None


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
