"""Prefix caching in the GenerationEngine: a request reuses the keys/values its slot kept from an
earlier request with the same prompt prefix, prefills only the rest, and generates exactly what an
engine without the cache generates."""
import pytest
import torch

from engine_testing import TinyLM
from dynamoe.engine import GenerationEngine, SamplingParams

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def model():
    return TinyLM(64).eval()


def _run(engine, prompt, n=6):
    req = engine.add_request(prompt, GREEDY, n, ignore_eos=True)
    engine.run_until_done()
    return req


def _ids(seed, n):
    return torch.randint(3, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_next_turn_reuses_the_conversation_and_matches_no_cache(model):
    cached = GenerationEngine(model, max_seq_len=64, max_batch=2)
    plain = GenerationEngine(model, max_seq_len=64, max_batch=2, prefix_caching=False)
    turn1 = _ids(0, 12)
    a, a0 = _run(cached, turn1), _run(plain, turn1)
    assert a.output_ids == a0.output_ids and a.stats.cached_tokens == 0
    # the next turn: the whole first exchange, then new tokens
    turn2 = turn1 + a.output_ids + _ids(1, 5)
    model.calls.clear()
    b = _run(cached, turn2)
    # the slot held the prompt and all outputs but the last (never fed back): that much is reused
    assert b.stats.cached_tokens == len(turn1) + len(a.output_ids) - 1
    assert model.calls[0] == (1, len(turn2) - b.stats.cached_tokens)
    assert b.output_ids == _run(plain, turn2).output_ids
    assert cached.totals["cached_tokens"] == b.stats.cached_tokens
    assert b.stats.as_dict()["cached_tokens"] == b.stats.cached_tokens


def test_same_prompt_again_prefills_only_its_last_token(model):
    engine = GenerationEngine(model, max_seq_len=64, max_batch=1)
    p = _ids(2, 10)
    first = _run(engine, p)
    model.calls.clear()
    again = _run(engine, p)
    assert again.stats.cached_tokens == len(p) - 1 and model.calls[0] == (1, 1)
    assert again.output_ids == first.output_ids


def test_slot_choice_longest_prefix_else_least_recently_used(model):
    engine = GenerationEngine(model, max_seq_len=64, max_batch=3)
    convs = [_ids(10 + i, 9) for i in range(3)]
    reqs = [engine.add_request(c, GREEDY, 3, ignore_eos=True) for c in convs]
    engine.run_until_done()
    slots_of = {i: s for i, s in enumerate(r.slot for r in reqs)}  # finished: slots released
    assert all(s is None for s in slots_of.values())
    # a continuation of conversation 1 goes to its slot, even with all three free
    follow = _run(engine, convs[1] + [5, 6, 7])
    assert follow.stats.cached_tokens == len(convs[1])
    # an unrelated prompt reuses nothing
    other = _run(engine, _ids(99, 9))
    assert other.stats.cached_tokens == 0
    # a short accidental match (fewer than min_cached_prefix tokens) is not worth a slot
    short = _run(engine, convs[0][:2] + _ids(98, 7))
    assert short.stats.cached_tokens == 0


def test_batched_prefill_of_different_cached_lengths(model):
    """Requests admitted together with different cached prefixes but as many new tokens prefill as
    one batch at their own positions, and still match the engine without the cache."""
    cached = GenerationEngine(model, max_seq_len=64, max_batch=2)
    plain = GenerationEngine(model, max_seq_len=64, max_batch=2, prefix_caching=False)
    a, b = _ids(20, 6), _ids(21, 11)
    for e in (cached, plain):
        e.add_request(a, GREEDY, 2, ignore_eos=True)
        e.add_request(b, GREEDY, 2, ignore_eos=True)
        e.run_until_done()
    prompts = [a + [9, 9, 9, 9], b + [8, 8, 8, 8]]
    out = {}
    for name, e in (("cached", cached), ("plain", plain)):
        model.calls.clear()
        reqs = [e.add_request(p, GREEDY, 5, ignore_eos=True) for p in prompts]
        e.run_until_done()
        out[name] = ([r.output_ids for r in reqs], [r.stats.cached_tokens for r in reqs], list(model.calls))
    assert out["cached"][0] == out["plain"][0]
    # each slot holds its prompt and first output; the new prompts share the prompts
    assert out["cached"][1] == [len(a), len(b)] and out["plain"][1] == [0, 0]
    assert out["cached"][2][0] == (2, 4)  # one batched prefill of the 4 tokens after each prefix


def test_failed_forward_forgets_the_slot(model):
    engine = GenerationEngine(model, max_seq_len=64, max_batch=1)
    p = _ids(30, 8)
    _run(engine, p)
    real = model.forward

    def boom(*a, **kw):
        raise RuntimeError("device lost")

    model.forward = boom
    try:
        req = engine.add_request(p + [4, 4], GREEDY, 3, ignore_eos=True)
        with pytest.raises(RuntimeError, match="device lost"):
            engine.run_until_done()
        assert req.finish_reason == "error"
    finally:
        model.forward = real
    again = _run(engine, p + [4, 4])
    assert again.stats.cached_tokens == 0   # what the failed forward wrote is not trusted
