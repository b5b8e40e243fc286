"""Kimi-Linear against transformers on tiny random checkpoints: Kimi Delta Attention (per-channel decay,
short convolutions on q/k/v, sigmoid-gated output norm) mixed with NoPE MLA, a dense first layer and
DeepSeek-V3 routing with shared experts; the recurrent state in the cache (chunked prefill, decode, rows
at different positions, a reused slot, no prefix reuse); the hub's config.json and tensor names."""
import copy
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch
from models_mla_util import check_absorption, check_group_routing_differs, ids, make_pair

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.kda import KimiDeltaAttention, kda_chunked, kda_recurrent  # noqa: E402
from dynamoe.models.kimi_linear import KimiLinearForCausalLM  # noqa: E402
from dynamoe.models.linear_attention import gated_delta_rule_recurrent, l2norm  # noqa: E402
from dynamoe.models.mla import MLAttention  # noqa: E402
from dynamoe.models.moe_block import GatedMLP, SparseMoeBlock  # noqa: E402

LAYERS = ["linear_attention", "full_attention", "linear_attention", "linear_attention", "full_attention"]
SIZES = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=5,
             num_attention_heads=4, num_key_value_heads=4, num_local_experts=8, num_experts_per_tok=2, kv_lora_rank=32,
             qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12, linear_head_dim=8, linear_num_heads=4,
             layer_types=LAYERS, max_position_embeddings=256, bos_token_id=None, eos_token_id=None, pad_token_id=None)
VARIANTS = {
    # the hub's shape: q_proj (no q_lora_rank), one expert group, one shared expert, renormalised
    "q_proj": dict(),
    # q_lora_rank, 4 groups of 2 experts with the best 2 eligible, raw weights, 2 shared experts, conv of 3
    "q_lora": dict(q_lora_rank=24, n_group=4, topk_group=2, norm_topk_prob=False, n_shared_experts=2,
                   linear_conv_kernel_dim=3),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    cfg = transformers.KimiLinearConfig(**SIZES, **VARIANTS[request.param])
    hf, path = make_pair(transformers.KimiLinearForCausalLM, cfg, tmp_path_factory.mktemp(f"kimi_{request.param}"))
    return request.param, hf, dm.load(path, progress=False), path


# ------------------------------------------------------------------------------ the ops
def _inputs(B=2, H=3, T=37, dk=8, dv=6, seed=0, dtype=torch.float64):
    g = torch.Generator().manual_seed(seed)
    q = l2norm(torch.randn(B, H, T, dk, generator=g, dtype=dtype)) * dk ** -0.5
    k = l2norm(torch.randn(B, H, T, dk, generator=g, dtype=dtype))
    v = torch.randn(B, H, T, dv, generator=g, dtype=dtype)
    decay = -3 * torch.rand(B, H, T, dk, generator=g, dtype=dtype)  # per channel, some nearly zero, some strong
    beta = torch.rand(B, H, T, generator=g, dtype=dtype)
    return q, k, v, decay, beta, torch.randn(B, H, dk, dv, generator=g, dtype=dtype)


@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
def test_chunked_kda_equals_recurrent(chunk):
    """fp64: the chunked form is the recurrence, not an approximation (with and without a start state,
    and two calls equal one)."""
    q, k, v, decay, beta, s0 = _inputs()
    for start in (None, s0):
        o_ref, s_ref = kda_recurrent(q, k, v, decay, beta, start)
        o, s = kda_chunked(q, k, v, decay, beta, start, chunk_size=chunk)
        assert o.dtype == torch.float64 and o.shape == v.shape and s.shape == s0.shape
        torch.testing.assert_close(o, o_ref, atol=1e-12, rtol=0)
        torch.testing.assert_close(s, s_ref, atol=1e-12, rtol=0)
    parts = [t[:, :, :20] for t in (q, k, v, decay, beta)]
    o1, s1 = kda_chunked(*parts, chunk_size=chunk)
    o2, s2 = kda_chunked(*(t[:, :, 20:] for t in (q, k, v, decay, beta)), s1, chunk_size=chunk)
    o_ref, s_ref = kda_recurrent(q, k, v, decay, beta)
    torch.testing.assert_close(torch.cat([o1, o2], 2), o_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(s2, s_ref, atol=1e-12, rtol=0)


def test_kda_with_one_decay_per_head_is_the_gated_delta_rule():
    q, k, v, decay, beta, s0 = _inputs(seed=1)
    per_head = decay[..., 0]
    o, s = kda_recurrent(q, k, v, per_head[..., None].expand_as(decay), beta, s0)
    o_ref, s_ref = gated_delta_rule_recurrent(q, k, v, per_head, beta, s0)
    torch.testing.assert_close(o, o_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(s, s_ref, atol=1e-12, rtol=0)


def test_kda_matches_transformers_kernels():
    """fp32, against transformers' own chunked and recurrent KDA (which normalise and scale q, k inside)."""
    from transformers.models.kimi_linear import modeling_kimi_linear as mk

    g = torch.Generator().manual_seed(2)
    B, T, H, d = 2, 29, 3, 8
    q, k, v = (torch.randn(B, T, H, d, generator=g) for _ in range(3))
    decay = -2 * torch.rand(B, T, H, d, generator=g)
    beta = torch.rand(B, T, H, generator=g)
    s0 = torch.randn(B, H, d, d, generator=g)
    qn, kn = (mk.l2norm(q) * d ** -0.5).transpose(1, 2), mk.l2norm(k).transpose(1, 2)
    args = (qn, kn, v.transpose(1, 2), decay.transpose(1, 2), beta.transpose(1, 2), s0)
    with torch.no_grad():
        ref, ref_s = mk.chunk_kimi_delta_attention(q, k, v, decay, beta, chunk_size=8, initial_state=s0,
                                                   output_final_state=True, use_qk_l2norm_in_kernel=True)
        o, s = kda_chunked(*args, chunk_size=16)
        torch.testing.assert_close(o.transpose(1, 2), ref, atol=1e-5, rtol=0)
        torch.testing.assert_close(s, ref_s, atol=1e-5, rtol=0)
        one = [t[:, :1] for t in (q, k, v, decay, beta)]
        ref1, ref1_s = mk.recurrent_kimi_delta_attention(*one, initial_state=s0, output_final_state=True,
                                                         use_qk_l2norm_in_kernel=True)
        o1, s1 = kda_recurrent(*(t[:, :, :1] for t in args[:5]), s0)
        torch.testing.assert_close(o1.transpose(1, 2), ref1, atol=1e-5, rtol=0)
        torch.testing.assert_close(s1, ref1_s, atol=1e-5, rtol=0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="chunk_size"):
        kda_chunked(*_inputs()[:5], chunk_size=0)
    with pytest.raises(ValueError, match="hidden_act"):
        KimiDeltaAttention(16, 2, 4, 4, 0, activation="gelu")
    base = {"model_type": "kimi_linear", "vocab_size": 8, "hidden_size": 16, "num_hidden_layers": 3,
            "num_attention_heads": 2}
    with pytest.raises(ValueError, match="kda_layers"):
        dm.ModelConfig.from_dict({**base, "linear_attn_config": {"full_attn_layers": [3], "kda_layers": [0, 1]}})
    with pytest.raises(ValueError, match="every layer"):
        dm.ModelConfig.from_dict({**base, "linear_attn_config": {"full_attn_layers": [3], "kda_layers": [1]}})


# ------------------------------------------------------------------------------ the model
def test_structure_and_cache(pair):
    name, hf, ours, _ = pair
    assert isinstance(ours, KimiLinearForCausalLM) and type(ours).recurrent_state is True
    assert [type(layer.self_attn) for layer in ours.model.layers] == [
        KimiDeltaAttention, MLAttention, KimiDeltaAttention, KimiDeltaAttention, MLAttention]
    assert [type(layer.mlp) for layer in ours.model.layers] == [GatedMLP] + [SparseMoeBlock] * 4
    assert ours.model.rotary_emb is None and all(layer.self_attn.rotary is None for layer in ours.model.layers
                                                 if isinstance(layer.self_attn, MLAttention))
    assert hasattr(ours.model.layers[1].self_attn, "q_a_proj") == (name == "q_lora")
    for _, block in ours.moe_layers():
        gate = block.moe.config.gates[0]
        assert (gate.type, gate.route_scale, gate.normalize) == ("sigmoid", 2.446, name == "q_proj")
        assert (gate.n_group, gate.topk_group) == ((4, 2) if name == "q_lora" else (1, 1))
        assert block.moe.shared_experts.gate_proj.out_features == 32 * (2 if name == "q_lora" else 1)
    kda = ours.model.layers[0].self_attn
    assert kda.dt_bias.dtype == torch.float32 and tuple(kda.A_log.shape) == (1, 1, 4, 1)
    K = 3 if name == "q_lora" else 4
    assert ours.config.kv_elements_per_position() == 2 * (32 + 8)   # the two MLA layers' latent and key
    with torch.no_grad():
        cache = ours.new_cache(3, 16)
        ours(ids(rows=1, tokens=2), cache=cache)
    shapes = [{k: tuple(v.shape) for k, v in layer.items()} for layer in cache.layers]
    assert shapes[0] == {"conv_state": (3, 96, K - 1), "recurrent_state": (3, 4, 8, 8), "state_position": (3,)}
    assert shapes[1] == {"latent": (1, 3, 16, 32), "k_rope": (1, 3, 16, 8)}   # [1 head, 3 blocks of 16, dim]
    sizes = {n: sum(layer[n][0].numel() for layer in cache.layers if n in layer) for n in ("conv_state", "recurrent_state")}
    assert ours.config.state_elements_per_sequence() == sizes == {"conv_state": 3 * 96 * (K - 1),
                                                                  "recurrent_state": 3 * 4 * 8 * 8}


def test_logits_match_transformers(pair):
    _, hf, ours, _ = pair
    check_logits(hf, ours, ids())


def test_group_limited_routing_differs_from_plain_topk(pair):
    name, hf, _, _ = pair
    check_group_routing_differs(hf, ids(), expect_differ=name == "q_lora")


def test_greedy_matches_generate(pair):
    _, hf, ours, _ = pair
    check_greedy(hf, ours, ids(seed=1), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[2], ids(seed=2), prefill=9)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[2])


def test_absorbed_and_expanded_mla_agree(pair):
    check_absorption(pair[2], ids(seed=3))


def test_chunked_prefill_and_chunk_length(pair):
    """Three prefill chunks (one shorter than the conv window) give the one-pass logits and states; a
    delta-rule chunk of 5 tokens gives the logits of one chunk."""
    ours = pair[2]
    x = ids(rows=1, tokens=30, seed=4)
    with torch.no_grad():
        one = ours.new_cache(1, 40)
        full = ours(x[:, :28], cache=one)
        three = ours.new_cache(1, 40)
        parts = [ours(x[:, a:b], cache=three) for a, b in ((0, 13), (13, 15), (15, 28))]
        torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-4, rtol=0)
        for i in (0, 2, 3):
            for n in ("conv_state", "recurrent_state"):
                torch.testing.assert_close(three.layers[i][n][0], one.layers[i][n][0], atol=1e-4, rtol=0)
        torch.testing.assert_close(ours(x[:, 28:], cache=three), ours(x[:, 28:], cache=one), atol=1e-4, rtol=0)
        short = copy.deepcopy(ours)
        for layer in short.model.layers:
            if isinstance(layer.self_attn, KimiDeltaAttention):
                layer.self_attn.chunk_size = 5
        torch.testing.assert_close(short(ids(seed=5)), ours(ids(seed=5)), atol=1e-4, rtol=0)


def test_rows_at_different_positions_and_reused_slots(pair):
    """One forward of two rows: one starts a new sequence in a slot whose buffers hold junk, the other
    continues at position 11; each row equals the row run alone. Continuing a truncated slot is an error."""
    ours = pair[2]
    a, b = ids(rows=1, tokens=5, seed=6), ids(rows=1, tokens=16, seed=7)
    with torch.no_grad():
        alone_a, alone_b = ours(a), ours(b)[:, 11:]
        cache = ours.new_cache(3, 32)
        ours(b[:, :11], cache=cache, slots=torch.tensor([0]))
        ours(ids(rows=1, tokens=7, seed=8), cache=cache, slots=torch.tensor([2]))
        for layer in cache.layers:
            for name, t in layer.items():
                if name in ("conv_state", "recurrent_state"):
                    t[2].fill_(1e3)
        cache.free(2)
        together = ours(torch.cat([a, b[:, 11:]]), cache=cache, slots=torch.tensor([2, 0]))
        torch.testing.assert_close(together, torch.cat([alone_a, alone_b]), atol=1e-4, rtol=0)
        cache.truncate(0, 5)
        with pytest.raises(ValueError, match="reached position 16, but its row starts at position 5"):
            ours(b[:, 5:6], cache=cache, slots=torch.tensor([0]))


def _hub_checkpoint(path, dst, layers=LAYERS) -> None:
    """The tiny checkpoint as the hub publishes Kimi-Linear: config.json with linear_attn_config (1-based
    layer lists, its sizes only there), first_k_dense_replace instead of mlp_layer_types, and the dense
    layer's MLP under ``mlp.``."""
    os.makedirs(dst)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    lac = {"full_attn_layers": [i + 1 for i, t in enumerate(layers) if t == "full_attention"],
           "kda_layers": [i + 1 for i, t in enumerate(layers) if t == "linear_attention"],
           "head_dim": cfg.pop("linear_head_dim"), "num_heads": cfg.pop("linear_num_heads"),
           "short_conv_kernel_size": cfg.pop("linear_conv_kernel_dim")}
    for k in ("layer_types", "mlp_layer_types", "head_dim", "qk_head_dim"):
        cfg.pop(k)
    cfg.update(linear_attn_config=lac, first_k_dense_replace=1)
    with open(os.path.join(dst, "config.json"), "w") as f:
        json.dump(cfg, f)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    renamed = {k.replace("layers.0.block_sparse_moe.", "layers.0.mlp."): v for k, v in tensors.items()}
    assert renamed.keys() != tensors.keys()
    save_file(renamed, os.path.join(dst, "model.safetensors"))


def test_hub_layout_loads_the_same_model(pair, tmp_path):
    _, hf, ours, path = pair
    _hub_checkpoint(path, tmp_path / "hub")
    with open(tmp_path / "hub" / "config.json") as f:
        hub_cfg = json.load(f)
    hf_cfg = transformers.KimiLinearConfig(**{k: v for k, v in hub_cfg.items() if k != "model_type"})
    assert list(hf_cfg.layer_types) == LAYERS      # transformers reads the hub config so too
    model = dm.load(tmp_path / "hub", progress=False)
    assert model.config.layer_types == tuple(LAYERS) and model.dense_mlp_prefix == "mlp"
    assert model.config.linear_conv_kernel_dim == ours.config.linear_conv_kernel_dim
    with torch.no_grad():
        torch.testing.assert_close(model(ids()), ours(ids()), atol=0, rtol=0)


def test_bf16_tracks_transformers_bf16(pair):
    """bf16 weights: dt_bias and the recurrent state stay fp32, cached decode runs, and the logits are on
    average no further from the fp32 ones than transformers' own bf16 logits are (the mean: these random
    layers amplify rounding, and one routing flip moves a few logits by ~1 either way)."""
    _, hf, _, path = pair
    ours = dm.load(path, dtype="bfloat16", progress=False)
    # transformers' own loader: dt_bias, the router weight and its bias stay fp32 (_keep_in_fp32_modules_strict)
    hf16 = transformers.KimiLinearForCausalLM.from_pretrained(path, dtype=torch.bfloat16).eval()
    x = ids(seed=2)
    with torch.no_grad():
        ref32 = hf(x).logits
        hf_err = (hf16(x).logits.float() - ref32).abs().mean()
        full = ours(x)
        cache = ours.new_cache(2, 32)
        steps = [ours(x[:, :9], cache=cache)] + [ours(x[:, t:t + 1], cache=cache) for t in range(9, 24)]
    assert full.dtype == torch.bfloat16 and ours.model.layers[0].self_attn.dt_bias.dtype == torch.float32
    assert cache.layers[0]["recurrent_state"].dtype == torch.float32
    assert (full.float() - ref32).abs().mean() <= 1.5 * hf_err
    assert (torch.cat(steps, 1).float() - ref32).abs().mean() <= 1.5 * hf_err


def test_engine_generates_each_requests_own_continuation(pair):
    """dynamoe's engine with 2 slots for 3 requests (prefix reuse is off for recurrent-state models):
    chunked prefill, rows at different positions and a reused slot give each request its own greedy tokens."""
    from dynamoe.engine import GenerationEngine
    from dynamoe.engine.sampling import SamplingParams
    from models_util import greedy

    ours = pair[2]
    prompts = [ids(rows=1, tokens=n, seed=20 + n)[0].tolist() for n in (7, 13, 4)]
    engine = GenerationEngine(ours, None, max_seq_len=64, max_batch=2, prefill_chunk=5)
    requests = [engine.add_request(p, SamplingParams(temperature=0.0), max_tokens=8, ignore_eos=True) for p in prompts]
    engine.run_until_done(requests)
    for p, r in zip(prompts, requests):
        assert r.output_ids == greedy(ours, torch.tensor([p]), 8)[0, len(p):].tolist()
