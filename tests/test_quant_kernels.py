"""The fused packed-weight GEMV kernels against dequantize-then-matmul."""

import pytest
import torch

from dynamoe import quant
from dynamoe.ops import cpu_kernels
from dynamoe.quant.matmul import packed_gemv

kernels = cpu_kernels.load()
needs_kernels = pytest.mark.skipif(kernels is None, reason="the packed-weight CPU kernels could not be built here (see log)")


def reference(x, w):
    return x.double() @ w.dequantize(torch.float64).t()


@needs_kernels
@pytest.mark.parametrize("fmt,shape,options", [
    ("mxfp4", (40, 256), {}), ("mxfp4", (17, 96), {}),                 # 96 = 3 groups: a SIMD step + a tail
    ("nvfp4", (40, 256), {}), ("nvfp4", (9, 48), {}),                  # 48: tail of 8 bytes after one step
    ("fp8_block", (300, 272), {}), ("fp8_block", (5, 200), {"block": (4, 40)}),  # partial blocks; b1 % 16 != 0
    ("fp8_block", (33, 256), {"scale_fmt": "ue8m0"}),
    ("int4", (40, 256), {}), ("int4", (17, 96), {}), ("int4", (11, 80), {}),          # 80: a partial last group
    ("int4", (9, 48), {"group_size": 16}), ("int4", (7, 256), {"group_size": 128, "scale_dtype": torch.float32}),
    ("int4", (6, 96), {"group_size": 48, "scale_dtype": torch.float16}),               # 48: kernel groups of 16
    ("int4", (5, 1056), {}), ("int4", (3, 544), {"group_size": 16, "scale_dtype": torch.float16}),  # 16 scales at once
    ("int4", (4, 96), {"scale_dtype": torch.float32}),
])
@pytest.mark.parametrize("T", [1, 3, 8, 9, 16])
def test_packed_gemv_matches_dequantize_then_matmul(fmt, shape, options, T):
    w = quant.quantize(torch.randn(*shape) * 3, fmt, **options)
    x = torch.randn(T, shape[1])
    y = packed_gemv(x, w)
    assert y is not None and y.shape == (T, shape[0]) and y.dtype == torch.float32
    torch.testing.assert_close(y.double(), reference(x, w), atol=1e-4, rtol=1e-4)


@needs_kernels
def test_nan_blocks_propagate_and_limits():
    w = torch.randn(4, 256)
    w[1, 3] = float("nan")
    x = torch.randn(2, 256)
    for fmt, options in (("fp8_block", {"block": (1, 128)}), ("mxfp4", {}), ("nvfp4", {}), ("int4", {})):
        q = quant.quantize(w, fmt, **options)
        y = packed_gemv(x, q)
        assert torch.isnan(y[:, 1]).all() and not torch.isnan(y[:, [0, 2, 3]]).any(), fmt
        assert torch.equal(torch.isnan(y), torch.isnan(reference(x, q)))
    q = quant.quantize(w.nan_to_num(), "mxfp4")
    assert packed_gemv(torch.randn(17, 256), q) is None  # more rows than the kernel takes: caller falls back
    assert packed_gemv(torch.randn(0, 256), q) is None
    with pytest.raises(RuntimeError, match="features"):
        kernels.mxfp4_gemv(torch.randn(1, 128), q.blocks, q.scales)


@needs_kernels
@pytest.mark.parametrize("fmt", ["fp8_block", "mxfp4", "nvfp4", "int4"])
def test_decode_through_linear_and_experts_uses_kernels_with_same_results(fmt, monkeypatch):
    torch.manual_seed(0)
    lin = torch.nn.Linear(128, 64)
    ql = quant.QuantizedLinear.from_linear(lin, fmt)
    x = torch.randn(3, 128)
    with torch.no_grad():
        fast = ql(x)
        monkeypatch.setattr(cpu_kernels, "load", lambda: None)
        slow = ql(x)
    torch.testing.assert_close(fast, slow, atol=1e-5, rtol=1e-5)


def test_kernels_can_be_disabled(monkeypatch):
    monkeypatch.setenv("DYNAMOE_NO_CPU_KERNELS", "1")
    monkeypatch.setattr(cpu_kernels, "_state", {})
    assert cpu_kernels.load() is None
    w = quant.quantize(torch.randn(8, 64), "nvfp4")
    x = torch.randn(2, 64)
    with torch.no_grad():
        torch.testing.assert_close(quant.quantized_linear(x, w), x @ w.dequantize(torch.float32).t())


def test_stale_kernel_builds_are_pruned(tmp_path):
    """After a new build, other versions' folders not written or loaded for the age limit go; the
    current one, recent ones (another checkout may load them) and unrelated folders stay."""
    import os
    import time

    old = time.time() - 30 * 86400
    for name in ("dynamoe_cpu_kernels_old", "dynamoe_cpu_kernels_recent", "dynamoe_cpu_kernels_now", "other_ext"):
        (tmp_path / name).mkdir()
        lib = tmp_path / name / f"{name}.so"
        lib.write_bytes(b"x")
        if name != "dynamoe_cpu_kernels_recent":
            os.utime(lib, (old, old))
            os.utime(tmp_path / name, (old, old))
    removed = cpu_kernels.prune_stale_builds("dynamoe_cpu_kernels_now", str(tmp_path))
    assert removed == [str(tmp_path / "dynamoe_cpu_kernels_old")]
    assert sorted(p.name for p in tmp_path.iterdir()) == ["dynamoe_cpu_kernels_now", "dynamoe_cpu_kernels_recent", "other_ext"]
    assert cpu_kernels.prune_stale_builds("x", str(tmp_path / "missing")) == []


def test_an_existing_build_is_imported_without_rebuilding(monkeypatch):
    """A build of these sources (its name carries their digest) is imported as it is: torch's loader,
    which runs ninja and rebuilds when the sources sit at another path, is not called."""
    from torch.utils import cpp_extension

    if cpu_kernels.load() is None:
        pytest.skip("the CPU kernels could not be built here")

    def no_build(*args, **kwargs):
        raise AssertionError("rebuilt")

    monkeypatch.setattr(cpu_kernels, "_state", {})
    monkeypatch.setattr(cpp_extension, "load", no_build)
    k = cpu_kernels.load()
    assert k is not None and k.has_avx512_bf16() in (True, False)
