"""dynamoe.ops.linear: F.linear's results, through the bf16 GEMV kernel for decode-sized inputs."""
import pytest
import torch
import torch.nn.functional as F

from dynamoe.ops import cpu_kernels, grouped_mm, grouped_mm_reference, linear
from dynamoe.ops import gemv as linear_mod

kernels = cpu_kernels.load()
needs_kernel = pytest.mark.skipif(kernels is None, reason="the CPU kernels could not be built here")


def _close(a, b):
    torch.testing.assert_close(a.float(), b.float(), atol=3e-2, rtol=2e-2)


@needs_kernel
@pytest.mark.parametrize("shape", [(1, 64), (2, 100), (1, 1, 96), (2, 3, 64)])
@pytest.mark.parametrize("bias", [False, True])
def test_matches_f_linear(shape, bias):
    g = torch.Generator().manual_seed(0)
    x = torch.randn(*shape, generator=g).bfloat16()
    w = torch.randn(37, shape[-1], generator=g).bfloat16()
    b = torch.randn(37, generator=g).bfloat16() if bias else None
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    got = linear(x, w, b)
    assert got.shape == want.shape and got.dtype == torch.bfloat16
    _close(got, want)


@needs_kernel
def test_kernel_used_only_where_it_applies(monkeypatch):
    calls = []
    real = kernels.bf16_gemv_out

    class Spy:
        def __getattr__(self, name):
            return getattr(kernels, name)

        def bf16_gemv_out(self, *a):
            calls.append(a[0].shape)
            return real(*a)

    monkeypatch.setattr(linear_mod.cpu_kernels, "load", lambda: Spy())
    w = torch.randn(8, 64).bfloat16()
    linear(torch.randn(1, 64).bfloat16(), w)
    assert len(calls) == 1
    linear(torch.randn(9, 64).bfloat16(), w)                          # many rows: oneDNN
    linear(torch.randn(1, 64), w.float())                             # fp32
    linear(torch.randn(1, 64).bfloat16(), w.t().contiguous().t())     # non-contiguous weight
    x = torch.randn(1, 64).bfloat16().requires_grad_()
    y = linear(x, w)                                                  # autograd
    y.sum().backward()
    assert len(calls) == 1 and x.grad is not None


@needs_kernel
@pytest.mark.parametrize("bias", [False, True])
def test_grouped_mm_decode_rows_through_the_kernel(bias):
    counts = [1, 0, 2, 1, 5]  # 5 rows: the bucketed oneDNN path; 1-2 rows: the kernel
    E, I, O = 5, 64, 48
    x = torch.randn(sum(counts), I).bfloat16()
    w = torch.randn(E, O, I).bfloat16()
    b = torch.randn(E, O).bfloat16() if bias else None
    with torch.no_grad():
        _close(grouped_mm(x, w, counts, b, trans_w=True), grouped_mm_reference(x.float(), w.float(), counts,
                                                                                None if b is None else b.float(), trans_w=True))


def test_without_kernels_it_is_f_linear(monkeypatch):
    monkeypatch.setattr(linear_mod.cpu_kernels, "load", lambda: None)
    x, w = torch.randn(1, 32).bfloat16(), torch.randn(5, 32).bfloat16()
    assert torch.equal(linear(x, w), F.linear(x, w))


@needs_kernel
def test_grouped_kernel_checks_its_groups():
    x, w, out = torch.randn(3, 32).bfloat16(), torch.randn(2, 8, 32).bfloat16(), torch.empty(3, 8).bfloat16()
    for bad in ([[2, 0, 1]], [[0, 2, 2]], [[0, 0, 0]]):  # expert out of range, rows past the end, no rows
        with pytest.raises(RuntimeError, match="out of range"):
            kernels.bf16_grouped_gemv_out(x, w, torch.tensor(bad), None, out)
    kernels.bf16_grouped_gemv_out(x, w, torch.tensor([[1, 0, 2], [0, 2, 1]]), None, out)
    _close(out[:2], x[:2].float() @ w[1].float().t())
    _close(out[2:], x[2:].float() @ w[0].float().t())
