"""Sampling: greedy limits, seeded reproducibility regardless of the batch, HF repetition penalty, validation."""
import math

import pytest
import torch

from dynamoe.engine import SamplingParams, sample
from dynamoe.engine.sampling import apply_presence_frequency_penalty, apply_repetition_penalty

V = 50


def _gens(params):
    return [p.make_generator() if not p.greedy else None for p in params]


@pytest.mark.parametrize("p", [SamplingParams(temperature=0), SamplingParams(temperature=1.3, top_k=1),
                               SamplingParams(temperature=2.0, top_p=1e-6),
                               SamplingParams(temperature=1.0, min_p=1.0)])
def test_greedy_limits_are_argmax(p):
    logits = torch.randn(6, V) * 3
    params = [p] * 6
    tokens, lps = sample(logits, params, _gens(params))
    assert torch.equal(tokens, logits.argmax(-1)) and lps == [None] * 6


def test_seed_gives_same_tokens_alone_and_in_any_batch():
    torch.manual_seed(1)
    steps = [torch.randn(4, V) for _ in range(6)]
    mine = SamplingParams(temperature=0.9, top_p=0.95, top_k=20, seed=1234)
    others = [SamplingParams(temperature=0.0), SamplingParams(temperature=1.5, seed=7), SamplingParams(top_k=3)]
    alone_g = mine.make_generator()
    alone = [int(sample(s[2:3], [mine], [alone_g])[0]) for s in steps]
    params = [others[0], others[1], mine, others[2]]
    gens = _gens(params)
    batched = [int(sample(s, params, gens)[0][2]) for s in steps]
    assert alone == batched
    again = mine.make_generator()
    assert alone == [int(sample(s[2:3], [mine], [again])[0]) for s in steps]


def test_draws_follow_the_filtered_distribution():
    logits = torch.tensor([[2.0, 1.0, 0.5, 0.0, -1.0, -3.0]])
    n = 4000
    for p, support in [(SamplingParams(temperature=1.0, seed=0), 6),
                       (SamplingParams(temperature=1.0, top_k=2, seed=0), 2),
                       (SamplingParams(temperature=1.0, top_p=0.8, seed=0), 3),
                       (SamplingParams(temperature=1.0, min_p=0.2, seed=0), 3)]:
        g = p.make_generator()  # one generator for all rows: n independent draws in one call
        counts = torch.bincount(sample(logits.expand(n, -1), [p] * n, [g] * n)[0], minlength=6).float()
        assert counts[support:].sum() == 0
        want = torch.softmax(logits[0, :support], -1)
        assert torch.allclose(counts[:support] / n, want, atol=0.03), (p, counts / n, want)
    # temperature sharpens: token 0 more often at T=0.5 than at T=1
    p = SamplingParams(temperature=0.5, seed=3)
    g = p.make_generator()
    share = (sample(logits.expand(2000, -1), [p] * 2000, [g] * 2000)[0] == 0).float().mean()
    assert abs(share - torch.softmax(logits[0] / 0.5, -1)[0]) < 0.03


def test_repetition_penalty_matches_transformers():
    transformers = pytest.importorskip("transformers")
    torch.manual_seed(0)
    logits = torch.randn(3, V) * 4
    input_ids = torch.randint(0, V, (3, 12))
    for penalty in (1.3, 0.7):
        want = transformers.RepetitionPenaltyLogitsProcessor(penalty)(input_ids, logits.clone())
        seen = torch.zeros(3, V, dtype=torch.bool).scatter_(1, input_ids, True)
        got = apply_repetition_penalty(logits, seen, torch.full((3,), penalty))
        assert torch.equal(got, want)
    # through sample(): greedy with a penalty picks the argmax of the penalised logits
    p = SamplingParams(temperature=0, repetition_penalty=5.0)
    seen = torch.zeros(3, V, dtype=torch.bool).scatter_(1, logits.argmax(-1, keepdim=True), True)
    tokens, _ = sample(logits, [p] * 3, None, seen_BV=seen)
    assert torch.equal(tokens, apply_repetition_penalty(logits, seen, torch.full((3,), 5.0)).argmax(-1))
    assert not torch.equal(tokens, logits.argmax(-1))


def test_presence_frequency_penalty():
    logits = torch.zeros(1, 4)
    counts = torch.tensor([[0.0, 1.0, 3.0, 0.0]])
    got = apply_presence_frequency_penalty(logits, counts, torch.tensor([0.5]), torch.tensor([0.25]))
    assert torch.allclose(got, torch.tensor([[0.0, -0.75, -1.25, 0.0]]))


def test_logprobs_are_the_models():
    torch.manual_seed(0)
    logits = torch.randn(2, V)
    params = [SamplingParams(temperature=0, logprobs=3), SamplingParams(temperature=0.7, seed=1, logprobs=0)]
    tokens, lps = sample(logits, params, _gens(params))
    ref = torch.log_softmax(logits, -1)
    assert lps[0].token_id == int(tokens[0]) and math.isclose(lps[0].logprob, float(ref[0, tokens[0]]), rel_tol=1e-6)
    top = ref[0].topk(3)
    assert [t for t, _ in lps[0].top] == top.indices.tolist() and lps[0].top[0][0] == int(tokens[0])
    assert lps[1].top == [] and math.isclose(lps[1].logprob, float(ref[1, tokens[1]]), rel_tol=1e-6)


@pytest.mark.parametrize("kwargs, name", [
    (dict(temperature=-0.1), "temperature"), (dict(temperature=float("nan")), "temperature"),
    (dict(temperature=True), "temperature"), (dict(top_p=0.0), "top_p"), (dict(top_p=1.5), "top_p"),
    (dict(top_k=-2), "top_k"), (dict(top_k=2.5), "top_k"), (dict(min_p=1.5), "min_p"),
    (dict(repetition_penalty=0.0), "repetition_penalty"), (dict(presence_penalty=2.5), "presence_penalty"),
    (dict(frequency_penalty=-3), "frequency_penalty"), (dict(seed=-1), "seed"), (dict(seed="1"), "seed"),
    (dict(logprobs=21), "logprobs"),
])
def test_invalid_values_raise(kwargs, name):
    with pytest.raises(ValueError, match=rf"^{name} must be .*got"):
        SamplingParams(**kwargs)


def test_generation_config_defaults():
    assert SamplingParams.from_generation_config({}).temperature == 0
    p = SamplingParams.from_generation_config({"do_sample": True, "temperature": 0.6, "top_p": 0.95, "top_k": 20},
                                              top_p=None, temperature=0.3)
    assert (p.temperature, p.top_p, p.top_k) == (0.3, 0.95, 20)
    assert SamplingParams(top_k=-1).top_k == 0
