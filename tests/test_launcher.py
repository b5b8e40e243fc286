"""The MPI -> torch.distributed bridge."""
import subprocess
import sys

import pytest

from dynamoe.launcher.run import mpi_environment


def test_open_mpi_variables_are_mapped():
    env = {"OMPI_COMM_WORLD_RANK": "3", "OMPI_COMM_WORLD_SIZE": "4", "OMPI_COMM_WORLD_LOCAL_RANK": "1",
           "OMPI_COMM_WORLD_LOCAL_SIZE": "2", "MASTER_ADDR": "10.0.0.1"}
    out = mpi_environment(env, cpu_count=16)
    assert (out["RANK"], out["WORLD_SIZE"], out["LOCAL_RANK"], out["LOCAL_SIZE"]) == ("3", "4", "1", "2")
    assert out["MASTER_ADDR"] == "10.0.0.1" and out["MASTER_PORT"] == "29500"
    assert out["OMP_NUM_THREADS"] == "8"  # the node's cores shared by its 2 ranks, not 1024
    assert "RANK" not in env  # the input is not modified


def test_torchrun_variables_win_and_user_threads_are_kept():
    env = {"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "1", "OMPI_COMM_WORLD_RANK": "0", "OMP_NUM_THREADS": "3"}
    out = mpi_environment(env, cpu_count=8)
    assert out["RANK"] == "1" and out["LOCAL_SIZE"] == "2" and out["OMP_NUM_THREADS"] == "3"


def test_plain_process_and_slurm():
    assert mpi_environment({}, cpu_count=2)["WORLD_SIZE"] == "1"
    out = mpi_environment({"SLURM_PROCID": "5", "SLURM_NTASKS": "8", "SLURM_LOCALID": "1", "SLURM_NTASKS_PER_NODE": "4(x2)"}, 8)
    assert (out["RANK"], out["LOCAL_SIZE"], out["OMP_NUM_THREADS"]) == ("5", "4", "2")


@pytest.mark.parametrize("env,match", [
    ({"PMI_RANK": "4", "PMI_SIZE": "4"}, "not in a world"),
    ({"RANK": "x"}, "RANK must be an integer"),
    ({"RANK": "1", "WORLD_SIZE": "2", "LOCAL_RANK": "2", "LOCAL_SIZE": "2"}, "LOCAL_SIZE"),
])
def test_bad_environments(env, match):
    with pytest.raises(ValueError, match=match):
        mpi_environment(env, 4)


def test_runs_a_module_as_one_rank():
    out = subprocess.run([sys.executable, "-m", "dynamoe.launcher.run", "-m", "dynamoe.examples.helloworld",
                          "--batch_size", "1", "--num_tokens", "8", "--model_dim", "8", "--hidden_size", "8",
                          "--num_local_experts", "2", "--num_steps", "1"], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert "STEP-0" in out.stdout
    bad = subprocess.run([sys.executable, "-m", "dynamoe.launcher.run", "missing.py"], capture_output=True, text=True)
    assert bad.returncode == 2 and "no such script" in bad.stderr
