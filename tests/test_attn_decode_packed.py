"""Packed attention projections (dynamoe.quant.QuantizedLinear q/k/v/o: blockwise FP8, MXFP4, NVFP4, INT4;
exact or int8 activations) inside the fused attention kernel (kernels.LinearWeights in AttentionWeights):
the kernel runs, its block equals the op-by-op block (which calls the same packed GEMVs), it writes the same
keys and values, and a model decodes through the DecodePlan with the logits of the full recompute. Where the
packed path is simulated (FP8 activations) the kernel is declined with the reason."""
import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, save_family

import transformers  # noqa: E402 -- a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.attention import Attention  # noqa: E402
from dynamoe.ops import cpu_kernels  # noqa: E402
from dynamoe.quant import quantize_linears_  # noqa: E402
from spying import record_calls  # noqa: E402

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels could not be built here")

COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=256, bos_token_id=None, eos_token_id=None)
FAMILIES = {  # q/k norms (Qwen3); q/k/v and o biases with partial RoPE (GLM-4.5)
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, **COMMON)),
    "glm4_moe": lambda: transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(
        intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
        first_k_dense_replace=1, n_shared_experts=1, attention_bias=True, use_qk_norm=True, **COMMON)),
}
FORMATS = [("fp8_block", None), ("mxfp4", None), ("nvfp4", None), ("int4", None), ("mxfp4", "int8"), ("int4", "int8")]


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def folder(request, tmp_path_factory):
    return save_family(FAMILIES, request.param, tmp_path_factory)


def _quantized(folder, dtype, fmt, act_quant):
    model = dm.load(folder, dtype=dtype, progress=False)
    n = quantize_linears_(model, fmt, exclude=lambda name: ".self_attn." not in name, act_quant=act_quant,
                          **({"group_size": 32} if fmt == "int4" else {}))
    assert n == 4 * len(model.model.layers)
    return model


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("fmt,act_quant", FORMATS)
def test_packed_block_equals_op_by_op_block(folder, dtype, fmt, act_quant):
    model = _quantized(folder, dtype, fmt, act_quant)
    g = torch.Generator().manual_seed(3)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    slots, start = torch.tensor([1, 3, 0]), torch.tensor([0, 3, 1])
    for layer in model.model.layers:
        attn, norm = layer.self_attn, layer.input_layernorm
        fused = attn.decode_fused(norm, dtype)
        assert fused.weights is not None, fused.extra
        assert len(fused.weights.qkv) == 3 and fused.weights.o.format.name == fmt
        fast_cache, slow_cache = model.new_cache(4, 40), model.new_cache(4, 40)
        with torch.no_grad():
            for step in range(10):
                h = torch.randn(3, 1, 64, generator=g).to(dtype)
                positions = (start + step)[:, None]
                kv_len = int(positions.max()) + 1
                for c in (fast_cache, slow_cache):
                    for s, p in zip(slots.tolist(), positions[:, 0].tolist()):
                        c.reserve(s, p + 1)
                fast = attn.decode_step(h, norm, positions, fast_cache, slots, kv_len)
                slow = h + attn(norm(h), positions, slow_cache, slots, kv_len)
                assert fast is not None and fast.dtype == dtype
                torch.testing.assert_close(fast.float(), slow.float(), atol=tol * slow.abs().max().item(), rtol=tol)
        for name in ("k", "v"):
            a = fast_cache.kv_pool(attn.layer_idx, name, attn.num_kv_heads, attn.head_dim)
            b = slow_cache.kv_pool(attn.layer_idx, name, attn.num_kv_heads, attn.head_dim)
            torch.testing.assert_close(a.float(), b.float(), atol=tol * b.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("fmt", ["fp8_block", "nvfp4"])
def test_quantized_model_decodes_through_the_plan(folder, monkeypatch, fmt):
    """fp32 steps through the DecodePlan (packed attention inside the one native call) give the logits of the
    full recompute, and the plan holds every layer's attention."""
    model = _quantized(folder, torch.float32, fmt, None)
    ids = torch.randint(0, VOCAB, (1, 14), generator=torch.Generator().manual_seed(7))
    cache, slots = model.new_cache(2, 40), torch.tensor([1])
    used = record_calls(monkeypatch, Attention, "decode_with")  # the layer-by-layer kernel: not needed
    with torch.no_grad():
        steps = [model(ids[:, :6], cache=cache, slots=slots)]
        for t in range(6, ids.size(1)):
            steps.append(model(ids[:, t:t + 1], cache=cache, slots=slots))
        full = model(ids)
    plan = model.__dict__["_plan"][1]
    assert plan is not None and used == []
    n = len(model.model.layers)
    assert plan.describe() == f"{n} of {n} layers fused", plan.describe()
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=1e-5, rtol=1e-5)


def test_simulated_activation_quantization_is_declined(folder):
    model = _quantized(folder, torch.float32, "fp8_block", "fp8")
    layer = model.model.layers[0]
    fused = layer.self_attn.decode_fused(layer.input_layernorm, torch.float32)
    assert fused.weights is None and "activation quantization 'fp8'" in fused.extra
