"""The fused decode path of the MoE layer (dynamoe.ops.moe_decode): a decode step's routed GLU experts
in one kernel call give what a per-token, per-expert loop in fp32 gives, report the same routing
statistics, and run only where they are the same computation."""
import dataclasses

import pytest
import torch
import torch.nn.functional as F

from dynamoe.moe import ExpertConfig, GateConfig, MoEConfig, MoELayer
from dynamoe.ops import cpu_kernels, moe_decode
from dynamoe.ops.activations import glu_activation
from spying import record_calls

kernels = cpu_kernels.load()
needs_kernel = pytest.mark.skipif(kernels is None, reason="the CPU kernels could not be built here")


def _layer(E=8, k=2, D=64, Fh=48, act="silu", bias=False, shared=0, cf=0.0, seed=0, dtype=torch.bfloat16):
    torch.manual_seed(seed)
    cfg = MoEConfig(model_dim=D, gates=[GateConfig(type="top", k=k, capacity_factor=cf, fp32_gate=True)],
                    experts=ExpertConfig(type="glu", num_experts_per_device=E, hidden_size_per_expert=Fh,
                                         glu_activation=act, glu_bias=bias, gpt_oss_limit=0.5,
                                         num_shared_experts=shared),
                    aux_loss="none", dtype=dtype, check_finite=False)
    layer = MoELayer(cfg).eval()
    with torch.no_grad():  # larger values, so that clamps and signs matter
        for p in layer.experts.parameters():
            p.mul_(4)
    return layer


def _reference(layer, x_TD):
    """Per token, per chosen expert, in fp32 from the bf16 weights (routing taken from the gate)."""
    ex = layer.experts
    logits = F.linear(x_TD.float(), layer.gates[0].wg.weight.float())
    w, ids = torch.softmax(logits, -1).topk(layer.top_k, dim=-1)
    w = w / w.sum(-1, keepdim=True) if layer.top_k > 1 else w
    Fh = ex.gate_up_proj.size(1) // 2
    out = torch.zeros(x_TD.size(0), ex.down_proj.size(1))
    for t in range(x_TD.size(0)):
        for j in range(layer.top_k):
            e = int(ids[t, j])
            gu = ex.gate_up_proj[e].float() @ x_TD[t].float()
            if ex.gate_up_proj_bias is not None:
                gu = gu + ex.gate_up_proj_bias[e].float()
            h = glu_activation(gu[:Fh], gu[Fh:], ex.activation, ex.alpha, ex.limit)
            y = ex.down_proj[e].float() @ h
            if ex.down_proj_bias is not None:
                y = y + ex.down_proj_bias[e].float()
            out[t] += w[t, j] * y
    if layer.shared_experts is not None:
        out += layer.shared_experts(x_TD).float()
    return out, torch.bincount(ids.flatten(), minlength=layer.num_global_experts)


def _spy(monkeypatch):
    """Calls of the layer's own decode path (router + experts in one kernel call)."""
    return record_calls(monkeypatch, moe_decode, "moe_decode_with")


def _general(monkeypatch):
    """The general path from here on: routing in torch, the experts on the general path too."""
    monkeypatch.setattr(MoELayer, "_decode_step", lambda *a, **kw: None)
    for name in ("glu_decode", "packed_glu_decode", "ffn_decode"):
        monkeypatch.setattr(moe_decode, name, lambda *a, **kw: None)


@needs_kernel
@pytest.mark.parametrize("act", ["silu", "gelu", "gelu_tanh", "relu", "gpt_oss"])
@pytest.mark.parametrize("T,k", [(1, 1), (1, 4), (2, 2), (5, 3), (8, 2), (16, 5)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_matches_per_expert_loop(monkeypatch, act, T, k, dtype):
    used = _spy(monkeypatch)
    layer = _layer(E=6, k=k, act=act, bias=act == "gpt_oss", Fh=40, D=72, dtype=dtype)  # D: a 16-tail
    x = torch.randn(1, T, 72).to(dtype)
    with torch.inference_mode():
        y = layer(x)
    want, load = _reference(layer, x[0])
    assert used == [True]
    assert y.shape == (1, T, 72) and y.dtype == dtype
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y[0].float(), want, atol=tol * want.abs().max().item(), rtol=tol)
    st = y.routing_stats
    assert torch.equal(st.load, load) and torch.equal(st.kept, load) and st.dropped == 0
    assert st.capacity == int(load.max()) and st.top_k == k and st.num_tokens == T


@needs_kernel
def test_shared_experts_and_general_path_agree(monkeypatch):
    layer = _layer(E=8, k=2, shared=1, Fh=32)
    x = torch.randn(3, 64).bfloat16()
    used = _spy(monkeypatch)
    with torch.inference_mode():
        fused = layer(x)
    assert used == [True]
    _general(monkeypatch)
    with torch.inference_mode():
        general = layer(x)
    torch.testing.assert_close(fused.float(), general.float(), atol=3e-2 * general.abs().max().item(), rtol=3e-2)
    assert torch.equal(fused.routing_stats.load, general.routing_stats.load)
    assert fused.routing_stats.capacity == general.routing_stats.capacity


@needs_kernel
def test_not_used_where_it_is_not_the_same_computation(monkeypatch):
    fast = _spy(monkeypatch)
    used = record_calls(monkeypatch, moe_decode, "glu_decode")  # the experts kernel after torch's routing
    x = torch.randn(2, 64).bfloat16()
    layer = _layer()
    layer(x)  # autograd on: the experts' gradients need the general path
    with torch.inference_mode():
        layer(torch.randn(17, 64).bfloat16())  # more tokens than a decode batch
        layer(x.half())  # fp16 input: the layer casts it to the weights' dtype, and the kernel runs
        layer.half()(x.half())  # fp16 weights: no kernel
        _layer(cf=1.0)(x)  # a capacity that may drop: the plan decides
    layer.bfloat16().train()
    with torch.no_grad():
        layer(x)  # training mode
    assert fast == []  # none of these is the layer's own decode path
    assert used == [False, True, False]  # autograd and fp16 weights: the kernel declined


@needs_kernel
@pytest.mark.parametrize("shared", [0, 1])
@pytest.mark.parametrize("T,k", [(1, 1), (3, 2), (5, 3), (9, 2)])
def test_input_scaled_experts(monkeypatch, shared, T, k):
    """is_postscore=False (Llama-4: expert(w * x)): the layer kernel, which scales the experts' outputs, is refused;
    the experts' kernel runs on one prescaled row per (token, choice) while they fit a decode batch (T * k <= 16),
    and either way the result is the per-expert loop's prescaled sum."""
    fast = _spy(monkeypatch)
    used = record_calls(monkeypatch, moe_decode, "glu_decode")
    layer = _layer(E=6, k=k, shared=shared, dtype=torch.float32)
    layer.config = dataclasses.replace(layer.config, is_postscore=False)
    x = torch.randn(T, 64)
    with torch.inference_mode():
        y = layer(x)
    assert fast == [] and used == ([True] if T * k <= 16 else [])
    assert layer.decode_fused(x).weights is None and "is_postscore=False" in layer.decode_fused(x).extra
    ex = layer.experts
    w, ids = torch.softmax(F.linear(x, layer.gates[0].wg.weight), -1).topk(k, dim=-1)
    w = w / w.sum(-1, keepdim=True) if k > 1 else w
    Fh = ex.gate_up_proj.size(1) // 2
    want = torch.zeros(T, 64) if layer.shared_experts is None else layer.shared_experts(x).detach()
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            gu = ex.gate_up_proj[e] @ (w[t, j] * x[t])
            want[t] += ex.down_proj[e] @ glu_activation(gu[:Fh], gu[Fh:], ex.activation)
    torch.testing.assert_close(y, want, atol=1e-4 * want.abs().max().item(), rtol=1e-5)
    assert torch.equal(y.routing_stats.load, torch.bincount(ids.flatten(), minlength=6))


@needs_kernel
def test_kernel_checks_its_arguments():
    ex = _layer(E=4).experts
    x = torch.randn(2, 64).bfloat16()
    out, load = x.new_empty(2, 64), torch.empty(4, dtype=torch.long)
    ids = torch.tensor([[0, 4], [1, 2]])
    w = torch.ones(2, 2)
    with pytest.raises(RuntimeError, match="expert id 4 out of range"):
        kernels.moe_glu_decode_out(x, ids, w, ex.gate_up_proj.detach(), ex.down_proj.detach(), None, None, 0,
                                   1.0, 7.0, out, load)
    with pytest.raises(RuntimeError, match="x must have 1..16 rows"):
        kernels.moe_glu_decode_out(torch.randn(17, 64).bfloat16(), ids, w, ex.gate_up_proj.detach(),
                                   ex.down_proj.detach(), None, None, 0, 1.0, 7.0, torch.empty(17, 64).bfloat16(), load)
    with pytest.raises(RuntimeError, match="must be bf16 or fp32"):
        kernels.moe_glu_decode_out(x.half(), ids, w, ex.gate_up_proj.detach().half(), ex.down_proj.detach().half(),
                                   None, None, 0, 1.0, 7.0, out.half(), load)


# ------------------------------------------------------------------------------------ packed experts
@needs_kernel
@pytest.mark.parametrize("fmt", ["fp8_block", "mxfp4", "nvfp4", "int4"])
@pytest.mark.parametrize("act,T,k", [("silu", 1, 2), ("gpt_oss", 3, 3), ("silu", 16, 4)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_packed_experts_match_the_general_path(monkeypatch, fmt, act, T, k, dtype):
    """Blockwise FP8, MXFP4, NVFP4 and INT4 GLU experts (dynamoe.quant.quantize_experts_) through the packed
    decode kernel give what the layer's general path (dequantize or packed GEMVs per expert) gives."""
    from dynamoe.quant import quantize_experts_

    kw = {"block": (32, 32)} if fmt == "fp8_block" else {"group_size": 16} if fmt == "int4" else {}
    layer = _layer(E=6, k=k, D=64, Fh=64, act=act, bias=act == "gpt_oss", dtype=dtype)
    quantize_experts_(layer, fmt, **kw)
    assert type(layer.experts).__name__ == "QuantizedExperts"
    x = torch.randn(T, 64).to(dtype)
    used = _spy(monkeypatch)
    with torch.inference_mode():
        fused = layer(x)
        _general(monkeypatch)
        general = layer(x)
    assert used == [True] and fused.dtype == dtype and fused.shape == (T, 64)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-4
    torch.testing.assert_close(fused.float(), general.float(), atol=tol * general.abs().max().item(), rtol=tol)
    assert torch.equal(fused.routing_stats.load, general.routing_stats.load)


# ------------------------------------------------------------------------------------ FFN experts
@needs_kernel
@pytest.mark.parametrize("act", ["relu", "gelu", "silu"])
@pytest.mark.parametrize("T,k,bias", [(1, 2, True), (4, 1, False), (16, 3, True)])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_ffn_experts_match_per_expert_loop(monkeypatch, act, T, k, bias, dtype):
    """Tutel-layout FFN experts (fc1 [E, F, D], fc2 [E, F, O], biases; output_dim != model_dim) through
    the decode kernel against a per-token, per-expert loop in fp32."""
    used = _spy(monkeypatch)
    torch.manual_seed(1)
    cfg = MoEConfig(model_dim=64, gates=[GateConfig(type="top", k=k, capacity_factor=0.0, fp32_gate=True)],
                    experts=ExpertConfig(type="ffn", num_experts_per_device=6, hidden_size_per_expert=300,
                                         activation_fn=act, has_fc1_bias=bias, has_fc2_bias=bias, output_dim=80),
                    aux_loss="none", dtype=dtype, check_finite=False)
    layer = MoELayer(cfg).eval()
    x = torch.randn(T, 64).to(dtype)
    with torch.inference_mode():
        y = layer(x)
    ex = layer.experts
    logits = F.linear(x.float(), layer.gates[0].wg.weight.float())
    w, ids = torch.softmax(logits, -1).topk(k, dim=-1)
    w = w / w.sum(-1, keepdim=True) if k > 1 else w
    fn = {"relu": F.relu, "gelu": F.gelu, "silu": F.silu}[act]
    want = torch.zeros(T, 80)
    for t in range(T):
        for j in range(k):
            e = int(ids[t, j])
            h = ex.batched_fc1_w[e].float() @ x[t].float()
            h = fn(h + ex.batched_fc1_bias[e].float() if bias else h)
            o = h @ ex.batched_fc2_w[e].float()
            want[t] += w[t, j] * (o + ex.batched_fc2_bias[e].float() if bias else o)
    assert used == [True] and y.shape == (T, 80) and y.dtype == dtype
    tol = 3e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(y.float(), want, atol=tol * want.abs().max().item(), rtol=tol)
    assert torch.equal(y.routing_stats.load, torch.bincount(ids.flatten(), minlength=6))
