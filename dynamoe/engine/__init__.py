"""Generation: tokenizer and chat templates, sampling, continuous batching over the KV cache.

``GenerationEngine(model, tokenizer, max_seq_len, max_batch)`` serves many requests at once
(``add_request`` / ``step`` / ``cancel``); ``generate`` / ``stream`` run one prompt; ``load`` reads a
checkpoint folder. Heavy imports (``tokenizers``, ``jinja2``) happen on first use. Expert-parallel
models run on several ranks through :mod:`dynamoe.engine.distributed` (rank 0 drives, the others follow).
"""
from .detokenizer import IncrementalDecoder, StopStrings
from .engine import GenerationEngine, Request, RequestStats, TokenEvent, encode_prompt
from .generate import generate, load, stream
from .sampling import SamplingParams, TokenLogprob, sample
from .tokenizer import Tokenizer, load_chat_template, render_chat_template

__all__ = ["GenerationEngine", "Request", "RequestStats", "TokenEvent", "encode_prompt", "SamplingParams",
           "TokenLogprob", "sample", "Tokenizer", "IncrementalDecoder", "StopStrings", "render_chat_template",
           "load_chat_template", "generate", "stream", "load"]
