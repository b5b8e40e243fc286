"""Hunyuan-A13B (hunyuan_v1_moe) against transformers on tiny random checkpoints: per-head q/k norms
after RoPE, GQA, attention biases, softmax top-k renormalised (moe_topk), the ungated shared MLP;
hub-style per-layer lists (moe_topk, num_experts) of one value parse, differing ones are refused."""
import json
import os

import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_util import ids as _ids

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.hunyuan_v1_moe import HunYuanMoEV1ForCausalLM  # noqa: E402

VARIANTS = {
    "top2": dict(moe_topk=2),
    "bias_top3": dict(moe_topk=3, attention_bias=True, tie_word_embeddings=True),
}


def tiny_config(**overrides):
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_experts=8, max_position_embeddings=256, pad_token_id=None,
              bos_token_id=None, eos_token_id=None, eod_token_id=None, sep_token_id=None)
    kw.update(overrides)
    return transformers.HunYuanMoEV1Config(**kw)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.HunYuanMoEV1ForCausalLM(tiny_config(**VARIANTS[request.param])).eval()
    randomize_(hf, seed=1)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"hunyuan_{request.param}"))
    return request.param, hf, dm.load(path, progress=False), path


def test_structure(pair):
    name, hf, ours, _ = pair
    assert isinstance(ours, HunYuanMoEV1ForCausalLM)
    for i, layer in enumerate(ours.model.layers):
        a = layer.self_attn
        assert a.qk_norm_after_rope and not a.qk_norm_all and tuple(a.q_norm.weight.shape) == (16,)
        assert (a.o_proj.bias is not None) == (name == "bias_top3")
        assert layer.mlp.moe.config.gates[0].k == (2 if name == "top2" else 3)
        torch.testing.assert_close(layer.mlp.moe.shared_experts.up_proj.weight, hf.model.layers[i].mlp.shared_mlp.up_proj.weight)


def test_logits_match_transformers(pair):
    _, hf, ours, _ = pair
    check_logits(hf, ours, _ids())


def test_norm_after_rope_matters(pair):
    """Norming before RoPE (Qwen3's order) gives other logits: the order is exercised."""
    _, _, ours, _ = pair
    attns = [layer.self_attn for layer in ours.model.layers]
    with torch.no_grad():
        ref = ours(_ids())
        try:
            for a in attns:
                a.qk_norm_after_rope = False
            before = ours(_ids())
        finally:
            for a in attns:
                a.qk_norm_after_rope = True
    assert (before - ref).abs().max() > 1e-3


def test_greedy_matches_generate(pair):
    _, hf, ours, _ = pair
    check_greedy(hf, ours, _ids(seed=1), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[2], _ids(seed=2), prefill=9)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[2])


def test_hub_per_layer_lists(pair):
    name, _, _, path = pair
    with open(os.path.join(path, "config.json")) as f:
        d = json.load(f)
    k = d["moe_topk"]
    hub = {**d, "moe_topk": [k, k], "num_experts": [8, 8], "moe_intermediate_size": [32, 32]}
    assert dm.ModelConfig.from_dict(hub) == dm.load_config(path)
    with pytest.raises(ValueError, match="moe_topk"):
        dm.ModelConfig.from_dict({**hub, "moe_topk": [k, k + 1]})
