"""The shared blocks against transformers' own functions: RoPE frequencies of every type we parse
(and both config styles), interleaved and partial RoPE, RMSNorm; the attention masks."""
import math

import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)

transformers = pytest.importorskip("transformers")

from transformers.modeling_rope_utils import ROPE_INIT_FUNCTIONS  # noqa: E402

from dynamoe.models import ModelConfig  # noqa: E402
from dynamoe.models.attention import attention_mask  # noqa: E402
from dynamoe.models.norms import RMSNorm  # noqa: E402
from dynamoe.models.rope import apply_rope, rope_frequencies, yarn_mscale  # noqa: E402

BASE = dict(vocab_size=64, hidden_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
            head_dim=32, max_position_embeddings=2048, num_experts=4, num_experts_per_tok=2, moe_intermediate_size=32)
ROPES = [
    {"rope_type": "linear", "factor": 4.0},
    {"rope_type": "dynamic", "factor": 2.0},
    {"rope_type": "yarn", "factor": 32.0, "beta_fast": 32.0, "beta_slow": 1.0, "truncate": False,
     "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "factor": 40.0, "mscale": 1.0, "mscale_all_dim": 0.707, "original_max_position_embeddings": 128},
    {"rope_type": "yarn", "factor": 8.0, "attention_factor": 1.5, "original_max_position_embeddings": 256},
    {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0, "high_freq_factor": 4.0,
     "original_max_position_embeddings": 128},
    {"rope_type": "default", "partial_rotary_factor": 0.5},
]


@pytest.mark.parametrize("rope", ROPES, ids=lambda r: r["rope_type"] + ("-" + "-".join(sorted(set(r) - {"rope_type"}))))
@pytest.mark.parametrize("hub_style", [False, True])
def test_rope_frequencies_match_transformers(rope, hub_style):
    hf_cfg = transformers.Qwen3MoeConfig(**BASE, rope_parameters={"rope_theta": 50000.0, **rope})
    if rope["rope_type"] == "default":  # transformers' default RoPE is computed by the model itself
        dim = int(32 * rope.get("partial_rotary_factor", 1.0))
        want, want_scale = 1.0 / (50000.0 ** (torch.arange(0, dim, 2).float() / dim)), 1.0
    else:
        want, want_scale = ROPE_INIT_FUNCTIONS[rope["rope_type"]](hf_cfg, None)
    if hub_style:
        scaling = {("type" if k == "rope_type" else k): v for k, v in rope.items() if k != "partial_rotary_factor"}
        d = {"model_type": "qwen3_moe", **BASE, "rope_theta": 50000.0, "rope_scaling": scaling}
        if "partial_rotary_factor" in rope:
            d["partial_rotary_factor"] = rope["partial_rotary_factor"]
    else:
        d = {**hf_cfg.to_dict()}
    cfg = ModelConfig.from_dict(d)
    dim = int(cfg.head_dim * cfg.rope.partial_rotary_factor)
    got, scale = rope_frequencies(cfg.rope, dim, cfg.max_position_embeddings)
    torch.testing.assert_close(got, want.float(), atol=0, rtol=1e-6)
    assert scale == pytest.approx(want_scale, rel=1e-6)


def test_dynamic_rope_grows_past_max_positions():
    cfg = ModelConfig.from_dict({"model_type": "qwen3_moe", **BASE, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}})
    hf_cfg = transformers.Qwen3MoeConfig(**BASE, rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    want, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf_cfg, None, seq_len=5000)
    got, _ = rope_frequencies(cfg.rope, 32, 2048, seq_len=5000)
    torch.testing.assert_close(got, want, atol=0, rtol=1e-6)


def test_yarn_mscale():
    assert yarn_mscale(1.0) == 1.0 and yarn_mscale(40, 0.707) == pytest.approx(0.1 * 0.707 * math.log(40) + 1)


def test_interleaved_rope_matches_deepseek():
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import apply_rotary_pos_emb_interleave

    g = torch.Generator().manual_seed(0)
    q, k = torch.randn(2, 4, 5, 16, generator=g), torch.randn(2, 1, 5, 16, generator=g)
    freqs = torch.randn(2, 5, 8, generator=g)
    cos, sin = freqs.cos(), freqs.sin()
    want_q, want_k = apply_rotary_pos_emb_interleave(q, k, torch.cat([cos, cos], -1), torch.cat([sin, sin], -1))
    torch.testing.assert_close(apply_rope(q, cos, sin, interleaved=True), want_q)
    torch.testing.assert_close(apply_rope(k, cos, sin, interleaved=True), want_k)


def test_partial_rope_matches_glm():
    from transformers.models.glm4_moe.modeling_glm4_moe import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(1)
    q, k = torch.randn(2, 4, 5, 16, generator=g), torch.randn(2, 2, 5, 16, generator=g)
    freqs = torch.randn(2, 5, 4, generator=g)  # 8 of the 16 dims rotate
    cos, sin = freqs.cos(), freqs.sin()
    want_q, want_k = apply_rotary_pos_emb(q, k, torch.cat([cos, cos], -1), torch.cat([sin, sin], -1))
    torch.testing.assert_close(apply_rope(q, cos, sin), want_q)
    torch.testing.assert_close(apply_rope(k, cos, sin), want_k)


@pytest.mark.parametrize("weight_in_fp32", [False, True])
def test_rmsnorm_matches_transformers(weight_in_fp32):
    from transformers.models.gpt_oss.modeling_gpt_oss import GptOssRMSNorm
    from transformers.models.qwen3_moe.modeling_qwen3_moe import Qwen3MoeRMSNorm

    ref = (GptOssRMSNorm if weight_in_fp32 else Qwen3MoeRMSNorm)(24, eps=1e-5)
    ours = RMSNorm(24, 1e-5, weight_in_fp32=weight_in_fp32)
    with torch.no_grad():
        ref.weight.normal_()
        ours.weight.copy_(ref.weight)
    ref, ours = ref.to(torch.bfloat16), ours.to(torch.bfloat16)
    x = torch.randn(3, 24).to(torch.bfloat16)
    assert torch.equal(ours(x), ref(x))


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("weight_in_fp32", [False, True])
def test_rmsnorm_inference_kernel_matches_torch_path(dtype, weight_in_fp32):
    """Under no_grad on CPU the norm is one kernel call: the same values as the op-by-op path (fp32
    statistics; a bf16 result may differ by the last bit where the sum's order moves a rounding),
    for whole rows and for heads viewed out of a wider row."""
    ours = RMSNorm(64, 1e-6, weight_in_fp32=weight_in_fp32).to(dtype)
    with torch.no_grad():
        ours.weight.normal_()
    g = torch.Generator().manual_seed(0)
    wide = (torch.randn(5, 3, 7 * 64, generator=g) * 3).to(dtype)
    for x in (wide[..., :64], wide[..., 64:5 * 64].unflatten(-1, (4, 64)), wide[:1, :1, :64]):
        want = ours(x)   # grad mode: the op-by-op path
        with torch.no_grad():
            got = ours(x)
        assert got.shape == want.shape and got.dtype == dtype and got.is_contiguous()
        if dtype == torch.float32:
            torch.testing.assert_close(got, want, rtol=1e-6, atol=1e-6)
        else:
            diff = (got.float() - want.float()).abs()
            assert (diff <= want.float().abs() * 2 ** -7).all() and (diff > 0).float().mean() < 0.02


def test_attention_mask_rows_at_different_positions():
    q_pos = torch.tensor([[3], [6]])  # row 0 decodes position 3, row 1 position 6
    k_pos = torch.arange(7).expand(2, 7)
    causal = attention_mask(q_pos, k_pos, None)[:, 0, 0]
    assert causal.tolist() == [[True] * 4 + [False] * 3, [True] * 7]
    windowed = attention_mask(q_pos, k_pos, 3)[:, 0, 0]  # keeps kv > q - 3
    assert windowed.tolist() == [[False, True, True, True, False, False, False], [False] * 4 + [True] * 3]


def test_sigmoid_moe_block_matches_deepseek_v3():
    """The DeepSeek-V3 routing path of SparseMoeBlock (for the families that build on it): sigmoid
    scores, selection bias, group-limited top-k, renormalise, route scale, shared experts."""
    from transformers.models.deepseek_v3.modeling_deepseek_v3 import DeepseekV3MoE

    from dynamoe.models.moe_block import SparseMoeBlock

    hf_cfg = transformers.DeepseekV3Config(vocab_size=64, hidden_size=64, intermediate_size=96, moe_intermediate_size=32,
                                           num_hidden_layers=1, num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8,
                                           num_experts_per_tok=2, n_group=4, topk_group=2, routed_scaling_factor=2.5,
                                           n_shared_experts=1, norm_topk_prob=True)
    ref = DeepseekV3MoE(hf_cfg).eval()
    g = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for p in list(ref.parameters()) + [ref.gate.e_score_correction_bias]:
            p.copy_(torch.randn(p.shape, generator=g) * 0.3)
    cfg = ModelConfig.from_dict(hf_cfg.to_dict())
    assert (cfg.num_experts, cfg.n_group, cfg.topk_group, cfg.n_shared_experts) == (8, 4, 2, 1)
    ours = SparseMoeBlock(cfg, "sigmoid", normalize=cfg.norm_topk_prob, num_shared_experts=cfg.n_shared_experts).eval()
    moe = ours.moe
    with torch.no_grad():
        moe.gates[0].wg.weight.copy_(ref.gate.weight)
        moe.gates[0].e_score_correction_bias.copy_(ref.gate.e_score_correction_bias)
        moe.experts.gate_up_proj.copy_(ref.experts.gate_up_proj)
        moe.experts.down_proj.copy_(ref.experts.down_proj)
        for n in ("gate_proj", "up_proj", "down_proj"):
            getattr(moe.shared_experts, n).weight.copy_(getattr(ref.shared_experts, n).weight)
        x = torch.randn(2, 7, 64, generator=g)
        torch.testing.assert_close(ours(x), ref(x), atol=1e-5, rtol=1e-5)  # fp32 sums in another order


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float32])
@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("rotary_dims", [32, 16])
def test_rope_inference_kernel_matches_torch_path(dtype, interleaved, rotary_dims):
    """Under no_grad on CPU RoPE is one kernel call with the op-by-op path's roundings: equal values,
    also for partial rotary and for q/k viewed out of a fused [B, T, (H + 2K) d] projection."""
    g = torch.Generator().manual_seed(0)
    B, T, H, d = 2, 3, 4, 32
    fused = torch.randn(B, T, (H + 4) * d, generator=g).to(dtype)
    q = fused[..., :H * d].unflatten(-1, (H, d)).transpose(1, 2)       # [B, H, T, d], strided
    ang = torch.randn(B, T, rotary_dims // 2, generator=g)
    cos, sin = ang.cos().to(dtype), ang.sin().to(dtype)
    for x in (q, q.contiguous(), q[:1, :, -1:]):
        c, s = cos[:x.size(0), -x.size(2):], sin[:x.size(0), -x.size(2):]
        want = apply_rope(x, c, s, interleaved)   # grad mode: the op-by-op path
        with torch.no_grad():
            got = apply_rope(x, c, s, interleaved)
        assert got.shape == want.shape and got.dtype == dtype
        assert torch.equal(got, want)


def test_dynamic_rope_rows_are_their_own_length():
    # each row rotates with the base its own length gives (as transformers for that row alone), whatever the
    # batch's other rows are: a request's output does not change with what shares its batch
    from dynamoe.models.rope import RotaryEmbedding

    cfg = ModelConfig.from_dict({"model_type": "qwen3_moe", **BASE, "rope_parameters": {"rope_type": "dynamic", "factor": 2.0}})
    rot = RotaryEmbedding(cfg.rope, 32, 64)
    short, long = torch.arange(40, 45)[None], torch.arange(95, 100)[None]       # lengths 45 (< 64) and 100 (> 64)
    both = torch.cat([short, long])
    cos_s, sin_s = rot(short, torch.float32)
    cos_l, sin_l = rot(long, torch.float32)
    cos_b, sin_b = rot(both, torch.float32)
    assert torch.equal(cos_b[0], cos_s[0]) and torch.equal(sin_b[0], sin_s[0])
    assert torch.equal(cos_b[1], cos_l[0]) and torch.equal(sin_b[1], sin_l[0])
    hf_cfg = transformers.Qwen3MoeConfig(**{**BASE, "max_position_embeddings": 64},
                                         rope_parameters={"rope_type": "dynamic", "factor": 2.0, "rope_theta": 10000.0})
    want, _ = ROPE_INIT_FUNCTIONS["dynamic"](hf_cfg, None, seq_len=100)
    torch.testing.assert_close(cos_l[0], torch.cos(long[0, :, None].float() * want[:16]), atol=1e-6, rtol=1e-6)
    base = 1.0 / 10000.0 ** (torch.arange(0, 32, 2).float() / 32)      # the plain frequencies below the limit
    torch.testing.assert_close(cos_s[0], torch.cos(short[0, :, None].float() * base), atol=1e-6, rtol=1e-6)
