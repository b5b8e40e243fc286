"""One-call generation: ``dynamoe.generate(model_or_path, prompt, **kw) -> text``.

For many calls, load once (:func:`load`) and keep a :class:`~dynamoe.engine.GenerationEngine`; these
helpers build a one-slot engine per call, with a cache just long enough for the prompt and
``max_tokens`` (capped by the model's ``max_position_embeddings``).
"""
from __future__ import annotations

import inspect
from typing import Iterator, Sequence

import torch

from .engine import GenerationEngine, encode_prompt
from .tokenizer import Tokenizer

__all__ = ["load", "generate", "stream"]


def load(path: str, dtype: torch.dtype | str | None = None, device=None, chat_template: str | None = None):
    """``(model, tokenizer)`` of the checkpoint folder ``path`` (``dynamoe.models.load`` + :class:`Tokenizer`)."""
    from .. import models

    load_model = getattr(models, "load", None)
    if load_model is None:
        raise RuntimeError("dynamoe.models.load is not available in this build")
    if isinstance(dtype, str):
        dtype = parse_dtype(dtype)
    kwargs = {"dtype": dtype} if dtype is not None else {}
    if device is not None and "device" in inspect.signature(load_model).parameters:
        kwargs["device"] = device
    model = load_model(path, **kwargs)
    if device is not None and "device" not in kwargs:
        model = model.to(device)
    model.eval()
    return model, Tokenizer.from_dir(path, chat_template=chat_template)


def parse_dtype(name: str) -> torch.dtype:
    table = {"float32": torch.float32, "fp32": torch.float32, "bfloat16": torch.bfloat16, "bf16": torch.bfloat16,
             "float16": torch.float16, "fp16": torch.float16}
    if name not in table:
        raise ValueError(f"dtype must be one of {sorted(table)}, got {name!r}")
    return table[name]


def _engine_for(model_or_path, prompt, tokenizer, max_tokens, max_seq_len, dtype, device, chat_template, chat,
                system, thinking, tools):
    if isinstance(model_or_path, str):
        model, tok = load(model_or_path, dtype=dtype, device=device, chat_template=chat_template)
        tokenizer = tokenizer or tok
    else:
        model = model_or_path
        if isinstance(tokenizer, str):
            tokenizer = Tokenizer.from_dir(tokenizer, chat_template=chat_template)
    ids = encode_prompt(tokenizer, prompt, chat=chat, system=system, thinking=thinking, tools=tools)
    if max_seq_len is None:
        mpe = getattr(getattr(model, "config", None), "max_position_embeddings", None)
        if max_tokens is None:
            if not mpe:
                raise ValueError("max_tokens=None needs max_seq_len (the model config has no max_position_embeddings)")
            max_seq_len = int(mpe)
        else:
            max_seq_len = len(ids) + max_tokens
            if mpe:
                max_seq_len = min(max_seq_len, int(mpe))  # too long a request fails in add_request, clearly
    return GenerationEngine(model, tokenizer, max_seq_len=max_seq_len, max_batch=1), ids


def stream(model_or_path, prompt, *, tokenizer: Tokenizer | str | None = None, max_tokens: int | None = 256,
           max_seq_len: int | None = None, dtype=None, device=None, chat_template: str | None = None,
           chat: bool | None = None, system: str | None = None, thinking: bool | None = None, tools=None,
           stop: Sequence[str] | str = (), **sampling) -> Iterator[str]:
    """Yield the text of one generation as it is produced. ``model_or_path``: a checkpoint folder or a
    loaded model (then pass ``tokenizer``: a :class:`Tokenizer` or its folder). ``prompt``: text, token
    ids or chat messages. ``sampling``: :class:`~dynamoe.engine.SamplingParams` fields."""
    engine, ids = _engine_for(model_or_path, prompt, tokenizer, max_tokens, max_seq_len, dtype, device,
                              chat_template, chat, system, thinking, tools)
    if engine.tokenizer is None:
        raise ValueError("text output needs a tokenizer; pass tokenizer= (a Tokenizer or its folder)")
    for ev in engine.stream(ids, max_tokens, stop=stop, **sampling):
        if ev.text:
            yield ev.text


def generate(model_or_path, prompt, **kwargs) -> str:
    """The generated text for ``prompt`` (arguments as :func:`stream`)."""
    return "".join(stream(model_or_path, prompt, **kwargs))
