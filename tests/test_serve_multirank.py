"""Multi-rank (expert-parallel) serving: the rank-synchronised runner (dynamoe.engine.distributed) on two
gloo ranks -- engine output equal to one process's, slots freed and reused, errors on every rank or on
rank 0 alone -- and ``torchrun --standalone --nproc_per_node 2 -m dynamoe.cli serve`` end to end through
the official ``openai`` SDK against a one-process server over the same checkpoint."""
from __future__ import annotations

import os
import signal
import subprocess
import sys
import threading
import time

import pytest
import torch
import torch.distributed as dist

from dist_harness import run_ranks
from serve_testing import MAX_SEQ_LEN, InProcessServer, ServerProcess, free_port, make_checkpoint

pytest.importorskip("transformers")

PROMPTS = ["hello world", "the quick brown fox jumps", "世界", "les élèves étudient à l'école; über schön"]


@pytest.fixture(scope="module")
def ckpt(tmp_path_factory) -> str:
    return make_checkpoint(str(tmp_path_factory.mktemp("ep_serve_ckpt")))


# ------------------------------------------------------------------------ the runner on 2 gloo ranks
def _generate(engine, prompts, max_tokens):
    """Every prompt queued at once (more than the engine's slots: some wait, then reuse freed slots)."""
    from dynamoe.engine import SamplingParams

    greedy = SamplingParams(temperature=0)
    reqs = [engine.add_request(p, greedy, max_tokens=max_tokens + i, ignore_eos=True) for i, p in enumerate(prompts)]
    engine.run_until_done(reqs)
    assert all(r.finish_reason == "length" for r in reqs), reqs
    return [r.output_ids for r in reqs]


def runner_worker(rank, world, path):
    from dynamoe.engine import GenerationEngine, Tokenizer
    from dynamoe.engine.distributed import ControlChannel, LeaderModel, follow
    from dynamoe.models import load

    torch.set_num_threads(1)
    model = load(path, progress=False, group=dist.group.WORLD)
    assert all(len(b.local_experts) == 4 for _, b in model.moe_layers())
    channel = ControlChannel(dist.group.WORLD)
    if rank != 0:
        follow(model, channel)       # returns at STOP
        return
    tok = Tokenizer.from_dir(path)
    ref_engine = GenerationEngine(load(path, progress=False), tok, max_seq_len=64, max_batch=3)
    want = _generate(ref_engine, PROMPTS, 5)
    fatal = []
    leader = LeaderModel(model, channel, on_fatal=fatal.append)
    engine = GenerationEngine(leader, tok, max_seq_len=64, max_batch=3, prefill_chunk=4)
    assert _generate(engine, PROMPTS, 5) == want
    assert engine.cache.lengths.tolist() == [0, 0, 0]   # every slot freed on rank 0 (never sent)

    # rank 0 alone: checks before anything is sent
    with pytest.raises(ValueError, match="made last by this model's new_cache"):
        leader(torch.tensor([[1, 2]]), cache=ref_engine.cache, slots=torch.tensor([0]))
    with pytest.raises(ValueError, match="exceeds max_seq_len"):
        leader(torch.ones(1, 65, dtype=torch.long), cache=engine.cache, slots=torch.tensor([1]))
    # every rank fails alike (a token id past the vocabulary): rank 0 gets the error, nobody falls out of step
    with pytest.raises(IndexError):
        leader(torch.tensor([[10 ** 6]]), cache=engine.cache, slots=torch.tensor([2]))
    with pytest.raises(IndexError):
        leader(torch.tensor([[10 ** 6]]))
    assert leader.broken is None and not fatal
    assert _generate(engine, PROMPTS[::-1], 4) == _generate(ref_engine, PROMPTS[::-1], 4)
    leader.stop_followers()
    leader.stop_followers()   # idempotent
    with pytest.raises(RuntimeError, match="stopped"):
        leader(torch.tensor([[1]]))


def test_runner_matches_one_process(ckpt):
    run_ranks(2, runner_worker, ckpt, timeout=240)


def out_of_step_worker(rank, world, path):
    """A forward that fails on rank 0 alone, before the first expert exchange: rank 1 waits in that
    exchange. Rank 0 declares the ranks out of step after fail_timeout_s; once it is gone, rank 1 does."""
    from dynamoe.engine.distributed import ControlChannel, LeaderModel, RanksOutOfStep, follow
    from dynamoe.models import load

    torch.set_num_threads(1)
    model = load(path, progress=False, group=dist.group.WORLD)
    channel = ControlChannel(dist.group.WORLD, fail_timeout_s=2.0)
    if rank == 0:
        fatal = []
        leader = LeaderModel(model, channel, on_fatal=fatal.append)
        cache = leader.new_cache(2, 32)
        ids, slots = torch.tensor([[5, 6, 7]]), torch.tensor([0])
        leader(ids, cache=cache, slots=slots)          # in step so far

        def boom(module, args):
            raise RuntimeError("out of memory on rank 0 only")

        model.moe_layers()[0][1].register_forward_pre_hook(boom)
        t0 = time.monotonic()
        with pytest.raises(RanksOutOfStep, match="out of step"):
            leader(ids, cache=cache, slots=torch.tensor([1]))
        assert time.monotonic() - t0 < 30
        assert len(fatal) == 1 and leader.broken is fatal[0]
        with pytest.raises(RanksOutOfStep):
            leader(ids, cache=cache, slots=slots)
        leader.stop_followers()                        # a no-op once out of step: must not hang
    else:
        with pytest.raises(RanksOutOfStep):
            follow(model, channel)
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(0)   # the process group is unusable: no barrier, no destroy


def test_forward_failing_on_rank0_alone_ends_every_rank(ckpt):
    run_ranks(2, out_of_step_worker, ckpt, timeout=180)


# ------------------------------------------------------------------------ torchrun end to end
def _children(pid: int) -> list[int]:
    out = []
    for d in os.listdir("/proc"):
        if d.isdigit():
            try:
                with open(f"/proc/{d}/stat") as f:
                    stat = f.read()
            except OSError:
                continue
            if int(stat.rsplit(")", 1)[1].split()[1]) == pid:
                out.append(int(d))
    return out


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


class TorchrunServer(ServerProcess):
    """``torchrun --standalone --nproc_per_node N -m dynamoe.cli serve`` in its own session (so that
    whatever is left can be killed as a group); ``workers``: the rank processes."""

    def __init__(self, model_dir: str, nproc: int = 2):
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = None
        torchrun = os.path.join(os.path.dirname(sys.executable), "torchrun")
        launcher = [torchrun] if os.path.exists(torchrun) else [sys.executable, "-m", "torch.distributed.run"]
        cmd = [*launcher, "--standalone", "--nproc_per_node", str(nproc), "-m", "dynamoe.cli", "serve",
               "--model", model_dir, "--port", str(self.port), "--max_seq_len", str(MAX_SEQ_LEN), "--max-num-seqs", "4",
               "--served-model-name", "tiny-moe", "--log-level", "warning", "--device", "cpu"]
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", DYNAMOE_COLLECTIVE_TIMEOUT_SEC="120")
        env.pop("DYNAMOE_API_KEY", None)
        for name in ("WORLD_SIZE", "RANK", "LOCAL_RANK", "LOCAL_SIZE", "LOCAL_WORLD_SIZE", "MASTER_ADDR", "MASTER_PORT"):
            env.pop(name, None)
        self.log_path = os.path.join(model_dir, f"torchrun-{self.port}.log")
        self._log = open(self.log_path, "w")
        root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
        self.proc = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=env, cwd=root,
                                     start_new_session=True)
        self.workers: list[int] = []
        try:
            self._wait(timeout=180.0)
            self.workers = _children(self.proc.pid)
        except BaseException:
            self.kill()
            raise

    def kill(self) -> None:
        """Everything left of the job, at once."""
        try:
            os.killpg(self.proc.pid, signal.SIGKILL)
        except (ProcessLookupError, PermissionError):
            pass
        for pid in self.workers:
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        self.proc.wait(10)
        if not self._log.closed:
            self._log.close()


def _client(url: str):
    import openai

    return openai.OpenAI(base_url=url + "/v1", api_key="unused", max_retries=0, timeout=120.0)


def _texts(client) -> dict:
    """Greedy outputs of the four call shapes, keyed by what was asked."""
    out = {}
    for i, p in enumerate(PROMPTS[:2]):
        r = client.chat.completions.create(model="tiny-moe", messages=[{"role": "user", "content": p}], max_tokens=8,
                                           temperature=0)
        out["chat", p] = r.choices[0].message.content
        stream = client.chat.completions.create(model="tiny-moe", messages=[{"role": "user", "content": p}],
                                                max_tokens=8, temperature=0, stream=True)
        out["chat-stream", p] = "".join(c.choices[0].delta.content or "" for c in stream if c.choices)
        r = client.completions.create(model="tiny-moe", prompt=p, max_tokens=8, temperature=0)
        out["completion", p] = r.choices[0].text
        stream = client.completions.create(model="tiny-moe", prompt=p, max_tokens=8, temperature=0, stream=True)
        out["completion-stream", p] = "".join(c.choices[0].text for c in stream if c.choices)
    return out


def _concurrent(client) -> dict:
    results, errors = {}, []

    def one(p):
        try:
            r = client.chat.completions.create(model="tiny-moe", messages=[{"role": "user", "content": p}],
                                               max_tokens=6, temperature=0)
            results[p] = (r.choices[0].message.content, r.choices[0].finish_reason)
        except Exception as e:   # noqa: BLE001 -- reported below
            errors.append(e)

    threads = [threading.Thread(target=one, args=(p,)) for p in PROMPTS + [p + "!" for p in PROMPTS]]
    for t in threads:
        t.start()
    for t in threads:
        t.join(180)
    assert not errors, errors
    return results


def test_torchrun_serve_matches_one_process(ckpt):
    pytest.importorskip("openai")
    from dynamoe.engine import GenerationEngine, load

    model, tok = load(ckpt)
    ref = InProcessServer(GenerationEngine(model, tok, max_seq_len=MAX_SEQ_LEN, max_batch=4), tok,
                          model_name="tiny-moe")
    server = None
    try:
        want = _texts(_client(ref.url))
        want_concurrent = _concurrent(_client(ref.url))
        server = TorchrunServer(ckpt)
        log = server.log()
        assert "parameters per rank, cpu, expert parallel over 2 ranks" in log, log
        assert len(server.workers) == 2, (server.workers, log)
        client = _client(server.url)
        assert [m.id for m in client.models.list().data] == ["tiny-moe"]
        got = _texts(client)
        assert all(want.values()), want
        assert got == want
        assert _concurrent(client) == want_concurrent
        assert len(want_concurrent) == 2 * len(PROMPTS)

        # terminating the job ends every rank
        server.proc.send_signal(signal.SIGTERM)
        server.proc.wait(60)
        deadline = time.monotonic() + 20
        while any(_alive(p) for p in server.workers) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert not any(_alive(p) for p in server.workers), server.log()
    finally:
        ref.stop()
        if server is not None:
            server.kill()


def test_serve_errors_before_the_process_group(ckpt, monkeypatch, capsys):
    from dynamoe import cli
    from dynamoe.serve.cli import rank_environment

    assert rank_environment({}) is None and rank_environment({"WORLD_SIZE": "1"}) is None
    assert rank_environment({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_RANK": "1"}) == (3, 4, 1, 4)
    assert rank_environment({"WORLD_SIZE": "4", "RANK": "3", "LOCAL_SIZE": "2"}) == (3, 4, 1, 2)  # the name
    assert rank_environment({"WORLD_SIZE": "4", "RANK": "2", "LOCAL_WORLD_SIZE": "2", "LOCAL_RANK": "0"}) == (2, 4, 0, 2)
    for env, msg in (({"WORLD_SIZE": "2"}, "RANK is not set"), ({"WORLD_SIZE": "2", "RANK": "2"}, "RANK must be in"),
                     ({"WORLD_SIZE": "x"}, "WORLD_SIZE must be an integer"),
                     ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_SIZE": "3"}, "LOCAL_SIZE"),
                     ({"WORLD_SIZE": "2", "RANK": "0", "LOCAL_RANK": "2", "LOCAL_SIZE": "2"}, "LOCAL_RANK must be in")):
        with pytest.raises(ValueError, match=msg):
            rank_environment(env)
    monkeypatch.setenv("WORLD_SIZE", "2")
    assert cli.main(["serve", "--model", ckpt]) == 2
    assert "RANK is not set" in capsys.readouterr().err
    monkeypatch.setenv("RANK", "1")
    monkeypatch.setenv("LOCAL_RANK", "1")
    if not torch.cuda.is_available():
        assert cli.main(["serve", "--model", ckpt, "--device", "cuda"]) == 2
        assert "LOCAL_RANK=1 needs cuda:1, but this node has 0 CUDA device(s)" in capsys.readouterr().err
