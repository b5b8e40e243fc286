"""LongCat-Flash against transformers on tiny random checkpoints: two MLA sublayers per layer with LoRA scales
(caching as layers 2i and 2i + 1), two dense MLPs and a shortcut MoE whose softmax router (selection bias, route
scale) also picks zero-computation experts; YaRN's softmax mscale in one variant."""
import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, ids, save_tiny
from models_mla_util import YARN, randomize_deepseek_

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.longcat_flash import LongcatDecoderLayer, LongcatFlashForCausalLM, ZeroComputeExperts  # noqa: E402
from dynamoe.moe.experts import GLUExperts  # noqa: E402

E, Z = 4, 3
SIZES = dict(vocab_size=VOCAB, hidden_size=64, num_layers=2, num_attention_heads=4, ffn_hidden_size=96,
             expert_ffn_hidden_size=32, n_routed_experts=E, zero_expert_num=Z, moe_topk=3, q_lora_rank=24,
             kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, head_dim=8,
             max_position_embeddings=256, bos_token_id=None, eos_token_id=None, routed_scaling_factor=2.0)
VARIANTS = {
    "default": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0}),
    "yarn_bias": dict(rope_parameters=YARN, attention_bias=True),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.LongcatFlashForCausalLM(transformers.LongcatFlashConfig(**SIZES, **VARIANTS[request.param])).eval()
    randomize_deepseek_(hf, 3)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"longcat_{request.param}"))
    return request.param, hf, dm.load(path, progress=False)


def test_structure(pair):
    name, hf, ours = pair
    assert type(ours) is LongcatFlashForCausalLM and ours.config.num_hidden_layers == 2 == hf.config.num_layers
    assert all(type(layer) is LongcatDecoderLayer for layer in ours.model.layers)
    assert [a.layer_idx for layer in ours.model.layers for a in layer.self_attn] == [0, 1, 2, 3]
    assert len(ours.new_cache(1, 8).layers) == 4
    attn = ours.model.layers[0].self_attn[0]
    assert attn.lora_scales == pytest.approx(((64 / 24) ** 0.5, (64 / 32) ** 0.5))
    assert (attn.o_proj.bias is not None) == (name == "yarn_bias")
    for _, block in ours.moe_layers():
        gate = block.moe.config.gates[0]
        assert (gate.type, gate.k, gate.normalize, gate.route_scale, gate.selection_bias) == ("top", 3, False, 2.0, True)
        assert type(block.moe.experts) is ZeroComputeExperts and block.moe.experts.gate_up_proj.size(0) == E
        assert block.moe.gates[0].e_score_correction_bias.shape == (E + Z,)
        assert block.moe.gates[0].e_score_correction_bias.abs().min() > 0


def _no_identity(self, x_ND, counts, row_scale=None, out=None):
    """ZeroComputeExperts.forward_ragged with the zero experts' rows zeroed (their identity output dropped)."""
    n = sum(counts[:E])
    y = GLUExperts.forward_ragged(self, x_ND[:n], list(counts[:E]), None if row_scale is None else row_scale[:n])
    return torch.cat([y, torch.zeros_like(x_ND[n:])])


def test_zero_experts_lora_scales_and_shortcut_matter(pair, monkeypatch):
    """Sanity of the test itself: tokens do spend weight on zero experts, and without their identity output,
    without the LoRA scales, or without the shortcut MoE, the logits change."""
    ours = pair[2]
    x = ids()
    attns = [a for layer in ours.model.layers for a in layer.self_attn]
    with torch.no_grad():
        ref = ours(x)
        assert all(block.last_stats.load[E:].sum() > 0 for _, block in ours.moe_layers())
        with monkeypatch.context() as m:
            m.setattr(ZeroComputeExperts, "forward_ragged", _no_identity)
            no_identity = ours(x)
        with monkeypatch.context() as m:
            for a in attns:
                m.setattr(a, "lora_scales", None)
            unscaled = ours(x)
        with monkeypatch.context() as m:
            m.setattr(ours.model.layers[0].mlp, "forward", torch.zeros_like)
            no_shortcut = ours(x)
        assert torch.equal(ours(x), ref)
    for other in (no_identity, unscaled, no_shortcut):
        assert (other - ref).abs().max() > 1e-2


def test_logits_match_transformers(pair):
    _, hf, ours = pair
    check_logits(hf, ours, ids())


def test_greedy_matches_generate(pair):
    _, hf, ours = pair
    check_greedy(hf, ours, ids(seed=1), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[2], ids(seed=2), prefill=9)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[2])


def test_padded_layout_equals_ragged(pair):
    """The zero experts in the padded [E + Z, C, D] layout give what the ragged rows give."""
    ours = pair[2]
    _, block = ours.moe_layers()[0]
    x = torch.randn(20, 64)
    with torch.no_grad():
        ragged = block.moe(x, layout="ragged")
        padded = block.moe(x, layout="padded")
    torch.testing.assert_close(padded, ragged, atol=1e-5, rtol=1e-5)


def test_kernels_refuse_zero_experts(pair):
    ours = pair[2]
    _, block = ours.moe_layers()[0]
    fused = block.moe.decode_fused(torch.randn(2, 64))
    assert fused.weights is None and "ZeroComputeExperts" in fused.extra


def test_engine_generation_matches_generate(pair):
    """The serving engine (continuous batching, chunked prefill) gives transformers' greedy tokens per prompt."""
    from dynamoe.engine import GenerationEngine, SamplingParams

    _, hf, ours = pair
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (6, 19)]
    engine = GenerationEngine(ours, None, max_seq_len=48, max_batch=2, prefill_chunk=8)
    reqs = [engine.add_request(p, SamplingParams(temperature=0), 10, ignore_eos=True) for p in prompts]
    engine.run_until_done()
    for p, r in zip(prompts, reqs):
        want = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=10, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert r.output_ids == want


def test_head_dim_must_be_the_rope_head_dim():
    """LongCat's RoPE table is head_dim wide and rotates the qk_rope_head_dim part of each head (transformers'
    LongcatFlash fails on any other config): refused at build, naming the field, not at the first decode."""
    d = {"model_type": "longcat_flash", **SIZES, "rope_parameters": VARIANTS["default"]["rope_parameters"]}
    LongcatFlashForCausalLM(dm.ModelConfig.from_dict(d))
    with pytest.raises(ValueError, match=r"'head_dim' must equal qk_rope_head_dim=8 for longcat_flash.*got 16"):
        LongcatFlashForCausalLM(dm.ModelConfig.from_dict({**d, "head_dim": 16}))
