"""Speculative decoding on every family with per-sequence recurrent state (Gated DeltaNet, Kimi Delta Attention,
Mamba-1, Mamba-2, lightning attention, short convolutions, ZAYA's convolved attention, Inkling's short convolutions,
Qwen4-Exp's per-layer n-gram embeddings): a verification forward run while the cache keeps a history records every
per-slot buffer after every token, and cutting the rejected drafts off (``KVCache.truncate``) puts them back.

Per family, on its tiny random checkpoint (the sizes of its own test file): two rows fed 6 tokens in one forward,
cut back to different lengths (1..6), continue exactly as sequences that never held the cut tokens; and the
engine's greedy output with n-gram drafts (batched rows accepting different counts, drafts both accepted and
rejected) is plain decoding's. The cache's history mechanics (windows, the refusal of an unrecorded buffer) are
checked on a bare KVCache."""
import pytest
import torch

from models_util import one_thread  # noqa: F401 (autouse fixture)
from models_util import VOCAB, randomize_, save_tiny

import test_models_bailing_hybrid as bailing
import test_models_glm5_next as glm5
import test_models_granitemoehybrid as granite
import test_models_inkling as inkling
import test_models_jamba as jamba
import test_models_kimi_linear as kimi
import test_models_lara_mini as lara
import test_models_lfm2_moe as lfm2
import test_models_minimax as minimax
import test_models_nemotron_h as nemotron
import test_models_qwen3_next as qwen3_next
import test_models_qwen4_exp as qwen4
import test_models_zaya as zaya
import transformers

import dynamoe.models as dm  # noqa: E402
from dynamoe.engine import GenerationEngine, SamplingParams  # noqa: E402
from dynamoe.models.cache import KVCache  # noqa: E402

T = transformers
GREEDY = SamplingParams(temperature=0, logprobs=2)   # (the logprobs show a wrong state where the argmax does not)

#: family -> (its tiny transformers model, randomize_ scales): one variant each, the one with the widest conv windows
FAMILIES = {
    "qwen3_next": (lambda: T.Qwen3NextForCausalLM(T.Qwen3NextConfig(**qwen3_next.SIZES)), qwen3_next.SCALES),
    "lara_mini": (lambda: T.LaraMiniForCausalLM(T.LaraMiniConfig(**{**lara.SIZES, **lara.VARIANTS["mixed"]})),
                  {"lm_head": 0.2, "A_log": 0.5}),
    "qwen4_exp": (lambda: T.Qwen4ExpForCausalLM(T.Qwen4ExpTextConfig(**{**qwen4.TEXT, **qwen4.VARIANTS["text"]})),
                  {"lm_head": 0.1, "A_log": 0.5, "ple.conv1d": 0.5}),
    "kimi_linear": (lambda: T.KimiLinearForCausalLM(T.KimiLinearConfig(**{**kimi.SIZES, **kimi.VARIANTS["q_lora"]})),
                    {"lm_head": 0.1}),
    "glm5_next": (lambda: T.Glm5NextForConditionalGeneration(T.Glm5NextConfig(
        text_config={**glm5.TEXT, **glm5.VARIANTS["bounded"]}, vision_config=glm5.VISION)),
        {"lm_head": 0.1, "A_log": 0.5}),
    "bailing_hybrid": (lambda: T.BailingHybridForCausalLM(T.BailingHybridConfig(**bailing.SIZES)), bailing.SCALES),
    "jamba": (lambda: T.JambaForCausalLM(T.JambaConfig(**jamba.SIZES)), None),
    "granitemoehybrid": (lambda: T.GraniteMoeHybridForCausalLM(T.GraniteMoeHybridConfig(
        **{**granite.SIZES, **granite.VARIANTS["moe"]})), None),
    "nemotron_h": (lambda: T.NemotronHForCausalLM(T.NemotronHConfig(**nemotron.SIZES)), None),
    "minimax": (lambda: T.MiniMaxForCausalLM(T.MiniMaxConfig(**{**minimax.SIZES, **minimax.VARIANTS["sliding"]})), None),
    "lfm2_moe": (lambda: T.Lfm2MoeForCausalLM(T.Lfm2MoeConfig(**{**lfm2.SIZES,
                                                                 **lfm2.VARIANTS["no-expert-bias-conv-bias"]})), None),
    "zaya": (lambda: T.ZayaForCausalLM(T.ZayaConfig(**{**zaya.SIZES, **zaya.VARIANTS["sliding"]})), zaya.SCALES),
    "inkling": (lambda: T.InklingForCausalLM(T.InklingTextConfig(**{**inkling.SIZES, **inkling.VARIANTS["plain"]})),
                {"lm_head": 0.2}),
}


def _load(name: str, folder, embed_scale: float | None = None):
    """The family's tiny random checkpoint, loaded by dynamoe; ``embed_scale``: the token embeddings' scale."""
    make, scales = FAMILIES[name]
    scales = dict(scales or {})
    if embed_scale is not None:
        scales.update({"embed_tokens": embed_scale, "model.embeddings": embed_scale})
    torch.manual_seed(0)
    hf = make().eval()
    randomize_(hf, seed=1, scales=scales)
    with torch.no_grad():   # (GLM-5.3's indexer: key-norm biases near 1 would relu most scores to exactly 0, ties)
        for n, p in hf.named_parameters():
            if n.endswith("k_norm.bias"):
                p.copy_(torch.randn(p.shape, generator=torch.Generator().manual_seed(3)) * 0.2)
    return dm.load(save_tiny(hf, folder), progress=False)


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def model(request, tmp_path_factory):
    """The family's tiny random model."""
    return _load(request.param, tmp_path_factory.mktemp(request.param))


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def looping_model(request, tmp_path_factory):
    """The family's tiny random model with token embeddings 500 times the other weights' scale: the residual stream
    is mostly the last token's embedding, so that greedy decoding soon runs in a loop (n-gram drafts accepted) while
    the layers, recurrent state included, still move the logits."""
    return _load(request.param, tmp_path_factory.mktemp(request.param), embed_scale=100.0)


def test_recurrent_state_rolls_back_to_any_position(model):
    """Two rows (slots 2 and 0, after prefixes of 7 and 5 tokens) fed 6 tokens in one forward while the cache keeps
    history, cut back to keep and 7 - keep of them (keep = 1..6), then 3 more tokens each in one forward: the logits
    of sequences that never held the cut tokens."""
    assert model.recurrent_state and model.recurrent_rollback
    g = torch.Generator().manual_seed(2)
    prefixes = [torch.randint(0, VOCAB, (1, n), generator=g) for n in (7, 5)]
    fed, more = (torch.randint(0, VOCAB, (2, n), generator=g) for n in (6, 3))
    slots = torch.tensor([2, 0])
    with torch.no_grad():
        for keep in range(1, 7):
            cache = model.new_cache(3, 32)
            for p, s in zip(prefixes, slots):
                model(p, cache=cache, slots=s[None])
            cache.begin_history()
            model(fed, cache=cache, slots=slots)
            kept = (keep, 7 - keep)
            for p, s, k in zip(prefixes, slots.tolist(), kept):
                cache.truncate(s, p.size(1) + k)
            cache.end_history()
            got = model(more, cache=cache, slots=slots)
            for b, (p, k) in enumerate(zip(prefixes, kept)):
                want = model(torch.cat([p, fed[b:b + 1, :k], more[b:b + 1]], 1))[:, -3:]
                torch.testing.assert_close(got[b:b + 1], want, atol=1e-4, rtol=1e-4, msg=f"row {b}, keep {k}")


def _prompts() -> list[list[int]]:
    """Two prompts repeating a pattern, one without repeats, and one holding every token once (whatever token the
    model chooses first, the one after it in the prompt is drafted: mostly rejected)."""
    g = torch.Generator().manual_seed(4)
    pat = [torch.randint(0, VOCAB, (n,), generator=g).tolist() for n in (4, 5)]
    return [pat[0] * 4 + [1], torch.randperm(VOCAB, generator=g).tolist(), pat[1] * 3,
            torch.randint(0, VOCAB, (9,), generator=g).tolist()]


def _generate(model, n: int, prompts: list[list[int]] | None = None, **kw):
    """Greedy outputs of ``prompts`` (default: the 4 of _prompts, in 3 slots: batched rows, a slot reused), their
    logprobs (the chosen token's and the top 2, [requests, n, 3]) and the engine."""
    engine = GenerationEngine(model, max_seq_len=VOCAB + 2 * n, max_batch=3, block_size=4, prefill_chunk=16, **kw)
    reqs = [engine.add_request(p, GREEDY, n, ignore_eos=True) for p in (prompts or _prompts())]
    engine.run_until_done()
    lps = torch.tensor([[[lp.logprob, *(v for _, v in lp.top)] for lp in r.logprobs] for r in reqs])
    return [r.output_ids for r in reqs], lps, engine


def test_engine_ngram_drafts_give_plain_tokens(looping_model):
    """n-gram drafts (speculative_tokens=3) verified in batched forwards: the greedy tokens of plain decoding and
    their logprobs, with drafts accepted and rejected and, in some forward, rows cut back to different lengths."""
    model = looping_model
    plain, plain_lps, _ = _generate(model, 24)
    cuts: list[list[int]] = []   # per verification forward, how many drafts each row kept
    begin, rewind = KVCache.begin_history, KVCache._rewind

    def spy_begin(self):
        cuts.append([])
        begin(self)

    def spy_rewind(self, slot, length):
        cuts[-1].append(length - self._history_rows[slot][1] - 1)
        rewind(self, slot, length)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(KVCache, "begin_history", spy_begin)
        mp.setattr(KVCache, "_rewind", spy_rewind)
        spec, lps, engine = _generate(model, 24, speculative_tokens=3)
    assert spec == plain
    torch.testing.assert_close(lps, plain_lps, atol=1e-4, rtol=0)
    t = engine.totals
    assert 0 < t["spec_accepted_ngram"] < t["spec_drafted_ngram"], t   # drafts accepted, and rejected
    assert cuts and any(len(set(c)) > 1 for c in cuts), cuts           # rows of one forward kept different counts
    assert engine.cache_stats()["blocks_used"] == 0


def test_history_records_windows_and_refuses_an_unrecorded_buffer():
    """KVCache.record_windows keeps the window after each token of a stream (a conv's inputs, the last token ids);
    truncate puts each recorded buffer back; a per-slot buffer no layer recorded makes the cut an error (the model's
    rollback would be wrong), as does a history in which nothing was recorded."""
    cache = KVCache(3, 16, 2)
    win = cache.buffer(0, "window", 2, 3)                  # [slots, C, W]
    ctx = cache.buffer(1, "context", 2, dtype=torch.long)  # [slots, W]
    slots = torch.tensor([2, 1])
    for s, n in ((2, 5), (1, 3)):   # (prefixes of 5 and 3 tokens)
        cache.check_room(torch.tensor([s]), n)
        cache.advance(torch.tensor([s]), n)
    cache.check_room(slots, 8)
    stream = torch.arange(2 * 2 * 7, dtype=torch.float32).view(2, 2, 7)   # [B, C, W + T], T = 4
    ids = torch.arange(2 * 6).view(2, 6)                                  # [B, W + T]
    cache.begin_history()
    cache.record_windows(0, "window", slots, stream, 3)
    cache.record_windows(1, "context", slots, ids, 2)
    win[slots], ctx[slots] = stream[..., -3:], ids[:, -2:]
    cache.advance(slots, 4)
    cache.truncate(2, 5 + 2)   # 2 of the 4 tokens kept
    cache.truncate(1, 3 + 4)   # all kept
    torch.testing.assert_close(win[2], stream[0, :, 2:5])
    torch.testing.assert_close(win[1], stream[1, :, 4:7])
    assert ctx[2].tolist() == ids[0, 2:4].tolist() and ctx[1].tolist() == ids[1, 4:6].tolist()
    cache.end_history()

    cache.begin_history()
    cache.record_windows(0, "window", slots, stream, 3)   # (layer 1's context not recorded)
    cache.advance(slots, 4)
    with pytest.raises(ValueError, match="layer 1's buffer 'context' was not recorded"):
        cache.truncate(2, 9)
    cache.end_history()
    cache.begin_history()
    with pytest.raises(ValueError, match="no layer recorded its buffers"):
        cache.truncate(2, 9)
    cache.end_history()


@pytest.mark.parametrize("looping_model", ["qwen3_next", "jamba"], indirect=True)
def test_drafts_shrink_to_the_history_memory(looping_model):
    """A verification forward keeps every row's recurrent state after each token: it feeds rows x tokens states
    within the engine's history_memory (fewer drafts where more rows decode), none where not even one state fits
    -- the same tokens as plain decoding."""
    model = looping_model
    looping = _prompts()[:1]   # (alone in the engine: one row, whose drafts are cut by nothing but k)
    plain, _, engine = _generate(model, 16)
    plain_one, _, _ = _generate(model, 16, looping)
    per_row = engine.cache.slot_state_bytes
    assert per_row > 0
    fed: list[tuple[int, int]] = []
    verify = GenerationEngine._verify

    def spy_verify(self, reqs, ids, *args, **kw):
        fed.append((len(reqs), len(ids[0])))
        return verify(self, reqs, ids, *args, **kw)

    def most(rows: int) -> int:   # tokens a forward of this many rows may feed: the next one and its drafts
        return 1 + min(3, 6 // rows - 1)

    with pytest.MonkeyPatch.context() as mp:
        mp.setattr(GenerationEngine, "_verify", spy_verify)
        mp.setattr(GenerationEngine, "history_memory", 6 * per_row)
        spec, _, engine = _generate(model, 16, speculative_tokens=3)
        assert spec == plain and engine.totals["spec_drafted_ngram"] > 0
        assert fed and all(tokens <= most(rows) for rows, tokens in fed), fed
        assert any(rows > 1 for rows, _ in fed), fed   # (batched rows drafted: cut to fewer than 3 drafts each)
        fed.clear()
        spec, _, engine = _generate(model, 16, looping, speculative_tokens=3)
        assert spec == plain_one and (1, 4) in fed, fed   # one row: all 3 drafts fit
        fed.clear()
        mp.setattr(GenerationEngine, "history_memory", per_row - 1)
        spec, _, engine = _generate(model, 16, speculative_tokens=3)
    assert spec == plain and not fed and engine.totals["spec_drafted_ngram"] == 0
