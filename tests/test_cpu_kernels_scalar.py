"""The CPU kernels' scalar (non-AVX-512) code paths: the GEMV and fused-MoE-decode sources compiled with
-march=x86-64-v3 (AVX2, no AVX-512) into a temporary folder give the torch reference's results. The
cached -march=native build (AVX-512 on the CI machine) never compiles these branches."""
import platform

import pytest
import torch
import torch.nn.functional as F

from dynamoe.ops import cpu_kernels, moe_decode
from dynamoe.ops import gemv as gemv_mod
from test_moe_decode import _layer

pytestmark = pytest.mark.skipif(platform.machine().lower() not in ("x86_64", "amd64") or cpu_kernels.load() is None,
                                reason="x86-64 only, and needs a compiler that builds the CPU kernels")

# only the ops under test are bound: building all of csrc/ takes minutes, these three sources about one
BINDINGS = r"""
#include "decode_ops.h"
#include "decode_enums_bind.h"
bool has_avx512() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_decode_enums(m);  // the names the Python side reads (Activation, MAX_ROWS, ...)
  m.def("bf16_gemv_out", &bf16_gemv_out);
  m.def("bf16_grouped_gemv_out", &bf16_grouped_gemv_out);
  m.def("moe_glu_decode_out", &moe_glu_decode_out);
  m.def("has_avx512", &has_avx512);
  m.def("has_avx512_bf16", [] { return false; });
}
"""


@pytest.fixture(scope="module")
def scalar_kernels(tmp_path_factory):
    folder = tmp_path_factory.mktemp("dynamoe_kernels_x86_64_v3")
    (folder / "bindings.cpp").write_text(BINDINGS)
    k = cpu_kernels.build(str(folder / "build"), march="x86-64-v3",
                          sources=("bf16_gemv.cpp", "f32_gemv.cpp", "moe_decode.cpp"),
                          extra_sources=[str(folder / "bindings.cpp")])
    assert not k.has_avx512()
    return k


@pytest.mark.parametrize("T,I,O,bias", [(1, 64, 37, False), (3, 100, 19, True), (16, 72, 40, False)])
def test_bf16_gemv(scalar_kernels, monkeypatch, T, I, O, bias):
    monkeypatch.setattr(gemv_mod.cpu_kernels, "load", lambda: scalar_kernels)
    x = torch.randn(T, I).bfloat16()
    w = torch.randn(O, I).bfloat16()
    b = torch.randn(O).bfloat16() if bias else None
    out = torch.empty(T, O, dtype=torch.bfloat16)
    scalar_kernels.bf16_gemv_out(x, w, b, out)
    want = F.linear(x.float(), w.float(), None if b is None else b.float())
    torch.testing.assert_close(out.float(), want, atol=3e-2, rtol=2e-2)


@pytest.mark.parametrize("act", ["silu", "gpt_oss"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,k", [(1, 2), (5, 3)])
def test_moe_glu_decode(scalar_kernels, monkeypatch, act, dtype, T, k):
    from test_moe_decode import _reference

    monkeypatch.setattr(moe_decode.cpu_kernels, "load", lambda: scalar_kernels)
    layer = _layer(E=6, k=k, act=act, bias=act == "gpt_oss", Fh=40, D=72, dtype=dtype)  # D: a 16-tail
    x_TD = torch.randn(T, 72).to(dtype)
    want, load = _reference(layer, x_TD)
    logits = F.linear(x_TD.float(), layer.gates[0].wg.weight.float())
    w, ids = torch.softmax(logits, -1).topk(k, dim=-1)
    w = w / w.sum(-1, keepdim=True)
    with torch.inference_mode():
        got = moe_decode.glu_decode(x_TD, ids, w, layer.experts)
    assert got is not None
    y, got_load, max_load = got
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y.float(), want, atol=tol * want.abs().max().item(), rtol=tol)
    assert torch.equal(got_load, load) and max_load == int(load.max())
