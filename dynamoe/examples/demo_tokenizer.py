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

__all__ = ["CHAT_TEMPLATE", "SPECIAL_TOKENS", "QUOTED_LETTER", "PAD", "IM_START", "IM_END", "train_tokenizer", "save_tokenizer",
           "render", "encode_conversation", "encode_conversations"]

#: a letter of a word that ends right before a double quote: such words (``"planet"``: the words the
#: demo's word skills quote, and their answers) are split into single letters, so that writing a word
#: backwards or copying it letter by letter never needs a BPE merge the model has not seen.
QUOTED_LETTER = r'\p{L}(?=\p{L}*")'

PAD, IM_START, IM_END = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
SPECIAL_TOKENS = (PAD, IM_START, IM_END)

# ChatML as Qwen3 writes it (without Qwen3's tool and thinking branches): a message's content may be a
# string or a list of {"type": "text", "text": ...} parts (what OpenAI clients send).
CHAT_TEMPLATE = (
    "{%- for message in messages %}"
    "{{- '<|im_start|>' + message['role'] + '\\n' }}"
    "{%- if message['content'] is string %}{{- message['content'] }}"
    "{%- elif message['content'] is not none %}"
    "{%- for part in message['content'] %}{%- if part['type'] == 'text' %}{{- part['text'] }}{%- endif %}{%- endfor %}"
    "{%- endif %}"
    "{{- '<|im_end|>\\n' }}"
    "{%- endfor %}"
    "{%- if add_generation_prompt %}{{- '<|im_start|>assistant\\n' }}{%- endif %}"
)


def render(messages: Sequence[dict], add_generation_prompt: bool = False) -> str:
    """What :data:`CHAT_TEMPLATE` renders for string contents, without Jinja (for the corpus)."""
    text = "".join(f"{IM_START}{m['role']}\n{m['content']}{IM_END}\n" for m in messages)
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


def _assistant_spans(messages: Sequence[dict]) -> list[tuple[int, int]]:
    spans, pos = [], 0
    for m in messages:
        start = pos + len(f"{IM_START}{m['role']}\n")
        end = start + len(m["content"]) + len(IM_END)
        if m["role"] == "assistant":
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


def encode_conversation(tok, messages: Sequence[dict]) -> tuple[list[int], list[int]]:
    """(ids, loss mask) of one conversation rendered with the chat template: the mask is 1 on the
    tokens of every assistant reply and its ``<|im_end|>`` (what the model must learn to write)."""
    enc = tok.encode(render(messages), add_special_tokens=False)
    return list(enc.ids), _mask(enc.offsets, _assistant_spans(messages))


def encode_conversations(tok, conversations: Sequence[Sequence[dict]]) -> list[tuple[list[int], list[int]]]:
    """:func:`encode_conversation` for many conversations at once (``encode_batch``: parallel)."""
    encs = tok.encode_batch([render(m) for m in conversations], add_special_tokens=False)
    return [(list(e.ids), _mask(e.offsets, _assistant_spans(m))) for e, m in zip(encs, conversations)]
