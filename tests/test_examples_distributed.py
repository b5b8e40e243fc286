"""The multi-process examples under ``torchrun --nproc_per_node=2`` (gloo on CPU, tiny sizes): DDP,
ZeRO, the parallel-switch equivalence check, the bandwidth table and the variable-length collectives;
plus their one-process behaviour."""
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from dynamoe.examples import bandwidth_test, helloworld, helloworld_switch, nccl_all_gather_v, nccl_all_to_all_v
from ports import free_port

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
TINY = ["--batch_size", "2", "--num_tokens", "16", "--model_dim", "16", "--hidden_size", "32",
        "--num_local_experts", "2", "--num_steps", "3", "--device", "cpu"]
STEP_RE = re.compile(r"^STEP-(\d+): loss = (\S+), step_time = \S+ sec, perf = \S+ tflops\.$", re.M)


def _env() -> dict:
    env = dict(os.environ, OMP_NUM_THREADS="1")
    for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_SIZE", "MASTER_ADDR", "MASTER_PORT"):
        env.pop(name, None)
    return env


def torchrun(module: str, *args: str) -> str:
    """Run ``-m dynamoe.examples.<module>`` on 2 ranks; returns rank 0's (and rank 1's) stdout."""
    proc = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={free_port()}",
         "-m", f"dynamoe.examples.{module}", *args],
        capture_output=True, text=True, timeout=120, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    return proc.stdout


def losses_of(out: str) -> list[float]:
    return [float(m.group(2)) for m in STEP_RE.finditer(out)]


def test_helloworld_ddp_two_ranks_matches_manual_averaging():
    """DDP (experts left out of its all-reduce) trains exactly as helloworld's manual averaging does."""
    out = torchrun("helloworld_ddp", *TINY, "--lr", "0.1")
    losses = losses_of(out)
    assert "world_size = 2" in out and "DistributedDataParallel(" in out
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]
    assert len(out.split("load = [")[-1].split("]")[0].split(",")) == 4  # 2 local experts x 2 ranks
    reference = losses_of(torchrun("helloworld", *TINY, "--lr", "0.1"))
    assert losses == pytest.approx(reference, abs=2e-5)


def test_helloworld_ddp_plain_process_makes_its_own_group(capsys):
    proc = subprocess.run([sys.executable, "-m", "dynamoe.examples.helloworld_ddp", *TINY, "--lr", "0.1"],
                          capture_output=True, text=True, timeout=120, env=_env(), cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-4000:]
    assert "world_size = 1" in proc.stdout and "DistributedDataParallel(" in proc.stdout
    losses = losses_of(proc.stdout)
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert losses == pytest.approx(helloworld.main(TINY + ["--lr", "0.1"]), abs=2e-5)
    capsys.readouterr()


def test_helloworld_ddp_tutel_two_ranks():
    # Tutel's optimizer (SGD on averaged, sharded gate gradients): helloworld's losses (its manual averaging)
    out = torchrun("helloworld_ddp_tutel", *TINY, "--lr", "0.1")
    assert "[Optimizer] TutelDistributedOptimizer(SGD, lr = 0.1, average_shared) over 2 rank(s)" in out
    assert losses_of(out) == pytest.approx(losses_of(torchrun("helloworld", *TINY, "--lr", "0.1")), abs=2e-5)
    out = torchrun("helloworld_ddp_tutel", *TINY, "--lr", "0.01", "--optimizer", "zero_adamw")
    losses = losses_of(out)
    assert "[Optimizer] ZeroOptimizer(AdamW, lr = 0.01) over 2 rank(s)" in out
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


def test_helloworld_switch_two_ranks_settings_are_identical():
    out = torchrun("helloworld_switch", *TINY, "--num_steps", "4")
    losses = losses_of(out)
    assert len(losses) == 4 and all(math.isfinite(v) for v in losses)
    switch = [line for line in out.splitlines() if line.strip().startswith("switch:")]
    assert len(switch) == 4 and all("layout = padded" in line and line.endswith("moved = 0") for line in switch)
    check = re.findall(r"^\[Switch-check\] adaptive_r = (\d), a2a_ffn_overlap_degree = (\d), use_2dh = (\w+): "
                       r"loss = (\S+), layout = (\w+)$", out, re.M)
    # torchrun sets LOCAL_WORLD_SIZE=2, which divides the world: use_2dh is tried both ways
    assert {c[:3] for c in check} == {(r, o, t) for r in "01" for o in "12" for t in ("False", "True")}
    assert len(check) == 8 and len({c[3] for c in check}) == 1 and math.isfinite(float(check[0][3]))
    assert {c[4] for c in check if c[0] == "1"} == {"padded"}
    assert "[Switch-check] identical: True" in out


def test_helloworld_switch_two_ranks_sharing_one_expert():
    """--num_local_experts -2: both ranks hold half of one expert; adaptive_r cycles 0, 1, 2."""
    out = torchrun("helloworld_switch", *TINY, "--num_local_experts", "-2", "--top", "1", "--num_steps", "2",
                   "--parallel_type", "model")
    check = re.findall(r"^\[Switch-check\] adaptive_r = (\d), a2a_ffn_overlap_degree = (\d), use_2dh = (\w+): "
                       r"loss = (\S+)", out, re.M)
    assert {c[0] for c in check} == {"0", "1", "2"} and len(check) == 12
    assert "[Switch-check] identical: True" in out


def test_switch_check_reports_a_mismatch(capsys):
    """The check itself (one process: adaptive_r 0 and 1, overlap 1 and 2) passes, and fails when a
    setting computes something else."""
    args = helloworld_switch.parse_args(helloworld_switch.build_parser("x"), TINY)
    model = helloworld_switch.build_model(args)
    x, target = helloworld_switch.make_data(args, torch.float32)
    assert helloworld_switch.check_parallel_switches(args, model, x, target)
    forward = model.forward
    model.forward = lambda x, **kw: forward(x, **kw) * (1.0 if kw["adaptive_r"] == 0 else 1.1)
    assert not helloworld_switch.check_parallel_switches(args, model, x, target)
    out = capsys.readouterr().out
    assert out.count("identical: True") == 1 and out.count("identical: False") == 1


def test_bandwidth_table_two_ranks():
    out = torchrun("bandwidth_test", "--size_mb", "2", "--iters", "2")
    assert "all-to-all across 2 ranks, backend = gloo" in out
    assert re.search(r"^\s+MB\s+dynamoe ms\s+dynamoe GB/s\s+torch ms\s+torch GB/s$", out, re.M)
    rows = re.findall(r"^\s*(\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)\s+(\d+\.\d+)$", out, re.M)
    assert [r[0] for r in rows] == ["1", "2"]  # sizes double up to --size_mb, printed by rank 0 only
    assert all(float(v) > 0 for r in rows for v in r[1:])


def test_bandwidth_needs_two_ranks(capsys):
    assert bandwidth_test.main(["--size_mb", "1", "--device", "cpu"]) == []
    assert "needs >= 2 ranks" in capsys.readouterr().out
    assert bandwidth_test.sizes_mb(8) == [1, 2, 4, 8] and bandwidth_test.sizes_mb(5) == [1, 2, 4, 5]


@pytest.mark.parametrize("module, ok", [
    ("nccl_all_to_all_v", "[all_to_all_v] OK: 2 rank(s)"),
    ("nccl_all_gather_v", "[all_gather_v] OK: 2 rank(s) holding [0, 1] rows"),
])
def test_variable_length_collectives_two_ranks(module, ok):
    out = torchrun(module, "--device", "cpu")
    assert out.count(ok) == 1
    assert "Device-0 recvs" in out and "Device-1 recvs" in out


def test_variable_length_collectives_one_process(capsys):
    assert nccl_all_to_all_v.main(["--device", "cpu"]) and nccl_all_gather_v.main(["--device", "cpu"])
    out = capsys.readouterr().out
    assert "[all_to_all_v] OK: 1 rank(s)" in out and "[all_gather_v] OK: 1 rank(s) holding [0] rows" in out
    # the uneven/zero pattern the 2-rank run exercises
    assert [[nccl_all_to_all_v.count(s, d) for d in range(2)] for s in range(2)] == [[1, 0], [2, 1]]
