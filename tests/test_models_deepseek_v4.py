"""DeepSeek-V4 against transformers on tiny random checkpoints: sliding-window, compressed-sparse (overlapping windows
of 2m, a lightning indexer keeping index_topk entries) and heavily compressed attention layers over one shared
key = value head with per-head sinks, the output's RoPE undone and a grouped output projection; residual streams
with hyper-connections; hash-routed (by token id) and sqrt(softplus)- or sigmoid-routed MoE with a selection bias,
clamped SwiGLU experts and a shared expert; the "compress" RoPE plain or YaRN."""
import json
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import check_engine_with_shared_prefix
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, greedy, randomize_
from models_util import ids as _ids
from models_util import save_tiny

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.deepseek_v4 import DeepseekV4ForCausalLM, V4MoeBlock, v4_fields  # noqa: E402

WINDOW = 6
KINDS = ["sliding_attention", "compressed_sparse_attention", "heavily_compressed_attention",
         "compressed_sparse_attention"]
SIZES = dict(vocab_size=VOCAB, hidden_size=64, moe_intermediate_size=32, num_hidden_layers=4, num_attention_heads=4,
             head_dim=32, q_lora_rank=48, n_routed_experts=8, num_experts_per_tok=2, layer_types=KINDS,
             compress_rates={"compressed_sparse_attention": 4, "heavily_compressed_attention": 8}, sliding_window=WINDOW,
             o_groups=2, o_lora_rank=16, index_n_heads=8, index_head_dim=16, index_topk=3, partial_rotary_factor=0.25,
             max_position_embeddings=256, bos_token_id=None, eos_token_id=None)
VARIANTS = {
    # one hash-routed layer, three streams, sqrt(softplus) scores, the default clamp (10)
    "plain": dict(mlp_layer_types=["hash_moe", "moe", "moe", "moe"], hc_mult=3),
    # two hash layers, two streams, sigmoid scores, a clamp that bites, YaRN on the compressed layers, 4 groups
    "yarn": dict(mlp_layer_types=["hash_moe", "hash_moe", "moe", "moe"], hc_mult=2, scoring_func="sigmoid",
                 swiglu_limit=0.5, o_groups=4, routed_scaling_factor=2.0, hc_sinkhorn_iters=5,
                 rope_parameters={"rope_type": "yarn", "factor": 4.0, "original_max_position_embeddings": 32,
                                  "beta_fast": 32.0, "beta_slow": 1.0}),
}


def _randomize(hf, seed):
    randomize_(hf, seed=seed, scales={"lm_head": 0.1, "embed_tokens": 0.5})
    g = torch.Generator().manual_seed(seed + 1)
    with torch.no_grad():
        for name, b in hf.named_buffers():
            if name.endswith("tid2eid"):  # distinct experts per token, as a hash table has
                b.copy_(torch.stack([torch.randperm(b.size(1) * 4, generator=g)[:b.size(1)] for _ in range(b.size(0))]))
            elif name.endswith("e_score_correction_bias"):
                b.copy_(torch.randn(b.shape, generator=g) * 0.3)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    name = request.param
    torch.manual_seed(0)
    hf = transformers.DeepseekV4ForCausalLM(transformers.DeepseekV4Config(**{**SIZES, **VARIANTS[name]})).eval()
    _randomize(hf, seed=1)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"deepseek_v4_{name}"))
    return name, hf, dm.load(path, progress=False), path


def test_structure(pair):
    name, _, ours, _ = pair
    assert type(ours) is DeepseekV4ForCausalLM
    f = ours.fields
    assert f.compress_rates == (0, 4, 8, 4)
    assert f.hash_layers == ((True, False, False, False) if name == "plain" else (True, True, False, False))
    assert f.hc_mult == (3 if name == "plain" else 2)
    attns = [layer.self_attn for layer in ours.model.layers]
    assert [a.compressor is not None for a in attns] == [False, True, True, True]
    assert [a.indexer is not None for a in attns] == [False, True, False, True]
    assert [a.compressor.overlap for a in attns[1:]] == [True, False, True]
    assert all(isinstance(layer.mlp, V4MoeBlock) for layer in ours.model.layers)
    assert f.compress_rope.rope_type == ("yarn" if name == "yarn" else "default")
    assert f.compress_rope.attention_factor == (1.0 if name == "yarn" else None)   # transformers' V4 rule
    assert attns[0].rotary.rope.theta == 10000.0 and attns[1].rotary.rope.theta == 160000.0


def test_logits_match_transformers(pair):
    _, hf, ours, _ = pair
    check_logits(hf, ours, _ids(tokens=30))


def test_greedy_matches_generate(pair):
    _, hf, ours, _ = pair
    check_greedy(hf, ours, _ids(seed=1), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[2], _ids(tokens=30, seed=2), prefill=9, chunk=6)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[2], lengths=(10, 19), decode_steps=8)


def test_engine_generation_matches_generate(pair):
    """The serving engine (continuous batching, chunked prefill, prefix reuse of a shared prompt head) gives
    transformers' greedy tokens per prompt."""
    check_engine_with_shared_prefix(pair[1], pair[2], VOCAB)


def test_the_test_exercises_what_it_claims(pair):
    """Sanity of the test itself: the window, the compressed entries, the indexer's selection, the sinks, the
    hyper-connection mixing, the hash table, the router's scoring and the SwiGLU clamp each change the logits."""
    name, _, ours, _ = pair
    x = _ids(tokens=30)
    with torch.no_grad():
        ref = ours(x)
    layers = ours.model.layers
    attns = [layer.self_attn for layer in layers]

    def differs(undo, redo):
        undo()
        try:
            with torch.no_grad():
                return (ours(x) - ref).abs().max().item() > 1e-3
        finally:
            redo()

    def setting(objs, attr, value):
        old = [getattr(o, attr) for o in objs]
        return (lambda: [setattr(o, attr, value) for o in objs], lambda: [setattr(o, attr, v) for o, v in zip(objs, old)])

    assert differs(*setting(attns, "window", 1000))
    compressed = [a for a in attns if a.compressor is not None]
    assert differs(*setting(compressed[1:2], "compressor", None))          # the HCA layer's entries
    indexers = [a.indexer for a in attns if a.indexer is not None]
    assert differs(*setting(indexers, "topk", 1000))                        # keep every complete entry instead
    sinks = [a.attn_sink for a in attns]
    kept = [s.detach().clone() for s in sinks]
    assert differs(lambda: [s.data.fill_(-1e4) for s in sinks], lambda: [s.data.copy_(k) for s, k in zip(sinks, kept)])
    hcs = [layer.attn_hc for layer in layers]
    kept = [h.base.detach().clone() for h in hcs]
    assert differs(lambda: [h.base.data.zero_() for h in hcs], lambda: [h.base.data.copy_(k) for h, k in zip(hcs, kept)])
    table = layers[0].mlp.hash.tid2eid
    kept = table.clone()
    assert differs(lambda: table.copy_(table.roll(1, dims=0)), lambda: table.copy_(kept))
    moes = [layer.mlp for layer in layers]
    assert differs(*setting(moes, "scoring", "sqrtsoftplus" if name == "yarn" else "sigmoid"))
    if name == "yarn":
        experts = [m.moe.experts for m in moes] + [m.moe.shared_experts for m in moes]
        assert differs(*setting(experts, "limit", 1e4))


def test_hub_checkpoint_names_load_alike(pair, tmp_path):
    """The hub's files name the tensors at the top level (embed, layers.*, norm, hc_head_*, head) and carry the
    tensors of a multi-token-prediction layer (mtp.*; without its e_proj no head is built, they stay unread): they
    load to the same model."""
    _, _, ours, path = pair
    tensors = load_file(os.path.join(path, "model.safetensors"))
    hub = {}
    for k, v in tensors.items():
        k = k.removeprefix("model.")
        k = {"embed_tokens.weight": "embed.weight"}.get(k, k)
        hub[k.replace("hc_head.hc_", "hc_head_") if k.startswith("hc_head.") else k] = v
    hub["mtp.0.attn.wq_a.weight"] = torch.zeros(2, 2)
    save_file(hub, str(tmp_path / "model.safetensors"))
    with open(os.path.join(path, "config.json")) as f:
        (tmp_path / "config.json").write_text(f.read())
    again = dm.load(str(tmp_path), progress=False)
    x = _ids()
    with torch.no_grad():
        torch.testing.assert_close(again(x), ours(x), atol=0, rtol=0)


def test_moe_kernel_refuses_with_reason(pair):
    block = pair[2].model.layers[1].mlp
    fused = block.decode_fused(torch.zeros(1, 64), pair[2].model.layers[1].post_attention_layernorm)
    assert fused.weights is None and "hash routing" in fused.extra


def test_config_refusals():
    base = {"model_type": "deepseek_v4", "vocab_size": 8, "hidden_size": 16, "num_hidden_layers": 2,
            "num_attention_heads": 2, "head_dim": 16, "q_lora_rank": 8, "moe_intermediate_size": 8,
            "n_routed_experts": 4, "num_experts_per_tok": 1, "o_groups": 2, "o_lora_rank": 4}
    assert dm.ModelConfig.from_dict(base).layer_types == ("heavily_compressed_attention",) * 2
    legacy = dm.ModelConfig.from_dict({**base, "compress_ratios": [0, 4, 128], "num_hash_layers": 1,
                                       "compress_rate_csa": 2})
    assert legacy.layer_types == ("sliding_attention", "compressed_sparse_attention")
    assert v4_fields(legacy).compress_rates == (0, 2) and v4_fields(legacy).hash_layers == (True, False)
    for bad, field in (({"layer_types": ["full_attention"] * 2}, "layer_types"),
                       ({"compress_ratios": [0, 3]}, "compress_ratios"),
                       ({"scoring_func": "softmax"}, "scoring_func")):
        with pytest.raises(ValueError, match=field):
            dm.ModelConfig.from_dict({**base, **bad})
    for bad, field in (({"mlp_layer_types": ["dense", "moe"]}, "mlp_layer_types"),
                       ({"o_groups": 3}, "o_groups"), ({"hc_mult": 0}, "hc_mult"),
                       ({"compress_rates": {"heavily_compressed_attention": 0}}, "compress_rates")):
        with pytest.raises(ValueError, match=field):
            v4_fields(dm.ModelConfig.from_dict({**base, **bad}))


def test_saved_config_parses_as_written(pair):
    """transformers saves its derived fields (nested rope_parameters, compress_rates, qk_rope_head_dim): read back."""
    _, hf, ours, path = pair
    with open(os.path.join(path, "config.json")) as f:
        saved = json.load(f)
    assert "main" in saved["rope_parameters"]
    assert ours.config.layer_types == tuple(hf.config.layer_types)
    assert greedy(ours, _ids(rows=1), 2).shape == (1, 26)


def test_cache_size_is_what_the_config_says(pair):
    """kv_elements_per_position (what the server sizes the cache pool by) counts every tensor the layers cache."""
    ours = pair[2]
    cache = ours.new_cache(1, 32)
    with torch.no_grad():
        ours(_ids(rows=1, tokens=20), cache=cache)
    assert cache.bytes_per_block == ours.config.kv_elements_per_position() * cache.block_size * 4


def test_fp8_checkpoint(pair, tmp_path):
    """`dynamoe quantize --format fp8` of the checkpoint (the hub ships V4 in blockwise FP8) loads with the attention
    Linears packed (the grouped output projection dequantizes its wo_a) and matches the dequantize-then-fp32
    reference of transformers."""
    from dynamoe.cli import quantize_checkpoint
    from dynamoe.quant.modules import QuantizedLinear
    from models_mla_util import dequantized_reference

    _, hf, _, path = pair
    qdir = str(tmp_path / "fp8")
    quantize_checkpoint(path, qdir, "fp8", log=lambda *a: None)
    model = dm.load(qdir, progress=False)
    attn = model.model.layers[1].self_attn
    assert all(isinstance(lin, QuantizedLinear) for lin in (attn.wq_a, attn.wq_b, attn.wkv, attn.wo_a, attn.wo_b,
                                                            attn.compressor.wkv, attn.indexer.wq_b))
    ref = transformers.DeepseekV4ForCausalLM.from_pretrained(
        dequantized_reference(qdir, path, str(tmp_path / "ref")), dtype=torch.float32).eval()
    x = _ids()
    with torch.no_grad():
        got, want, orig = model(x), ref(x).logits, hf(x).logits
    assert (want - orig).abs().max() > 1e-3  # the quantization did change the model
    torch.testing.assert_close(got, want, atol=1e-4, rtol=0)
