"""Prefix caching in the GenerationEngine: full KV blocks are shared by every request whose tokens begin
with the same prefix (finished or still running), a request computes only the positions after them, and
it generates exactly what an engine without the cache generates."""
import pytest
import torch

from engine_testing import TinyLM
from dynamoe.engine import GenerationEngine, SamplingParams

GREEDY = SamplingParams(temperature=0)
BS = 4   # small blocks: short prompts share whole blocks


@pytest.fixture(scope="module")
def model():
    return TinyLM(64).eval()


def _engine(model, **kw):
    kw.setdefault("max_seq_len", 64)
    kw.setdefault("max_batch", 2)
    return GenerationEngine(model, block_size=BS, **kw)


def _run(engine, prompt, n=6):
    req = engine.add_request(prompt, GREEDY, n, ignore_eos=True)
    engine.run_until_done()
    return req


def _ids(seed, n):
    return torch.randint(3, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def test_next_turn_reuses_the_conversation_and_matches_no_cache(model):
    cached, plain = _engine(model), _engine(model, prefix_caching=False)
    turn1 = _ids(0, 12)
    a, a0 = _run(cached, turn1), _run(plain, turn1)
    assert a.output_ids == a0.output_ids and a.stats.cached_tokens == 0
    # the next turn: the whole first exchange, then new tokens
    turn2 = turn1 + a.output_ids + _ids(1, 5)
    model.calls.clear()
    b = _run(cached, turn2)
    # the first request computed its prompt and all outputs but the last (never fed back): its full blocks
    computed = len(turn1) + len(a.output_ids) - 1
    assert b.stats.cached_tokens == computed // BS * BS
    assert model.calls[0] == (1, len(turn2) - b.stats.cached_tokens)
    assert b.output_ids == _run(plain, turn2).output_ids
    assert cached.totals["cached_tokens"] == b.stats.cached_tokens
    assert b.stats.as_dict()["cached_tokens"] == b.stats.cached_tokens
    assert plain.totals["cached_tokens"] == 0


def test_same_prompt_again_prefills_only_its_last_token(model):
    engine = _engine(model, max_batch=1)
    p = _ids(2, 3 * BS + 1)
    first = _run(engine, p)
    model.calls.clear()
    again = _run(engine, p)
    assert again.stats.cached_tokens == len(p) - 1 and model.calls[0] == (1, 1)
    assert again.output_ids == first.output_ids
    # a prompt that is whole blocks still computes its last token (its logits start the output)
    q = _ids(3, 2 * BS)
    _run(engine, q)
    model.calls.clear()
    assert _run(engine, q).stats.cached_tokens == BS and model.calls[0] == (1, BS)


def test_running_requests_share_blocks_and_unrelated_prompts_share_nothing(model):
    engine, plain = _engine(model, max_batch=3), _engine(model, max_batch=3, prefix_caching=False)
    shared = _ids(10, 3 * BS)
    first = engine.add_request(shared + _ids(11, 3), GREEDY, 8, ignore_eos=True)
    engine.step()          # first is prefilled (its blocks registered) and keeps running
    assert not first.finished
    second = engine.add_request(shared + _ids(12, 5), GREEDY, 4, ignore_eos=True)
    other = engine.add_request(_ids(13, 3 * BS + 2), GREEDY, 4, ignore_eos=True)
    engine.run_until_done()
    assert second.stats.cached_tokens == len(shared) and other.stats.cached_tokens == 0
    for r in (first, second, other):
        assert r.output_ids == _run(plain, r.prompt_ids, len(r.output_ids)).output_ids
    s = engine.cache_stats()
    assert s["blocks_used"] == 0 and s["blocks_cached"] > 0 and s["prefix_hits"] == len(shared) // BS
    engine.cache.pool.check()


def test_batched_prefill_of_different_cached_lengths(model):
    """Requests admitted together with different cached prefixes but as many new tokens prefill as
    one batch at their own positions, and still match the engine without the cache."""
    cached, plain = _engine(model), _engine(model, prefix_caching=False)
    a, b = _ids(20, 2 * BS), _ids(21, 3 * BS)
    for e in (cached, plain):
        e.add_request(a, GREEDY, 2, ignore_eos=True)
        e.add_request(b, GREEDY, 2, ignore_eos=True)
        e.run_until_done()
    prompts = [a + [9] * BS, b + [8] * BS]
    out = {}
    for name, e in (("cached", cached), ("plain", plain)):
        model.calls.clear()
        reqs = [e.add_request(p, GREEDY, 5, ignore_eos=True) for p in prompts]
        e.run_until_done()
        out[name] = ([r.output_ids for r in reqs], [r.stats.cached_tokens for r in reqs], list(model.calls))
    assert out["cached"][0] == out["plain"][0]
    assert out["cached"][1] == [len(a), len(b)] and out["plain"][1] == [0, 0]
    assert out["cached"][2][0] == (2, BS)  # one batched prefill of the tokens after each prefix


def test_failed_forward_registers_nothing_it_wrote(model):
    engine = _engine(model, max_batch=1)
    p = _ids(30, 2 * BS)
    _run(engine, p)        # computes p and one output: p's blocks are cached
    real = model.forward

    def boom(*a, **kw):
        raise RuntimeError("device lost")

    model.forward = boom
    try:
        req = engine.add_request(p + [4] * (2 * BS), GREEDY, 3, ignore_eos=True)
        with pytest.raises(RuntimeError, match="device lost"):
            engine.run_until_done()
        assert req.finish_reason == "error"
    finally:
        model.forward = real
    engine.cache.pool.check()
    again = _run(engine, p + [4] * (2 * BS) + [1])
    assert again.stats.cached_tokens == len(p)   # the blocks the failed forward wrote are not trusted
    assert again.output_ids == _run(_engine(model, prefix_caching=False), again.prompt_ids).output_ids
