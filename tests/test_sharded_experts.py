"""Experts sharded over ranks (num_experts_per_device = -n): every adaptive degree r (0, and the
divisors of n) gives one process's outputs and gradients on the global batch, and switching r
moves no parameter. Plus the pure shard/merge functions behind it and checkpoint re-sharding."""
import dataclasses
import pytest
import torch
import torch.distributed as dist

from dist_harness import run_ranks
from dynamoe.checkpoint import reshard
from dynamoe.moe import ExpertConfig, GateConfig, MoEConfig, MoELayer
from dynamoe.moe.experts import FFNExperts, GLUExperts
from dynamoe.moe.sharding import OUTPUT_BIAS, merge_shards, split_shard

D, F = 12, 16


@pytest.mark.parametrize("role,shape", [((1, 1), (3, 8, 5)), ((1, 2), (3, 8, 5)), ((2, 1), (3, 5, 8)),
                                        ((1, 2), (3, 8)), (OUTPUT_BIAS, (3, 7))])
@pytest.mark.parametrize("n", [1, 2, 4])
def test_split_then_merge_is_identity(role, shape, n):
    full = torch.randn(shape)
    shards = torch.stack([split_shard(full, role, n, s) for s in range(n)])
    out_dim = shape[-1] if role == OUTPUT_BIAS else None
    torch.testing.assert_close(merge_shards(shards, role, out_dim), full)


def test_glu_shards_split_gate_and_up_separately():
    full = torch.arange(8.0).view(1, 8, 1)  # gate rows 0..3, up rows 4..7
    assert split_shard(full, (1, 2), 2, 1).flatten().tolist() == [2, 3, 6, 7]


def test_uneven_hidden_split_is_an_error():
    with pytest.raises(ValueError, match="divisible by the 3 ranks"):
        FFNExperts(D, 16, 1, sharded_count=3)
    with pytest.raises(ValueError, match="cannot be split into 3"):
        split_shard(torch.randn(1, 8, 2), (1, 1), 3, 0)


def test_sharded_module_shapes():
    m = GLUExperts(D, F, 1, bias=True, sharded_count=4)
    assert m.gate_up_proj.shape == (1, 2 * F // 4, D) and m.down_proj.shape == (1, D, F // 4)
    assert m.down_proj_bias.shape == (1, 3) and m.hidden_size == F


def test_sharding_needs_enough_ranks():
    cfg = MoEConfig(model_dim=D, gates=[GateConfig(k=1)],
                    experts=ExpertConfig(num_experts_per_device=-2, hidden_size_per_expert=F))
    with pytest.raises(ValueError, match="2 devices should share an expert, but the world has 1"):
        MoELayer(cfg)
    with pytest.raises(ValueError, match="non-zero int"):
        ExpertConfig(num_experts_per_device=0, hidden_size_per_expert=F)


def sharded_worker(rank, world, n, experts, k, folder):
    torch.manual_seed(0)
    E = world // n
    ekw = dict(glu_bias=True) if experts == "glu" else {}
    mk = lambda L: MoEConfig(model_dim=D, gates=[GateConfig(k=k, capacity_factor=0.0)],
                             experts=ExpertConfig(type=experts, num_experts_per_device=L, hidden_size_per_expert=F, **ekw))
    ref = MoELayer(mk(E)).double()
    layer = MoELayer(mk(-n), group=dist.group.WORLD).double()
    assert layer.num_global_experts == E and layer.sharded_count == n and layer.num_local_experts == 1
    e, s = rank // n, rank % n
    spec = layer.experts.shard_spec
    with torch.no_grad():
        layer.gates[0].load_state_dict(ref.gates[0].state_dict())
        for (name, p), (_, q) in zip(layer.experts.named_parameters(), ref.experts.named_parameters()):
            p.copy_(split_shard(q[e:e + 1], spec[name], n, s))
            q.mul_(3.0) if "bias" in name else None  # biases large enough to matter
            p.mul_(3.0) if "bias" in name else None
    g = torch.Generator().manual_seed(1)
    counts = [3 + r for r in range(world)]
    X = torch.randn(sum(counts), D, generator=g, dtype=torch.float64)
    G = torch.randn(sum(counts), D, generator=g, dtype=torch.float64)
    mine = slice(sum(counts[:rank]), sum(counts[:rank + 1]))
    Xr = X.clone().requires_grad_()
    y_ref = ref(Xr, layout="padded")
    (y_ref * G).sum().backward()

    pointers = {k: p.data_ptr() for k, p in layer.named_parameters()}
    degrees = [0] + [d for d in range(1, n + 1) if n % d == 0]
    for r, overlap in [(r, 1) for r in degrees] + [(n, 2), (1, 2)]:
        layer.zero_grad()
        x = X[mine].clone().requires_grad_()
        y = layer(x, adaptive_r=r, a2a_ffn_overlap_degree=overlap)
        (y * G[mine]).sum().backward()
        torch.testing.assert_close(y, y_ref[mine], msg=f"r={r}")
        torch.testing.assert_close(x.grad, Xr.grad[mine], msg=f"r={r}")
        for (name, p), (_, q) in zip(layer.experts.named_parameters(), ref.experts.named_parameters()):
            torch.testing.assert_close(p.grad, split_shard(q.grad[e:e + 1], spec[name], n, s), msg=f"r={r} {name}")
        gate_grad = layer.gates[0].wg.weight.grad.clone()
        dist.all_reduce(gate_grad)
        torch.testing.assert_close(gate_grad, ref.gates[0].wg.weight.grad)
    assert pointers == {k: p.data_ptr() for k, p in layer.named_parameters()}
    with pytest.raises(ValueError, match="adaptive_r must be one of"):
        layer(X[mine], adaptive_r=3)
    # checkpoint re-sharding: the rank files gather into the one-process layer's state dict, and
    # that state dict scatters back into this rank's (and into other world sizes)
    torch.save(layer.state_dict(), f"{folder}/rank{rank}.pt")
    dist.barrier()
    states = [torch.load(f"{folder}/rank{i}.pt") for i in range(world)]
    full = reshard.gather(states)
    assert full.keys() == ref.state_dict().keys()
    for key, t in ref.state_dict().items():
        torch.testing.assert_close(full[key], t, msg=key)
    for key, t in reshard.scatter(full, world)[rank].items():
        torch.testing.assert_close(t, layer.state_dict()[key], msg=key)
    for other_world in (E, 2 * world):   # one expert per rank; and twice as many ranks per expert
        back = reshard.gather(reshard.scatter(full, other_world))
        for key, t in full.items():
            torch.testing.assert_close(back[key], t, msg=f"{other_world} {key}")
    # parallel_type spellings: 'model' = r n, 'data' = r 1
    for ptype in ("model", "data"):
        cfg = dataclasses.replace(mk(-n), parallel_type=ptype)
        other = MoELayer(cfg, group=dist.group.WORLD).double()
        other.load_state_dict(layer.state_dict())
        with torch.no_grad():
            torch.testing.assert_close(other(X[mine]), y_ref[mine])


def test_two_ranks_share_one_ffn_expert(tmp_path):
    run_ranks(2, sharded_worker, 2, "ffn", 1, str(tmp_path), timeout=180)


def test_four_ranks_two_glu_experts_each_on_two(tmp_path):
    run_ranks(4, sharded_worker, 2, "glu", 2, str(tmp_path), timeout=180)


def test_four_ranks_share_one_expert(tmp_path):
    run_ranks(4, sharded_worker, 4, "ffn", 1, str(tmp_path), timeout=180)
