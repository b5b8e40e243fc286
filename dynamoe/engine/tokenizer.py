"""Text in and out: a Hugging Face ``tokenizer.json`` plus its config files, and the chat template.

``Tokenizer.from_dir(path)`` reads what a checkpoint folder ships:

- ``tokenizer.json`` (the ``tokenizers`` library does the encoding and decoding);
- ``tokenizer_config.json``: bos/eos/pad/unk tokens (strings or ``{"content": ...}`` objects),
  ``added_tokens_decoder`` (tokens the json lacks are added), ``add_bos_token``, ``chat_template``
  (a string, or a list of ``{"name", "template"}``);
- ``chat_template.jinja`` and ``chat_templates/<name>.jinja`` (the files transformers 5 writes; they
  take priority over the config entry, as in transformers), or a ``chat_template.json``;
- ``generation_config.json``: its ``eos_token_id`` (int or list) joins :attr:`Tokenizer.eos_token_ids`;
  the whole file is kept as :attr:`Tokenizer.generation_config` (sampling defaults).

Chat templates are rendered the way transformers renders them: a sandboxed Jinja2 environment with
``trim_blocks``, ``lstrip_blocks``, the loop-controls extension, ``raise_exception``, ``strftime_now``
and a ``tojson`` filter that does not escape HTML; the named special tokens (``bos_token``...) are
template variables. ``tokenizers`` and ``jinja2`` are imported on first use, not at import time.
"""
from __future__ import annotations

import json
import os
from datetime import datetime
from functools import lru_cache
from typing import Any, Iterable, Mapping, Sequence

__all__ = ["Tokenizer", "render_chat_template", "load_chat_template"]

# the named special tokens transformers passes to every chat template
SPECIAL_TOKEN_NAMES = ("bos_token", "eos_token", "unk_token", "sep_token", "pad_token", "cls_token", "mask_token")
# names a message's reasoning text goes under; templates read the first (gpt-oss reads "thinking")
_REASONING_FIELDS = ("reasoning_content", "thinking", "reasoning")


def _token_content(value) -> str | None:
    """A special-token entry of tokenizer_config.json: a string or an AddedToken-like dict."""
    if value is None:
        return None
    if isinstance(value, str):
        return value
    if isinstance(value, Mapping) and isinstance(value.get("content"), str):
        return value["content"]
    raise ValueError(f"special token must be a string or a {{'content': ...}} object, got {value!r}")


def _read_json(path: str) -> dict | None:
    if not os.path.exists(path):
        return None
    with open(path, encoding="utf-8") as f:
        data = json.load(f)
    if not isinstance(data, dict):
        raise ValueError(f"{path} is not a JSON object")
    return data


def load_chat_template(path: str) -> str:
    """The text of a chat-template file: a ``.jinja`` file, or a JSON file with a ``chat_template`` key
    (``chat_template.json`` / ``tokenizer_config.json``)."""
    with open(path, encoding="utf-8") as f:
        text = f.read()
    if path.endswith(".json"):
        data = json.loads(text)
        template = data.get("chat_template") if isinstance(data, dict) else None
        if template is None:
            raise ValueError(f"chat template file {path!r} has no 'chat_template' entry")
        return template
    return text


def _normalise_templates(template) -> str | dict[str, str] | None:
    """A config's ``chat_template``: a string, a list of ``{"name", "template"}`` or a dict of them."""
    if template is None or isinstance(template, str):
        return template
    if isinstance(template, list):
        out = {}
        for entry in template:
            if not (isinstance(entry, Mapping) and isinstance(entry.get("name"), str)
                    and isinstance(entry.get("template"), str)):
                raise ValueError(f"chat_template list entries must be {{'name': str, 'template': str}}, got {entry!r}")
            out[entry["name"]] = entry["template"]
        return out
    if isinstance(template, Mapping) and all(isinstance(k, str) and isinstance(v, str) for k, v in template.items()):
        return dict(template)
    raise ValueError(f"chat_template must be a string, a list of named templates or a dict, "
                     f"got {type(template).__name__}")


@lru_cache(maxsize=16)
def _compile(template: str):
    import jinja2
    import jinja2.ext
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    def raise_exception(message):
        raise jinja2.exceptions.TemplateError(message)

    def tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False):
        # Jinja's own tojson escapes HTML characters; templates expect plain JSON
        return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)

    def strftime_now(fmt):
        return datetime.now().strftime(fmt)

    env = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True,
                                        extensions=[jinja2.ext.loopcontrols])
    env.filters["tojson"] = tojson
    env.globals["raise_exception"] = raise_exception
    env.globals["strftime_now"] = strftime_now
    return env.from_string(template)


def _plain(value):
    """Rebuild template inputs from plain JSON types (the sandbox must not see arbitrary objects)."""
    if value is None or type(value) in (str, int, float, bool):
        return value
    if isinstance(value, str):
        return str.__str__(value)
    if isinstance(value, bool):
        return bool(value)
    if isinstance(value, int):
        return int.__int__(value)
    if isinstance(value, float):
        return float.__float__(value)
    if isinstance(value, Mapping):
        return {_plain(k): _plain(v) for k, v in value.items()}
    if isinstance(value, (list, tuple)):
        return [_plain(v) for v in value]
    if callable(getattr(value, "model_dump", None)):  # pydantic models (the server's request bodies)
        return _plain(value.model_dump())
    return f"<{type(value).__name__}>"


def _normalise_messages(messages) -> list[dict]:
    if isinstance(messages, (str, bytes)) or not isinstance(messages, Sequence):
        raise ValueError(f"messages must be a list of {{'role': ..., 'content': ...}} dicts, "
                         f"got {type(messages).__name__}")
    if not messages:
        raise ValueError("messages must not be empty")
    out = []
    for i, m in enumerate(messages):
        m = _plain(m)
        if not isinstance(m, dict) or "role" not in m:
            raise ValueError(f"messages[{i}] must be a dict with a 'role', got {m!r}")
        m = {k: v for k, v in m.items() if v is not None}  # OpenAI clients send content=None
        reasoning = next((m[k] for k in _REASONING_FIELDS if m.get(k) is not None), None)
        if reasoning is not None:
            m = {"thinking": reasoning, **m, "reasoning_content": reasoning}
        out.append(m)
    return out


def render_chat_template(template: str, messages, *, tools=None, documents=None, add_generation_prompt: bool = True,
                         **variables) -> str:
    """Render one conversation with ``template`` exactly as transformers' ``apply_chat_template(tokenize=False)``
    does (``variables`` are the extra template variables, e.g. the special tokens, ``enable_thinking``)."""
    if tools is not None:
        if not isinstance(tools, Sequence) or not all(isinstance(t, Mapping) for t in tools):
            raise ValueError(f"tools must be a list of JSON-schema dicts, got {tools!r}")
    return _compile(template).render(messages=_normalise_messages(messages), tools=_plain(tools),
                                     documents=_plain(documents), add_generation_prompt=add_generation_prompt,
                                     **_plain(variables))


class Tokenizer:
    """A ``tokenizers.Tokenizer`` plus the special tokens, stop ids and chat template(s) of a checkpoint.

    Build it with :meth:`from_dir` (a checkpoint folder) or directly from a ``tokenizers.Tokenizer``.
    ``special_tokens`` maps the names of :data:`SPECIAL_TOKEN_NAMES` to token strings.
    """

    def __init__(self, tokenizer, *, special_tokens: Mapping[str, str | None] | None = None,
                 chat_template: str | Mapping[str, str] | list | None = None,
                 eos_token_ids: Iterable[int] = (), add_bos_token: bool | None = None,
                 generation_config: Mapping | None = None):
        self._tok = tokenizer
        self.generation_config = dict(generation_config or {})
        self.special_tokens = {k: v for k, v in (special_tokens or {}).items() if v is not None}
        self.chat_template = _normalise_templates(chat_template)
        self.add_bos_token = add_bos_token
        ids = []
        for t in [self.eos_token_id, *eos_token_ids]:
            if t is not None and t not in ids:
                ids.append(int(t))
        self.eos_token_ids: list[int] = ids

    # --- construction -------------------------------------------------------------------------------

    @classmethod
    def from_dir(cls, path: str, chat_template: str | None = None) -> "Tokenizer":
        """Load the tokenizer files of checkpoint folder ``path`` (see the module docstring).
        ``chat_template`` overrides the folder's template: a file path (``.jinja`` or ``.json``) or the
        template text itself."""
        from tokenizers import AddedToken
        from tokenizers import Tokenizer as _HFTokenizer

        tj = os.path.join(path, "tokenizer.json")
        if not os.path.isfile(tj):
            raise FileNotFoundError(f"{path!r} has no tokenizer.json (only the fast-tokenizer format is supported)")
        tok = _HFTokenizer.from_file(tj)
        config = _read_json(os.path.join(path, "tokenizer_config.json")) or {}

        # added tokens the config knows but tokenizer.json lacks (older checkpoints), in id order
        decoder = config.get("added_tokens_decoder") or {}
        for idx in sorted(decoder, key=int):
            entry = decoder[idx]
            content = _token_content(entry)
            if content is None or tok.token_to_id(content) is not None:
                continue
            if int(idx) != tok.get_vocab_size(with_added_tokens=True):
                continue  # cannot place it at its id; leave the json's vocabulary as it is
            token = AddedToken(content, single_word=entry.get("single_word", False), lstrip=entry.get("lstrip", False),
                               rstrip=entry.get("rstrip", False), normalized=entry.get("normalized", False),
                               special=entry.get("special", True))
            (tok.add_special_tokens if token.special else tok.add_tokens)([token])

        special = {name: _token_content(config.get(name)) for name in SPECIAL_TOKEN_NAMES}

        # template: explicit override > chat_template.jinja (+ chat_templates/) > chat_template.json > config
        template = _normalise_templates(config.get("chat_template"))
        jt = os.path.join(path, "chat_template.jinja")
        named = {}
        if os.path.isfile(jt):
            named["default"] = load_chat_template(jt)
        tdir = os.path.join(path, "chat_templates")
        if os.path.isdir(tdir):
            for name in sorted(os.listdir(tdir)):
                if name.endswith(".jinja"):
                    named[name[: -len(".jinja")]] = load_chat_template(os.path.join(tdir, name))
        if named:
            template = named["default"] if list(named) == ["default"] else named
        elif template is None and os.path.isfile(os.path.join(path, "chat_template.json")):
            template = load_chat_template(os.path.join(path, "chat_template.json"))
        if chat_template is not None:
            template = load_chat_template(chat_template) if os.path.isfile(chat_template) else chat_template

        eos_ids = []
        gen = _read_json(os.path.join(path, "generation_config.json")) or {}
        g = gen.get("eos_token_id")
        eos_ids += g if isinstance(g, list) else ([g] if g is not None else [])
        add_bos = config.get("add_bos_token") if tok.post_processor is None else None
        return cls(tok, special_tokens=special, chat_template=template, eos_token_ids=eos_ids, add_bos_token=add_bos,
                   generation_config=gen)

    # --- special tokens -----------------------------------------------------------------------------

    def _id(self, name: str) -> int | None:
        t = self.special_tokens.get(name)
        return None if t is None else self._tok.token_to_id(t)

    @property
    def bos_token(self) -> str | None:
        return self.special_tokens.get("bos_token")

    @property
    def eos_token(self) -> str | None:
        return self.special_tokens.get("eos_token")

    @property
    def pad_token(self) -> str | None:
        return self.special_tokens.get("pad_token")

    @property
    def bos_token_id(self) -> int | None:
        return self._id("bos_token")

    @property
    def eos_token_id(self) -> int | None:
        return self._id("eos_token")

    @property
    def pad_token_id(self) -> int | None:
        return self._id("pad_token")

    @property
    def vocab_size(self) -> int:
        """Number of token ids, added tokens included."""
        return self._tok.get_vocab_size(with_added_tokens=True)

    @property
    def backend(self):
        """The underlying ``tokenizers.Tokenizer``."""
        return self._tok

    def token_to_id(self, token: str) -> int | None:
        return self._tok.token_to_id(token)

    def id_to_token(self, token_id: int) -> str | None:
        return self._tok.id_to_token(token_id)

    # --- encode / decode ----------------------------------------------------------------------------

    def encode(self, text: str, add_special_tokens: bool = True) -> list[int]:
        """Token ids of ``text``. ``add_special_tokens`` applies the tokenizer's post-processor (e.g. a BOS),
        as transformers does for plain prompts; rendered chat templates already hold their special tokens
        and are encoded without (see :meth:`encode_chat`)."""
        if not isinstance(text, str):
            raise ValueError(f"text must be a str, got {type(text).__name__}")
        # (encode_batch, not encode: the same ids, but it lets go of the GIL -- encode holds it throughout, ~20 ms
        # for a 12k-token prompt in which the engine thread and the event loop stall every running stream)
        ids = self._tok.encode_batch([text], add_special_tokens=add_special_tokens)[0].ids
        bos = self.bos_token_id
        if add_special_tokens and self.add_bos_token and bos is not None and ids[:1] != [bos]:
            ids = [bos] + ids
        return ids

    def decode(self, ids: Sequence[int], skip_special_tokens: bool = True) -> str:
        return self._tok.decode(list(ids), skip_special_tokens=skip_special_tokens)

    # --- chat ---------------------------------------------------------------------------------------

    def get_chat_template(self, chat_template: str | None = None, tools=None) -> str:
        """The template text to use: ``chat_template`` may name one of several templates or be a template;
        with several templates, ``tool_use`` is chosen when tools are given, else ``default``."""
        templates = self.chat_template
        if isinstance(templates, dict):
            if chat_template is not None:
                return templates.get(chat_template, chat_template)
            if tools is not None and "tool_use" in templates:
                return templates["tool_use"]
            if "default" in templates:
                return templates["default"]
            raise ValueError(f"this tokenizer has several chat templates and none is 'default'; pass "
                             f"chat_template= one of {sorted(templates)}")
        if chat_template is not None:
            return chat_template
        if templates is None:
            raise ValueError("this tokenizer has no chat template; pass chat_template= (or --chat-template FILE)")
        return templates

    def apply_chat_template(self, messages, tools=None, add_generation_prompt: bool = True,
                            enable_thinking: bool | None = None, system: str | None = None,
                            chat_template: str | None = None, documents=None, **template_kwargs) -> str:
        """Render ``messages`` (list of ``{"role", "content", ...}`` dicts) into the prompt text.

        ``system`` replaces the content of a leading system message, or inserts one. ``enable_thinking``
        (None: the template's default) is passed under both names templates use: ``enable_thinking``
        (Qwen3) and ``thinking`` (DeepSeek-V3.1); ``template_kwargs`` become template variables too."""
        messages = list(messages) if isinstance(messages, Sequence) and not isinstance(messages, str) else messages
        if system is not None:
            if not isinstance(system, str):
                raise ValueError(f"system must be a str, got {type(system).__name__}")
            if isinstance(messages, list) and messages and isinstance(messages[0], Mapping) \
                    and messages[0].get("role") == "system":
                messages = [{**messages[0], "content": system}, *messages[1:]]
            elif isinstance(messages, list):
                messages = [{"role": "system", "content": system}, *messages]
        variables: dict[str, Any] = dict(self.special_tokens)
        if enable_thinking is not None:
            variables["enable_thinking"] = bool(enable_thinking)
            variables["thinking"] = bool(enable_thinking)
        variables.update(template_kwargs)
        template = self.get_chat_template(chat_template, tools)
        return render_chat_template(template, messages, tools=tools, documents=documents,
                                    add_generation_prompt=add_generation_prompt, **variables)

    def encode_chat(self, messages, **kwargs) -> list[int]:
        """``encode(apply_chat_template(messages, **kwargs), add_special_tokens=False)``."""
        return self.encode(self.apply_chat_template(messages, **kwargs), add_special_tokens=False)

    def __repr__(self) -> str:
        return (f"Tokenizer(vocab_size={self.vocab_size}, eos_token_ids={self.eos_token_ids}, "
                f"chat_template={'yes' if self.chat_template else 'no'})")
