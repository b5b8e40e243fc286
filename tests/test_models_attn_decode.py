"""One sequence's decode step through an attention block in one kernel call (Attention.decode_step,
csrc/attn_decode.cpp) for every attention variant the GQA families use -- q/k norm (Qwen3), sinks +
sliding window shorter than the sequence + biases + YaRN (GPT-OSS), partial RoPE + q/k/v biases (GLM-4.5),
a plain sliding window (Mixtral), a softplus output gate per head or per channel (Laguna), NoPE layers beside
sliding RoPE ones (EXAONE-MoE): fp32 steps equal the full recompute, bf16 steps equal the op-by-op
path within bf16 rounding, and the kernel runs only where it applies."""
import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, save_family

transformers = pytest.importorskip("transformers")

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.attention import Attention  # noqa: E402
from dynamoe.ops import cpu_kernels  # noqa: E402
from spying import record_calls  # noqa: E402

pytestmark = pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels could not be built here")

COMMON = dict(vocab_size=VOCAB, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
              head_dim=16, max_position_embeddings=256, bos_token_id=None, eos_token_id=None)
FAMILIES = {
    "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
        intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, **COMMON)),
    "gpt_oss": lambda: transformers.GptOssForCausalLM(transformers.GptOssConfig(
        intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=6, **COMMON)),
    "glm4_moe": lambda: transformers.Glm4MoeForCausalLM(transformers.Glm4MoeConfig(
        intermediate_size=96, moe_intermediate_size=32, n_routed_experts=8, num_experts_per_tok=2,
        first_k_dense_replace=1, n_shared_experts=1, attention_bias=True, use_qk_norm=True, **COMMON)),
    "mixtral_window": lambda: transformers.MixtralForCausalLM(transformers.MixtralConfig(
        intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=5, **COMMON)),
    "laguna_head": lambda: transformers.LagunaForCausalLM(transformers.LagunaConfig(
        intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
        num_experts_per_tok=2, **COMMON)),
    "laguna_channel": lambda: transformers.LagunaForCausalLM(transformers.LagunaConfig(
        intermediate_size=96, moe_intermediate_size=32, shared_expert_intermediate_size=48, num_experts=8,
        num_experts_per_tok=2, gating="per-element", layer_types=["sliding_attention", "full_attention"],
        sliding_window=5, **COMMON)),
    "exaone_nope": lambda: transformers.ExaoneMoeForCausalLM(transformers.ExaoneMoeConfig(
        intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, sliding_window=5,
        sliding_window_pattern=2, **COMMON)),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def folder(request, tmp_path_factory):
    return save_family(FAMILIES, request.param, tmp_path_factory)


def _spy(monkeypatch):
    return record_calls(monkeypatch, Attention, "decode_with")


def _decode(model, ids, prefill=6, slot=1):
    cache = model.new_cache(3, 40)
    slots = torch.tensor([slot])
    with torch.no_grad():
        steps = [model(ids[:, :prefill], cache=cache, slots=slots)]
        for t in range(prefill, ids.size(1)):
            steps.append(model(ids[:, t:t + 1], cache=cache, slots=slots))
    return torch.cat(steps, dim=1)


IDS = torch.randint(0, VOCAB, (1, 16), generator=torch.Generator().manual_seed(7))


@pytest.mark.parametrize("plan", [False, True])
def test_fp32_steps_equal_full_recompute(folder, monkeypatch, plan):
    """Layer by layer (the kernel called by Attention.decode_step, counted) and through a DecodePlan."""
    model = dm.load(folder, progress=False)
    model.use_decode_plan = plan
    used = _spy(monkeypatch)
    got = _decode(model, IDS)
    if not plan:
        assert used and all(used) and len(used) == 2 * (IDS.size(1) - 6)
    with torch.no_grad():
        full = model(IDS)
    # fp32 logits up to ~6 through two layers summed in another order (8-, 16-lane or scalar partial sums
    # by build): ~1e-5 apart already at the prompt's positions
    torch.testing.assert_close(got, full, atol=3e-5, rtol=1e-5)


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("rows", [1, 3])
def test_block_equals_op_by_op_block(folder, dtype, rows):
    """Each layer's attention block alone (no MoE routing downstream to amplify a rounding): the kernel's
    h + attn(norm(h)) against the op-by-op path's on identical caches, step by step past the window
    (rows > 1: rows at different positions, slots out of order)."""
    model = dm.load(folder, dtype=dtype, progress=False)
    g = torch.Generator().manual_seed(3)
    tol = 2e-2 if dtype == torch.bfloat16 else 1e-5
    slots = torch.tensor([1, 3, 0][:rows])
    start = torch.tensor([0, 3, 1][:rows])
    for layer in model.model.layers:
        attn, norm = layer.self_attn, layer.input_layernorm
        fast_cache, slow_cache = model.new_cache(4, 40), model.new_cache(4, 40)
        with torch.no_grad():
            for step in range(12):
                h = torch.randn(rows, 1, 64, generator=g).to(dtype)
                positions = (start + step)[:, None]
                kv_len = int(positions.max()) + 1
                for c in (fast_cache, slow_cache):   # (a model's forward takes the blocks; here the layer alone runs)
                    for s, p in zip(slots.tolist(), positions[:, 0].tolist()):
                        c.reserve(s, p + 1)
                fast = attn.decode_step(h, norm, positions, fast_cache, slots, kv_len)
                slow = h + attn(norm(h), positions, slow_cache, slots, kv_len)
                assert fast is not None and fast.dtype == dtype and fast.shape == h.shape
                torch.testing.assert_close(fast.float(), slow.float(), atol=tol * slow.abs().max().item(), rtol=tol)
        for name in ("k", "v"):  # the kernel wrote the same keys and values into the cache
            a = fast_cache.kv_pool(attn.layer_idx, name, attn.num_kv_heads, attn.head_dim)
            b = slow_cache.kv_pool(attn.layer_idx, name, attn.num_kv_heads, attn.head_dim)
            torch.testing.assert_close(a.float(), b.float(), atol=tol * b.abs().max().item(), rtol=tol)


@pytest.mark.parametrize("plan", [False, True])
def test_batched_rows_at_different_lengths(folder, monkeypatch, plan):
    """Three sequences of different lengths in slots out of order decode together (one kernel call per
    layer and step, or a DecodePlan) and each row's logits equal the full recompute of its own sequence."""
    model = dm.load(folder, progress=False)
    model.use_decode_plan = plan
    g = torch.Generator().manual_seed(11)
    seqs = [torch.randint(0, VOCAB, (1, n), generator=g) for n in (14, 9, 12)]
    slots = torch.tensor([2, 0, 3])
    cache = model.new_cache(4, 40)
    used = _spy(monkeypatch)
    steps = 4
    with torch.no_grad():
        for b, seq in enumerate(seqs):  # prefill each alone, all but the last `steps` tokens
            model(seq[:, :-steps], cache=cache, slots=slots[b:b + 1])
        got = []
        for i in range(steps):
            col = torch.cat([seq[:, seq.size(1) - steps + i:seq.size(1) - steps + i + 1] for seq in seqs])
            got.append(model(col, cache=cache, slots=slots))
        for b, seq in enumerate(seqs):
            full = model(seq)[0, -steps:]
            torch.testing.assert_close(torch.cat([x[b] for x in got]), full, atol=1e-5, rtol=1e-5)
    assert plan or (used and all(used) and len(used) == 2 * steps)


def test_not_used_where_it_does_not_apply(folder, monkeypatch):
    model = dm.load(folder, progress=False)
    model.use_decode_plan = False
    used = _spy(monkeypatch)
    cache = model.new_cache(17, 40)
    with torch.no_grad():
        model(IDS[:, :4].repeat(17, 1), cache=cache)            # prefill: T > 1, never asked
        model(IDS[:, 4:5].repeat(17, 1), cache=cache)           # 17 sequences: the op-by-op path
    assert used == []
    cache = model.new_cache(1, 40)
    model(IDS[:, :4], cache=cache)
    model(IDS[:, 4:5], cache=cache)  # autograd on: the op-by-op path
    assert used == []
    attn = model.model.layers[0].self_attn
    with torch.no_grad():  # a norm of another kind: declined by the attention itself
        assert attn.decode_step(torch.zeros(1, 1, 64), torch.nn.LayerNorm(64), torch.tensor([[0]]), cache,
                                torch.tensor([0])) is None
