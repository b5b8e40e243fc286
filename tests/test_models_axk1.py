"""A.X-K1 against transformers on tiny random checkpoints: DeepSeek-V3 (MLA with query LoRA, interleaved or
half-split RoPE, sigmoid group-limited routing with a selection bias, shared experts) with a norm on every MoE
block's output; the MLP kinds from the hub's first_k_dense_replace / moe_layer_freq; the hub's files (a post-MLP
norm on the dense layers, no selection bias) loaded alike."""
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch
from models_mla_util import BASE, GROUPS, MLA, edit_config, ids, make_pair

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.axk1 import AXK1ForCausalLM, PostNormMoeLayer  # noqa: E402
from dynamoe.models.base import DecoderLayer  # noqa: E402

SIZES = {k: v for k, v in BASE.items() if k != "first_k_dense_replace"}
VARIANTS = {
    # groups, interleaved RoPE, the first layer dense
    "groups": dict(**MLA, **GROUPS, mlp_layer_types=["dense", "sparse", "sparse"]),
    # one group, half-split RoPE, MoE on every other layer from 1 (the hub's moe_layer_freq), 2 shared experts
    "freq": dict(**MLA, n_group=1, topk_group=1, rope_interleave=False, n_shared_experts=2, num_hidden_layers=4,
                 mlp_layer_types=["dense", "dense", "sparse", "dense"]),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    name = request.param
    hf, path = make_pair(transformers.AXK1ForCausalLM, transformers.AXK1Config(**{**SIZES, **VARIANTS[name]}),
                         tmp_path_factory.mktemp(f"axk1_{name}"))
    if name == "freq":  # the hub's spelling of the same MLP kinds
        edit_config(path, mlp_layer_types=None, first_k_dense_replace=1, moe_layer_freq=2)
    return name, hf, dm.load(path, progress=False), path


def test_structure(pair):
    name, hf, ours, _ = pair
    assert type(ours) is AXK1ForCausalLM
    moe = [hf.config.mlp_layer_types[i] == "sparse" for i in range(hf.config.num_hidden_layers)]
    assert [ours.config.is_moe_layer(i) for i in range(len(moe))] == moe
    assert [type(layer) for layer in ours.model.layers] == [PostNormMoeLayer if m else DecoderLayer for m in moe]
    assert ours.model.layers[0].self_attn.rope_interleaved == (name == "groups")


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


def test_post_mlp_norm_matters(pair):
    _, _, ours, _ = pair
    x = ids()
    norms = [layer.post_mlp_layernorm.weight for layer in ours.model.layers if isinstance(layer, PostNormMoeLayer)]
    kept = [w.detach().clone() for w in norms]
    with torch.no_grad():
        ref = ours(x)
        for w in norms:
            w.fill_(1.0)
        changed = (ours(x) - ref).abs().max() > 1e-3
        for w, k in zip(norms, kept):
            w.copy_(k)
    assert changed


def test_hub_files_load(pair, tmp_path):
    """The hub's files: a post-MLP norm on every dense layer too (skipped), no selection bias (zero: as transformers
    initialises a missing one)."""
    name, hf, ours, path = pair
    tensors = load_file(os.path.join(path, "model.safetensors"))
    hub = {k: v for k, v in tensors.items() if not k.endswith("e_score_correction_bias")}
    dense = [i for i in range(hf.config.num_hidden_layers) if hf.config.mlp_layer_types[i] == "dense"]
    hub.update({f"model.layers.{i}.post_mlp_layernorm.weight": torch.ones(64) for i in dense})
    save_file(hub, str(tmp_path / "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        (tmp_path / "config.json").write_text(f.read())
    hub_model = dm.load(str(tmp_path), progress=False)
    assert hub_model.zero_bias_layers == tuple(i for i, _ in ours.moe_layers())
    with torch.no_grad():
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.zero_()
    try:
        check_logits(hf, hub_model, ids())
    finally:
        with torch.no_grad():  # (the module-scoped transformers model: put its biases back)
            for k, v in tensors.items():
                if k.endswith("e_score_correction_bias"):
                    hf.get_buffer(k).copy_(v)
