"""Routing ops against per-token references; Tutel-named ops."""
import pytest
import torch

from dynamoe import ops
from dynamoe.ops.routing import softmax_group_topk
from reference import ref_sigmoid_choice, ref_softmax_choice, ref_softmax_group_choice


@pytest.mark.parametrize("k", [1, 2, 8])
@pytest.mark.parametrize("renorm", [True, False])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
def test_softmax_topk_matches_reference(k, renorm, dtype):
    logits = torch.randn(37, 16).to(dtype)
    w, ids, probs = ops.softmax_topk(logits, k, renorm)
    w_ref, ids_ref, probs_ref = ops.softmax_topk_reference(logits, k, renorm)
    assert ids.dtype == torch.int64 and w.dtype == (torch.float64 if dtype == torch.float64 else torch.float32)
    assert torch.equal(ids, ids_ref)
    torch.testing.assert_close(w, w_ref)
    torch.testing.assert_close(probs, probs_ref)
    for t in range(5):
        order, wt, _ = ref_softmax_choice(logits[t], k, renorm)
        assert ids[t].tolist() == order
        torch.testing.assert_close(w[t].double(), torch.stack(wt), atol=1e-6, rtol=1e-5)


def test_softmax_topk_skips_probs_when_not_needed():
    w, ids, probs = ops.softmax_topk(torch.randn(4, 8), 2, renormalize=True, need_probs=False)
    assert probs is None
    torch.testing.assert_close(w.sum(-1), torch.ones(4))


@pytest.mark.parametrize("n_group,topk_group,k", [(1, 1, 4), (4, 2, 3), (8, 4, 8), (8, 8, 2)])
@pytest.mark.parametrize("with_bias", [True, False])
@pytest.mark.parametrize("renorm,scale", [(True, 2.5), (False, 1.0)])
def test_sigmoid_group_topk_matches_reference(n_group, topk_group, k, with_bias, renorm, scale):
    E = 32
    logits = torch.randn(23, E)
    bias = torch.randn(E) * 0.1 if with_bias else None
    w, ids, scores = ops.sigmoid_group_topk(logits, k, bias, n_group, topk_group, renorm, scale)
    for t in range(23):
        order, wt, _ = ref_sigmoid_choice(logits[t], k, bias, n_group, topk_group, renorm, scale)
        assert sorted(ids[t].tolist()) == sorted(order)
        got = dict(zip(ids[t].tolist(), w[t].tolist()))
        for e, v in zip(order, wt):
            assert got[e] == pytest.approx(float(v), rel=1e-5, abs=1e-6)
    torch.testing.assert_close(scores, torch.sigmoid(logits))


@pytest.mark.parametrize("n_group,topk_group,k", [(1, 1, 4), (4, 2, 3), (8, 3, 8), (8, 8, 2), (32, 5, 4)])
@pytest.mark.parametrize("group_rank", ["max", "top2_sum"])
@pytest.mark.parametrize("renorm,scale", [(True, 2.5), (False, 1.0)])
def test_softmax_group_topk_matches_reference(n_group, topk_group, k, group_rank, renorm, scale):
    E, T = 32, 40
    logits = torch.randn(T, E, generator=torch.Generator().manual_seed(n_group * 10 + k)) * 2
    w, ids, probs = softmax_group_topk(logits, k, n_group, topk_group, renorm, scale, group_rank=group_rank)
    for t in range(T):
        order, wt = ref_softmax_group_choice(logits[t], k, n_group, topk_group, renorm, scale, group_rank)
        assert sorted(ids[t].tolist()) == sorted(order)
        got = dict(zip(ids[t].tolist(), w[t].tolist()))
        for e, v in zip(order, wt):
            assert got[e] == pytest.approx(v, rel=1e-5, abs=1e-6)
    torch.testing.assert_close(probs, torch.softmax(logits, -1))


def test_group_rank_decides_the_groups():
    """Group 0 has the single best expert, group 1 the larger sum of its two best: 'max' keeps group 0,
    'top2_sum' (Mistral-4) group 1."""
    probs = torch.tensor([[0.40, 0.02, 0.01, 0.005, 0.25, 0.24, 0.04, 0.035]])
    logits = probs.log()
    _, by_max, _ = softmax_group_topk(logits, 2, n_group=2, topk_group=1, group_rank="max")
    _, by_sum, _ = softmax_group_topk(logits, 2, n_group=2, topk_group=1, group_rank="top2_sum")
    assert sorted(by_max[0].tolist()) == [0, 1]
    assert sorted(by_sum[0].tolist()) == [4, 5]
    with pytest.raises(ValueError, match="group_rank must be one of \\['max', 'top2_sum'\\], got 'sum'"):
        softmax_group_topk(logits, 2, n_group=2, topk_group=1, group_rank="sum")


def test_selection_bias_changes_choice_not_weight():
    logits = torch.zeros(1, 8)
    logits[0, 0] = 1.0
    bias = torch.zeros(8)
    bias[5] = 10.0
    w, ids, _ = ops.sigmoid_group_topk(logits, 1, bias, renormalize=False)
    assert ids.item() == 5
    assert w.item() == pytest.approx(0.5)  # sigmoid(0): the unbiased score


def test_tutel_named_ops():
    # Tutel's README: qwen3_moe_scaled_topk takes softmax probabilities, weights normalised to 1
    probs = torch.softmax(torch.randn(5, 128), -1)
    w, ids = ops.qwen3_moe_scaled_topk(probs)
    assert ids.shape == (5, 8)
    top = probs.topk(8)
    assert torch.equal(ids, top.indices)
    torch.testing.assert_close(w, top.values / top.values.sum(-1, keepdim=True))
    # optional output tensors and leading dims, as Tutel's op
    v_out, k_out = torch.empty(2, 3, 8), torch.empty(2, 3, 8, dtype=torch.long)
    w3, ids3 = ops.qwen3_moe_scaled_topk(torch.softmax(torch.randn(2, 3, 128), -1), v_out, k_out)
    assert w3.data_ptr() == v_out.data_ptr() and ids3.data_ptr() == k_out.data_ptr()
    # deepseek: Tutel's call is (logits, bias, None, None)
    logits = torch.randn(5, 256)
    bias = torch.randn(256) * 0.01
    w, ids = ops.deepseek_moe_sigmoid_scaled_topk(logits, bias, None, None)
    assert ids.shape == (5, 8)
    torch.testing.assert_close(w.sum(-1), torch.full((5,), 2.5))
    for t in range(5):
        order, wt, _ = ref_sigmoid_choice(logits[t], 8, bias, 8, 4, True, 2.5)
        assert sorted(ids[t].tolist()) == sorted(order)
        got = dict(zip(ids[t].tolist(), w[t].tolist()))
        assert all(got[e] == pytest.approx(float(v), rel=1e-5) for e, v in zip(order, wt))
    with pytest.raises(ValueError, match="top_v_out"):
        ops.deepseek_moe_sigmoid_scaled_topk(logits, bias, torch.empty(5, 7))


@pytest.mark.parametrize("bad", [
    dict(top_k=0), dict(top_k=9), dict(n_group=3), dict(topk_group=5, n_group=4), dict(top_k=8, n_group=8, topk_group=1),
])
def test_routing_rejects_bad_arguments(bad):
    args = dict(top_k=2, n_group=1, topk_group=1)
    args.update(bad)
    name = next(iter(bad))
    with pytest.raises(ValueError, match=name if name != "n_group" or "topk_group" not in bad else "topk_group"):
        ops.sigmoid_group_topk(torch.randn(3, 8), args["top_k"], None, args["n_group"], args["topk_group"])


def test_logits_shape_errors():
    with pytest.raises(ValueError, match="logits"):
        ops.softmax_topk(torch.randn(3, 4, 5), 2, True)
    with pytest.raises(ValueError, match="top_k"):
        ops.softmax_topk(torch.randn(3, 4), 5, True)
