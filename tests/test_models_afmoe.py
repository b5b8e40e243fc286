"""Arcee AFMoE (Trinity) against transformers on tiny random checkpoints: sliding layers with RoPE and full NoPE
layers (every global_attn_every_n_layers-th), per-head q/k norms, an elementwise sigmoid gate on the attention
output, sandwich norms around both sublayers, a dense first layer, sigmoid routing with a selection-only expert
bias, a route scale and shared experts; muP's embedding scale."""
import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_util import ids as _ids

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.afmoe import AfmoeAttention, AfmoeForCausalLM, SandwichDecoderLayer  # noqa: E402
from dynamoe.models.moe_block import GatedMLP, SparseMoeBlock  # noqa: E402
from dynamoe.ops import cpu_kernels  # noqa: E402

WINDOW = 6
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
             sliding_window=WINDOW, global_attn_every_n_layers=2, max_position_embeddings=256)
VARIANTS = {
    "plain": dict(),
    # two dense layers, one shared expert, weights scaled by 2.5, muP's embedding scale, another RoPE base
    "mup": dict(num_dense_layers=2, num_shared_experts=1, route_scale=2.5, mup_enabled=True,
                rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
}
SCALES = {"lm_head": 0.1}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    name = request.param
    torch.manual_seed(0)
    hf = transformers.AfmoeForCausalLM(transformers.AfmoeConfig(**SIZES, **VARIANTS[name])).eval()
    randomize_(hf, seed=1, scales={**SCALES, "embed_tokens": 0.02 if name == "mup" else 0.2})
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("expert_bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"afmoe_{name}"))
    return name, hf, dm.load(path, progress=False), path


def test_structure(pair):
    name, _, ours, _ = pair
    assert type(ours) is AfmoeForCausalLM
    assert ours.config.layer_types == ("sliding_attention", "full_attention") * 2
    layers = ours.model.layers
    assert all(type(layer) is SandwichDecoderLayer and type(layer.self_attn) is AfmoeAttention for layer in layers)
    assert [layer.self_attn.use_rope for layer in layers] == [True, False, True, False]
    assert [layer.self_attn.sliding_window for layer in layers] == [WINDOW, None, WINDOW, None]
    dense = 2 if name == "mup" else 1
    assert [type(layer.mlp) for layer in layers] == [GatedMLP] * dense + [SparseMoeBlock] * (4 - dense)
    for _, block in ours.moe_layers():
        gate = block.moe.config.gates[0]
        assert (gate.type, gate.normalize, gate.n_group) == ("sigmoid", True, 1)
        assert gate.route_scale == (2.5 if name == "mup" else 1.0)
        assert block.moe.shared_experts.gate_proj.out_features == 32 * (1 if name == "mup" else 2)
    assert getattr(ours.model.embed_tokens, "multiplier", 1.0) == (8.0 if name == "mup" else 1.0)


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
    """Sanity of the test itself: the window, the output gate, the post norms and the selection bias each change the
    logits (so parity above pins them)."""
    _, _, ours, _ = pair
    x = _ids()
    with torch.no_grad():
        ref = ours(x)
    layers = ours.model.layers

    def differs(undo, redo):
        undo()
        try:
            with torch.no_grad():
                return (ours(x) - ref).abs().max().item() > 1e-3
        finally:
            redo()

    attns = [layer.self_attn for layer in layers]
    assert differs(lambda: [setattr(a, "sliding_window", None) for a in attns],
                   lambda: [setattr(a, "sliding_window", WINDOW if a.use_rope else None) for a in attns])
    saved = [a.gate_proj.weight.detach().clone() for a in attns]
    assert differs(lambda: [a.gate_proj.weight.data.zero_() for a in attns],  # sigmoid(0) = 1/2 everywhere
                   lambda: [a.gate_proj.weight.data.copy_(w) for a, w in zip(attns, saved)])
    norms = [layer.post_mlp_layernorm.weight.detach().clone() for layer in layers]
    assert differs(lambda: [layer.post_mlp_layernorm.weight.data.fill_(1.0) for layer in layers],
                   lambda: [layer.post_mlp_layernorm.weight.data.copy_(w) for layer, w in zip(layers, norms)])
    biases = [b.moe.gates[0].e_score_correction_bias for _, b in ours.moe_layers()]
    kept = [b.clone() for b in biases]
    assert differs(lambda: [b.zero_() for b in biases], lambda: [b.copy_(k) for b, k in zip(biases, kept)])


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels could not be built here")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_attention_kernel_equals_op_by_op(pair, dtype):
    """The attention block alone through the fused kernel (sigmoid gate per channel; RoPE on the sliding layers, none
    on the NoPE ones, which have no rotary embedding) equals the op-by-op block, rows at different positions; the
    decode plan runs the sandwich layers as modules and says why."""
    ours = dm.load(pair[3], dtype=dtype, progress=False)
    g = torch.Generator().manual_seed(3)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    slots, start = torch.tensor([1, 0]), torch.tensor([0, 3])
    D = ours.config.hidden_size
    for layer in ours.model.layers:
        attn, norm = layer.self_attn, layer.input_layernorm
        fast_cache, slow_cache = ours.new_cache(2, 40), ours.new_cache(2, 40)
        with torch.no_grad():
            for step in range(10):
                h = torch.randn(2, 1, D, generator=g).to(dtype)
                positions = (start + step)[:, None]
                for c in (fast_cache, slow_cache):
                    for s, p in zip(slots.tolist(), positions[:, 0].tolist()):
                        c.reserve(s, p + 1)
                fast = attn.decode_step(h, norm, positions, fast_cache, slots)
                slow = h + attn(norm(h), positions, slow_cache, slots, int(positions.max()) + 1)
                assert fast is not None, attn.decode_fused(norm, dtype).extra
                torch.testing.assert_close(fast.float(), slow.float(), atol=tol * slow.abs().max().item(), rtol=tol)
    assert {a.self_attn.use_rope for a in ours.model.layers} == {True, False}  # both kinds were checked
    cache = ours.new_cache(1, 8)
    with torch.no_grad():
        ours(torch.tensor([[1, 2]]), cache=cache, slots=torch.tensor([0]))
        ours(torch.tensor([[3]]), cache=cache, slots=torch.tensor([0]))
    assert "SandwichDecoderLayer has its own forward" in ours.__dict__["_plan"][2].describe()


def test_refusals():
    base = {"model_type": "afmoe", "vocab_size": 8, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
            "head_dim": 8, "moe_intermediate_size": 8, "num_experts": 4, "num_experts_per_tok": 1}
    with pytest.raises(ValueError, match="mup_enabled"):
        AfmoeForCausalLM(dm.ModelConfig.from_dict({**base, "mup_enabled": "yes"}))
    with pytest.raises(ValueError, match="global_attn_every_n_layers"):
        dm.ModelConfig.from_dict({**base, "global_attn_every_n_layers": 0})


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
