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


# --- drafts from the model's multi-token-prediction head (draft="mtp") -------------------------------------------

def _mtp_checkpoint(path, seed: int = 1, exact_head: bool = False, family: str = "deepseek_v3") -> str:
    """A tiny DeepSeek-V3 checkpoint with one MTP layer (random). ``exact_head``: every layer's attention and MLP
    output zeroed, so that the model is a bigram model (the next token depends on the last one only), and a head
    that computes that same function of its input token (eh_proj = [I, 0], enorm = 1, shared_head = the model's
    norm and lm_head): its drafts are the model's own next tokens."""
    import transformers
    from models_mla_util import BASE, MLA, add_mtp_layers, make_pair
    from safetensors.torch import load_file, save_file

    if family == "glm4_moe":   # GQA with q/k/v biases and q/k norms (the head's decode steps: the fused kernel)
        cls, cfg = transformers.Glm4MoeForCausalLM, transformers.Glm4MoeConfig(
            **{k: BASE[k] for k in ("vocab_size", "hidden_size", "intermediate_size", "moe_intermediate_size",
                                    "num_hidden_layers", "num_attention_heads", "n_routed_experts",
                                    "num_experts_per_tok", "first_k_dense_replace", "n_shared_experts",
                                    "max_position_embeddings", "bos_token_id", "eos_token_id")},
            num_key_value_heads=2, head_dim=16, attention_bias=True, use_qk_norm=True)
    else:
        cls, cfg = transformers.DeepseekV3ForCausalLM, transformers.DeepseekV3Config(
            **{**BASE, **MLA, "n_group": 2, "topk_group": 1})
    _, path = make_pair(cls, cfg, path, seed=seed)
    add_mtp_layers(path, seed=seed)
    if exact_head:
        t = load_file(path + "/model.safetensors")
        for k in t:
            if k.endswith(("o_proj.weight", "down_proj.weight")):
                t[k] = torch.zeros_like(t[k])
        D = t["model.embed_tokens.weight"].shape[1]
        t["model.layers.3.eh_proj.weight"] = torch.cat([torch.eye(D), torch.zeros(D, D)], 1)
        t["model.layers.3.enorm.weight"] = torch.ones(D)
        t["model.layers.3.shared_head.norm.weight"] = t["model.norm.weight"].clone()
        save_file(t, path + "/model.safetensors", metadata={"format": "pt"})
    return path


@pytest.fixture(scope="module")
def mtp_model(tmp_path_factory):
    from dynamoe.models import load

    torch.set_num_threads(1)
    return load(_mtp_checkpoint(tmp_path_factory.mktemp("dsv3_mtp")), progress=False)


def _mtp_run(model, batches, params, n, **kw):
    """Run ``batches`` (lists of prompts) one after the other on one engine; the outputs and the engine."""
    engine = GenerationEngine(model, max_seq_len=160, max_batch=4, block_size=4, **kw)
    out, reqs = [], []
    for prompts in batches:
        rs = [engine.add_request(p, sp, n, ignore_eos=True) for p, sp in zip(prompts, params)]
        engine.run_until_done()
        out += [r.output_ids for r in rs]
        reqs += rs
    return out, engine, reqs


def test_mtp_drafts_same_tokens_as_plain(mtp_model):
    """Greedy requests draft with the head beside sampled and penalised ones; a later request continues a cached
    prefix (blocks whose head entries an earlier greedy request wrote); a small pool preempts. The tokens are
    those of plain decoding throughout, and the counters say where the drafts came from."""
    g = torch.Generator().manual_seed(0)
    base = torch.randint(0, 128, (14,), generator=g).tolist()
    first = [base + [5, 6], torch.randint(0, 128, (9,), generator=g).tolist(), base + [7], base[:6]]
    params = [GREEDY, SamplingParams(temperature=0.8, seed=3), GREEDY, SamplingParams(temperature=0, repetition_penalty=1.3)]
    plain, _, _ = _mtp_run(mtp_model, [first], params, 12)
    spec, engine, reqs = _mtp_run(mtp_model, [first], params, 12, speculative_tokens=3, draft="mtp")
    assert spec == plain
    t = engine.totals
    assert t["spec_drafted_mtp"] > 0 and t["spec_drafted_ngram"] == 0 and t["spec_drafted"] == t["spec_drafted_mtp"]
    assert t["spec_accepted"] == t["spec_accepted_mtp"]
    engine.cache.pool.check()
    assert engine.cache_stats()["blocks_used"] == 0
    # continuing what request 0 computed: its blocks are reused, head entries included
    cont = [first[0] + spec[0] + [9, 9, 9], first[1] + [4]]
    plain, _, _ = _mtp_run(mtp_model, [first, cont], params[:2], 10)
    spec, engine, reqs = _mtp_run(mtp_model, [first, cont], params[:2], 10, speculative_tokens=3, draft="mtp")
    assert spec == plain
    assert reqs[2].stats.cached_tokens >= 24
    # a pool too small for all of them at once: preemption, recomputation, the same tokens
    prompts = [base * 2, first[1] * 3, base + first[1]]
    plain, _, _ = _mtp_run(mtp_model, [prompts], [GREEDY] * 3, 20)
    spec, engine, _ = _mtp_run(mtp_model, [prompts], [GREEDY] * 3, 20, speculative_tokens=4, draft="mtp",
                               kv_cache_blocks=24)
    assert spec == plain and engine.totals["preempted"] > 0
    engine.cache.pool.check()


@pytest.mark.parametrize("family", ["deepseek_v3", "glm4_moe"])
def test_mtp_head_cache_stays_consistent(mtp_model, family, tmp_path):
    """After every step, each request's drafts for the next one equal the head's drafts recomputed from scratch
    (float64, no cache) over its tokens so far: the head's cache entries are right after rejections (a random head:
    most drafts fail), in batches at different lengths, for a request that continues a cached prefix, and after
    preemption (a small pool)."""
    import copy

    from models_mla_util import reference_mtp_drafts

    from dynamoe.engine.request import RUNNING

    from dynamoe.models import load

    model = mtp_model if family == "deepseek_v3" else load(_mtp_checkpoint(tmp_path, family=family), progress=False)
    ref = copy.deepcopy(model).double()
    g = torch.Generator().manual_seed(4)
    base = torch.randint(0, 128, (10,), generator=g).tolist()
    prompts = [base + [3, 1], torch.randint(0, 128, (7,), generator=g).tolist(), base * 2]
    e = GenerationEngine(model, max_seq_len=160, max_batch=3, block_size=4, speculative_tokens=3, draft="mtp",
                         kv_cache_blocks=16)
    reqs = [e.add_request(p, GREEDY, 14, ignore_eos=True) for p in prompts]
    checked = 0
    while e.has_work():
        e.step()
        if len(reqs) == 3 and reqs[0].finished:   # then one that continues request 0's blocks
            reqs.append(e.add_request(reqs[0].prompt_ids + reqs[0].output_ids + [8], GREEDY, 8, ignore_eos=True))
        for r in reqs:
            if r._mtp_draft and r.state == RUNNING and r._decoding:
                tokens = (r.prompt_ids + r.output_ids)[:r._computed]
                assert r._mtp_draft == reference_mtp_drafts(ref, tokens, len(r._mtp_draft))[0], (r.id, tokens)
                checked += 1
    assert checked > 20 and e.totals["preempted"] > 0 and reqs[3].stats.cached_tokens > 0
    assert e.totals["spec_accepted_mtp"] < e.totals["spec_drafted_mtp"] / 2   # (mostly rejected)
    e.cache.pool.check()


def test_mtp_requests_reuse_only_blocks_with_their_head_entries(mtp_model):
    """The head's entry at a block's last position depends on the token after the block: a request that drafts
    with the head takes a cached block only where its head entries were written for its own next token -- none of
    a sampled request's blocks (the head did not run there), and not the last block of a greedy request that
    went on differently. n-gram drafting takes them all."""
    g = torch.Generator().manual_seed(1)
    base = torch.randint(0, 128, (16,), generator=g).tolist()
    sampled = SamplingParams(temperature=0.9, seed=1)
    for draft, want in (("ngram", [0, 16, 16]), ("mtp", [0, 0, 12])):
        e = GenerationEngine(mtp_model, max_seq_len=160, max_batch=2, block_size=4, speculative_tokens=2, draft=draft)
        plain = GenerationEngine(mtp_model, max_seq_len=160, max_batch=2, block_size=4)
        got = []
        for prompt, sp in ((base + [1, 2], sampled), (base + [3], GREEDY), (base + [1, 4], GREEDY)):
            r, p = (x.add_request(prompt, sp, 6, ignore_eos=True) for x in (e, plain))
            e.run_until_done()
            plain.run_until_done()
            assert r.output_ids == p.output_ids
            got.append(r.stats.cached_tokens)
        assert got == want, draft
        e.cache.pool.check()


def test_mtp_head_that_predicts_the_model_is_accepted(tmp_path):
    """A bigram model and a head that computes its next token: nearly every draft is accepted, a step makes
    several tokens, and the tokens are still those of plain decoding (broken verification would show here)."""
    from dynamoe.models import load

    torch.set_num_threads(1)
    model = load(_mtp_checkpoint(tmp_path / "exact", seed=2, exact_head=True), progress=False)
    prompts = [_ids(7, 11), _ids(8, 6)]
    plain, e0, _ = _mtp_run(model, [prompts], [GREEDY, GREEDY], 30)
    spec, engine, _ = _mtp_run(model, [prompts], [GREEDY, GREEDY], 30, speculative_tokens=4, draft="mtp")
    assert spec == plain
    t = engine.totals
    assert t["spec_accepted_mtp"] >= 0.9 * t["spec_drafted_mtp"] > 0
    assert t["steps"] < e0.totals["steps"] / 2


def test_mtp_draft_needs_a_head(model):
    from types import SimpleNamespace

    from dynamoe.serve import cli as serve_cli

    with pytest.raises(ValueError, match="draft='mtp' needs a model with multi-token-prediction heads"):
        GenerationEngine(model, max_seq_len=64, speculative_tokens=2, draft="mtp")
    with pytest.raises(ValueError, match="draft must be one of"):
        GenerationEngine(model, max_seq_len=64, speculative_tokens=2, draft="eagle")
    args = SimpleNamespace(max_seq_len=64, max_num_seqs=1, prefix_caching=True, speculative_tokens=2,
                           speculative_draft="mtp")
    with pytest.raises(ValueError, match="--speculative-draft mtp needs a model with multi-token-prediction heads"):
        serve_cli.build_engine(args, model, None)
    from dynamoe import cli

    args = cli._parser().parse_args(["serve", "--num-speculative-tokens", "3", "--speculative-draft", "mtp"])
    assert (args.speculative_tokens, args.speculative_draft) == (3, "mtp")
    assert cli._parser().parse_args(["serve"]).speculative_draft == "ngram"
    with pytest.raises(SystemExit):
        cli._parser().parse_args(["serve", "--speculative-draft", "eagle"])


def test_mtp_needs_tokens_and_metrics_by_source(mtp_model):
    from dynamoe.serve.metrics import Metrics

    with pytest.raises(ValueError, match="speculative_tokens >= 1"):
        GenerationEngine(mtp_model, max_seq_len=64, draft="mtp")
    totals = {"spec_drafted_mtp": 7, "spec_accepted_mtp": 3}
    text = Metrics().render(model_name="m", waiting=0, running=0, max_num_seqs=1, expert_load={}, engine_totals=totals)
    assert 'dynamoe_spec_draft_tokens_total{source="mtp"} 7' in text
    assert 'dynamoe_spec_accepted_tokens_total{source="mtp"} 3' in text
    assert 'dynamoe_spec_draft_tokens_total{source="ngram"} 0' in text
    # the KV cache's share of memory holds fewer blocks when the head's layer takes its part of each
    from dynamoe.serve.cli import kv_cache_blocks

    plain, mtp = (kv_cache_blocks(mtp_model, 4096, 8, 16, memory=1 << 20, extra_layers=n) for n in (0, 1))
    assert mtp == plain * 3 // 4
