"""dynamoe.net collectives on 2 and 4 gloo ranks: values and gradients against an all-ranks
simulation written with plain torch ops (every rank can build every rank's inputs from seeds)."""
import pytest
import torch

from dist_harness import run_ranks
from dynamoe import net


def inputs(world, shape, seed=0, requires_grad=True):
    g = torch.Generator().manual_seed(seed)
    return [torch.randn(*shape, generator=g, dtype=torch.float64).requires_grad_(requires_grad) for _ in range(world)]


def check(rank, fn_dist, fn_sim, xs, gs):
    """Compare rank's output and input gradient with the simulation over all ranks."""
    x = xs[rank].detach().clone().requires_grad_()
    y = fn_dist(x)
    (y * gs[rank]).sum().backward()
    ys = fn_sim(xs)
    sum((yy * gg).sum() for yy, gg in zip(ys, gs)).backward()
    torch.testing.assert_close(y, ys[rank])
    torch.testing.assert_close(x.grad, xs[rank].grad)


def collectives_worker(rank, world):
    W = world
    # all_to_all(x, 1, 0): [W*L, C, D] -> [L, W*C, D]
    xs = inputs(W, (W * 2, 3, 4), seed=1)
    gs = [t.detach() for t in inputs(W, (2, W * 3, 4), seed=2, requires_grad=False)]
    check(rank, lambda x: net.all_to_all(x, 1, 0),
          lambda xs: [torch.cat([xs[j].chunk(W, 0)[r] for j in range(W)], dim=1) for r in range(W)], xs, gs)
    # 2DH: two-level exchange (nodes of 2 ranks) equals the flat one, values and gradients
    if W == 4:
        import os
        os.environ["LOCAL_SIZE"] = "2"
        check(rank, lambda x: net.all_to_all(x, 1, 0, use_2dh=True),
              lambda xs: [torch.cat([xs[j].chunk(W, 0)[r] for j in range(W)], dim=1) for r in range(W)],
              [t.detach().clone().requires_grad_() for t in xs], gs)
        y2 = net.all_to_all(xs[rank].detach(), 0, 2, use_2dh=True) if xs[rank].size(2) % W == 0 else None
        if y2 is not None:
            torch.testing.assert_close(y2, net.all_to_all(xs[rank].detach(), 0, 2))
    # and back: all_to_all(y, 0, 1) undoes it
    x = inputs(W, (W * 2, 3, 4), seed=3, requires_grad=False)[rank]
    torch.testing.assert_close(net.all_to_all(net.all_to_all(x, 1, 0), 0, 1), x)
    # all_to_all_single
    xs = inputs(W, (W * 3, 2), seed=4)
    gs = [t.detach() for t in inputs(W, (W * 3, 2), seed=5, requires_grad=False)]
    check(rank, net.all_to_all_single,
          lambda xs: [torch.cat([xs[j].chunk(W, 0)[r] for j in range(W)]) for r in range(W)], xs, gs)
    # all_gather along dim 1, fused: gradient = sum over ranks of each slice
    xs = inputs(W, (3, 2), seed=6)
    gs = [t.detach() for t in inputs(W, (3, 2 * W), seed=7, requires_grad=False)]
    check(rank, lambda x: net.all_gather(x, 1, fused=True), lambda xs: [torch.cat(xs, 1) for _ in range(W)], xs, gs)
    # Tutel's default (not fused): the gradient is this rank's own slice
    x = xs[rank].detach().clone().requires_grad_()
    (net.all_gather(x, 1) * gs[rank]).sum().backward()
    torch.testing.assert_close(x.grad, gs[rank].chunk(W, 1)[rank])
    # spatial_split: own chunk forward, gradient all-gathered (own slice of each rank's gradient)
    x = xs[rank].detach().repeat(W, 1).requires_grad_()
    y = net.spatial_split(x, 0)
    torch.testing.assert_close(y, xs[rank].detach())
    y.backward(torch.full_like(y, float(rank + 1)))
    torch.testing.assert_close(x.grad, torch.cat([torch.full_like(y, float(r + 1)) for r in range(W)]))
    # reduce_scatter along dim 0
    xs = inputs(W, (2 * W, 3), seed=8)
    gs = [t.detach() for t in inputs(W, (2, 3), seed=9, requires_grad=False)]
    check(rank, lambda x: net.reduce_scatter(x, 0), lambda xs: list(sum(xs).chunk(W, 0)), xs, gs)
    # zero_gather / zero_scatter
    xs = inputs(W, (2, 3), seed=10)
    gs = [t.detach() for t in inputs(W, (W * 2, 3), seed=11, requires_grad=False)]
    check(rank, net.zero_gather, lambda xs: [torch.cat(xs) for _ in range(W)], xs, gs)
    full = inputs(W, (W, 5), seed=12, requires_grad=False)[0]
    shard, shape = net.zero_scatter(full, net.simple_split)
    torch.testing.assert_close(shard, full.reshape(-1).chunk(W)[rank])
    assert shape == full.shape
    odd = torch.arange(7.0)  # padded with zeros to a multiple of W, cut back by zero_gather's full_shape
    torch.testing.assert_close(net.zero_gather(net.zero_scatter(odd, net.simple_split)[0], full_shape=[7]), odd)
    # all_to_all_v with uneven and zero-length splits
    counts = [[(r + j) % 3 for j in range(W)] for r in range(W)]
    xs = [torch.randn(sum(counts[r]), 4, dtype=torch.float64, generator=torch.Generator().manual_seed(20 + r)).requires_grad_()
          for r in range(W)]

    def sim_a2a_v(xs):
        out = []
        for r in range(W):
            parts = []
            for j in range(W):
                start = sum(counts[j][:r])
                parts.append(xs[j][start:start + counts[j][r]])
            out.append(torch.cat(parts))
        return out

    gs = [torch.randn(sum(counts[j][r] for j in range(W)), 4, dtype=torch.float64,
                      generator=torch.Generator().manual_seed(40 + r)) for r in range(W)]
    check(rank, lambda x: net.all_to_all_v(x, counts[rank]), sim_a2a_v, xs, gs)
    # batch_all_gather_v: rank r holds r rows (rank 0: none)
    rows = [torch.full((r, 2), float(r), dtype=torch.float64) for r in range(W)]
    got, sizes = net.batch_all_gather_v([rows[rank], rows[rank] * 2])  # Tutel's: flat, element counts
    torch.testing.assert_close(got[0], torch.cat(rows).reshape(-1))
    torch.testing.assert_close(got[1], torch.cat(rows).reshape(-1) * 2)
    assert sizes.tolist() == [2 * r for r in range(W)]
    torch.testing.assert_close(net.all_gather_v(rows[rank]), torch.cat(rows))
    # bad input fails before any collective (no rank waits)
    with pytest.raises(ValueError, match="divisible"):
        net.all_to_all_single(torch.zeros(W + 1, 2))
    with pytest.raises(ValueError, match="send_counts"):
        net.all_to_all_v(torch.zeros(3, 2), [1] * (W + 1))
    # groups: model groups of 2 consecutive ranks
    if W % 2 == 0:
        groups = net.create_groups_from_world(-2)
        assert groups.model_size == 2 and groups.data_size == W // 2
        v = torch.tensor([float(rank)])
        total = net.simple_all_reduce(v, group=groups.model_group)  # Tutel: a new tensor by default
        base = rank - rank % 2
        assert total.item() == base + base + 1 and v.item() == rank
        net.simple_all_reduce(v, group=groups.model_group, inplace=True)
        assert v.item() == base + base + 1
        assert net.create_groups_from_world(-2) is groups


@pytest.mark.parametrize("world", [2, 4])
def test_collectives(world):
    run_ranks(world, collectives_worker, timeout=180)


def test_single_process_fallbacks():
    x = torch.randn(4, 3)
    assert net.get_world_size() == 1 and net.get_world_rank() == 0
    assert net.all_to_all(x, 1, 0) is x and net.all_gather(x) is x
    assert net.all_to_all_v(x, [4]) is x
    torch.testing.assert_close(net.zero_gather(x), x)
    with pytest.raises(ValueError, match="send_counts"):
        net.all_to_all_v(x, [3])


def test_timeout_env_is_validated(monkeypatch):
    monkeypatch.setenv(net.TIMEOUT_ENV, "soon")
    with pytest.raises(ValueError, match="DYNAMOE_COLLECTIVE_TIMEOUT_SEC"):
        net.collective_timeout()
    monkeypatch.setenv(net.TIMEOUT_ENV, "2.5")
    assert net.collective_timeout().total_seconds() == 2.5


def dead_rank_worker(rank, world):
    import os
    import time

    if rank == 1:
        os._exit(0)  # dies without a word
    start = time.monotonic()
    with pytest.raises(RuntimeError):
        net.all_to_all_single(torch.zeros(world * 2, 3))
    assert time.monotonic() - start < 30
    os._exit(0)


def test_dead_rank_gives_an_error_not_a_hang(monkeypatch):
    monkeypatch.setenv(net.TIMEOUT_ENV, "5")
    run_ranks(2, dead_rank_worker, timeout=60)
