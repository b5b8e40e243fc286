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


@pytest.mark.parametrize("trans_w", [False, True])
@pytest.mark.parametrize("bias", [False, True])
def test_row_scale_forward_and_gradients(trans_w, bias):
    counts = [3, 0, 4]
    E, I, O = 3, 8, 4
    x = torch.randn(7, I, dtype=torch.float64, requires_grad=True)
    w = (torch.randn(E, O, I) if trans_w else torch.randn(E, I, O)).double().requires_grad_()
    b = torch.randn(E, O, dtype=torch.float64, requires_grad=True) if bias else None
    s = torch.rand(7, dtype=torch.float64, requires_grad=True)
    args = (x, w, b, s) if bias else (x, w, s)

    def ours(*a):
        return grouped_mm(a[0], a[1], counts, a[2] if bias else None, trans_w=trans_w, row_scale=a[-1])

    def ref(*a):
        return grouped_mm_reference(a[0], a[1], counts, a[2] if bias else None, trans_w=trans_w, row_scale=a[-1])

    torch.testing.assert_close(ours(*args), ref(*args))
    assert torch.autograd.gradcheck(ours, args)


def test_out_buffer_is_inference_only():
    counts = [2, 3]
    x, w = torch.randn(5, 4), torch.randn(2, 4, 4)
    out = torch.empty(5, 4)
    with torch.no_grad():
        y = grouped_mm(x, w, counts, out=out)
    assert y.data_ptr() == out.data_ptr()
    torch.testing.assert_close(y, grouped_mm_reference(x, w, counts))
    with pytest.raises(ValueError, match="inference only"):
        grouped_mm(x, w.requires_grad_(), counts, out=out)
    with pytest.raises(ValueError, match="out must be"):
        grouped_mm(x, w.detach(), counts, out=torch.empty(5, 3))


def test_weights_follow_activation_dtype():
    counts = [2, 3]
    x = torch.randn(5, 8, dtype=torch.bfloat16)
    w = torch.randn(2, 8, 4, requires_grad=True)
    y = grouped_mm(x, w, counts)
    assert y.dtype == torch.bfloat16
    y.float().sum().backward()
    assert w.grad.dtype == torch.float32


@pytest.mark.parametrize("rows", [[1100, 0, 63], [64, 513, 1]])
def test_bucketed_chunks_in_half_precision(rows):
    """CPU bf16 splits each group into bucketed row chunks; results and grads must not change."""
    from dynamoe.ops.grouped_matmul import _row_chunks

    for c in rows:
        pieces = list(_row_chunks(5, c, True))
        assert sum(n for _, n in pieces) == c and (not pieces or pieces[0][0] == 5)
        assert all(o2 == o1 + n1 for (o1, n1), (o2, _) in zip(pieces, pieces[1:]))
    x = torch.randn(sum(rows), 16).bfloat16().requires_grad_()
    w = torch.randn(3, 8, 16).bfloat16().requires_grad_()
    s = torch.rand(sum(rows), requires_grad=True)
    y = grouped_mm(x, w, rows, trans_w=True, row_scale=s)
    g = torch.randn_like(y)
    (y.float() * g.float()).sum().backward()
    got = [x.grad.float(), w.grad.float(), s.grad.float()]
    x64, w64, s64 = (t.detach().double().requires_grad_() for t in (x, w, s))
    y64 = grouped_mm_reference(x64, w64, rows, trans_w=True, row_scale=s64)
    (y64 * g.double()).sum().backward()
    torch.testing.assert_close(y.double(), y64, atol=0.1, rtol=0.02)
    for a, b in zip(got, [x64.grad, w64.grad, s64.grad]):
        torch.testing.assert_close(a.double(), b, atol=0.5, rtol=0.05)


def test_torch_backend_refusal_falls_back_and_is_remembered(monkeypatch):
    import dynamoe.ops.grouped_matmul as gm

    calls = []

    def refuse(*a, **k):
        calls.append(1)
        raise RuntimeError("grouped gemm is not supported on this device")

    monkeypatch.setattr(torch, "_grouped_mm", refuse)
    monkeypatch.setattr(gm, "_TORCH_REFUSED", set())
    counts = [2, 2]
    x, w = torch.randn(4, 8), torch.randn(2, 8, 4)
    for _ in range(2):
        torch.testing.assert_close(grouped_mm(x, w, counts, backend="torch"), grouped_mm_reference(x, w, counts))
    assert len(calls) == 1 and ("cpu", torch.float32) in gm._TORCH_REFUSED


@pytest.mark.parametrize("trans_w", [False, True])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_groups_cycling_over_the_weights(trans_w, dtype):
    """k*E groups, group g using weight g % E (the layout received from an all-to-all): forward and
    every gradient (weights summed over their groups; expert 2 gets rows only in the 2nd cycle,
    expert 3 none at all) equal the reference's."""
    counts = [3, 2, 0, 0, 1, 4, 2, 0]  # E = 4, two cycles
    E, I, O = 4, 8, 4
    N = sum(counts)
    x = torch.randn(N, I, dtype=dtype, requires_grad=True)
    w = (torch.randn(E, O, I) if trans_w else torch.randn(E, I, O)).to(dtype).requires_grad_()
    b = torch.randn(E, O, dtype=dtype, requires_grad=True)
    s = torch.rand(N, dtype=dtype, requires_grad=True)
    g = torch.randn(N, O, dtype=dtype)
    grads = []
    for fn in (grouped_mm, grouped_mm_reference):
        y = fn(x, w, counts, b, trans_w=trans_w, row_scale=s)
        (y * g).sum().backward()
        grads.append([y.detach()] + [t.grad.clone() for t in (x, w, b, s)])
        for t in (x, w, b, s):
            t.grad = None
    tol = dict(atol=5e-2, rtol=5e-2) if dtype == torch.bfloat16 else {}
    for got, want in zip(*grads):
        torch.testing.assert_close(got, want, **tol)
    assert grads[0][2][3].abs().sum() == 0  # the expert without rows: zero gradient
    with torch.no_grad():
        torch.testing.assert_close(grouped_mm(x, w, counts, b, trans_w=trans_w), grouped_mm_reference(x, w, counts, b, trans_w=trans_w), **tol)
