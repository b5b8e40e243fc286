"""The Anthropic routes through the official ``anthropic`` SDK: a real ``dynamoe serve`` process (tiny random
Qwen3-MoE) for messages, streaming, system prompts, count_tokens and errors; an in-process server over a
scripted model for thinking and the tool_use -> tool_result round trip."""
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
    msg = client.messages.create(model="x", max_tokens=4, messages=MSGS, system="You are terse.")
    assert msg.usage.input_tokens == with_system
    other = client.messages.create(model="x", max_tokens=4, messages=MSGS)
    assert other.usage.input_tokens == plain


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
                                                       "message": "temperature must be a finite number >= 0 (0: greedy), "
                                                                  "got -0.5"}}
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
