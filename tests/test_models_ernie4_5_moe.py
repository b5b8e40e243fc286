"""ERNIE-4.5-MoE against transformers on tiny random checkpoints: interleaved RoPE, dense layers outside
moe_layer_start_index..end / moe_layer_interval, softmax routing with a selection-only bias (which
changes the choice) and renormalised unbiased weights, shared experts, tied embeddings (the default)."""
import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_mla_util import moe_inputs
from models_util import ids as _ids

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.ernie4_5_moe import Ernie4_5_MoeForCausalLM  # noqa: E402
from dynamoe.models.moe_block import GatedMLP, SparseMoeBlock  # noqa: E402

VARIANTS = {
    # layer 0 dense (moe_layer_start_index=1, the default), one shared expert, tied lm_head (the default)
    "start1": dict(moe_num_shared_experts=1),
    # every second layer sparse (interval 2: layer 1), no shared experts, untied, top-3
    "interval2": dict(moe_layer_start_index=0, moe_layer_interval=2, moe_num_shared_experts=0, moe_k=3,
                      tie_word_embeddings=False),
}


def tiny_config(**overrides):
    kw = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=96, moe_intermediate_size=32, num_hidden_layers=3,
              num_attention_heads=4, num_key_value_heads=2, moe_num_experts=8, moe_k=2, max_position_embeddings=256,
              pad_token_id=None, bos_token_id=None, eos_token_id=None)
    kw.update(overrides)
    return transformers.Ernie4_5_MoeConfig(**kw)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    torch.manual_seed(0)
    hf = transformers.Ernie4_5_MoeForCausalLM(tiny_config(**VARIANTS[request.param])).eval()
    randomize_(hf, seed=1, scales={"e_score_correction_bias": 0.05})  # (a parameter in transformers' model)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"ernie_{request.param}"))
    return request.param, hf, dm.load(path, progress=False)


def test_structure(pair):
    name, hf, ours = pair
    assert isinstance(ours, Ernie4_5_MoeForCausalLM)
    kinds = [GatedMLP, SparseMoeBlock, SparseMoeBlock] if name == "start1" else [GatedMLP, SparseMoeBlock, GatedMLP]
    assert [type(layer.mlp) for layer in ours.model.layers] == kinds
    assert all(layer.self_attn.rope_interleaved for layer in ours.model.layers)
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == (name == "start1")
    for i, block in ours.moe_layers():
        gate = block.moe.config.gates[0]
        assert (gate.type, gate.selection_bias, gate.normalize, gate.k) == ("top", True, True, 2 if name == "start1" else 3)
        torch.testing.assert_close(block.moe.gates[0].e_score_correction_bias,
                                   hf.model.layers[i].mlp.gate.moe_statics.e_score_correction_bias)
        assert (block.moe.shared_experts is None) == (name == "interval2")


def test_logits_match_transformers(pair):
    _, hf, ours = pair
    check_logits(hf, ours, _ids())


def test_selection_bias_changes_the_choice(pair):
    _, hf, _ = pair
    differ = 0
    for i, x in moe_inputs(hf, _ids()).items():
        gate = hf.model.layers[i].mlp.gate
        with torch.no_grad():
            _, _, chosen = gate(x)
            plain = torch.softmax(x.float() @ gate.weight.float().t(), dim=-1).topk(gate.top_k, dim=-1).indices
        differ += int((chosen.sort(-1).values != plain.sort(-1).values).any(-1).sum())
    assert differ > 0


def test_greedy_matches_generate(pair):
    _, hf, ours = pair
    check_greedy(hf, ours, _ids(seed=1), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[2], _ids(seed=2), prefill=9)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[2])


def test_use_bias_is_refused():
    cfg = dm.ModelConfig.from_dict({**tiny_config().to_dict(), "use_bias": True})
    with pytest.raises(ValueError, match="use_bias"), torch.device("meta"):
        Ernie4_5_MoeForCausalLM(cfg)
