"""Test doubles for the engine tests: a tiny byte-level BPE tokenizer folder and a tiny causal LM that
honours the model contract of dynamoe.engine (``new_cache`` + ``model(ids, cache=, slots=)``)."""
from __future__ import annotations

import json
import math
import os
from types import SimpleNamespace

import torch
from torch import nn

from dynamoe.models.cache import KVCache

SENTENCES = [
    "héllo 世界 🙂",
    "hello world, the quick brown fox jumps over the lazy dog",
    "les élèves étudient à l'école; über schön",
    "世界你好 🙂🙂 emoji 🚀 and ñandú",
    "the model writes text and the engine streams it",
]

SPECIAL = ["<|endoftext|>", "<|im_start|>", "<|im_end|>"]

# a small Qwen3-like template: system, tools, reasoning_content, loop controls, raise_exception, enable_thinking
QWEN_TEMPLATE = (
    "{%- if tools %}\n"
    "    {{- '<|im_start|>system\\n' }}\n"
    "    {%- if messages[0].role == 'system' %}\n"
    "        {{- messages[0].content + '\\n\\n' }}\n"
    "    {%- endif %}\n"
    "    {{- '# Tools\\n<tools>' }}\n"
    "    {%- for tool in tools %}\n"
    "        {{- '\\n' }}{{- tool | tojson }}\n"
    "    {%- endfor %}\n"
    "    {{- '\\n</tools><|im_end|>\\n' }}\n"
    "{%- elif messages[0].role == 'system' %}\n"
    "    {{- '<|im_start|>system\\n' + messages[0].content + '<|im_end|>\\n' }}\n"
    "{%- endif %}\n"
    "{%- for message in messages %}\n"
    "    {%- if message.role == 'system' and loop.first %}\n"
    "        {%- continue %}\n"
    "    {%- endif %}\n"
    "    {%- if message.role not in ['system', 'user', 'assistant', 'tool'] %}\n"
    "        {{- raise_exception('unknown role ' + message.role) }}\n"
    "    {%- endif %}\n"
    "    {%- if message.role == 'assistant' and message.reasoning_content is defined %}\n"
    "        {{- '<|im_start|>assistant\\n<think>\\n' + message.reasoning_content + '\\n</think>\\n\\n'"
    " + message.content + '<|im_end|>\\n' }}\n"
    "    {%- else %}\n"
    "        {{- '<|im_start|>' + message.role + '\\n' + message.content + '<|im_end|>\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endfor %}\n"
    "{%- if add_generation_prompt %}\n"
    "    {{- '<|im_start|>assistant\\n' }}\n"
    "    {%- if enable_thinking is defined and enable_thinking is false %}\n"
    "        {{- '<think>\\n\\n</think>\\n\\n' }}\n"
    "    {%- endif %}\n"
    "{%- endif %}\n"
)

# DeepSeek-V3.1 style: the switch is called `thinking`
DEEPSEEK_TEMPLATE = (
    "{{ bos_token }}{% for m in messages %}{% if m.role == 'user' %}<|im_start|>user {{ m.content }}"
    "{% elif m.role == 'assistant' %}<|im_start|>assistant {{ m.content }}<|im_end|>{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant {% if thinking is defined and thinking %}<think>"
    "{% else %}</think>{% endif %}{% endif %}"
)


def build_bpe_tokenizer(vocab_size: int = 300):
    """A byte-level BPE (GPT-2 / Qwen style) trained on SENTENCES; small enough that many multi-byte
    characters stay split over several tokens."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=vocab_size, special_tokens=SPECIAL, show_progress=False,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet())
    tok.train_from_iterator(SENTENCES * 3, trainer)
    tok.add_tokens(["<think>", "</think>"])  # added but not special, as in Qwen3
    return tok


def write_tokenizer_dir(path: str, *, chat_template=QWEN_TEMPLATE, jinja_file: bool = False,
                        generation_eos=None, extra_config: dict | None = None) -> str:
    """tokenizer.json + tokenizer_config.json (+ chat_template.jinja, generation_config.json) under ``path``."""
    os.makedirs(path, exist_ok=True)
    tok = build_bpe_tokenizer()
    tok.save(os.path.join(path, "tokenizer.json"))
    decoder = {}
    for content in SPECIAL + ["<think>", "</think>"]:
        decoder[str(tok.token_to_id(content))] = {"content": content, "lstrip": False, "normalized": False,
                                                  "rstrip": False, "single_word": False,
                                                  "special": content in SPECIAL}
    config = {"tokenizer_class": "PreTrainedTokenizerFast", "added_tokens_decoder": decoder,
              "eos_token": "<|im_end|>", "pad_token": "<|endoftext|>", "bos_token": None,
              "model_max_length": 4096, **(extra_config or {})}
    if chat_template is not None:
        if jinja_file:
            with open(os.path.join(path, "chat_template.jinja"), "w", encoding="utf-8") as f:
                f.write(chat_template)
        else:
            config["chat_template"] = chat_template
    with open(os.path.join(path, "tokenizer_config.json"), "w", encoding="utf-8") as f:
        json.dump(config, f, ensure_ascii=False, indent=1)
    if generation_eos is not None:
        with open(os.path.join(path, "generation_config.json"), "w") as f:
            json.dump({"eos_token_id": generation_eos}, f)
    return path


class TinyLM(nn.Module):
    """A one-layer causal LM (token + position embedding, one attention head, MLP, head) that honours the
    engine's model contract. The KV cache holds "k" and "v" [slots, S, D]; each row attends to the
    positions of its own slot up to its own position, so rows at different lengths batch freely."""

    def __init__(self, vocab_size: int = 64, dim: int = 32, max_position_embeddings: int = 256, eos_token_id=None,
                 seed: int = 0):
        super().__init__()
        self.config = SimpleNamespace(vocab_size=vocab_size, max_position_embeddings=max_position_embeddings,
                                      eos_token_id=eos_token_id, model_type="tiny_test_lm")
        self.dim = dim
        with torch.random.fork_rng():
            torch.manual_seed(seed)
            self.tok = nn.Embedding(vocab_size, dim)
            self.pos = nn.Embedding(max_position_embeddings, dim)
            self.qkv = nn.Linear(dim, 3 * dim)
            self.proj = nn.Linear(dim, dim)
            self.mlp = nn.Sequential(nn.Linear(dim, 2 * dim), nn.GELU(), nn.Linear(2 * dim, dim))
            self.head = nn.Linear(dim, vocab_size)
            with torch.no_grad():
                self.head.weight.mul_(4.0)  # a peakier distribution than the default init gives
        self.calls: list[tuple[int, int]] = []   # (B, T) of every forward, for the tests

    def new_cache(self, num_slots: int, max_seq_len: int, dtype=None, device=None, **paging) -> KVCache:
        return KVCache(num_slots, max_seq_len, num_layers=1, dtype=dtype or torch.float32, device=device, **paging)

    def forward(self, input_ids, cache: KVCache | None = None, slots=None):
        B, T = input_ids.shape
        self.calls.append((B, T))
        D = self.dim
        start_B = cache.check_room(slots, T) if cache is not None else torch.zeros(B, dtype=torch.long)
        pos_BT = start_B[:, None] + torch.arange(T)
        x = self.tok(input_ids) + self.pos(pos_BT)
        q, k, v = self.qkv(x).split(D, dim=-1)
        if cache is not None:
            S = int(pos_BT.max()) + 1
            kv = cache.write(0, slots, pos_BT, S, k=k[:, None], v=v[:, None])   # paged, one head: [B, 1, S, D]
            keys, vals = kv["k"][:, 0], kv["v"][:, 0]
            key_pos = torch.arange(S)
        else:
            keys, vals, key_pos = k, v, torch.arange(T)
        mask_BTS = key_pos[None, None, :] <= pos_BT[:, :, None]
        att = (q @ keys.transpose(-1, -2)) / math.sqrt(D)
        att = att.masked_fill(~mask_BTS, float("-inf")).softmax(-1)
        x = x + self.proj(att @ vals)
        x = x + self.mlp(x)
        if cache is not None:
            cache.advance(slots, T)
        return self.head(x)
