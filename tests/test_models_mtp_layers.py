"""Multi-token-prediction heads of the families whose checkpoints keep DeepSeek-style MTP layers
(``model.layers.{N + j}``: enorm, hnorm, eh_proj, a decoder layer of the family, the head's norm and lm_head) under
their own names and norms, beyond DeepSeek-V3 / GLM (tests/test_models_mtp.py): tiny random checkpoints from
transformers' classes with MTP layers added in the hub's names and shapes. Every tensor loads (none left unread),
the head's drafts equal a float64 recomputation without a cache, the engine's greedy tokens with draft='mtp' are
plain decoding's (a batch with a shared prefix), and a head built to compute the model's own next token (every
sublayer's output zeroed: a bigram model) has nearly every draft accepted."""
import json
import os
import shutil

import pytest
import torch
from safetensors.torch import load_file, save_file

from models_util import check_engine_mtp_drafts_follow_the_head, check_mtp_drafts, one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, randomize_
from models_mla_util import add_mtp_layers, reference_mtp_drafts

import transformers

import dynamoe.models as dm  # noqa: E402
from dynamoe.engine import GenerationEngine, SamplingParams  # noqa: E402
from dynamoe.models.mtp import NextTokenPredictor  # noqa: E402

GREEDY = SamplingParams(temperature=0)


def _step3p5(path, mtp_kind: str) -> str:
    """A step3p5 checkpoint (the hub's config: per-layer lists with an entry for the MTP layer) with layers
    full / sliding / sliding / full, MoE on 2-3 (moe_layers_enum); the MTP layer 'full' (MoE, as layer 3) or
    'sliding' (dense, as layer 1: Step-3.5-Flash's)."""
    from test_models_step3p5 import BASE, LAYERS, SCALES, VARIANTS, VISION, _step3p5_folder

    text = {**BASE, **VARIANTS["hub"]}
    if mtp_kind == "sliding":
        text.update(layer_types=LAYERS + ["sliding_attention"], moe_layers_enum="2,3",
                    rope_theta=[1e4, 300.0, 300.0, 1e4, 300.0], partial_rotary_factors=[0.5, 1.0, 1.0, 0.5, 1.0],
                    swiglu_limits_shared=[0, 0, 0, 0.5, 0.6])
    torch.manual_seed(0)
    hf = transformers.Step3p7ForConditionalGeneration(
        transformers.Step3p7Config(text_config=dict(text), vision_config=VISION)).eval()
    randomize_(hf, seed=1, scales=SCALES)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if "norm" in n and "vision" not in n:
                p.sub_(1.0)   # zero-centred norms
    hf.save_pretrained(str(path / "wrapper"))
    out = _step3p5_folder(str(path / "wrapper"), str(path / "text"), text)
    add_mtp_layers(out, seed=3, copies=False, source=3 if mtp_kind == "full" else 1,
                   names={"shared_head.norm.weight": "transformer.shared_head.norm.weight"})
    t = load_file(out + "/model.safetensors")   # the hub's Step-3.5 MTP layers carry their own output head
    t["model.layers.4.transformer.shared_head.output.weight"] = 0.1 * torch.randn(
        t["lm_head.weight"].shape, generator=torch.Generator().manual_seed(5))
    for k in [k for k in t if k.startswith("model.layers.4.") and k.endswith("norm.weight")]:
        t[k] = t[k] - 1.0   # zero-centred: scales near 1
    save_file(t, out + "/model.safetensors", metadata={"format": "pt"})
    return out


def _hy_v3(path) -> str:
    """A Hy3 checkpoint (dense first layer, MoE after) with its MTP layer as the hub's: final_layernorm for the head
    norm, and shared_head / embed_tokens tensors of its own that the head does not read (vLLM's HYV3MTP neither)."""
    from test_models_hy_v3 import SCALES, SIZES

    torch.manual_seed(0)
    hf = transformers.HYV3ForCausalLM(transformers.HYV3Config(**SIZES)).eval()
    randomize_(hf, seed=1, scales=SCALES)
    hf.save_pretrained(str(path))
    add_mtp_layers(str(path), seed=3, copies=True, names={"shared_head.norm.weight": "final_layernorm.weight"})
    return str(path)


def _dots3(path, kind: str) -> str:
    """A dots3_note checkpoint (DSA layers 0-1, sliding 2-3, a dense first layer) with its MTP layer as vLLM's
    Dots3NoteMTP reads it: a dense MLP, the head's embedding under model.mtp.embed_tokens; 'sliding': the kind
    listed in the config's layer_types (num_hidden_layers + 1 entries, as the MoE flags); 'indexed': not listed, a
    DSA layer by its indexer tensors."""
    from test_models_dots3_note import TEXT, VARIANTS

    from models_mla_util import edit_config, make_pair

    _, out = make_pair(transformers.Dots3NoteForCausalLM, transformers.Dots3NoteTextConfig(
        **{**TEXT, **VARIANTS["text"]}), str(path))
    N = TEXT["num_hidden_layers"]
    edit_config(out, mlp_layer_types=None, moe_layer_freq=[0, 1, 1, 1, 0], num_nextn_predict_layers=1,
                **({"layer_types": ["indexed_attention"] * 2 + ["sliding_attention"] * 3} if kind == "sliding" else {}))
    add_mtp_layers(out, seed=3, copies=False, source=2 if kind == "sliding" else 0, skip=("mlp.",))
    t = load_file(out + "/model.safetensors")
    g = torch.Generator().manual_seed(4)
    for k in [k for k in t if k.startswith("model.layers.0.mlp.")]:   # the dense MLP's shapes
        t[k.replace("model.layers.0.", f"model.layers.{N}.")] = 0.2 * torch.randn(t[k].shape, generator=g)
    t["model.mtp.embed_tokens.weight"] = t["model.embed_tokens.weight"].clone()
    save_file(t, out + "/model.safetensors", metadata={"format": "pt"})
    return out


def _bailing(path) -> str:
    """A Ling-3 checkpoint (KDA / MLA layers) with its MTP layer as vLLM's BailingMoeV3 MTP model reads it: an MLA
    layer and MoE under the decoder's names, final_layernorm for the head norm, no copies."""
    from test_models_bailing_hybrid import SCALES, SIZES

    torch.manual_seed(0)
    hf = transformers.BailingHybridForCausalLM(transformers.BailingHybridConfig(**SIZES)).eval()
    randomize_(hf, seed=1, scales=SCALES)
    hf.save_pretrained(str(path))
    add_mtp_layers(str(path), seed=3, copies=False, embed="model.word_embeddings.weight",
                   names={"shared_head.norm.weight": "final_layernorm.weight"})
    return str(path)


def _hy_v4(path) -> str:
    """A Hy4 checkpoint (two residual streams; indexer on layers 0-1, shared after) with the hub's MTP layer
    model.mtp_layers.0 as SGLang's HYV4ForCausalLMNextN reads it: a plain layer shaped like layer 1 (MLA with its
    own indexer, sinks and output gate; MoE) without hyper-connections, final_layernorm for the head norm."""
    from test_models_hy_v4 import TEXT, VARIANTS

    torch.manual_seed(0)
    hf = transformers.HYV4ForCausalLM(transformers.HYV4Config(**{**TEXT, **VARIANTS["hy_v4"]})).eval()
    randomize_(hf, seed=1, scales={"lm_head": 0.2, "sinks": 1.0})
    hf.save_pretrained(str(path))
    add_mtp_layers(str(path), seed=3, copies=False, source=1,
                   names={"shared_head.norm.weight": "final_layernorm.weight"})
    t = load_file(str(path / "model.safetensors"))
    N = TEXT["num_hidden_layers"]
    t = {k.replace(f"model.layers.{N}.", "model.mtp_layers.0."): v for k, v in t.items()
         if not (k.startswith(f"model.layers.{N}.") and "hc_" in k)}
    save_file(t, str(path / "model.safetensors"), metadata={"format": "pt"})
    return str(path)


# name -> (checkpoint builder(folder) -> path, what to check on the head)
FAMILIES = {
    "hy_v4": (_hy_v4, dict(kind="indexed_attention", moe=True, own_head=False, zero_centered=False,
                           attn=("q_b_proj", "kv_b_proj"), prefix="model.mtp_layers.0.",
                           outputs=("o_proj.weight", "down_proj.weight", "experts.down_proj"))),
    # (recurrent KDA state, rolled back past rejected drafts: cache.begin_history)
    "bailing_hybrid": (_bailing, dict(kind="full_attention", moe=True, own_head=False, zero_centered=False,
                                      attn=("kv_b_proj", "g_proj"), embed="model.word_embeddings.weight",
                                      outputs=("attention.dense.weight", "down_proj.weight"))),
    "dots3_sliding": (lambda p: _dots3(p, "sliding"), dict(kind="sliding_attention", moe=False, own_head=False,
                                                         zero_centered=False, attn=("q_b_proj", "g_proj"))),
    "dots3_indexed": (lambda p: _dots3(p, "indexed"), dict(kind="indexed_attention", moe=False, own_head=False,
                                                         zero_centered=False, attn=("q_b_proj", "g_proj"))),
    "hy_v3": (_hy_v3, dict(kind="full_attention", moe=True, own_head=False, zero_centered=False)),
    "step3p5_full": (lambda p: _step3p5(p, "full"), dict(kind="full_attention", moe=True, own_head=True,
                                                         zero_centered=True)),
    "step3p5_sliding": (lambda p: _step3p5(p, "sliding"), dict(kind="sliding_attention", moe=False, own_head=True,
                                                               zero_centered=True)),
}


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    build, want = FAMILIES[request.param]
    path = build(tmp_path_factory.mktemp(request.param))
    return request.param, want, dm.load(path, progress=False), path


def test_head_loads_every_tensor(family):
    name, want, model, path = family
    assert model.has_mtp and len(model.mtp) == 1 and isinstance(model.mtp[0], NextTokenPredictor)
    head, N = model.mtp[0], model.config.num_hidden_layers
    attn = head.block.self_attn
    assert attn.layer_idx == N
    assert (attn.sliding_window is not None) == (want["kind"] == "sliding_attention")
    assert (getattr(attn, "indexer", None) is not None) == (want["kind"] == "indexed_attention")
    assert hasattr(head.block.mlp, "moe") == want["moe"]
    assert head.embed_tokens is model.model.embed_tokens
    assert (head.shared_head.head is not model.lm_head) == want["own_head"]
    assert head.enorm.zero_centered == head.shared_head.norm.zero_centered == want["zero_centered"]
    assert not model.ignores_checkpoint_tensor(model.checkpoint_name("mtp.0.eh_proj.weight"))
    # the loader refuses an unread tensor once a head is built: each of the layer's is read into its place
    t = load_file(os.path.join(path, "model.safetensors"))
    sd = {n: p for n, p in model.named_parameters()}
    for ours in ("enorm.weight", "hnorm.weight", "eh_proj.weight", "shared_head.norm.weight",
                 *(["shared_head.head.weight"] if want["own_head"] else []), "block.input_layernorm.weight",
                 *(f"block.self_attn.{p}.weight" for p in want.get("attn", ("q_proj", "o_proj")))):
        theirs = model.checkpoint_name(f"mtp.0.{ours}")
        assert theirs.startswith(want.get("prefix", f"model.layers.{N}.")) and theirs in t, ours
        torch.testing.assert_close(sd[f"mtp.0.{ours}"], t[theirs], atol=0, rtol=0, msg=ours)
    assert len(model.new_cache(1, 16).layers) == N + 1
    if name == "hy_v3":   # the layer's own lm_head / embedding copies: knowingly not read (the model's are used)
        assert all(model.ignores_checkpoint_tensor(f"model.layers.{N}.{x}.weight")
                   for x in ("shared_head.head", "embed_tokens"))


def test_drafts_match_a_float64_recomputation(family):
    check_mtp_drafts(family[2], reference_mtp_drafts, VOCAB)


def _run(model, prompts, n, **kw):
    """Greedy outputs, two requests at a time (a third waits, then reuses what the first cached)."""
    engine = GenerationEngine(model, max_seq_len=96, max_batch=2, block_size=4, **kw)
    reqs = [engine.add_request(p, GREEDY, n, ignore_eos=True) for p in prompts]
    engine.run_until_done()
    return [r.output_ids for r in reqs], engine


def test_engine_mtp_drafts_give_plain_tokens(family):
    _, want, model, _ = family
    g = torch.Generator().manual_seed(5)
    base = torch.randint(0, VOCAB, (9,), generator=g).tolist()
    prompts = [base + [3, 1], torch.randint(0, VOCAB, (6,), generator=g).tolist(), base + [3, 7]]
    plain, _ = _run(model, prompts, 10)
    spec, engine = _run(model, prompts, 10, speculative_tokens=3, draft="mtp")
    assert spec == plain
    t = engine.totals
    assert t["spec_drafted_mtp"] > 0 and t["spec_drafted"] == t["spec_drafted_mtp"]
    # (a recurrent state summarises a whole prefix: no prefix reuse for bailing_hybrid)
    assert (t["cached_tokens"] > 0) == (not getattr(model, "recurrent_state", False))
    engine.cache.pool.check()


def test_engine_drafts_follow_the_head_after_rejections(family):
    """The head's drafts after every engine step equal a recomputation over the tokens so far."""
    check_engine_mtp_drafts_follow_the_head(family[2], reference_mtp_drafts, VOCAB)


def test_head_that_predicts_the_model_is_accepted(family, tmp_path):
    """Every sublayer's output projection zeroed: the model is a bigram model. A head with eh_proj = [I, 0], a
    unit enorm and the model's final norm and lm_head computes the same function of its input token."""
    _, want, _, path = family
    other = str(tmp_path / "exact")
    shutil.copytree(path, other)
    with open(other + "/config.json") as f:
        N = json.load(f)["num_hidden_layers"]
    t = load_file(other + "/model.safetensors")
    for k in t:
        if k.endswith(want.get("outputs", ("o_proj.weight", "down_proj.weight"))):
            t[k] = torch.zeros_like(t[k])
    model = dm.load(path, progress=False)
    D = t[want.get("embed", "model.embed_tokens.weight")].shape[1]
    name = lambda ours: model.checkpoint_name(f"mtp.0.{ours}")   # noqa: E731
    t[name("eh_proj.weight")] = torch.cat([torch.eye(D), torch.zeros(D, D)], 1)
    t[name("enorm.weight")] = torch.zeros(D) if want["zero_centered"] else torch.ones(D)
    t[name("shared_head.norm.weight")] = t["model.norm.weight"].clone()
    if want["own_head"]:
        t[name("shared_head.head.weight")] = t["lm_head.weight"].clone()
    assert name("eh_proj.weight").startswith(want.get("prefix", f"model.layers.{N}."))
    save_file(t, other + "/model.safetensors", metadata={"format": "pt"})
    model = dm.load(other, progress=False)
    g = torch.Generator().manual_seed(7)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (8, 5)]
    if not want.get("engine", True):   # no engine speculation: the head's drafts against greedy decoding
        from models_util import greedy

        hits = total = 0
        for p in prompts:
            drafts = reference_mtp_drafts(model, p, 4)[0]
            hits += sum(a == b for a, b in zip(drafts, greedy(model, torch.tensor([p]), 5)[0, len(p) + 1:].tolist()))
            total += 4
        assert hits >= 0.9 * total
        return
    plain, e0 = _run(model, prompts, 24)
    spec, engine = _run(model, prompts, 24, speculative_tokens=4, draft="mtp")
    assert spec == plain
    tot = engine.totals
    assert tot["spec_accepted_mtp"] >= 0.9 * tot["spec_drafted_mtp"] > 0
    assert tot["steps"] < e0.totals["steps"] / 2
