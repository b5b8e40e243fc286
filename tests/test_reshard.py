"""Checkpoint re-sharding round trip 4 ranks -> 1 -> 2 with identical outputs, plus the CLIs."""
import os

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_ranks
from dynamoe.checkpoint import expert_keys, gather, scatter
from dynamoe.checkpoint.gather import main as gather_main
from dynamoe.checkpoint.scatter import main as scatter_main
from dynamoe.moe import ExpertConfig, GateConfig, MoEConfig, MoELayer

E, D = 8, 8


class Net(torch.nn.Module):
    def __init__(self, world, group):
        super().__init__()
        self.inp = torch.nn.Linear(D, D)
        self.moe = MoELayer(MoEConfig(model_dim=D, gates=[GateConfig(k=2, capacity_factor=0)],
                                      experts=ExpertConfig(type="glu", num_experts_per_device=E // world,
                                                           hidden_size_per_expert=8)), group=group)

    def forward(self, x):
        return self.moe(self.inp(x))


def batch():
    return torch.randn(12, D, generator=torch.Generator().manual_seed(7))


def save_worker(rank, world, folder):
    torch.manual_seed(rank)  # expert weights differ per rank; replicated ones are set equal below
    m = Net(world, dist.group.WORLD)
    torch.manual_seed(123)
    with torch.no_grad():
        m.inp.weight.copy_(torch.randn(D, D))
        m.inp.bias.zero_()
        m.moe.gates[0].wg.weight.copy_(torch.randn(E, D))
    X = batch()
    rows = X.chunk(world)[rank]
    with torch.no_grad():
        y = m(rows)
    torch.save(m.state_dict(), os.path.join(folder, f"w{world}-rank{rank}.pt"))
    torch.save(y.detach().clone(), os.path.join(folder, f"w{world}-out{rank}.pt"))  # a plain tensor, no stats


def load_worker(rank, world, folder):
    m = Net(world, dist.group.WORLD)
    m.load_state_dict(torch.load(os.path.join(folder, f"scattered-{rank}.pt"), weights_only=True))
    with torch.no_grad():
        y = m(batch().chunk(world)[rank])
    want = torch.load(os.path.join(folder, "single.pt"), weights_only=True).chunk(world)[rank]
    torch.testing.assert_close(y, want)


def test_round_trip_4_to_1_to_2(tmp_path):
    folder = str(tmp_path)
    run_ranks(4, save_worker, folder, timeout=180)
    files = [os.path.join(folder, f"w4-rank{r}.pt") for r in range(4)]
    gather_main(["--inputs", *files, "--output", os.path.join(folder, "full.pt")])
    full = torch.load(os.path.join(folder, "full.pt"), weights_only=True)
    single = Net(1, None)
    single.load_state_dict(full)
    with torch.no_grad():
        y = single(batch())
    torch.save(y.detach().clone(), os.path.join(folder, "single.pt"))
    want = torch.cat([torch.load(os.path.join(folder, f"w4-out{r}.pt"), weights_only=True) for r in range(4)])
    torch.testing.assert_close(y, want)  # one process == the 4-rank run
    scatter_main(["--input", os.path.join(folder, "full.pt"), "--world", "2",
                  "--output", os.path.join(folder, "scattered-{rank}.pt")])
    run_ranks(2, load_worker, folder, timeout=180)  # 2 ranks == one process


def test_reshard_functions_and_errors(tmp_path):
    one = Net(1, None).state_dict()
    keys = expert_keys(one)
    assert keys and all(k.startswith("moe.experts.") for k in keys) and set(keys.values()) == {E}
    parts = scatter(one, 4)
    assert parts[0]["moe.experts.gate_up_proj"].shape[0] == 2
    back = gather(parts)
    assert all(torch.equal(back[k], one[k]) for k in one)
    with pytest.raises(ValueError, match="do not split"):
        scatter(one, 3)
    bad = [dict(p) for p in parts]
    bad[1]["inp.weight"] = bad[1]["inp.weight"] + 1
    with pytest.raises(ValueError, match="differs"):
        gather(bad)
    with pytest.raises(ValueError, match="all ranks"):
        gather(parts[:3])
    with pytest.raises(SystemExit) as e:
        gather_main(["--inputs", str(tmp_path / "missing.pt"), "--output", str(tmp_path / "x.pt")])
    assert e.value.code == 2
    with pytest.raises(SystemExit):
        scatter_main(["--input", str(tmp_path / "missing.pt"), "--world", "2", "--output", "x"])
