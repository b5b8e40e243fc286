"""A decode step's MoE sub-block in one kernel call (MoELayer.decode_fused with a norm, then
moe_decode.moe_decode_with: RMSNorm + router + GLU experts + residual) against the same pieces called one
after another -- bit for bit, statistics included --, the refusals with their reasons, and the decoder
layer taking it only where it is that computation."""
import dataclasses

import pytest
import torch

from dynamoe.models.moe_block import BiasedRouter
from dynamoe.models.norms import RMSNorm
from dynamoe.moe import ExpertConfig, GateConfig, MoEConfig, MoELayer
from dynamoe.models.moe_block import SparseMoeBlock
from dynamoe.ops import cpu_kernels, moe_decode
from dynamoe.ops.fused import RMSNormSpec
from spying import record_calls

kernels = cpu_kernels.load()
pytestmark = pytest.mark.skipif(kernels is None, reason="the CPU kernels could not be built here")

D = 72  # a 16-lane tail in every dot product


def _layer(gate: GateConfig, E=8, Fh=40, dtype=torch.bfloat16, glu="silu", bias=False, shared=0, **cfg):
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(model_dim=D, gates=[gate], dtype=dtype, **{"aux_loss": "none", "check_finite": False, **cfg},
                               experts=ExpertConfig(type="glu", num_experts_per_device=E, hidden_size_per_expert=Fh,
                                                    glu_activation=glu, glu_bias=bias, num_shared_experts=shared)))
    layer.eval()
    with torch.no_grad():
        for name, p in layer.named_parameters():
            if "bias" in name and "correction" not in name:
                p.normal_(0, 0.5)
        sel = getattr(layer.gates[0], "e_score_correction_bias", None)
        if sel is not None:
            sel.copy_(torch.randn(E) * 0.3)
    return layer


def _norm(dtype, weight_in_fp32=False):
    n = RMSNorm(D, eps=1e-5, weight_in_fp32=weight_in_fp32, dtype=dtype)
    with torch.no_grad():
        n.weight.normal_(1.0, 0.3)
    return n


def _fused(layer, h, norm_w, eps=1e-5, fp32=False):
    """The layer's fused block for h with that norm: its Fused (weights None and the reason where refused)."""
    return layer.decode_fused(h, norm=RMSNormSpec(norm_w, eps, fp32))


def _block(layer, h, norm_w, eps=1e-5, fp32=False):
    """(h + layer(norm(h)), stats) through the fused kernel, or the reason it refuses (a str)."""
    if not layer._decode_ready(h):
        return "not a decode step"
    f = _fused(layer, h, norm_w, eps, fp32)
    if f.weights is None:
        return f.extra
    out, load, max_load = moe_decode.moe_decode_with(f.extra, f.weights, h)
    return out, layer.decode_done(load, max_load)


def _one_by_one(layer, norm, h):
    with torch.inference_mode():
        y = layer(norm(h))
        return h + y, y.routing_stats


GATES = {
    "softmax-renorm": lambda: GateConfig(type="top", k=2, capacity_factor=0.0, fp32_gate=True),
    "softmax-plain-k1": lambda: GateConfig(type="top", k=1, capacity_factor=0.0, fp32_gate=True, normalize=False),
    "sigmoid-groups": lambda: GateConfig(type="sigmoid", k=3, capacity_factor=0.0, fp32_gate=True, n_group=4,
                                         topk_group=2, route_scale=2.5),
    "gpt-oss": lambda: GateConfig(type="custom", k=2, capacity_factor=0.0, module=BiasedRouter(D, 8)),
}


@pytest.mark.parametrize("name", list(GATES))
@pytest.mark.parametrize("T", [1, 3, 16])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_block_equals_norm_layer_residual(monkeypatch, name, T, dtype):
    gate = GATES[name]()
    gpt_oss = name == "gpt-oss"
    if gpt_oss:
        torch.manual_seed(1)
        torch.nn.init.normal_(gate.module.weight)
        torch.nn.init.normal_(gate.module.bias)
        gate.module.to(dtype)
    layer = _layer(gate, dtype=dtype, glu="gpt_oss" if gpt_oss else "silu", bias=gpt_oss)
    norm = _norm(dtype, weight_in_fp32=gpt_oss)
    h = (torch.randn(T, D) * 3).to(dtype)
    with torch.inference_mode():
        out, stats = _block(layer, h, norm.weight, norm.eps, norm.weight_in_fp32)
    want, want_stats = _one_by_one(layer, norm, h)
    assert out.dtype == dtype and out.shape == (T, D)
    assert torch.equal(out, want)  # the same kernels and roundings, in the same order
    assert torch.equal(stats.load, want_stats.load) and stats.capacity == want_stats.capacity
    assert (stats.top_k, stats.dropped, stats.layout) == (want_stats.top_k, 0, want_stats.layout)
    assert float(layer.l_aux) == 0.0


def test_block_declines_what_it_does_not_compute():
    gate = GATES["softmax-renorm"]
    h = torch.randn(2, D).bfloat16()
    norm = _norm(torch.bfloat16)
    w = norm.weight
    with torch.inference_mode():
        assert "not stacked" in _block(_layer(gate(), shared=1), h, w)  # shared experts that may train
        assert "check_finite" in _block(_layer(gate(), check_finite=True), h, w)  # the general path names NaNs
        assert "auxiliary losses" in _block(_layer(gate(), aux_loss="switch"), h, w)
        assert "capacity_factor=1" in _block(_layer(GateConfig(type="top", k=2, capacity_factor=1.0, fp32_gate=True)), h, w)
        assert "router" in _block(_layer(GateConfig(type="top", k=2, capacity_factor=0.0)), h, w)  # bf16 logits
        layer = _layer(gate())
        layer.result_func = lambda y: y * 2
        assert "result_func" in _block(layer, h, w)
        layer = _layer(gate())
        assert _block(layer, torch.randn(17, D).bfloat16(), w) == "not a decode step"
        assert "differs from the experts" in _block(layer, h.float(), w)  # input in another dtype than the experts
        assert "norm weight" in _block(layer, h, w.float())  # norm weight in another dtype
        ffn = MoELayer(MoEConfig(model_dim=D, gates=[gate()], dtype=torch.bfloat16, aux_loss="none", check_finite=False,
                                 experts=ExpertConfig(type="ffn", num_experts_per_device=8, hidden_size_per_expert=16))).eval()
        out, stats = _block(ffn, h, w)  # Tutel's FFN experts: the same block kernel with the FFN experts kernel
        want, want_stats = _one_by_one(ffn, norm, h)
        assert torch.equal(out, want) and torch.equal(stats.load, want_stats.load)
        assert isinstance(_block(layer, h, w), tuple)
    with torch.no_grad():
        layer.train()
        assert _block(layer, h, w) == "not a decode step"
    layer.eval()
    assert _block(layer, h, w) == "not a decode step"  # autograd on


def test_fused_block_is_cached_while_current():
    """The block's Fused is built once and reused; a new routing config, a parameter replaced or
    given new data, and an in-place update of a tensor the struct holds a copy of each make it stale."""
    layer = _layer(GATES["gpt-oss"](), glu="gpt_oss", bias=True)
    block = SparseMoeBlock.__new__(SparseMoeBlock)
    torch.nn.Module.__init__(block)
    block.moe, block.hidden_size = layer, D
    norm = _norm(torch.bfloat16)
    h = torch.randn(2, D).bfloat16()
    with torch.inference_mode():
        f = block.decode_fused(h, norm)
        assert f.weights is not None and block.decode_fused(h, norm) is f
        layer.config = dataclasses.replace(layer.config, gates=(dataclasses.replace(layer.config.gates[0], k=1),))
        f2 = block.decode_fused(h, norm)
        assert f2 is not f and f2.weights.top_k == 1
    with torch.no_grad():
        norm.weight = torch.nn.Parameter(norm.weight.detach().clone())
        f3 = block.decode_fused(h, norm)
        assert f3 is not f2
        layer.experts.down_proj.data = layer.experts.down_proj.data.clone()
        f4 = block.decode_fused(h, norm)
        assert f4 is not f3
        layer.gates[0].bias.add_(1.0)  # bf16: the struct holds an fp32 copy
        f5 = block.decode_fused(h, norm)
        assert f5 is not f4 and torch.equal(f5.weights.gate_bias, layer.gates[0].bias.float())
        assert block.decode_fused(h, norm) is f5


def _tiny_qwen3(tmp_path, dtype):
    transformers = pytest.importorskip("transformers")
    import dynamoe.models

    cfg = transformers.Qwen3MoeConfig(vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=16, intermediate_size=96, moe_intermediate_size=32,
                                      num_experts=8, num_experts_per_tok=2, norm_topk_prob=True, mlp_only_layers=[1],
                                      max_position_embeddings=64, tie_word_embeddings=False)
    torch.manual_seed(0)
    transformers.Qwen3MoeForCausalLM(cfg).save_pretrained(tmp_path)
    return dynamoe.models.load(str(tmp_path), dtype=dtype, progress=False)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_decoder_layers_take_the_block_at_decode(monkeypatch, tmp_path, dtype):
    """Batched decode steps (rows at different lengths) with the block kernel give the same logits and
    statistics as with it off; layer 1 (a dense MLP) has its own block kernel."""
    model = _tiny_qwen3(tmp_path, dtype)
    model.use_decode_plan = False  # (the layer-by-layer path; tests/test_decode_plan.py compares the two)
    ids = torch.randint(0, 96, (2, 7), generator=torch.Generator().manual_seed(3))

    def run():
        cache = model.new_cache(2, 16)
        with torch.inference_mode():
            model(ids[:1, :5], cache=cache, slots=torch.tensor([0]))
            model(ids[1:], cache=cache, slots=torch.tensor([1]))
            steps = [model(torch.tensor([[4], [9]]), cache=cache, slots=torch.tensor([1, 0])) for _ in range(3)]
        return torch.cat(steps, 1), [s.load.clone() for s in model.moe_stats()]

    used = record_calls(monkeypatch, moe_decode, "moe_decode_with")
    fast, fast_stats = run()
    # 2 MoE layers x (2 short prefills through the layer's own decode path + 3 steps), and layer 1's dense MLP
    # block at the 3 steps
    assert used == [True] * 13
    with monkeypatch.context() as m:
        m.setattr(SparseMoeBlock, "decode_block", lambda *a, **kw: None)
        slow, slow_stats = run()
    assert torch.equal(fast, slow)
    assert all(torch.equal(a, b) for a, b in zip(fast_stats, slow_stats))
    assert [i for i, _ in model.moe_layers()] == [0, 2]


@pytest.mark.parametrize("gated", [False, True])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
def test_shared_experts_run_in_the_kernel(monkeypatch, gated, dtype):
    """Shared experts stacked (a loaded model's, or stack_linears_) run inside the MoE kernel -- with
    Qwen2-MoE's sigmoid gate too: the block equals norm + the layer's own decode step + residual bit for
    bit, and the general path (torch's shared experts) within rounding."""
    torch.manual_seed(0)
    layer = MoELayer(MoEConfig(model_dim=D, gates=[GATES["softmax-renorm"]()], dtype=dtype, aux_loss="none",
                               check_finite=False,
                               experts=ExpertConfig(type="glu", num_experts_per_device=8, hidden_size_per_expert=40,
                                                    num_shared_experts=2, shared_gate=gated))).eval()
    layer.requires_grad_(False)
    assert layer.shared_experts.stack_linears_()
    norm = _norm(dtype)
    h = (torch.randn(5, D) * 3).to(dtype)
    used = record_calls(monkeypatch, moe_decode, "moe_decode_with")
    with torch.inference_mode():
        out, stats = _block(layer, h, norm.weight)
        want, want_stats = _one_by_one(layer, norm, h)
    assert used == [True, True] and _fused(layer, h, norm.weight).after is None  # both in the kernel
    assert torch.equal(out, want) and torch.equal(stats.load, want_stats.load)
    monkeypatch.setattr(MoELayer, "_decode_step", lambda *a, **kw: None)
    monkeypatch.setattr(moe_decode, "glu_decode", lambda *a, **kw: None)
    with torch.inference_mode():
        general = h + layer(norm(h))
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    torch.testing.assert_close(out.float(), general.float(), atol=tol * general.abs().max().item(), rtol=tol)
