"""GLM-5 (glm_moe_dsa) against transformers on tiny random checkpoints: DeepSeek-V3.2's MLA + sparse
attention with the indexer's RoPE interleaved and a 'shared' indexer layer reusing the previous full
layer's top-k; index_topk < 24; the per-layer indexer kinds parsed as transformers derives them."""
import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import check_cached_decode, check_greedy, check_logits, check_ragged_batch
from models_mla_util import (BASE, GROUPS, MLA, YARN, check_absorption, check_group_routing_differs,
                             check_indexer_prunes, ids, make_pair)

transformers = pytest.importorskip("transformers")

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.glm_moe_dsa import GlmMoeDsaForCausalLM  # noqa: E402
from dynamoe.models.indexer import Indexer  # noqa: E402

TOPK = 8
CONFIG = dict(**MLA, **GROUPS, rope_parameters=YARN, index_topk=TOPK, index_head_dim=16, index_n_heads=16,
              indexer_types=["full", "shared", "full"])


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf, path = make_pair(transformers.GlmMoeDsaForCausalLM, transformers.GlmMoeDsaConfig(**{**BASE, **CONFIG}),
                         tmp_path_factory.mktemp("glm5"))
    return hf, dm.load(path, progress=False), path


def test_structure_and_cache(pair):
    _, ours, path = pair
    assert isinstance(ours, GlmMoeDsaForCausalLM) and dm.load_config(path).indexer_types == ("full", "shared", "full")
    a0, a1, a2 = (layer.self_attn for layer in ours.model.layers)
    assert isinstance(a0.indexer, Indexer) and a0.indexer.rope_interleaved and isinstance(a2.indexer, Indexer)
    assert a1.indexer is None and a1.shared_index is ours.shared_index
    assert not any(".indexer." in n for n, _ in a1.named_parameters(prefix="x"))
    cache = ours.new_cache(2, 16)
    with torch.no_grad():
        ours(ids(tokens=5), cache=cache)
    assert [sorted(layer) for layer in cache.layers] == [["index_k", "k_rope", "latent"], ["k_rope", "latent"],
                                                        ["index_k", "k_rope", "latent"]]


def test_logits_match_transformers(pair):
    hf, ours, _ = pair
    check_logits(hf, ours, ids())


def test_indexer_prunes(pair):
    check_indexer_prunes(pair[1], ids(), TOPK)


def test_group_limited_routing_differs_from_plain_topk(pair):
    check_group_routing_differs(pair[0], ids())


def test_greedy_matches_generate(pair):
    hf, ours, _ = pair
    check_greedy(hf, ours, ids(seed=1), new_tokens=16)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[1], ids(seed=2), prefill=9)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[1])


def test_weight_absorption_equals_expansion(pair):
    check_absorption(pair[1], ids(seed=3))


@pytest.mark.parametrize("fields", [
    {"index_topk_pattern": "FSFSS"},
    {"index_topk_freq": 2},
    {"index_topk_freq": 3, "index_skip_topk_offset": 1},
    {},
], ids=["pattern", "freq", "freq-offset", "default"])
def test_indexer_types_parse_as_transformers(fields):
    hf = transformers.GlmMoeDsaConfig(**{**BASE, "num_hidden_layers": 5, **fields})
    d = {**hf.to_dict(), **fields}
    d.pop("indexer_types")
    want = tuple(hf.indexer_types)
    got = dm.ModelConfig.from_dict(d).indexer_types
    assert got == (() if all(t == "full" for t in want) else want)


def test_first_layer_cannot_be_shared():
    cfg = dm.ModelConfig.from_dict({**transformers.GlmMoeDsaConfig(**{**BASE, **CONFIG}).to_dict(),
                                    "indexer_types": ["shared", "full", "full"]})
    with pytest.raises(ValueError, match="indexer_types"):
        GlmMoeDsaForCausalLM(cfg)
