"""The demo model's tokenizer: a byte-level BPE trained with ``tokenizers`` on the demo corpus, and a
Qwen3-style (ChatML) chat template.

Digits are split one per token before BPE (as Qwen's tokenizers do), so numbers are sequences of
digits and arithmetic is learnable; the spelled-out words of the corpus (``p-l-a-n-e-t``) and quoted
words (``"planet"``) are single letters for the same reason. Special tokens: ``<|endoftext|>`` (padding), ``<|im_start|>``,
``<|im_end|>`` (end of a turn: the eos token).

Saved as ``tokenizer.json`` + ``tokenizer_config.json`` (with the template), so
``dynamoe.engine.Tokenizer.from_dir`` and transformers' ``AutoTokenizer`` both load it.
"""
from __future__ import annotations

import json
import os
from typing import Iterable, Sequence

__all__ = ["CHAT_TEMPLATE", "TOOLS_HEADER", "segments", "render", "SPECIAL_TOKENS", "QUOTED_LETTER", "PAD", "IM_START", "IM_END", "train_tokenizer", "save_tokenizer",
           "encode_conversation", "encode_conversations"]

#: a letter of a word that ends right before a double quote: such words (``"planet"``: the words the
#: demo's word skills quote, and their answers) are split into single letters, so that writing a word
#: backwards or copying it letter by letter never needs a BPE merge the model has not seen.
QUOTED_LETTER = r'\p{L}(?=\p{L}*")'

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
#: what precedes the names of the offered tools in the system block
TOOLS_HEADER = "# Tools\n\nThe client offers these tools, which this model does not call: "
SPECIAL_TOKENS = (PAD, IM_START, IM_END)

# ChatML as Qwen3 writes it, without Qwen3's thinking and tool-call branches (the demo model calls no
# tools): a message's content may be a string or a list of {"type": "text", "text": ...} parts (what
# OpenAI and Anthropic clients send). Every system message -- the first one and those harnesses put
# later in the conversation -- goes into one leading system block, in order, joined by a blank line,
# followed by the names of the offered tools (their JSON schemas are left out: the model calls no tool,
# and an agent's tool list is tens of thousands of tokens); the other messages follow in order. The demo
# model reads the system block but answers the last user message.
CHAT_TEMPLATE = (
    "{%- set ns = namespace(system='') %}"
    "{%- for message in messages if message['role'] == 'system' %}"
    "{%- if ns.system %}{%- set ns.system = ns.system ~ '\\n\\n' %}{%- endif %}"
    "{%- if message['content'] is string %}{%- set ns.system = ns.system ~ message['content'] %}"
    "{%- elif message['content'] is not none %}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{%- set ns.system = ns.system ~ part['text'] %}{%- endif %}{%- endfor %}"
    "{%- endif %}"
    "{%- endfor %}"
    "{%- if tools %}"
    "{%- if ns.system %}{%- set ns.system = ns.system ~ '\\n\\n' %}{%- endif %}"
    "{%- set ns.system = ns.system ~ '" + TOOLS_HEADER.replace("\n", "\\n") + "' %}"
    "{%- for tool in tools %}{%- set ns.system = ns.system ~ (', ' if not loop.first else '') ~ "
    "(tool['function']['name'] if tool['function'] is defined else tool['name']) %}{%- endfor %}"
    "{%- set ns.system = ns.system ~ '.' %}"
    "{%- endif %}"
    "{%- if ns.system %}{{- '<|im_start|>system\\n' ~ ns.system ~ '<|im_end|>\\n' }}{%- endif %}"
    "{%- for message in messages if message['role'] != 'system' %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- elif message['content'] is not none %}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def _text(content) -> str:
    if content is None:
        return ""
    if isinstance(content, str):
        return content
    return "".join(p["text"] for p in content if p.get("type") == "text")


def segments(messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[tuple[str, str]]:
    """(role, text) of each rendered block, in :data:`CHAT_TEMPLATE`'s order: the system block first."""
    system = "\n\n".join(_text(m["content"]) for m in messages if m["role"] == "system")
    if tools:
        names = [t["function"]["name"] if "function" in t else t["name"] for t in tools]
        system += ("\n\n" if system else "") + TOOLS_HEADER + ", ".join(names) + "."
    head = [("system", system)] if system else []
    return head + [(m["role"], _text(m["content"])) for m in messages if m["role"] != "system"]


def render(messages: Sequence[dict], add_generation_prompt: bool = False, tools: Sequence[dict] | None = None) -> str:
    """What :data:`CHAT_TEMPLATE` renders, without Jinja (for the corpus)."""
    text = "".join(f"{IM_START}{role}\n{t}{IM_END}\n" for role, t in segments(messages, tools))
    return text + (f"{IM_START}assistant\n" if add_generation_prompt else "")


def train_tokenizer(texts: Iterable[str], vocab_size: int = 3072, min_frequency: int = 2):
    """A byte-level BPE (``tokenizers.Tokenizer``) trained on ``texts``; the special tokens get ids 0, 1, 2."""
    from tokenizers import Regex, Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(QUOTED_LETTER), behavior="isolated"),
        pre_tokenizers.Split(Regex(r"\p{N}"), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True),
    ])
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, min_frequency=min_frequency, show_progress=False,
                                  special_tokens=list(SPECIAL_TOKENS),
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(texts, trainer)
    return tok


def save_tokenizer(tok, out_dir: str, model_max_length: int = 512) -> None:
    """Write ``tokenizer.json`` and ``tokenizer_config.json`` (chat template, eos ``<|im_end|>``)."""
    os.makedirs(out_dir, exist_ok=True)
    tok.save(os.path.join(out_dir, "tokenizer.json"))
    added = {str(tok.token_to_id(t)): {"content": t, "lstrip": False, "normalized": False, "rstrip": False,
                                       "single_word": False, "special": True} for t in SPECIAL_TOKENS}
    config = {
        "tokenizer_class": "PreTrainedTokenizerFast",
        "bos_token": None, "eos_token": IM_END, "pad_token": PAD, "unk_token": None,
        "add_bos_token": False, "add_prefix_space": False, "clean_up_tokenization_spaces": False,
        "model_max_length": model_max_length, "added_tokens_decoder": added,
        "chat_template": CHAT_TEMPLATE,
    }
    with open(os.path.join(out_dir, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, indent=2, ensure_ascii=False)
        f.write("\n")


def _assistant_spans(messages: Sequence[dict], tools: Sequence[dict] | None = None) -> list[tuple[int, int]]:
    spans, pos = [], 0
    for role, t in segments(messages, tools):
        start = pos + len(f"{IM_START}{role}\n")
        end = start + len(t) + len(IM_END)
        if role == "assistant":
            spans.append((start, end))
        pos = end + 1
    return spans


def _mask(offsets, spans) -> list[int]:
    """1 for tokens (char offsets a..b, in order) inside one of the (sorted) spans."""
    out, i, n = [], 0, len(spans)
    for a, b in offsets:
        while i < n and spans[i][1] < b:
            i += 1
        out.append(1 if i < n and spans[i][0] <= a < b else 0)
    return out


def encode_conversation(tok, messages: Sequence[dict], tools: Sequence[dict] | None = None) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of one conversation rendered with the chat template: the mask is 1 on the
    tokens of every assistant reply and its ``<|im_end|>`` (what the model must learn to write)."""
    enc = tok.encode(render(messages, tools=tools), add_special_tokens=False)
    return list(enc.ids), _mask(enc.offsets, _assistant_spans(messages, tools))


def encode_conversations(tok, conversations: Sequence[Sequence[dict]],
                         tools: Sequence[Sequence[dict] | None] | None = None) -> list[tuple[list[int], list[int]]]:
    """:func:`encode_conversation` for many conversations at once (``encode_batch``: parallel);
    ``tools``: each conversation's offered tools (or None)."""
    tools = list(tools) if tools is not None else [None] * len(conversations)
    encs = tok.encode_batch([render(m, tools=t) for m, t in zip(conversations, tools)], add_special_tokens=False)
    return [(list(e.ids), _mask(e.offsets, _assistant_spans(m, t))) for e, m, t in zip(encs, conversations, tools)]
