"""Dynamic NTK RoPE (the base grows with the sequence past max_position_embeddings) in the engine: a request's
tokens equal transformers' for that prompt alone whether its prompt is prefilled whole or in chunks, alone or in a
batch with rows of other lengths, from a cached prefix or not, and after a preemption (transformers rotates a
prompt's positions with the prompt's length, each later position with its own position + 1)."""
import pytest
import torch

from models_util import hf_greedy, one_thread, randomize_, save_tiny  # noqa: F401 (autouse fixture)

transformers = pytest.importorskip("transformers")

import dynamoe.models as dm  # noqa: E402
from dynamoe.engine import GenerationEngine, SamplingParams  # noqa: E402

MAX_POS, VOCAB, NEW = 16, 96, 12
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    cfg = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      num_experts=4, num_experts_per_tok=2, max_position_embeddings=MAX_POS,
                                      rope_parameters={"rope_type": "dynamic", "factor": 4.0, "rope_theta": 10000.0},
                                      bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(cfg).eval()
    randomize_(hf, seed=3)
    path = save_tiny(hf, str(tmp_path_factory.mktemp("dyn")))
    return hf, dm.load(path, progress=False)


def _prompts():
    g = torch.Generator().manual_seed(7)
    base = torch.randint(1, VOCAB, (40,), generator=g).tolist()
    # past max_position_embeddings (16) by different amounts; the third shares the first's first 24 tokens
    return [base[:33], torch.randint(1, VOCAB, (21,), generator=g).tolist(), base[:24] + [5, 9, 11, 2, 7, 3]]


def _want(hf, prompt):
    """transformers' tokens for ``prompt`` alone: its rotary module keeps the longest length it has seen (one base
    for whatever runs next, until a forward shorter than max_position_embeddings resets it), so reset it first."""
    with torch.no_grad():
        hf(torch.tensor([[1]]))
    return hf_greedy(hf, torch.tensor([prompt]), NEW)[0, len(prompt):].tolist()


def _engine(model, **kw):
    return GenerationEngine(model, max_seq_len=64, max_batch=4, block_size=4, **kw)


def test_alone_batched_chunked_and_cached_equal_transformers(pair):
    hf, model = pair
    prompts = _prompts()
    want = [_want(hf, p) for p in prompts]
    for kw in ({}, {"prefill_chunk": 8}, {"prefill_chunk": 5, "token_budget": 7}):
        e = _engine(model, **kw)
        reqs = [e.add_request(p, GREEDY, NEW, ignore_eos=True) for p in prompts]   # one batch, ragged
        e.run_until_done()
        assert [r.output_ids for r in reqs] == want, kw
        # again: the same prompts find their own blocks; the third prompt's first 24 tokens are the first's, but a
        # prompt of another length rotates them with another base: it must not read the first's blocks
        again = [e.add_request(p, GREEDY, NEW, ignore_eos=True) for p in prompts]
        e.run_until_done()
        assert [r.output_ids for r in again] == want, kw
        assert again[0].stats.cached_tokens >= 32 and again[2].stats.cached_tokens >= 28, kw
    e = _engine(model)
    first = e.add_request(prompts[0], GREEDY, NEW, ignore_eos=True)
    e.run_until_done()
    third = e.add_request(prompts[2], GREEDY, NEW, ignore_eos=True)
    e.run_until_done()
    assert first.output_ids == want[0] and third.output_ids == want[2] and third.stats.cached_tokens == 0


def test_a_preempted_request_recomputes_to_the_same_tokens(pair):
    hf, model = pair
    prompts = _prompts()
    e = GenerationEngine(model, max_seq_len=64, max_batch=3, block_size=4, kv_cache_blocks=20, prefix_caching=False)
    reqs = [e.add_request(p, GREEDY, NEW, ignore_eos=True) for p in prompts]
    e.run_until_done()
    assert e.totals["preempted"] > 0
    assert [r.output_ids for r in reqs] == [_want(hf, p) for p in prompts]


def test_prompt_positions_take_the_prompts_length(pair):
    """The rule matters: the prompt's second chunk rotated with its own positions + 1 (what a decode step does)
    instead of the prompt's length gives other logits."""
    _, model = pair
    prompt = torch.tensor([_prompts()[0]])
    rot = model.model.rotary_emb
    with torch.no_grad():
        whole = model(prompt)
        cache = model.new_cache(1, 64)
        cache.declare_prompt(0, prompt.size(1))
        model(prompt[:, :20], cache=cache, slots=torch.tensor([0]))
        chunked = model(prompt[:, 20:], cache=cache, slots=torch.tensor([0]))
        torch.testing.assert_close(chunked, whole[:, 20:], atol=1e-4, rtol=0)
        undeclared = model.new_cache(1, 64)   # the first forward is taken as the prompt: 20 tokens
        model(prompt[:, :20], cache=undeclared, slots=torch.tensor([0]))
        other = model(prompt[:, 20:], cache=undeclared, slots=torch.tensor([0]))
    assert (other - whole[:, 20:]).abs().max() > 1e-2
    assert rot.prompt_lengths is None   # (set only while a forward runs)
