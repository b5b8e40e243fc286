"""Decode steps through a DecodePlan (dynamoe.models.decode_plan: the fused kernel calls of every layer
back to back, their weights worked out once) against the layer-by-layer path of a twin model: the
same logits, routing statistics and KV cache, bit for bit -- in steady state, after each kind of change
that makes a plan stale, and where a kernel fails mid-plan."""
import copy
import dataclasses

import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import fused_families, save_family

transformers = pytest.importorskip("transformers")

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.decode_plan import DecodePlan  # noqa: E402
from dynamoe.models.norms import RMSNorm  # noqa: E402
from dynamoe.ops import cpu_kernels  # noqa: E402
from spying import record_calls  # noqa: E402

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels could not be built here")

FAMILIES = fused_families(transformers)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def folder(request, tmp_path_factory):
    return save_family(FAMILIES, request.param, tmp_path_factory)


def _pair(folder, dtype):
    """(model with plans, twin without), the same weights -- both copies, so that both own their memory:
    a loaded model's weights may be views into the memory-mapped file at any offset, and oneDNN's fp32
    GEMV (the lm_head here) sums in another order for another alignment of the weight."""
    model = copy.deepcopy(dm.load(folder, dtype=dtype, progress=False))
    twin = copy.deepcopy(model)
    twin.use_decode_plan = False
    return model, twin


class _Run:
    """One model's cache and steps: two prompts of different lengths in slots 2 and 0, then batched
    steps (rows at different positions, slots out of order)."""

    def __init__(self, model, dtype):
        self.model, self.cache = model, model.new_cache(3, 40, dtype=dtype)
        g = torch.Generator().manual_seed(5)
        self.ids = torch.randint(0, 96, (2, 30), generator=g)
        with torch.inference_mode():
            model(self.ids[:1, :7], cache=self.cache, slots=torch.tensor([2]))
            model(self.ids[1:, :4], cache=self.cache, slots=torch.tensor([0]))
        self.t = 7

    def step(self, rows=2):
        with torch.inference_mode():
            ids = self.ids[:rows, self.t:self.t + 1]
            logits = self.model(ids, cache=self.cache, slots=torch.tensor([2, 0][:rows]))
        self.t += 1
        stats = [(s.load.clone(), s.top_k, s.capacity) for s in (b.last_stats for _, b in self.model.moe_layers())]
        return logits, stats


def _same(a: _Run, b: _Run, rows=2):
    (la, sa), (lb, sb) = a.step(rows), b.step(rows)
    assert torch.equal(la, lb)
    assert len(sa) == len(sb) and all(torch.equal(x[0], y[0]) and x[1:] == y[1:] for x, y in zip(sa, sb))
    for bufs_a, bufs_b in zip(a.cache.layers, b.cache.layers):
        assert bufs_a.keys() == bufs_b.keys() and all(torch.equal(bufs_a[k], bufs_b[k]) for k in bufs_a)
    assert torch.equal(a.cache.lengths, b.cache.lengths)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_plan_steps_equal_layer_by_layer(folder, dtype, monkeypatch):
    model, twin = _pair(folder, dtype)
    built = record_calls(monkeypatch, DecodePlan, "build")
    ran = record_calls(monkeypatch, DecodePlan, "run")
    a, b = _Run(model, dtype), _Run(twin, dtype)
    for rows in (2, 2, 1, 2, 1, 2, 2, 2):  # past the window; one row and two
        _same(a, b, rows)
    assert built == [True] and len(ran) == 8  # built once, for the first step (twin: never)
    plan = model.__dict__["_plan"][1]
    assert [e.fused for e in plan.entries] == [True] * 3 and len(plan.steps) == 1  # one DecodeStack
    assert plan.describe() == "3 of 3 layers fused"


def test_a_stale_plan_is_rebuilt(folder, monkeypatch):
    dtype = torch.bfloat16
    model, twin = _pair(folder, dtype)
    built = record_calls(monkeypatch, DecodePlan, "build")
    a, b = _Run(model, dtype), _Run(twin, dtype)
    _same(a, b)

    def both(change):
        for m in (model, twin):
            change(m)
        n = len(built)
        _same(a, b)
        return len(built) - n

    def moe(m, i=0):
        return m.model.layers[i].mlp.moe

    def gate(m, **change):  # a new routing config for the layer (configs are frozen)
        cfg = moe(m).config
        moe(m).config = dataclasses.replace(cfg, gates=(dataclasses.replace(cfg.gates[0], **change),))

    # routing switched at run time (new configs, not modules): renormalisation off, then top-k 2 -> 1
    assert both(lambda m: gate(m, normalize=False)) == 1
    assert both(lambda m: gate(m, k=1)) == 1
    assert a.step()[1][0][1] == 1  # the statistics say k = 1
    b.step()
    # weights updated in place: the plan holds the parameters themselves, nothing to rebuild -- but for its
    # fp32 copies of bf16 parameters (GPT-OSS's sinks and router biases)
    sd = {k: v + 0.01 if v.is_floating_point() else v for k, v in twin.state_dict().items()}
    assert both(lambda m: m.load_state_dict(sd)) == (1 if "gpt_oss" in folder else 0)
    # a module replaced
    norm = RMSNorm(64, eps=1e-6, dtype=dtype)
    with torch.no_grad():
        norm.weight.normal_(1.0, 0.3)
    assert both(lambda m: setattr(m.model.layers[2], "post_attention_layernorm", copy.deepcopy(norm))) == 1
    # a q_proj weight given new data: the fused q/k/v weight no longer backs it (the layer runs as a module)
    new_q = model.model.layers[0].self_attn.q_proj.weight.detach().clone() * 1.5

    def swap_q(m):
        m.model.layers[0].self_attn.q_proj.weight.data = new_q.clone()
    assert both(swap_q) == 1
    entry = model.__dict__["_plan"][1].entries[0]
    assert not entry.fused and "no longer view the fused buffer" in entry.reason
    if "gpt_oss" in folder:  # a bf16 parameter of which the plan holds an fp32 copy, changed in place
        def sinks(m):
            with torch.no_grad():
                m.model.layers[2].self_attn.sinks.mul_(-1)
        assert both(sinks) == 1
    # the whole model converted: new data everywhere (CausalLM._apply); with the cache of the old dtype
    # (every layer on its own path) and with a new fp32 cache (a plan again: q/k/v fused again after the
    # conversion, but layer 0's, unfused before)
    assert both(lambda m: m.float()) == 1
    _same(_Run(model, torch.float32), _Run(twin, torch.float32))
    plan = model.__dict__["_plan"][1]
    assert [e.fused for e in plan.entries] == [False, True, True]
    assert plan.describe().startswith("2 of 3 layers fused; layers 0 run as modules: attention: q/k/v projections")


def test_copies_and_conversions_stay_fused(folder):
    """q/k/v fused (one GEMV at decode, and what the fused attention call needs) survive .to() and deep
    copies, with the same numbers."""
    model = dm.load(folder, dtype=torch.bfloat16, progress=False)
    twin = copy.deepcopy(model)
    assert all(layer.self_attn._still_fused(layer.self_attn._qkv) for layer in twin.model.layers)
    twin.use_decode_plan = False
    _same(_Run(model, torch.bfloat16), _Run(twin, torch.bfloat16))
    model.to(torch.float32)
    attn = model.model.layers[0].self_attn
    assert attn._qkv[0].dtype == torch.float32 and attn._still_fused(attn._qkv)


def test_a_relaid_weight_rebuilds_the_plan_without_that_kernel(folder):
    """An expert weight given the same values in a non-contiguous layout (``p.data = ...``): the plan is
    rebuilt, that layer's MoE block runs on the general path (the kernel takes contiguous weights), with
    the same results."""
    dtype = torch.bfloat16
    model, twin = _pair(folder, dtype)
    a, b = _Run(model, dtype), _Run(twin, dtype)
    _same(a, b)
    for m in (model, twin):
        experts = m.model.layers[0].mlp.moe.experts
        experts.down_proj.data = experts.down_proj.data.transpose(1, 2).contiguous().transpose(1, 2)
    _same(a, b)
    entry = model.__dict__["_plan"][1].entries[0]
    assert not entry.fused and "not contiguous" in entry.reason
    _same(a, b)


def test_a_kernel_failing_midway_falls_back_and_says_so(folder, monkeypatch, caplog):
    """A fused run that raises (something no check foresaw): the step reruns layer by layer with the same
    result, a warning says what failed, and the plan stays off until the model changes."""
    from dynamoe.models import decode_plan

    dtype = torch.bfloat16
    model, twin = _pair(folder, dtype)
    a, b = _Run(model, dtype), _Run(twin, dtype)
    _same(a, b)
    calls = []

    def failing(self, *args):
        calls.append(1)
        raise RuntimeError("a kernel refused")
    monkeypatch.setattr(decode_plan._FusedRun, "run", failing)
    with caplog.at_level("WARNING", logger="dynamoe.models.base"):
        _same(a, b)
        _same(a, b)
    assert calls == [1]
    assert "decode plan" in caplog.text and "a kernel refused" in caplog.text
    assert model.__dict__["_plan"][1] is None


def test_no_plan_where_it_does_not_apply(folder, monkeypatch):
    """Prefill (T > 1), 17 rows, autograd on, a switched-off model: the layers run one by one."""
    model = dm.load(folder, progress=False)
    ran = record_calls(monkeypatch, DecodePlan, "run")
    ids = torch.randint(0, 96, (17, 5), generator=torch.Generator().manual_seed(1))
    cache = model.new_cache(17, 16)
    with torch.no_grad():
        model(ids[:, :4], cache=cache)
        model(ids[:, 4:], cache=cache)
    cache = model.new_cache(1, 16)
    model(ids[:1, :4], cache=cache)
    model(ids[:1, 4:], cache=cache)
    model.use_decode_plan = False
    with torch.no_grad():
        model(ids[:1, 4:], cache=cache)
    assert ran == []
    model.use_decode_plan = True
    with torch.no_grad():
        model(ids[:1, 4:], cache=cache)
    assert ran == [True]
