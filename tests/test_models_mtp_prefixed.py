"""Multi-token-prediction heads kept under a prefix of their own (dynamoe.models.mtp_prefixed) on tiny random
checkpoints: transformers saves none, so each family's MTP tensors are written beside its tensors with the hub's
names and shapes. Per family: every tensor loads (none dropped), the model's own output is unchanged, the head's
cached, batched drafts equal a from-scratch float64 recomputation written from the reference architecture (vLLM's
*_mtp.py), the engine's greedy tokens with draft='mtp' are plain decoding's (batched, prompts sharing a prefix,
mostly rejected drafts), and a head built to predict the model's next token is accepted nearly always. For the
hybrid Qwen3-Next / Qwen3.5 (Gated DeltaNet state per sequence): the state rolls back past rejected drafts. The
multimodal checkpoints' layouts (Qwen3.5's, MiniMax-M3's hub layout under language_model.) load their heads too."""
import copy
import json
import logging
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from models_util import check_mtp_drafts, one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, randomize_, save_tiny

import transformers

import dynamoe.models as dm  # noqa: E402
from dynamoe.engine import GenerationEngine, SamplingParams  # noqa: E402

GREEDY = SamplingParams(temperature=0)

QWEN = dict(vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, shared_expert_intermediate_size=48,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=12, num_experts=8,
            num_experts_per_tok=2, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
            layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"])


def _qwen3_next():
    return transformers.Qwen3NextForCausalLM(transformers.Qwen3NextConfig(**QWEN, intermediate_size=96))


def _qwen3_5():
    return transformers.Qwen3_5MoeForCausalLM(transformers.Qwen3_5MoeTextConfig(**QWEN))


MIMO = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
            num_attention_heads=4, num_key_value_heads=1, n_routed_experts=8, num_experts_per_tok=2, head_dim=24,
            v_head_dim=16, sliding_window=6, max_position_embeddings=256, bos_token_id=None, eos_token_id=None,
            layer_types=["full_attention", "sliding_attention", "sliding_attention", "full_attention"])


def _mimo():
    return transformers.MiMoV2FlashForCausalLM(transformers.MiMoV2FlashConfig(**MIMO))


EXAONE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=4,
              num_attention_heads=4, num_key_value_heads=2, head_dim=16, num_experts=8, num_experts_per_tok=2,
              max_position_embeddings=256, pad_token_id=None, bos_token_id=None, eos_token_id=None,
              sliding_window=6, sliding_window_pattern=2)   # layers 0, 2 slide with RoPE, 1, 3 global without


def _exaone():
    return transformers.ExaoneMoeForCausalLM(transformers.ExaoneMoeConfig(**EXAONE))


MINIMAX = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=12, dense_intermediate_size=40,
               shared_intermediate_size=24, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
               head_dim=16, num_local_experts=4, num_experts_per_tok=2, routed_scaling_factor=1.5,
               layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
               mlp_layer_types=["dense", "sparse", "sparse"], index_n_heads=2, index_head_dim=24, index_block_size=4,
               index_topk_blocks=2, index_local_blocks=1, max_position_embeddings=256, bos_token_id=None,
               eos_token_id=None)


def _minimax():
    return transformers.MiniMaxM3VLForCausalLM(transformers.MiniMaxM3VLTextConfig(**MINIMAX))


def _rms(x, w, eps):
    """RMSNorm: x / rms(x) * w."""
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def _zc_rms(x, w, eps):
    """Qwen's zero-centred RMSNorm: x / rms(x) * (1 + w)."""
    return _rms(x, 1 + w, eps)


def _randn_like(t: torch.Tensor, g: torch.Generator, norm: bool, zero_centred: bool) -> torch.Tensor:
    noise = 0.2 * torch.randn(t.shape, generator=g)
    return (noise if zero_centred or not norm else 1 + noise).to(t.dtype)


def _copy_layer(tensors: dict, src: str, dst: str, g: torch.Generator, zero_centred: bool, renames=()) -> dict:
    """Random tensors named and shaped as those under ``src``, under ``dst`` (``renames``: (old, new) substrings)."""
    out = {}
    for k, t in tensors.items():
        if k.startswith(src):
            name = dst + k[len(src):]
            for a, b in renames:
                name = name.replace(a, b)
            out[name] = _randn_like(t, g, "norm" in k, zero_centred)
    return out


# ---- the fc layout (Qwen3-Next, Qwen3.5; vllm qwen3_next_mtp.py / qwen3_5_mtp.py) --------------------------------
def _fc_tensors(tensors: dict, g: torch.Generator, layer: int, zero_centred: bool = True, dense_from: int | None = None
                ) -> dict:
    """mtp.{fc, pre_fc_norm_embedding, pre_fc_norm_hidden, norm} and mtp.layers.0, shaped like the main model's
    layer ``layer`` (the MLP like ``dense_from``'s when given: a dense one)."""
    D = tensors["model.embed_tokens.weight"].shape[1]
    out = _copy_layer(tensors, f"model.layers.{layer}.", "mtp.layers.0.", g, zero_centred)
    if dense_from is not None:
        out = {k: v for k, v in out.items() if ".mlp." not in k}
        out.update(_copy_layer(tensors, f"model.layers.{dense_from}.mlp.", "mtp.layers.0.mlp.", g, zero_centred))
    out["mtp.fc.weight"] = 0.2 * torch.randn(D, 2 * D, generator=g)
    for n in ("pre_fc_norm_embedding", "pre_fc_norm_hidden", "norm"):
        out[f"mtp.{n}.weight"] = 0.2 * torch.randn(D, generator=g) + (0 if zero_centred else 1)
    return out


def _fc_step(norm):
    """The head's (normed) output at every position, as vLLM's Qwen3NextMultiTokenPredictor / ExaoneMoeMultiToken-
    Predictor write it: norm(layer(fc([pre_fc_norm_embedding(embed(next)) ; pre_fc_norm_hidden(h)])))."""
    def step(model, nxt: torch.Tensor, hid: torch.Tensor) -> torch.Tensor:
        m, eps = model.mtp, model.config.rms_norm_eps
        e = model.model.embed_tokens.weight[nxt]
        x = torch.cat([norm(e, m.pre_fc_norm_embedding.weight, eps), norm(hid, m.pre_fc_norm_hidden.weight, eps)],
                      -1) @ m.fc.weight.T
        g = norm(m.layers[0](x[None], torch.arange(len(nxt))[None])[0], m.norm.weight, eps)
        return g, g
    return step


def _fc_exact(one: float):
    """fc = [I, 0], the embedding's norm scaling by 1 (weight ``one``), ``mtp.norm`` the model's final norm."""
    def edit(t: dict) -> None:
        D = t["model.embed_tokens.weight"].shape[1]
        t["mtp.fc.weight"] = torch.cat([torch.eye(D), torch.zeros(D, D)], 1)
        t["mtp.pre_fc_norm_embedding.weight"] = torch.full((D,), one)
        t["mtp.norm.weight"] = t["model.norm.weight"].clone()
    return edit


# ---- the per-depth eh_proj layout (MiMo-V2-Flash; vllm mimo_v2_mtp.py) ---------------------------------------------
def _eh_tensors(tensors: dict, g: torch.Generator) -> dict:
    """model.mtp.layers.0.{enorm, hnorm, eh_proj, input_layernorm, self_attn (a sliding layer's: layer 1),
    pre_mlp_layernorm, mlp (dense: layer 0's), final_layernorm}."""
    D = tensors["model.embed_tokens.weight"].shape[1]
    own = "model.mtp.layers.0."
    out = {k: v for k, v in _copy_layer(tensors, "model.layers.1.", own, g, False,
                                        (("post_attention_layernorm", "pre_mlp_layernorm"),)).items()
           if ".mlp." not in k}
    out.update(_copy_layer(tensors, "model.layers.0.mlp.", own + "mlp.", g, False))
    out.update({own + "eh_proj.weight": 0.2 * torch.randn(D, 2 * D, generator=g),
                **{own + f"{n}.weight": 1 + 0.2 * torch.randn(D, generator=g)
                   for n in ("enorm", "hnorm", "final_layernorm")}})
    return out


def _eh_step(model, nxt: torch.Tensor, hid: torch.Tensor) -> torch.Tensor:
    """As vLLM's MiMoV2MTPLayer: final_layernorm(block(eh_proj([enorm(embed(next)) ; hnorm(h)])))."""
    d, eps = model.mtp.layers[0], model.config.rms_norm_eps
    e = model.model.embed_tokens.weight[nxt]
    x = torch.cat([_rms(e, d.enorm.weight, eps), _rms(hid, d.hnorm.weight, eps)], -1) @ d.eh_proj.weight.T
    b = d.block
    x = x + b.self_attn(_rms(x, b.input_layernorm.weight, eps)[None], torch.arange(len(nxt))[None])[0]
    x = x + b.mlp(_rms(x, b.post_attention_layernorm.weight, eps))
    g = _rms(x, d.final_layernorm.weight, eps)
    return g, g


def _eh_exact(t: dict) -> None:
    D = t["model.embed_tokens.weight"].shape[1]
    t["model.mtp.layers.0.eh_proj.weight"] = torch.cat([torch.eye(D), torch.zeros(D, D)], 1)
    t["model.mtp.layers.0.enorm.weight"] = torch.ones(D)
    t["model.mtp.layers.0.final_layernorm.weight"] = t["model.norm.weight"].clone()


# ---- MiniMax-M3 (vllm/models/minimax_m3's MiniMaxM3MTP): eh_proj layout, DeepSeek's conventions ----------------
def _m3_tensors(tensors: dict, g: torch.Generator) -> dict:
    """model.mtp.layers.0.{enorm, hnorm, eh_proj, final_layernorm} and a block-sparse MoE layer (layer 1's shape)."""
    D = tensors["model.embed_tokens.weight"].shape[1]
    own = "model.mtp.layers.0."
    out = _copy_layer(tensors, "model.layers.1.", own, g, zero_centred=True)
    out[own + "eh_proj.weight"] = 0.2 * torch.randn(D, 2 * D, generator=g)
    for n in ("enorm", "hnorm", "final_layernorm"):
        out[own + f"{n}.weight"] = 0.2 * torch.randn(D, generator=g)
    return out


def _m3_step(model, nxt: torch.Tensor, hid: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """g = layer(eh_proj([enorm(embed(next)) ; hnorm(h)])) with the embedding zeroed at position 0 (Gemma norms);
    the logits read final_layernorm(g)."""
    d, eps = model.mtp.layers[0], model.config.rms_norm_eps
    e = model.model.embed_tokens.weight[nxt].clone()
    e[0] = 0
    x = torch.cat([_zc_rms(e, d.enorm.weight, eps), _zc_rms(hid, d.hnorm.weight, eps)], -1) @ d.eh_proj.weight.T
    g = d.block(x[None], torch.arange(len(nxt))[None])[0]
    return g, _zc_rms(g, d.final_layernorm.weight, eps)


def _m3_exact(t: dict) -> None:
    D = t["model.embed_tokens.weight"].shape[1]
    t["model.mtp.layers.0.eh_proj.weight"] = torch.cat([torch.eye(D), torch.zeros(D, D)], 1)
    t["model.mtp.layers.0.enorm.weight"] = torch.zeros(D)
    t["model.mtp.layers.0.final_layernorm.weight"] = t["model.norm.weight"].clone()


# name: (transformers model, the MTP tensors, the reference head step, the head made to predict the model)
FAMILIES = {
    "qwen3_next": (_qwen3_next, lambda t, g: _fc_tensors(t, g, layer=1), _fc_step(_zc_rms), _fc_exact(0.0)),
    "qwen3_5_moe": (_qwen3_5, lambda t, g: _fc_tensors(t, g, layer=3), _fc_step(_zc_rms), _fc_exact(0.0)),
    # the head's layer: layer 0's sliding attention (with RoPE) and a dense MLP
    "exaone_moe": (_exaone, lambda t, g: _fc_tensors(t, g, layer=0, zero_centred=False, dense_from=0),
                   _fc_step(_rms), _fc_exact(1.0)),
    "mimo_v2_flash": (_mimo, _eh_tensors, _eh_step, _eh_exact),
    "minimax_m3": (_minimax, _m3_tensors, _m3_step, _m3_exact),
}


def _reference(model, tokens: list[int], k: int, step) -> tuple[list[int], torch.Tensor]:
    """k greedy drafts after ``tokens`` recomputed from scratch for every draft (no cache): the head's step over
    every position (its inputs: the token after each position and the model's hidden state there -- for a further
    draft, the head's own output, g), the model's lm_head on what the logits read at the last."""
    with torch.no_grad():
        logits, h = model(torch.tensor([tokens]), return_hidden=True)
        nxt = tokens[1:] + [int(logits[0, -1].argmax())]
        hid = [h[0, p] for p in range(len(tokens))]
        drafts, g_last = [], None
        for _ in range(k):
            g, out = (t[-1] for t in step(model, torch.tensor(nxt), torch.stack(hid)))
            g_last = g if g_last is None else g_last
            drafts.append(int((out @ model.lm_head.weight.T).argmax()))
            nxt.append(drafts[-1])
            hid.append(g)
    return drafts, g_last


def _save(name: str, path: str, exact: bool = False, seed: int = 1) -> str:
    """The family's tiny random checkpoint with MTP tensors. ``exact``: a bigram model (every layer's output
    projections zeroed: the logits depend on the last token only) and a head that computes the same function of
    its input token (its layer's output zeroed too, its input the embedding alone, its last norm the model's)."""
    make, tensors_fn, _, make_exact = FAMILIES[name]
    torch.manual_seed(0)
    hf = make().eval()
    randomize_(hf, seed=seed, scales={"lm_head": 0.05} if not exact else None)
    save_tiny(hf, path)
    f = os.path.join(path, "model.safetensors")
    t = load_file(f)
    t.update(tensors_fn(t, torch.Generator().manual_seed(seed + 7)))
    if exact:
        for k in t:
            if k.endswith(("o_proj.weight", "out_proj.weight", "down_proj.weight", "down_proj")):
                t[k] = torch.zeros_like(t[k])
        make_exact(t)
    save_file(t, f, metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(name, the model with its head, the checkpoint folder)."""
    path = _save(request.param, str(tmp_path_factory.mktemp(request.param)))
    return request.param, dm.load(path, progress=False), path


def test_every_mtp_tensor_loads(family, tmp_path, caplog):
    """The head is built and every mtp.* tensor is in it (the loader refuses unread tensors, and none is skipped
    as unused); the model's own output is that of the checkpoint without them."""
    name, model, path = family
    assert model.has_mtp and len(model.mtp) == 1
    assert model.mtp.embed_tokens is model.model.embed_tokens and model.mtp.lm_head is model.lm_head
    assert len(model.new_cache(1, 16).layers) == model.config.num_hidden_layers + 1
    t = load_file(os.path.join(path, "model.safetensors"))
    ours = {model.checkpoint_name(n): p for n, p in [*model.named_parameters(), *model.named_buffers()]}
    mtp = [k for k in t if k.startswith(("mtp.", "model.mtp."))]
    assert mtp
    for k in mtp:
        if ".experts." not in k:   # (stacked experts: the loader's strictness covers them)
            assert torch.equal(ours[k], t[k].to(ours[k].dtype)), k
    with caplog.at_level(logging.INFO, logger="dynamoe.models.loader"):
        dm.load(path, progress=False)
    assert "not loading" not in caplog.text
    plain = str(tmp_path / "plain")
    shutil.copytree(path, plain)
    save_file({k: v for k, v in t.items() if k not in mtp}, os.path.join(plain, "model.safetensors"),
              metadata={"format": "pt"})
    without = dm.load(plain, progress=False)
    assert not without.has_mtp
    with pytest.raises(ValueError, match="draft='mtp' needs a model with multi-token-prediction heads"):
        GenerationEngine(without, max_seq_len=32, speculative_tokens=2, draft="mtp")
    x = torch.randint(0, VOCAB, (2, 11), generator=torch.Generator().manual_seed(3))
    with torch.no_grad():  # (two loads' fp32 matmuls may round differently: MKL's kernels depend on alignment)
        torch.testing.assert_close(model(x), without(x), atol=1e-5, rtol=1e-5)


def test_bad_layouts_are_refused(family, tmp_path):
    """A config whose MTP layer count disagrees (the families whose config has one), numbered layers with a gap."""
    name, _, path = family
    if name.startswith("qwen"):
        wrong = str(tmp_path / "count")
        shutil.copytree(path, wrong)
        with open(os.path.join(wrong, "config.json")) as f:
            cfg = json.load(f)
        with open(os.path.join(wrong, "config.json"), "w") as f:
            json.dump({**cfg, "mtp_num_hidden_layers": 2}, f)
        with pytest.raises(ValueError, match="mtp_num_hidden_layers"):
            dm.load(wrong, progress=False)
    gap = str(tmp_path / "gap")
    shutil.copytree(path, gap)
    t = load_file(os.path.join(gap, "model.safetensors"))
    t = {k.replace("mtp.layers.0.", "mtp.layers.1."): v for k, v in t.items()}
    save_file(t, os.path.join(gap, "model.safetensors"), metadata={"format": "pt"})
    with pytest.raises(ValueError, match="without a gap"):
        dm.load(gap, progress=False)


def test_drafts_match_a_float64_recomputation(family):
    """The head over two rows at different lengths, then drafts from both at once: the reference's."""
    name = family[0]
    check_mtp_drafts(family[1], lambda ref, r, k: _reference(ref, r, k, FAMILIES[name][2]), VOCAB)


def _run(model, prompts, params, n, follow=None, **kw):
    """Run ``prompts`` on one engine, then (``follow``: a function of the first outputs giving more prompts) a
    second batch on the same engine; the outputs of both and the engine."""
    engine = GenerationEngine(model, max_seq_len=96, max_batch=3, block_size=4, prefill_chunk=8, **kw)
    out, batch = [], list(zip(prompts, params))
    while batch:
        reqs = [engine.add_request(p, sp, n, ignore_eos=True) for p, sp in batch]
        engine.run_until_done()
        out += [r.output_ids for r in reqs]
        batch, follow = (follow(out), None) if follow is not None else ([], None)
    return out, engine


def _prompts(seed: int) -> list[list[int]]:
    """Two prompts sharing a 13-token head, one of its own, one repetitive."""
    g = torch.Generator().manual_seed(seed)
    head = torch.randint(0, VOCAB, (13,), generator=g).tolist()
    return [head + [5, 6], torch.randint(0, VOCAB, (9,), generator=g).tolist(), head + [7], head[:6] * 3]


def test_engine_mtp_drafts_give_plain_tokens(family):
    """Greedy requests (prompts sharing a head, one repetitive) drafting with a random head -- mostly rejected:
    the recurrent state must roll back every step -- beside a sampled one, 4 requests in 3 slots, then requests
    continuing the first (where prefix caching is on: its cached blocks, head entries included): the tokens of
    plain decoding."""
    _, model, _ = family
    prompts = _prompts(0)
    params = [GREEDY, SamplingParams(temperature=0.8, seed=3), GREEDY, GREEDY]

    def follow(out):
        return [(prompts[0] + out[0] + [9, 9], GREEDY), (prompts[2] + [1], GREEDY)]

    plain, _ = _run(model, prompts, params, 14, follow)
    spec, engine = _run(model, prompts, params, 14, follow, speculative_tokens=3, draft="mtp")
    assert spec == plain
    t = engine.totals
    assert t["spec_drafted_mtp"] > 0 and t["spec_drafted_ngram"] == 0
    assert t["spec_accepted_mtp"] < t["spec_drafted_mtp"]   # (rejections: rollbacks ran)
    assert (t["cached_tokens"] >= 24) == engine.prefix_caching == (not getattr(model, "recurrent_state", False))
    assert engine.cache_stats()["blocks_used"] == 0


@pytest.mark.parametrize("name", sorted(FAMILIES))
def test_head_that_predicts_the_model_is_accepted(name, tmp_path):
    """A bigram model and a head that computes its next token: nearly every draft is accepted, a step makes
    several tokens, and the tokens are still those of plain decoding; n-gram drafts (the bigram model soon
    cycles) too."""
    model = dm.load(_save(name, str(tmp_path), exact=True, seed=2), progress=False)
    prompts = _prompts(5)[:3]
    plain, e0 = _run(model, prompts, [GREEDY] * 3, 24)
    spec, engine = _run(model, prompts, [GREEDY] * 3, 24, speculative_tokens=4, draft="mtp")
    assert spec == plain
    t = engine.totals
    assert t["spec_accepted_mtp"] >= 0.9 * t["spec_drafted_mtp"] > 0
    assert t["steps"] < e0.totals["steps"] / 2
    spec, engine = _run(model, prompts, [GREEDY] * 3, 24, speculative_tokens=4)
    assert spec == plain and engine.totals["spec_accepted_ngram"] > 0


@pytest.mark.parametrize("family", ["qwen3_next", "qwen3_5_moe"], indirect=True)   # the recurrent ones
def test_recurrent_state_rolls_back_to_any_position(family):
    """A forward of 6 tokens with the cache keeping history, cut back to 1..6 of them (KVCache.truncate), then
    3 more tokens: the logits of a sequence that never held the cut tokens; a cut before the recorded forward is
    an error, and outside a history a cut slot still refuses to continue."""
    _, model, _ = family
    assert model.recurrent_state and model.recurrent_rollback
    g = torch.Generator().manual_seed(2)
    prefix, fed, more = (torch.randint(0, VOCAB, (1, n), generator=g) for n in (7, 6, 3))
    with torch.no_grad():
        for keep in range(1, 7):
            cache = model.new_cache(2, 32)
            slot = torch.tensor([1])
            model(prefix, cache=cache, slots=slot)
            cache.begin_history()
            model(fed, cache=cache, slots=slot)
            cache.truncate(1, 7 + keep)
            if keep == 1:
                with pytest.raises(ValueError, match="before the recorded forward's first"):
                    cache.truncate(1, 6)
            if keep == 6:   # one forward per history: a second one is refused, not mixed up with the first
                with pytest.raises(ValueError, match="a history holds one forward"):
                    model(more[:, :1], cache=cache, slots=slot)
                cache.truncate(1, 13)
            cache.end_history()
            got = model(more, cache=cache, slots=slot)
            want = model(torch.cat([prefix, fed[:, :keep], more], 1))[:, -3:]
            torch.testing.assert_close(got, want, atol=3e-4, rtol=1e-4)  # (recurrent vs chunked state)
        cache.truncate(1, 8)
        with pytest.raises(ValueError, match="cannot continue a truncated slot"):
            model(more, cache=cache, slots=slot)


def test_head_layer_structure(family, tmp_path):
    """Each family's head layer as the reference builds it (layer index N + j, its own cache layer): Qwen's a
    full-attention MoE layer; MiniMax-M3's a block-sparse MoE layer; K-EXAONE's the attention of layer j (here sliding, with RoPE) unless mtp_layer_types
    says otherwise, a dense MLP; MiMo's a sliding-window layer with sinks and a dense MLP."""
    from dynamoe.models.moe_block import GatedMLP, SparseMoeBlock
    from dynamoe.models.qwen3_next import GatedAttention, SharedExpertMoeBlock

    name, model, path = family
    layer = model.mtp.layers[0]
    block = getattr(layer, "block", layer)
    assert block.self_attn.layer_idx == model.config.num_hidden_layers
    if name.startswith("qwen"):
        assert type(block.self_attn) is GatedAttention and type(block.mlp) is SharedExpertMoeBlock
    elif name == "minimax_m3":   # a block-sparse MoE layer (vLLM: force_sparse_attn, force_moe)
        assert block.self_attn.indexer is not None and isinstance(block.mlp, SparseMoeBlock)
        assert block.self_attn.indexer.layer_idx == model.config.num_hidden_layers
    else:
        assert type(block.mlp) is GatedMLP and block.self_attn.sliding_window == 6 and block.self_attn.use_rope
    if name == "mimo_v2_flash":
        assert block.self_attn.sinks is not None
        assert block.self_attn.num_kv_heads == 2 * model.config.num_key_value_heads
    if name == "exaone_moe":
        other = str(tmp_path / "full")
        shutil.copytree(path, other)
        with open(os.path.join(other, "config.json")) as f:
            cfg = json.load(f)
        for kinds, window, rope in ((["full_attention"], None, False), (["sliding_attention"], 3, True)):
            with open(os.path.join(other, "config.json"), "w") as f:
                json.dump({**cfg, "mtp_layer_types": kinds, "mtp_sliding_windows": [window or 0]}, f)
            attn = dm.load(other, progress=False).mtp.layers[0].self_attn
            assert (attn.sliding_window, attn.use_rope) == (window, rope)


def test_qwen3_5_multimodal_checkpoint(tmp_path):
    """Qwen3.5's multimodal checkpoint keeps the text model under model.language_model. and the head at the top
    (mtp.*): the head loads and drafts as the reference says."""
    text = {k: v for k, v in QWEN.items() if k != "layer_types"}
    vision = dict(depth=1, hidden_size=16, intermediate_size=32, num_heads=2, out_hidden_size=64, patch_size=4,
                  num_position_embeddings=16)
    torch.manual_seed(0)
    hf = transformers.Qwen3_5MoeForConditionalGeneration(
        transformers.Qwen3_5MoeConfig(text_config=text, vision_config=vision)).eval()
    randomize_(hf, seed=1, scales={"lm_head": 0.05})
    path = save_tiny(hf, tmp_path)
    f = os.path.join(path, "model.safetensors")
    t = load_file(f)
    stack = {k.replace("model.language_model.", "model."): v for k, v in t.items()
             if k.startswith("model.language_model.")}
    t.update(_fc_tensors(stack, torch.Generator().manual_seed(4), layer=3))
    save_file(t, f, metadata={"format": "pt"})
    model = dm.load(path, progress=False)
    assert model.has_mtp and model.config.text_config_nested
    tokens = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(5)).tolist()
    cache = model.new_cache(1, 32)
    with torch.no_grad():
        lg, h = model(torch.tensor([tokens]), cache=cache, return_hidden=True)
        nxt = torch.tensor([tokens[1:] + [int(lg[0, -1].argmax())]])
        g = model.mtp_fill(nxt, h, torch.arange(10)[None], cache, torch.tensor([0]))
        drafts = model.mtp_drafts(g[:, -1], torch.tensor([9]), cache, torch.tensor([0]), [3])
    assert drafts[0] == _reference(copy.deepcopy(model).double(), tokens, 3, _fc_step(_zc_rms))[0]


def test_minimax_m3_multimodal_hub_layout(tmp_path):
    """MiniMax-M3's multimodal checkpoint as transformers saves it -- the hub's layout (block_sparse_moe., per-expert
    w1 / w3 / w2, index_*) under language_model.model. -- with the head under language_model.model.mtp.layers.0 in
    that layout: it loads and drafts as the reference says."""
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
                  image_size=16)
    torch.manual_seed(0)
    hf = transformers.MiniMaxM3SparseForConditionalGeneration(
        transformers.MiniMaxM3VLConfig(text_config=dict(MINIMAX), vision_config=vision)).eval()
    randomize_(hf, seed=1)
    path = save_tiny(hf, tmp_path)
    f = os.path.join(path, "model.safetensors")
    t = load_file(f)
    assert any(".block_sparse_moe.experts.0.w1." in k for k in t)
    stack = {k.replace("language_model.model.", "model."): v for k, v in t.items()
             if k.startswith("language_model.model.")}
    t.update({"language_model." + k: v for k, v in _m3_tensors(stack, torch.Generator().manual_seed(4)).items()})
    save_file(t, f, metadata={"format": "pt"})
    model = dm.load(path, progress=False)
    assert model.has_mtp and model.config.text_config_nested
    tokens = torch.randint(0, VOCAB, (10,), generator=torch.Generator().manual_seed(5)).tolist()
    cache = model.new_cache(1, 32)
    with torch.no_grad():
        lg, h = model(torch.tensor([tokens]), cache=cache, return_hidden=True)
        nxt = torch.tensor([tokens[1:] + [int(lg[0, -1].argmax())]])
        g = model.mtp_fill(nxt, h, torch.arange(10)[None], cache, torch.tensor([0]))
        drafts = model.mtp_drafts(g[:, -1], torch.tensor([9]), cache, torch.tensor([0]), [3])
    assert drafts[0] == _reference(copy.deepcopy(model).double(), tokens, 3, _m3_step)[0]


def test_serve_pool_counts_the_head_layer_as_an_attention_layer(family):
    """The server's KV pool for draft='mtp' (cli.kv_cache_blocks, extra_layers=1) makes room for the head's layer
    as for one more attention layer -- of a hybrid model's attention layers (Qwen: 2 of 4), not of all its layers."""
    from dynamoe.serve.cli import kv_cache_blocks

    model = family[1]
    attention = sum(t != "linear_attention" for t in model.config.layer_types)
    plain, mtp = (kv_cache_blocks(model, 4096, 8, 16, memory=1 << 22, extra_layers=n) for n in (0, 1))
    assert plain / mtp == pytest.approx((attention + 1) / attention, rel=0.02)
