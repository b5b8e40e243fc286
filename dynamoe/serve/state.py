"""What every route shares: the engine and its runner, the tokenizer and chat template, the limits,
and the steps from a request body to engine inputs (chat rendering, sampling parameters, checks)."""
from __future__ import annotations

import copy
import hashlib
import json
import time
from dataclasses import dataclass
from typing import Any

from ..engine import GenerationEngine, SamplingParams, Tokenizer
from .errors import APIError
from .metrics import ExpertLoad, Metrics
from .harmony import HarmonyParser, uses_harmony
from .parsing import OutputParser, prompt_opens_think, think_tags_for
from .tool_formats import mistral_tool_parser, tool_parser_for
from .runner import EngineRunner

__all__ = ["ServerConfig", "ServerState"]

# what a request's chat_template_kwargs may not override (the template itself, above all: clients do not
# get to run their own Jinja)
_RESERVED_TEMPLATE_KWARGS = {"chat_template", "add_generation_prompt", "messages", "tools", "documents", "system",
                             "tokenize", "continue_final_message"}


@dataclass
class ServerConfig:
    """Server settings (the CLI's flags). ``api_key``: None = no auth. ``thinking_effort``: default
    ``reasoning_effort`` template variable (low|medium|high). ``max_request_bytes``: body size limit.
    ``keepalive_s``: a stream silent this long gets a ping."""
    model_name: str
    max_seq_len: int
    max_num_seqs: int
    api_key: str | None = None
    webui: bool = True
    thinking_effort: str | None = None
    max_request_bytes: int = 32 * 2**20
    keepalive_s: float = 10.0


def _template_texts(tokenizer: Tokenizer | None) -> str:
    t = getattr(tokenizer, "chat_template", None)
    if isinstance(t, dict):
        return "\n".join(t.values())
    return t or ""


def _nine_char_ids(messages: list[dict]) -> list[dict]:
    """The messages with every tool-call id made 9 letters and digits, as Mistral's templates require
    (they raise on any other). Ids that already are stay (the ones this server gave Mistral's calls);
    others keep their last 9 letters and digits (``toolu_`` + such an id comes back as it), or, when
    shorter, become a hash of themselves. A call and its result map alike."""
    def fix(cid):
        if not isinstance(cid, str) or (len(cid) == 9 and cid.isalnum() and cid.isascii()):
            return cid
        alnum = "".join(c for c in cid if c.isascii() and c.isalnum())
        return alnum[-9:] if len(alnum) >= 9 else hashlib.sha1(cid.encode()).hexdigest()[:9]

    out = copy.deepcopy(messages)
    for m in out:
        for tc in m.get("tool_calls") or []:
            tc["id"] = fix(tc.get("id"))
        if m.get("tool_call_id") is not None:
            m["tool_call_id"] = fix(m["tool_call_id"])
    return out


def _args_as_text(messages: list[dict]) -> list[dict]:
    """The messages with every tool call's ``arguments`` as JSON text (templates that concatenate it)."""
    out = copy.deepcopy(messages)
    for m in out:
        for tc in m.get("tool_calls") or []:
            fn = tc.get("function", tc)
            if isinstance(fn.get("arguments"), dict):
                fn["arguments"] = json.dumps(fn["arguments"], ensure_ascii=False)
    return out


def _fold_system_messages(messages: list[dict]) -> list[dict]:
    """The messages with every system message after the first message appended (in order, a blank line
    apart) to the leading system prompt, which is created when there is none."""
    late = [m for i, m in enumerate(messages) if i > 0 and m.get("role") == "system"]
    rest = [m for i, m in enumerate(messages) if i == 0 or m.get("role") != "system"]
    texts = [m.get("content") or "" for m in late]
    if rest and rest[0].get("role") == "system":
        rest[0] = {**rest[0], "content": "\n\n".join([rest[0].get("content") or "", *texts])}
    else:
        rest.insert(0, {"role": "system", "content": "\n\n".join(texts)})
    return rest


def _place_system_messages(messages: list[dict], render) -> list[dict]:
    """``messages`` as they are when ``render`` (messages -> prompt text) puts the text of every system
    message after the first message into the prompt, else folded (:func:`_fold_system_messages`). Found
    out by rendering with a marker in their place: templates raise on such a message, drop it, or render
    it; which one is not written anywhere but in the template."""
    import jinja2

    late = [i for i, m in enumerate(messages) if i > 0 and m.get("role") == "system"]
    if not late:
        return messages
    markers = {i: f"dynamoe{i}system{hashlib.sha1(str(i).encode()).hexdigest()[:8]}" for i in late}
    probe = [dict(m, content=markers[i]) if i in markers else m for i, m in enumerate(messages)]
    try:
        text = render(probe)
    except (jinja2.TemplateError, TypeError, ValueError):
        return _fold_system_messages(messages)
    if all(marker in text for marker in markers.values()):
        return messages
    return _fold_system_messages(messages)


class ServerState:
    """The engine, its runner, metrics and the served model's text conventions."""

    def __init__(self, engine: GenerationEngine, tokenizer: Tokenizer | None, config: ServerConfig):
        self.engine = engine
        self.tokenizer = tokenizer
        self.config = config
        self.metrics = Metrics()
        self.runner = EngineRunner(engine, self.metrics)
        self.expert_load = ExpertLoad(engine.model)
        self.created = int(time.time())
        template = _template_texts(tokenizer)
        self.has_template = bool(template)
        vocab_has = (lambda t: tokenizer.token_to_id(t) is not None) if tokenizer is not None else (lambda t: False)
        self.think_tags = think_tags_for(template, vocab_has)
        self.tool_parser = tool_parser_for(template)
        self.harmony = uses_harmony(template)

    # --- names and limits ---------------------------------------------------------------------------

    @property
    def model_name(self) -> str:
        return self.config.model_name

    @property
    def no_images(self) -> str:
        """What a request holding an image is told, naming the served model: dynamoe's models read text
        (a vision-language checkpoint such as Kimi-K2.5 is served without its vision tower, which its model
        class says in ``text_only_reason``)."""
        return self._not_supported("images are")

    @property
    def no_audio(self) -> str:
        """What a request holding audio is told, naming the served model (an omni or speech checkpoint such as
        Nemotron-3.5-Transcribe is served without its audio encoders: ``text_only_reason``)."""
        return self._not_supported("audio is")

    def _not_supported(self, what: str) -> str:
        model = self.engine.model
        kind = getattr(getattr(model, "config", None), "model_type", None)
        reason = getattr(model, "text_only_reason", None) or "dynamoe serves it as a text model"
        return f"{what} not supported by the model {self.model_name!r}{f' ({kind})' if kind else ''}: {reason}"

    def check_model(self, name: str | None) -> None:
        """OpenAI routes: only the served model (or no name) is accepted."""
        if name is not None and name != self.model_name:
            raise APIError(404, f"the model {name!r} does not exist; this server serves {self.model_name!r}",
                           param="model", code="model_not_found")

    def check_prompt(self, ids: list[int], param: str, anthropic: bool = False) -> None:
        """A 400 for an empty prompt or one that leaves no room to generate; ``anthropic``: in the words of
        Anthropic's API ("prompt is too long: N tokens > M maximum"), which Claude Code reads to compact."""
        m = self.config.max_seq_len
        if len(ids) >= m and anthropic:
            raise APIError(400, f"prompt is too long: {len(ids)} tokens > {m - 1} maximum (this server's "
                                f"--max_seq_len {m} holds the prompt and at least one generated token)", param=param)
        if len(ids) >= m:
            raise APIError(400, f"the prompt is {len(ids)} tokens; this server's max_seq_len is {m} (--max_seq_len), "
                                f"which must hold the prompt and at least one generated token",
                           param=param, code="context_length_exceeded")
        if not ids:
            raise APIError(400, "the prompt is empty", param=param)

    @staticmethod
    def max_tokens(value: int | None, name: str) -> int | None:
        if value is not None and (isinstance(value, bool) or not isinstance(value, int) or value < 1):
            raise APIError(400, f"{name} must be an int >= 1, got {value!r}", param=name)
        return value

    # --- engine inputs ------------------------------------------------------------------------------

    def sampling(self, **fields: Any) -> SamplingParams:
        """SamplingParams from the checkpoint's generation_config.json defaults and the request's fields
        (None = default); its validation message becomes a 400."""
        gen = self.tokenizer.generation_config if self.tokenizer is not None else None
        try:
            return SamplingParams.from_generation_config(gen, **fields)
        except (ValueError, TypeError) as err:
            msg = str(err)
            raise APIError(400, msg, param=msg.split(" ", 1)[0]) from None

    def encode_text(self, text: str) -> list[int]:
        if self.tokenizer is None:
            raise APIError(400, "this model has no tokenizer; send token ids", param="prompt")
        return self.tokenizer.encode(text)

    def render_chat(self, messages: list[dict], *, tools: list[dict] | None = None,
                    enable_thinking: bool | None = None, reasoning_effort: str | None = None,
                    template_kwargs: dict | None = None) -> tuple[str, list[int]]:
        """(prompt text, token ids) of a conversation through the chat template. Tool-call arguments go
        in as dicts (what most templates want); a template that fails on that gets them as JSON text.
        System messages after the first message stay at their place where the template renders them
        there, else their text is folded into the leading system prompt (:func:`_place_system_messages`)."""
        import jinja2

        if self.tokenizer is None or not self.has_template:
            raise APIError(400, "this model has no chat template; start the server with --chat-template FILE, "
                                "or use /v1/completions", param="messages")
        kwargs = dict(template_kwargs or {})
        reserved = sorted(set(kwargs) & _RESERVED_TEMPLATE_KWARGS)
        if reserved:
            raise APIError(400, f"chat_template_kwargs may not set {', '.join(reserved)}", param="chat_template_kwargs")
        effort = reasoning_effort or self.config.thinking_effort
        if effort == "none":
            enable_thinking = False if enable_thinking is None else enable_thinking
        elif effort is not None:
            kwargs.setdefault("reasoning_effort", effort)
        if enable_thinking is not None:
            kwargs["enable_thinking"] = bool(enable_thinking)
        if self.tool_parser is mistral_tool_parser:
            messages = _nine_char_ids(messages)

        def render(msgs):
            try:
                return self.tokenizer.apply_chat_template(msgs, tools=tools, **kwargs)
            except (jinja2.TemplateError, TypeError):
                if not any(m.get("tool_calls") for m in msgs):
                    raise
                return self.tokenizer.apply_chat_template(_args_as_text(msgs), tools=tools, **kwargs)

        try:
            text = render(_place_system_messages(messages, render))
        except jinja2.TemplateError as err:
            raise APIError(400, f"the chat template rejected the messages: {err}", param="messages") from None
        except (ValueError, TypeError) as err:
            raise APIError(400, str(err), param="messages") from None
        return text, self.tokenizer.encode(text, add_special_tokens=False)

    def output_parser(self, prompt_text: str | None, tools: list[dict] | bool | None) -> OutputParser:
        """How this request's output splits: think tags (chat routes), tool calls (when ``tools`` were sent;
        their schemas type bare-text argument values), or GPT-OSS's harmony channels (chat routes)."""
        if prompt_text is not None and self.harmony:
            return OutputParser(harmony=HarmonyParser(tools=bool(tools)))
        tags = self.think_tags if prompt_text is not None else None
        tool_list = tools if isinstance(tools, list) else None
        return OutputParser(tags, prompt_opens_think(prompt_text or "", tags),
                            self.tool_parser(tool_list) if tools and self.tool_parser else None)

    def decode_options(self, parser: OutputParser, ignore_eos: bool = False) -> dict:
        """``Generation.add`` keywords for a request read by ``parser``: the special tokens among its markers
        (kept in the text: a detokenizer skips them by default) and its stop tokens (harmony's ``<|call|>``
        and ``<|return|>``, also when generation_config.json does not list them; not with ``ignore_eos``)."""
        if self.tokenizer is None:
            return {}

        def ids(tokens):
            return [i for i in (self.tokenizer.token_to_id(t) for t in tokens) if i is not None]
        return {"keep_special_ids": ids(parser.markers),
                "stop_token_ids": [] if ignore_eos else ids(parser.stop_markers)}

    def token_text(self, token_id: int) -> str:
        return self.tokenizer.decode([token_id], skip_special_tokens=False) if self.tokenizer else str(token_id)
