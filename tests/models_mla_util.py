"""Helpers of the DeepSeek-style family tests (DeepSeek-V3 / Kimi-K2, GLM-4.5, DeepSeek-V3.2, GLM-5):
tiny MLA / routing configs, random weights that make routing and the indexer matter, and the checks
they share beyond models_util's (group-limited routing differs from plain top-k, the indexer prunes)."""
from __future__ import annotations

import json
import os
import shutil

import torch
from safetensors.torch import load_file, save_file

from models_util import VOCAB, ids, randomize_, save_tiny  # noqa: F401 (ids: for the MLA tests)

# YaRN with both mscale corrections (cos/sin scaled by m(mscale)/m(mscale_all_dim), softmax by m(all)^2)
YARN = {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0, "original_max_position_embeddings": 64,
        "mscale": 1.0, "mscale_all_dim": 0.8, "beta_fast": 32.0, "beta_slow": 1.0}
BASE = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=4, n_routed_experts=8, num_experts_per_tok=2,
            max_position_embeddings=256, bos_token_id=None, eos_token_id=None, first_k_dense_replace=1,
            n_shared_experts=1, routed_scaling_factor=2.5, norm_topk_prob=True)
MLA = dict(q_lora_rank=24, kv_lora_rank=32, qk_nope_head_dim=16, qk_rope_head_dim=8, v_head_dim=12)
# 4 groups of 2 experts, the best 2 groups eligible: often not where the plain top-2 would go
GROUPS = dict(n_group=4, topk_group=2)


def randomize_deepseek_(hf, seed: int) -> None:
    """models_util.randomize_ plus what it leaves trivial: a random non-zero selection bias for every
    router (so that biased selection and unbiased weights differ), and small random LayerNorm biases
    (randomize_ puts every 'norm' parameter near 1; an indexer key bias near 1 would make most index
    scores relu to exactly 0 and tie)."""
    randomize_(hf, seed=seed)
    g = torch.Generator().manual_seed(seed + 1000)
    with torch.no_grad():
        for name, b in hf.named_buffers():
            if name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)
        for name, p in hf.named_parameters():
            if name.endswith("k_norm.bias"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.2)


def make_pair(hf_cls, hf_config, path, seed: int = 1):
    """(hf model in eval mode with random weights, its saved folder)."""
    torch.manual_seed(seed)
    hf = hf_cls(hf_config).eval()
    randomize_deepseek_(hf, seed)
    return hf, save_tiny(hf, path)


def edit_config(path: str, **changes) -> None:
    cfg_path = os.path.join(path, "config.json")
    with open(cfg_path) as f:
        cfg = json.load(f)
    for k, v in changes.items():
        if v is None:
            cfg.pop(k, None)
        else:
            cfg[k] = v
    with open(cfg_path, "w") as f:
        json.dump(cfg, f)


def moe_inputs(hf, x_ids: torch.Tensor) -> dict:
    """The inputs [N, D] of every MoE block of a transformers model on x_ids (forward hooks)."""
    seen, hooks = {}, []
    for i, layer in enumerate(hf.model.layers):
        if hasattr(layer.mlp, "gate"):
            hooks.append(layer.mlp.register_forward_hook(
                lambda m, inp, out, i=i: seen.__setitem__(i, inp[0].reshape(-1, inp[0].size(-1)).detach())))
    try:
        with torch.no_grad():
            hf(x_ids)
    finally:
        for h in hooks:
            h.remove()
    return seen


def check_group_routing_differs(hf, x_ids: torch.Tensor, expect_differ: bool = True) -> int:
    """Group-limited selection (transformers' router) differs from the plain top-k of the biased
    scores for at least one token: the routing path is exercised (``expect_differ=False``: one group,
    it never differs). Returns the number of such tokens."""
    differ = 0
    for i, x in moe_inputs(hf, x_ids).items():
        gate = hf.model.layers[i].mlp.gate
        with torch.no_grad():
            _, _, chosen = gate(x)
            biased = torch.sigmoid(x.float() @ gate.weight.float().t()) + gate.e_score_correction_bias
        plain = biased.topk(gate.top_k, dim=-1).indices
        differ += int((chosen.sort(-1).values != plain.sort(-1).values).any(-1).sum())
    if expect_differ:
        assert differ > 0, "group-limited routing picked the plain top-k for every token: the test exercises nothing"
    else:
        assert differ == 0
    return differ


def check_indexer_prunes(ours, x_ids: torch.Tensor, topk: int) -> None:
    """The sparse-attention indexer matters on x_ids: each query past ``topk`` keys attends to exactly
    ``topk`` of its causal keys, and attending to all of them gives other logits. Also checks that no
    query's top-k boundary falls on tied scores (relu makes exact-zero scores when every indexer head
    is negative; which of tied keys top-k keeps is up to the sort, so the test data must avoid them)."""
    from dynamoe.models.indexer import Indexer

    seen, hooks = [], []
    for m in ours.modules():
        if isinstance(m, Indexer):
            hooks.append(m.register_forward_hook(lambda mod, inp, out: seen.append((mod, inp, out))))
    try:
        with torch.no_grad():
            sparse = ours(x_ids)
    finally:
        for h in hooks:
            h.remove()
    B, T = x_ids.shape
    causal = torch.ones(T, T).tril().bool()
    want = torch.minimum(torch.arange(1, T + 1), torch.tensor(topk))  # keys kept per query position
    assert seen
    for mod, inp, mask in seen:
        assert mask is not None and tuple(mask.shape) == (B, 1, T, T)
        assert not (mask[:, 0] & ~causal).any()
        assert torch.equal(mask[:, 0].sum(-1), want.expand(B, T))
        with torch.no_grad():
            x, q_resid, positions = inp[:3]
            scores = mod.scores(x, q_resid, positions, mod.keys(x, positions))
            scores = scores.masked_fill(~causal, float("-inf"))[:, topk:]  # the queries with more than topk keys
        top = scores.topk(topk + 1, dim=-1).values
        assert (top[..., topk - 1] > top[..., topk]).all(), "tied index scores at the top-k boundary"
    saved = [(m, m.topk) for m in ours.modules() if isinstance(m, Indexer)]
    try:
        for m, _ in saved:
            m.topk = 10 ** 6
        with torch.no_grad():
            dense = ours(x_ids)
    finally:
        for m, k in saved:
            m.topk = k
    assert (dense - sparse).abs().max() > 1e-2, "top-k selection changed nothing: the test exercises nothing"


def check_absorption(ours, x_ids: torch.Tensor) -> None:
    """Absorbed and expanded MLA agree (prefill then decode steps)."""
    outs = {}
    try:
        for absorb in (False, True):
            ours.set_absorb(absorb)
            with torch.no_grad():
                cache = ours.new_cache(x_ids.size(0), x_ids.size(1))
                T = x_ids.size(1) - 4
                outs[absorb] = torch.cat([ours(x_ids[:, :T], cache=cache)] + [ours(x_ids[:, t:t + 1], cache=cache)
                                                                              for t in range(T, x_ids.size(1))], dim=1)
    finally:
        ours.set_absorb(None)
    torch.testing.assert_close(outs[True], outs[False], atol=1e-4, rtol=0)


def dequantized_reference(qdir: str, dense_dir: str, dst: str) -> str:
    """The dense checkpoint whose weights are the FP8 checkpoint's, dequantized by our BlockFP8Weight
    (right on partial edge blocks), for transformers to load in fp32."""
    from dynamoe.quant.base import QuantizedWeight
    from dynamoe.quant.checkpoint import quant_config_from_dir, read_weight
    from dynamoe.quant.checkpoint_files import CheckpointTensors

    os.makedirs(dst)
    qcfg, qt = quant_config_from_dir(qdir), CheckpointTensors(qdir)
    out = {}
    for name in CheckpointTensors(dense_dir):
        w = read_weight(qt, name, qcfg)
        out[name] = (w.dequantize(torch.float32) if isinstance(w, QuantizedWeight) else w).float().contiguous()
    save_file(out, os.path.join(dst, "model.safetensors"), metadata={"format": "pt"})
    shutil.copy(os.path.join(dense_dir, "config.json"), dst)
    return dst


def add_mtp_layers(path: str, depths: int = 1, seed: int = 0, *, copies: bool = True, std: float = 0.2,
                   source: int | None = None, names: dict | None = None, skip: tuple = (),
                   embed: str = "model.embed_tokens.weight") -> None:
    """Write multi-token-prediction layers ``model.layers.{N + j}`` into a saved DeepSeek-style checkpoint
    (transformers saves none): a random decoder layer shaped like layer ``source`` (default the last one: an MoE
    layer; its tensors under ``skip`` prefixes left out), ``enorm``, ``hnorm``, ``eh_proj`` [D, 2 D],
    ``shared_head.norm``, and ``embed_tokens`` / ``shared_head.head`` -- copies of the model's, as DeepSeek's
    checkpoints store them (``copies=False``: left out, as some conversions do). ``names``: the family's names of
    the head's own tensors (e.g. Step-3.5's ``{"shared_head.head.weight": "transformer.shared_head.output.weight"}``;
    a None value: not written); ``embed``: the model's embedding tensor."""
    with open(os.path.join(path, "config.json")) as f:
        N = json.load(f)["num_hidden_layers"]
    source = N - 1 if source is None else source
    names = names or {}
    weights = os.path.join(path, "model.safetensors")
    tensors = load_file(weights)
    g = torch.Generator().manual_seed(seed)
    D = tensors[embed].shape[1]
    head = tensors.get("lm_head.weight", tensors[embed])
    for j in range(depths):
        src, own = f"model.layers.{source}.", f"model.layers.{N + j}."
        for k in [k for k in tensors if k.startswith(src) and not k[len(src):].startswith(skip)]:
            t = tensors[k]
            is_norm = "norm" in k and k.endswith("weight")
            noise = torch.randn(t.shape, generator=g)
            new = 1 + 0.2 * noise if is_norm else noise * std
            tensors[own + k[len(src):]] = new.to(t.dtype)
        mine = {"enorm.weight": 1 + 0.2 * torch.randn(D, generator=g),
                "hnorm.weight": 1 + 0.2 * torch.randn(D, generator=g),
                "eh_proj.weight": std * torch.randn(D, 2 * D, generator=g),
                "shared_head.norm.weight": 1 + 0.2 * torch.randn(D, generator=g)}
        if copies:
            mine["embed_tokens.weight"] = tensors[embed].clone()
            mine["shared_head.head.weight"] = head.clone()
        for k, v in mine.items():
            if names.get(k, k) is not None:
                tensors[own + names.get(k, k)] = v
    save_file(tensors, weights, metadata={"format": "pt"})


def _rms(x, norm, eps):
    """RMSNorm by hand with ``norm``'s weight (1 + w for a zero-centred one)."""
    w = norm.weight + 1 if getattr(norm, "zero_centered", False) else norm.weight
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_mtp_drafts(model, tokens: list[int], k: int) -> tuple[list[int], torch.Tensor]:
    """An MTP model's first head's k drafts after ``tokens`` (and the head's output at their last position),
    recomputed from scratch for every draft, without a cache, the head's input written out by hand (pass a
    float64 copy of the model for a reference)."""
    head, eps = model.mtp[0], model.config.rms_norm_eps
    with torch.no_grad():
        logits, h = model(torch.tensor([tokens]), return_hidden=True)
        nxt = tokens[1:] + [int(logits[0, -1].argmax())]        # the token after each position
        hid = [h[0, p] for p in range(len(tokens))]            # what each position's head input reads
        drafts, g_last = [], None
        for _ in range(k):
            e = head.embed_tokens.weight[torch.tensor(nxt)].clone()
            if head.mask_first:
                e[0] = 0                                          # position 0: no embedding
            inp = torch.cat([_rms(e, head.enorm, eps), _rms(torch.stack(hid), head.hnorm, eps)], -1)
            g = head.block((inp @ head.eh_proj.weight.T)[None], torch.arange(len(nxt))[None])[0]
            if head.norm_output:                                  # (Hy3: its output is final_layernorm'd)
                g = _rms(g, head.shared_head.norm, eps)
                out = g[-1] @ head.shared_head.head.weight.T
            else:
                out = _rms(g[-1], head.shared_head.norm, eps) @ head.shared_head.head.weight.T
            if g_last is None:
                g_last = g[-1]
            drafts.append(int(out.argmax()))
            nxt.append(drafts[-1])
            hid.append(g[-1])                                     # a further draft reads the head's own output
    return drafts, g_last
