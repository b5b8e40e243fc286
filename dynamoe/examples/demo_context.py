"""Long contexts for the demo model: what agent harnesses (Claude Code, IDE plugins, chat front ends)
put around a user's question -- long system prompts, tool lists, reminder blocks, system messages in
the middle of a conversation -- generated synthetically, so the model learns to answer the last user
message and ignore what it cannot use.

Nothing here is any real harness's text: prompts are built from a grammar of assistant instructions,
markdown structure, environment blocks, code spans and paths; tools are random JSON-schema functions.
:func:`wrap` puts one such context around a corpus conversation (:mod:`dynamoe.examples.demo_data`):
a system prompt (often several system messages, some after the first user turn, which the demo chat
template folds into the leading system block), ``tools``, and reminder text before (sometimes after)
the question inside the user's message. The assistant's reply is unchanged.

Same ``rng`` state -> the same context (only ``random.Random`` is used).
"""
from __future__ import annotations

import random
from typing import Optional

__all__ = ["system_prompt", "tool_definitions", "reminder", "wrap", "HARNESS_VERSION"]

#: bumped whenever the generated contexts change (cached training data is rebuilt)
HARNESS_VERSION = 1

_VERBS = ("read", "write", "edit", "search", "run", "check", "list", "open", "update", "create", "delete", "review",
          "explain", "summarize", "verify", "install", "build", "test", "format", "fetch", "schedule", "cancel",
          "merge", "commit", "deploy", "inspect", "compare", "rename", "move", "copy", "plan", "refactor")
_NOUNS = ("file", "files", "directory", "repository", "branch", "commit", "test", "tests", "command", "shell", "task",
          "tasks", "agent", "tool", "tools", "function", "module", "package", "request", "response", "error",
          "message", "user", "session", "project", "code", "change", "changes", "issue", "pull request", "diff",
          "output", "input", "config", "setting", "path", "url", "page", "document", "notebook", "cell", "server",
          "process", "log", "result", "summary", "plan", "workflow", "schedule", "worktree", "context", "memory")
_ADJS = ("relevant", "existing", "current", "new", "large", "small", "specific", "absolute", "relative", "optional",
         "required", "safe", "unsafe", "long", "short", "recent", "previous", "following", "available", "default",
         "careful", "concise", "independent", "parallel", "sensitive", "local", "remote", "temporary", "clear")
_ADVS = ("always", "never", "only", "usually", "first", "then", "carefully", "briefly", "directly", "quietly")
_OPENERS = ("You are", "You must", "Do not", "Prefer to", "When the user asks you to", "Before you", "After you",
            "If you need to", "Only", "Always", "Never", "Use this tool to", "Make sure to", "It is important to",
            "Remember to", "Avoid", "Try to", "Consider whether to", "You can", "You should")
_SECTIONS = ("Tone and style", "Doing tasks", "Tool usage policy", "Environment", "Safety", "Code references",
             "Following conventions", "Task management", "Proactiveness", "Output format", "Examples", "Git",
             "Memory", "Security", "Asking questions", "Planning", "Testing", "Notes")
_TYPES = ("string", "integer", "number", "boolean", "array", "object")
_WORDS = tuple(sorted(set(_VERBS + _NOUNS + _ADJS + ("the", "a", "an", "this", "that", "with", "for", "in", "on",
                                                    "to", "of", "and", "or", "not", "by", "when", "if", "as"))))


def _sentence(rng: random.Random) -> str:
    k = rng.random()
    if k < 0.55:
        s = (f"{rng.choice(_OPENERS)} {rng.choice(_VERBS)} the {rng.choice(_ADJS)} {rng.choice(_NOUNS)}"
             f"{rng.choice(('', ' before ' + rng.choice(_VERBS) + 'ing it', ' with the ' + rng.choice(_NOUNS) + ' tool', ' in ' + rng.choice(_ADVS) + ' one step', ' unless the user asks otherwise'))}")
    elif k < 0.8:
        s = " ".join(rng.choice(_WORDS) for _ in range(rng.randint(4, 16)))
        s = s[0].upper() + s[1:]
    elif k < 0.9:
        s = f"IMPORTANT: {rng.choice(_ADVS)} {rng.choice(_VERBS)} {rng.choice(_NOUNS)} that are {rng.choice(_ADJS)}"
    else:
        s = f"Use `{_ident(rng)}` to {rng.choice(_VERBS)} {rng.choice(_NOUNS)} such as {_path(rng)}"
    return s + rng.choice((".", ".", ".", ":", "!"))


def _ident(rng: random.Random, camel: bool = False) -> str:
    parts = [rng.choice(_VERBS), rng.choice(_NOUNS).replace(" ", "_")][:rng.randint(1, 2)]
    return "".join(p.capitalize() for p in parts) if camel else "_".join(parts)


def _path(rng: random.Random) -> str:
    root = rng.choice(("/home/user", "/tmp", "src", "~/work", "C:\\\\Users\\\\dev", "/var/log", "."))
    parts = [rng.choice(_NOUNS).replace(" ", "-") for _ in range(rng.randint(1, 3))]
    return root + "/" + "/".join(parts) + rng.choice((".py", ".md", ".json", ".ts", "", ".txt", ".yaml"))


def _block(rng: random.Random) -> str:
    k = rng.random()
    if k < 0.4:
        return " ".join(_sentence(rng) for _ in range(rng.randint(1, 5)))
    if k < 0.7:
        return "\n".join(f"- {_sentence(rng)}" for _ in range(rng.randint(2, 6)))
    if k < 0.8:
        return "<env>\n" + "\n".join(f"{key}: {val}" for key, val in (
            ("Working directory", _path(rng)), ("Is directory a git repo", rng.choice(("Yes", "No"))),
            ("Platform", rng.choice(("linux", "darwin", "win32"))), ("Today's date", _date(rng)))) + "\n</env>"
    if k < 0.9:
        return (f"<example>\nuser: {rng.choice(_VERBS)} the {rng.choice(_NOUNS)}\nassistant: "
                f"{_sentence(rng)}\n</example>")
    return "```\n" + "\n".join(f"{_ident(rng)}({rng.choice(_NOUNS)!r})" for _ in range(rng.randint(1, 4))) + "\n```"


def _date(rng: random.Random) -> str:
    return f"{rng.randint(2024, 2030)}-{rng.randint(1, 12):02d}-{rng.randint(1, 28):02d}"


def system_prompt(rng: random.Random, chars: int) -> str:
    """A harness-style system prompt of about ``chars`` characters (markdown sections of instructions)."""
    out = []
    if rng.random() < 0.3:
        out.append(f"x-client-header: version={rng.randint(1, 9)}.{rng.randint(0, 99)}.{rng.randint(0, 999)}; entry=cli;")
    if rng.random() < 0.6:
        out.append(f"{rng.choice(('You are', 'You are an', 'This is'))} {' '.join(rng.choice(_WORDS) for _ in range(rng.randint(3, 9)))}.")
    size = sum(len(p) for p in out)
    while size < chars:
        p = (f"{'#' * rng.randint(1, 3)} {rng.choice(_SECTIONS)}\n" if rng.random() < 0.35 else "") + _block(rng)
        out.append(p)
        size += len(p) + 2
    return "\n\n".join(out)


def tool_definitions(rng: random.Random, n: int) -> list[dict]:
    """``n`` OpenAI-style function tools with JSON-schema parameters and long descriptions."""
    tools = []
    for i in range(n):
        props, required = {}, []
        for _ in range(rng.randint(0, 6)):
            name = _ident(rng)
            t = rng.choice(_TYPES)
            spec = {"type": t, "description": _sentence(rng)}
            if t == "array":
                spec["items"] = {"type": rng.choice(("string", "integer"))}
            elif t == "string" and rng.random() < 0.3:
                spec["enum"] = [rng.choice(_ADJS) for _ in range(rng.randint(2, 4))]
            props[name] = spec
            if rng.random() < 0.5:
                required.append(name)
        desc = "\n\n".join(_block(rng) for _ in range(rng.randint(1, 6)))
        tools.append({"type": "function", "function": {
            "name": _ident(rng, camel=True) + (str(i) if rng.random() < 0.2 else ""), "description": desc,
            "parameters": {"type": "object", "properties": props, "required": required,
                           "additionalProperties": False}}})
    return tools


def reminder(rng: random.Random) -> str:
    """A reminder block of the kind harnesses put into the user's message."""
    body = "\n".join(rng.choice((
        lambda: f"# currentDate\nToday's date is {_date(rng)}.",
        lambda: "As you answer the user's questions, you can use the following context:",
        lambda: _sentence(rng),
        lambda: f"# {rng.choice(_SECTIONS)}\n{_block(rng)}",
        lambda: f"IMPORTANT: this context may or may not be relevant to your tasks. {_sentence(rng)}",
        lambda: f"Contents of {_path(rng)}:\n{_block(rng)}"))() for _ in range(rng.randint(1, 4)))
    tag = rng.choice(("system-reminder", "system-reminder", "context", "reminder"))
    return f"<{tag}>\n{body}\n</{tag}>"


def wrap(rng: random.Random, messages: list, max_chars: int = 6000,
         tools: Optional[bool] = None) -> tuple[list, Optional[list]]:
    """(messages, tools) for one corpus conversation (``messages``: [system?], user, assistant, ...)
    inside a harness context of at most about ``max_chars`` characters of system text, with 1-30
    offered tools half of the time (``tools``: always / never).
    Reminder blocks go into the user messages as separate text parts (as harnesses send them); the
    last assistant reply is kept as it is."""
    budget = rng.randint(max_chars // 8, max_chars)
    use_tools = rng.random() < 0.5 if tools is None else tools
    tool_list = tool_definitions(rng, rng.randint(1, 30)) if use_tools else None
    head = [{"role": "system", "content": system_prompt(rng, max(40, budget * 2 // 3))}]
    out = []
    for m in messages:
        if m["role"] == "system":
            head.append(m)
        elif m["role"] == "user":
            parts = []
            for _ in range(rng.choice((0, 1, 1, 1, 2, 3))):
                parts.append({"type": "text", "text": reminder(rng) + rng.choice(("", "\n", "\n\n"))})
            parts.append({"type": "text", "text": m["content"]})
            if rng.random() < 0.1:
                parts.append({"type": "text", "text": rng.choice(("\n", "\n\n")) + reminder(rng)})
            out.append({"role": "user", "content": parts if len(parts) > 1 or rng.random() < 0.5 else m["content"]})
            if rng.random() < 0.35:  # a system message after the user's turn (folded into the system block)
                out.append({"role": "system", "content": system_prompt(rng, rng.randint(100, max(101, budget // 3)))})
        else:
            out.append(m)
    return head + out, tool_list
