"""DeepSeek-V3.2 against transformers on tiny random checkpoints: MLA (interleaved RoPE, YaRN) with
the sparse-attention indexer keeping fewer keys than the input has (index_topk < 24), its keys cached
per position; dense layers from first_k_dense_replace or mlp_layer_types; DeepSeek routing."""
import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import check_cached_decode, check_greedy, check_logits, check_ragged_batch
from models_mla_util import (BASE, GROUPS, MLA, YARN, check_absorption, check_group_routing_differs,
                             check_indexer_prunes, dequantized_reference, ids, make_pair)

transformers = pytest.importorskip("transformers")

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.deepseek_v32 import DeepseekV32ForCausalLM  # noqa: E402
from dynamoe.models.indexer import Indexer  # noqa: E402
from dynamoe.models.moe_block import GatedMLP, SparseMoeBlock  # noqa: E402

VARIANTS = {
    # YaRN, 4 groups / 2 kept, dense first layer, 8 of the keys kept (16 index heads of 16 = 8 roped + 8)
    "yarn": dict(**MLA, **GROUPS, rope_parameters=YARN, index_topk=8, index_head_dim=16, index_n_heads=16),
    # mlp_layer_types choose the dense layer, plain RoPE, raw weights, 12 keys kept (head 24 = 8 roped + 16)
    "mlp_types": dict(**MLA, n_group=2, topk_group=1, norm_topk_prob=False,
                      mlp_layer_types=["sparse", "dense", "sparse"], rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, index_topk=12, index_head_dim=24,
                      index_n_heads=16),
}


def tiny_config(**overrides):
    return transformers.DeepseekV32Config(**{**BASE, **overrides})


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    hf, path = make_pair(transformers.DeepseekV32ForCausalLM, tiny_config(**VARIANTS[request.param]),
                         tmp_path_factory.mktemp(f"dsv32_{request.param}"))
    return request.param, hf, dm.load(path, progress=False)


def test_structure_and_cache(pair):
    name, _, ours = pair
    assert isinstance(ours, DeepseekV32ForCausalLM)
    kinds = [type(layer.mlp) for layer in ours.model.layers]
    want = [GatedMLP, SparseMoeBlock, SparseMoeBlock] if name == "yarn" else [SparseMoeBlock, GatedMLP, SparseMoeBlock]
    assert kinds == want
    d = VARIANTS[name]["index_head_dim"]
    for layer in ours.model.layers:
        attn = layer.self_attn
        assert attn.rope_interleaved and isinstance(attn.indexer, Indexer) and not attn.indexer.rope_interleaved
        assert attn.indexer.topk == VARIANTS[name]["index_topk"]
        assert attn.indexer.weights_proj.weight.dtype == torch.float32  # fp32 head weights, as transformers
    cache = ours.new_cache(2, 16)
    with torch.no_grad():
        ours(ids(tokens=5), cache=cache)
    for layer in cache.layers:
        assert {k: tuple(v.shape) for k, v in layer.items()} == {
            "latent": (1, 2, 16, 32), "k_rope": (1, 2, 16, 8), "index_k": (1, 2, 16, d)}


def test_logits_match_transformers(pair):
    _, hf, ours = pair
    check_logits(hf, ours, ids())


def test_indexer_prunes(pair):
    name, _, ours = pair
    check_indexer_prunes(ours, ids(), VARIANTS[name]["index_topk"])


def test_group_limited_routing_differs_from_plain_topk(pair):
    check_group_routing_differs(pair[1], ids())


def test_greedy_matches_generate(pair):
    _, hf, ours = pair
    check_greedy(hf, ours, ids(seed=1), new_tokens=16)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[2], ids(seed=2), prefill=9)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[2])


def test_weight_absorption_equals_expansion(pair):
    check_absorption(pair[2], ids(seed=3))


def test_requires_q_lora_rank():
    cfg = dm.ModelConfig.from_dict({**tiny_config(**VARIANTS["yarn"]).to_dict(), "q_lora_rank": None})
    with pytest.raises(ValueError, match="q_lora_rank"):
        DeepseekV32ForCausalLM(cfg)


def test_indexer_scores_in_query_chunks(pair, monkeypatch):
    """A long prefill scores its queries in chunks (bounded memory): same selection, same logits."""
    _, _, ours = pair
    x = ids(seed=4)
    with torch.no_grad():
        whole = ours(x)
        monkeypatch.setattr(Indexer, "MAX_SCORES", 2 * 16 * 24 * 5)  # 5 queries per chunk
        chunked = ours(x)
    torch.testing.assert_close(chunked, whole, atol=1e-5, rtol=0)


def test_fp8_checkpoint(tmp_path):
    """`dynamoe quantize --format fp8`: MLA's and the indexer's Linears load packed, and the model matches
    transformers on the dequantized weights (ours dequantized by BlockFP8Weight)."""
    from dynamoe.cli import quantize_checkpoint
    from dynamoe.quant.modules import QuantizedLinear

    _, dense = make_pair(transformers.DeepseekV32ForCausalLM, tiny_config(**VARIANTS["yarn"]), tmp_path / "dense")
    qdir = str(tmp_path / "fp8")
    quantize_checkpoint(dense, qdir, "fp8", log=lambda *a: None)
    model = dm.load(qdir, progress=False)
    idx = model.model.layers[1].self_attn.indexer
    assert all(isinstance(lin, QuantizedLinear) for lin in (idx.wq_b, idx.wk, idx.weights_proj,
                                                            model.model.layers[1].self_attn.kv_b_proj))
    ref = transformers.DeepseekV32ForCausalLM.from_pretrained(
        dequantized_reference(qdir, dense, str(tmp_path / "ref")), dtype=torch.float32).eval()
    x = ids()
    check_logits(ref, model, x)
    check_cached_decode(model, ids(seed=2), prefill=9)


# --- ties at the indexer's top-k boundary: the same keys whatever else is in the batch ------------------------

def test_keep_top_breaks_ties_by_position_whatever_follows():
    from dynamoe.models.indexer import keep_top

    row = torch.tensor([0.5, 0.0, 0.0, 0.9, 0.0, 0.0])                   # relu's exact zeros tie at the boundary
    want = torch.tensor([True, True, False, True, False, False])            # 0.9, 0.5, then the earliest zero
    assert torch.equal(keep_top(row.view(1, 1, 6), 3)[0, 0], want)
    padded = torch.cat([row, torch.full((10,), float("-inf"))]).view(1, 1, 16)
    assert torch.equal(keep_top(padded, 3)[0, 0, :6], want) and not keep_top(padded, 3)[0, 0, 6:].any()
    g = torch.Generator().manual_seed(0)
    for _ in range(20):   # any row, any padding: the kept set of the real keys is the same
        r = torch.randint(0, 3, (1, 2, 12), generator=g).float()         # many ties
        k = int(torch.randint(1, 12, (1,), generator=g))
        p = torch.cat([r, torch.full((1, 2, 7), float("-inf"))], -1)
        assert torch.equal(keep_top(p, k)[..., :12], keep_top(r, k))


@pytest.fixture(scope="module")
def tied_model(tmp_path_factory):
    # 4 indexer heads: every head's dot product negative for many keys -> exact-zero scores tie at the boundary
    cfg = tiny_config(**MLA, n_group=2, topk_group=1, index_topk=6, index_head_dim=16, index_n_heads=4,
                      first_k_dense_replace=0)
    hf, path = make_pair(transformers.DeepseekV32ForCausalLM, cfg, tmp_path_factory.mktemp("dsv32_ties"))
    return dm.load(path, progress=False)


def test_ties_occur_in_this_model(tied_model, monkeypatch):
    seen = []
    scores = Indexer.scores

    def spy(self, *a, **kw):
        seen.append(scores(self, *a, **kw))
        return seen[-1]
    monkeypatch.setattr(Indexer, "scores", spy)
    with torch.no_grad():
        tied_model(ids(tokens=40, seed=3))
    top = torch.cat([s.flatten(0, -2) for s in seen]).sort(dim=-1, descending=True).values
    assert ((top[:, 5] == top[:, 6]) & (top[:, 5] == 0)).any(), "the model must tie at the top-k boundary, or this pins nothing"


def test_greedy_tokens_alone_batched_chunked_and_prefix_cached_agree(tied_model):
    from dynamoe.engine import GenerationEngine, SamplingParams

    greedy = SamplingParams(temperature=0)
    prompt = ids(tokens=20, seed=5)[0].tolist()
    other = ids(tokens=33, seed=6)[0].tolist()

    def run(prompts, **kw):
        e = GenerationEngine(tied_model, max_seq_len=128, max_batch=4, **kw)
        reqs = [e.add_request(p, greedy, 32, ignore_eos=True) for p in prompts]
        e.run_until_done()
        return [r.output_ids for r in reqs], e

    alone, _ = run([prompt], prefix_caching=False)
    batched, _ = run([other, prompt], prefix_caching=False)
    chunked, _ = run([prompt], prefill_chunk=3, prefix_caching=False)
    assert batched[1] == alone[0] and chunked[0] == alone[0]
    e = GenerationEngine(tied_model, max_seq_len=128, max_batch=4)
    first = e.add_request(prompt + [7, 8, 9], greedy, 4, ignore_eos=True)
    e.run_until_done()
    again = e.add_request(prompt, greedy, 32, ignore_eos=True)
    e.run_until_done()
    assert again.stats.cached_tokens > 0 and again.output_ids == alone[0] and first.output_ids
