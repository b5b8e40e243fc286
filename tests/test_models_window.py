"""Sliding-window attention over long sequences attends each block of queries over only the keys its
window reaches (linear cost): the result equals attention over all keys with the window mask -- without
a cache (training, a whole prompt), with a cache (chunked or cached prefill, rows at other positions),
with GPT-OSS sinks, and where positions do not grow (padded rows), where it falls back to the full mask.
The reference below builds the scores with plain loops over positions, not the library's mask."""
import math

import pytest
import torch

from dynamoe.models import attention
from dynamoe.models.attention import attend


def reference(q, k, v, q_pos, k_pos, scale, window, sinks=None, prefix=None):
    """softmax over the visible keys of each query, written out per (row, head, query) in fp64 (``prefix``: each
    row's key positions below it visible outside the window)."""
    B, H, T, d = q.shape
    K = k.size(1)
    out = torch.zeros(B, H, T, d, dtype=torch.float64)
    for b in range(B):
        for h in range(H):
            kh = h // (H // K)
            for t in range(T):
                p = int(q_pos[b, t])
                vis = [j for j in range(k.size(2)) if int(k_pos[b, j]) <= p and (
                    window is None or int(k_pos[b, j]) > p - window or (prefix is not None and int(k_pos[b, j]) < prefix[b]))]
                s = torch.stack([q[b, h, t].double() @ k[b, kh, j].double() * scale for j in vis])
                if sinks is not None:
                    s = torch.cat([s, sinks[h].double().view(1)])
                w = torch.softmax(s, 0)[:len(vis)]
                out[b, h, t] = (w[:, None] * v[b, kh, vis].double()).sum(0)
    return out


def _qkv(B, H, K, T, L, d, seed=0):
    g = torch.Generator().manual_seed(seed)
    return (torch.randn(B, H, T, d, generator=g), torch.randn(B, K, L, d, generator=g),
            torch.randn(B, K, L, d, generator=g))


@pytest.mark.parametrize("sinks", [False, True])
def test_uncached_long_sequence_equals_full_window_mask(sinks, monkeypatch):
    B, H, K, T, d, W = 2, 4, 2, 70, 8, 16
    q, k, v = _qkv(B, H, K, T, T, d)
    pos = torch.arange(T).expand(B, T) + torch.tensor([[0], [9]])  # rows at other offsets
    s = torch.randn(H) if sinks else None
    seen = []
    real = attention._masked
    monkeypatch.setattr(attention, "_masked", lambda q_, k_, *a: seen.append(k_.size(2)) or real(q_, k_, *a))
    got = attend(q, k, v, pos, None, 0.3, W, s)
    assert max(seen) <= 2 * W and len(seen) == math.ceil(T / W)  # blocks over windows, not all keys
    torch.testing.assert_close(got.double(), reference(q, k, v, pos, pos, 0.3, W, s), atol=1e-5, rtol=1e-5)


def test_window_with_a_prefix_in_sight():
    """Unlimited-OCR's reference window: each row's keys before its prefix length stay visible (a chunk of rows
    with other prefixes, queries inside and past their prefix: all over the keys, not in window blocks)."""
    B, H, K, T, L, d, W = 2, 2, 1, 20, 60, 8, 6
    q, k, v = _qkv(B, H, K, T, L, d, seed=3)
    q_pos = torch.stack([torch.arange(40, 60), torch.arange(30, 50)])
    k_pos = torch.arange(L).expand(B, L)
    P = torch.tensor([45, 12])
    got = attend(q, k, v, q_pos, k_pos, 0.25, W, prefix_B=P)
    torch.testing.assert_close(got.double(), reference(q, k, v, q_pos, k_pos, 0.25, W, prefix=P.tolist()),
                               atol=1e-5, rtol=1e-5)
    assert (got - attend(q, k, v, q_pos, k_pos, 0.25, W)).abs().max() > 1e-3
    with pytest.raises(ValueError, match="prefix_B .* needs a window"):
        attend(q, k, v, q_pos, k_pos, 0.25, None, prefix_B=P)


def test_cached_chunk_at_other_positions_equals_full_window_mask(monkeypatch):
    B, H, K, T, L, d, W = 2, 2, 1, 20, 90, 8, 12
    q, k, v = _qkv(B, H, K, T, L, d, seed=1)
    q_pos = torch.stack([torch.arange(60, 80), torch.arange(70, 90)])  # a chunk of each row's prompt
    k_pos = torch.arange(L).expand(B, L)
    seen = []
    real = attention._masked
    monkeypatch.setattr(attention, "_masked", lambda q_, k_, *a: seen.append(k_.size(2)) or real(q_, k_, *a))
    got = attend(q, k, v, q_pos, k_pos, 0.25, W)
    assert max(seen) < L
    torch.testing.assert_close(got.double(), reference(q, k, v, q_pos, k_pos, 0.25, W), atol=1e-5, rtol=1e-5)


def test_positions_that_do_not_grow_use_the_full_mask():
    B, H, K, T, d, W = 1, 2, 2, 40, 4, 8
    q, k, v = _qkv(B, H, K, T, T, d, seed=2)
    pos = torch.cat([torch.zeros(5, dtype=torch.long), torch.arange(35)]).view(1, T)  # left padding repeats 0
    assert attention._window_spans(pos, None, T, W) is None
    torch.testing.assert_close(attend(q, k, v, pos, None, 0.5, W).double(),
                               reference(q, k, v, pos, pos, 0.5, W), atol=1e-5, rtol=1e-5)


def test_window_blocks_have_gradients_like_the_full_mask():
    B, H, K, T, d, W = 1, 2, 1, 50, 4, 10
    q, k, v = (t.requires_grad_() for t in _qkv(B, H, K, T, T, d, seed=3))
    pos = torch.arange(T).view(1, T)
    attend(q, k, v, pos, None, 0.5, W).square().sum().backward()
    grads = [t.grad.clone() for t in (q, k, v)]
    for t in (q, k, v):
        t.grad = None
    attention._masked(q, k, v, pos, pos, 0.5, W, None).square().sum().backward()
    for a, t in zip(grads, (q, k, v)):
        torch.testing.assert_close(a, t.grad, atol=1e-5, rtol=1e-5)
