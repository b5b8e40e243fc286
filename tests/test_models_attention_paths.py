"""The attention paths of dynamoe.models.attention against one plain float64 reference (explicit scores, a
boolean mask, softmax over the scores and, with sinks, one more logit per head that takes probability and gives
no value): GQA query heads folded into rows per key/value head (_sdpa), sinks through the flash kernel's
log-sum-exp (inference on the CPU) and through materialized scores (with autograd)."""
import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamoe.models.attention import attend


def reference(q, k, v, q_pos, k_pos, scale, window=None, sinks=None):
    """[B, H, T, dv] in float64."""
    B, H, T, d = q.shape
    K = k.size(1)
    G = H // K
    kk = k.double().repeat_interleave(G, 1)
    vv = v.double().repeat_interleave(G, 1)
    s = torch.einsum("bhtd,bhld->bhtl", q.double(), kk) * scale
    allowed = k_pos[:, None, None, :] <= q_pos[:, None, :, None]
    if window is not None:
        allowed &= k_pos[:, None, None, :] > q_pos[:, None, :, None] - window
    s = s.masked_fill(~allowed, float("-inf"))
    if sinks is not None:
        s = torch.cat([s, sinks.double().view(1, H, 1, 1).expand(B, H, T, 1)], -1)
    p = torch.softmax(s, -1)
    if sinks is not None:
        p = p[..., :-1]
    return torch.einsum("bhtl,bhld->bhtd", p, vv)


@settings(max_examples=40, deadline=None)
@given(B=st.integers(1, 3), K=st.sampled_from([1, 2, 4]), G=st.sampled_from([1, 2, 4]), T=st.integers(1, 9),
       past=st.integers(0, 40), window=st.sampled_from([None, 3, 16]), sinks=st.booleans(), seed=st.integers(0, 99))
def test_cached_attention_equals_the_reference(B, K, G, T, past, window, sinks, seed):
    g = torch.Generator().manual_seed(seed)
    H, d, L = K * G, 8, past + T
    q = torch.randn(B, H, T, d, generator=g)
    k = torch.randn(B, K, L, d, generator=g)
    v = torch.randn(B, K, L, d, generator=g)
    starts = torch.randint(0, past + 1, (B,), generator=g)       # rows at their own positions (continuous batching)
    q_pos = starts[:, None] + torch.arange(T)
    k_pos = torch.arange(L).expand(B, L)
    s_H = torch.randn(H, generator=g) if sinks else None
    with torch.inference_mode():
        got = attend(q, k, v, q_pos, k_pos, 0.3, window, s_H)
    want = reference(q, k, v, q_pos, k_pos, 0.3, window, s_H)
    torch.testing.assert_close(got.double(), want, atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_sinks_with_autograd_take_the_materialized_path_and_agree(dtype):
    g = torch.Generator().manual_seed(1)
    B, K, G, T, L, d = 2, 2, 4, 5, 12, 16
    q = torch.randn(B, K * G, T, d, generator=g).to(dtype)
    k = torch.randn(B, K, L, d, generator=g).to(dtype)
    v = torch.randn(B, K, L, d, generator=g).to(dtype)
    q_pos = torch.tensor([[7, 8, 9, 10, 11], [3, 4, 5, 6, 7]])
    k_pos = torch.arange(L).expand(B, L)
    sinks = torch.randn(K * G, generator=g)
    with torch.inference_mode():
        fast = attend(q, k, v, q_pos, k_pos, 0.25, None, sinks)           # flash kernel + log-sum-exp
    qg = q.clone().requires_grad_(True)
    slow = attend(qg, k, v, q_pos, k_pos, 0.25, None, sinks)              # scores materialized (autograd)
    slow.float().sum().backward()
    assert qg.grad is not None and torch.isfinite(qg.grad).all()
    want = reference(q, k, v, q_pos, k_pos, 0.25, None, sinks)
    tol = 1e-5 if dtype == torch.float32 else 3e-2
    torch.testing.assert_close(fast.double(), want, atol=tol, rtol=tol)
    torch.testing.assert_close(slow.detach().double(), want, atol=tol, rtol=tol)


@settings(max_examples=30, deadline=None)
@given(K=st.sampled_from([1, 2, 4]), G=st.sampled_from([1, 3, 4]), T=st.integers(2, 12), past=st.integers(12, 60),
       dtype=st.sampled_from([torch.float32, torch.bfloat16]), seed=st.integers(0, 99))
def test_a_chunk_over_its_cached_prefix_splits_and_equals_the_reference(K, G, T, past, dtype, seed):
    """One sequence's chunk at the end of its keys: the prefix without a mask and the chunk's causal square,
    merged by log-sum-exp (the threshold lowered so that small shapes take that path)."""
    from unittest import mock

    from dynamoe.models import attention

    g = torch.Generator().manual_seed(seed)
    H, d, L = K * G, 16, past + T
    q, k, v = (torch.randn(1, n, m, d, generator=g).to(dtype) for n, m in ((H, T), (K, L), (K, L)))
    q_pos, k_pos = torch.arange(past, L)[None], torch.arange(L)[None]
    calls = []
    split = attention._prefix_then_causal
    with mock.patch.object(attention, "_SPLIT_MIN_PREFIX", 0), \
            mock.patch.object(attention, "_prefix_then_causal", lambda *a: calls.append(1) or split(*a)):
        with torch.inference_mode():
            got = attend(q, k, v, q_pos, k_pos, 0.3)
            shifted = attend(q, k, v, q_pos - 1, k_pos, 0.3)     # not at the end of its keys: the masked path
    assert len(calls) == (1 if past >= T else 0) and got.dtype == dtype
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    torch.testing.assert_close(got.double(), reference(q, k, v, q_pos, k_pos, 0.3), atol=tol, rtol=tol)
    torch.testing.assert_close(shifted.double(), reference(q, k, v, q_pos - 1, k_pos, 0.3), atol=tol, rtol=tol)


def test_a_long_prompt_chunked_equals_it_whole():
    """A chunk over a cached prefix past the split threshold (what a long prompt beside running streams, or a new
    turn after a cached conversation, runs) attends as the same queries of the whole prompt's causal pass."""
    from dynamoe.models import attention

    L, T = attention._SPLIT_MIN_PREFIX + 40, 24
    g = torch.Generator().manual_seed(3)
    q = torch.randn(1, 8, L, 16, generator=g)
    k = torch.randn(1, 2, L, 16, generator=g)
    v = torch.randn(1, 2, L, 16, generator=g)
    with torch.inference_mode():
        whole = attend(q, k, v, torch.arange(L)[None], None, 0.25)
        chunk = attend(q[:, :, L - T:], k, v, torch.arange(L - T, L)[None], torch.arange(L)[None], 0.25)
    assert attention._is_chunk_over_its_prefix(q[:, :, L - T:], k, v, torch.arange(L - T, L)[None])
    torch.testing.assert_close(chunk, whole[:, :, L - T:], atol=1e-5, rtol=1e-5)


@settings(max_examples=40, deadline=None)
@given(blocks=st.permutations(list(range(12))), start=st.integers(0, 47), n=st.integers(0, 48))
def test_cache_spans_are_the_rows_run_by_run(blocks, start, n):
    """KVCache.spans: views over each run of consecutive blocks, together the positions rows() gathers."""
    from dynamoe.models.cache import KVCache

    cache = KVCache(1, 48, 1, block_size=4, num_blocks=12)
    cache.set_blocks(0, blocks, 48)
    pool = cache.kv_pool(0, "k", 2, 3)
    pool.copy_(torch.randn(pool.shape))
    stop = min(48, start + n)
    used = blocks[start // 4:-(-stop // 4)]
    runs = sum(1 for a, b in zip(used, used[1:]) if b != a + 1) + 1 if stop > start else 0
    got, again = cache.spans((pool, pool.neg()), 0, start, stop, most=12)
    assert len(again) == len(got) and all(torch.equal(a, -b) for a, b in zip(again, got))   # one table, each pool
    assert len(got) == runs and all(t._base is not None for t in got)                      # views, no copies
    want = cache.rows(pool, torch.tensor([0]), 48)[:, :, start:stop]
    assert torch.equal(torch.cat(got, dim=2), want) if got else want.size(2) == 0
    assert runs == 0 or cache.spans((pool,), 0, start, stop, most=runs - 1) is None          # past the most: None


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("blocks", [list(range(40)), [7] + list(range(20, 59)), [3, 4] + list(range(30, 45)) + [9]
                                    + list(range(50, 72)), list(range(79, 39, -1))])
def test_a_chunk_over_a_prefix_in_runs_of_blocks_equals_the_reference(blocks, dtype):
    """Attention.attend_cached for a chunk whose cached prefix lies in one run of blocks, in a few (a prefix-cached
    prompt: its shared blocks, then its own), or in one run per block (past the most runs: one gathered copy):
    attention run by run straight from the blocks, the same as the float64 reference over all its keys."""
    from dynamoe.models import attention
    from dynamoe.models.cache import KVCache

    K, G, d, bs, T = 2, 3, 16, 8, 24
    L = len(blocks) * bs - 5
    P = L - T
    g = torch.Generator().manual_seed(len(blocks))
    k, v = (torch.randn(1, K, L, d, generator=g).to(dtype) for _ in range(2))
    q = torch.randn(1, K * G, T, d, generator=g).to(dtype)
    cache = KVCache(1, 80 * bs, 1, dtype, block_size=bs, num_blocks=80)
    cache.set_blocks(0, blocks, 0)
    slots = torch.tensor([0])
    layer = attention.Attention.__new__(attention.Attention)
    torch.nn.Module.__init__(layer)
    layer.layer_idx, layer.scale = 0, 0.3
    cache.put(0, slots, torch.arange(P)[None], k=k[:, :, :P], v=v[:, :, :P])   # the cached prefix
    calls = []
    runs = attention._runs_then_causal
    with torch.inference_mode(), \
            mock_patch(attention, "_runs_then_causal", lambda q_, ks, *a: calls.append(len(ks)) or runs(q_, ks, *a)):
        got = layer.attend_cached(q, k[:, :, P:], v[:, :, P:], torch.arange(P, L)[None], cache, slots, L)
    cuts = sum(1 for a, b in zip(blocks[:-(-P // bs)], blocks[1:-(-P // bs)]) if b != a + 1)
    assert calls == [cuts + 1 if cuts + 1 <= attention._MOST_PREFIX_RUNS else 1]
    tol = 2e-5 if dtype == torch.float32 else 2e-2
    want = reference(q, k, v, torch.arange(P, L)[None], torch.arange(L)[None], 0.3)
    torch.testing.assert_close(got.double(), want, atol=tol, rtol=tol)


def mock_patch(obj, name, value):
    from unittest import mock

    return mock.patch.object(obj, name, value)
