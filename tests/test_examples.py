"""The examples run in-process with tiny sizes: they train (finite, falling loss), honour their flags
(Tutel's multi-process ones included), save and resume checkpoints, reject bad flag values through
argparse, and the module entry point works."""
import math
import os
import re
import subprocess
import sys

import pytest
import torch

from dynamoe.examples import (helloworld, helloworld_amp, helloworld_custom_gate_expert, helloworld_from_scratch,
                              helloworld_switch)
from dynamoe.moe import moe_layer

TINY = ["--batch_size", "2", "--num_tokens", "16", "--model_dim", "16", "--num_local_experts", "4",
        "--num_steps", "3", "--device", "cpu"]
HIDDEN = ["--hidden_size", "32"]
STEP_RE = re.compile(r"^STEP-(\d+): loss = (\S+), step_time = (\S+) sec, perf = (\S+) tflops\.$", re.M)


def printed_losses(out: str) -> list[float]:
    return [float(m.group(2)) for m in STEP_RE.finditer(out)]


def last_routing(out: str) -> str:
    return next(line for line in out.splitlines() if line.startswith("[Routing] last step:"))


# every single-process example with its extra flags (the custom one has no --hidden_size)
ALL_EXAMPLES = [
    (helloworld, HIDDEN),
    (helloworld_switch, HIDDEN),
    (helloworld_amp, HIDDEN),
    (helloworld_custom_gate_expert, []),
    (helloworld_from_scratch, HIDDEN),
]
EXAMPLE_IDS = lambda v: getattr(v, "__name__", "").rsplit(".", 1)[-1] or None  # noqa: E731


@pytest.mark.parametrize("module, extra", ALL_EXAMPLES, ids=EXAMPLE_IDS)
def test_example_trains(module, extra, capsys):
    losses = module.main(TINY + extra + ["--lr", "0.1"])
    out = capsys.readouterr().out
    assert len(losses) == 3 and all(math.isfinite(v) for v in losses)
    assert printed_losses(out) == pytest.approx(losses, abs=1e-5)
    assert losses[-1] < losses[0]
    assert "[Summary] Average step_time over the last 3 step(s)" in out
    assert re.search(r"dropped = \d+, load = \[", last_routing(out))


@pytest.mark.parametrize("flags, expect", [
    (["--eval"], None),
    (["--capacity_factor", "0"], "dropped = 0"),
    (["--megablocks_size", "1"], "layout = ragged"),
    (["--megablocks_size", "0"], "layout = padded"),
    (["--dtype", "bfloat16", "--fp32_gate"], None),
    (["--expert_type", "glu", "--l_aux_wt", "0.01"], None),
    (["--a2a_ffn_overlap_degree", "3", "--capacity_factor", "0", "--parallel_type", "adaptive:0"], "dropped = 0"),
])
def test_helloworld_flags(flags, expect, capsys):
    losses = helloworld.main(TINY + HIDDEN + flags)
    out = capsys.readouterr().out
    assert all(math.isfinite(v) for v in losses)
    if "--eval" in flags:  # no update: the same loss every step
        assert len(set(losses)) == 1
    if expect:
        assert expect in last_routing(out)
    if "--a2a_ffn_overlap_degree" in flags:  # capacity is rounded up to a multiple of the degree
        assert int(re.search(r"capacity = (\d+)", last_routing(out)).group(1)) % 3 == 0


def test_helloworld_glu_counts_three_matmuls():
    from dynamoe.examples._common import ffn_flops_per_row
    assert ffn_flops_per_row(16, 32, "glu") == 3 * 2 * 16 * 32
    assert ffn_flops_per_row(16, 32, "ffn") == 2 * 2 * 16 * 32


def test_switch_visits_settings_without_moving_parameters(capsys):
    helloworld_switch.main(TINY + HIDDEN + ["--num_steps", "6"])
    out = capsys.readouterr().out
    switch_lines = [line for line in out.splitlines() if line.strip().startswith("switch:")]
    assert len(switch_lines) == 6
    assert all(line.endswith("parameters moved = 0") for line in switch_lines)
    assert {"layout = padded", "layout = ragged"} <= {m for line in switch_lines for m in re.findall(r"layout = \w+", line)}
    assert {"top_k = 1", "top_k = 2"} <= {m for line in switch_lines for m in re.findall(r"top_k = \d+", line)}
    assert "[Check]" in out


@pytest.mark.parametrize("flags, layout", [([], "ragged"), (["--megablocks_size", "1"], "ragged"),
                                           (["--megablocks_size", "0"], "padded")])
def test_amp_keeps_fp32_master_weights(flags, layout, capsys):
    """Both layouts run under autocast with fp32 weights (unset picks ragged on CPU)."""
    losses = helloworld_amp.main(TINY + HIDDEN + ["--lr", "0.1"] + flags)
    out = capsys.readouterr().out
    assert "[AMP] autocast(cpu, dtype=bfloat16), master weights ['torch.float32']" in out
    assert f"layout = {layout}" in last_routing(out)
    assert all(math.isfinite(v) for v in losses) and losses[-1] < losses[0]


def test_custom_modules_receive_options(capsys):
    helloworld_custom_gate_expert.main(TINY + ["--num_steps", "1"])
    out = capsys.readouterr().out
    assert "CustomGate(" in out and "CustomExpert(" in out
    layer = moe_layer(
        gate_type={"type": "custom", "module": helloworld_custom_gate_expert.CustomGate, "top_k": 1},
        experts={"type": "custom", "module": helloworld_custom_gate_expert.CustomExpert,
                 "num_experts_per_device": 3, "my_activ_type": "none"},
        model_dim=8,
    )
    assert layer.gates[0].top_k == 1 and layer.experts.my_activation is None
    assert layer.experts.W.shape == (3, 8, 8)


@pytest.mark.parametrize("layout", ["ragged", "padded"])
def test_from_scratch_matches_moe_layer(layout):
    """The hand-assembled data flow computes what MoELayer computes (same weights, same layout)."""
    torch.manual_seed(0)
    D, F, E, k = 16, 32, 4, 2
    scratch = helloworld_from_scratch.ScratchMoE(D, F, E, k, capacity_factor=1.0)
    layer = moe_layer(gate_type={"type": "top", "k": k, "capacity_factor": 1.0}, model_dim=D,
                      experts={"type": "ffn", "num_experts_per_device": E, "hidden_size_per_expert": F})
    with torch.no_grad():
        layer.gates[0].wg.weight.copy_(scratch.wg.weight)
        layer.experts.batched_fc1_w.copy_(scratch.fc1_w)
        layer.experts.batched_fc1_bias.copy_(scratch.fc1_b)
        layer.experts.batched_fc2_w.copy_(scratch.fc2_w)
        layer.experts.batched_fc2_bias.copy_(scratch.fc2_b)
    x = torch.randn(2, 16, D)
    y_ref, y = layer(x, layout=layout), scratch(x, layout=layout)
    torch.testing.assert_close(y, y_ref)
    torch.testing.assert_close(y.l_aux, y_ref.l_aux)
    s, s_ref = y.routing_stats, y_ref.routing_stats
    assert (s.layout, s.dropped, s.capacity) == (s_ref.layout, s_ref.dropped, s_ref.capacity)
    assert torch.equal(s.kept, s_ref.kept) and torch.equal(s.load, s_ref.load)


def test_from_scratch_megablocks_size_picks_layout(capsys):
    helloworld_from_scratch.main(TINY + HIDDEN + ["--num_steps", "1", "--megablocks_size", "0"])
    assert "layout = padded" in last_routing(capsys.readouterr().out)


TUTEL_MULTIPROCESS_FLAGS = ["--local_rank", "0", "--allreduce_degree", "2", "--use_2dh"]


@pytest.mark.parametrize("module, extra", ALL_EXAMPLES, ids=EXAMPLE_IDS)
def test_tutel_multiprocess_flags_are_accepted(module, extra, capsys):
    """Tutel command lines run unchanged; on one process these flags change nothing."""
    base = TINY + extra + ["--num_steps", "2"]
    with_flags = module.main(base + TUTEL_MULTIPROCESS_FLAGS)
    capsys.readouterr()
    assert with_flags == module.main(base)


def test_tutel_flags_parse_and_help():
    from dynamoe.examples._common import build_parser, parse_args
    parser = build_parser("x")
    args = parser.parse_args(["--local-rank", "3", "--allreduce_degree", "4", "--use_2dh", "--save_load_checkpoint"])
    assert (args.local_rank, args.allreduce_degree, args.use_2dh, args.save_load_checkpoint) == (3, 4, True, True)
    defaults = parser.parse_args([])
    assert (defaults.local_rank, defaults.allreduce_degree, defaults.use_2dh) == (-1, 1, False)
    # Tutel's default: no checkpoint; --save_load_checkpoint alone uses the example's own file
    assert (defaults.save_load_checkpoint, defaults.checkpoint_path) == (False, "")
    assert parse_args(build_parser("x"), ["--save_load_checkpoint"]).checkpoint_path == "./dynamoe-helloworld.ckpt"
    assert parser.parse_args(["--allreduce_degree", "-1", "--use_tensorcore", "--expert_type", "llama_ffn"]).allreduce_degree == -1
    text = " ".join(parser.format_help().split())
    assert "ignored" in text and text.count("no effect on one process") >= 2


def test_save_load_checkpoint_resumes(tmp_path, capsys):
    """Run 1 saves; run 2 loads and starts exactly where run 1 stopped: its first loss is the loss
    of run 1's final weights (= step 3 of an uninterrupted 4-step run)."""
    ckpt = tmp_path / "hw.ckpt"
    flags = TINY + HIDDEN + ["--lr", "0.1", "--save_load_checkpoint", "--checkpoint_path", str(ckpt)]
    first = helloworld.main(flags)
    out = capsys.readouterr().out
    assert ckpt.is_file() and "not found: starting from fresh weights" in out
    assert f"[Checkpoint] saved model and optimizer state to `{ckpt}` (3 training steps)" in out
    assert [p.name for p in tmp_path.iterdir()] == ["hw.ckpt"]  # the temporary file was renamed away

    uninterrupted = helloworld.main(TINY + HIDDEN + ["--lr", "0.1", "--num_steps", "4"])
    capsys.readouterr()
    resumed = helloworld.main(flags)
    out = capsys.readouterr().out
    assert f"[Checkpoint] loaded model and optimizer state from `{ckpt}` (3 training steps so far)" in out
    assert resumed[0] == pytest.approx(uninterrupted[3], rel=1e-6)
    assert resumed[0] != pytest.approx(first[0], rel=1e-6)
    assert "(6 training steps)" in out


def test_tutel_checkpoint_path_saves_and_loads_the_model_state(tmp_path, capsys):
    """Tutel's --checkpoint_path alone: {rank}/{size} name the file, which holds the model's state dict
    (as Tutel's helloworld writes it); a second run loads it and continues where the first stopped."""
    pattern = str(tmp_path / "ck" / "hw-{rank}-of-{size}.pt")
    flags = TINY + HIDDEN + ["--lr", "0.1", "--checkpoint_path", pattern]
    helloworld.main(flags)
    out = capsys.readouterr().out
    saved = tmp_path / "ck" / "hw-0-of-1.pt"
    assert "Checkpoint not loaded: file" in out and saved.is_file()
    state = torch.load(saved, weights_only=True)
    assert {"_moe_layer._num_global_experts", "_moe_layer.gates.0.wg.weight", "_moe_layer.experts.batched_fc1_w"} <= set(state)
    uninterrupted = helloworld.main(TINY + HIDDEN + ["--lr", "0.1", "--num_steps", "4"])
    resumed = helloworld.main(flags)
    assert "[Checkpoint] loaded the model state from" in capsys.readouterr().out
    assert resumed[0] == pytest.approx(uninterrupted[3], rel=1e-6)


def test_tutel_flags_keep_tutels_meaning(monkeypatch, capsys):
    from dynamoe.examples import _common, bandwidth_test
    calls = []
    monkeypatch.setattr(_common, "_average_gradients", lambda model: calls.append(1))
    helloworld.main(TINY + HIDDEN + ["--num_steps", "2"])
    assert len(calls) == 2
    helloworld.main(TINY + HIDDEN + ["--num_steps", "2", "--allreduce_degree", "-1"])  # Tutel: no all-reduce
    assert len(calls) == 2
    before = torch.backends.cuda.matmul.allow_tf32
    try:
        torch.backends.cuda.matmul.allow_tf32 = False
        helloworld.main(TINY + HIDDEN + ["--num_steps", "1", "--use_tensorcore"])
        assert torch.backends.cuda.matmul.allow_tf32 is True
    finally:
        torch.backends.cuda.matmul.allow_tf32 = before
    capsys.readouterr()
    with pytest.warns(UserWarning, match="k=9 exceeds the 4 experts"):  # Tutel clamps --top to the experts
        helloworld.main(TINY + HIDDEN + ["--num_steps", "1", "--top", "9"])
    assert "top_k = 4," in last_routing(capsys.readouterr().out)
    llama = helloworld.build_model(helloworld.parse_args(helloworld.build_parser("x"), TINY + HIDDEN + ["--expert_type", "llama_ffn"]))
    assert sorted(n for n, _ in llama._moe_layer.experts.named_parameters()) == ["W_fc1", "W_fc2", "W_fc3"]
    capsys.readouterr()
    rounds = bandwidth_test.main(["--size_mb", "1", "--loop", "2", "--device", "cpu"])
    out = capsys.readouterr().out
    assert len(rounds) == 2 and set(rounds[0]) == {"AllToAll", "AllReduce", "AllGather", "ReduceScatter"}
    assert out.count("AllReduce bandwidth across 1 node(s) = ") == 2


def test_interrupted_save_keeps_the_previous_checkpoint(tmp_path, monkeypatch):
    from dynamoe.examples._common import load_checkpoint, save_checkpoint
    path = str(tmp_path / "m.ckpt")
    model = torch.nn.Linear(3, 2)
    optimizer = torch.optim.SGD(model.parameters(), lr=0.1)
    save_checkpoint(path, model, optimizer, steps=5)
    before = open(path, "rb").read()

    def crash(obj, f, *args, **kwargs):
        f.write(b"half a checkpoint")
        raise KeyboardInterrupt
    monkeypatch.setattr(torch, "save", crash)
    with pytest.raises(KeyboardInterrupt):
        save_checkpoint(path, model, optimizer, steps=6)
    monkeypatch.undo()
    assert open(path, "rb").read() == before and os.listdir(tmp_path) == ["m.ckpt"]
    assert load_checkpoint(path, model, optimizer) == 5


def test_checkpoint_from_another_model_is_a_clear_error(tmp_path, capsys):
    ckpt = str(tmp_path / "hw.ckpt")
    common = ["--num_steps", "1", "--save_load_checkpoint", "--checkpoint_path", ckpt]
    helloworld.main(TINY + HIDDEN + common)
    with pytest.raises(SystemExit, match="does not fit this model") as exc:
        helloworld.main(TINY + ["--hidden_size", "8"] + common)
    assert ckpt in str(exc.value)


BAD_FLAGS = [
    (helloworld, ["--batch_size", "0"], "--batch_size"),
    (helloworld, ["--capacity_factor", "nan"], "--capacity_factor"),
    (helloworld, ["--megablocks_size", "-1"], "--megablocks_size"),
    (helloworld, ["--parallel_type", "adaptive:2"], "--parallel_type"),
    (helloworld, ["--dtype", "int8"], "--dtype"),
    (helloworld, ["--allreduce_degree", "0"], "--allreduce_degree"),
    (helloworld, ["--save_load_checkpoint", "--checkpoint_path", "/nonexistent-dir/x.ckpt"], "--checkpoint_path"),
    (helloworld_custom_gate_expert, ["--hidden_size", "32"], "--hidden_size"),
    (helloworld_from_scratch, ["--num_local_experts", "-2"], "--num_local_experts"),
]
if not torch.cuda.is_available():
    BAD_FLAGS.append((helloworld, ["--device", "cuda"], "--device"))


@pytest.mark.parametrize("module, bad, flag", BAD_FLAGS, ids=[" ".join(b) for _, b, _ in BAD_FLAGS])
def test_bad_flag_is_an_argparse_error(module, bad, flag, capsys):
    with pytest.raises(SystemExit) as exc:
        module.main(TINY + bad)
    assert exc.value.code == 2
    assert flag in capsys.readouterr().err


def test_module_entry_point():
    env = dict(os.environ, OMP_NUM_THREADS="1")
    proc = subprocess.run([sys.executable, "-m", "dynamoe.examples.helloworld", *TINY, *HIDDEN, "--num_steps", "2"],
                          capture_output=True, text=True, timeout=120, env=env,
                          cwd=os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
    assert proc.returncode == 0, proc.stderr
    assert len(printed_losses(proc.stdout)) == 2 and "[Summary]" in proc.stdout


def test_helloworld_under_torchrun_two_ranks():
    """Tutel's multi-process run: torchrun --nproc_per_node=2 spreads the experts over the ranks."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, OMP_NUM_THREADS="1")
    out = subprocess.run(
        [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2", f"--master_port={port}",
         "-m", "dynamoe.examples.helloworld", "--batch_size", "2", "--num_tokens", "16", "--model_dim", "16",
         "--hidden_size", "32", "--num_local_experts", "2", "--top", "2", "--num_steps", "3", "--capacity_factor", "0"],
        capture_output=True, text=True, timeout=180, env=env)
    assert out.returncode == 0, out.stderr[-3000:]
    assert "world_size = 2" in out.stdout
    assert out.stdout.count("STEP-") == 3  # rank 0 prints, rank 1 does not
    load = out.stdout.split("load = [")[1].split("]")[0]
    assert len(load.split(",")) == 4  # 2 local experts x 2 ranks
