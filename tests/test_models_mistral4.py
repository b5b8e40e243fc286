"""Mistral-Small-4 against transformers on tiny random checkpoints: DeepSeek-V3's MLA (q_lora_rank and
q_proj, interleaved and half-split RoPE, YaRN with the softmax-scale correction) with Llama-4's position
scaling of the queries past original_max_position_embeddings, softmax top-k routing with shared
experts and a dense first layer, the fused expert tensors transformers saves; group-limited routing with
the groups ranked by the sum of their two best probabilities (the fused decode kernel refuses it)."""
import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch
from models_mla_util import MLA, check_absorption, ids, make_pair, moe_inputs

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.mistral4 import Mistral4ForCausalLM  # noqa: E402
from dynamoe.models.moe_block import GatedMLP, SparseMoeBlock  # noqa: E402
from dynamoe.ops import cpu_kernels  # noqa: E402
from dynamoe.ops.routing import softmax_group_topk  # noqa: E402

# original_max_position_embeddings 8: positions 8.. of the 24-token inputs are scaled (by 1 + 0.1 ln 2, 1 + 0.1 ln 3)
ROPE = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 8,
        "beta_fast": 32.0, "beta_slow": 1.0, "mscale_all_dim": 1.0, "mscale": 1.0, "llama_4_scaling_beta": 0.1}
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
             num_attention_heads=4, n_routed_experts=8, num_experts_per_tok=2, first_k_dense_replace=1,
             max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)
VARIANTS = {
    "q_lora": dict(**MLA, rope_parameters=ROPE),
    # q_proj, half-split RoPE, raw top-k weights scaled by 2.5, two shared experts, a larger llama-4 beta
    "q_proj": dict(**{**MLA, "q_lora_rank": None}, rope_interleave=False, norm_topk_prob=False, routed_scaling_factor=2.5,
                   n_shared_experts=2, rope_parameters={**ROPE, "llama_4_scaling_beta": 0.5}),
    # 16 experts in 8 groups of 2, the best 3 groups eligible, top-3: where ranking groups by their best
    # probability would choose other experts for some tokens
    "groups": dict(**MLA, rope_parameters=ROPE, n_routed_experts=16, num_experts_per_tok=3, n_group=8, topk_group=3),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    cfg = transformers.Mistral4Config(**{**SIZES, **VARIANTS[request.param]})
    hf, path = make_pair(transformers.Mistral4ForCausalLM, cfg, tmp_path_factory.mktemp(f"mistral4_{request.param}"))
    return request.param, hf, dm.load(path, progress=False), path


def test_structure(pair):
    name, _, ours, _ = pair
    assert isinstance(ours, Mistral4ForCausalLM)
    assert [type(layer.mlp) for layer in ours.model.layers] == [GatedMLP, SparseMoeBlock, SparseMoeBlock]
    cfg = ours.config
    assert cfg.head_dim == 16 + 8 and cfg.rope.rope_type == "yarn" and cfg.rope.partial_rotary_factor == 8 / 24
    beta = 0.5 if name == "q_proj" else 0.1
    for layer in ours.model.layers:
        attn = layer.self_attn
        assert attn.llama4_scaling == (beta, 8) and attn.rope_interleaved == (name != "q_proj")
    for _, block in ours.moe_layers():
        gate = block.moe.config.gates[0]
        assert (gate.type, gate.normalize, gate.group_rank) == ("top", name != "q_proj", "top2_sum")
        assert (gate.n_group, gate.topk_group) == ((8, 3) if name == "groups" else (1, 1))
        assert gate.route_scale == (2.5 if name == "q_proj" else 1.0)
        assert block.moe.shared_experts.gate_proj.out_features == 32 * (2 if name == "q_proj" else 1)


def test_position_scaling_matters(pair):
    """Sanity of the test itself: without the Llama-4 query scaling the positions past 8 change."""
    ours = pair[2]
    x = ids()
    with torch.no_grad():
        ref = ours(x)
        saved = [layer.self_attn.llama4_scaling for layer in ours.model.layers]
        for layer in ours.model.layers:
            layer.self_attn.llama4_scaling = None
        plain = ours(x)
        for layer, s in zip(ours.model.layers, saved):
            layer.self_attn.llama4_scaling = s
    torch.testing.assert_close(plain[:, :8], ref[:, :8], atol=1e-5, rtol=0)
    assert (plain[:, 8:] - ref[:, 8:]).abs().max() > 1e-2


def test_logits_match_transformers(pair):
    _, hf, ours, _ = pair
    check_logits(hf, ours, ids())


def test_greedy_matches_generate(pair):
    _, hf, ours, _ = pair
    check_greedy(hf, ours, ids(seed=1), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[2], ids(seed=2), prefill=9)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[2])


def test_absorbed_and_expanded_mla_agree(pair):
    check_absorption(pair[2], ids(seed=3))


def test_group_ranking_matters(pair):
    """Sanity of the test itself: on the 'groups' variant transformers' router picks, for some tokens,
    other experts than the groups ranked by their best probability (DeepSeek-V2's rule) would, and than
    plain top-k; the same experts as dynamoe's 'top2_sum' ranking for every token (one group: plain top-k)."""
    name, hf, _, _ = pair
    E, K, G, keep = (16, 3, 8, 3) if name == "groups" else (8, 2, 1, 1)
    by_max = plain = 0
    for i, x in moe_inputs(hf, ids()).items():
        gate = hf.model.layers[i].mlp.gate
        with torch.no_grad():
            _, _, chosen = gate(x)
            logits = x.float() @ gate.weight.float().t()
        chosen = chosen.sort(-1).values
        _, ours, _ = softmax_group_topk(logits, K, G, keep, group_rank="top2_sum")
        assert torch.equal(ours.sort(-1).values, chosen)
        _, other, _ = softmax_group_topk(logits, K, G, keep, group_rank="max")
        by_max += int((other.sort(-1).values != chosen).any(-1).sum())
        plain += int((logits.topk(K, dim=-1).indices.sort(-1).values != chosen).any(-1).sum())
    assert (by_max > 0 and plain > 0) if name == "groups" else by_max == plain == 0


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels could not be built here")
def test_fused_decode_refuses_group_ranking(pair):
    """The fused decode kernel's router has no 'top2_sum' group ranking: with limited groups the MoE block
    refuses it with the reason (and the parity tests above ran the general path); with one group it fuses."""
    name, _, ours, _ = pair
    h = torch.randn(1, 64)
    for i, block in ours.moe_layers():
        with torch.no_grad():
            fused = block.decode_fused(h, ours.model.layers[i].post_attention_layernorm)
        if name == "groups":
            assert fused.weights is None and "group_rank='top2_sum'" in fused.extra and "no router kernel" in fused.extra
        else:
            assert fused.weights is not None, fused.extra


def test_refusals():
    base = {"model_type": "mistral4", "vocab_size": 8, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
            "n_routed_experts": 4, "num_experts_per_tok": 1, "moe_intermediate_size": 8}
    cfg = dm.ModelConfig.from_dict({**base, "rope_parameters": {"rope_type": "default", "rope_theta": 1e4}})
    with pytest.raises(ValueError, match="llama_4_scaling_beta"):
        Mistral4ForCausalLM(cfg)


def test_engine_generation_matches_generate(pair):
    """The serving engine (continuous batching, chunked prefill) gives transformers' greedy tokens per prompt."""
    from dynamoe.engine import GenerationEngine, SamplingParams

    hf, ours = pair[1], pair[2]
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (6, 19)]
    engine = GenerationEngine(ours, None, max_seq_len=48, max_batch=2, prefill_chunk=8)
    reqs = [engine.add_request(p, SamplingParams(temperature=0), 10, ignore_eos=True) for p in prompts]
    engine.run_until_done()
    for p, r in zip(prompts, reqs):
        want = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=10, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert r.output_ids == want
