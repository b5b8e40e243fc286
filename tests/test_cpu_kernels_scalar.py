"""The CPU kernels' paths for CPUs without AVX-512: the GEMV, fused-MoE-decode (dense and packed) and
attention-row sources compiled with -march=x86-64-v3 (AVX2 + FMA + F16C: the DYNAMOE_AVX2 paths of
csrc/simd_avx2.h) and with -march=x86-64-v2 (the plain scalar loops) into temporary folders give the torch
reference's results. The cached -march=native build compiles only one of the three (AVX-512 on the CI
machine)."""
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
#include "decode_rows.h"
bool has_avx512() {
#if defined(__AVX512F__)
  return true;
#else
  return false;
#endif
}
bool has_avx2_paths() {
#if defined(DYNAMOE_AVX2)
  return true;
#else
  return false;
#endif
}
PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  bind_decode_enums(m);  // the names the Python side reads (Activation, PackedActs, MAX_ROWS, ...)
  m.def("bf16_gemv_out", &bf16_gemv_out);
  m.def("bf16_grouped_gemv_out", &bf16_grouped_gemv_out);
  m.def("moe_glu_decode_out", &moe_glu_decode_out);
  m.def("packed_moe_glu_decode_out", &packed_moe_glu_decode_out);
  m.def("has_avx512", &has_avx512);
  m.def("has_avx2_paths", &has_avx2_paths);
  m.def("has_avx512_bf16", [] { return false; });
  // the attention rows' helpers: softmax numerators (in place) and their sum; a dot product of two fp32 rows
  m.def("exp_shifted", [](torch::Tensor p, double mx) {
    return dynamoe::exp_shifted(p.data_ptr<float>(), p.numel(), static_cast<float>(mx));
  });
  m.def("dot_rows", [](torch::Tensor a, torch::Tensor b) {
    return dynamoe::dot_rows(a.data_ptr<float>(), b.data_ptr<float>(), a.numel());
  });
}
"""


@pytest.fixture(scope="module", params=["x86-64-v3", "x86-64-v2"], ids=["avx2", "scalar"])
def scalar_kernels(request, tmp_path_factory):
    march = request.param
    folder = tmp_path_factory.mktemp("dynamoe_kernels_" + march.replace("-", "_"))
    (folder / "bindings.cpp").write_text(BINDINGS)
    k = cpu_kernels.build(str(folder / "build"), march=march,
                          sources=("bf16_gemv.cpp", "f32_gemv.cpp", "moe_decode.cpp", "moe_decode_packed.cpp"),
                          extra_sources=[str(folder / "bindings.cpp")], name="dynamoe_kernels_test_" + march.replace("-", "_"))
    assert not k.has_avx512()
    assert k.has_avx2_paths() == (march == "x86-64-v3")
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


@pytest.mark.parametrize("fmt,options,acts", [
    ("mxfp4", {}, None), ("nvfp4", {}, None), ("int4", {}, None), ("int4", {"group_size": 16}, None),
    ("fp8_block", {}, None), ("fp8_block", {"block": (16, 40)}, None),
    ("mxfp4", {}, "int8"), ("nvfp4", {}, "int8"), ("int4", {}, "int8"),   # packed_int8.h's rows
])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("T,k", [(1, 2), (5, 3)])
def test_packed_moe_glu_decode(scalar_kernels, monkeypatch, fmt, options, acts, dtype, T, k):
    """The packed row kernels (packed_rows.h: fp4_row over MXFP4/NVFP4/INT4 nibbles, fp8_row; with int8
    activations packed_int8.h's rows) against the dequantized experts in float64; D = 224: whole 16- and
    32-element steps, a partial last 128-element step, FP8 scale blocks with a partial last one."""
    from dynamoe import quant

    monkeypatch.setattr(moe_decode.cpu_kernels, "load", lambda: scalar_kernels)
    E, D, Fh = 6, 224, 64
    g = torch.Generator().manual_seed(1)
    experts = quant.QuantizedExperts(quant.quantize(torch.randn(E, 2 * Fh, D, generator=g) / 8, fmt, **options),
                                     quant.quantize(torch.randn(E, D, Fh, generator=g) / 6, fmt, **options), "glu",
                                     act_quant=acts)
    x_TD = torch.randn(T, D, generator=g).to(dtype)
    w, ids = torch.rand(T, E, generator=g).softmax(-1).topk(k, dim=-1)
    with torch.inference_mode():
        got = moe_decode.packed_glu_decode(x_TD, ids, w, experts)
    assert got is not None
    w1, w2 = experts.w1.dequantize(torch.float64), experts.w2.dequantize(torch.float64)
    want = torch.zeros(T, D, dtype=torch.float64)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            gate, up = (w1[e] @ x_TD[t].double()).split(Fh)
            h = F.silu(gate) * up
            want[t] += float(w[t, j]) * (w2[e] @ (h.to(dtype).double() if dtype == torch.bfloat16 else h))
    tol = 3e-2 if acts else 2e-2 if dtype == torch.bfloat16 else 1e-4  # (int8: 1/254 of each block's largest)
    torch.testing.assert_close(got[0].double(), want, atol=tol * want.abs().max().item(), rtol=tol)


def test_attention_row_helpers(scalar_kernels):
    """exp_shifted (the softmax numerators: exp8 on AVX2, within a few ulp of expf, 0 far below the maximum)
    and dot_rows, across a body of whole vectors and a tail."""
    g = torch.Generator().manual_seed(2)
    p = torch.cat([torch.randn(37, generator=g) * 30, torch.tensor([-200.0, 0.0, 88.0, -103.5])])
    want = torch.exp((p - 5.0).double())  # (the kernel subtracts in fp32, as here)
    got = p.clone()
    total = scalar_kernels.exp_shifted(got, 5.0)
    torch.testing.assert_close(got.double(), want, rtol=4e-7, atol=1e-37)
    assert abs(total - want.sum().item()) <= 1e-6 * want.sum().item()
    a, b = torch.randn(45, generator=g), torch.randn(45, generator=g)
    assert abs(scalar_kernels.dot_rows(a, b) - float(a.double() @ b.double())) < 1e-5
