"""Checks shared by the families whose layers keep per-sequence recurrent state in the cache (Mamba, short
convolutions, linear attention): chunked prefill leaves the one-pass state, rows at different positions in one
forward, a reused slot starts from zero, a truncated slot is an error, and the engine (prefix reuse off)
generates each request's own continuation."""
from __future__ import annotations

import pytest
import torch

from models_util import ATOL, greedy
from models_util import ids as _ids

STATE_NAMES = ("conv_state", "recurrent_state")


def states(cache, slot, names=STATE_NAMES) -> dict:
    """Every layer's per-slot state tensors of ``slot`` (copies), by (layer, name)."""
    return {(i, name): t[slot].clone() for i, layer in enumerate(cache.layers) for name, t in layer.items()
            if name in names}


def check_chunked_prefill(ours, cuts=((0, 13), (13, 15), (15, 28)), total=30, seed=3, expect_states=None, *,
                          state_names=STATE_NAMES) -> None:
    """Prefill in chunks (one shorter than a conv window) gives the one-pass logits and leaves the same states;
    decoding on from either gives the same logits. ``expect_states``: how many state tensors the slot holds (of the
    buffers named ``state_names``)."""
    ids = _ids(rows=1, tokens=total, seed=seed)
    end = cuts[-1][1]
    with torch.no_grad():
        one = ours.new_cache(1, total + 8)
        full = ours(ids[:, :end], cache=one)
        parts_cache = ours.new_cache(1, total + 8)
        parts = [ours(ids[:, a:b], cache=parts_cache) for a, b in cuts]
        torch.testing.assert_close(torch.cat(parts, 1), full, atol=ATOL, rtol=0)
        s1, s3 = states(one, 0, state_names), states(parts_cache, 0, state_names)
        assert s1 and (expect_states is None or len(s1) == expect_states), sorted(s1)
        for key in s1:
            torch.testing.assert_close(s3[key], s1[key], atol=ATOL, rtol=0)
        torch.testing.assert_close(ours(ids[:, end:], cache=parts_cache), ours(ids[:, end:], cache=one),
                                   atol=ATOL, rtol=0)


def _junk_(cache, slot=None):
    """Fill the buffers (of one slot, or all) with large values: a fresh sequence must never read them."""
    for layer in cache.layers:
        for t in layer.values():
            if t.dtype == torch.long:   # (the position bookkeeping, not a state)
                continue
            if slot is None:
                t.fill_(1e3)
            elif any(t is p for p in cache._paged):   # a paged KV tensor [K, blocks, block_size, d]
                t[:, cache.blocks(slot)] = 1e3
            else:                                     # per-slot state [slots, ...]
                t[slot].fill_(1e3)


def check_rows_at_different_positions(ours) -> None:
    """One forward of T = 5 tokens for two rows: one starts a new sequence in a slot whose buffers hold
    junk, the other continues its prompt at position 11; each row equals the row run alone."""
    a, b = _ids(rows=1, tokens=5, seed=4), _ids(rows=1, tokens=16, seed=5)
    with torch.no_grad():
        alone_a = ours(a)
        alone_b = ours(b)[:, 11:]
        cache = ours.new_cache(3, 32)
        ours(b[:, :11], cache=cache, slots=torch.tensor([0]))
        ours(_ids(rows=1, tokens=7, seed=6), cache=cache, slots=torch.tensor([2]))
        _junk_(cache, 2)
        cache.free(2)
        together = ours(torch.cat([a, b[:, 11:]]), cache=cache, slots=torch.tensor([2, 0]))
    assert cache.lengths.tolist() == [16, 0, 5]
    torch.testing.assert_close(together, torch.cat([alone_a, alone_b]), atol=ATOL, rtol=0)


def check_reused_slot(ours) -> None:
    """A slot freed after one sequence (its buffers then filled with junk) gives the next sequence exactly what
    a fresh cache gives: prefill and decode."""
    first, second = _ids(rows=1, tokens=12, seed=7), _ids(rows=1, tokens=9, seed=8)
    with torch.no_grad():
        fresh = ours.new_cache(1, 32)
        want = [ours(second, cache=fresh)] + [ours(second[:, t:t + 1], cache=fresh) for t in range(3)]
        cache = ours.new_cache(1, 32)
        ours(first, cache=cache)
        ours(first[:, :1], cache=cache)
        _junk_(cache)
        cache.free(0)
        got = [ours(second, cache=cache)] + [ours(second[:, t:t + 1], cache=cache) for t in range(3)]
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


def check_truncated_slot_is_an_error(ours) -> None:
    """Continuing a slot from any position but the one its state reached is a clear error; position 0 starts
    afresh."""
    ids = _ids(rows=1, tokens=12, seed=10)
    with torch.no_grad():
        cache = ours.new_cache(2, 32)
        ours(ids, cache=cache)
        cache.truncate(0, 5)
        with pytest.raises(ValueError, match="reached position 12, but its row starts at position 5"):
            ours(ids[:, 5:], cache=cache)
        cache.truncate(0, 0)
        torch.testing.assert_close(ours(ids, cache=cache), ours(ids), atol=ATOL, rtol=0)


def check_engine(ours) -> None:
    """dynamoe's engine with its defaults (it turns prefix reuse off for a recurrent model; no speculation) with 2
    slots for 3 requests, the third sharing the first's prompt: chunked prefill, decoding rows at different positions
    together and a slot reused by the third request give each request the greedy continuation it gets alone."""
    from dynamoe.engine import GenerationEngine
    from dynamoe.engine.sampling import SamplingParams

    assert type(ours).recurrent_state is True
    prompts = [_ids(rows=1, tokens=n, seed=20 + n)[0].tolist() for n in (19, 13)]
    prompts.append(prompts[0][:17] + [1, 2])
    engine = GenerationEngine(ours, None, max_seq_len=64, max_batch=2, prefill_chunk=5)
    assert engine.prefix_caching is False
    requests = [engine.add_request(p, SamplingParams(temperature=0.0), max_tokens=8, ignore_eos=True) for p in prompts]
    engine.run_until_done(requests)
    for p, r in zip(prompts, requests):
        assert r.output_ids == greedy(ours, torch.tensor([p]), 8)[0, len(p):].tolist()


def check_bf16(hf, path, seeds=(0, 1, 2, 3), *, hf16=None) -> None:
    """bf16 weights: the recurrent states stay fp32 (conv windows in the cache's dtype), cached decode runs, and over
    a few prompts the logits are no further from the fp32 ones than transformers' own bf16 logits are (random
    layers amplify rounding, differently for each prompt: the errors are summed over the prompts). ``hf16``:
    transformers' bf16 model (default: ``hf`` cast whole; a family whose modules transformers keeps in fp32 passes
    its ``from_pretrained(path, dtype=torch.bfloat16)``)."""
    import copy

    import dynamoe.models as dm

    ours = dm.load(path, dtype="bfloat16", progress=False)
    hf16 = copy.deepcopy(hf).to(torch.bfloat16) if hf16 is None else hf16
    ours_err = hf_err = steps_err = 0.0
    with torch.no_grad():
        for seed in seeds:
            ids = _ids(seed=seed)
            ref32 = hf(ids).logits
            full = ours(ids)
            assert full.dtype == torch.bfloat16
            ours_err += float((full.float() - ref32).abs().max())
            hf_err += float((hf16(ids).logits.float() - ref32).abs().max())
            cache = ours.new_cache(2, 32)
            steps = [ours(ids[:, :9], cache=cache)] + [ours(ids[:, t:t + 1], cache=cache) for t in range(9, 24)]
            steps_err += float((torch.cat(steps, 1).float() - ref32).abs().max())
    for layer in cache.layers:
        if "recurrent_state" in layer:
            assert layer["recurrent_state"].dtype == torch.float32
        if "conv_state" in layer:
            assert layer["conv_state"].dtype == torch.bfloat16
    assert ours_err <= 1.5 * hf_err and steps_err <= 1.5 * hf_err, (ours_err, steps_err, hf_err)
