"""Speculative decoding with n-gram drafts: the same tokens as plain decoding (greedy requests
speculate, sampled ones beside them decode as usual), drafts accepted where the context repeats, the
cache cut back to what was accepted."""
import pytest
import torch

from engine_testing import TinyLM
from dynamoe.engine import GenerationEngine, SamplingParams
from dynamoe.engine.speculative import NgramIndex

GREEDY = SamplingParams(temperature=0)


@pytest.fixture(scope="module")
def model():
    return TinyLM(64, max_position_embeddings=512, seed=3).eval()


def _ids(seed, n):
    return torch.randint(3, 64, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


class CycleLM(torch.nn.Module):
    """The next token is a fixed permutation of the last one (short cycles: a context that repeats), with
    the KV cache contract honoured; random logits elsewhere so that sampled rows differ."""

    def __init__(self, vocab=64, seed=0):
        super().__init__()
        from types import SimpleNamespace

        self.config = SimpleNamespace(vocab_size=vocab, max_position_embeddings=512, eos_token_id=None)
        g = torch.Generator().manual_seed(seed)
        self.register_buffer("nxt", torch.randperm(vocab, generator=g) % 9 + 3)   # into 9 tokens: cycles
        self.register_buffer("noise", torch.randn(vocab, vocab, generator=g))

    def new_cache(self, num_slots, max_seq_len, dtype=None, device=None, **paging):
        from dynamoe.models.cache import KVCache
        return KVCache(num_slots, max_seq_len, 1, **paging)

    def forward(self, input_ids, cache=None, slots=None):
        B, T = input_ids.shape
        starts = cache.check_room(slots, T)
        pos = starts[:, None] + torch.arange(T)
        cache.write(0, slots, pos, int(pos.max()) + 1, k=input_ids[:, None, :, None].float())
        cache.advance(slots, T)
        logits = self.noise[input_ids].clone()
        logits.scatter_(-1, self.nxt[input_ids][..., None], 20.0)
        return logits


def _run(model, prompts, params, n, **kw):
    engine = GenerationEngine(model, max_seq_len=256, max_batch=len(prompts), block_size=4, **kw)
    reqs = [engine.add_request(p, sp, n, ignore_eos=True) for p, sp in zip(prompts, params)]
    engine.run_until_done()
    return [r.output_ids for r in reqs], engine


def test_ngram_index_drafts_what_followed_the_latest_match():
    idx = NgramIndex(max_ngram=3, min_ngram=1)
    t = [1, 2, 3, 4, 5, 9, 2, 3]
    assert idx.draft(t, 3) == [4, 5, 9]                 # "2 3" last seen before 4 5 9
    t += [4, 7, 2, 3]
    assert idx.draft(t, 2) == [4, 7]                    # the most recent earlier "2 3" (grown incrementally)
    assert idx.draft([5, 6, 7], 4) == []                # nothing repeats
    assert NgramIndex(2, 2).draft([8, 1, 8], 3) == []   # only 1-grams repeat: below min_ngram
    with pytest.raises(ValueError):
        NgramIndex(1, 2)


def test_drafts_are_accepted_where_the_context_repeats_and_tokens_do_not_change():
    model = CycleLM()
    prompt = _ids(1, 12)
    plain, e0 = _run(model, [prompt], [GREEDY], 40)
    spec, engine = _run(model, [prompt], [GREEDY], 40, speculative_tokens=4)
    assert spec == plain
    t = engine.totals
    assert t["spec_accepted"] > 20 and t["spec_drafted"] >= t["spec_accepted"]
    assert t["steps"] < e0.totals["steps"] / 2          # a step makes several tokens
    engine.cache.pool.check()
    assert engine.cache_stats()["blocks_used"] == 0


@pytest.mark.parametrize("k", [1, 3, 7])
def test_mixed_batch_same_tokens_as_plain(model, k):
    base = _ids(2, 10)
    prompts = [base * 3, _ids(3, 9), base + base[:5], _ids(4, 20) * 2]
    params = [GREEDY, SamplingParams(temperature=0.8, top_p=0.9, seed=7), GREEDY,
              SamplingParams(temperature=0, repetition_penalty=1.2)]   # penalties: no drafts
    plain, _ = _run(model, prompts, params, 30)
    spec, engine = _run(model, prompts, params, 30, speculative_tokens=k)
    assert spec == plain and all(len(o) == 30 for o in spec)
    cyc = CycleLM(seed=k)
    plain, _ = _run(cyc, prompts, params, 30)
    spec, engine = _run(cyc, prompts, params, 30, speculative_tokens=k)
    assert spec == plain and engine.totals["spec_accepted"] > 0


def test_speculation_respects_max_tokens_stop_strings_and_the_pool(model):
    base = _ids(5, 8)
    prompt = base * 4
    for n in (1, 2, 5):
        plain, _ = _run(model, [prompt], [GREEDY], n)
        spec, _ = _run(CycleLM(), [prompt], [GREEDY], n, speculative_tokens=6)
        assert spec == _run(CycleLM(), [prompt], [GREEDY], n)[0] and len(spec[0]) == n
    # a stop token inside an accepted draft ends the request there, as without drafts
    cyc = CycleLM()
    out = {}
    for k in (0, 6):
        e = GenerationEngine(cyc, max_seq_len=256, max_batch=1, block_size=4, speculative_tokens=k)
        free = e.add_request(prompt, GREEDY, 40, ignore_eos=True)
        e.run_until_done()
        stop = free.output_ids[20]
        r = e.add_request(prompt, GREEDY, 40, stop_token_ids=[stop])
        e.run_until_done()
        out[k] = (r.output_ids, r.finish_reason, r.stop_reason)
        e.cache.pool.check()
    assert out[6] == out[0] and out[0][1] == "stop" and out[0][0][-1] == out[0][2]
    # a small pool: drafts never take more positions than it has; preemption still gives the same tokens
    prompts = [base * 3, _ids(6, 7) * 3, base * 2]
    for m in (model, CycleLM()):
        plain, _ = _run(m, prompts, [GREEDY] * 3, 24)
        spec, engine = _run(m, prompts, [GREEDY] * 3, 24, speculative_tokens=4, kv_cache_blocks=16)
        assert spec == plain
        assert engine.totals["preempted"] > 0
        engine.cache.pool.check()
    engine.cache.pool.check()


def test_real_model_speculative_equals_plain(tmp_path):
    import transformers  # a test dependency: missing is a broken install, which must fail, not skip
    from models_util import randomize_

    from dynamoe.models import load

    torch.set_num_threads(1)
    cfg = transformers.Qwen3MoeConfig(vocab_size=96, hidden_size=32, intermediate_size=48, moe_intermediate_size=16,
                                      num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=8,
                                      num_experts=4, num_experts_per_tok=2, max_position_embeddings=256)
    hf = transformers.Qwen3MoeForCausalLM(cfg)
    randomize_(hf, 0)
    hf.save_pretrained(str(tmp_path))
    model = load(str(tmp_path), progress=False)
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 96, (10,), generator=g).tolist()
    prompts = [base * 3, torch.randint(0, 96, (14,), generator=g).tolist()]
    out = {}
    for k in (0, 4):
        e = GenerationEngine(model, max_seq_len=200, max_batch=2, speculative_tokens=k)
        reqs = [e.add_request(p, GREEDY, 24, ignore_eos=True) for p in prompts]
        e.run_until_done()
        out[k] = [r.output_ids for r in reqs]
    assert out[4] == out[0]
