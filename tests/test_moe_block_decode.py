"""A decode step's MoE sub-block in one kernel call (MoELayer.decode_block, moe_decode.glu_block_decode:
RMSNorm + router + GLU experts + residual) against the same pieces called one after another -- bit for
bit, statistics included -- and the decoder layer taking it only where it is that computation."""
import pytest
import torch

from dynamoe.models.moe_block import BiasedRouter
from dynamoe.models.norms import RMSNorm
from dynamoe.moe import ExpertConfig, GateConfig, MoEConfig, MoELayer
from dynamoe.moe.gates import renormalizes
from dynamoe.ops import cpu_kernels, moe_decode
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
    used = record_calls(monkeypatch, moe_decode, "glu_block_with")
    with torch.inference_mode():
        got = layer.decode_block(h, norm.weight, norm.eps, norm.weight_in_fp32)
    assert used == [True]
    out, stats = got
    with torch.inference_mode():  # the functional form: the same call
        gcfg = layer.config.gates[0]
        alone = moe_decode.glu_block_decode(h, norm.weight, norm.eps, norm.weight_in_fp32, layer.gates[0], gcfg.type,
                                            gcfg.k, renormalizes(gcfg, gcfg.k, layer.config.normalize_gate),
                                            gcfg.route_scale, gcfg.n_group, gcfg.topk_group, layer.experts)
    assert torch.equal(alone[0], out) and torch.equal(alone[1], stats.load)
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
    args = (norm.weight, norm.eps)
    with torch.inference_mode():
        assert _layer(gate(), shared=1).decode_block(h, *args) is None  # shared experts
        assert _layer(gate(), check_finite=True).decode_block(h, *args) is None  # the general path names NaNs
        assert _layer(gate(), aux_loss="switch").decode_block(h, *args) is None
        assert _layer(GateConfig(type="top", k=2, capacity_factor=1.0, fp32_gate=True)).decode_block(h, *args) is None
        assert _layer(GateConfig(type="top", k=2, capacity_factor=0.0)).decode_block(h, *args) is None  # bf16 logits
        layer = _layer(gate())
        layer.result_func = lambda y: y * 2
        assert layer.decode_block(h, *args) is None
        layer = _layer(gate())
        assert layer.decode_block(torch.randn(17, D).bfloat16(), *args) is None  # not a decode batch
        assert layer.decode_block(h.float(), *args) is None  # input in another dtype than the experts
        assert layer.decode_block(h, norm.weight.float(), norm.eps) is None  # norm weight in another dtype
        assert layer.decode_block(torch.randn(D, 2).bfloat16().t(), *args) is None  # not contiguous
        ffn = MoELayer(MoEConfig(model_dim=D, gates=[gate()], dtype=torch.bfloat16, aux_loss="none", check_finite=False,
                                 experts=ExpertConfig(type="ffn", num_experts_per_device=8, hidden_size_per_expert=16))).eval()
        assert ffn.decode_block(h, *args) is None
        assert layer.decode_block(h, *args) is not None
    with torch.no_grad():
        layer.train()
        assert layer.decode_block(h, *args) is None
    layer.eval()
    assert layer.decode_block(h, *args) is None  # autograd on


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
    statistics as with it off; layer 1 (a dense MLP) keeps its own path."""
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

    used = record_calls(monkeypatch, moe_decode, "glu_block_with")
    fast, fast_stats = run()
    assert used == [True] * 6  # 3 steps x 2 MoE layers
    with monkeypatch.context() as m:
        m.setattr(moe_decode, "glu_block_args", lambda *a, **kw: None)
        slow, slow_stats = run()
    assert torch.equal(fast, slow)
    assert all(torch.equal(a, b) for a, b in zip(fast_stats, slow_stats))
    assert [i for i, _ in model.moe_layers()] == [0, 2]
