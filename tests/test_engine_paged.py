"""The paged KV cache under the engine: the block allocator's invariants, reads through block tables
against a dense reference, preemption when the pool runs out, the token budget that keeps running
streams going while a long prompt prefills, and real models (sliding window, MLA) served from a small
pool -- always the tokens the request gets alone."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from engine_testing import TinyLM
from dynamoe.engine import GenerationEngine, SamplingParams
from dynamoe.models.blocks import BlockPool, OutOfBlocks, prefix_keys
from dynamoe.models.cache import KVCache

GREEDY = SamplingParams(temperature=0)
SEEDED = SamplingParams(temperature=0.9, top_p=0.95, seed=3)


@pytest.fixture(scope="module")
def model():
    return TinyLM(64, max_position_embeddings=512).eval()


def _ids(seed, n, vocab=64):
    return torch.randint(3, vocab, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _alone(model, prompt, params, n, **kw):
    e = GenerationEngine(model, max_seq_len=kw.pop("max_seq_len", 256), max_batch=1, prefix_caching=False, **kw)
    r = e.add_request(prompt, params, n, ignore_eos=True)
    e.run_until_done()
    return r.output_ids


# --- the allocator ------------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["alloc", "release", "register", "lookup"]), st.integers(0, 7)),
                max_size=80))
def test_block_pool_never_leaks_or_double_uses(ops):
    pool = BlockPool(6)
    held: list[list[int]] = [[] for _ in range(3)]     # three sequences' blocks
    keys = [bytes([k]) * 16 for k in range(8)]
    for op, x in ops:
        seq = held[x % 3]
        if op == "alloc":
            try:
                b = pool.allocate()
            except OutOfBlocks:
                assert pool.num_free == 0
                continue
            assert all(b not in s for s in held)     # a fresh block is nobody's
            seq.append(b)
        elif op == "release" and seq:
            pool.release([seq.pop()])
        elif op == "register" and seq:
            pool.register(seq[-1], keys[x])
        elif op == "lookup":
            seq.extend(pool.lookup([keys[x]]))
        pool.check()
        assert pool.num_used == len({b for s in held for b in s})
        assert sum(len(s) for s in held) == sum(pool.refcount(b) for b in range(6))
    for s in held:
        pool.release(s)
    pool.check()
    assert pool.num_used == 0 and pool.num_free == 6


def test_block_pool_evicts_the_least_recently_released_prefix():
    pool = BlockPool(3)
    a, b, c = pool.allocate_many(3)
    for blk, k in ((a, b"a"), (b, b"b"), (c, b"c")):
        pool.register(blk, k * 16)
    pool.release([b])
    pool.release([a])
    pool.release([c])
    assert pool.num_cached == 3 and pool.allocate() == b      # b was released first
    assert pool.lookup([b"b" * 16]) == [] and pool.lookup([b"a" * 16]) == [a]
    with pytest.raises(OutOfBlocks):
        pool.allocate_many(3)
    with pytest.raises(ValueError, match="released more often"):
        pool.release([b, b])


def test_new_runs_start_in_the_middle_of_the_largest_free_run():
    pool = BlockPool(100)
    assert pool.allocate_many(3) == [0, 1, 2]             # an empty pool: from its start
    assert pool.allocate() == 51                          # free 3..99: its middle
    assert pool.allocate(prefer=3) == 3                   # a free preferred block is taken as asked
    assert pool.allocate(prefer=3) == 76                  # a taken one: the middle of the largest run (52..99)
    pool.release([0, 1, 2, 3])
    assert pool.allocate() == 0                           # 0..50 is now the largest run: it starts at the pool's start
    pool.check()


def test_sequences_growing_side_by_side_stay_one_run_each():
    # a long prompt prefilling in chunks beside decoding streams: none gathers on read (each new run starts in the
    # middle of the largest free one: the fifth sequence's room is an eighth of the pool, 160 blocks, here)
    cache = KVCache(5, 4096, 1, block_size=16)
    lengths = [0] * 5
    for step in range(150):
        grow = [(s, 1) for s in range(4)] + [(4, 16)]       # four streams decode, slot 4 prefills 16 a step
        for s, n in grow:
            cache.check_room(torch.tensor([s]), n)
            lengths[s] += n
            cache.advance(torch.tensor([s]), n)
    pool = cache.kv_pool(0, "k", 1, 2)
    for s in range(5):
        assert cache._consecutive[s] == len(cache.blocks(s)), f"slot {s} is scattered: {cache.blocks(s)}"
        view = cache.rows(pool, torch.tensor([s]), lengths[s])
        assert view.untyped_storage().data_ptr() == pool.untyped_storage().data_ptr()   # a view, no copy


def test_prefix_keys_name_whole_prefixes():
    t = _ids(0, 40)
    k = prefix_keys(t, 8)
    assert len(k) == 5 and len(set(k)) == 5
    assert prefix_keys(t[:17], 8) == k[:2]                          # partial blocks have no key
    assert prefix_keys(t[16:], 8, parent=k[1]) == k[2:]             # chained from a parent
    u = list(t)
    u[3] += 1
    assert all(x != y for x, y in zip(prefix_keys(u, 8), k))        # one token changes every later key
    v = t[:8] + t[:8]
    assert prefix_keys(v, 8)[1] != prefix_keys(v, 8)[0]             # same block, other prefix


# --- reads and writes through block tables ---------------------------------------------------------------

def test_paged_reads_equal_a_dense_reference():
    g = torch.Generator().manual_seed(0)
    cache = KVCache(3, 40, 1, block_size=4, num_blocks=60)
    for b in range(0, 60, 2):   # every other block held elsewhere: runs of one free block, reads must gather
        assert cache.pool.allocate(prefer=b) == b
    dense = torch.zeros(3, 2, 40, 5)
    lengths = [0, 0, 0]
    # interleaved growth: the slots' blocks end up scattered over the pool
    for step, (slots, T) in enumerate([([0, 2], 3), ([1], 9), ([2, 0, 1], 1), ([0], 7), ([1, 2], 5), ([2], 1)]):
        s = torch.tensor(slots)
        starts = cache.check_room(s, T)
        assert starts.tolist() == [lengths[x] for x in slots]
        pos = starts[:, None] + torch.arange(T)
        new = torch.randn(len(slots), 2, T, 5, generator=g)
        kv_len = int(pos.max()) + 1
        got = cache.write(0, s, pos, kv_len, k=new)["k"]
        for i, x in enumerate(slots):
            dense[x, :, lengths[x]:lengths[x] + T] = new[i]
            lengths[x] += T
            assert torch.equal(got[i, :, :lengths[x]], dense[x, :, :lengths[x]])
        cache.advance(s, T)
    assert any(cache._consecutive[x] < len(cache.blocks(x)) for x in range(3))   # really scattered
    cache.pool.check()
    # put + gather (a layer that reads a few positions): the same entries as the dense reference, any order
    pool = cache.put(0, torch.tensor([1]), torch.tensor([[lengths[1]]]), k=torch.ones(1, 2, 1, 5))["k"]
    dense[1, :, lengths[1]] = 1.0
    at = torch.tensor([[0, 5, 3, lengths[0] - 1], [lengths[1], 2, 11, 7]])
    got = cache.gather(pool, torch.tensor([0, 1]), at)
    for i, x in enumerate((0, 1)):
        assert torch.equal(got[i], dense[x][:, at[i]])


def test_truncating_into_a_shared_block_copies_it_first():
    cache = KVCache(2, 16, 1, block_size=4)
    s0, s1 = torch.tensor([0]), torch.tensor([1])
    cache.check_room(s0, 8)
    old = torch.arange(8.0).view(1, 1, 8, 1)
    cache.write(0, s0, torch.arange(8)[None], 8, k=old)
    cache.advance(s0, 8)
    b0, b1 = cache.blocks(0)
    for blk in (b0, b1):
        cache.pool.retain(blk)
    cache.attach(1, [b0, b1], 8)            # slot 1 starts on slot 0's two blocks
    cache.truncate(1, 6)                     # and will overwrite positions 6.. of the second one
    assert cache.blocks(1)[0] == b0 and cache.blocks(1)[1] != b1
    cache.write(0, s1, torch.tensor([[6]]), 7, k=torch.full((1, 1, 1, 1), -1.0))
    assert torch.equal(cache.write(0, s0, torch.tensor([[7]]), 8, k=old[:, :, 7:])["k"], old)   # slot 0 intact
    cache.free(0)
    cache.free(1)
    cache.pool.check()
    assert cache.pool.num_used == 0


# --- the engine over a small pool --------------------------------------------------------------------------

@pytest.mark.parametrize("params", [GREEDY, SEEDED], ids=["greedy", "seeded"])
def test_preemption_when_the_pool_runs_out_keeps_every_output(model, params):
    prompts = [_ids(i, n) for i, n in enumerate([10, 14, 7])]
    # 12 blocks of 4 = 48 positions for three requests of up to 14 + 24 positions each
    engine = GenerationEngine(model, max_seq_len=64, max_batch=3, kv_cache_blocks=12, block_size=4)
    reqs = [engine.add_request(p, params, 24, ignore_eos=True) for p in prompts]
    engine.run_until_done()
    assert engine.totals["preempted"] > 0
    for p, r in zip(prompts, reqs):
        assert r.finish_reason == "length" and r.output_ids == _alone(model, p, params, 24)
        assert r.stats.cached_tokens == 0      # usage counts the first admission only
    assert engine.cache_stats()["blocks_used"] == 0
    engine.cache.pool.check()


def test_a_request_larger_than_the_pool_is_refused_by_name(model):
    engine = GenerationEngine(model, max_seq_len=64, max_batch=2, kv_cache_blocks=3, block_size=4)
    with pytest.raises(ValueError, match="kv_cache_blocks=3"):
        engine.add_request(_ids(0, 13), GREEDY, 1)
    with pytest.raises(ValueError, match="lower max_tokens to at most 2"):
        engine.add_request(_ids(0, 10), GREEDY, 5)
    r = engine.add_request(_ids(0, 10), GREEDY, None, ignore_eos=True)
    engine.run_until_done()
    assert r.finish_reason == "context" and len(r.output_ids) == 2
    with pytest.raises(ValueError, match="kv_cache_blocks must be None or an int >= 1"):
        GenerationEngine(model, kv_cache_blocks=0)


def test_a_long_prompt_never_stalls_running_streams(model):
    """While a long prompt prefills, every step decodes each running request once and spends only the
    rest of the token budget on the prompt's chunks."""
    engine = GenerationEngine(model, max_seq_len=256, max_batch=3, token_budget=16, block_size=4)   # fixed
    running = [engine.add_request(_ids(i, 5), GREEDY, 40, ignore_eos=True) for i in range(2)]
    engine.step()
    assert all(len(r.output_ids) == 1 for r in running)
    long = engine.add_request(_ids(9, 150), GREEDY, 5, ignore_eos=True)
    model.calls.clear()
    steps = 0
    while not long.output_ids:
        before = [len(r.output_ids) for r in running]
        engine.step()
        steps += 1
        assert [len(r.output_ids) for r in running] == [n + 1 for n in before]   # nobody waited
    assert steps == -(-150 // 14)
    assert all(c == (2, 1) or c[1] <= 14 for c in model.calls)                  # decode rows + chunk <= 16
    engine.run_until_done()
    assert long.output_ids == _alone(model, long.prompt_ids, GREEDY, 5)
    for r in running:
        assert r.output_ids == _alone(model, r.prompt_ids, GREEDY, 40)


def test_chunk_cost_fit_and_the_tokens_within_a_time():
    from dynamoe.engine.budget import ChunkCost

    c = ChunkCost()
    assert c.tokens_within(1.0, 100) is None
    c.observe(10, 0.030)                       # one size: all of it per token
    assert c.fit() == (0.0, pytest.approx(0.003)) and c.tokens_within(0.060, 100) == 20
    # ... but over the target, one size cannot tell a fixed part from per-token cost: half the size (a second size
    # for the fit, and a stall no longer than the last one's -- twice the size doubled the longest gaps)
    assert c.tokens_within(0.015, 100) == 5
    assert c.tokens_within(0.015, 8) == 4       # (half of what the cap allows)
    c.observe(11, 0.031)                       # nearby sizes are still one (their slope would be noise)
    assert c.fit()[0] == 0.0 and c.tokens_within(0.015, 100) == int(c._m[0]) // 2
    one = ChunkCost()
    one.observe(1, 0.030)
    assert one.tokens_within(0.015, 100) == 2   # from one token: two (nothing smaller to try)
    assert c.tokens_within(0.015, 100, least=8) == 2 * int(c._m[0])   # half is below the least chunk: twice
    for n in (4, 16, 8, 32, 4, 64, 12):        # a = 20 ms fixed, b = 1 ms a token
        c.observe(n, 0.020 + 0.001 * n)
    a, b = c.fit()
    assert a == pytest.approx(0.020, rel=0.05) and b == pytest.approx(0.001, rel=0.05)
    assert c.tokens_within(0.050, 100) in (29, 30)
    assert c.tokens_within(0.010, 100) in (19, 20)   # the fixed part alone is over: tokens worth as much
    from dynamoe.engine.budget import GROWTH_FLOOR

    mean = c._m[0]
    assert c.tokens_within(1.0, 1000) == max(int(2 * mean) + 1, GROWTH_FLOOR)   # no jump past the sizes seen
    for _ in range(40):
        c.observe(300, 0.020 + 0.001 * 300)
    assert c.tokens_within(1.0, 1000) == int(2 * c._m[0]) + 1 > GROWTH_FLOOR
    # settled on one size (the budget's steady state), each chunk dearer (a growing context): the slope last read,
    # scaled to that size's time now -- no probe, and no answer past the target
    for _ in range(60):
        c.observe(30, 0.075)
    a, b = c.fit()
    assert c._degenerate() and a > 0 and b > 0 and a + b * 30 == pytest.approx(0.075, rel=1e-3)
    assert a / b == pytest.approx(c._shape[0] / c._shape[1])
    assert 1 <= c.tokens_within(0.060, 100) < 30 and c.tokens_within(0.090, 100) > 30


def test_the_prefill_budget_follows_the_measured_speeds(model):
    engine = GenerationEngine(model, max_seq_len=256, max_batch=3, block_size=4)
    assert engine.adaptive_budget and engine._prefill_budget(2) == 4     # a block until measured
    engine._decode_s = 0.010
    for n in (10, 20, 40, 30):
        engine._chunk_cost.observe(n, 0.001 * n)                        # 1 ms a token, no fixed part
    assert engine._prefill_budget(2) == int(engine.stall_ratio * 10)
    fixed = GenerationEngine(model, max_seq_len=256, max_batch=3, token_budget=40)
    assert not fixed.adaptive_budget and fixed._prefill_budget(2) == 38
    # measured as it runs: a long prompt beside streams ends with both averages set, same tokens
    running = [engine.add_request(_ids(i, 5), GREEDY, 30, ignore_eos=True) for i in range(2)]
    engine.step()
    long = engine.add_request(_ids(9, 120), GREEDY, 3, ignore_eos=True)
    engine.run_until_done()
    assert engine._decode_s > 0 and engine._chunk_cost.fit() is not None
    assert long.output_ids == _alone(model, long.prompt_ids, GREEDY, 3)
    assert all(r.output_ids == _alone(model, r.prompt_ids, GREEDY, 30) for r in running)


def test_concurrent_requests_share_one_prefix(model):
    """Six requests with the same long prefix sent together after one warm request: each reads the
    prefix's blocks from the cache, and prefills only its own tail."""
    prefix = _ids(5, 96)
    engine = GenerationEngine(model, max_seq_len=256, max_batch=6, block_size=16)
    warm = engine.add_request(prefix + [7], GREEDY, 2, ignore_eos=True)
    engine.run_until_done()
    reqs = [engine.add_request(prefix + _ids(20 + i, 4), GREEDY, 3, ignore_eos=True) for i in range(6)]
    engine.run_until_done()
    assert warm.stats.cached_tokens == 0
    assert [r.stats.cached_tokens for r in reqs] == [96] * 6
    for r in reqs:
        assert r.output_ids == _alone(model, r.prompt_ids, GREEDY, 3)
    no_cache = GenerationEngine(model, max_seq_len=256, max_batch=6, block_size=16, prefix_caching=False)
    r = no_cache.add_request(prefix + [7], GREEDY, 2, ignore_eos=True)
    no_cache.run_until_done()
    assert r.stats.cached_tokens == 0 and no_cache.cache_stats()["blocks_cached"] == 0


def test_cancelling_a_request_mid_prefill_gives_its_blocks_back(model):
    engine = GenerationEngine(model, max_seq_len=256, max_batch=2, prefill_chunk=8, block_size=4)
    r = engine.add_request(_ids(1, 60), GREEDY, 3, ignore_eos=True)
    engine.step()
    assert engine.cache_stats()["blocks_used"] == 2
    engine.cancel(r)
    assert r.finish_reason == "cancelled" and engine.cache_stats()["blocks_used"] == 0
    engine.cache.pool.check()


# --- real models from a small pool ------------------------------------------------------------------------

def _tiny_checkpoint(tmp_path, kind):
    import transformers  # a test dependency: missing is a broken install, which must fail, not skip
    from models_util import randomize_

    if kind == "window":
        cfg = transformers.Qwen3MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                          num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                          num_experts=4, num_experts_per_tok=2, max_position_embeddings=256,
                                          use_sliding_window=True, sliding_window=12, max_window_layers=0)
        hf = transformers.Qwen3MoeForCausalLM(cfg)
    else:
        cfg = transformers.DeepseekV3Config(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                            num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=4,
                                            n_routed_experts=4, num_experts_per_tok=2, n_group=1, topk_group=1,
                                            first_k_dense_replace=1, kv_lora_rank=16, q_lora_rank=None,
                                            qk_rope_head_dim=8, qk_nope_head_dim=8, v_head_dim=8,
                                            max_position_embeddings=256, rope_scaling=None)
        hf = transformers.DeepseekV3ForCausalLM(cfg)
    randomize_(hf, 0)
    hf.save_pretrained(str(tmp_path))
    return str(tmp_path)


@pytest.mark.parametrize("kind", ["window", "mla"])
def test_real_model_from_a_small_pool_equals_alone(tmp_path, kind):
    from dynamoe.models import load

    torch.set_num_threads(1)
    model = load(_tiny_checkpoint(tmp_path, kind), progress=False)
    shared = _ids(40, 32, 96)
    prompts = [shared + _ids(41, 9, 96), _ids(42, 30, 96), shared + _ids(43, 3, 96)]
    engine = GenerationEngine(model, max_seq_len=128, max_batch=3, kv_cache_blocks=10, block_size=8, token_budget=16)
    reqs = [engine.add_request(p, GREEDY, 20, ignore_eos=True) for p in prompts]
    engine.run_until_done()
    # MLA: the pool runs out, requests are preempted; sliding windows (12) on every layer: each sequence gives
    # back its blocks out of the window and all three fit
    assert engine.cache.window == (12 if kind == "window" else None)
    assert (engine.totals["preempted"] > 0) == (kind == "mla")
    for p, r in zip(prompts, reqs):
        alone = GenerationEngine(model, max_seq_len=128, max_batch=1, prefix_caching=False)
        a = alone.add_request(p, GREEDY, 20, ignore_eos=True)
        alone.run_until_done()
        assert r.output_ids == a.output_ids
    engine.cache.pool.check()


@pytest.mark.parametrize("token_budget", [None, 64])
def test_sliding_window_sequences_longer_than_the_pool(tmp_path, token_budget):
    """Every layer windowed: a sequence holds only its window's blocks (and a chunk's), so one far longer than
    the whole pool runs, with the tokens of an engine that keeps everything. A budget larger than the free
    blocks hold (a fixed 64, or a measured one on a busy machine) shrinks the chunk instead of preempting."""
    from dynamoe.models import load

    torch.set_num_threads(1)
    model = load(_tiny_checkpoint(tmp_path, "window"), progress=False)
    prompt = _ids(50, 150, 96)
    small = GenerationEngine(model, max_seq_len=256, max_batch=2, kv_cache_blocks=8, block_size=8,
                             token_budget=token_budget)
    assert small.capacity == 256 and small.cache.num_blocks * 8 == 64
    peak = 0
    r = small.add_request(prompt, GREEDY, 60, ignore_eos=True)
    other = small.add_request(_ids(51, 20, 96), GREEDY, 40, ignore_eos=True)
    while not (r.finished and other.finished):
        small.step()
        peak = max(peak, small.cache_stats()["blocks_used"])
    assert peak <= 8 and small.totals["preempted"] == 0
    for req in (r, other):
        big = GenerationEngine(model, max_seq_len=256, max_batch=1, prefix_caching=False)
        ref = big.add_request(req.prompt_ids, GREEDY, len(req.output_ids), ignore_eos=True)
        big.run_until_done()
        assert req.output_ids == ref.output_ids
    small.cache.pool.check()
    with pytest.raises(ValueError, match="given back"):
        c = model.new_cache(1, 64, block_size=4)
        c.check_room(torch.tensor([0]), 40)
        c.advance(torch.tensor([0]), 40)
        assert c.trim(0) == (40 - 12 + 1) // 4
        c.truncate(0, 8)
