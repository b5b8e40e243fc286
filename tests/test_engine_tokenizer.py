"""Tokenizer, chat templates (against transformers), streaming detokenizer and stop strings."""
import json
import os
import random

import pytest

from engine_testing import DEEPSEEK_TEMPLATE, QWEN_TEMPLATE, write_tokenizer_dir
from dynamoe.engine import IncrementalDecoder, StopStrings, Tokenizer

os.environ.setdefault("HF_HUB_OFFLINE", "1")

TEXT = "héllo 世界 🙂"
POOL = ["h", "é", "l", "o", " ", "世", "界", "🙂", "🚀", "ñ", "ü", "a", "the", "\n", "ß", "你好"]

CONVERSATIONS = [
    [{"role": "user", "content": TEXT}],
    [{"role": "system", "content": "be brief"}, {"role": "user", "content": "hi"},
     {"role": "assistant", "content": "hello"}, {"role": "user", "content": TEXT}],
    [{"role": "user", "content": "why?"}, {"role": "assistant", "content": "because", "reasoning_content": "hmm"},
     {"role": "user", "content": "ok", "name": None}],
]


@pytest.fixture(scope="module")
def tok_dir(tmp_path_factory):
    return write_tokenizer_dir(str(tmp_path_factory.mktemp("tok")), generation_eos=[2, 0])


@pytest.fixture(scope="module")
def tok(tok_dir):
    return Tokenizer.from_dir(tok_dir)


@pytest.fixture(scope="module")
def hf(tok_dir):
    transformers = pytest.importorskip("transformers")
    return transformers.AutoTokenizer.from_pretrained(tok_dir)


def test_encode_decode_and_special_tokens(tok, hf):
    assert tok.encode(TEXT) == hf.encode(TEXT)
    assert tok.decode(tok.encode(TEXT)) == TEXT
    assert tok.eos_token == "<|im_end|>" and tok.pad_token == "<|endoftext|>" and tok.bos_token is None
    # tokenizer_config eos first, then generation_config's eos ids
    assert tok.eos_token_ids == [tok.token_to_id("<|im_end|>"), tok.token_to_id("<|endoftext|>")]
    ids = tok.encode("<|im_start|>user\nhi<|im_end|>", add_special_tokens=False)
    assert ids[0] == tok.token_to_id("<|im_start|>")
    assert tok.decode(ids) == "user\nhi" and tok.decode(ids, skip_special_tokens=False).startswith("<|im_start|>")


@pytest.mark.parametrize("conv", range(len(CONVERSATIONS)))
@pytest.mark.parametrize("kwargs", [dict(add_generation_prompt=True), dict(add_generation_prompt=False),
                                    dict(add_generation_prompt=True, enable_thinking=False),
                                    dict(add_generation_prompt=True, enable_thinking=True)])
def test_chat_template_matches_transformers(tok, hf, conv, kwargs):
    messages = CONVERSATIONS[conv]
    want = hf.apply_chat_template(messages, tokenize=False, **kwargs)
    assert tok.apply_chat_template(messages, **kwargs) == want
    want_ids = hf.apply_chat_template(messages, tokenize=True, return_dict=True, **kwargs)["input_ids"]
    assert tok.encode_chat(messages, **kwargs) == list(want_ids)


def test_chat_template_tools_system_and_errors(tok, hf):
    tools = [{"type": "function", "function": {"name": "get_weather", "description": "Wetter <heute> & morgen",
                                               "parameters": {"type": "object", "properties": {}}}}]
    messages = [{"role": "system", "content": "sys"}, {"role": "user", "content": TEXT}]
    want = hf.apply_chat_template(messages, tools=tools, tokenize=False, add_generation_prompt=True)
    assert tok.apply_chat_template(messages, tools=tools) == want
    assert "<heute> & morgen" in want  # tojson does not escape HTML
    # system= inserts a system message, or replaces the first one
    assert tok.apply_chat_template(messages[1:], system="sys") == tok.apply_chat_template(messages)
    assert tok.apply_chat_template([{"role": "system", "content": "old"}, messages[1]], system="sys") \
        == tok.apply_chat_template(messages)
    import jinja2
    with pytest.raises(jinja2.exceptions.TemplateError, match="unknown role"):
        tok.apply_chat_template([{"role": "wizard", "content": "x"}])
    with pytest.raises(ValueError, match="messages"):
        tok.apply_chat_template("just text")


def test_thinking_passed_under_both_names(tok, hf):
    messages = [{"role": "user", "content": "hi"}]
    for on in (True, False):
        want = hf.apply_chat_template(messages, chat_template=DEEPSEEK_TEMPLATE, tokenize=False,
                                      add_generation_prompt=True, thinking=on)
        got = tok.apply_chat_template(messages, chat_template=DEEPSEEK_TEMPLATE, enable_thinking=on)
        assert got == want
    assert tok.apply_chat_template(messages, chat_template=DEEPSEEK_TEMPLATE).endswith("</think>")


def test_template_sources(tmp_path, tok):
    messages = [{"role": "user", "content": "hi"}]
    # chat_template.jinja (transformers 5) takes priority over the config entry
    d = write_tokenizer_dir(str(tmp_path / "jinja"), chat_template=DEEPSEEK_TEMPLATE, jinja_file=True,
                            extra_config={"chat_template": "WRONG"})
    assert Tokenizer.from_dir(d).apply_chat_template(messages).startswith("<|im_start|>user hi")
    # a list of named templates; tools pick "tool_use"
    d = write_tokenizer_dir(str(tmp_path / "named"), chat_template=[
        {"name": "default", "template": QWEN_TEMPLATE}, {"name": "tool_use", "template": DEEPSEEK_TEMPLATE}])
    t = Tokenizer.from_dir(d)
    assert t.apply_chat_template(messages) == tok.apply_chat_template(messages)
    assert t.apply_chat_template(messages, tools=[{"type": "function"}]).startswith("<|im_start|>user hi")
    # --chat-template FILE overrides everything
    f = tmp_path / "override.jinja"
    f.write_text("{% for m in messages %}[{{ m.content }}]{% endfor %}")
    assert Tokenizer.from_dir(d, chat_template=str(f)).apply_chat_template(messages) == "[hi]"
    d = write_tokenizer_dir(str(tmp_path / "none"), chat_template=None)
    with pytest.raises(ValueError, match="no chat template"):
        Tokenizer.from_dir(d).apply_chat_template(messages)


def _texts(n, seed=0):
    rng = random.Random(seed)
    return [TEXT] + ["".join(rng.choice(POOL) for _ in range(rng.randint(1, 25))) for _ in range(n)]


def test_incremental_decoder_byte_level(tok):
    held = 0
    for text in _texts(60):
        ids = tok.encode(text)
        dec = IncrementalDecoder(tok.decode)
        deltas = [dec.push(t) for t in ids] + [dec.flush()]
        held += deltas.count("")
        assert "".join(deltas) == tok.decode(ids) == text
        assert not any("\ufffd" in d for d in deltas)
    assert held > 0  # some characters did span several tokens


def test_incremental_decoder_with_prompt_context(tok):
    prompt, out = tok.encode("the model"), tok.encode(" héllo 世界")
    dec = IncrementalDecoder(tok.decode, context=prompt)
    assert "".join(dec.push(t) for t in out) + dec.flush() == " héllo 世界"


def test_incremental_decoder_sentencepiece_style():
    """Metaspace ('▁') pieces with byte fallback and a decoder that strips the leading space (Llama)."""
    from tokenizers import Tokenizer as HFTokenizer, decoders, models, normalizers, pre_tokenizers

    pieces = [("<unk>", 0.0)] + [(f"<0x{b:02X}>", -10.0) for b in range(256)]
    pieces += [(p, -1.0) for p in ["▁", "▁h", "é", "llo", "▁the", "l", "o", "h", "a", "▁a", "世", "ñ"]]
    tok = HFTokenizer(models.Unigram(pieces, unk_id=0, byte_fallback=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("▁"), normalizers.Replace(" ", "▁")])
    tok.pre_tokenizer = pre_tokenizers.Split(" ", "merged_with_previous")  # keep the normalizer's pieces
    tok.decoder = decoders.Sequence([decoders.Replace("▁", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])

    def decode(ids):
        return tok.decode(ids, skip_special_tokens=True)

    for text in _texts(40, seed=1):
        ids = tok.encode(text).ids
        dec = IncrementalDecoder(decode)
        deltas = [dec.push(t) for t in ids] + [dec.flush()]
        assert "".join(deltas) == decode(ids)
        assert not any("\ufffd" in d for d in deltas)
        assert decode(ids) == text  # the double really is lossless, spaces included


@pytest.mark.parametrize("seed", range(5))
def test_stop_strings_cut_and_never_leak(seed):
    rng = random.Random(seed)
    text = "héllo wor世ld! the 🙂 STOP here, world!"
    stops = ["STOP", "world!", "🙂🙂"]
    want = text[: text.index("STOP")]  # "wor" and "🙂" are held, then released
    cuts = sorted(rng.sample(range(1, len(text)), 8))
    chunks = [text[a:b] for a, b in zip([0] + cuts, cuts + [len(text)])]
    s = StopStrings(stops)
    out, matched = "", None
    for c in chunks:
        piece, matched = s.push(c)
        out += piece
        assert want.startswith(out)  # nothing past the cut ever leaves
        if matched:
            break
    assert matched == "STOP" and out == want
    assert s.push("more")[0] == "" and s.flush() == ""


def test_stop_strings_hold_back_then_release():
    s = StopStrings(["</end>"])
    assert s.push("abc</e") == ("abc", None)   # "</e" might begin the stop string
    assert s.push("x") == ("</ex", None)       # it did not
    assert s.push("</") == ("", None)
    assert s.flush() == "</"                   # end of stream: held text is released
    with pytest.raises(ValueError, match="stop strings"):
        StopStrings([""])


def test_stop_strings_through_tokens(tok):
    text = "the quick brown fox 世界🙂 jumps"
    ids = tok.encode(text)
    for stop in ["界🙂", "k br", "fox 世", "o"]:
        dec, s = IncrementalDecoder(tok.decode), StopStrings([stop])
        out = ""
        for t in ids:
            piece, matched = s.push(dec.push(t))
            out += piece
            assert stop not in out
            if matched:
                break
        assert matched == stop and out == text[: text.index(stop)]


def test_from_dir_reads_added_tokens_missing_from_json(tmp_path, tok_dir):
    d = tmp_path / "t"
    d.mkdir()
    data = json.load(open(os.path.join(tok_dir, "tokenizer.json"), encoding="utf-8"))
    cfg = json.load(open(os.path.join(tok_dir, "tokenizer_config.json"), encoding="utf-8"))
    n = max(int(k) for k in cfg["added_tokens_decoder"]) + 1
    cfg["added_tokens_decoder"][str(n)] = {"content": "<|new|>", "special": True}
    (d / "tokenizer.json").write_text(json.dumps(data), encoding="utf-8")
    (d / "tokenizer_config.json").write_text(json.dumps(cfg), encoding="utf-8")
    t = Tokenizer.from_dir(str(d))
    assert t.token_to_id("<|new|>") == n
    assert t.decode(t.encode("a<|new|>b")) == "ab"
