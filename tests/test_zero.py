"""ZeRO-1 optimizer steps equal Tutel's manual data-parallel loop with a plain optimizer; DDP helper."""

import torch
import torch.distributed as dist

from dist_harness import run_ranks
from dynamoe.moe import ExpertConfig, GateConfig, MoEConfig, MoELayer
from dynamoe.parallel import ZeroOptimizer, data_parallel, is_expert_parameter


class Model(torch.nn.Module):
    def __init__(self, group):
        super().__init__()
        self.inp = torch.nn.Linear(8, 8)
        self.moe = MoELayer(MoEConfig(model_dim=8, gates=[GateConfig(k=2, capacity_factor=0)],
                                      experts=ExpertConfig(num_experts_per_device=2, hidden_size_per_expert=8)), group=group)
        self.out = torch.nn.Linear(8, 3)

    def forward(self, x):
        return self.out(self.moe(self.inp(x)))


def loss_of(model, rank, step):
    g = torch.Generator().manual_seed(100 * step + rank)
    x = torch.randn(6, 8, generator=g)
    return model(x).square().mean()


def zero_worker(rank, world):
    torch.manual_seed(0)
    a = Model(dist.group.WORLD)
    b = Model(dist.group.WORLD)
    b.load_state_dict(a.state_dict())
    zero = ZeroOptimizer(a.parameters(), torch.optim.AdamW, lr=1e-2, weight_decay=0.1)
    plain = torch.optim.AdamW(b.parameters(), lr=1e-2, weight_decay=0.1)
    for step in range(3):
        zero.zero_grad()
        loss_of(a, rank, step).backward()
        zero.step()
        plain.zero_grad()
        loss_of(b, rank, step).backward()
        for p in b.parameters():  # Tutel's loop: average what is replicated, experts as they are
            if not is_expert_parameter(p):
                p.grad /= world
                dist.all_reduce(p.grad)
        plain.step()
    for (n, p), (_, q) in zip(a.named_parameters(), b.named_parameters()):
        torch.testing.assert_close(p, q, atol=1e-6, rtol=1e-5, msg=n)
    # replicated parameters stay identical on every rank
    w = a.inp.weight.detach().clone()
    dist.all_reduce(w)
    torch.testing.assert_close(w, a.inp.weight.detach() * world)
    # each rank holds only its shard of the replicated state
    n_rep = sum(p.numel() for p in a.parameters() if not is_expert_parameter(p))
    assert zero.master.numel() == -(-n_rep // world)
    # DDP helper: expert parameters are not all-reduced by DDP
    c = Model(dist.group.WORLD)
    c.load_state_dict(b.state_dict())
    ddp = data_parallel(c)
    loss_of(ddp, rank, 9).backward()
    d = Model(dist.group.WORLD)
    d.load_state_dict(b.state_dict())
    loss_of(d, rank, 9).backward()
    for (n, p), (_, q) in zip(c.named_parameters(), d.named_parameters()):
        want = q.grad.clone()
        if not is_expert_parameter(q):
            dist.all_reduce(want)
            want /= world
        torch.testing.assert_close(p.grad, want, msg=n)


def test_zero_optimizer_and_ddp_helper_on_2_ranks():
    run_ranks(2, zero_worker, timeout=180)


def test_zero_optimizer_on_one_process_matches_the_inner_optimizer():
    torch.manual_seed(0)
    a = Model(None)
    b = Model(None)
    b.load_state_dict(a.state_dict())
    zero = ZeroOptimizer(a.parameters(), torch.optim.SGD, lr=0.1, momentum=0.9)
    plain = torch.optim.SGD(b.parameters(), lr=0.1, momentum=0.9)
    for step in range(3):
        for m, opt in ((a, zero), (b, plain)):
            opt.zero_grad()
            loss_of(m, 0, step).backward()
            opt.step()
    for p, q in zip(a.parameters(), b.parameters()):
        torch.testing.assert_close(p, q)
    state = zero.state_dict()
    zero.load_state_dict(state)
    state["rank"] = 1
    try:
        zero.load_state_dict(state)
        raise AssertionError("a state of another rank must be refused")
    except ValueError as e:
        assert "re-shard" in str(e)
