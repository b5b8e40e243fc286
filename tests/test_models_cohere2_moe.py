"""Cohere2-MoE (Command A MoE) against transformers on tiny random checkpoints: parallel layers (one norm, one
residual), sliding layers with interleaved RoPE and full NoPE layers, a dense prefix of its own width (rotating
when its pattern is 1), softmax-over-top-k or sigmoid routing, shared experts averaged with (or added to) the
routed ones, LayerNorms or RMSNorms, logit_scale."""
import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_util import ids as _ids

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.cohere2_moe import Cohere2MoeForCausalLM, ParallelDecoderLayer  # noqa: E402
from dynamoe.models.moe_block import GatedMLP, SparseMoeBlock  # noqa: E402
from dynamoe.models.norms import LayerNorm, RMSNorm  # noqa: E402
from dynamoe.ops import cpu_kernels  # noqa: E402

WINDOW = 6
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2, sliding_window=WINDOW,
             sliding_window_pattern=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
             pad_token_id=None)
VARIANTS = {
    # LayerNorms, softmax routing, one dense prefix layer (full attention with RoPE), averaged shared expert
    "plain": dict(first_k_dense_replace=1, prefix_dense_intermediate_size=96, num_shared_experts=1),
    # RMSNorms, sigmoid routing without renormalisation, summed shared experts, a dense prefix of the sliding
    # pattern (layer 0 sliding, layer 1 full NoPE), another logit scale and RoPE base, untied lm_head
    "sigmoid": dict(rms_norm_eps=1e-6, expert_selection_fn="sigmoid", norm_topk_prob=False, num_shared_experts=2,
                    shared_expert_combination_strategy="sum", first_k_dense_replace=2,
                    prefix_dense_sliding_window_pattern=2, logit_scale=0.25, tie_word_embeddings=False,
                    rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
}
SCALES = {"lm_head": 0.5, "embed_tokens": 1.0}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    name = request.param
    torch.manual_seed(0)
    hf = transformers.Cohere2MoeForCausalLM(transformers.Cohere2MoeConfig(**SIZES, **VARIANTS[name])).eval()
    randomize_(hf, seed=1, scales=SCALES)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"cohere2_moe_{name}"))
    return name, hf, dm.load(path, progress=False), path


def test_structure(pair):
    name, hf, ours, _ = pair
    assert type(ours) is Cohere2MoeForCausalLM
    layers = ours.model.layers
    assert all(type(layer) is ParallelDecoderLayer for layer in layers)
    assert ours.config.layer_types == tuple(hf.config.layer_types)
    if name == "plain":
        assert ours.config.layer_types == ("full_attention", "sliding_attention", "full_attention", "sliding_attention")
        assert [layer.self_attn.use_rope for layer in layers] == [True, True, False, True]
        assert [type(layer.mlp) for layer in layers] == [GatedMLP] + [SparseMoeBlock] * 3
        assert layers[0].mlp.gate_proj.out_features == 96
        assert type(ours.model.norm) is LayerNorm and ours.lm_head.weight is ours.model.embed_tokens.weight
        assert [layer.mlp_scale for layer in layers] == [1.0, 0.5, 0.5, 0.5]
    else:
        assert ours.config.layer_types == ("sliding_attention", "full_attention") * 2
        assert [layer.self_attn.use_rope for layer in layers] == [True, False, True, False]
        assert [type(layer.mlp) for layer in layers] == [GatedMLP] * 2 + [SparseMoeBlock] * 2
        assert type(ours.model.norm) is RMSNorm and ours.lm_head.weight is not ours.model.embed_tokens.weight
        assert [layer.mlp_scale for layer in layers] == [1.0] * 4
        for _, block in ours.moe_layers():
            gate = block.moe.config.gates[0]
            assert (gate.type, gate.normalize) == ("sigmoid", False)
            assert block.moe.shared_experts.gate_proj.out_features == 64
    assert [layer.self_attn.sliding_window for layer in layers] == [
        WINDOW if t == "sliding_attention" else None for t in ours.config.layer_types]
    assert all(layer.self_attn.rope_interleaved for layer in layers)
    assert ours.lm_head.multiplier == (0.25 if name == "sigmoid" else 0.0625)


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
    """Sanity of the test itself: the window, RoPE on the dense prefix, the parallel residual (vs sequential),
    the shared experts' combination and the logit scale each change the logits (so parity above pins them)."""
    name, _, ours, _ = pair
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
    windows = [a.sliding_window for a in attns]
    assert differs(lambda: [setattr(a, "sliding_window", None) for a in attns],
                   lambda: [setattr(a, "sliding_window", w) for a, w in zip(attns, windows)])
    a0 = attns[0]
    assert differs(lambda: setattr(a0, "use_rope", not a0.use_rope), lambda: setattr(a0, "use_rope", not a0.use_rope))
    assert differs(lambda: setattr(a0, "rope_interleaved", False), lambda: setattr(a0, "rope_interleaved", True))
    moe = [layer for layer in layers if isinstance(layer.mlp, SparseMoeBlock)]
    scales = [layer.mlp_scale for layer in moe]   # average <-> sum
    assert differs(lambda: [setattr(layer, "mlp_scale", 1.5 - s) for layer, s in zip(moe, scales)],
                   lambda: [setattr(layer, "mlp_scale", s) for layer, s in zip(moe, scales)])
    m = ours.lm_head.multiplier
    assert differs(lambda: setattr(ours.lm_head, "multiplier", 1.0), lambda: setattr(ours.lm_head, "multiplier", m))

    class Sequential(ParallelDecoderLayer):  # h += attn(norm(h)); h += mlp(norm(h)) with the one norm
        def forward(self, h, positions, cache=None, slots=None, kv_len=None):
            h = h + self.self_attn(self.input_layernorm(h), positions, cache, slots, kv_len)
            return h + self.mlp_scale * self.mlp(self.input_layernorm(h))

    assert differs(lambda: [setattr(layer, "__class__", Sequential) for layer in layers],
                   lambda: [setattr(layer, "__class__", ParallelDecoderLayer) for layer in layers])


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels could not be built here")
def test_attention_kernel_takes_rmsnorm_layers_and_refuses_layernorm_with_reason(pair):
    layers = pair[2].model.layers
    for layer in layers:
        fused = layer.self_attn.decode_fused(layer.input_layernorm, torch.float32)
        if type(layer.input_layernorm) is LayerNorm:
            assert fused.weights is None and "LayerNorm" in fused.extra
        else:   # RoPE'd sliding layers and NoPE full ones alike
            assert fused.weights is not None, fused.extra


def test_refusals():
    base = {"model_type": "cohere2_moe", "vocab_size": 8, "hidden_size": 16, "num_hidden_layers": 2,
            "num_attention_heads": 2, "head_dim": 8, "intermediate_size": 8, "num_experts": 4, "num_experts_per_tok": 1}
    for name, bad in (("expert_selection_fn", "relu"), ("shared_expert_combination_strategy", "max"),
                      ("logit_scale", "big")):
        with pytest.raises(ValueError, match=name):
            Cohere2MoeForCausalLM(dm.ModelConfig.from_dict({**base, name: bad}))
    with pytest.raises(ValueError, match="first_k_dense_replace"):
        dm.ModelConfig.from_dict({**base, "first_k_dense_replace": 3})
    with pytest.raises(ValueError, match="layer_norm_eps"):
        dm.ModelConfig.from_dict({**base, "layer_norm_eps": None})


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
