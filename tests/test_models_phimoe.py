"""Phi-3.5-MoE against transformers on tiny random checkpoints: SparseMixer routing at inference (against
transformers' own sparsemixer on ties, margins and signs), longrope whose cos/sin scale switches when a sequence
passes original_max_position_embeddings (greedy generation across the switch, where transformers recomputes the
cache), LayerNorms with biases, an lm_head bias, q/k/v/o biases, a sliding window on every layer."""
import dataclasses

import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import (VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, greedy, ids,
                         randomize_, save_tiny)

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.phimoe import PhimoeForCausalLM  # noqa: E402
from dynamoe.ops.routing import sparsemixer_top2  # noqa: E402

ORIG = 32
_g = torch.Generator().manual_seed(9)
LONGROPE = {"rope_type": "longrope", "rope_theta": 10000.0, "short_factor": (1 + torch.rand(8, generator=_g)).tolist(),
            "long_factor": (2 + 4 * torch.rand(8, generator=_g)).tolist(), "short_mscale": 1.1, "long_mscale": 1.3,
            "original_max_position_embeddings": ORIG}
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=3, num_attention_heads=4,
             num_key_value_heads=2, num_local_experts=8, max_position_embeddings=256, bos_token_id=None,
             eos_token_id=None)
VARIANTS = {
    # the scale switches at 32 positions; wide margins (several experts share a softmax); every bias
    "longrope": dict(rope_parameters=LONGROPE, lm_head_bias=True, attention_bias=True, router_jitter_noise=0.2),
    # plain RoPE at transformers' base, the default margin, a window shorter than the inputs on every layer
    "window": dict(sliding_window=6),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.PhimoeForCausalLM(transformers.PhimoeConfig(**SIZES, **VARIANTS[request.param])).eval()
    randomize_(hf, seed=3)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"phimoe_{request.param}"))
    return request.param, hf, dm.load(path, progress=False)


def test_structure(pair):
    name, hf, ours = pair
    assert type(ours) is PhimoeForCausalLM
    layer = ours.model.layers[0]
    assert type(layer.input_layernorm) is torch.nn.LayerNorm and layer.input_layernorm.bias.abs().max() > 0
    assert (ours.lm_head.bias is not None) == (name == "longrope")
    if ours.lm_head.bias is not None:
        assert torch.equal(ours.lm_head.bias, hf.lm_head.bias)
    assert [a.self_attn.sliding_window for a in ours.model.layers] == [6 if name == "window" else None] * 3
    gate = ours.moe_layers()[0][1].moe.config.gates[0]
    assert (gate.type, gate.k, gate.jitter_eps) == ("sparsemixer", 2, 0.2 if name == "longrope" else 0.01)
    assert ours.recurrent_state == (name == "longrope")   # (the engine then shares no prefix blocks)


def test_router_and_scale_matter(pair):
    """Sanity of the test itself: softmax top-2 instead of SparseMixer, another margin, or (longrope) the short
    scale past the original length change the logits."""
    name, _, ours = pair
    x = ids(tokens=40)
    moes = [block.moe for _, block in ours.moe_layers()]
    saved = [m.config for m in moes]

    def gates(**change):  # every MoE layer routed by a new gate config (configs are frozen)
        for m, cfg in zip(moes, saved):
            m.config = dataclasses.replace(cfg, gates=(dataclasses.replace(cfg.gates[0], **change),))

    with torch.no_grad():
        ref = ours(x)
        eps = saved[0].gates[0].jitter_eps
        gates(jitter_eps=0.05 if eps > 0.1 else 0.3)
        other_margin = ours(x)
        gates(type="top")
        softmax = ours(x)
        for m, cfg in zip(moes, saved):
            m.config = cfg
        changed = [other_margin, softmax]
        if name == "longrope":
            rope = ours.model.rotary_emb.rope
            object.__setattr__(rope, "long_mscale", rope.short_mscale)
            changed.append(ours(x))
            object.__setattr__(rope, "long_mscale", 1.3)
        assert torch.equal(ours(x), ref)
    for other in changed:
        assert (other - ref).abs().max() > 1e-2


def test_sparsemixer_matches_transformers_on_ties_and_margins():
    # imported here, not at collection: transformers' modeling module imports triton (compiled), which would make
    # tests/test_triton_kernels.py, collected later, unable to run its kernels under the interpreter
    from transformers.models.phimoe.modeling_phimoe import sparsemixer

    g = torch.Generator().manual_seed(0)
    rows = [torch.randn(64, 8, generator=g) * 3,                              # random
            torch.randn(64, 8, generator=g).round(),                           # many exact ties
            -torch.rand(64, 8, generator=g) - 0.01,                             # all negative
            torch.tensor([[2.0, 2.0, 1.99, -5.0, 0.0, 1.0, 2.0, -2.0]]),       # a three-way tie at the top
            torch.tensor([[0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0, 0.0]]),          # all equal (and zero)
            torch.tensor([[1.0, 0.99, 0.98, 0.5, -1.0, 0.97, 0.0, 0.96]])]     # a cluster within the margin
    for eps in (0.0, 0.01, 0.2):
        for logits in rows:
            w_ref, ids_ref = sparsemixer(logits.clone(), jitter_eps=eps, training=False)
            w, got, _ = sparsemixer_top2(logits, eps)
            assert torch.equal(got, ids_ref), (eps, logits)
            torch.testing.assert_close(w, w_ref, atol=1e-6, rtol=0)


def test_logits_match_transformers(pair):
    _, hf, ours = pair
    check_logits(hf, ours, ids())
    check_logits(hf, ours, ids(tokens=40))   # (longrope: past the original length, the long scale everywhere)


def test_greedy_matches_generate(pair):
    """24 prompt tokens and 32 new ones: the sequence passes the original length (32) on the way; transformers'
    generate recomputes the cache then, and so does dynamoe."""
    _, hf, ours = pair
    check_greedy(hf, ours, ids(seed=1), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[2], ids(seed=2, tokens=30), prefill=9)   # (below the original length)


def test_past_the_switch_steps_equal_recompute(pair):
    """Once a cached sequence has passed the original length, every step's logits equal those of one forward over
    the whole sequence (the keys were recomputed with the long scale), rows crossing at different steps."""
    ours = pair[2]
    x = ids(rows=2, tokens=44, seed=4)
    with torch.no_grad():
        full = ours(x)
        cache = ours.new_cache(3, 44)
        slots = torch.tensor([2, 0])
        ours(x[:1, :28], cache=cache, slots=slots[:1])
        ours(x[1:, :31], cache=cache, slots=slots[1:])
        ours(x[:1, 28:31], cache=cache, slots=slots[:1])   # row 0 catches up (31 <= 32: short scale, no recompute)
        steps = [ours(x[:, t:t + 1], cache=cache, slots=slots) for t in range(31, 44)]
    assert cache.lengths.tolist() == [44, 0, 44]
    got = torch.cat(steps, dim=1)
    want = full[:, 31:]
    if pair[0] == "longrope":   # position 31's step (length 32) still has the short scale; the whole sequence not
        got, want = got[:, 1:], want[:, 1:]
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[2])


def test_greedy_in_chunks_crosses_in_one_row(pair):
    """A batch where one row crosses the original length during a chunk of several tokens and the other does not:
    each row's logits are its own (the crossing row is recomputed alone)."""
    ours = pair[2]
    x = ids(rows=2, tokens=36, seed=6)
    with torch.no_grad():
        alone = []
        for r, n in enumerate((30, 20)):
            cache = ours.new_cache(1, 64)
            ours(x[r:r + 1, :n], cache=cache)
            alone.append(ours(x[r:r + 1, n:n + 6], cache=cache))
        cache = ours.new_cache(2, 64)
        ours(x[:1, :30], cache=cache, slots=torch.tensor([0]))
        ours(x[1:, :20], cache=cache, slots=torch.tensor([1]))
        both = ours(torch.cat([x[:1, 30:36], x[1:, 20:26]]), cache=cache, slots=torch.tensor([0, 1]))
        last = ours(torch.cat([x[:1, 30:36], x[1:, 20:26]])[:, :2], cache=cache, logits_to_keep=1)
    torch.testing.assert_close(both, torch.cat(alone), atol=1e-4, rtol=0)
    assert last.shape == (2, 1, VOCAB) and cache.lengths.tolist() == [38, 28]
    assert greedy(ours, x[:, :30], 4).shape == (2, 34)


def test_config_defaults_and_refusals():
    sizes = dict(vocab_size=128, hidden_size=64, num_hidden_layers=2, num_attention_heads=8)
    cfg = dm.ModelConfig.from_dict({"model_type": "phimoe", **sizes})
    hf = transformers.PhimoeConfig(**sizes)
    assert (cfg.num_experts, cfg.num_experts_per_tok, cfg.intermediate_size, cfg.router_jitter_noise) == \
        (hf.num_local_experts, hf.num_experts_per_tok, hf.intermediate_size, hf.router_jitter_noise)
    with pytest.raises(ValueError, match="exactly 2 experts"):
        PhimoeForCausalLM(dm.ModelConfig.from_dict({"model_type": "phimoe", **sizes, "num_experts_per_tok": 3,
                                                    "intermediate_size": 16}))
    with pytest.raises(ValueError, match="short_mscale"):
        PhimoeForCausalLM(dm.ModelConfig.from_dict({"model_type": "phimoe", **sizes, "intermediate_size": 16,
                                                    "rope_parameters": {**LONGROPE, "short_mscale": None}}))
    with pytest.raises(ValueError, match="longrope"):   # another family does not switch: refused, not ignored
        from dynamoe.models.rope import RotaryEmbedding
        RotaryEmbedding(dm.ModelConfig.from_dict({"model_type": "phimoe", **sizes,
                                                  "rope_parameters": LONGROPE}).rope, 8, 256)


def test_engine_shares_no_prefix_blocks_when_the_scale_switches(pair, tmp_path):
    """A block's keys depend on whether its sequence has passed the original length: the engine must not share
    them by prefix (the model says recurrent_state); without a switch, prefix caching stays on."""
    from engine_testing import write_tokenizer_dir

    from dynamoe.engine import GenerationEngine, Tokenizer

    name, _, ours = pair
    tok = Tokenizer.from_dir(write_tokenizer_dir(str(tmp_path / "tok")))
    engine = GenerationEngine(ours, tok, max_seq_len=64, max_batch=2)
    assert engine.prefix_caching == (name != "longrope")


def test_engine_generation_matches_generate(pair):
    """The serving engine (continuous batching, chunked prefill of 8 tokens) gives transformers' greedy tokens
    for each prompt, rows passing the original length during the prefill chunks and during decoding."""
    from dynamoe.engine import GenerationEngine, SamplingParams

    _, hf, ours = pair
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (20, 27, 38)]
    engine = GenerationEngine(ours, None, max_seq_len=64, max_batch=3, prefill_chunk=8)
    reqs = [engine.add_request(p, SamplingParams(temperature=0), 12, ignore_eos=True) for p in prompts]
    engine.run_until_done()
    for p, r in zip(prompts, reqs):
        want = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=12, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert r.output_ids == want
