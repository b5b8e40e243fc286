"""Shared helpers of the model-family tests: tiny random transformers models saved to a folder,
loaded back with dynamoe, and the checks every family runs (logits parity, greedy generation,
cached decode, rows at different lengths)."""
from __future__ import annotations

import pytest
import torch

VOCAB = 128
ATOL = 1e-4


@pytest.fixture(scope="module", autouse=True)
def one_thread():
    """Tiny models run fastest on one thread (and a shared machine's second core is often busy:
    OpenMP then waits for it on every op)."""
    n = torch.get_num_threads()
    torch.set_num_threads(1)
    yield
    torch.set_num_threads(n)


def ids(rows=2, tokens=24, seed=0) -> torch.Tensor:
    """Random token ids [rows, tokens] of the tiny models' vocabulary, seeded."""
    return torch.randint(0, VOCAB, (rows, tokens), generator=torch.Generator().manual_seed(seed))


def randomize_(model: torch.nn.Module, seed: int, std: float = 0.2, scales: dict | None = None) -> None:
    """Non-trivial random weights (transformers' init is near zero): N(0, std) everywhere, norms
    around 1, ``scales`` = {substring: std} for parameters whose name contains the substring."""
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for name, p in model.named_parameters():
            noise = torch.randn(p.shape, generator=g)
            if "norm" in name:
                p.copy_(1 + 0.2 * noise)
                continue
            s = std
            for key, value in (scales or {}).items():
                if key in name:
                    s = value
            p.copy_(noise * s)


def save_tiny(model, path, **kwargs) -> str:
    model.save_pretrained(str(path), **kwargs)
    return str(path)


def fused_families(transformers, max_position_embeddings: int = 64) -> dict:
    """Tiny transformers models whose every layer has a fused decode kernel (what a decode plan runs as one native
    call): Qwen3-MoE with a dense MLP in layer 1 (its own kernel, in the same DecodeStack), GPT-OSS with sinks,
    router biases and a window of 5 (shorter than the sequences)."""
    common = dict(vocab_size=96, hidden_size=64, num_hidden_layers=3, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=16, max_position_embeddings=max_position_embeddings, bos_token_id=None, eos_token_id=None,
                  tie_word_embeddings=False)
    return {
        "qwen3_moe": lambda: transformers.Qwen3MoeForCausalLM(transformers.Qwen3MoeConfig(
            intermediate_size=96, moe_intermediate_size=32, num_experts=8, num_experts_per_tok=2, norm_topk_prob=True,
            mlp_only_layers=[1], **common)),
        "gpt_oss": lambda: transformers.GptOssForCausalLM(transformers.GptOssConfig(
            intermediate_size=32, num_local_experts=4, num_experts_per_tok=2, sliding_window=5, **common)),
    }


def save_family(families: dict, name: str, tmp_path_factory) -> str:
    """``families[name]()`` (a tiny transformers model) with :func:`randomize_` weights (sinks at
    full scale), saved to a fresh folder."""
    torch.manual_seed(0)
    hf = families[name]().eval()
    randomize_(hf, seed=2, scales={"sinks": 1.0})
    return save_tiny(hf, tmp_path_factory.mktemp(name))


def hf_logits(hf, ids: torch.Tensor) -> torch.Tensor:
    with torch.no_grad():
        return hf(ids).logits


def greedy(model, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    """Greedy continuation with the KV cache: prefill all rows, then one token per step."""
    B, T = ids.shape
    cache = model.new_cache(B, T + new_tokens)
    slots = torch.arange(B)
    out = [ids]
    with torch.no_grad():
        logits = model(ids, cache=cache, slots=slots)
        for _ in range(new_tokens):
            nxt = logits[:, -1].argmax(-1, keepdim=True)
            out.append(nxt)
            logits = model(nxt, cache=cache, slots=slots)
    return torch.cat(out, dim=1)


def hf_greedy(hf, ids: torch.Tensor, new_tokens: int) -> torch.Tensor:
    with torch.no_grad():
        return hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                           pad_token_id=0)


def check_logits(hf, ours, ids: torch.Tensor) -> None:
    with torch.no_grad():
        ref, got = hf_logits(hf, ids), ours(ids)
    assert got.shape == ref.shape
    scale = ref.abs().max().item()
    assert scale > 1.0, "random model too close to zero to test anything"
    # fp32 sums in another order (oneDNN/MKL kernels differ by CPU): differences grow with the logits' scale
    torch.testing.assert_close(got, ref, atol=ATOL * scale, rtol=0)


def check_greedy(hf, ours, ids: torch.Tensor, new_tokens: int = 16) -> None:
    ref = hf_greedy(hf, ids, new_tokens)
    got = greedy(ours, ids, new_tokens)
    assert ref.shape == got.shape == (ids.size(0), ids.size(1) + new_tokens)
    assert torch.equal(got, ref), f"greedy continuations differ:\n{got[:, ids.size(1):]}\n{ref[:, ids.size(1):]}"


def check_cached_decode(ours, ids: torch.Tensor, prefill: int, chunk: int = 4) -> None:
    """Prefill ``prefill`` tokens, continue the prefill with a ``chunk`` of tokens (chunked prefill on
    top of cached keys), then decode token by token: every step's logits equal the full recompute's
    (no cache) at those positions."""
    B, T = ids.shape
    with torch.no_grad():
        full = ours(ids)
        cache = ours.new_cache(B, T)
        slots = torch.arange(B)
        steps = [ours(ids[:, :prefill], cache=cache, slots=slots),
                 ours(ids[:, prefill:prefill + chunk], cache=cache, slots=slots)]
        for t in range(prefill + chunk, T):
            steps.append(ours(ids[:, t:t + 1], cache=cache, slots=slots))
    assert torch.equal(cache.lengths, torch.full((B,), T))
    torch.testing.assert_close(torch.cat(steps, dim=1), full, atol=ATOL, rtol=0)


def check_ragged_batch(ours, lengths=(10, 17), decode_steps: int = 6, seed: int = 5) -> None:
    """Two rows at different lengths decoded together (slots in reverse order) give each row's
    logits when decoded alone."""
    g = torch.Generator().manual_seed(seed)
    prompts = [torch.randint(0, VOCAB, (1, n), generator=g) for n in lengths]
    nexts = torch.randint(0, VOCAB, (len(lengths), decode_steps), generator=g)
    with torch.no_grad():
        alone = []
        for r, p in enumerate(prompts):
            cache = ours.new_cache(1, 64)
            ours(p, cache=cache, slots=torch.tensor([0]))
            alone.append(torch.cat([ours(nexts[r:r + 1, s:s + 1], cache=cache, slots=torch.tensor([0]))
                                    for s in range(decode_steps)], dim=1))
        cache = ours.new_cache(3, 64)
        slots = torch.tensor([2, 0])  # row r lives in slot slots[r]
        for r, p in enumerate(prompts):
            ours(p, cache=cache, slots=slots[r:r + 1])
        together = torch.cat([ours(nexts[:, s:s + 1], cache=cache, slots=slots) for s in range(decode_steps)], dim=1)
    assert cache.lengths.tolist() == [lengths[1] + decode_steps, 0, lengths[0] + decode_steps]
    torch.testing.assert_close(together, torch.cat(alone, dim=0), atol=ATOL, rtol=0)


def check_engine_with_shared_prefix(hf, ours, vocab: int) -> None:
    """The serving engine (continuous batching, chunked prefill, prefix reuse of a shared prompt head) gives
    transformers' greedy tokens per prompt."""
    from dynamoe.engine import GenerationEngine, SamplingParams

    g = torch.Generator().manual_seed(11)
    head = torch.randint(0, vocab, (17,), generator=g).tolist()
    prompts = [torch.randint(0, vocab, (6,), generator=g).tolist(), head + [5, 9], head + [7]]
    engine = GenerationEngine(ours, None, max_seq_len=48, max_batch=2, prefill_chunk=7)
    reqs = [engine.add_request(p, SamplingParams(temperature=0), 10, ignore_eos=True) for p in prompts]
    engine.run_until_done()
    assert engine.totals["cached_tokens"] >= 16   # the third prompt reused the second's first block
    for p, r in zip(prompts, reqs):
        want = hf.generate(torch.tensor([p]), attention_mask=torch.ones(1, len(p), dtype=torch.long),
                           max_new_tokens=10, do_sample=False, pad_token_id=0)[0, len(p):].tolist()
        assert r.output_ids == want


def check_mtp_drafts(model, reference, vocab: int, k: int = 4) -> None:
    """The model's multi-token-prediction head (:mod:`dynamoe.models.mtp`) over two rows of different lengths --
    ``mtp_fill`` after a 5-token prefill of both, then after each row's rest on its own (continuing the cache) --,
    then ``mtp_drafts`` of both rows at once (k and k - 1 drafts): each row's last head output and its drafts equal
    ``reference(float64 copy of the model, tokens, k) -> (drafts, head output)``, a recomputation without a cache."""
    import copy

    g = torch.Generator().manual_seed(11)
    rows = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (13, 9)]
    cache = model.new_cache(2, 64)
    slots = torch.arange(2)
    with torch.no_grad():
        _, h = model(torch.tensor([r[:5] for r in rows]), cache=cache, slots=slots, return_hidden=True)
        model.mtp_fill(torch.tensor([r[1:6] for r in rows]), h, torch.arange(5).expand(2, 5), cache, slots)
        outs = []
        for b, r in enumerate(rows):
            lg, h = model(torch.tensor([r[5:]]), cache=cache, slots=slots[b:b + 1], return_hidden=True)
            after = r[6:] + [int(lg[0, -1].argmax())]
            outs.append(model.mtp_fill(torch.tensor([after]), h, torch.arange(5, len(r))[None], cache,
                                       slots[b:b + 1])[0, -1])
        g_BD = torch.stack(outs)
        drafts = model.mtp_drafts(g_BD, torch.tensor([len(r) - 1 for r in rows]), cache, slots, [k, k - 1])
    ref = copy.deepcopy(model).double()
    for b, r in enumerate(rows):
        want, g_ref = reference(ref, r, k)
        torch.testing.assert_close(g_BD[b].double(), g_ref, atol=2e-4, rtol=2e-4)
        assert drafts[b] == want[:k - b], b


def check_engine_mtp_drafts_follow_the_head(model, reference, vocab: int) -> None:
    """After every engine step (draft='mtp', two requests of different lengths), each decoding request's drafts
    for the next step equal ``reference(float64 copy, tokens so far, k)[0]``: the head's cache entries stay right
    after rejected drafts (a random head: most are)."""
    import copy

    from dynamoe.engine import GenerationEngine, SamplingParams
    from dynamoe.engine.request import RUNNING

    ref = copy.deepcopy(model).double()
    g = torch.Generator().manual_seed(4)
    prompts = [torch.randint(0, vocab, (n,), generator=g).tolist() for n in (10, 7)]
    e = GenerationEngine(model, max_seq_len=96, max_batch=2, block_size=4, speculative_tokens=3, draft="mtp")
    reqs = [e.add_request(p, SamplingParams(temperature=0.0), 8, ignore_eos=True) for p in prompts]
    checked = 0
    while e.has_work():
        e.step()
        for r in reqs:
            if r._mtp_draft and r.state == RUNNING and r._decoding:
                tokens = (r.prompt_ids + r.output_ids)[:r._computed]
                assert r._mtp_draft == reference(ref, tokens, len(r._mtp_draft))[0], (r.id, tokens)
                checked += 1
    assert checked >= 6
