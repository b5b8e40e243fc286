"""A prefill chunk beside decoding requests runs a few of the model's layers a step (CausalLM.begin_forward /
run_some_layers / end_forward): every running stream still gets a token every step, the chunk's forward spans
several steps, and every request's tokens are the ones it gets alone; a request cancelled or preempted with its
chunk part way through the layers starts that chunk again. (The model's chunks as rows of the decode forward,
which a fully fused model takes while they are cheap, are off here: tests/test_forward_rows.py has them.)"""
import pytest
import torch

from models_util import one_thread, randomize_, save_tiny  # noqa: F401 (autouse fixture)

transformers = pytest.importorskip("transformers")

import dynamoe.models as dm  # noqa: E402
from dynamoe.engine import GenerationEngine, SamplingParams  # noqa: E402

VOCAB = 96
GREEDY = SamplingParams(temperature=0.0)


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    cfg = transformers.Qwen3MoeConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=64, moe_intermediate_size=32,
                                      num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      num_experts=4, num_experts_per_tok=2, max_position_embeddings=512,
                                      bos_token_id=None, eos_token_id=None, pad_token_id=0)
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(cfg).eval()
    randomize_(hf, seed=4)
    model = dm.load(save_tiny(hf, str(tmp_path_factory.mktemp("steps"))), progress=False)
    model.rows_plan = lambda cache, slots=None: None   # (chunks beside decode rows: not these tests' path)
    return model


def _ids(seed, n):
    return torch.randint(1, VOCAB, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def _alone(model, prompt, n):
    e = GenerationEngine(model, max_seq_len=512, max_batch=1, block_size=4)
    r = e.add_request(prompt, GREEDY, n, ignore_eos=True)
    e.run_until_done()
    return r.output_ids


class _Spy:
    """Counts the layers each step runs of a pending chunk."""

    def __init__(self, model, monkeypatch):
        self.layers = []
        orig = model.run_some_layers

        def run_some_layers(run, count):
            self.layers.append(count)
            return orig(run, count)

        monkeypatch.setattr(model, "run_some_layers", run_some_layers)


def test_a_chunk_runs_a_layer_a_step_beside_streams(model, monkeypatch):
    assert model.runs_in_steps
    engine = GenerationEngine(model, max_seq_len=256, max_batch=3, block_size=4)
    engine.stall_ratio = 1e-9   # (every layer over the target: one layer a step)
    # (streams long enough to outlast the prompt whatever chunk sizes the measured times give: at least a block of
    # 4 tokens a chunk, 4 layers a chunk -> at most 152 steps for its 150 tokens)
    running = [engine.add_request(_ids(i, 6), GREEDY, 200, ignore_eos=True) for i in range(2)]
    engine.step()
    spy = _Spy(model, monkeypatch)
    long = engine.add_request(_ids(9, 150), GREEDY, 4, ignore_eos=True)
    steps = 0
    while not long.output_ids:
        before = [len(r.output_ids) for r in running]
        ran = len(spy.layers)
        engine.step()
        steps += 1
        assert [len(r.output_ids) for r in running] == [n + 1 for n in before]   # nobody waited
        assert len(spy.layers) - ran <= 1                                            # one layer a step at most
    assert len(spy.layers) >= 4 and steps >= len(spy.layers)   # (the prompt's chunks: 4 steps each)
    assert len(spy.layers) % 4 == 0 and engine._layer_run is None
    engine.run_until_done()
    assert long.output_ids == _alone(model, long.prompt_ids, 4)
    for r in running:
        assert r.output_ids == _alone(model, r.prompt_ids, 200)
    engine.cache.pool.check()


def test_steps_run_layers_while_they_fit(model, monkeypatch):
    """With a generous target a step takes a chunk through several layers (all four when they fit)."""
    engine = GenerationEngine(model, max_seq_len=256, max_batch=3, block_size=4)
    engine.stall_ratio = 1e6
    running = engine.add_request(_ids(1, 6), GREEDY, 30, ignore_eos=True)
    engine.step()
    spy = _Spy(model, monkeypatch)
    long = engine.add_request(_ids(2, 40), GREEDY, 3, ignore_eos=True)
    per_step = []
    while engine.has_work():
        ran = len(spy.layers)
        engine.step()
        per_step.append(len(spy.layers) - ran)
    assert max(per_step) == 4 and engine._layer_run is None   # a chunk through all four layers in one step
    assert long.output_ids == _alone(model, long.prompt_ids, 3) and len(running.output_ids) == 30


@pytest.mark.parametrize("how", ["cancel", "preempt"])
def test_a_request_leaving_mid_chunk_drops_the_pending_layers(model, how):
    engine = GenerationEngine(model, max_seq_len=256, max_batch=3, block_size=4,
                              kv_cache_blocks=64 if how == "cancel" else 20)
    engine.stall_ratio = 1e-9
    running = [engine.add_request(_ids(i, 6), GREEDY, 70, ignore_eos=True) for i in range(2)]
    engine.step()
    long = engine.add_request(_ids(9, 60), GREEDY, 3, ignore_eos=True)
    while engine._layer_run is None:
        engine.step()
    engine.step()
    assert engine._layer_run is not None and engine._layer_run.run.next_layer >= 1
    if how == "cancel":
        engine.cancel(long)
    else:   # the streams grow into the pool's last blocks: the latest request (the long one) is preempted
        while not engine.totals["preempted"]:
            engine.step()
        assert long._preempted and long._computed == 0
        assert engine._layer_run is None or long not in engine._layer_run.group
    engine.run_until_done()
    assert engine._layer_run is None
    for r in running:
        assert r.output_ids == _alone(model, r.prompt_ids, 70)
    if how == "preempt":
        assert long.output_ids == _alone(model, long.prompt_ids, 3)
    else:
        assert long.finish_reason == "cancelled"
    engine.cache.pool.check()


def test_a_prompt_on_cached_blocks_attends_over_them_in_place(model, monkeypatch):
    """A prompt whose first blocks come from the prefix cache holds them and then a run of its own: its chunks
    attend over the prefix run by run straight from the blocks (attention._runs_then_causal with two runs or
    more, no gathered copy), and it generates what it generates without the prefix cache."""
    from dynamoe.models import attention

    runs = []
    merge = attention._runs_then_causal
    monkeypatch.setattr(attention, "_runs_then_causal", lambda q, ks, *a: runs.append(len(ks)) or merge(q, ks, *a))
    shared, own = _ids(20, 320), _ids(21, 150)
    outputs = []
    for caching in (True, False):
        e = GenerationEngine(model, max_seq_len=512, max_batch=2, block_size=16, prefill_chunk=64,
                             prefix_caching=caching)
        first = e.add_request(shared + _ids(22, 5), GREEDY, 60, ignore_eos=True)
        while not first.output_ids:
            e.step()
        runs.clear()   # (the first request still runs: its blocks after the shared ones are taken)
        second = e.add_request(shared + own, GREEDY, 8, ignore_eos=True)
        e.run_until_done()
        assert second.stats.cached_tokens == (320 if caching else 0)
        assert first.output_ids == _alone(model, first.prompt_ids, 60)
        if caching:
            assert runs and max(runs) >= 2   # the cached blocks, then its own
        outputs.append(second.output_ids)
    assert outputs[0] == outputs[1]
