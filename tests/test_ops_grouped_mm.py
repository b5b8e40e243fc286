"""grouped_mm backends against the plain loop reference, forward and backward."""
import pytest
import torch

from dynamoe.ops import grouped_mm, grouped_mm_reference


@pytest.mark.parametrize("backend", ["loop", "torch"])
@pytest.mark.parametrize("trans_w", [False, True])
@pytest.mark.parametrize("bias", [False, True])
@pytest.mark.parametrize("counts", [[3, 0, 5, 1], [0, 0, 0, 9], [2, 2, 2, 2]])
def test_grouped_mm_matches_reference(backend, trans_w, bias, counts):
    E, I, O = len(counts), 8, 4  # 16-byte rows, so the torch backend really runs
    x = torch.randn(sum(counts), I, requires_grad=True)
    w = torch.randn(E, O, I) if trans_w else torch.randn(E, I, O)
    w.requires_grad_()
    b = torch.randn(E, O, requires_grad=True) if bias else None
    y = grouped_mm(x, w, counts, b, trans_w=trans_w, backend=backend)
    g = torch.randn_like(y)
    (y * g).sum().backward()
    got = [x.grad, w.grad] + ([b.grad] if bias else [])
    for t in [x, w] + ([b] if bias else []):
        t.grad = None
    y_ref = grouped_mm_reference(x, w, counts, b, trans_w=trans_w)
    (y_ref * g).sum().backward()
    want = [x.grad, w.grad] + ([b.grad] if bias else [])
    torch.testing.assert_close(y, y_ref)
    for a, c in zip(got, want):
        torch.testing.assert_close(a, c)
    assert w.grad.is_contiguous()


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_grouped_mm_low_precision(dtype):
    counts = [4, 0, 7]
    x = torch.randn(11, 8, dtype=dtype)
    w = torch.randn(3, 8, 4, dtype=dtype)
    torch.testing.assert_close(grouped_mm(x, w, counts), grouped_mm_reference(x, w, counts), atol=2e-2, rtol=2e-2)


def test_grouped_mm_errors():
    x, w = torch.randn(5, 3), torch.randn(2, 3, 4)
    with pytest.raises(ValueError, match="counts"):
        grouped_mm(x, w, [1, 1])
    with pytest.raises(ValueError, match="features"):
        grouped_mm(torch.randn(5, 2), w, [2, 3])
    with pytest.raises(ValueError, match="backend"):
        grouped_mm(x, w, [2, 3], backend="cutlass")


def test_torch_backend_falls_back_on_unaligned_shapes():
    counts = [2, 1]
    x, w = torch.randn(3, 5), torch.randn(2, 5, 3)
    torch.testing.assert_close(grouped_mm(x, w, counts, backend="torch"), grouped_mm_reference(x, w, counts))
