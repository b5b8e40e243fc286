"""DeepSeek-V4's multi-token-prediction heads (``mtp.{j}.*``: dynamoe.models.mtp through DeepseekV4ForCausalLM's
hooks) on tiny random checkpoints with an MTP layer written beside transformers' tensors (it saves none), with the
hub's names and shapes (``e_proj`` / ``h_proj`` [D, D], ``enorm``, ``hnorm``, ``norm``, ``hc_head_{fn,base,scale}``
and a whole V4 layer: ``attn.*``, ``ffn.*``, ``hc_{attn,ffn}_*``, norms): every tensor loads, the model's output is
untouched, the head's drafts equal a float64 recomputation written out by hand (no cache), the engine's greedy
tokens with ``draft="mtp"`` equal plain decoding (a batch with a shared prefix), and a head built to compute the
model's own next token (a bigram model) has its drafts accepted."""
import copy
import json
import logging
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from models_util import check_engine_mtp_drafts_follow_the_head, check_mtp_drafts, one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, save_tiny
from test_models_deepseek_v4 import SIZES, VARIANTS, _randomize

import transformers

import dynamoe.models as dm  # noqa: E402
from dynamoe.engine import GenerationEngine, SamplingParams  # noqa: E402
from dynamoe.models.deepseek_v4 import V4MoeBlock, V4NextTokenPredictor  # noqa: E402

GREEDY = SamplingParams(temperature=0)
N = SIZES["num_hidden_layers"]


def _to_hub(tensors: dict) -> dict:
    """transformers' names -> the hub's (top level: embed, layers.*, norm, hc_head_*, head)."""
    hub = {}
    for k, v in tensors.items():
        k = k.removeprefix("model.")
        k = {"embed_tokens.weight": "embed.weight"}.get(k, k)
        hub[k.replace("hc_head.hc_", "hc_head_") if k.startswith("hc_head.") else k] = v
    return hub


def add_v4_mtp(path: str, *, kind: str = "sliding", seed: int = 0, std: float = 0.2, hub: bool = True,
               copies: bool = False) -> None:
    """Write ``mtp.0.*`` into a saved tiny V4 checkpoint: a random layer shaped like the last decoder layer (a
    compressed-sparse one; ``kind="sliding"`` leaves out its compressor and indexer, as the released MTP layer has
    none; ``"csa"`` keeps them and lists the kind in the config's layer_types; ``"hash"``: sliding and routed by
    token id), the head's own projections, norms
    and hc_head; ``copies``: its own ``emb.tok_emb`` / ``head`` copies of the model's. ``hub``: the hub's top-level
    names for everything (else transformers' ``model.*`` beside the hub's ``mtp.*``)."""
    weights = os.path.join(path, "model.safetensors")
    tensors = load_file(weights)
    g = torch.Generator().manual_seed(seed)
    D = tensors["model.embed_tokens.weight"].shape[1]
    streams = tensors["model.hc_head.hc_base"].shape[0]
    last = f"model.layers.{N - 1}."
    for k in [k for k in tensors if k.startswith(last)]:
        rest = k[len(last):]
        if kind != "csa" and rest.startswith(("attn.compressor.", "attn.indexer.")):
            continue
        t = tensors[k]
        noise = torch.randn(t.shape, generator=g)
        if rest.endswith("tid2eid"):
            new = t.clone()
        elif "norm" in rest and rest.endswith("weight"):
            new = 1 + 0.2 * noise
        elif rest.startswith("hc_") and rest.endswith("scale"):
            new = t + 0.1 * noise
        else:
            new = noise * std
        tensors["mtp.0." + rest] = new.to(t.dtype)
    if kind == "hash":   # routed by token id (the head's input tokens) as the first layer is
        del tensors["mtp.0.ffn.gate.bias"]
        tensors["mtp.0.ffn.gate.tid2eid"] = tensors["model.layers.0.ffn.gate.tid2eid"].roll(1, dims=0).clone()
    for name in ("enorm.weight", "hnorm.weight", "norm.weight"):
        tensors["mtp.0." + name] = 1 + 0.2 * torch.randn(D, generator=g)
    tensors["mtp.0.e_proj.weight"] = std * torch.randn(D, D, generator=g)
    tensors["mtp.0.h_proj.weight"] = std * torch.randn(D, D, generator=g)
    tensors["mtp.0.hc_head_fn"] = std * torch.randn(streams, streams * D, generator=g)
    tensors["mtp.0.hc_head_base"] = 0.3 * torch.randn(streams, generator=g)
    tensors["mtp.0.hc_head_scale"] = 1 + 0.2 * torch.randn(1, generator=g)
    if copies:
        tensors["mtp.0.emb.tok_emb.weight"] = tensors["model.embed_tokens.weight"].clone()
        tensors["mtp.0.head.weight"] = tensors["head.weight"].clone()
    save_file(_to_hub(tensors) if hub else tensors, weights, metadata={"format": "pt"})
    if kind == "csa":
        cfg_path = os.path.join(path, "config.json")
        with open(cfg_path) as f:
            cfg = json.load(f)
        cfg["layer_types"] = [*cfg["layer_types"][:N], "compressed_sparse_attention"]
        with open(cfg_path, "w") as f:
            json.dump(cfg, f)


def v4_checkpoint(path, variant: str = "plain", **kw) -> str:
    torch.manual_seed(0)
    hf = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**{**SIZES, **VARIANTS[variant]})).eval()
    _randomize(hf, seed=1)
    path = save_tiny(hf, path)
    add_v4_mtp(path, **kw)
    return path


@pytest.fixture(scope="module", params=["sliding", "csa", "hash"])
def mtp(request, tmp_path_factory):
    """(kind, model with the head, its folder)."""
    path = v4_checkpoint(tmp_path_factory.mktemp(f"v4_mtp_{request.param}"), kind=request.param, seed=3)
    return request.param, dm.load(path, progress=False), path


def _rms(x, w, eps):
    return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + eps) * w


def reference_v4_drafts(model, tokens: list[int], k: int) -> tuple[list[int], torch.Tensor]:
    """The first head's k drafts after ``tokens`` (and its output streams at their last position), recomputed from
    scratch for every draft without a cache, the head's input and its hc_head collapse written out by hand (pass a
    float64 copy of the model)."""
    head, eps, hc_eps = model.mtp[0], model.config.rms_norm_eps, model.fields.hc_eps
    hh = head.shared_head.norm.hc_head
    with torch.no_grad():
        logits, h = model(torch.tensor([tokens]), return_hidden=True)     # h: the final streams [1, T, S, D]
        nxt = tokens[1:] + [int(logits[0, -1].argmax())]
        hid = list(h[0])
        drafts, g_last = [], None
        for _ in range(k):
            e = head.embed_tokens.weight[torch.tensor(nxt)].clone()
            e[0] = 0                                                       # position 0: no embedding
            streams = torch.stack(hid)                                     # [T, S, D]
            x = (_rms(e, head.enorm.weight, eps) @ head.e_proj.weight.T)[:, None, :] \
                + _rms(streams, head.hnorm.weight, eps) @ head.h_proj.weight.T
            model.token_ids.ids = torch.tensor([nxt])                      # (a hash-routed layer's tokens)
            g = head.block(x[None], torch.arange(len(nxt))[None])[0]       # [T, S, D]
            model.token_ids.ids = None
            last = g[-1]                                                   # [S, D]
            flat = last.reshape(-1)
            mixes = hh.hc_fn @ (flat / flat.pow(2).mean().add(eps).sqrt())
            pre = torch.sigmoid(mixes * hh.hc_scale + hh.hc_base) + hc_eps
            y = (pre[:, None] * last).sum(0)
            out = _rms(y, head.shared_head.norm.weight, eps) @ head.shared_head.head.weight.T
            if g_last is None:
                g_last = last
            drafts.append(int(out.argmax()))
            nxt.append(drafts[-1])
            hid.append(last)                                               # a further draft reads its own output
    return drafts, g_last


def test_head_loads_every_tensor_and_leaves_the_model_alone(mtp, tmp_path):
    kind, model, path = mtp
    assert model.has_mtp and len(model.mtp) == 1 and isinstance(model.mtp[0], V4NextTokenPredictor)
    head = model.mtp[0]
    attn = head.block.self_attn
    assert attn.layer_idx == N and isinstance(head.block.mlp, V4MoeBlock)
    assert (head.block.mlp.hash is not None) == (kind == "hash")
    assert (attn.compressor is not None, attn.indexer is not None) == ((True, True) if kind == "csa" else (False, False))
    # the model's own embedding and lm_head (the hub's MTP layer has no copies)
    assert head.embed_tokens is model.model.embed_tokens and head.shared_head.head is model.lm_head
    # every mtp.* tensor was read (the loader refuses unread ones once a head is built) into its place
    t = load_file(os.path.join(path, "model.safetensors"))
    assert model.unused_checkpoint_prefixes == ()
    for ours, theirs in (("enorm.weight", "enorm.weight"), ("hnorm.weight", "hnorm.weight"),
                         ("e_proj.weight", "e_proj.weight"), ("h_proj.weight", "h_proj.weight"),
                         ("shared_head.norm.weight", "norm.weight"),
                         ("shared_head.norm.hc_head.hc_fn", "hc_head_fn"),
                         ("shared_head.norm.hc_head.hc_base", "hc_head_base"),
                         ("shared_head.norm.hc_head.hc_scale", "hc_head_scale"),
                         ("block.self_attn.wq_a.weight", "attn.wq_a.weight"),
                         ("block.self_attn.attn_sink", "attn.attn_sink"),
                         ("block.attn_hc.fn", "hc_attn_fn"), ("block.ffn_hc.scale", "hc_ffn_scale"),
                         ("block.post_attention_layernorm.weight", "ffn_norm.weight"),
                         ("block.mlp.moe.gates.0.wg.weight", "ffn.gate.weight"),
                         *([("block.mlp.hash.tid2eid", "ffn.gate.tid2eid")] if kind == "hash" else []),
                         ("block.mlp.moe.shared_experts.down_proj.weight", "ffn.shared_experts.w2.weight")):
        assert model.checkpoint_name("mtp.0." + ours) == "mtp.0." + theirs
        got = model.get_buffer if ours.endswith("tid2eid") else model.get_parameter
        torch.testing.assert_close(got("mtp.0." + ours).float(), t["mtp.0." + theirs].float(), atol=0, rtol=0,
                                   msg=ours)
    # the same model without the head: identical logits; the hidden states are the final streams
    plain_dir = tmp_path / "plain"
    plain_dir.mkdir()
    save_file({k: v for k, v in t.items() if not k.startswith("mtp.")}, str(plain_dir / "model.safetensors"))
    shutil.copy(os.path.join(path, "config.json"), plain_dir)
    plain = dm.load(str(plain_dir), progress=False)
    assert not plain.has_mtp and len(model.new_cache(1, 16).layers) == N + 1
    x = torch.randint(0, VOCAB, (2, 13), generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        torch.testing.assert_close(model(x), plain(x), atol=0, rtol=0)
        logits, hidden = model(x, return_hidden=True)
        torch.testing.assert_close(logits, plain(x), atol=0, rtol=0)
        assert hidden.shape == (2, 13, model.fields.hc_mult, SIZES["hidden_size"])
        torch.testing.assert_close(model.lm_head(model.model.norm(hidden)), logits, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("mtp", ["sliding"], indirect=True)   # one layout check is enough
def test_transformers_layout_and_copies_load_alike(mtp, tmp_path):
    """transformers' names for the model (model.*) beside the hub's mtp.*, and a head with its own embedding /
    lm_head copies (shared with the model's after loading): the same drafts."""
    kind, model, _ = mtp
    path = v4_checkpoint(tmp_path / "tf", kind=kind, seed=3, hub=False, copies=True)
    other = dm.load(path, progress=False)
    assert other.mtp[0].embed_tokens is other.model.embed_tokens and other.mtp[0].shared_head.head is other.lm_head
    toks = torch.randint(0, VOCAB, (11,), generator=torch.Generator().manual_seed(2)).tolist()
    ref = copy.deepcopy(other).double()
    assert reference_v4_drafts(ref, toks, 3)[0] == reference_v4_drafts(copy.deepcopy(model).double(), toks, 3)[0]


def test_drafts_match_a_float64_recomputation(mtp):
    check_mtp_drafts(mtp[1], reference_v4_drafts, VOCAB)


def _run(model, prompts, n, **kw):
    """Greedy outputs of ``prompts`` (two at a time: a third waits, then reuses what the first cached)."""
    engine = GenerationEngine(model, max_seq_len=96, max_batch=2, block_size=4, **kw)
    reqs = [engine.add_request(p, GREEDY, n, ignore_eos=True) for p in prompts]
    engine.run_until_done()
    return [r.output_ids for r in reqs], engine


def test_engine_mtp_drafts_give_plain_tokens(mtp):
    """A batch with a shared prompt head (prefix reuse, head entries included), greedy: draft='mtp' emits plain
    decoding's tokens, its drafts counted as the head's."""
    _, model, _ = mtp
    g = torch.Generator().manual_seed(5)
    base = torch.randint(0, VOCAB, (9,), generator=g).tolist()
    prompts = [base + [3, 1], torch.randint(0, VOCAB, (6,), generator=g).tolist(), base + [3, 7]]
    plain, _ = _run(model, prompts, 10)
    spec, engine = _run(model, prompts, 10, speculative_tokens=3, draft="mtp")
    assert spec == plain
    t = engine.totals
    assert t["spec_drafted_mtp"] > 0 and t["spec_drafted"] == t["spec_drafted_mtp"] and t["cached_tokens"] > 0
    engine.cache.pool.check()


@pytest.mark.parametrize("mtp", ["sliding"], indirect=True)   # every kind's cached path: the recomputation test
def test_head_cache_stays_consistent_in_the_engine(mtp):
    check_engine_mtp_drafts_follow_the_head(mtp[1], reference_v4_drafts, VOCAB)


def test_head_that_predicts_the_model_is_accepted(tmp_path):
    """Every sublayer's output zeroed: the model is a bigram model (its streams stay the token's embedding, up to
    a scale the final norm removes). A head with e_proj = I, h_proj = 0, enorm = 1 and the model's final norm
    computes the same function of its input token: nearly every draft is accepted, and the tokens are plain
    decoding's."""
    path = v4_checkpoint(tmp_path / "exact", seed=2)
    t = load_file(path + "/model.safetensors")
    for k in t:
        if k.endswith(("wo_b.weight", "w2.weight")):
            t[k] = torch.zeros_like(t[k])
    D = t["embed.weight"].shape[1]
    t["mtp.0.e_proj.weight"] = torch.eye(D)
    t["mtp.0.h_proj.weight"] = torch.zeros(D, D)
    t["mtp.0.enorm.weight"] = torch.ones(D)
    t["mtp.0.norm.weight"] = t["norm.weight"].clone()
    save_file(t, path + "/model.safetensors", metadata={"format": "pt"})
    model = dm.load(path, progress=False)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (8, 5)]
    plain, e0 = _run(model, prompts, 24)
    spec, engine = _run(model, prompts, 24, speculative_tokens=4, draft="mtp")
    assert spec == plain
    t = engine.totals
    assert t["spec_accepted_mtp"] >= 0.9 * t["spec_drafted_mtp"] > 0
    assert t["steps"] < e0.totals["steps"] / 2


def test_partial_or_misnumbered_mtp_layers(tmp_path, caplog):
    """mtp.* tensors without e_proj make no head and are named as left unread; a depth 1 without a depth 0 and a
    head count that contradicts num_nextn_predict_layers are refused by name."""
    path = v4_checkpoint(tmp_path / "m", seed=1)
    t = load_file(path + "/model.safetensors")
    partial = str(tmp_path / "partial")
    shutil.copytree(path, partial)
    save_file({k: v for k, v in t.items() if k != "mtp.0.e_proj.weight"}, partial + "/model.safetensors")
    with caplog.at_level(logging.INFO):
        m = dm.load(partial, progress=False)
    assert not m.has_mtp and "no mtp.{j}.e_proj.weight" in caplog.text and "mtp.* (" in caplog.text
    gap = str(tmp_path / "gap")
    shutil.copytree(path, gap)
    save_file({k.replace("mtp.0.", "mtp.1."): v for k, v in t.items()}, gap + "/model.safetensors")
    with pytest.raises(ValueError, match="without a gap"):
        dm.load(gap, progress=False)
    count = str(tmp_path / "count")
    shutil.copytree(path, count)
    with open(count + "/config.json") as f:
        cfg = json.load(f)
    cfg["num_nextn_predict_layers"] = 2
    with open(count + "/config.json", "w") as f:
        json.dump(cfg, f)
    with pytest.raises(ValueError, match="num_nextn_predict_layers"):
        dm.load(count, progress=False)
