"""CausalLM.forward_rows: decode rows of some sequences and a prompt chunk of another as the rows of one native
decode-plan call, against the same model's two ordinary forwards (the decode step, then the chunk through the
prefill path); and the engine that runs a waiting prompt's chunks beside decoding requests that way: the same
tokens as with every chunk on its own."""
import copy

import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import fused_families, save_family

transformers = pytest.importorskip("transformers")

import dynamoe.models as dm  # noqa: E402
from dynamoe.engine import GenerationEngine, SamplingParams  # noqa: E402
from dynamoe.models.base import CausalLM  # noqa: E402
from dynamoe.ops import cpu_kernels  # noqa: E402
from dynamoe.ops.fused import MAX_ROWS  # noqa: E402

# (make test sets DYNAMOE_REQUIRE_CPU_KERNELS: a failed build raises there instead of skipping)
pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels could not be built here")
FAMILIES = fused_families(transformers, max_position_embeddings=256)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def folder(request, tmp_path_factory):
    return save_family(FAMILIES, request.param, tmp_path_factory)


def _model(folder, dtype):
    return copy.deepcopy(dm.load(folder, dtype=dtype, progress=False))


def _prefilled(model, dtype, ids):
    """A cache with ids[0, :20] in slot 2 and ids[1, :9] in slot 0."""
    cache = model.new_cache(3, 64, dtype=dtype, block_size=4)
    with torch.inference_mode():
        model(ids[:1, :20], cache=cache, slots=torch.tensor([2]))
        model(ids[1:, :9], cache=cache, slots=torch.tensor([0]))
    return cache


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("chunk", [2, 7, MAX_ROWS - 1])
def test_decode_rows_and_a_chunk_equal_separate_forwards(folder, dtype, chunk):
    """Against the chunk's tokens decoded one by one (the same kernels: equal but for the order of the attention's
    sums) and, in fp32, against the chunk through the prefill path."""
    model = _model(folder, dtype)
    ids = torch.randint(0, 96, (2, 40), generator=torch.Generator().manual_seed(3))
    assert model.rows_plan(model.new_cache(1, 8, dtype=dtype)) is not None
    a, b, c = (_prefilled(model, dtype, ids) for _ in range(3))
    with torch.inference_mode():
        rows = torch.cat([ids[0, 20:21], ids[1, 9:9 + chunk]])
        slots = torch.tensor([2] + [0] * chunk)
        got = model.forward_rows(rows, a, slots, list(range(chunk + 1)))
        want = [model(ids[:1, 20:21], cache=b, slots=torch.tensor([2]))[0, -1]]
        want += [model(ids[1:, t:t + 1], cache=b, slots=torch.tensor([0]))[0, -1] for t in range(9, 9 + chunk)]
        prefill = model(ids[1:, 9:9 + chunk], cache=c, slots=torch.tensor([0]))[0]
    tight = dict(rtol=1e-5, atol=1e-5) if dtype == torch.float32 else dict(rtol=0.02, atol=0.02)
    torch.testing.assert_close(got, torch.stack(want), **tight)
    if dtype == torch.float32:
        torch.testing.assert_close(got[1:], prefill, rtol=1e-4, atol=1e-4)
    assert torch.equal(a.lengths, b.lengths) and a.lengths.tolist() == [9 + chunk, 0, 21]
    for la, lb in zip(a.layers, b.layers):   # the same keys and values written (the blocks may differ)
        for name in ("k", "v"):
            for slot, n in ((2, 21), (0, 9 + chunk)):
                torch.testing.assert_close(a.rows(la[name], torch.tensor([slot]), n),
                                           b.rows(lb[name], torch.tensor([slot]), n), **tight)


def test_forward_rows_refuses_what_it_cannot_run(folder):
    model = _model(folder, torch.float32)
    cache = model.new_cache(3, 16, block_size=4)
    ids = torch.zeros(3, dtype=torch.long)
    with torch.inference_mode():
        with pytest.raises(ValueError, match="one after the other"):
            model.forward_rows(ids, cache, torch.tensor([0, 1, 0]), [0])
        with pytest.raises(ValueError, match=f"1..{MAX_ROWS} rows"):
            model.forward_rows(torch.zeros(MAX_ROWS + 1, dtype=torch.long), cache,
                               torch.zeros(MAX_ROWS + 1, dtype=torch.long), [0])
        with pytest.raises(ValueError, match="exceeds max_seq_len=16"):
            model.forward_rows(ids, _full(cache, 0, 14), torch.tensor([0, 0, 0]), [0])
        twin = copy.deepcopy(model)
        twin.use_decode_plan = False
        assert twin.rows_plan(cache) is None
        with pytest.raises(RuntimeError, match="rows_plan"):
            twin.forward_rows(ids, cache, torch.tensor([0, 0, 1]), [0])


def _full(cache, slot, length):
    cache.reserve(slot, length)
    cache.lengths[slot] = length
    return cache


def _generate(model, prompts, rows_beside: bool, monkeypatch, **engine_kw):
    """Greedy tokens of every prompt: the first two decode, the others arrive once they have two tokens each."""
    calls = []
    if rows_beside:
        real = CausalLM.forward_rows

        def spy(self, ids, cache, slots, logits_rows):
            calls.append(len(set(slots.tolist())) < slots.numel())
            return real(self, ids, cache, slots, logits_rows)
        monkeypatch.setattr(CausalLM, "forward_rows", spy)
    else:
        monkeypatch.setattr(CausalLM, "rows_plan", lambda self, cache, slots=None: None)
    eng = GenerationEngine(model, None, max_seq_len=200, max_batch=4, block_size=4, **engine_kw)
    reqs = [eng.add_request(p, SamplingParams(temperature=0), max_tokens=12, ignore_eos=True) for p in prompts[:2]]
    while min(len(r.output_ids) for r in reqs) < 2:
        eng.step()
    reqs += [eng.add_request(p, SamplingParams(temperature=0), max_tokens=6, ignore_eos=True) for p in prompts[2:]]
    while any(not r.finished for r in reqs):
        eng.step()
    monkeypatch.undo()
    return [r.output_ids for r in reqs], calls


@pytest.mark.parametrize("engine_kw", [{}, {"token_budget": 8}])
def test_engine_runs_a_short_prompt_in_the_decode_forward(folder, engine_kw, monkeypatch):
    """A short prompt arriving rides in the decoding requests' forward (and a long one's chunks run on their own):
    the same tokens as with every prompt on its own."""
    model = _model(folder, torch.float32)
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, 96, (n,), generator=g).tolist() for n in (5, 9, 6, 60)]
    beside, calls = _generate(model, prompts, True, monkeypatch, **engine_kw)
    alone, _ = _generate(model, prompts, False, monkeypatch, **engine_kw)
    assert beside == alone
    assert sum(calls) >= 1   # (the short prompt's rows beside the decode rows)


def test_the_prefill_budget_after_rows_beside(folder):
    """What a prompt's rows took in the decode forward comes off the step's prefill budget (tokens when it is fixed,
    seconds when it is measured): none left, no chunk that step."""
    model = _model(folder, torch.float32)
    fixed = GenerationEngine(model, None, max_seq_len=64, max_batch=2, block_size=4, token_budget=8)
    assert fixed._prefill_budget(2) == 6 and fixed._prefill_budget(2, (3, 0.0)) == 3
    assert fixed._prefill_budget(2, (6, 0.0)) == 0
    measured = GenerationEngine(model, None, max_seq_len=64, max_batch=2, block_size=4)
    measured._decode_s = 0.010   # stall_ratio 2: 20 ms of prefill a step
    for n in (8, 16, 32):
        measured._chunk_cost.observe(n, 0.001 * n)
    assert measured._prefill_budget(2, (3, 0.025)) == 0
    assert measured._prefill_budget(2, (3, 0.010)) < measured._prefill_budget(2)
