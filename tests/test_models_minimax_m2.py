"""MiniMax-M2 against transformers on tiny random checkpoints: q/k RMSNorm over all heads (GQA: two
sizes), partial RoPE (saved as partial_rotary_factor, or a hub config's rotary_dim), sigmoid routing
with a selection bias that changes the choice, renormalised, no groups or scale, Mixtral's names."""
import json
import os

import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch
from models_mla_util import edit_config, ids, make_pair, moe_inputs

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.minimax_m2 import MiniMaxM2ForCausalLM  # noqa: E402

VARIANTS = {
    # half of each head rotates (MiniMax-M2's rotary_dim 64 of head_dim 128)
    "partial": dict(rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
    # the whole head rotates, at transformers' default base (5e6), top-3 of 8, tied lm_head
    "full": dict(num_experts_per_tok=3, tie_word_embeddings=True),
}


def tiny_config(**overrides):
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2, num_attention_heads=4,
              num_key_value_heads=2, head_dim=16, num_local_experts=8, num_experts_per_tok=2,
              max_position_embeddings=256, bos_token_id=None, eos_token_id=None)
    kw.update(overrides)
    return transformers.MiniMaxM2Config(**kw)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    hf, path = make_pair(transformers.MiniMaxM2ForCausalLM, tiny_config(**VARIANTS[request.param]),
                         tmp_path_factory.mktemp(f"minimax_m2_{request.param}"))
    return request.param, hf, dm.load(path, progress=False), path


def test_structure(pair):
    name, hf, ours, _ = pair
    assert isinstance(ours, MiniMaxM2ForCausalLM)
    assert ours.model.rotary_emb.dim == (8 if name == "partial" else 16)
    for i, layer in enumerate(ours.model.layers):
        a = layer.self_attn
        assert a.qk_norm_all and tuple(a.q_norm.weight.shape) == (64,) and tuple(a.k_norm.weight.shape) == (32,)
        gate = layer.mlp.moe.config.gates[0]
        assert (gate.type, gate.normalize, gate.n_group, gate.route_scale) == ("sigmoid", True, 1, 1.0)
        bias = layer.mlp.moe.gates[0].e_score_correction_bias
        torch.testing.assert_close(bias, hf.model.layers[i].mlp.e_score_correction_bias)
        assert bias.abs().min() > 0


def test_logits_match_transformers(pair):
    _, hf, ours, _ = pair
    check_logits(hf, ours, ids())


def test_selection_bias_changes_the_choice(pair):
    """The biased top-k (transformers' choice) differs from the unbiased one for some tokens."""
    _, hf, _, _ = pair
    differ = 0
    for i, x in moe_inputs(hf, ids()).items():
        block = hf.model.layers[i].mlp
        with torch.no_grad():
            _, _, chosen = block.gate(x, block.e_score_correction_bias)
            plain = torch.sigmoid(x.float() @ block.gate.weight.float().t()).topk(block.gate.top_k, dim=-1).indices
        differ += int((chosen.sort(-1).values != plain.sort(-1).values).any(-1).sum())
    assert differ > 0


def test_greedy_matches_generate(pair):
    _, hf, ours, _ = pair
    check_greedy(hf, ours, ids(seed=1), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[2], ids(seed=2), prefill=9)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[2])


def test_hub_rotary_dim(pair, tmp_path):
    """A hub config.json says rotary_dim (and rope_theta) instead of rope_parameters: the same model."""
    name, hf, _, path = pair
    with open(os.path.join(path, "config.json")) as f:
        d = json.load(f)
    rope = d["rope_parameters"]
    hub = str(tmp_path / "hub")
    os.makedirs(hub)
    for f in os.listdir(path):
        if f.endswith(".safetensors"):
            os.symlink(os.path.join(path, f), os.path.join(hub, f))
    with open(os.path.join(hub, "config.json"), "w") as f:
        json.dump({**d, "rope_parameters": None}, f)
    edit_config(hub, rope_parameters=None, rope_theta=rope["rope_theta"],
                rotary_dim=int(16 * rope.get("partial_rotary_factor", 1.0)))
    ours = dm.load(hub, progress=False)
    assert ours.model.rotary_emb.dim == (8 if name == "partial" else 16)
    check_logits(hf, ours, ids())
    with pytest.raises(ValueError, match="rotary_dim"):
        dm.ModelConfig.from_dict({**d, "rope_parameters": None, "rotary_dim": 17})
