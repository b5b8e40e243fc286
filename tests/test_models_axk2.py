"""A.X-K2 against transformers on tiny random checkpoints: DeepSeek-V3.2's sparse MLA whose query projection also
gives each head an output gate, self-gated RMSNorms before the attention and the MoE blocks, a dense first layer,
sigmoid routing with a selection bias and shared experts; the MLP kinds from the hub's first_k_dense_replace /
moe_layer_freq."""
import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch
from models_mla_util import BASE, MLA, edit_config, ids, make_pair

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.axk2 import AXK2ForCausalLM, SelfGatedRMSNorm  # noqa: E402
from dynamoe.models.norms import RMSNorm  # noqa: E402

SIZES = {k: v for k, v in BASE.items() if k != "first_k_dense_replace"}
INDEX = dict(index_topk=6, index_head_dim=16, index_n_heads=8)
VARIANTS = {
    # the first layer dense, the default gate rank
    "plain": dict(**MLA, **INDEX, mlp_layer_types=["dense", "sparse", "sparse"]),
    # MoE every other layer from 1 (the hub's moe_layer_freq), a gate rank of 4, two shared experts, YaRN
    "freq": dict(**MLA, **INDEX, num_hidden_layers=4, mlp_layer_types=["dense", "dense", "sparse", "dense"],
                 gated_norm_rank=4, n_shared_experts=2,
                 rope_parameters={"rope_type": "yarn", "rope_theta": 10000.0, "factor": 4.0,
                                  "original_max_position_embeddings": 64, "mscale": 1.0, "mscale_all_dim": 1.0}),
}


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    name = request.param
    hf, path = make_pair(transformers.AXK2ForCausalLM, transformers.AXK2Config(**{**SIZES, **VARIANTS[name]}),
                         tmp_path_factory.mktemp(f"axk2_{name}"))
    if name == "freq":  # the hub's spelling of the same MLP kinds
        edit_config(path, mlp_layer_types=None, first_k_dense_replace=1, moe_layer_freq=2)
    return name, hf, dm.load(path, progress=False), path


def test_structure(pair):
    name, hf, ours, _ = pair
    assert type(ours) is AXK2ForCausalLM
    layers = ours.model.layers
    moe = [t == "sparse" for t in hf.config.mlp_layer_types]
    assert [ours.config.is_moe_layer(i) for i in range(len(layers))] == moe
    assert all(type(layer.input_layernorm) is SelfGatedRMSNorm for layer in layers)
    assert [type(layer.post_attention_layernorm) for layer in layers] == [SelfGatedRMSNorm if m else RMSNorm
                                                                          for m in moe]
    attn = layers[0].self_attn
    assert attn.gated_queries and attn.rope_interleaved and attn.indexer is not None and not attn.indexer.rope_interleaved
    assert layers[0].input_layernorm.W_down.out_features == (16 if name == "plain" else 4)


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


def test_the_test_exercises_what_it_claims(pair):
    """Sanity of the test itself: the norms' gates, the output gates and the indexer's selection each change the
    logits (so parity above pins them)."""
    _, _, ours, _ = pair
    x = ids()
    with torch.no_grad():
        ref = ours(x)
    layers = ours.model.layers

    def differs(undo, redo):
        undo()
        try:
            with torch.no_grad():
                return (ours(x) - ref).abs().max().item() > 1e-3
        finally:
            redo()

    ups = [layer.input_layernorm.W_up.weight for layer in layers]
    kept = [w.detach().clone() for w in ups]
    assert differs(lambda: [w.data.zero_() for w in ups], lambda: [w.data.copy_(k) for w, k in zip(ups, kept)])
    attns = [layer.self_attn for layer in layers]
    q_b = [a.q_b_proj.weight for a in attns]
    kept = [w.detach().clone() for w in q_b]

    def zero_gates():  # the gate rows of each head: the last v of its n + r + v
        for a, w in zip(attns, q_b):
            w.data.view(a.num_heads, a.qk_dim + a.v_dim, -1)[:, a.qk_dim:].zero_()
    assert differs(zero_gates, lambda: [w.data.copy_(k) for w, k in zip(q_b, kept)])
    indexers = [a.indexer for a in attns]
    old = [i.topk for i in indexers]
    assert differs(lambda: [setattr(i, "topk", 1000) for i in indexers],
                   lambda: [setattr(i, "topk", t) for i, t in zip(indexers, old)])


def test_limiting_groups_is_refused():
    base = {"model_type": "axk2", "vocab_size": 8, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
            "n_routed_experts": 8, "num_experts_per_tok": 2}
    assert dm.ModelConfig.from_dict(base).n_group == 1
    AXK2ForCausalLM(dm.ModelConfig.from_dict({**base, "n_group": 2, "topk_group": 2}), dtype=None)
    with pytest.raises(ValueError, match="n_group"):
        AXK2ForCausalLM(dm.ModelConfig.from_dict({**base, "n_group": 4, "topk_group": 2}))
