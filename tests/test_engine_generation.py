"""GenerationEngine with a tiny test-double LM: continuous batching equals running alone, slots, finish
reasons, limits, threads; the `dynamoe generate` command."""
import json
import threading

import pytest
import torch

from engine_testing import TinyLM, write_tokenizer_dir
from dynamoe.engine import GenerationEngine, SamplingParams, Tokenizer

S = 48  # max_seq_len of every engine here: the same cache shape alone and batched


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tokenizer_dir(str(tmp_path_factory.mktemp("tok")))


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_dir(tok_dir)


@pytest.fixture(scope="module")
def model(tok):
    return TinyLM(tok.vocab_size).eval()


def _prompts(model, lengths, seed=0):
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(3, model.config.vocab_size, (n,), generator=g).tolist() for n in lengths]


def _alone(model, prompt, params, max_tokens, tokenizer=None, **kw):
    engine = GenerationEngine(model, tokenizer, max_seq_len=S, max_batch=3)
    req = engine.add_request(prompt, params, max_tokens, ignore_eos=True, **kw)
    engine.run_until_done()
    return req


PARAMS = {
    "greedy": [SamplingParams(temperature=0)] * 3,
    "seeded": [SamplingParams(temperature=0.8, top_p=0.9, top_k=40, seed=11), SamplingParams(temperature=0),
               SamplingParams(temperature=1.2, min_p=0.05, repetition_penalty=1.3, presence_penalty=0.5, seed=5)],
}


@pytest.mark.parametrize("mode", sorted(PARAMS))
def test_batched_decode_equals_alone(model, mode):
    prompts = _prompts(model, [3, 7, 12])
    params = PARAMS[mode]
    engine = GenerationEngine(model, None, max_seq_len=S, max_batch=3)
    model.calls.clear()
    reqs = [engine.add_request(p, sp, 10, ignore_eos=True) for p, sp in zip(prompts, params)]
    engine.run_until_done()
    assert (3, 1) in model.calls  # decode really ran batched
    for p, sp, r in zip(prompts, params, reqs):
        assert r.finish_reason == "length" and len(r.output_ids) == 10
        assert r.output_ids == _alone(model, p, sp, 10).output_ids


def test_equal_length_prompts_prefill_together(model):
    prompts = _prompts(model, [6, 6, 4], seed=1)
    engine = GenerationEngine(model, None, max_seq_len=S, max_batch=3)
    model.calls.clear()
    reqs = [engine.add_request(p, SamplingParams(temperature=0), 5, ignore_eos=True) for p in prompts]
    engine.step()   # prefill [6, 6] together, then [4]: each samples its first token
    assert model.calls == [(2, 6), (1, 4)] and all(len(r.output_ids) == 1 for r in reqs)
    engine.step()   # then all three decode together
    assert model.calls[2:] == [(3, 1)]
    engine.run_until_done()
    for p, r in zip(prompts, reqs):
        assert r.output_ids == _alone(model, p, SamplingParams(temperature=0), 5).output_ids


def test_chunked_prefill_equals_whole(model):
    p = _prompts(model, [13], seed=2)[0]
    engine = GenerationEngine(model, None, max_seq_len=S, max_batch=3, prefill_chunk=4)
    r = engine.add_request(p, SamplingParams(temperature=0), 6, ignore_eos=True)
    engine.run_until_done()
    assert r.output_ids == _alone(model, p, SamplingParams(temperature=0), 6).output_ids


def test_cancel_frees_slot_for_queued_request(model):
    prompts = _prompts(model, [5, 9, 4], seed=3)
    engine = GenerationEngine(model, None, max_seq_len=S, max_batch=2)
    greedy = SamplingParams(temperature=0)
    reqs = [engine.add_request(p, greedy, 8, ignore_eos=True) for p in prompts]
    engine.step()
    engine.step()
    assert [r.state for r in reqs] == ["running", "running", "waiting"] and engine.num_waiting == 1
    slot = reqs[0].slot
    assert engine.cancel(reqs[0]) and not engine.cancel(reqs[0])
    assert reqs[0].finish_reason == "cancelled" and reqs[0].slot is None and int(engine.cache.lengths[slot]) == 0
    events = []
    while True:
        ev = reqs[0].get_nowait()
        if ev is None:
            break
        events.append(ev)
    assert events[-1].finish_reason == "cancelled" and events[-1].token_id is None
    engine.step()
    assert reqs[2].state == "running" and reqs[2].slot == slot
    engine.run_until_done()
    # the reused slot held the cancelled request's keys: they must not leak into the newcomer
    assert reqs[2].output_ids == _alone(model, prompts[2], greedy, 8).output_ids
    assert reqs[1].output_ids == _alone(model, prompts[1], greedy, 8).output_ids
    # cancelling a waiting request removes it from the queue
    engine2 = GenerationEngine(model, None, max_seq_len=S, max_batch=1)
    a, b = (engine2.add_request(p, greedy, 3, ignore_eos=True) for p in prompts[:2])
    engine2.cancel(b)
    engine2.run_until_done()
    assert a.finish_reason == "length" and b.finish_reason == "cancelled" and b.output_ids == []


def test_finish_reasons_and_limits(model):
    p = _prompts(model, [6], seed=4)[0]
    greedy = SamplingParams(temperature=0)
    ref = _alone(model, p, greedy, 12).output_ids
    j = next(i for i in range(2, 12) if ref[i] not in ref[:i])
    engine = GenerationEngine(model, None, max_seq_len=S, max_batch=2)
    r = engine.add_request(p, greedy, 12, stop_token_ids=[ref[j]])
    engine.run_until_done()
    assert r.finish_reason == "stop" and r.stop_reason == ref[j] and r.output_ids == ref[: j + 1]
    # the model's eos (config / tokenizer) stops too, unless ignore_eos
    eos_model = TinyLM(model.config.vocab_size, eos_token_id=ref[j])
    eos_model.load_state_dict(model.state_dict())
    engine = GenerationEngine(eos_model, None, max_seq_len=S, max_batch=2)
    r1 = engine.add_request(p, greedy, 12)
    r2 = engine.add_request(p, greedy, 12, ignore_eos=True)
    engine.run_until_done()
    assert r1.output_ids == ref[: j + 1] and r1.finish_reason == "stop" and r2.output_ids == ref
    # max_seq_len
    engine = GenerationEngine(model, None, max_seq_len=16, max_batch=1)
    with pytest.raises(ValueError, match="max_seq_len=16"):
        engine.add_request(list(range(3, 13)), greedy, 7)
    with pytest.raises(ValueError, match="leaves no room"):
        engine.add_request(list(range(3, 19)), greedy)
    r = engine.add_request(list(range(3, 13)), greedy, 7, clip_max_tokens=True, ignore_eos=True)
    r_all = engine.add_request(list(range(3, 13)), greedy, None, ignore_eos=True)
    assert r.max_tokens == 6 and r_all.max_tokens == 6
    engine.run_until_done()
    # max_seq_len full before the asked max_tokens (or with none asked): 'context', not 'length'
    assert r.finish_reason == r_all.finish_reason == "context" and len(r.output_ids) == len(r_all.output_ids) == 6
    exact = engine.add_request(list(range(3, 13)), greedy, 6, ignore_eos=True)   # asked for exactly what fits
    engine.run_until_done()
    assert exact.finish_reason == "length"
    for bad, match in [(dict(prompt=[]), "at least one token"), (dict(prompt=[1, 10**6]), r"\[0, 302\)"),
                       (dict(prompt=[1], max_tokens=0), "max_tokens"), (dict(prompt="hi"), "tokenizer"),
                       (dict(prompt=[1], stop=["x"]), "tokenizer")]:
        with pytest.raises(ValueError, match=match):
            engine.add_request(**bad)


def test_text_events_stop_strings_and_stats(model, tok):
    greedy = SamplingParams(temperature=0, logprobs=2)
    prompt = tok.encode("the quick brown fox")
    ref = _alone(model, prompt, greedy, 24, tokenizer=tok)
    full = ref.text
    assert ref.stats.prefill_tokens_per_s > 0 and ref.stats.decode_ms_per_token > 0
    assert len(ref.logprobs) == 24 and ref.logprobs[0].top[0][0] == ref.output_ids[0]
    # a stop string from the middle of the text, usually spanning tokens
    a = len(full) // 3
    stop = full[a:a + 3]
    a = full.index(stop)
    engine = GenerationEngine(model, tok, max_seq_len=S, max_batch=2)
    r = engine.add_request(prompt, greedy, 24, stop=[stop], ignore_eos=True)
    other = engine.add_request(prompt[:2], SamplingParams(temperature=0), 5, ignore_eos=True)
    events = engine.step() + engine.step()
    engine.run_until_done()
    assert r.finish_reason == "stop" and r.stop_reason == stop and r.text == full[:a]
    assert other.finish_reason == "length"
    got = []
    while (ev := r.get_nowait()) is not None:
        got.append(ev)
    assert "".join(e.text for e in got) == r.text and got[-1].finish_reason == "stop"
    assert all(e.finish_reason is None for e in got[:-1]) and {e.request_id for e in events} == {r.id, other.id}


def test_generate_and_stream_helpers(model, tok):
    engine = GenerationEngine(model, tok, max_seq_len=S, max_batch=2)
    messages = [{"role": "user", "content": "héllo 世界 🙂"}]
    text = engine.generate(messages, 8, temperature=0, ignore_eos=True, thinking=False)
    ids = tok.encode_chat(messages, enable_thinking=False)
    ref = _alone(model, ids, SamplingParams(temperature=0), 8, tokenizer=tok)
    assert text == ref.text
    assert engine.generate("héllo 世界 🙂", 8, chat=True, temperature=0, ignore_eos=True) \
        == engine.generate(messages, 8, temperature=0, ignore_eos=True)
    stream = engine.stream(ids, 8, temperature=0, ignore_eos=True)
    next(stream)
    stream.close()  # closing early cancels
    assert engine.num_running == 0 and not engine.has_work()
    import dynamoe
    assert dynamoe.generate(model, ids, tokenizer=tok, max_tokens=8, temperature=0, ignore_eos=True) == ref.text
    with pytest.raises(ValueError, match="temperature"):
        engine.generate("x", 4, temperature=-1)


def test_background_thread_add_and_cancel(model):
    greedy = SamplingParams(temperature=0)
    prompts = _prompts(model, [4, 8, 5], seed=5)
    want = [_alone(model, p, greedy, 10).output_ids for p in prompts]
    engine = GenerationEngine(model, None, max_seq_len=S, max_batch=2)
    stop = engine.start()
    try:
        reqs = []
        threads = [threading.Thread(target=lambda p=p: reqs.append(engine.add_request(p, greedy, 10, ignore_eos=True)))
                   for p in prompts]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        doomed = engine.add_request(prompts[0], greedy, 40, ignore_eos=True)
        for r in reqs:
            toks = [ev.token_id for ev in r.events(timeout=30) if ev.token_id is not None]
            assert toks == r.output_ids and r.output_ids == want[prompts.index(r.prompt_ids)]
        engine.cancel(doomed)
        assert doomed.wait(30) and doomed.finish_reason in ("cancelled", "length")
        assert list(engine.stream(prompts[1], 10, temperature=0, ignore_eos=True))[-1].finish_reason == "length"
    finally:
        stop.set()


def test_cli_generate(tmp_path, monkeypatch, model, tok, capsys):
    from dynamoe import cli
    d = write_tokenizer_dir(str(tmp_path / "ckpt"))
    with open(f"{d}/config.json", "w") as f:
        json.dump({"model_type": "tiny_test_lm"}, f)
    for argv, name in [(["--temperature", "-1"], "--temperature"), (["--top-p", "2"], "--top-p"),
                       (["--max-tokens", "0"], "--max-tokens"), (["--top-k", "x"], "--top-k"),
                       (["--dtype", "int8"], "--dtype"), (["--system", "s"], "--system")]:
        with pytest.raises(SystemExit) as e:
            cli.main(["generate", "--model", d, "--prompt", "hi", *argv])
        assert e.value.code == 2 and name in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["quantize", "--input", d])  # the other subcommand still parses (and asks for --output)
    assert "--output" in capsys.readouterr().err

    import dynamoe.engine
    monkeypatch.setattr(dynamoe.engine, "load", lambda path, **kw: (model, Tokenizer.from_dir(path)))
    argv = ["generate", "--model", d, "--prompt", "héllo", "--chat", "--no-thinking", "--max-tokens", "6",
            "--system", "be brief", "--stats"]
    assert cli.main(argv) == 0
    out = capsys.readouterr()
    ids = tok.encode_chat([{"role": "user", "content": "héllo"}], system="be brief", enable_thinking=False)
    engine = GenerationEngine(model, tok, max_seq_len=len(ids) + 6, max_batch=1)
    assert out.out == engine.generate(ids, 6, temperature=0) + "\n"
    assert "tok/s" in out.err


def test_on_event_callback_may_cancel_and_errors_end_requests(model):
    engine = GenerationEngine(model, None, max_seq_len=S, max_batch=2)
    seen = []

    def on_event(ev):
        seen.append(ev)
        if len(seen) == 3:
            engine.cancel(req)

    req = engine.add_request([5, 6, 7], SamplingParams(temperature=0), 20, ignore_eos=True, on_event=on_event)
    engine.run_until_done()
    assert req.finish_reason == "cancelled" and len(req.output_ids) == 3 and seen[-1].finish_reason == "cancelled"

    class Flaky(torch.nn.Module):
        def __init__(self):
            super().__init__()
            self.inner, self.config, self.fail = model, model.config, True

        def new_cache(self, *a, **kw):
            return self.inner.new_cache(*a, **kw)

        def forward(self, ids, cache=None, slots=None):
            if self.fail and ids.shape[1] == 1:
                self.fail = False
                raise RuntimeError("boom")
            return self.inner(ids, cache=cache, slots=slots)

    engine = GenerationEngine(Flaky(), None, max_seq_len=S, max_batch=1)
    a = engine.add_request([5, 6, 7], SamplingParams(temperature=0), 5, ignore_eos=True)
    b = engine.add_request([5, 6, 7], SamplingParams(temperature=0), 5, ignore_eos=True)
    engine.step()   # a's prefill (its first token)
    with pytest.raises(RuntimeError, match="boom"):
        engine.step()   # a's first decode step fails
    assert a.finish_reason == "error" and list(a.events())[-1].error == "RuntimeError: boom"
    engine.run_until_done()  # the slot is free again and the next request runs normally
    assert b.finish_reason == "length"
    assert b.output_ids == _alone(model, [5, 6, 7], SamplingParams(temperature=0), 5).output_ids


def test_end_to_end_with_a_loaded_checkpoint(tmp_path, capsys, tok):
    """A tiny random Qwen3-MoE saved by transformers, loaded by dynamoe.models: the engine's batched greedy
    output equals transformers' generate, and `dynamoe generate` streams it."""
    transformers = pytest.importorskip("transformers")
    from dynamoe import cli
    from dynamoe.engine import load

    d = write_tokenizer_dir(str(tmp_path / "ckpt"))
    cfg = transformers.Qwen3MoeConfig(vocab_size=tok.vocab_size, hidden_size=32, intermediate_size=48,
                                      moe_intermediate_size=16, num_hidden_layers=2, num_attention_heads=4,
                                      num_key_value_heads=2, head_dim=8, num_experts=4, num_experts_per_tok=2,
                                      max_position_embeddings=128, bos_token_id=None, eos_token_id=2)
    torch.manual_seed(0)
    hf = transformers.Qwen3MoeForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2)
    hf.save_pretrained(d)
    model, tokenizer = load(d)
    prompts = [tokenizer.encode(t) for t in ["héllo 世界", "the quick brown fox jumps", "über"]]
    engine = GenerationEngine(model, tokenizer, max_seq_len=40, max_batch=3)
    reqs = [engine.add_request(p, SamplingParams(temperature=0), 8, ignore_eos=True) for p in prompts]
    engine.run_until_done()
    for p, r in zip(prompts, reqs):
        ids = torch.tensor([p])
        ref = hf.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=8, do_sample=False,
                          pad_token_id=0, eos_token_id=None)[0, len(p):].tolist()
        assert r.output_ids == ref
    capsys.readouterr()
    assert cli.main(["generate", "--model", d, "--prompt", "héllo 世界", "--max-tokens", "8"]) == 0
    text = tokenizer.decode(hf.generate(torch.tensor([prompts[0]]), max_new_tokens=8, do_sample=False,
                                        pad_token_id=0, eos_token_id=2)[0, len(prompts[0]):].tolist())
    assert capsys.readouterr().out == text + "\n"
