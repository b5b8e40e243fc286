"""SmallDoge's Doge against transformers on tiny random checkpoints: dynamic-mask attention (a learned bias per key
from its value, a top-k of the keys past keep_window_size, an optional window), per-head q/k norms, per-channel
residual weights; the CDMoE variant is refused, with the reason."""
import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_util import ids as _ids

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.doge import DogeAttention, DogeForCausalLM, WeightedResidualLayer  # noqa: E402
from dynamoe.ops import cpu_kernels  # noqa: E402

KEEP = 7
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, max_position_embeddings=256)
VARIANTS = {
    "plain": dict(),   # keep_window_size 2048: every visible key, each with its bias
    # each query keeps its 7 keys of largest bias once there are more than 7
    "topk": dict(keep_window_size=KEEP),
    # a window of 10 on every layer, biases on the MLPs and attention, another RoPE base
    "window": dict(sliding_window=10, mlp_bias=True, attention_bias=True,
                   rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
}
# (moderate key biases: exp(A softplus(.)) far from underflowing to equal zeros, whose top-k would be a tie)
SCALES = {"lm_head": 0.2, "self_attn.A": 0.5, "dt_proj": 0.05}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    name = request.param
    torch.manual_seed(0)
    hf = transformers.DogeForCausalLM(transformers.DogeConfig(**SIZES, **VARIANTS[name])).eval()
    randomize_(hf, seed=1, scales=SCALES)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"doge_{name}"))
    return name, hf, dm.load(path, progress=False), path


def _distinct(rows=2, tokens=24, seed=0) -> torch.Tensor:
    """Prompts without a repeated token: a repeated token's layer-0 key bias ties, and transformers' top-k breaks
    ties as the row's length has it, dynamoe by keeping the earlier key (the module docstring): parity for those
    is not defined."""
    g = torch.Generator().manual_seed(seed)
    return torch.stack([torch.randperm(VOCAB, generator=g)[:tokens] for _ in range(rows)])


def test_structure(pair):
    name, _, ours, _ = pair
    assert type(ours) is DogeForCausalLM
    for layer in ours.model.layers:
        assert type(layer) is WeightedResidualLayer and type(layer.self_attn) is DogeAttention
        assert layer.self_attn.keep_window_size == (KEEP if name == "topk" else 2048)
        assert layer.self_attn.q_norm is not None
        assert layer.self_attn.sliding_window == (10 if name == "window" else None)
        assert (layer.mlp.gate_proj.bias is not None) == (name == "window")


def test_logits_match_transformers(pair):
    name, hf, ours, _ = pair
    check_logits(hf, ours, _distinct())
    if name != "topk":   # (with ties among the biases the kept keys are dynamoe's rule, not topk's happenstance)
        check_logits(hf, ours, _ids())


def test_greedy_matches_generate(pair):
    _, hf, ours, _ = pair
    check_greedy(hf, ours, _ids(seed=1), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[2], _distinct(seed=2) if pair[0] == "topk" else _ids(seed=2), prefill=9)


def test_rows_at_different_lengths(pair):
    if pair[0] == "topk":   # (random prompts repeat tokens: top-k ties, see test_ties_...)
        torch.manual_seed(0)
        x = _distinct(rows=1, tokens=27, seed=5)
        ours = pair[2]
        with torch.no_grad():   # two rows of distinct tokens at different lengths decoded together and alone
            cache = ours.new_cache(3, 32)
            ours(x[:, :10], cache=cache, slots=torch.tensor([2]))
            ours(x[:, 10:27], cache=cache, slots=torch.tensor([0]))
            together = ours(torch.tensor([[x[0, 20].item()], [x[0, 5].item()]]), cache=cache,
                            slots=torch.tensor([2, 0]))
            alone = ours(torch.cat([x[:, :10], x[:, 20:21]], 1))[:, -1]
        torch.testing.assert_close(together[0, -1], alone[0], atol=1e-4, rtol=0)
        return
    check_ragged_batch(pair[2])


@pytest.mark.parametrize("pair", ["topk"], indirect=True)
def test_ties_are_broken_as_transformers_breaks_them(pair):
    """With repeated tokens (tied key biases) a cached decode may keep other keys than the full forward -- in
    transformers itself, shown here; dynamoe's cached decode gives transformers' cached decode's logits."""
    name, hf, ours, _ = pair
    x = _ids(seed=2)
    with torch.no_grad():
        full = hf(x).logits
        out = hf(x[:, :9], use_cache=True)
        want, c = [out.logits], out.cache
        for t in range(9, x.size(1)):
            o = hf(x[:, t:t + 1], cache=c, use_cache=True)
            want.append(o.logits)
            c = o.cache
        want = torch.cat(want, 1)
        cache = ours.new_cache(2, x.size(1))
        got = [ours(x[:, :9], cache=cache)] + [ours(x[:, t:t + 1], cache=cache) for t in range(9, x.size(1))]
    assert (full - want).abs().max() > 1e-3, "no tie at the top-k boundary here: the test shows nothing"
    torch.testing.assert_close(torch.cat(got, 1), want, atol=1e-4, rtol=0)


def test_the_test_exercises_what_it_claims(pair):
    """Sanity of the test itself: the key biases, the top-k of the keys, the window and the residual weights each
    change the logits (so parity above pins them)."""
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

    kept = [a.A.detach().clone() for a in attns]
    assert differs(lambda: [a.A.data.zero_() for a in attns],   # dt = exp(0) = 1 for every key: no bias
                   lambda: [a.A.data.copy_(k) for a, k in zip(attns, kept)])
    if name == "topk":
        assert differs(lambda: [setattr(a, "keep_window_size", 10_000) for a in attns],
                       lambda: [setattr(a, "keep_window_size", KEEP) for a in attns])
    if name == "window":
        assert differs(lambda: [setattr(a, "sliding_window", None) for a in attns],
                       lambda: [setattr(a, "sliding_window", 10) for a in attns])
    weights = [layer.input_residual.detach().clone() for layer in layers]
    assert differs(lambda: [layer.input_residual.data.fill_(1.0) for layer in layers],
                   lambda: [layer.input_residual.data.copy_(w) for layer, w in zip(layers, weights)])


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels could not be built here")
def test_attention_kernel_refuses_with_reason(pair):
    layer = pair[2].model.layers[0]
    fused = layer.self_attn.decode_fused(layer.input_layernorm, torch.float32)
    assert fused.weights is None and "dynamic" in fused.extra


def test_cdmoe_is_refused_with_the_reason():
    """transformers' CDMoE routes a token by logits split over the whole forward: its outputs depend on the batch,
    which no cache or serving batch can reproduce (shown here on transformers itself); dynamoe refuses it."""
    torch.manual_seed(0)
    cfg = transformers.DogeConfig(vocab_size=64, hidden_size=32, intermediate_size=32, num_hidden_layers=1,
                                  num_attention_heads=2, is_moe=True, num_experts=16, num_experts_per_tok=4)
    hf = transformers.DogeForCausalLM(cfg).eval()
    randomize_(hf, seed=1, std=0.5)
    x = torch.randint(0, 64, (1, 8), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():
        alone = hf(x).logits[0]
        batched = hf(torch.cat([x, x.flip(1)])).logits[0]
    assert (alone - batched).abs().max() > 1e-3
    with pytest.raises(ValueError, match="is_moe"):
        DogeForCausalLM(dm.ModelConfig.from_dict({**cfg.to_dict(), "model_type": "doge"}))


# (not the top-k variant: greedy text repeats tokens, and top-k ties make its kept keys depend on the batch, as
# test_ties_ shows in transformers itself)
@pytest.mark.parametrize("pair", sorted(set(VARIANTS) - {"topk"}), indirect=True)
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
