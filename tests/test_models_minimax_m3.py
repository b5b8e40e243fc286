"""MiniMax-M3's language model (minimax_m3_vl_text) against transformers on tiny random checkpoints: full and
block-sparse attention layers (a lightning indexer choosing key blocks per KV group, its keys cached), Gemma-style
norms, dense and MoE SwiGLU-OAI MLPs (sigmoid routing with a selection bias, a route scale, a shared expert); the
indexer shown to select (and to matter), prefix caching in the engine over the indexer's cached keys."""
import copy

import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_util import ids as _ids

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.minimax_m3 import BlockIndexer, GateUpMLP, M3Attention  # noqa: E402
from dynamoe.models.moe_block import SparseMoeBlock  # noqa: E402

# blocks of 4 keys, 2 chosen per query (one of them the query's own): over 24 tokens most blocks are left out;
# 2F = 24 != D = 32 (the stacked experts' orientation is unambiguous)
SIZES = dict(vocab_size=VOCAB, hidden_size=32, intermediate_size=12, dense_intermediate_size=40,
             shared_intermediate_size=24, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
             head_dim=16, num_local_experts=4, num_experts_per_tok=2, routed_scaling_factor=1.5,
             layer_types=["full_attention", "minimax_m3_sparse", "minimax_m3_sparse"],
             mlp_layer_types=["dense", "sparse", "sparse"], index_n_heads=2, index_head_dim=24, index_block_size=4,
             index_topk_blocks=2, index_local_blocks=1, max_position_embeddings=256, bos_token_id=None,
             eos_token_id=None)


def _build(**extra):
    torch.manual_seed(0)
    hf = transformers.MiniMaxM3VLForCausalLM(transformers.MiniMaxM3VLTextConfig(**{**SIZES, **extra})).eval()
    randomize_(hf, seed=1)
    g = torch.Generator().manual_seed(2)
    with torch.no_grad():   # (a buffer: randomize_ leaves it at zero) a selection bias that changes the choice
        for layer in hf.model.layers:
            if hasattr(layer.mlp, "gate"):
                layer.mlp.gate.e_score_correction_bias.copy_(torch.randn(4, generator=g) * 0.3)
    return hf


@pytest.fixture(scope="module")
def pair(tmp_path_factory):
    hf = _build()
    path = save_tiny(hf, tmp_path_factory.mktemp("minimax_m3"))
    return hf, dm.load(path, progress=False), path


def test_structure(pair):
    _, ours, _ = pair
    cfg = ours.config
    assert cfg.layer_types == ("full_attention", "minimax_m3_sparse", "minimax_m3_sparse")
    layers = ours.model.layers
    assert all(type(layer.self_attn) is M3Attention for layer in layers)
    assert [type(layer.self_attn.indexer) for layer in layers] == [type(None), BlockIndexer, BlockIndexer]
    assert type(layers[0].mlp) is GateUpMLP and all(isinstance(layer.mlp, SparseMoeBlock) for layer in layers[1:])
    assert layers[1].self_attn.q_norm.zero_centered and ours.model.norm.zero_centered
    assert ours.model.rotary_emb.inv_freq.numel() * 2 == 16   # the whole head (transformers ignores rotary_dim)
    assert cfg.kv_elements_per_position() == 3 * 2 * 2 * 16 + 2 * 24   # k, v everywhere + the indexer keys


def test_logits_match_transformers(pair):
    hf, ours, _ = pair
    check_logits(hf, ours, _ids())


def test_greedy_matches_generate(pair):
    hf, ours, _ = pair
    check_greedy(hf, ours, _ids(seed=1), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[1], _ids(seed=2), prefill=9)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[1])


def test_full_attention_moe_layers_decode_with_their_shared_mlp(tmp_path):
    """Full-attention layers take the fused attention kernel (zero-centred q/k norms); an MoE block with its shared
    GateUpMLP refuses the fused MoE kernel, so a decode plan runs those layers as modules (the shared MLP included):
    cached decode equals recompute and the greedy tokens transformers'."""
    hf = _build(layer_types=["full_attention"] * 3, mlp_layer_types=["sparse"] * 3)
    ours = dm.load(save_tiny(hf, tmp_path), progress=False)
    layer = ours.model.layers[0]
    assert layer.self_attn.decode_fused(layer.input_layernorm, torch.float32).weights is not None
    check_cached_decode(ours, _ids(seed=2), prefill=9)
    check_greedy(hf, ours, _ids(seed=1), new_tokens=16)
    desc = ours.__dict__["_plan"][2].describe()
    assert desc.startswith("0 of 3 layers fused") and "shared GateUpMLP" in desc, desc


def test_indexer_selects_blocks():
    """The chosen keys: causal, whole blocks by absolute position, the query's own block always, at most
    index_topk_blocks blocks per query and group -- and fewer than all keys once a query sees more blocks."""
    torch.manual_seed(3)
    idx = BlockIndexer(32, 2, 8, block_size=4, topk_blocks=2, local_blocks=1, layer_idx=0).eval()
    x, pos = torch.randn(1, 21, 32), torch.arange(21)[None]
    from dynamoe.models.rope import RotaryEmbedding
    from dynamoe.models.config import RopeConfig

    cos, sin = RotaryEmbedding(RopeConfig(), 8, 64)(pos, torch.float32)
    with torch.no_grad():
        allowed = idx(x, pos, cos, sin, None, None, None)[0]                       # [G, T, L]
    assert allowed.shape == (2, 21, 21) and not allowed.triu(1).any()          # causal
    for t in range(21):
        own = t // 4
        assert allowed[:, t, own * 4:t + 1].all()                                  # its own block, up to itself
        past = allowed[:, t, :own * 4].reshape(2, own, 4)
        assert torch.equal(past.all(-1), past.any(-1))                             # earlier blocks: whole or not at all
        assert (past.all(-1).sum(-1) <= 1).all()                                   # two blocks at most, with its own
    assert not allowed[:, 20].all()


def test_engine_generation_matches_generate(pair):
    """The serving engine (continuous batching, chunked prefill, prefix caching over the cached indexer keys) gives
    transformers' greedy tokens per prompt; the third prompt shares the first's prefix."""
    from dynamoe.engine import GenerationEngine, SamplingParams

    hf, ours = pair[0], pair[1]
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (19, 6)]
    prompts.append(prompts[0][:16] + [3, 5])
    engine = GenerationEngine(ours, None, max_seq_len=48, max_batch=2, prefill_chunk=8)
    for group in (prompts[:2], prompts[2:]):   # (the shared prefix is cached by the time the third arrives)
        reqs = [engine.add_request(p, SamplingParams(temperature=0), 10, ignore_eos=True) for p in group]
        engine.run_until_done()
        for p, r in zip(group, reqs):
            want = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                               max_new_tokens=10, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
            assert r.output_ids == want
    assert reqs[0].stats.cached_tokens == 16   # the third prompt's first block came from the cache


def test_each_feature_matters(pair):
    """Dropping any of the particulars moves the logits far from transformers': the indexer's selection, its local
    blocks, the route scale's shared expert, the Gemma-style norms."""
    hf, ours, _ = pair
    ids = _ids(seed=6)

    def far(edit):
        m = copy.deepcopy(ours)
        with torch.no_grad():
            for layer in m.model.layers:
                edit(layer)
            return float((m(ids) - hf(ids).logits).abs().max())

    assert far(lambda layer: None) < 1e-4
    assert far(lambda layer: setattr(layer.self_attn, "indexer", None)) > 1e-2
    assert far(lambda layer: setattr(layer.self_attn.indexer, "local_blocks", 0)
               if layer.self_attn.indexer is not None else None) > 1e-2
    assert far(lambda layer: layer.mlp.shared_experts.down_proj.weight.zero_()
               if isinstance(layer.mlp, SparseMoeBlock) else None) > 1e-2
    assert far(lambda layer: setattr(layer.self_attn.q_norm, "zero_centered", False)) > 1e-2


def test_bad_config():
    from dynamoe.models.registry import builder_for

    base = {"model_type": "minimax_m3_vl_text", **{k: v for k, v in SIZES.items() if v is not None}}
    for extra, field in (({"index_n_heads": 1}, "index_n_heads"), ({"index_head_dim": 8}, "index_head_dim"),
                         ({"index_block_size": 0}, "index_block_size")):
        cfg = dm.ModelConfig.from_dict({**base, **extra})
        with pytest.raises(ValueError, match=field):
            builder_for(cfg)(cfg)
    with pytest.raises(ValueError, match="moe_layer_freq"):
        dm.ModelConfig.from_dict({**{k: v for k, v in base.items() if k != "mlp_layer_types"}, "moe_layer_freq": [1, 2, 1]})


@pytest.fixture(scope="module")
def wrapped(tmp_path_factory):
    """The multimodal checkpoint (minimax_m3_vl: the text model under language_model.*, a vision tower, a patch-merge
    MLP and a projector beside it)."""
    text = {k: v for k, v in SIZES.items()}
    vision = dict(hidden_size=16, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2, patch_size=4,
                  image_size=16)
    torch.manual_seed(0)
    hf = transformers.MiniMaxM3SparseForConditionalGeneration(
        transformers.MiniMaxM3VLConfig(text_config=text, vision_config=vision)).eval()
    randomize_(hf, seed=1)
    path = save_tiny(hf, tmp_path_factory.mktemp("minimax_m3_vl"))
    return hf, dm.load(path, progress=False)


def test_wrapper_loads_the_text_model(wrapped):
    hf, ours = wrapped
    assert ours.config.model_type == "minimax_m3_vl" and ours.config.text_config_nested
    assert type(ours).__name__ == "MiniMaxM3ForCausalLM"
    assert set(ours.unused_checkpoint_prefixes) >= {"vision_tower.", "multi_modal_projector.", "patch_merge_mlp."}
    check_logits(hf, ours, _ids())
    check_greedy(hf, ours, _ids(seed=1), new_tokens=16)
