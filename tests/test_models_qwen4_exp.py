"""Qwen4-Exp's text model against transformers' Qwen4ExpForCausalLM / Qwen4ExpForConditionalGeneration on tiny random
checkpoints: Qwen3.5's Gated DeltaNet (silu or sigmoid output gate) and gated attention through the QSA indexer (the
best blocks of pooled keys plus the query's open block), gated residuals over hyper-connection streams, per-layer
hashed n-gram embeddings with their dilated convolutions (n-grams cut at eos), MoE with a gated shared expert; the
cache (recurrent states, PLE states, indexer keys) under chunked prefill, decode and rows at different positions; the
vision tower skipped, images refused by the server; a text-only config loaded alike."""
import json
import logging
import os

import pytest
import torch
from safetensors.torch import load_file, save_file

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_cached_decode, check_greedy, check_logits, check_ragged_batch, greedy, randomize_
from models_util import ids as _ids
from models_util import save_tiny

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.hyper_connections import GatedStreamMixer  # noqa: E402
from dynamoe.models.linear_attention import GatedDeltaNet  # noqa: E402
from dynamoe.models.ngram_embedding import NGramEmbedding, head_vocab_sizes, layer_multipliers  # noqa: E402
from dynamoe.models.qwen3_next import SharedExpertMoeBlock  # noqa: E402
from dynamoe.models.qwen4_exp import QSAGatedAttention, Qwen4DecoderLayer, Qwen4ExpForCausalLM  # noqa: E402

EOS = 3
TEXT = dict(vocab_size=VOCAB, hidden_size=32, moe_intermediate_size=16, shared_expert_intermediate_size=24,
            num_hidden_layers=4, num_attention_heads=4, num_key_value_heads=2, head_dim=16, linear_num_key_heads=2,
            linear_num_value_heads=4, linear_key_head_dim=8, linear_value_head_dim=8, num_experts=8,
            num_experts_per_tok=2, max_position_embeddings=256, eos_token_id=EOS, hc_lowrank=8, ple_embed_dim=16,
            heads_per_ngram=2, ngram_vocab_size_base=50, split_ngram_parts=3, indexer_n_heads=8, indexer_kv_heads=1,
            indexer_head_dim=12, indexer_budget=8, indexer_compress_ratio=4,
            rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5})
VISION = dict(depth=1, hidden_size=32, num_heads=2, intermediate_size=32, out_hidden_size=32)
VARIANTS = {
    # the text model alone: two streams, PLE on both linear layers, trigrams, the silu output gate, the n-gram tables
    # in 12 checkpoint chunks (shard_10 sorts before shard_2 by name: read in chunk order)
    "text": dict(layer_types=["linear_attention", "full_attention", "linear_attention", "full_attention"], hc_count=2,
                 ple_layer_ids=[1, 3], split_ngram_parts=12),
    # in the vision-language wrapper: three streams, 4-grams on one layer, the sigmoid output gate, layer kinds from
    # full_attention_interval, a shorter PLE conv
    "wrapped": dict(full_attention_interval=2, hc_count=3, ple_layer_ids=[3], ngram_size=4, heads_per_ngram=1,
                    ple_embed_dim=15, ple_conv_kernel_size=3, output_gate_type="sigmoid", split_ngram_parts=5),
}


def _with_eos(x: torch.Tensor, every: int = 7) -> torch.Tensor:
    """Token ids with an eos every few positions (the n-grams restart after each)."""
    x = x.clone()
    x[:, 5::every] = EOS
    return x


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    name = request.param
    text = {**TEXT, **VARIANTS[name]}
    torch.manual_seed(0)
    if name == "text":
        hf = transformers.Qwen4ExpForCausalLM(transformers.Qwen4ExpTextConfig(**text)).eval()
    else:
        cfg = transformers.Qwen4ExpConfig(text_config=text, vision_config=VISION)
        hf = transformers.Qwen4ExpForConditionalGeneration(cfg).eval()
    randomize_(hf, seed=1, scales={"lm_head": 0.1})
    g = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for n, p in hf.named_parameters():
            if n.endswith("A_log"):
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
            elif "ple.conv1d" in n:   # (transformers initialises it to zeros; make the conv matter)
                p.copy_(torch.randn(p.shape, generator=g) * 0.5)
    path = save_tiny(hf, tmp_path_factory.mktemp(f"qwen4_exp_{name}"))
    hf.generation_config.eos_token_id = None   # (generate on past an eos, as dynamoe's greedy helpers do)
    return name, hf, dm.load(path, progress=False), path


def test_structure(pair):
    name, hf, ours, _ = pair
    assert type(ours) is Qwen4ExpForCausalLM and ours.recurrent_state
    assert ours.config.text_config_nested == (name == "wrapped")
    layers = ours.model.layers
    assert all(type(layer) is Qwen4DecoderLayer for layer in layers)
    kinds = [type(layer.mixer) for layer in layers]
    assert kinds == [GatedDeltaNet, QSAGatedAttention] * 2
    assert all(type(layer.mlp) is SharedExpertMoeBlock for layer in layers)
    assert [layer.ple is not None for layer in layers] == ([True, False, True, False] if name == "text"
                                                          else [False, False, True, False])
    streams = 2 if name == "text" else 3
    assert type(ours.model.norm) is GatedStreamMixer and ours.model.norm.block_inject_weight is None
    assert ours.model.norm.streams == streams and ours.model.embed_tokens.streams == streams
    assert layers[0].linear_attn.norm.activation == ("silu" if name == "text" else "sigmoid")
    indexer = layers[1].self_attn.indexer
    assert (indexer.n_heads, indexer.head_dim, indexer.block, indexer.keep) == (8, 12, 4, 2)
    assert ours.model.rotary_emb.inv_freq.numel() * 2 == 8    # RoPE on half of the 16 head dims
    # the cache sizing counts what the layers store: keys, values and the QSA's raw and block keys per position (two
    # indexed layers); the linear layers' conv windows and states, the PLE layers' conv windows per sequence
    assert ours.config.kv_elements_per_position() == 2 * (2 * 2 * 16 + 2 * 12)
    with torch.no_grad():
        cache = ours.new_cache(3, 16)
        ours(_ids(rows=1, tokens=9), cache=cache)
    paged = sum(t[:, 0, 0].numel() for t in cache._paged)
    assert paged == ours.config.kv_elements_per_position()
    sizes = {"conv_state": sum(layer[n][0].numel() for layer in cache.layers for n in ("conv_state", "ple_conv_state")
                               if n in layer),
             "recurrent_state": sum(layer["recurrent_state"][0].numel() for layer in cache.layers
                                    if "recurrent_state" in layer)}
    ple = 2 * streams * 32 * 3 * 3 if name == "text" else streams * 32 * 2 * 4
    assert ours.config.state_elements_per_sequence() == sizes == {"conv_state": 2 * 64 * 3 + ple,
                                                                  "recurrent_state": 2 * 4 * 8 * 8}


def test_ngram_tables_and_hashes_match_transformers(pair):
    """The derived hash multipliers, prime sizes and offsets equal the buffers transformers saved; the table's
    checkpoint chunks are kept as they are (torch.chunk's)."""
    name, _, ours, path = pair
    tensors = load_file(os.path.join(path, "model.safetensors"))
    prefix = "model.language_model." if name == "wrapped" else "model."
    for i, layer in enumerate(ours.model.layers):
        if layer.ple is None:
            continue
        table: NGramEmbedding = layer.ple.ple_embedding
        base = f"{prefix}layers.{i}.ple.ple_embedding."
        assert table.multipliers == tensors[base + "layer_multipliers"].tolist()
        assert table.sizes == tensors[base + "ngram_heads_vocab_sizes"].tolist()
        assert table.offsets == tensors[base + "ngram_heads_offsets"].tolist()
        shards = sorted(n for n in tensors if n.startswith(base + "ngram_embedding.shard_"))
        assert len(shards) == len(list(table.ngram_embedding.children()))
    assert head_vocab_sizes(50, 3, 1) == [67, 71, 73]   # (the 4th to 6th primes >= 50: 53, 59, 61, 67, 71, 73)
    assert all(m % 2 == 1 and m < (1 << 63) // 128 for m in layer_multipliers(128, 3, 2, 1234))


def test_logits_match_transformers(pair):
    _, hf, ours, _ = pair
    check_logits(hf, ours, _with_eos(_ids(tokens=30)))


def test_greedy_matches_generate(pair):
    _, hf, ours, _ = pair
    check_greedy(hf, ours, _with_eos(_ids(seed=1)), new_tokens=32)


def test_cached_decode_equals_recompute(pair):
    check_cached_decode(pair[2], _with_eos(_ids(tokens=30, seed=2)), prefill=9, chunk=6)


def _states(cache, slot):
    return {(i, name): t[slot].clone() for i, layer in enumerate(cache.layers) for name, t in layer.items()
            if name in ("conv_state", "recurrent_state", "ple_conv_state", "ngram_context")}


def test_chunked_prefill_equals_one_pass(pair):
    """Prefill chunks shorter than the n-gram context, the convolutions' windows and a QSA block give the one-pass
    logits and leave the same states; decoding on from either gives the same logits."""
    ours = pair[2]
    ids = _with_eos(_ids(rows=1, tokens=30, seed=3), every=6)
    with torch.no_grad():
        one = ours.new_cache(1, 40)
        full = ours(ids[:, :28], cache=one)
        parts_cache = ours.new_cache(1, 40)
        parts = [ours(ids[:, a:b], cache=parts_cache) for a, b in ((0, 1), (1, 3), (3, 13), (13, 14), (14, 28))]
        torch.testing.assert_close(torch.cat(parts, 1), full, atol=1e-4, rtol=0)
        s1, s2 = _states(one, 0), _states(parts_cache, 0)
        assert {name for _, name in s1} == {"conv_state", "recurrent_state", "ple_conv_state", "ngram_context"}
        for key in s1:
            torch.testing.assert_close(s2[key], s1[key], atol=1e-4, rtol=0)
        torch.testing.assert_close(ours(ids[:, 28:], cache=parts_cache), ours(ids[:, 28:], cache=one), atol=1e-4,
                                   rtol=0)


def test_scoring_in_query_chunks_changes_nothing(pair, monkeypatch):
    """A long prefill's indexer scores its queries in chunks (bounded memory): the same logits as in one piece."""
    from dynamoe.models.qsa_indexer import QSAIndexer

    ours, x = pair[2], _with_eos(_ids(tokens=30, seed=6))
    with torch.no_grad():
        whole = ours(x)
        monkeypatch.setattr(QSAIndexer, "MAX_SCORES", 2 * 8 * 7 * 4)    # 4 queries per chunk (B 2, I 8, W 7)
        torch.testing.assert_close(ours(x), whole, atol=1e-5, rtol=0)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[2], lengths=(10, 19), decode_steps=8)


def test_rows_at_different_positions_in_one_chunk(pair):
    """One forward of 5 tokens for two rows: one starts a sequence in a slot whose buffers hold junk, the other
    continues at position 11; each row equals the row run alone."""
    ours = pair[2]
    a, b = _ids(rows=1, tokens=5, seed=4), _with_eos(_ids(rows=1, tokens=16, seed=5))
    with torch.no_grad():
        alone_a, alone_b = ours(a), ours(b)[:, 11:]
        cache = ours.new_cache(3, 32)
        ours(b[:, :11], cache=cache, slots=torch.tensor([0]))
        ours(_ids(rows=1, tokens=7, seed=6), cache=cache, slots=torch.tensor([2]))
        for layer in cache.layers:
            for n, t in layer.items():
                if not any(t is p for p in cache._paged) and n != "state_position":
                    t[2].fill_(7)
        cache.free(2)
        together = ours(torch.cat([a, b[:, 11:]]), cache=cache, slots=torch.tensor([2, 0]))
    torch.testing.assert_close(together, torch.cat([alone_a, alone_b]), atol=1e-4, rtol=0)


def test_engine_generates_transformers_tokens(pair):
    """dynamoe's engine (prefix reuse off: recurrent state) with 2 slots for 3 requests: chunked prefill, rows at
    different positions and a reused slot give each request transformers' greedy tokens."""
    from dynamoe.engine import GenerationEngine, SamplingParams

    hf, ours = pair[1], pair[2]
    g = torch.Generator().manual_seed(11)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (7, 18, 4)]
    prompts[1][6] = EOS
    engine = GenerationEngine(ours, None, max_seq_len=48, max_batch=2, prefill_chunk=5)
    reqs = [engine.add_request(p, SamplingParams(temperature=0), 10, ignore_eos=True) for p in prompts]
    engine.run_until_done()
    for p, r in zip(prompts, reqs):
        want = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=10, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert r.output_ids == want


def test_bf16_tracks_transformers_bf16(pair):
    """bf16 weights: cached decode runs (the recurrent state fp32, the conv windows in the cache's dtype, the n-gram
    context int64), and the logits are no further from the fp32 ones than transformers' own bf16 logits are."""
    import copy

    name, hf, _, path = pair
    ours = dm.load(path, dtype="bfloat16", progress=False)
    ids = _with_eos(_ids(seed=2))
    with torch.no_grad():
        ref32, hf16 = hf(ids).logits, copy.deepcopy(hf).to(torch.bfloat16)(ids).logits.float()
        full = ours(ids)
        cache = ours.new_cache(2, 32)
        steps = [ours(ids[:, :9], cache=cache)] + [ours(ids[:, t:t + 1], cache=cache) for t in range(9, 24)]
    assert full.dtype == torch.bfloat16
    ple = next(i for i, layer in enumerate(ours.model.layers) if layer.ple is not None)
    assert cache.layers[ple]["recurrent_state"].dtype == torch.float32
    assert cache.layers[ple]["ple_conv_state"].dtype == torch.bfloat16
    assert cache.layers[ple]["ngram_context"].dtype == torch.long
    ours_err, hf_err = (full.float() - ref32).abs().max(), (hf16 - ref32).abs().max()
    assert ours_err <= 1.5 * hf_err, (ours_err, hf_err)
    assert (torch.cat(steps, 1).float() - ref32).abs().max() <= 1.5 * hf_err


def test_the_test_exercises_what_it_claims(pair):
    """Sanity of the test itself: the indexer's selection, the PLE (its n-grams' eos cut, their hash, its conv, the
    whole of it), the mixers' inject and mix weights, the output gate's activation and the shared expert each change
    the logits (so the parity above pins them)."""
    name, _, ours, _ = pair
    x = _with_eos(_ids(tokens=30))
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

    def setting(objs, attr, value):
        old = [getattr(o, attr) for o in objs]
        return (lambda: [setattr(o, attr, value) for o in objs], lambda: [setattr(o, attr, v) for o, v in zip(objs, old)])

    def zeroed(params):
        kept = [p.detach().clone() for p in params]
        return (lambda: [p.data.zero_() for p in params], lambda: [p.data.copy_(k) for p, k in zip(params, kept)])

    indexers = [layer.self_attn.indexer for layer in layers if hasattr(layer, "self_attn")]
    assert differs(*setting(indexers, "keep", 1000))                 # every complete block instead of the best
    ples = [layer.ple for layer in layers if layer.ple is not None]
    assert differs(*setting(ples, "eos", EOS + 1))                   # n-grams no longer cut at the eos tokens
    assert differs(*zeroed([p.conv1d.weight for p in ples]))
    assert differs(*zeroed([p.value_proj.weight for p in ples]))
    tables = [p.ple_embedding for p in ples]
    assert differs(*setting(tables, "multipliers", [1] * tables[0].ngram_size))   # another hash of the n-grams
    assert differs(*zeroed([layer.mlp_hyper_connection.block_inject_weight.weight for layer in layers]))
    assert differs(*zeroed([layer.attn_hyper_connection.input_mix_weight_up.weight for layer in layers]))  # plain mean
    norms = [layer.linear_attn.norm for layer in layers if hasattr(layer, "linear_attn")]
    assert differs(*setting(norms, "activation", "silu" if name == "wrapped" else "sigmoid"))
    assert differs(*zeroed([layer.mlp.shared_expert_gate.weight for layer in layers]))


def test_vision_tower_is_skipped_and_logged(pair, caplog):
    name, *_, path = pair
    with caplog.at_level(logging.INFO, logger="dynamoe.models.loader"):
        dm.load(path, progress=False)
    notes = [r.getMessage() for r in caplog.records if "not loading" in r.getMessage()]
    if name == "text":
        assert notes == []
    else:
        assert len(notes) == 1 and notes[0].startswith("qwen4_exp: not loading") and "model.visual.*" in notes[0], notes


@pytest.mark.parametrize("pair", ["wrapped"], indirect=True)
def test_text_config_loads_alike(pair, tmp_path):
    """The wrapper's text_config as a qwen4_exp_text config.json (our names) loads to the same model."""
    name, _, ours, path = pair
    with open(os.path.join(path, "config.json")) as f:
        text = json.load(f)["text_config"]
    (tmp_path / "config.json").write_text(json.dumps(text))
    tensors = load_file(os.path.join(path, "model.safetensors"))
    save_file({k.replace("model.language_model.", "model."): v for k, v in tensors.items()
               if not k.startswith("model.visual.")}, str(tmp_path / "model.safetensors"))
    again = dm.load(str(tmp_path), progress=False)
    assert again.config.model_type == "qwen4_exp_text" and not again.config.text_config_nested
    x = _with_eos(_ids())
    with torch.no_grad():
        torch.testing.assert_close(again(x), ours(x), atol=0, rtol=0)
    assert greedy(again, x[:1], 3).shape == (1, 27)


def test_server_says_images_are_not_supported(pair, tmp_path):
    from serve_testing import image_refusal

    name, _, ours, _ = pair
    msg = image_refusal(ours, str(tmp_path), "qwen4-tiny")
    reason = ("(qwen4_exp_text): dynamoe serves it as a text model" if name == "text" else
              "(qwen4_exp): its vision tower is not loaded (dynamoe serves the Qwen4-Exp text model only)")
    assert f"images are not supported by the model 'qwen4-tiny' {reason}" in msg


def test_config_refusals():
    base = {"model_type": "qwen4_exp_text", "vocab_size": 8, "hidden_size": 16, "num_hidden_layers": 4,
            "num_attention_heads": 2, "num_key_value_heads": 1, "head_dim": 8, "moe_intermediate_size": 8,
            "shared_expert_intermediate_size": 8, "num_experts": 4, "num_experts_per_tok": 1, "linear_num_key_heads": 1,
            "linear_num_value_heads": 2, "linear_key_head_dim": 4, "linear_value_head_dim": 4, "indexer_n_heads": 2,
            "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 8, "indexer_compress_ratio": 4,
            "eos_token_id": 1, "hc_lowrank": 4}
    cfg = dm.ModelConfig.from_dict(base)
    assert cfg.layer_types == ("linear_attention",) * 3 + ("indexed_attention",)
    assert Qwen4ExpForCausalLM(cfg).model.layers[3].self_attn.indexer.keep == 2
    for bad, field in (({"layer_types": ["sliding_attention"] * 4}, "layer_types"),
                       ({"indexer_budget": 6}, "indexer_budget"), ({"indexer_kv_heads": 2}, "indexer_kv_heads"),
                       ({"indexer_compress_ratio": None}, "indexer_compress_ratio"),
                       ({"indexer_head_dim": 4}, "indexer_head_dim"), ({"output_gate_type": "gelu"}, "output_gate_type"),
                       ({"hc_count": 1}, "hc_count"), ({"ple_layer_ids": [4]}, "ple_layer_ids"),
                       ({"ple_layer_ids": [5]}, "ple_layer_ids"), ({"ple_layer_ids": [1], "ple_embed_dim": 17},
                                                                   "ple_embed_dim"),
                       ({"ple_layer_ids": [1], "eos_token_id": None}, "eos_token_id")):
        with pytest.raises(ValueError, match=field):
            Qwen4ExpForCausalLM(dm.ModelConfig.from_dict({**base, **bad}))


def test_ngrams_restart_after_the_text_configs_eos():
    """A wrapper whose own eos differs from its text config's: the n-grams restart after the text config's (what
    transformers' text model reads), while generation stops at the wrapper's."""
    text = {"vocab_size": 8, "hidden_size": 16, "num_hidden_layers": 2, "num_attention_heads": 2,
            "num_key_value_heads": 1, "head_dim": 8, "layer_types": ["linear_attention", "full_attention"],
            "indexer_n_heads": 2, "indexer_kv_heads": 1, "indexer_head_dim": 8, "indexer_budget": 8,
            "indexer_compress_ratio": 4, "ple_layer_ids": [1], "ple_embed_dim": 16, "eos_token_id": 5}
    cfg = dm.ModelConfig.from_dict({"model_type": "qwen4_exp", "eos_token_id": 7, "text_config": text})
    from dynamoe.models.family_fields import qwen4_fields

    assert cfg.eos_token_id == (7,) and qwen4_fields(cfg).ple_eos == 5
    with pytest.raises(ValueError, match="eos_token_id"):
        qwen4_fields(dm.ModelConfig.from_dict({"model_type": "qwen4_exp", "eos_token_id": 7,
                                               "text_config": {**text, "eos_token_id": None}}))
