"""Prompts to token ids: chat messages through the chat template, text through the tokenizer, or ids
checked as they are."""
from __future__ import annotations

import operator

from torch import Tensor

__all__ = ["encode_prompt", "token_list"]


def encode_prompt(tokenizer, prompt, *, chat: bool | None = None, system: str | None = None,
                  thinking: bool | None = None, tools=None, chat_template_kwargs: dict | None = None) -> list[int]:
    """Token ids of ``prompt``: a list of chat messages (rendered with the chat template), text (with
    ``chat=True``: one user message; else encoded as is), or token ids (returned as a list)."""
    is_messages = isinstance(prompt, (list, tuple)) and len(prompt) > 0 and isinstance(prompt[0], dict)
    if is_messages or chat:
        if tokenizer is None:
            raise ValueError("chat prompts need a tokenizer")
        if not is_messages and not isinstance(prompt, str):
            raise ValueError(f"chat=True needs text or a list of messages, got {type(prompt).__name__}")
        messages = prompt if is_messages else [{"role": "user", "content": prompt}]
        return tokenizer.encode_chat(messages, system=system, enable_thinking=thinking, tools=tools,
                                     **(chat_template_kwargs or {}))
    if system is not None:
        raise ValueError("system is only used with chat prompts (messages, or chat=True)")
    if isinstance(prompt, str):
        if tokenizer is None:
            raise ValueError("a text prompt needs a tokenizer; pass token ids or a tokenizer")
        return tokenizer.encode(prompt)
    if isinstance(prompt, Tensor):
        return prompt.tolist()
    if isinstance(prompt, (list, tuple)):
        return list(prompt)
    raise ValueError(f"prompt must be text, token ids or a list of chat messages, got {type(prompt).__name__}")


def token_list(seq, name: str) -> list[int]:
    if isinstance(seq, (str, bytes)):
        raise ValueError(f"{name} must be a sequence of int token ids, got {type(seq).__name__}")
    try:
        out = [operator.index(t) for t in seq]
    except TypeError:
        raise ValueError(f"{name} must be a sequence of int token ids, got {seq!r:.80}") from None
    if any(isinstance(t, bool) for t in seq):
        raise ValueError(f"{name} must hold int token ids, not bools")
    return out
