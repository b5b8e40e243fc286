"""Capacity rule and slot assignment: formula table and hypothesis properties."""

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from dynamoe import ops
from dynamoe.moe import build_plan
from reference import ref_capacity


@pytest.mark.parametrize("T,E,k,cf,max_load,want", [
    (100, 8, 2, 1.0, 40, 2 * 13),        # k * int(cf * ceil(T/E))
    (100, 8, 2, 1.5, 40, 2 * 19),
    (100, 8, 1, 0.0, 40, 40),            # dropless: max load
    (100, 8, 2, -1.0, 40, 26),           # min(max load, k*int(-cf*ceil(T/E)))
    (100, 8, 2, -4.0, 40, 40),
    (3, 8, 2, 0.1, 2, 0),                # tiny factor can give zero capacity
])
def test_capacity_formula(T, E, k, cf, max_load, want):
    assert ops.capacity(T, E, k, cf, max_load) == want


def test_capacity_alignment_and_errors():
    assert ops.capacity(100, 8, 2, 1.0, 40, alignment=4) == 28
    with pytest.raises(ValueError, match="capacity_factor"):
        ops.capacity(10, 2, 1, float("nan"), 3)


def test_slot_order_is_choice_major():
    ids = torch.tensor([[0, 1], [0, 1], [1, 0]])
    slots, load, order = ops.expert_slots(ids, 2)
    # expert 0 queue: t0 (1st), t1 (1st), t2 (2nd); expert 1: t2 (1st), t0 (2nd), t1 (2nd)
    assert slots.tolist() == [[0, 1], [1, 2], [0, 2]]
    assert load.tolist() == [3, 3]
    T = 3
    assert [(int(a) % T, int(a) // T) for a in order] == [(0, 0), (1, 0), (2, 1), (2, 0), (0, 1), (1, 1)]


def test_batch_prioritized_slots():
    ids = torch.tensor([[0], [0], [0]])
    slots, _, order = ops.expert_slots(ids, 1, priority_T=torch.tensor([0.1, 0.9, 0.5]))
    assert slots[:, 0].tolist() == [2, 0, 1]
    assert order.tolist() == [1, 2, 0]


routing = st.integers(1, 6).flatmap(lambda E: st.tuples(
    st.just(E), st.integers(1, E), st.integers(0, 40), st.sampled_from([0.0, 0.5, 1.0, 1.7, -0.5, -2.0]),
    st.integers(0, 2**31 - 1), st.booleans()))


@settings(max_examples=60, deadline=None)
@given(routing)
def test_plan_invariants(args):
    E, k, T, cf, seed, prio = args
    g = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(E, generator=g)[:k] for _ in range(T)]) if T else torch.zeros(0, k, dtype=torch.long)
    w = torch.rand(T, k, generator=g)
    priority = torch.rand(T, generator=g) if prio else None
    plan = build_plan(ids, w, E, cf, priority)
    loads = torch.bincount(ids.reshape(-1), minlength=E).tolist()
    assert plan.load == loads
    C = ref_capacity(T, E, k, cf, loads) if T else (0 if cf <= 0 else k * int(cf * 0))
    assert plan.capacity == C
    # each expert keeps at most C, drop counts add up, dropless drops nothing
    assert all(c <= C for c in plan.counts)
    assert plan.counts == [min(n, C) for n in loads]
    assert plan.num_dropped == T * k - sum(plan.counts) == sum(n - min(n, C) for n in loads)
    if cf == 0:
        assert plan.num_dropped == 0
    # rows are sorted by (expert, slot), slots within an expert are 0..count-1
    for e in range(E):
        mine = plan.slot_N[plan.expert_N == e].tolist()
        assert mine == list(range(plan.counts[e]))
    assert plan.expert_N.tolist() == sorted(plan.expert_N.tolist())
    # every kept row refers to the right (token, choice)
    for a, t, e in zip(plan.order_N.tolist(), plan.token_N.tolist(), plan.expert_N.tolist()):
        assert a % max(T, 1) == t and ids[t, a // T].item() == e
