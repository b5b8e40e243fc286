"""Unlimited-OCR's text model from its multimodal checkpoint against transformers on tiny random checkpoints:
DeepSeek-OCR-2's decoder under reference sliding-window attention (the prompt stays in sight, generated tokens
slide over a window), with the prompt length carried per sequence by the KV cache -- prefill in chunks, decode,
batches of rows with different prompts, a recompute of prompt and output, the engine's prefix cache and
preemption all attend as transformers' generation does; the vision encoders skipped and logged, images refused by
the server."""
import dataclasses
import logging

import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, check_greedy, check_logits, check_ragged_batch, randomize_, save_tiny
from models_util import ids as _ids

import transformers  # a test dependency: missing is a broken install, which must fail, not skip

import dynamoe.models as dm  # noqa: E402
from dynamoe.models.attention import Attention  # noqa: E402
from dynamoe.models.moe_block import GatedMLP, SparseMoeBlock  # noqa: E402
from dynamoe.models.unlimited_ocr import ReferenceSlidingAttention, UnlimitedOcrForCausalLM  # noqa: E402
from dynamoe.ops import cpu_kernels  # noqa: E402

ATOL = 1e-4
TEXT = dict(vocab_size=VOCAB, hidden_size=64, intermediate_size=48, moe_intermediate_size=16, num_hidden_layers=3,
            num_attention_heads=4, num_key_value_heads=2, n_routed_experts=4, num_experts_per_tok=2, n_shared_experts=1,
            routed_scaling_factor=1.5, sliding_window=4, eos_token_id=None)  # (no stop: generate() runs to the end)
VISION = dict(sam_config=dict(hidden_size=16, output_channels=16, num_hidden_layers=1, num_attention_heads=2,
                              image_size=32, patch_size=16, global_attn_indexes=[0], downsample_channels=[16, 32],
                              mlp_dim=32),
              encoder_config=dict(hidden_size=32, intermediate_size=32, num_hidden_layers=1, num_attention_heads=2,
                                  image_size=32, patch_size=16))
VARIANTS = {
    # the defaults' shape: every layer reference-sliding (window 4), layer 0 dense, greedy top-2 of 4, untied
    "greedy": dict(),
    # group-limited greedy (2 groups, the best kept), every layer MoE, a full-attention layer between two
    # reference-sliding ones (window 6), two shared experts, tied
    "grouped": dict(topk_method="group_limited_greedy", n_group=2, topk_group=1, n_routed_experts=6,
                    n_shared_experts=2, mlp_layer_types=["sparse"] * 3, routed_scaling_factor=1.0, sliding_window=6,
                    layer_types=["reference_sliding_attention", "full_attention", "reference_sliding_attention"]),
}


def _make(name: str, folder) -> tuple:
    """transformers' tiny random model of variant ``name``, saved to ``folder``: (model, path)."""
    torch.manual_seed(0)
    cfg = transformers.UnlimitedOcrConfig(text_config={**TEXT, **VARIANTS[name]}, vision_config=VISION,
                                          tie_word_embeddings=name == "grouped")
    hf = transformers.UnlimitedOcrForConditionalGeneration(cfg).eval()
    randomize_(hf, seed=1, scales={"lm_head": 0.5, "embed_tokens": 0.5})
    return hf, save_tiny(hf, folder)


@pytest.fixture(scope="module", params=sorted(VARIANTS))
def pair(request, tmp_path_factory):
    name = request.param
    hf, path = _make(name, tmp_path_factory.mktemp(f"unlimited_ocr_{name}"))
    return name, hf, dm.load(path, progress=False), path


def _hf_steps(hf, ids, cuts, prompt=None):
    """transformers' logits over ``ids`` [B, T] fed in pieces ending at ``cuts`` through one cache (the prompt
    length declared first when given, as generate() does; else the first piece is the prompt)."""
    cache = transformers.DynamicCache(config=hf.config.text_config)
    if prompt is not None:
        for layer in cache.layers:
            if layer._layer_type == "reference_sliding_attention":
                layer.set_prefill_length(prompt)
    out, at = [], 0
    with torch.no_grad():
        for cut in cuts:
            out.append(hf(ids[:, at:cut], cache=cache, use_cache=True).logits)
            at = cut
    return torch.cat(out, dim=1)


def _ours_steps(ours, ids, cuts, prompt=None):
    B = ids.size(0)
    cache = ours.new_cache(B, ids.size(1))
    slots = torch.arange(B)
    if prompt is not None:
        for s in range(B):
            cache.declare_prompt(s, prompt)
    out, at = [], 0
    with torch.no_grad():
        for cut in cuts:
            out.append(ours(ids[:, at:cut], cache=cache, slots=slots))
            at = cut
    if any(type(layer.self_attn) is ReferenceSlidingAttention for layer in ours.model.layers):
        assert cache.prompt_lengths.tolist() == [prompt or cuts[0]] * B
    return torch.cat(out, dim=1)


def test_structure(pair):
    name, hf, ours, _ = pair
    tc = hf.config.text_config
    assert type(ours) is UnlimitedOcrForCausalLM and ours.config.text_config_nested
    assert (ours.lm_head.weight is ours.model.embed_tokens.weight) == (name == "grouped")
    assert ours.config.head_dim == 16 and ours.attention_window() is None   # (no blocks out of any window)
    for kind, mlp_kind, layer in zip(tc.layer_types, tc.mlp_layer_types, ours.model.layers):
        attn = layer.self_attn
        if kind == "reference_sliding_attention":
            assert type(attn) is ReferenceSlidingAttention and attn.reference_window == tc.sliding_window
            assert attn.sliding_window is None
        else:
            assert type(attn) is Attention and attn.sliding_window is None
        assert type(layer.mlp) is (SparseMoeBlock if mlp_kind == "sparse" else GatedMLP)
        if mlp_kind == "sparse":
            gate = layer.mlp.moe.config.gates[0]
            assert (gate.type, gate.k, gate.normalize, gate.route_scale) == ("top", 2, False, tc.routed_scaling_factor)
            assert (gate.n_group, gate.topk_group) == ((2, 1) if name == "grouped" else (1, 1))


def test_logits_match_transformers(pair):
    _, hf, ours, _ = pair
    check_logits(hf, ours, _ids())


def test_greedy_matches_generate(pair):
    """32 tokens: far past the window, so most steps see the prompt and a window of their own output only."""
    _, hf, ours, _ = pair
    check_greedy(hf, ours, _ids(seed=1, tokens=10), new_tokens=32)


@pytest.mark.parametrize("prompt,cuts", [
    (None, [9, 13, *range(14, 29)]),        # a prefill, a chunk past it (generated tokens), then decode
    (13, [5, 9, 13, 17, *range(18, 29)]),   # the prompt declared and prefilled in chunks, a chunk, then decode
    (13, [28]),                             # prompt and continuation in one forward (a recompute)
    (13, [8, 20, 28]),                      # ... in chunks across the prompt's end
])
def test_cached_forwards_match_transformers(pair, prompt, cuts):
    """Every position's logits through dynamoe's cache equal transformers' through its own for the same prompt
    length, however the tokens are split into forwards."""
    _, hf, ours, _ = pair
    x = _ids(seed=2, tokens=28)
    want = _hf_steps(hf, x, [9, 13, *range(14, 29)] if prompt is None else [13, *range(14, 29)], prompt)
    torch.testing.assert_close(_ours_steps(ours, x, cuts, prompt), want, atol=ATOL, rtol=0)


def test_rows_at_different_lengths(pair):
    check_ragged_batch(pair[2])


def test_the_reference_window_matters(pair):
    """Past the prompt plus the window the logits differ from plain causal attention's (a forward without a
    cache: all prompt), and before it they equal them; a model without the window (all full attention) misses
    transformers' decode. The route scale (greedy) and the group limit (grouped) change the logits too."""
    name, hf, ours, _ = pair
    x = _ids(seed=3, tokens=28)
    W = hf.config.text_config.sliding_window
    P = 10
    with torch.no_grad():
        causal = ours(x)
    stepped = _ours_steps(ours, x, [P, *range(P + 1, 29)])
    torch.testing.assert_close(stepped[:, :P + W], causal[:, :P + W], atol=ATOL, rtol=0)
    assert (stepped[:, P + W:] - causal[:, P + W:]).abs().amax(-1).min() > 1e-3
    full = type(ours)(dataclasses.replace(ours.config, layer_types=("full_attention",) * 3)).eval()
    full.load_state_dict(ours.state_dict())
    want = _hf_steps(hf, x, [P, *range(P + 1, 29)])
    assert (_ours_steps(full, x, [P, *range(P + 1, 29)]) - want).abs().max() > 1e-3
    change = {"routed_scaling_factor": 1.0} if name == "greedy" else {"topk_method": "greedy"}
    other = type(ours)(dataclasses.replace(ours.config, **change)).eval()
    other.load_state_dict(ours.state_dict())
    with torch.no_grad():
        assert (other(x) - causal).abs().max() > 1e-3


@pytest.mark.skipif(cpu_kernels.load() is None, reason="the CPU kernels could not be built here")
def test_decode_fuses_until_the_window_slides(pair, monkeypatch):
    """Decode steps run the fused kernels (plain causal attention) while no row is W positions past its prompt,
    then the reference-sliding layers' attention op by op -- with the same logits as transformers' throughout
    (test_cached_forwards_match_transformers)."""
    _, hf, ours, _ = pair
    W, P = hf.config.text_config.sliding_window, 10
    for layer in ours.model.layers:
        assert layer.self_attn.decode_fused(layer.input_layernorm, torch.float32).weights is not None
    op_by_op = []
    real = ReferenceSlidingAttention.forward
    monkeypatch.setattr(ReferenceSlidingAttention, "forward",
                        lambda self, x, pos, *a, **kw: op_by_op.append(int(pos[:, -1].max())) or real(self, x, pos, *a, **kw))
    _ours_steps(ours, _ids(seed=4, tokens=P + W + 3), [P, *range(P + 1, P + W + 4)])
    assert sorted(set(op_by_op)) == [P - 1, P + W, P + W + 1, P + W + 2]   # the prefill, then past the window


def _generate(hf, p, n):
    with torch.no_grad():
        return hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=n, do_sample=False, pad_token_id=0)[0, len(p):].tolist()


def test_engine_generation_matches_generate(pair):
    """The serving engine gives transformers' greedy tokens per prompt: continuous batching, chunked prefill, two
    prompts of different lengths sharing a cached head, and then a prompt that holds another request's prompt and
    output (a chat's next turn: those positions are its prompt, so the blocks made as output are not reused)."""
    from dynamoe.engine import GenerationEngine, SamplingParams

    hf, ours = pair[1], pair[2]
    g = torch.Generator().manual_seed(11)
    head = torch.randint(0, VOCAB, (17,), generator=g).tolist()
    prompts = [torch.randint(0, VOCAB, (6,), generator=g).tolist(), head + [5, 9], head + [7]]
    engine = GenerationEngine(ours, None, max_seq_len=64, max_batch=2, prefill_chunk=7, block_size=8)
    reqs = [engine.add_request(p, SamplingParams(temperature=0), 20, ignore_eos=True) for p in prompts]
    engine.run_until_done()
    assert engine.totals["cached_tokens"] >= 16   # the third prompt reused the second's first two blocks
    for p, r in zip(prompts, reqs):
        assert r.output_ids == _generate(hf, p, 20)
    turn = prompts[1] + reqs[1].output_ids + [3]   # 40 tokens: blocks 2-4 of request 1 held its output
    before = engine.totals["cached_tokens"]
    nxt = engine.add_request(turn, SamplingParams(temperature=0), 12, ignore_eos=True)
    engine.run_until_done()
    assert engine.totals["cached_tokens"] - before == 16   # only the blocks within request 1's prompt
    assert nxt.output_ids == _generate(hf, turn, 12)


def test_engine_preemption_recomputes_as_decoded(pair):
    """A KV pool too small for every request preempts; a preempted request recomputes prompt and output with
    its own prompt length (the decode steps' mask), finding its own output blocks in the prefix cache, and
    goes on with transformers' tokens."""
    from dynamoe.engine import GenerationEngine, SamplingParams

    hf, ours = pair[1], pair[2]
    g = torch.Generator().manual_seed(12)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 13, 6)]
    engine = GenerationEngine(ours, None, max_seq_len=40, max_batch=3, kv_cache_blocks=10, block_size=4,
                              token_budget=8)
    reqs = [engine.add_request(p, SamplingParams(temperature=0), 24, ignore_eos=True) for p in prompts]
    engine.run_until_done()
    assert engine.totals["preempted"] > 0
    for p, r in zip(prompts, reqs):
        assert r.output_ids == _generate(hf, p, 24)


def test_engine_speculation_matches_generate(pair):
    """n-gram speculation: drafts verified several tokens per forward past the window give transformers' tokens."""
    from dynamoe.engine import GenerationEngine, SamplingParams

    hf, ours = pair[1], pair[2]
    g = torch.Generator().manual_seed(14)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (7, 12)]
    engine = GenerationEngine(ours, None, max_seq_len=64, max_batch=2, speculative_tokens=3)
    reqs = [engine.add_request(p, SamplingParams(temperature=0), 36, ignore_eos=True) for p in prompts]
    engine.run_until_done()
    assert engine.totals["spec_drafted"] > 0   # (the outputs repeat themselves: drafts to verify, kept or cut back)
    for p, r in zip(prompts, reqs):
        assert r.output_ids == _generate(hf, p, 36)


def expert_parallel_worker(rank, world, path):
    import torch.distributed as dist

    from dynamoe.engine import GenerationEngine, SamplingParams
    from dynamoe.engine.distributed import ControlChannel, LeaderModel, follow
    from dynamoe.models.cache import KVCache

    torch.set_num_threads(1)
    seen = []   # (slots, prompt lengths) of every reference-sliding layer's forward on this rank's cache
    own = KVCache.prompt_lengths_for

    def recording(self, slots_B, positions_BT):
        P_B = own(self, slots_B, positions_BT)
        seen.append((slots_B.tolist(), P_B.tolist()))
        return P_B

    model = dm.load(path, progress=False, group=dist.group.WORLD)
    channel = ControlChannel(dist.group.WORLD)
    if rank != 0:
        KVCache.prompt_lengths_for = recording
        follow(model, channel)   # returns at STOP
        dist.gather_object(seen, None, dst=0)
        return
    g = torch.Generator().manual_seed(13)
    prompts = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (9, 13, 6)]

    def outputs(m):
        engine = GenerationEngine(m, None, max_seq_len=48, max_batch=2, prefill_chunk=4, block_size=4)
        reqs = [engine.add_request(p, SamplingParams(temperature=0), 20, ignore_eos=True) for p in prompts]
        engine.run_until_done(reqs)
        return [r.output_ids for r in reqs]

    want = outputs(dm.load(path, progress=False))
    leader = LeaderModel(model, channel)
    KVCache.prompt_lengths_for = recording
    try:
        assert outputs(leader) == want
    finally:
        leader.stop_followers()
    theirs = [None, None]
    dist.gather_object(seen, theirs, dst=0)
    assert theirs[1] == seen and {tuple(P) for _, P in seen} >= {(9,), (13,), (6,)}


def test_expert_parallel_ranks_mirror_prompt_lengths(tmp_path):
    """Under expert parallelism the other ranks repeat rank 0's forwards on their own caches: the prompt lengths
    travel with the block tables (slots reused, prompts prefilled in chunks), so every rank's attention sees each
    sequence's own prompt length, and the outputs are one process's."""
    from dist_harness import run_ranks

    _, path = _make("greedy", tmp_path / "ckpt")
    run_ranks(2, expert_parallel_worker, path, timeout=240)


def test_vision_parts_are_skipped_and_logged(pair, caplog):
    path = pair[3]
    with caplog.at_level(logging.INFO, logger="dynamoe.models.loader"):
        dm.load(path, progress=False)
    notes = [r.getMessage() for r in caplog.records if "not loading" in r.getMessage()]
    assert len(notes) == 1 and notes[0].startswith("unlimited_ocr: not loading"), notes
    for part in ("model.sam_model.*", "model.vision_model.*", "model.projector.*", "model.image_newline",
                 "model.view_seperator"):
        assert part in notes[0], notes[0]


def test_server_says_images_are_not_supported(pair, tmp_path):
    from serve_testing import image_refusal

    msg = image_refusal(pair[2], str(tmp_path), "uocr-tiny")
    assert "images are not supported by the model 'uocr-tiny' (unlimited_ocr): its vision encoders" in msg


def test_config_forms_and_refusals():
    hub = {"model_type": "unlimited_ocr", "sliding_window": 32,
           "language_config": {**{k: v for k, v in TEXT.items() if k != "sliding_window"}, "model_type": "deepseek_v2",
                               "first_k_dense_replace": 2}}
    want = transformers.UnlimitedOcrConfig.from_dict(dict(hub)).text_config
    cfg = dm.ModelConfig.from_dict(hub)   # the hub's form: language_config, the window on the wrapper
    assert cfg.text_config_nested and cfg.sliding_window == want.sliding_window == 32
    assert cfg.layer_types == tuple(want.layer_types) == ("reference_sliding_attention",) * 3
    assert cfg.mlp_layer_types == tuple(want.mlp_layer_types) == ("dense", "dense", "sparse")
    with pytest.raises(ValueError, match="'sliding_window' is required"):
        dm.ModelConfig.from_dict({"model_type": "unlimited_ocr", "text_config": {**TEXT, "sliding_window": None}})
    with pytest.raises(ValueError, match="config field 'layer_types'"):
        dm.ModelConfig.from_dict({"model_type": "unlimited_ocr", "text_config": {
            **TEXT, "layer_types": ["sliding_attention"] * 3}})
    with pytest.raises(ValueError, match="^unlimited_ocr_text: the base language model"):
        dm.ModelConfig.from_dict({**TEXT, "model_type": "unlimited_ocr_text"})
    with pytest.raises(ValueError, match="reference_window must be an int >= 1"):
        ReferenceSlidingAttention(64, 4, 2, 16, 0, None, reference_window=0)


def test_prompt_lengths_in_the_cache():
    """The cache's per-slot prompt length: declared, else the first forward's end; forgotten when the slot is
    freed; mirrored with the tables (a follower rank)."""
    from dynamoe.models.cache import KVCache

    cache = KVCache(3, 32, 1)
    cache.declare_prompt(1, 7)
    P = cache.prompt_lengths_for(torch.tensor([0, 1]), torch.tensor([[0, 1, 2], [0, 1, 2]]))
    assert P.tolist() == [3, 7] and cache.prompt_lengths.tolist() == [3, 7, 0]
    cache.check_room(torch.tensor([0]), 3)
    cache.advance(torch.tensor([0]), 3)
    cache.free(0)
    assert cache.prompt_lengths.tolist() == [0, 7, 0]
    cache.set_blocks(2, [4], 5, 5)
    assert cache.prompt_lengths[2] == 5
    with pytest.raises(ValueError, match="prompt length must be an int >= 1"):
        cache.declare_prompt(0, 0)
