"""Qwen3-Next and Qwen3.5-MoE (text) against transformers on tiny random checkpoints: hybrid layers
(Gated DeltaNet linear attention and gated full attention), zero-centred norms, softmax top-k with a
sigmoid-gated shared expert, partial RoPE; and the recurrent state in the cache -- chunked prefill,
decode, rows at different positions in one batch, a reused slot starting from zero, the MTP head."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import (VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_,
                         save_tiny)
from models_util import ids as _ids

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.linear_attention import (GatedDeltaNet, causal_conv1d, gated_delta_rule_chunked,  # noqa: E402
                                             gated_delta_rule_recurrent, l2norm)
from dynamoe.models.moe_block import GatedMLP  # noqa: E402
from dynamoe.models.qwen3_next import GatedAttention, SharedExpertMoeBlock  # noqa: E402

LAYERS = ["linear_attention", "full_attention", "linear_attention", "full_attention"]
SIZES = dict(vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48,
             num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
             linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12, num_experts=8,
             num_experts_per_tok=2, layer_types=LAYERS, max_position_embeddings=256, bos_token_id=None,
             eos_token_id=None)


# transformers' own fp32 logits differ from its fp64 ones by up to ~3e-4 on these models at the logit scale
# (~12) that N(0, 0.2) weights give: a smaller lm_head (logits ~3, hidden states as random as ever) keeps
# an absolute 1e-4 a test of the model rather than of fp32 rounding
SCALES = {"lm_head": 0.05}


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    # layer 2 dense (mlp_only_layers): both MLP kinds, both mixers
    cfg = transformers.Qwen3NextConfig(**SIZES, intermediate_size=96, mlp_only_layers=[2])
    torch.manual_seed(0)
    hf = transformers.Qwen3NextForCausalLM(cfg).eval()
    randomize_(hf, seed=1, scales=SCALES)
    path = save_tiny(hf, tmp_path_factory.mktemp("qwen3_next"))
    return hf, dm.load(path, progress=False), path


# ------------------------------------------------------------------------------ the ops
@pytest.mark.parametrize("chunk", [1, 5, 16, 64])
def test_chunked_delta_rule_equals_recurrent(chunk):
    """fp64: the chunked form is the recurrence, not an approximation (with and without a start state)."""
    g = torch.Generator().manual_seed(0)
    B, H, T, dk, dv = 2, 3, 37, 8, 6
    q = l2norm(torch.randn(B, H, T, dk, generator=g, dtype=torch.float64)) * dk ** -0.5
    k = l2norm(torch.randn(B, H, T, dk, generator=g, dtype=torch.float64))
    v = torch.randn(B, H, T, dv, generator=g, dtype=torch.float64)
    decay = -2 * torch.rand(B, H, T, generator=g, dtype=torch.float64)
    beta = torch.rand(B, H, T, generator=g, dtype=torch.float64)
    for s0 in (None, torch.randn(B, H, dk, dv, generator=g, dtype=torch.float64)):
        o_ref, s_ref = gated_delta_rule_recurrent(q, k, v, decay, beta, s0)
        o, s = gated_delta_rule_chunked(q, k, v, decay, beta, s0, chunk_size=chunk)
        assert o.dtype == torch.float64 and o.shape == (B, H, T, dv) and s.shape == (B, H, dk, dv)
        torch.testing.assert_close(o, o_ref, atol=1e-12, rtol=0)
        torch.testing.assert_close(s, s_ref, atol=1e-12, rtol=0)
    # the state carries over: two calls equal one
    o1, s1 = gated_delta_rule_chunked(q[:, :, :20], k[:, :, :20], v[:, :, :20], decay[:, :, :20], beta[:, :, :20],
                                      chunk_size=chunk)
    o2, s2 = gated_delta_rule_chunked(q[:, :, 20:], k[:, :, 20:], v[:, :, 20:], decay[:, :, 20:], beta[:, :, 20:],
                                      s1, chunk_size=chunk)
    o_ref, s_ref = gated_delta_rule_recurrent(q, k, v, decay, beta)
    torch.testing.assert_close(torch.cat([o1, o2], 2), o_ref, atol=1e-12, rtol=0)
    torch.testing.assert_close(s2, s_ref, atol=1e-12, rtol=0)


def test_causal_conv_state_continues():
    g = torch.Generator().manual_seed(1)
    x = torch.randn(2, 5, 11, generator=g, dtype=torch.float64)
    w = torch.randn(5, 4, generator=g, dtype=torch.float64)
    whole, end = causal_conv1d(x, w)
    ref = torch.nn.functional.conv1d(x, w[:, None], padding=3, groups=5)[..., :11]
    torch.testing.assert_close(whole, ref, atol=1e-12, rtol=0)
    state, parts = None, []
    for a, b in ((0, 2), (2, 3), (3, 9), (9, 11)):  # chunks shorter and longer than the window
        y, state = causal_conv1d(x[..., a:b], w, state)
        parts.append(y)
    torch.testing.assert_close(torch.cat(parts, -1), whole, atol=1e-12, rtol=0)
    torch.testing.assert_close(state, end, atol=0, rtol=0)
    torch.testing.assert_close(end, x[..., -3:], atol=0, rtol=0)


def test_bad_arguments():
    with pytest.raises(ValueError, match="chunk_size"):
        gated_delta_rule_chunked(*(torch.zeros(1, 1, 2, 2) for _ in range(3)), torch.zeros(1, 1, 2),
                                 torch.zeros(1, 1, 2), chunk_size=0)
    with pytest.raises(ValueError, match="linear_num_value_heads"):
        GatedDeltaNet(16, 3, 4, 4, 4, 4, 0)
    with pytest.raises(ValueError, match="projection"):
        GatedDeltaNet(16, 2, 4, 4, 4, 4, 0, projection="fused")
    with pytest.raises(ValueError, match="layer_types"):
        dm.ModelConfig.from_dict({"model_type": "qwen3_next", "vocab_size": 8, "hidden_size": 16, "num_hidden_layers": 2,
                                  "num_attention_heads": 2, "layer_types": ["linear_attention", "mamba"]})


# ------------------------------------------------------------------------------ the model
def test_structure(pair):
    hf, ours, _ = pair
    assert type(ours).recurrent_state is True
    mixers = [type(layer.mixer) for layer in ours.model.layers]
    assert mixers == [GatedDeltaNet, GatedAttention, GatedDeltaNet, GatedAttention]
    assert [type(layer.mlp) for layer in ours.model.layers] == [SharedExpertMoeBlock, SharedExpertMoeBlock, GatedMLP,
                                                                SharedExpertMoeBlock]
    assert ours.model.norm.zero_centered and ours.model.layers[1].self_attn.q_norm.zero_centered
    assert ours.model.rotary_emb.inv_freq.numel() * 2 == 4  # RoPE on a quarter of the 16 head dims
    assert not hasattr(ours, "mtp")  # transformers saves no MTP tensors
    # the cache sizing counts only the full-attention layers' keys and values
    assert ours.config.kv_elements_per_position() == 2 * 2 * 2 * 16
    with torch.no_grad():
        cache = ours.new_cache(3, 8)
        ours(_ids(rows=1, tokens=2), cache=cache)
    sizes = {name: sum(layer[name][0].numel() for layer in cache.layers if name in layer)
             for name in ("conv_state", "recurrent_state")}
    assert ours.config.state_elements_per_sequence() == sizes == {"conv_state": 2 * 80 * 3,
                                                                  "recurrent_state": 2 * 4 * 8 * 12}


def test_logits_match_transformers(pair):
    hf, ours, _ = pair
    check_logits(hf, ours, _ids())


def test_greedy_matches_generate(pair):
    hf, ours, _ = pair
    check_greedy(hf, ours, _ids(seed=1), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[1], _ids(seed=2), prefill=9)


def _states(cache, slot):
    return {(i, name): t[slot].clone() for i, layer in enumerate(cache.layers) for name, t in layer.items()
            if name in ("conv_state", "recurrent_state")}


def test_chunked_prefill_equals_one_pass(pair):
    """Three prefill chunks (one shorter than the conv window) give the one-pass logits and leave the
    same conv and recurrent states; decoding on from either gives the same tokens' logits."""
    ours = pair[1]
    ids = _ids(rows=1, tokens=30, seed=3)
    with torch.no_grad():
        one = ours.new_cache(1, 40)
        full = ours(ids[:, :28], cache=one)
        three = ours.new_cache(1, 40)
        parts = [ours(ids[:, a:b], cache=three) for a, b in ((0, 13), (13, 15), (15, 28))]
        torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-4, rtol=0)
        s1, s3 = _states(one, 0), _states(three, 0)
        assert len(s1) == 4  # two linear-attention layers, two states each
        for key in s1:
            torch.testing.assert_close(s3[key], s1[key], atol=1e-4, rtol=0)
        torch.testing.assert_close(ours(ids[:, 28:], cache=three), ours(ids[:, 28:], cache=one), atol=1e-4, rtol=0)


def test_chunk_length_does_not_change_the_logits(pair):
    """The model's prefill crosses chunk boundaries of the delta rule (chunks of 5 over 24 tokens) and
    gives the logits of one chunk."""
    import copy

    ours = copy.deepcopy(pair[1])
    for layer in ours.model.layers:
        if hasattr(layer, "linear_attn"):
            layer.linear_attn.chunk_size = 5
    ids = _ids(seed=4)
    with torch.no_grad():
        torch.testing.assert_close(ours(ids), pair[1](ids), atol=1e-4, rtol=0)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[1])


def _junk_(cache, slot=None):
    """Fill the buffers (of one slot, or all) with large values: a fresh sequence must never read them."""
    for layer in cache.layers:
        for t in layer.values():
            if slot is None:
                t.fill_(1e3)
            elif any(t is p for p in cache._paged):   # a paged KV tensor [K, blocks, block_size, d]: the slot's blocks
                t[:, cache.blocks(slot)] = 1e3
            else:                                     # per-slot state [slots, ...]
                t[slot].fill_(1e3)


def test_rows_at_different_positions_in_one_chunk(pair):
    """One forward of T = 5 tokens for two rows: one starts a new sequence in a slot whose buffers hold
    junk, the other continues its prompt at position 11; each row equals the row run alone."""
    ours = pair[1]
    a, b = _ids(rows=1, tokens=5, seed=4), _ids(rows=1, tokens=16, seed=5)
    with torch.no_grad():
        alone_a = ours(a)
        alone_b = ours(b)[:, 11:]
        cache = ours.new_cache(3, 32)
        ours(b[:, :11], cache=cache, slots=torch.tensor([0]))
        ours(_ids(rows=1, tokens=7, seed=6), cache=cache, slots=torch.tensor([2]))
        _junk_(cache, 2)
        cache.free(2)
        together = ours(torch.cat([a, b[:, 11:]]), cache=cache, slots=torch.tensor([2, 0]))
    assert cache.lengths.tolist() == [16, 0, 5]
    torch.testing.assert_close(together, torch.cat([alone_a, alone_b]), atol=1e-4, rtol=0)


def test_reused_slot_starts_from_zero_state(pair):
    """A slot freed after one sequence (its buffers left as they were, and then filled with junk) gives
    the next sequence exactly what a fresh cache gives: prefill and decode."""
    ours = pair[1]
    first, second = _ids(rows=1, tokens=12, seed=7), _ids(rows=1, tokens=9, seed=8)
    with torch.no_grad():
        fresh = ours.new_cache(1, 32)
        want = [ours(second, cache=fresh)] + [ours(second[:, t:t + 1], cache=fresh) for t in range(3)]
        cache = ours.new_cache(1, 32)
        ours(first, cache=cache)
        ours(first[:, :1], cache=cache)
        cache.free(0)
        got_prefill = ours(second, cache=cache)
        cache2 = ours.new_cache(1, 32)
        ours(first, cache=cache2)
        _junk_(cache2)
        cache2.free(0)
        got = [ours(second, cache=cache2)] + [ours(second[:, t:t + 1], cache=cache2) for t in range(3)]
    torch.testing.assert_close(got_prefill, want[0], atol=0, rtol=0)
    for g, w in zip(got, want):
        torch.testing.assert_close(g, w, atol=0, rtol=0)


def test_mtp_tensors_load_into_a_module(pair, tmp_path):
    """A checkpoint with mtp.* tensors (as the published ones have) loads them into ``model.mtp``: every
    tensor read and in place; a config that disagrees about the layer count is an error."""
    hf, ours, path = pair
    for name in os.listdir(path):
        if name != "model.safetensors":
            os.symlink(os.path.join(path, name), tmp_path / name)
    tensors = load_file(os.path.join(path, "model.safetensors"))
    g = torch.Generator().manual_seed(9)
    layer1 = {k[len("model.layers.1."):]: v for k, v in tensors.items() if k.startswith("model.layers.1.")}
    mtp = {f"mtp.layers.0.{k}": torch.randn(v.shape, generator=g) for k, v in layer1.items()}
    mtp.update({"mtp.fc.weight": torch.randn(64, 128, generator=g), "mtp.norm.weight": torch.randn(64, generator=g),
                "mtp.pre_fc_norm_embedding.weight": torch.randn(64, generator=g),
                "mtp.pre_fc_norm_hidden.weight": torch.randn(64, generator=g)})
    save_file({**tensors, **mtp}, str(tmp_path / "model.safetensors"))
    model = dm.load(tmp_path, progress=False)
    assert len(model.mtp.layers) == 1
    ours_by_checkpoint = {model.checkpoint_name(n): p for n, p in model.named_parameters()}
    experts = model.mtp.layers[0].mlp.moe.experts
    for name, t in mtp.items():
        if ".mlp.experts." in name:  # per-expert tensors sit in the stacked [E, 2F, D] / [E, D, F] weights
            e, proj = name.split(".mlp.experts.")[1].split(".")[:2]
            w = {"gate_proj": experts.gate_up_proj[int(e), :32], "up_proj": experts.gate_up_proj[int(e), 32:],
                 "down_proj": experts.down_proj[int(e)]}[proj]
        else:
            w = ours_by_checkpoint[name]
        assert torch.equal(w, t), name
    with torch.no_grad():  # plain decoding does not run it
        torch.testing.assert_close(model(_ids()), ours(_ids()), atol=0, rtol=0)
    with open(os.path.join(path, "config.json")) as f:
        cfg = json.load(f)
    os.remove(tmp_path / "config.json")
    with open(tmp_path / "config.json", "w") as f:
        json.dump({**cfg, "mtp_num_hidden_layers": 2}, f)
    with pytest.raises(ValueError, match="mtp_num_hidden_layers"):
        dm.load(tmp_path, progress=False)



# ------------------------------------------------------------------------------ Qwen3.5-MoE (text)
def _qwen3_5(kind):
    text = {k: v for k, v in SIZES.items() if k != "layer_types"}  # from full_attention_interval: 3 linear, 1 full
    if kind == "text":
        return transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**text))
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4,
                  num_position_embeddings=16)
    return transformers.Qwen3_5MoeForConditionalGeneration(transformers.Qwen3_5MoeConfig(text_config=text,
                                                                                         vision_config=vision))


@pytest.fixture(scope="module", params=["text", "multimodal"])
def pair35(request, tmp_path_factory):
    """Qwen3_5MoeForCausalLM (model_type qwen3_5_moe_text, names model.layers.*) and the multimodal
    Qwen3_5MoeForConditionalGeneration (qwen3_5_moe with a text_config, names model.language_model.*, a
    vision tower under model.visual.*)."""
    torch.manual_seed(0)
    hf = _qwen3_5(request.param).eval()
    randomize_(hf, seed=1, scales=SCALES)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"qwen3_5_{request.param}"))
    return request.param, hf, dm.load(path, progress=False)


def test_qwen3_5_structure(pair35):
    kind, _, ours = pair35
    assert type(ours).__name__ == "Qwen3_5MoeForCausalLM" and type(ours).recurrent_state is True
    assert ours.config.text_config_nested == (kind == "multimodal")
    assert [type(layer.mixer) for layer in ours.model.layers] == [GatedDeltaNet] * 3 + [GatedAttention]
    assert all(layer.linear_attn.projection == "split" for layer in ours.model.layers[:3])
    assert all(type(layer.mlp) is SharedExpertMoeBlock and layer.mlp.moe.config.gates[0].normalize
               for layer in ours.model.layers)


def test_qwen3_5_logits_match_transformers(pair35):
    _, hf, ours = pair35
    check_logits(hf, ours, _ids())


def test_qwen3_5_greedy_matches_generate(pair35):
    _, hf, ours = pair35
    check_greedy(hf, ours, _ids(seed=1), new_tokens=32)


def test_qwen3_5_cached_decode_equals_recompute(pair35):
    check_cached_decode(pair35[2], _ids(seed=2), prefill=9)


def test_bf16_tracks_transformers_bf16(pair):
    """bf16 weights: the recurrent state stays fp32 (the conv window in the cache's dtype), cached decode
    runs, and the logits are no further from the fp32 ones than transformers' own bf16 logits are (these
    random layers amplify rounding: both are ~1 off at logit scale 3)."""
    import copy

    hf, ours32, path = pair
    ours = dm.load(path, dtype="bfloat16", progress=False)
    ids = _ids(seed=2)
    with torch.no_grad():
        ref32, hf16 = hf(ids).logits, copy.deepcopy(hf).to(torch.bfloat16)(ids).logits.float()
        full = ours(ids)
        cache = ours.new_cache(2, 32)
        steps = [ours(ids[:, :9], cache=cache)] + [ours(ids[:, t:t + 1], cache=cache) for t in range(9, 24)]
    assert full.dtype == torch.bfloat16
    assert cache.layers[0]["recurrent_state"].dtype == torch.float32
    assert cache.layers[0]["conv_state"].dtype == torch.bfloat16
    ours_err, hf_err = (full.float() - ref32).abs().max(), (hf16 - ref32).abs().max()
    assert ours_err <= 1.5 * hf_err, (ours_err, hf_err)
    assert (torch.cat(steps, 1).float() - ref32).abs().max() <= 1.5 * hf_err


def test_truncated_slot_is_an_error(pair):
    """Continuing a slot from any position but the one its state reached (KVCache.truncate, as prefix
    reuse does) is a clear error, not a silently wrong state; position 0 starts afresh."""
    ours = pair[1]
    ids = _ids(rows=1, tokens=12, seed=10)
    with torch.no_grad():
        cache = ours.new_cache(2, 32)
        ours(ids, cache=cache)
        cache.truncate(0, 5)
        with pytest.raises(ValueError, match="reached position 12, but its row starts at position 5"):
            ours(ids[:, 5:], cache=cache)
        ours(ids[:, :1], cache=cache, slots=torch.tensor([1]))
        cache.lengths[1] = 3  # a slot moved by hand: the same
        with pytest.raises(ValueError, match="slot 1 .* reached position 1, but its row starts at position 3"):
            ours(ids[:, :1], cache=cache, slots=torch.tensor([1]))
        cache.truncate(0, 0)
        torch.testing.assert_close(ours(ids, cache=cache), ours(ids), atol=1e-4, rtol=0)


def test_engine_generates_each_requests_own_continuation(pair):
    """dynamoe's engine (prefix reuse off, as this model needs: recurrent_state) with 2 slots for 3
    requests: chunked prefill, decoding rows at different positions together and a slot reused by the
    third request give each request the greedy continuation it gets alone."""
    from dynamoe.engine import GenerationEngine
    from dynamoe.engine.sampling import SamplingParams
    from models_util import greedy

    ours = pair[1]
    prompts = [_ids(rows=1, tokens=n, seed=20 + n)[0].tolist() for n in (7, 13, 4)]
    engine = GenerationEngine(ours, None, max_seq_len=64, max_batch=2, prefill_chunk=5, prefix_caching=False)
    requests = [engine.add_request(p, SamplingParams(temperature=0.0), max_tokens=8, ignore_eos=True) for p in prompts]
    engine.run_until_done(requests)
    for p, r in zip(prompts, requests):
        assert r.output_ids == greedy(ours, torch.tensor([p]), 8)[0, len(p):].tolist()
