"""JetBrains Mellum 2 against transformers on tiny random checkpoints: Qwen3-MoE layers in full and sliding kinds,
each kind with its own RoPE, dense layers by mlp_layer_types; the fused decode kernels run its layers."""
import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_util import ids as _ids

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.attention import Attention  # noqa: E402
from dynamoe.models.base import DecoderLayer  # noqa: E402
from dynamoe.models.mellum import MellumForCausalLM  # noqa: E402
from dynamoe.models.moe_block import GatedMLP, SparseMoeBlock  # noqa: E402
from dynamoe.ops import cpu_kernels  # noqa: E402

WINDOW = 6
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
             num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
             sliding_window=WINDOW, max_position_embeddings=256)
VARIANTS = {
    "plain": dict(),   # every layer full attention and MoE, base 5e5
    # sliding / full layers with their own RoPE, a dense first layer, no renormalisation, q/k/v/o biases
    "mixed": dict(layer_types=["sliding_attention", "full_attention"] * 2, mlp_layer_types=["dense"] + ["sparse"] * 3,
                  norm_topk_prob=False, attention_bias=True,
                  rope_parameters={"full_attention": {"rope_type": "default", "rope_theta": 1e4},
                                   "sliding_attention": {"rope_type": "default", "rope_theta": 500.0}}),
}
SCALES = {"lm_head": 0.2}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    name = request.param
    torch.manual_seed(0)
    hf = transformers.MellumForCausalLM(transformers.MellumConfig(**SIZES, **VARIANTS[name])).eval()
    randomize_(hf, seed=1, scales=SCALES)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"mellum_{name}"))
    return name, hf, dm.load(path, progress=False), path


def test_structure(pair):
    name, _, ours, _ = pair
    assert type(ours) is MellumForCausalLM
    layers = ours.model.layers
    attns = [layer.self_attn for layer in layers]
    assert all(type(layer) is DecoderLayer and type(a) is Attention and a.q_norm is not None
               for layer, a in zip(layers, attns))
    if name == "plain":
        assert [a.sliding_window for a in attns] == [None] * 4 and [type(x.mlp) for x in layers] == [SparseMoeBlock] * 4
        assert attns[0].rotary.inv_freq.numel() == 8 and attns[0].rotary.rope.theta == 5e5
    else:
        assert [a.sliding_window for a in attns] == [WINDOW, None] * 2
        assert [type(x.mlp) for x in layers] == [GatedMLP] + [SparseMoeBlock] * 3
        assert [a.rotary.rope.theta for a in attns[:2]] == [500.0, 1e4]
    assert all(b.moe.config.gates[0].normalize == (name == "plain") for _, b in ours.moe_layers())


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
    """Sanity of the test itself: each layer kind's RoPE, and (mixed) the window, change the logits."""
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

    tables = ours.model.rotary_emb.tables
    for kind in set(ours.config.layer_types):
        inv = tables[kind].inv_freq.clone()
        assert differs(lambda: tables[kind].inv_freq.mul_(0.5), lambda: tables[kind].inv_freq.copy_(inv))
    if name == "mixed":
        assert differs(lambda: [setattr(a, "sliding_window", None) for a in attns],
                       lambda: [setattr(a, "sliding_window", WINDOW if i % 2 == 0 else None) for i, a in enumerate(attns)])


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels could not be built here")
def test_decode_runs_the_fused_kernels(pair):
    ours = pair[2]
    with torch.no_grad():
        for layer in ours.model.layers:
            fused = layer.self_attn.decode_fused(layer.input_layernorm, torch.float32)
            assert fused.weights is not None, fused.extra
            fused = layer.mlp.decode_fused(torch.zeros(1, 64), layer.post_attention_layernorm)
            assert fused.weights is not None, fused.extra


def test_refusals():
    base = {"model_type": "mellum", "vocab_size": 8, "hidden_size": 16, "num_hidden_layers": 2,
            "num_attention_heads": 2, "num_key_value_heads": 2, "head_dim": 8, "moe_intermediate_size": 8,
            "num_experts": 4, "num_experts_per_tok": 1}
    partial = {"full_attention": {"rope_type": "default", "rope_theta": 1e4, "partial_rotary_factor": 0.5}}
    with pytest.raises(ValueError, match="partial_rotary_factor"):   # (transformers' attention fails on it)
        MellumForCausalLM(dm.ModelConfig.from_dict({**base, "rope_parameters": partial}))


def test_mtp_tensors_are_not_loaded(pair, tmp_path):
    """A checkpoint's multi-token-prediction module (mtp.*) is known and skipped, as transformers does."""
    import os
    from safetensors import safe_open
    from safetensors.torch import save_file

    path = pair[3]
    with safe_open(os.path.join(path, "model.safetensors"), "pt") as f:
        tensors = {n: f.get_tensor(n) for n in f.keys()}
    tensors["mtp.layers.0.input_layernorm.weight"] = torch.ones(64)
    save_file(tensors, str(tmp_path / "model.safetensors"), metadata={"format": "pt"})
    with open(os.path.join(path, "config.json")) as f:
        (tmp_path / "config.json").write_text(f.read())
    ours = dm.load(str(tmp_path), progress=False)
    with torch.no_grad():
        torch.testing.assert_close(ours(_ids()), pair[2](_ids()), atol=0, rtol=0)


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
