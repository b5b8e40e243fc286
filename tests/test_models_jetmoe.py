"""JetMoE against transformers on tiny random checkpoints: mixture-of-attention-heads layers (routed query and
output projections, shared key/value heads, an output bias), SwiGLU MoE layers with an output bias, softmax over
the top-k logits, layer norms of eps 1e-6 whatever the config says."""
import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_util import ids as _ids

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.jetmoe import BiasedMoeBlock, JetMoeDecoderLayer, JetMoeForCausalLM, MixtureOfAttentionHeads  # noqa: E402

SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_key_value_heads=2,
             kv_channels=16, max_position_embeddings=256, bos_token_id=None, eos_token_id=None)
VARIANTS = {
    "plain": dict(num_local_experts=4, num_experts_per_tok=2),
    # three of six attention / MLP experts per token, an untied lm_head, another RoPE base, a final norm eps of 1e-3
    "wide": dict(num_local_experts=6, num_experts_per_tok=3, tie_word_embeddings=False, rms_norm_eps=1e-3,
                 rope_parameters={"rope_type": "default", "rope_theta": 500.0}),
}
SCALES = {"lm_head": 0.2, "bias": 0.5}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    name = request.param
    torch.manual_seed(0)
    hf = transformers.JetMoeForCausalLM(transformers.JetMoeConfig(**SIZES, **VARIANTS[name])).eval()
    randomize_(hf, seed=1, scales=SCALES)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"jetmoe_{name}"))
    return name, hf, dm.load(path, progress=False), path


def test_structure(pair):
    name, _, ours, _ = pair
    assert type(ours) is JetMoeForCausalLM
    k = 3 if name == "wide" else 2
    assert ours.config.num_attention_heads == 2 * k and ours.config.head_dim == 16
    for layer in ours.model.layers:
        assert type(layer) is JetMoeDecoderLayer and type(layer.self_attn) is MixtureOfAttentionHeads
        assert type(layer.mlp) is BiasedMoeBlock
        assert layer.self_attn.num_heads == 2 * k and layer.self_attn.experts.num_experts == (6 if name == "wide" else 4)
        assert layer.input_layernorm.eps == layer.post_attention_layernorm.eps == 1e-6
    assert ours.model.norm.eps == (1e-3 if name == "wide" else 1e-6)


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
    """Sanity of the test itself: the attention routing (each choice's own query and output projections), the
    pairing of query heads with the shared key/value heads, and both output biases change the logits (so parity
    above pins them)."""
    _, _, ours, _ = pair
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

    routers = [a.experts.router.layer.weight.detach().clone() for a in attns]
    assert differs(lambda: [a.experts.router.layer.weight.data.neg_() for a in attns],   # the other experts chosen
                   lambda: [a.experts.router.layer.weight.data.copy_(w) for a, w in zip(attns, routers)])
    kv = [a.kv_proj.weight.detach().clone() for a in attns]

    def swap_kv_heads():  # key/value head 0 <-> 1: query heads then read the other group's keys
        for a in attns:
            w = a.kv_proj.weight.data.view(2, 2, 16, -1)
            w.copy_(w.flip(1))

    assert differs(swap_kv_heads, lambda: [a.kv_proj.weight.data.copy_(w) for a, w in zip(attns, kv)])
    for biases in ([a.experts.bias for a in attns], [layer.mlp.out_bias.bias for layer in ours.model.layers]):
        kept = [b.detach().clone() for b in biases]
        assert differs(lambda: [b.data.zero_() for b in biases], lambda: [b.data.copy_(k) for b, k in zip(biases, kept)])


def test_kernels_refuse_with_reasons(pair):
    layer = pair[2].model.layers[0]
    fused = layer.self_attn.decode_fused(layer.input_layernorm, torch.float32)
    assert fused.weights is None and "mixture of attention heads" in fused.extra
    fused = layer.mlp.decode_fused(torch.zeros(1, 64), layer.post_attention_layernorm)
    assert fused.weights is None and "output bias" in fused.extra


def test_heads_follow_kv_heads_and_top_k():
    """num_attention_heads is num_key_value_heads * num_experts_per_tok (what transformers' attention runs, whatever
    the file's num_attention_heads says); head_dim is kv_channels; hidden_act is activation_function."""
    cfg = dm.ModelConfig.from_dict({"model_type": "jetmoe", "vocab_size": 8, "hidden_size": 16, "num_hidden_layers": 1,
                                    "num_key_value_heads": 2, "kv_channels": 4, "num_experts_per_tok": 3,
                                    "num_local_experts": 4, "num_attention_heads": 7, "hidden_act": "gelu",
                                    "activation_function": "silu", "intermediate_size": 8})
    assert (cfg.num_attention_heads, cfg.head_dim, cfg.hidden_act) == (6, 4, "silu")


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
