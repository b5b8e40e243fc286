"""Mixtral against transformers on a tiny random checkpoint (block_sparse_moe names, w1/w3/w2 experts,
renormalised top-2)."""
import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_util import ids as _ids

transformers = pytest.importorskip("transformers")

import dynamoe.models as dm  # noqa: E402


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    cfg = transformers.MixtralConfig(vocab_size=VOCAB, hidden_size=64, intermediate_size=32, num_hidden_layers=2,
                                     num_attention_heads=4, num_key_value_heads=2, num_local_experts=8,
                                     num_experts_per_tok=2, max_position_embeddings=256, bos_token_id=None,
                                     eos_token_id=None)
    torch.manual_seed(0)
    hf = transformers.MixtralForCausalLM(cfg).eval()
    randomize_(hf, seed=2)
    return hf, dm.load(save_tiny(hf, tmp_path_factory.mktemp("mixtral")), progress=False)


def test_config_and_structure(pair):
    _, ours = pair
    assert ours.config.model_type == "mixtral" and ours.config.num_experts == 8
    assert ours.config.rope.theta == 1e6  # Mixtral's default base
    assert len(ours.moe_layers()) == 2
    assert ours.checkpoint_name("model.layers.0.mlp.moe.gates.0.wg.weight") == "model.layers.0.block_sparse_moe.gate.weight"


def test_logits_match_transformers(pair):
    check_logits(*pair, _ids())


def test_greedy_matches_generate(pair):
    check_greedy(*pair, _ids(seed=1), new_tokens=16)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[1], _ids(seed=2), prefill=7)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[1])
