"""Zyphra ZAYA1 against transformers on tiny random checkpoints: compressed convolutional attention (q/k convolved
over time with residual paths, half the values delayed a token, L2 q/k norms with a key temperature, partial RoPE per
layer kind, sliding layers), residual scalings, scaled embeddings and an fp32 residual stream, the MLP router whose
state flows from layer to layer and whose extra class skips the experts."""
import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_util import ids as _ids

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.zaya import CCAttention, ZayaDecoderLayer, ZayaForCausalLM, ZayaMoE  # noqa: E402

WINDOW = 6
SIZES = dict(vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, head_dim=16, num_experts=4, router_hidden_size=16, max_position_embeddings=256,
             bos_token_id=None, eos_token_id=None, pad_token_id=None)
VARIANTS = {
    "plain": dict(),   # every layer 'hybrid' (full attention), kernels of 2 and 2, tied embeddings
    # sliding / full layers, wider convolutions, an untied lm_head with a bias, another RoPE pair
    "sliding": dict(layer_types=["hybrid_sliding", "hybrid", "hybrid_sliding"], sliding_window=WINDOW, cca_time0=3,
                    cca_time1=2, tie_word_embeddings=False, lm_head_bias=True,
                    rope_parameters={"hybrid": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5},
                                     "hybrid_sliding": {"rope_type": "default", "rope_theta": 500.0,
                                                        "partial_rotary_factor": 1.0}}),
}
SCALES = {"lm_head": 0.2, "temp": 1.0, "balancing_biases": 0.1}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    name = request.param
    torch.manual_seed(0)
    hf = transformers.ZayaForCausalLM(transformers.ZayaConfig(**SIZES, **VARIANTS[name])).eval()
    randomize_(hf, seed=1, scales=SCALES)
    g = torch.Generator().manual_seed(7)
    with torch.no_grad():
        for n, b in hf.named_buffers():
            if n.endswith("balancing_biases"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.02)
                b[-1] = 0.0   # (the no-expert class is chosen now and then: see the sanity test)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"zaya_{name}"))
    return name, hf, dm.load(path, progress=False), path


def test_structure(pair):
    name, _, ours, _ = pair
    assert type(ours) is ZayaForCausalLM and ours.recurrent_state
    layers = ours.model.layers
    assert all(type(layer) is ZayaDecoderLayer and type(layer.self_attn) is CCAttention and type(layer.mlp) is ZayaMoE
               for layer in layers)
    assert [layer.mlp.gate.router_states_scale is None for layer in layers] == [True, False, False]
    if name == "plain":
        assert ours.config.layer_types == ("full_attention",) * 3
        assert layers[0].self_attn.rotary.inv_freq.numel() == 4 and layers[0].self_attn.qkv_proj.window == 2
        assert ours.lm_head.weight is ours.model.embed_tokens.weight and ours.lm_head.bias is None
    else:
        assert [a.self_attn.sliding_window for a in layers] == [WINDOW, None, WINDOW]
        assert [a.self_attn.rotary.inv_freq.numel() for a in layers[:2]] == [8, 4]
        assert layers[0].self_attn.qkv_proj.window == 3 and ours.lm_head.bias is not None


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
    """Sanity of the test itself: the convolution's past, the delayed values, the key temperature, the residual
    scalings, the router state passed between layers and the no-expert class each change the logits."""
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

    def saved(params):
        kept = [p.detach().clone() for p in params]
        return lambda: [p.data.copy_(k) for p, k in zip(params, kept)]

    convs = [layer.self_attn.qkv_proj.conv_qk_depthwise.weight for layer in layers]
    assert differs(lambda: [w.data[..., :-1].zero_() for w in convs], saved(convs))   # only the current token
    delayed = [layer.self_attn.qkv_proj.v_proj_delayed.weight for layer in layers]
    assert differs(lambda: [w.data.zero_() for w in delayed], saved(delayed))
    temps = [layer.self_attn.qk_norm.temp for layer in layers]
    assert differs(lambda: [t.data.fill_(1.0) for t in temps], saved(temps))
    scales = [layer.post_mlp_residual_scale.residual_scale for layer in layers]
    assert differs(lambda: [s.data.fill_(1.0) for s in scales], saved(scales))
    eda = [layer.mlp.gate.router_states_scale for layer in layers[1:]]
    assert differs(lambda: [s.data.zero_() for s in eda], saved(eda))
    chosen = []
    hooks = [layer.mlp.gate.register_forward_hook(lambda m, i, o: chosen.append(o[0])) for layer in layers]
    try:
        with torch.no_grad():
            ours(x)
    finally:
        for h in hooks:
            h.remove()
    chosen = torch.cat(chosen)
    assert bool((chosen == 4).any()) and bool((chosen < 4).any()), "both experts and the no-expert class are chosen"
    biases = [layer.mlp.gate.balancing_biases for layer in layers]
    kept = [b.clone() for b in biases]
    for last in (-100.0, 100.0):   # never / always skip the experts
        assert differs(lambda: [b.__setitem__(-1, last) for b in biases],
                       lambda: [b.copy_(k) for b, k in zip(biases, kept)])


def test_tied_lm_head_with_a_bias(tmp_path):
    """A tied lm_head's own bias loads (the loader reads it though the weight is the embeddings')."""
    torch.manual_seed(0)
    hf = transformers.ZayaForCausalLM(transformers.ZayaConfig(**{**SIZES, "num_hidden_layers": 1},
                                                              lm_head_bias=True)).eval()
    randomize_(hf, seed=3, scales=SCALES)
    ours = dm.load(save_tiny(hf, tmp_path), progress=False)
    assert ours.lm_head.weight is ours.model.embed_tokens.weight and ours.lm_head.bias is not None
    check_logits(hf, ours, _ids())


def test_refusals():
    base = {"model_type": "zaya", "vocab_size": 8, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 2, "head_dim": 8, "moe_intermediate_size": 8, "num_experts": 4}
    with pytest.raises(ValueError, match="num_experts_per_tok"):
        ZayaForCausalLM(dm.ModelConfig.from_dict({**base, "num_experts_per_tok": 2}))
    with pytest.raises(ValueError, match="layer_types"):   # ZAYA's kinds are 'hybrid' and 'hybrid_sliding'
        dm.ModelConfig.from_dict({**base, "layer_types": ["full_attention"] * 2})
    with pytest.raises(ValueError, match="cca_time0"):
        ZayaForCausalLM(dm.ModelConfig.from_dict({**base, "cca_time0": 0}))


def test_engine_generation_matches_generate(pair):
    """The serving engine (continuous batching, chunked prefill; no prefix sharing: a recurrent state) gives
    transformers' greedy tokens per prompt."""
    from dynamoe.engine import GenerationEngine, SamplingParams

    hf, ours = pair[1], pair[2]
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (6, 19)]
    engine = GenerationEngine(ours, None, max_seq_len=48, max_batch=2, prefill_chunk=8)
    assert not engine.prefix_caching
    reqs = [engine.add_request(p, SamplingParams(temperature=0), 10, ignore_eos=True) for p in prompts]
    engine.run_until_done()
    for p, r in zip(prompts, reqs):
        want = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=10, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert r.output_ids == want
