"""Stream one chat completion from an OpenAI-compatible server (``dynamoe serve`` or any other).

    python -m dynamoe.examples.oai_request_stream --url 127.0.0.1:8000 --prompt "Why is the sky blue?"

Uses the ``openai`` package when it is installed, else plain ``httpx`` reading the SSE lines itself.
Reasoning (``reasoning_content``) goes to stderr, the answer to stdout; ``--api-key`` (or
``$OPENAI_API_KEY`` / ``$DYNAMOE_API_KEY``) is sent as a Bearer token.
"""
from __future__ import annotations

import argparse
import json
import os
import sys


def _base_url(url: str) -> str:
    url = url.rstrip("/")
    if not url.startswith(("http://", "https://")):
        url = "http://" + url
    return url if url.endswith("/v1") else url + "/v1"


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="python -m dynamoe.examples.oai_request_stream",
                                description=__doc__.split("\n")[0])
    p.add_argument("--url", default="127.0.0.1:8000",
                   help="server address, host:port or a URL (default 127.0.0.1:8000)")
    p.add_argument("--prompt", required=True, help="the user message")
    p.add_argument("--system", default=None, help="an optional system message")
    p.add_argument("--model", default=None, help="model name (default: the server's first model)")
    p.add_argument("--max-tokens", type=int, default=512, help="tokens to generate at most (default 512)")
    p.add_argument("--temperature", type=float, default=None, help="sampling temperature (default: the server's)")
    p.add_argument("--api-key", default=os.environ.get("OPENAI_API_KEY") or os.environ.get("DYNAMOE_API_KEY") or "none",
                   help="API key, sent as a Bearer token")
    p.add_argument("--no-openai", action="store_true", help="use httpx even if openai is installed")
    return p


def _request(args, model: str) -> dict:
    messages = ([{"role": "system", "content": args.system}] if args.system else []) + \
        [{"role": "user", "content": args.prompt}]
    body = {"model": model, "messages": messages, "max_tokens": args.max_tokens, "stream": True,
            "stream_options": {"include_usage": True}}
    if args.temperature is not None:
        body["temperature"] = args.temperature
    return body


def _with_openai(args, out, err) -> dict | None:
    import openai

    client = openai.OpenAI(base_url=_base_url(args.url), api_key=args.api_key)
    model = args.model or client.models.list().data[0].id
    body = _request(args, model)
    usage = None
    for chunk in client.chat.completions.create(**body):
        if chunk.usage is not None:
            usage = chunk.usage.model_dump()
        for choice in chunk.choices:
            reasoning = (choice.delta.model_extra or {}).get("reasoning_content")
            if reasoning:
                err.write(reasoning)
                err.flush()
            if choice.delta.content:
                out.write(choice.delta.content)
                out.flush()
    return usage


def _with_httpx(args, out, err) -> dict | None:
    import httpx

    base = _base_url(args.url)
    headers = {"Authorization": f"Bearer {args.api_key}"}
    with httpx.Client(timeout=None, headers=headers) as client:
        model = args.model or client.get(base + "/models").raise_for_status().json()["data"][0]["id"]
        usage = None
        with client.stream("POST", base + "/chat/completions", json=_request(args, model)) as r:
            if r.status_code != 200:
                r.read()
                raise RuntimeError(f"HTTP {r.status_code}: {r.text}")
            for line in r.iter_lines():
                if not line.startswith("data: ") or line == "data: [DONE]":
                    continue
                chunk = json.loads(line[6:])
                if "error" in chunk:
                    raise RuntimeError(chunk["error"].get("message"))
                usage = chunk.get("usage") or usage
                for choice in chunk.get("choices", []):
                    delta = choice.get("delta", {})
                    if delta.get("reasoning_content"):
                        err.write(delta["reasoning_content"])
                        err.flush()
                    if delta.get("content"):
                        out.write(delta["content"])
                        out.flush()
    return usage


def main(argv=None, out=None, err=None) -> int:
    args = _parser().parse_args(argv)
    out, err = out or sys.stdout, err or sys.stderr
    try:
        import openai  # noqa: F401
        use_openai = not args.no_openai
    except ImportError:
        use_openai = False
    usage = (_with_openai if use_openai else _with_httpx)(args, out, err)
    out.write("\n")
    if usage:
        err.write(f"[{usage['prompt_tokens']} prompt + {usage['completion_tokens']} generated tokens]\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
