"""Expert parallelism on 2 and 4 gloo ranks equals one process on the global batch: outputs, and
gradients of inputs, experts and (summed over ranks) the gate."""
import pytest
import torch
import torch.distributed as dist

from dist_harness import run_ranks
from dynamoe.moe import ExpertConfig, GateConfig, MoEConfig, MoELayer, moe_layer

D, F, L = 16, 24, 2


def config(E, gate, experts, cf):
    gkw = dict(n_group=2, topk_group=1, route_scale=2.0) if gate == "sigmoid" else {}
    return MoEConfig(model_dim=D, gates=[GateConfig(type=gate, k=2, capacity_factor=cf, **gkw)],
                     experts=ExpertConfig(type=experts, num_experts_per_device=E, hidden_size_per_expert=F))


def ep_worker(rank, world, gate, experts, cf, tokens):
    torch.manual_seed(0)
    ref = MoELayer(config(L * world, gate, experts, cf)).double()  # one process, all experts
    ep = MoELayer(config(L, gate, experts, cf), group=dist.group.WORLD).double()
    assert ep.num_global_experts == L * world and ep.world_size == world
    with torch.no_grad():
        ep.gates[0].load_state_dict(ref.gates[0].state_dict())
        for (name, p), (_, q) in zip(ep.experts.named_parameters(), ref.experts.named_parameters()):
            p.copy_(q[rank * L:(rank + 1) * L])
    counts = tokens(world)
    g = torch.Generator().manual_seed(1)
    X = torch.randn(sum(counts), D, generator=g, dtype=torch.float64)
    G = torch.randn(sum(counts), D, generator=g, dtype=torch.float64)
    start = sum(counts[:rank])
    mine = slice(start, start + counts[rank])

    Xr = X.clone().requires_grad_()
    y_ref = ref(Xr, layout="padded")
    (y_ref * G).sum().backward()

    pointers = {n: p.data_ptr() for n, p in ep.named_parameters()}
    # r=1: expert parallel (all-to-all); r=0: data parallel for the call (experts gathered)
    # r=1 with overlap degree N: N capacity chunks, their all-to-alls in flight together
    runs = [(1, "padded", 1, False), (1, "padded", 2, False), (1, "padded", 4, False), (0, "padded", 1, False),
            (0, "ragged", 1, False)]
    if world == 4:  # two nodes of two ranks: the two-level exchange, alone and with overlap
        import os
        os.environ["LOCAL_SIZE"] = "2"
        runs += [(1, "padded", 1, True), (1, "padded", 2, True)]
    for r, layout, overlap, two in runs:
        ep.zero_grad()
        x = X[mine].clone().requires_grad_()
        y = ep(x, adaptive_r=r, layout=layout, a2a_ffn_overlap_degree=overlap, use_2dh=two)
        assert y.routing_stats.capacity % overlap == 0
        assert y.routing_stats.layout == layout
        (y * G[mine]).sum().backward()
        torch.testing.assert_close(y, y_ref[mine])
        torch.testing.assert_close(x.grad, Xr.grad[mine])
        for (name, p), (_, q) in zip(ep.experts.named_parameters(), ref.experts.named_parameters()):
            torch.testing.assert_close(p.grad, q.grad[rank * L:(rank + 1) * L], msg=f"r={r} N={overlap} {name}")
        gate_grad = ep.gates[0].wg.weight.grad.clone()
        dist.all_reduce(gate_grad)
        torch.testing.assert_close(gate_grad, ref.gates[0].wg.weight.grad)
    assert pointers == {n: p.data_ptr() for n, p in ep.named_parameters()}  # switching moved nothing

    if gate == "sigmoid":  # aux-loss-free bias update: from the load summed over ranks, same everywhere
        ep.train()
        ref.train()
        ep(X[mine])
        ref(X, layout="padded")
        ep.update_routing_bias(0.01)
        ref.update_routing_bias(0.01)
        torch.testing.assert_close(ep.gates[0].e_score_correction_bias, ref.gates[0].e_score_correction_bias)
        ep.eval()
        ref.eval()
    # per-call switches work across ranks too (same answer as the global layer with the same switch)
    with torch.no_grad():
        wide = 3 if gate == "top" else 2  # the sigmoid gate keeps 1 group of 2 experts
        for switch in (dict(top_k=1), dict(top_k=wide, capacity_factor=0.0)):
            torch.testing.assert_close(ep(X[mine], **switch), ref(X, layout="padded", **switch)[mine])


def six_each(world):
    return [6] * world


def five_each(world):
    return [5] * world


def four_each(world):
    return [4] * world


def unequal_with_an_empty_rank(world):
    return [0] + [3 + r for r in range(1, world)]


CASES = {
    "dropless": ("top", "ffn", 0.0, six_each),
    "no drops at cf=8": ("top", "ffn", 8.0, five_each),
    "sigmoid glu": ("sigmoid", "glu", 0.0, four_each),
    "unequal tokens, an empty rank": ("top", "glu", 0.0, unequal_with_an_empty_rank),
}


@pytest.mark.parametrize("case", list(CASES))
def test_expert_parallel_equals_single_process_on_2_ranks(case):
    run_ranks(2, ep_worker, *CASES[case], timeout=180)


def test_expert_parallel_on_4_ranks():
    run_ranks(4, ep_worker, *CASES["unequal tokens, an empty rank"], timeout=180)


def tutel_worker(rank, world):
    torch.manual_seed(0)
    m = moe_layer(gate_type={"type": "top", "k": 2, "capacity_factor": 0}, model_dim=D, group=dist.group.WORLD,
                  experts={"type": "ffn", "num_experts_per_device": L, "hidden_size_per_expert": F})
    assert m.num_global_experts == L * world and m.gates[0].wg.weight.shape == (L * world, D)
    y = m(torch.randn(5, D))
    assert y.shape == (5, D) and y.routing_stats.load.numel() == L * world
    with pytest.raises(ValueError, match="ragged"):
        m(torch.randn(5, D), layout="ragged")


def test_tutel_constructor_with_a_group():
    run_ranks(2, tutel_worker, timeout=120)
