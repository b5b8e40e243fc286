"""The Anthropic routes through the official ``anthropic`` SDK: a real ``dynamoe serve`` process (tiny random
Qwen3-MoE) for messages, streaming, system prompts, count_tokens and errors; an in-process server over a
scripted model for thinking and the tool_use -> tool_result round trip."""
import json
import os
import re

import httpx
import pytest

from serve_testing import shared_server

anthropic = pytest.importorskip("anthropic")

MSGS = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    return shared_server(tmp_path_factory)


@pytest.fixture(scope="module")
def client(server):
    return anthropic.Anthropic(base_url=server.url, api_key=server.api_key, max_retries=0, timeout=60)


@pytest.fixture(scope="module")
def scripted(tmp_path_factory):
    from serve_testing import scripted_server
    srv = scripted_server(tmp_path_factory)
    return anthropic.Anthropic(base_url=srv.url, api_key="unused", max_retries=0, timeout=30)


def test_messages_non_stream(client):
    msg = client.messages.create(model="claude-test-sonnet", max_tokens=10, messages=MSGS)
    assert msg.type == "message" and msg.role == "assistant" and msg.model == "tiny-moe"
    assert msg.stop_reason == "max_tokens" and msg.usage.output_tokens == 10 and msg.usage.input_tokens > 0
    assert [b.type for b in msg.content] == ["text"] and msg.content[0].text


def test_messages_stream_helper_equals_non_stream(client):
    ref = client.messages.create(model="claude-haiku", max_tokens=10, messages=MSGS)
    with client.messages.stream(model="claude-haiku", max_tokens=10, messages=MSGS) as stream:
        text = "".join(stream.text_stream)
        final = stream.get_final_message()
    assert text == ref.content[0].text == final.content[0].text
    assert final.stop_reason == "max_tokens"
    assert final.usage.output_tokens == 10 and final.usage.input_tokens == ref.usage.input_tokens


def test_system_prompt_and_count_tokens(client):
    plain = client.messages.count_tokens(model="x", messages=MSGS).input_tokens
    with_system = client.messages.count_tokens(model="x", messages=MSGS, system="You are terse.").input_tokens
    as_blocks = client.messages.count_tokens(model="x", messages=MSGS,
                                             system=[{"type": "text", "text": "You are terse."}]).input_tokens
    assert with_system == as_blocks > plain
    # usage splits the prompt into tokens computed and tokens read from the prefix cache
    msg = client.messages.create(model="x", max_tokens=4, messages=MSGS, system="You are terse.")
    assert msg.usage.input_tokens + msg.usage.cache_read_input_tokens == with_system
    other = client.messages.create(model="x", max_tokens=4, messages=MSGS)
    assert other.usage.input_tokens + other.usage.cache_read_input_tokens == plain


def test_stop_sequences(client):
    ref = client.messages.create(model="x", max_tokens=16, messages=MSGS).content[0].text
    stop = ref[5:7]
    msg = client.messages.create(model="x", max_tokens=16, messages=MSGS, stop_sequences=[stop])
    assert msg.stop_reason == "stop_sequence" and msg.stop_sequence == stop
    assert msg.content[0].text == ref[:ref.index(stop)]


def test_beta_route_and_raw_events(client, server):
    msg = client.beta.messages.create(model="claude-opus-4", max_tokens=3, messages=MSGS)   # POST /v1/messages?beta=true
    assert msg.usage.output_tokens == 3
    r = httpx.post(server.url + "/v1/messages?beta=true", headers={"x-api-key": server.api_key},
                   json={"model": "m", "max_tokens": 3, "messages": MSGS, "stream": True})
    assert r.status_code == 200 and r.headers["content-type"].startswith("text/event-stream")
    types = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
    assert types[:3] == ["message_start", "ping", "content_block_start"]
    assert types[-3:] == ["content_block_stop", "message_delta", "message_stop"]


def test_errors_in_anthropic_shape(client, server):
    with pytest.raises(anthropic.BadRequestError) as e:
        client.messages.create(model="x", max_tokens=5, messages=MSGS, extra_body={"temperature": -0.5})
    assert e.value.body == {"type": "error", "error": {"type": "invalid_request_error",
                                                       "message": "invalid request: temperature: Input should be "
                                                                  "greater than or equal to 0, got -0.5"}}
    with pytest.raises(anthropic.BadRequestError, match="max_tokens"):
        client.messages.create(model="x", max_tokens=0, messages=MSGS)
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": server.api_key}, content=b"{not json")
    assert r.status_code == 400 and r.json()["type"] == "error"
    r = httpx.post(server.url + "/v1/messages", headers={"x-api-key": server.api_key}, json={"messages": MSGS})
    assert r.status_code == 400 and "max_tokens: Field required" in r.json()["error"]["message"]


def test_thinking_blocks(scripted):
    msg = scripted.messages.create(model="claude-test-sonnet", max_tokens=100,
                                   messages=[{"role": "user", "content": "think about it"}])
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in msg.content] == \
        [("thinking", "Six times seven."), ("text", "Forty-two.")]
    assert msg.stop_reason == "end_turn"
    with scripted.messages.stream(model="x", max_tokens=100, messages=[{"role": "user", "content": "think about it"}]) as s:
        kinds = [e.type for e in s]
        final = s.get_final_message()
    assert "thinking" in kinds and final.content[0].thinking == "Six times seven." and final.content[1].text == "Forty-two."


TOOLS = [{"name": "get_weather", "description": "weather of a city",
          "input_schema": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}}]


@pytest.mark.parametrize("stream", [False, True])
def test_tool_use_round_trip(scripted, stream):
    msgs = [{"role": "user", "content": "What is the weather in Paris?"}]
    if stream:
        with scripted.messages.stream(model="claude-x", max_tokens=200, tools=TOOLS, messages=msgs,
                                      system="You help.") as s:
            json_deltas = [e.partial_json for e in s if e.type == "input_json"]
            msg = s.get_final_message()
        assert "".join(json_deltas) == '{"city": "Paris"}'
    else:
        msg = scripted.messages.create(model="claude-x", max_tokens=200, tools=TOOLS, messages=msgs, system="You help.")
    assert msg.stop_reason == "tool_use"
    assert [b.type for b in msg.content] == ["thinking", "tool_use"]
    use = msg.content[1]
    assert use.name == "get_weather" and use.input == {"city": "Paris"} and use.id.startswith("toolu_")
    # send the tool's result back: the model (scripted) answers from it
    msgs += [{"role": "assistant", "content": [b.model_dump(exclude_none=True) for b in msg.content]},
             {"role": "user", "content": [{"type": "tool_result", "tool_use_id": use.id, "content": "sunny, 24 C"}]}]
    answer = scripted.messages.create(model="claude-x", max_tokens=200, tools=TOOLS, messages=msgs, system="You help.")
    assert answer.stop_reason == "end_turn" and answer.content[0].text == "It is sunny in Paris."
    n = scripted.messages.count_tokens(model="claude-x", tools=TOOLS, messages=msgs, system="You help.").input_tokens
    assert n == answer.usage.input_tokens


def test_thinking_switch_reaches_the_template(scripted, tmp_path_factory):
    from serve_testing import scripted_server
    model = scripted_server(tmp_path_factory).app.state.server.engine.model
    scripted.messages.create(model="x", max_tokens=20, messages=MSGS, thinking={"type": "disabled"})
    assert model.prompts[-1].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")
    scripted.messages.create(model="x", max_tokens=20, messages=MSGS, thinking={"type": "enabled", "budget_tokens": 1024})
    assert model.prompts[-1].endswith("<|im_start|>assistant\n")


# --- what Claude Code sends ------------------------------------------------------------------------

CLAUDE_CODE = os.path.join(os.path.dirname(__file__), "data", "claude_code_requests.json")


@pytest.fixture(scope="module")
def long_context(tmp_path_factory):
    """A scripted server whose context holds Claude Code's main requests (~78k tokens with the test tokenizer)."""
    from serve_testing import InProcessServer, scripted_engine
    engine, tok = scripted_engine(str(tmp_path_factory.mktemp("long_tok")), max_seq_len=131072)
    srv = InProcessServer(engine, tok)
    yield srv
    srv.stop()


def _claude_code_requests():
    with open(CLAUDE_CODE, encoding="utf-8") as f:
        return json.load(f)


@pytest.mark.parametrize("i", range(5), ids=lambda i: "{cli} {method} {path}".format(**_claude_code_requests()[i]))
def test_claude_code_requests_are_served(long_context, i):
    """The requests Claude Code 2.1.197 and 2.1.332 sent (recorded): probes answer, messages (a system
    message inside messages[], thinking adaptive, output_config, context_management, metadata, any
    anthropic-beta) stream a message; the mid-conversation system text reaches the prompt."""
    req = _claude_code_requests()[i]
    url = long_context.url + req["path"]
    if req["method"] == "HEAD":
        r = httpx.head(url, headers=req["headers"])
        assert r.status_code in (200, 404)
        return
    body = req["body"]
    r = httpx.post(url, headers=req["headers"], json=body, timeout=120)
    assert r.status_code == 200, r.text
    types = [line[7:] for line in r.text.splitlines() if line.startswith("event: ")]
    assert types[0] == "message_start" and types[-2:] == ["message_delta", "message_stop"]
    n = httpx.post(long_context.url + "/v1/messages/count_tokens?beta=true", headers=req["headers"],
                   json={k: v for k, v in body.items() if k not in ("max_tokens", "stream")}).json()["input_tokens"]
    start = json.loads(r.text.split("data: ", 1)[1].split("\n", 1)[0])
    assert start["message"]["usage"]["input_tokens"] == n > 0
    prompt = long_context.app.state.server.engine.model.prompts[-1]
    assert "x-anthropic-billing-header" not in prompt   # request metadata, not part of the prompt
    for m in body["messages"]:
        if m["role"] == "system":   # the test template cannot render it in place: folded into the system prompt
            text = m["content"] if isinstance(m["content"], str) else m["content"][0]["text"]
            assert text[:200] in prompt and prompt.index(text[:200]) < prompt.index("<|im_start|>user")
    if "format" in body.get("output_config", {}):
        assert '"required": ["title"]' in prompt   # the JSON schema is asked for in the system prompt


TEXT_TEMPLATE_KEEPS = "{% for m in messages %}<{{ m.role }}>{{ m.content }}{% endfor %}"
TEMPLATE_DROPS = "{% for m in messages %}{% if m.role != 'system' or loop.first %}<{{ m.role }}>{{ m.content }}{% endif %}{% endfor %}"
TEMPLATE_RAISES = ("{% for m in messages %}{% if m.role == 'system' and not loop.first %}"
                   "{{ raise_exception('system first') }}{% endif %}<{{ m.role }}>{{ m.content }}{% endfor %}")


@pytest.mark.parametrize("template,expect", [
    (TEXT_TEMPLATE_KEEPS, "<system>S<user>a<system>late<assistant>b<system>later<user>c"),
    (TEMPLATE_DROPS, "<system>S\n\nlate\n\nlater<user>a<assistant>b<user>c"),
    (TEMPLATE_RAISES, "<system>S\n\nlate\n\nlater<user>a<assistant>b<user>c"),
], ids=["renders-in-place", "drops", "raises"])
def test_mid_conversation_system_messages(template, expect):
    """A system message after the first stays at its place when the template renders it there; when the
    template raises on it or drops it, its text is folded into the leading system prompt."""
    from dynamoe.serve.state import _place_system_messages
    from dynamoe.engine.tokenizer import render_chat_template

    msgs = [{"role": "system", "content": "S"}, {"role": "user", "content": "a"},
            {"role": "system", "content": "late"}, {"role": "assistant", "content": "b"},
            {"role": "system", "content": "later"}, {"role": "user", "content": "c"}]

    def render(m):
        return render_chat_template(template, m, add_generation_prompt=False)
    assert render(_place_system_messages(msgs, render)) == expect
    no_lead = _place_system_messages(msgs[1:], render)   # no leading system prompt: one is made when folding
    assert no_lead == msgs[1:] if template == TEXT_TEMPLATE_KEEPS else \
        no_lead == [{"role": "system", "content": "late\n\nlater"}, msgs[1], msgs[3], msgs[5]]


def test_system_message_in_messages_via_the_sdk(scripted, tmp_path_factory):
    from serve_testing import scripted_server
    model = scripted_server(tmp_path_factory).app.state.server.engine.model
    for content in ("Be brief.", [{"type": "text", "text": "Be brief.", "cache_control": {"type": "ephemeral"}}]):
        msg = scripted.messages.create(model="x", max_tokens=20, system=[{"type": "text", "text": "Top."}],
                                       messages=[{"role": "user", "content": "hi"}, {"role": "system", "content": content}])
        assert msg.stop_reason == "end_turn"
        assert model.prompts[-1].startswith("<|im_start|>system\nTop.\n\nBe brief.<|im_end|>\n<|im_start|>user\nhi")


def _post(srv_url: str, body: dict, path: str = "/v1/messages", **headers):
    return httpx.post(srv_url + path, json=body, headers=headers, timeout=30)


def _hello(**extra) -> dict:
    return {"model": "claude-x", "max_tokens": 20, "messages": [{"role": "user", "content": "hi"}], **extra}


@pytest.mark.parametrize("extra", [
    dict(thinking={"type": "adaptive"}), dict(thinking={"type": "adaptive", "display": "summarized"}),
    dict(thinking={"type": "adaptive", "display": "updates"}),  # Claude Code 2.1.332 with a display beta
    dict(thinking={"type": "between_tools"}), dict(thinking={"type": "enabled", "budget_tokens": 1024}),
    dict(metadata={"user_id": "u"}), dict(context_management={"edits": [{"type": "clear_thinking_20251015"}]}),
    dict(output_config={"effort": "max"}), dict(temperature=1), dict(temperature=0, top_p=1, top_k=0),
    dict(service_tier="auto", unknown_field={"x": 1}), dict(stop_sequences=["zzz"]),
    dict(tools=TOOLS, tool_choice={"type": "tool", "name": "get_weather", "disable_parallel_tool_use": True}),
    dict(tools=TOOLS, tool_choice={"type": "any"}), dict(tools=TOOLS, tool_choice={"type": "none"}),
    dict(tools=[*TOOLS, {"type": "web_search_20250305", "name": "web_search"}]),
    dict(system=[{"type": "text", "text": "a", "cache_control": {"type": "ephemeral", "ttl": "1h"}}]),
    dict(messages=[{"role": "user", "content": [{"type": "text", "text": "hi", "cache_control": {"type": "ephemeral"}}]}]),
])
def test_accepted_fields(tmp_path_factory, extra):
    from serve_testing import scripted_server
    srv = scripted_server(tmp_path_factory)
    r = _post(srv.url, _hello(**extra), "/v1/messages?beta=true", **{"anthropic-beta": "any-beta-2099-01-01,other"})
    assert r.status_code == 200, r.text
    assert r.json()["type"] == "message"


@pytest.mark.parametrize("extra,field", [
    (dict(stream="yes"), "stream"), (dict(temperature=1.5), "temperature"), (dict(temperature="hot"), "temperature"),
    (dict(top_p=1.01), "top_p"), (dict(top_k=-1), "top_k"), (dict(max_tokens=0), "max_tokens"),
    (dict(max_tokens="20"), "max_tokens"), (dict(max_tokens=2.5), "max_tokens"),
    (dict(thinking={"type": "sometimes"}), "thinking.type"), (dict(thinking={"type": "enabled"}), "thinking.budget_tokens"),
    (dict(thinking={"type": "enabled", "budget_tokens": 100}), "thinking.budget_tokens"),
    (dict(thinking={"type": "adaptive", "display": 5}), "thinking.display"),
    (dict(tools=TOOLS, tool_choice={"type": "required"}), "tool_choice.type"),
    (dict(tools=TOOLS, tool_choice={"type": "tool", "name": "nope"}), "tool_choice.name"),
    (dict(tools=TOOLS, tool_choice={"type": "auto", "disable_parallel_tool_use": "no"}), "tool_choice.disable_parallel_tool_use"),
    (dict(tools=[{"name": "x"}]), "tools.0.input_schema"), (dict(tools=[{"input_schema": {}}]), "tools.0.name"),
    (dict(messages=[]), "messages"), (dict(messages=[{"role": "robot", "content": "hi"}]), "messages.0.role"),
    (dict(messages=[{"role": "user"}]), "messages.0.content"), (dict(messages=["hi"]), "messages.0"),
    (dict(messages=[{"role": "user", "content": [{"type": "foo"}]}]), "messages.0.content.0.type"),
    (dict(messages=[{"role": "user", "content": [{"text": "x"}]}]), "messages.0.content.0.type"),
    (dict(messages=[{"role": "user", "content": ["hi"]}]), "messages.0.content.0"),
    (dict(messages=[{"role": "user", "content": [{"type": "image", "source": {}}]}]), "messages.0.content.0.type"),
    (dict(messages=[{"role": "user", "content": [{"type": "text"}]}]), "messages.0.content.0.text"),
    (dict(messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": [{"type": "tool_result"}]}]),
     "messages.1.content.0.type"),
    (dict(messages=[{"role": "user", "content": [{"type": "tool_result", "content": "x"}]}]), "messages.0.content.0.tool_use_id"),
    (dict(messages=[{"role": "user", "content": "a"}, {"role": "assistant", "content": [
        {"type": "tool_use", "id": "t", "name": "f", "input": "x"}]}]), "messages.1.content.0.input"),
    (dict(messages=[{"role": "user", "content": "a"}, {"role": "system", "content": [{"type": "image"}]}]),
     "messages.1.content.0.type"),
    (dict(system=[{"type": "image"}]), "system.0.type"), (dict(system=5), "system"),
    (dict(output_config={"effort": "extreme"}), "output_config.effort"),
    (dict(output_config={"format": {"type": "regex"}}), "output_config.format"),
    (dict(stop_sequences=[""]), "stop_sequences"), (dict(stop_sequences="x"), "stop_sequences"),
    (dict(metadata="u"), "metadata"),
])
def test_rejected_fields_name_the_field(tmp_path_factory, extra, field):
    """A client mistake is a 400 in Anthropic's shape whose message starts with the offending field."""
    from serve_testing import scripted_server
    srv = scripted_server(tmp_path_factory)
    for path in ("/v1/messages", "/v1/messages/count_tokens"):
        body = _hello(**extra)
        if path.endswith("count_tokens") and set(extra) & {"stream", "temperature", "top_p", "top_k", "max_tokens",
                                                          "stop_sequences"}:
            continue   # not fields of count_tokens (ignored there)
        r = _post(srv.url, body, path)
        assert r.status_code == 400, (path, r.text)
        err = r.json()
        assert err["type"] == "error" and err["error"]["type"] == "invalid_request_error"
        msg = err["error"]["message"].removeprefix("invalid request: ")
        assert msg.startswith(field + ":") or msg.startswith(field + " "), msg


def test_thinking_display_omitted(scripted):
    msgs = [{"role": "user", "content": "think about it"}]
    msg = scripted.messages.create(model="x", max_tokens=100, messages=msgs,
                                   thinking={"type": "adaptive", "display": "omitted"})
    assert [(b.type, getattr(b, "thinking", None) or getattr(b, "text", None)) for b in msg.content] == \
        [("thinking", None), ("text", "Forty-two.")] and msg.content[0].thinking == ""
    with scripted.messages.stream(model="x", max_tokens=100, messages=msgs,
                                  thinking={"type": "adaptive", "display": "omitted"}) as s:
        final = s.get_final_message()
    assert final.content[0].type == "thinking" and final.content[0].thinking == "" and final.content[1].text == "Forty-two."


# --- a full context --------------------------------------------------------------------------------

def test_full_context_is_not_max_tokens(client, server):
    """max_tokens above what fits: the generation fills max_seq_len and says so
    (model_context_window_exceeded), never max_tokens (Claude Code would report its own output limit)."""
    msg = client.messages.create(model="x", max_tokens=64000, messages=MSGS)
    assert msg.stop_reason == "model_context_window_exceeded"
    u = msg.usage
    assert u.input_tokens + u.cache_read_input_tokens + u.output_tokens == 256   # serve_testing.MAX_SEQ_LEN
    with client.messages.stream(model="x", max_tokens=64000, messages=MSGS) as s:
        final = s.get_final_message()
    assert final.stop_reason == "model_context_window_exceeded"
    exact = client.messages.create(model="x", max_tokens=msg.usage.output_tokens, messages=MSGS)
    assert exact.stop_reason == "max_tokens"   # its own limit, even though the context is full too
    too_long = [{"role": "user", "content": "hello world " * 300}]
    with pytest.raises(anthropic.BadRequestError) as e:   # Anthropic's words: Claude Code compacts on them
        client.messages.create(model="x", max_tokens=10, messages=too_long)
    assert re.fullmatch(r"prompt is too long: \d+ tokens > 255 maximum \(this server's --max_seq_len 256 holds "
                        r"the prompt and at least one generated token\)", e.value.body["error"]["message"])


def test_deferred_tools_and_tool_references(scripted, tmp_path_factory):
    """defer_loading tools are not offered until a tool_reference in a tool result (a tool search's
    answer, as Claude Code's ToolSearch gives it) loads them; search_result blocks are read as text."""
    from serve_testing import scripted_server
    model = scripted_server(tmp_path_factory).app.state.server.engine.model
    later = {"name": "LaterTool", "description": "loaded on demand", "defer_loading": True,
             "input_schema": {"type": "object", "properties": {}}}
    scripted.messages.create(model="x", max_tokens=50, tools=[*TOOLS, later], messages=MSGS)
    assert "get_weather" in model.prompts[-1] and "LaterTool" not in model.prompts[-1]
    msgs = [*MSGS, {"role": "assistant", "content": [{"type": "tool_use", "id": "toolu_1", "name": "get_weather",
                                                      "input": {"query": "select:LaterTool"}}]},
            {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1", "content": [
                {"type": "tool_reference", "tool_name": "LaterTool"},
                {"type": "search_result", "title": "Doc", "source": "https://x", "content": [{"type": "text", "text": "found"}]}]}]}]
    scripted.messages.create(model="x", max_tokens=50, tools=[*TOOLS, later], messages=msgs)
    prompt = model.prompts[-1]
    assert '"name": "LaterTool"' in prompt and "[tool LaterTool loaded]" in prompt and "Doc\nhttps://x\nfound" in prompt


# --- the prefix cache in usage, /metrics and /health ----------------------------------------------------

def test_repeated_prompt_is_read_from_the_cache_and_counted(client, server):
    msgs = [{"role": "user", "content": "the same long question about experts and routers, " * 4}]
    first = client.messages.create(model="x", max_tokens=3, messages=msgs)
    again = client.messages.create(model="x", max_tokens=3, messages=msgs)
    total = first.usage.input_tokens + first.usage.cache_read_input_tokens
    assert again.usage.input_tokens + again.usage.cache_read_input_tokens == total
    assert again.usage.cache_read_input_tokens >= 16 and again.usage.input_tokens >= 1
    assert again.content[0].text == first.content[0].text
    with client.messages.stream(model="x", max_tokens=3, messages=msgs) as s:
        final = s.get_final_message()
    # message_start went out before the cache was looked up; message_delta has the whole message's usage
    assert final.usage.cache_read_input_tokens == again.usage.cache_read_input_tokens
    assert final.usage.input_tokens == again.usage.input_tokens
    headers = {"x-api-key": server.api_key} if server.api_key else {}
    metrics = httpx.get(server.url + "/metrics", headers=headers).text
    hits = re.search(r"^dynamoe_prefix_cache_hits_total (\d+)$", metrics, re.M)
    assert hits and int(hits.group(1)) >= 2
    assert re.search(r'^dynamoe_kv_cache_blocks\{state="cached"\} [1-9]', metrics, re.M)
    health = httpx.get(server.url + "/health").json()["kv_cache"]
    assert health["blocks_total"] > 0 and health["block_size"] == 16 and health["blocks_used"] == 0
