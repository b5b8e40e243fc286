"""The OpenAI routes through the official ``openai`` SDK against a real ``dynamoe serve`` process (a tiny
random Qwen3-MoE), plus tool calls and reasoning against an in-process server over a scripted model."""
import json
import re
import threading

import httpx
import pytest

from serve_testing import MAX_SEQ_LEN, shared_server

from dynamoe.models.cache import DEFAULT_BLOCK_SIZE

openai = pytest.importorskip("openai")

MSGS = [{"role": "user", "content": "hello world"}]


@pytest.fixture(scope="module")
def server(tmp_path_factory):
    return shared_server(tmp_path_factory)


@pytest.fixture(scope="module")
def client(server):
    return openai.OpenAI(base_url=server.url + "/v1", api_key=server.api_key, max_retries=0, timeout=60)


def test_models_list(client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny-moe"]
    assert client.models.retrieve("tiny-moe").id == "tiny-moe"


def test_chat_non_stream_and_stream_agree(client):
    out = client.chat.completions.create(model="tiny-moe", messages=MSGS, max_tokens=12, temperature=0)
    choice = out.choices[0]
    assert choice.finish_reason == "length" and choice.message.role == "assistant"
    assert out.usage.completion_tokens == 12 and out.usage.prompt_tokens > 0
    assert out.usage.total_tokens == out.usage.prompt_tokens + 12
    chunks = list(client.chat.completions.create(model="tiny-moe", messages=MSGS, max_tokens=12, temperature=0,
                                                 stream=True))
    assert all(c.object == "chat.completion.chunk" for c in chunks)
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == choice.message.content and text
    assert chunks[0].choices[0].delta.role == "assistant"
    assert chunks[-1].choices[0].finish_reason == "length"


def test_next_turn_reports_cached_prompt_tokens(client):
    """The server's prefix cache: a conversation's next turn reuses the keys/values of the first
    (OpenAI's usage.prompt_tokens_details.cached_tokens), with the same reply as without them."""
    turn = [{"role": "user", "content": "tell me about the mixture of experts layer"}]
    first = client.chat.completions.create(model="tiny-moe", messages=turn, max_tokens=6, temperature=0)
    convo = turn + [{"role": "assistant", "content": first.choices[0].message.content},
                    {"role": "user", "content": "and more"}]
    second = client.chat.completions.create(model="tiny-moe", messages=convo, max_tokens=6, temperature=0)
    cached = second.usage.prompt_tokens_details.cached_tokens
    bs = DEFAULT_BLOCK_SIZE   # the cache shares whole blocks
    assert cached % bs == 0 and (first.usage.prompt_tokens - 2) // bs * bs <= cached < second.usage.prompt_tokens
    again = client.chat.completions.create(model="tiny-moe", messages=convo, max_tokens=6, temperature=0)
    assert again.usage.prompt_tokens_details.cached_tokens == (again.usage.prompt_tokens - 1) // bs * bs
    assert again.choices[0].message.content == second.choices[0].message.content


def test_stream_helper_and_include_usage(client):
    text = client.chat.completions.create(model="tiny-moe", messages=MSGS, max_tokens=12, temperature=0)\
        .choices[0].message.content
    stop = text[4:6]
    with client.chat.completions.stream(model="tiny-moe", messages=MSGS, max_tokens=12, temperature=0, stop=stop,
                                        stream_options={"include_usage": True}) as stream:
        events = list(stream)
        final = stream.get_final_completion()
    assert final.choices[0].finish_reason == "stop"
    assert final.choices[0].message.content == text[:text.index(stop)]
    chunks = [e.chunk for e in events if e.type == "chunk"]
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == final.usage.completion_tokens > 0


def test_n_choices_and_seeds(client):
    out = client.chat.completions.create(model="tiny-moe", messages=MSGS, max_tokens=8, n=2, temperature=1.0, seed=7)
    assert sorted(c.index for c in out.choices) == [0, 1]
    assert 2 <= out.usage.completion_tokens <= 16
    again = client.chat.completions.create(model="tiny-moe", messages=MSGS, max_tokens=8, n=2, temperature=1.0, seed=7)
    assert [c.message.content for c in again.choices] == [c.message.content for c in out.choices]
    assert out.choices[0].message.content != out.choices[1].message.content   # seed + index per choice
    other = client.chat.completions.create(model="tiny-moe", messages=MSGS, max_tokens=8, temperature=1.0, seed=8)
    assert other.choices[0].message.content != out.choices[0].message.content
    # streamed n=2: chunks of both choices, each ending with its finish_reason
    chunks = list(client.chat.completions.create(model="tiny-moe", messages=MSGS, max_tokens=5, n=2, temperature=0,
                                                 stream=True))
    texts = {0: "", 1: ""}
    finishes = {}
    for c in chunks:
        for ch in c.choices:
            texts[ch.index] += ch.delta.content or ""
            if ch.finish_reason:
                finishes[ch.index] = ch.finish_reason
    assert finishes == {0: "length", 1: "length"} and texts[0] == texts[1]   # greedy: the same twice


def test_stop_strings(client):
    full = client.completions.create(model="tiny-moe", prompt="the quick brown", max_tokens=16, temperature=0)
    text = full.choices[0].text
    stop = text[5:8]
    assert stop.strip(), text
    cut = client.completions.create(model="tiny-moe", prompt="the quick brown", max_tokens=16, temperature=0, stop=[stop])
    assert cut.choices[0].finish_reason == "stop"
    assert cut.choices[0].text == text[:text.index(stop)]
    chat = client.chat.completions.create(model="tiny-moe", messages=MSGS, max_tokens=16, temperature=0)
    s = chat.choices[0].message.content[4:6]
    cut = client.chat.completions.create(model="tiny-moe", messages=MSGS, max_tokens=16, temperature=0, stop=s)
    assert cut.choices[0].finish_reason == "stop" and s not in cut.choices[0].message.content


def test_completions_stream_usage_logprobs(client):
    out = client.completions.create(model="tiny-moe", prompt=["héllo", "the model"], max_tokens=5, temperature=0,
                                    logprobs=2)
    assert len(out.choices) == 2 and out.usage.completion_tokens == 10
    lp = out.choices[0].logprobs
    assert len(lp.tokens) == 5 and len(lp.top_logprobs[0]) == 2 and all(v <= 0 for v in lp.token_logprobs)
    stream = client.completions.create(model="tiny-moe", prompt="héllo", max_tokens=5, temperature=0, stream=True,
                                       stream_options={"include_usage": True})
    chunks = list(stream)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == out.choices[0].text
    assert chunks[-1].usage.completion_tokens == 5
    chat = client.chat.completions.create(model="tiny-moe", messages=MSGS, max_completion_tokens=3, temperature=0,
                                          logprobs=True, top_logprobs=3)
    content = chat.choices[0].logprobs.content
    assert len(content) == 3 and len(content[0].top_logprobs) == 3
    assert content[0].top_logprobs[0].logprob >= content[0].logprob - 1e-6


def test_bad_requests(client, server):
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-moe", messages=MSGS, temperature=-1)
    assert "temperature must be" in e.value.message and e.value.body["param"] == "temperature"
    with pytest.raises(openai.BadRequestError, match="top_p must be"):
        client.chat.completions.create(model="tiny-moe", messages=MSGS, top_p=1.5)
    with pytest.raises(openai.BadRequestError, match="presence_penalty"):
        client.completions.create(model="tiny-moe", prompt="x", presence_penalty=3)
    with pytest.raises(openai.BadRequestError, match="max_tokens must be an int >= 1"):
        client.chat.completions.create(model="tiny-moe", messages=MSGS, max_tokens=0)
    with pytest.raises(openai.BadRequestError, match="n must be"):
        client.chat.completions.create(model="tiny-moe", messages=MSGS, n=0)
    with pytest.raises(openai.NotFoundError, match="does not exist"):
        client.chat.completions.create(model="gpt-4o", messages=MSGS)
    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model="tiny-moe", messages=[{"role": "user", "content": "word " * MAX_SEQ_LEN}])
    assert e.value.body["code"] == "context_length_exceeded" and f"max_seq_len is {MAX_SEQ_LEN}" in e.value.message
    with pytest.raises(openai.BadRequestError, match=r"prompt holds token id 1000000, outside the vocabulary \[0, "):
        client.completions.create(model="tiny-moe", prompt=[1, 2, 10**6])
    with pytest.raises(openai.BadRequestError, match="role must be one of"):
        client.chat.completions.create(model="tiny-moe", messages=[{"role": "bot", "content": "x"}])
    # options we cannot honour are refused, not ignored
    with pytest.raises(openai.BadRequestError, match="response_format type 'json_object' is not supported"):
        client.chat.completions.create(model="tiny-moe", messages=MSGS, response_format={"type": "json_object"})
    with pytest.raises(openai.BadRequestError, match="tool_choice 'required' is not supported"):
        client.chat.completions.create(model="tiny-moe", messages=MSGS, tool_choice="required",
                                       tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}])
    ok = client.chat.completions.create(model="tiny-moe", messages=MSGS, max_tokens=2, response_format={"type": "text"})
    assert ok.choices[0].finish_reason == "length"
    # the server is still fine
    assert httpx.get(server.url + "/health").json()["status"] == "ok"


def test_concurrent_streams_equal_solo_outputs(client, server):
    """8 greedy streams at once (they join the running batch as they arrive) each equal the same prompt alone."""
    prompts = ["héllo", "the quick brown fox", "über schön", "世界", "emoji 🚀 and", "les élèves", "text and the engine",
               "a"]
    solo = [client.completions.create(model="tiny-moe", prompt=p, max_tokens=20, temperature=0).choices[0].text
            for p in prompts]
    got = [None] * len(prompts)
    errors = []

    def run(i):
        try:
            stream = client.completions.create(model="tiny-moe", prompt=prompts[i], max_tokens=20, temperature=0,
                                               stream=True)
            got[i] = "".join(c.choices[0].text for c in stream if c.choices)
        except Exception as err:  # noqa: BLE001 (reported below)
            errors.append(err)

    threads = [threading.Thread(target=run, args=(i,)) for i in range(len(prompts))]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    assert not errors
    assert got == solo


# --- tool calls and reasoning: a scripted model writes what a trained one would ----------------------

WEATHER_TOOL = {"type": "function", "function": {"name": "get_weather", "description": "weather of a city",
                                                 "parameters": {"type": "object",
                                                                "properties": {"city": {"type": "string"}}}}}


@pytest.fixture(scope="module")
def scripted_client(tmp_path_factory):
    from serve_testing import scripted_server
    srv = scripted_server(tmp_path_factory)
    return openai.OpenAI(base_url=srv.url + "/v1", api_key="unused", max_retries=0, timeout=30)


def test_tool_calls_and_reasoning(scripted_client):
    msgs = [{"role": "user", "content": "weather in Paris?"}]
    out = scripted_client.chat.completions.create(model="scripted", messages=msgs, tools=[WEATHER_TOOL])
    choice = out.choices[0]
    assert choice.finish_reason == "tool_calls"
    assert choice.message.model_extra["reasoning_content"] == "The user wants the weather."
    assert choice.message.content is None
    (call,) = choice.message.tool_calls
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == {"city": "Paris"}

    with scripted_client.chat.completions.stream(model="scripted", messages=msgs, tools=[WEATHER_TOOL]) as stream:
        reasoning = "".join(getattr(e.chunk.choices[0].delta, "reasoning_content", None) or ""
                            for e in stream if e.type == "chunk" and e.chunk.choices)
        final = stream.get_final_completion()
    assert reasoning == "The user wants the weather."
    assert final.choices[0].finish_reason == "tool_calls"
    assert final.choices[0].message.tool_calls[0].function.name == "get_weather"

    # the round trip: the tool's answer goes back through the template; the model answers in text
    msgs += [{"role": "assistant", "content": None, "tool_calls": [call.model_dump()]},
             {"role": "tool", "tool_call_id": call.id, "content": "sunny, 24 C"}]
    out = scripted_client.chat.completions.create(model="scripted", messages=msgs, tools=[WEATHER_TOOL])
    assert out.choices[0].finish_reason == "stop" and out.choices[0].message.content == "It is sunny in Paris."


def test_thinking_without_tools(scripted_client):
    out = scripted_client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "think about it"}])
    msg = out.choices[0].message
    assert msg.content == "Forty-two." and msg.model_extra["reasoning_content"] == "Six times seven."
    assert msg.model_extra["reasoning"] == "Six times seven." and out.choices[0].finish_reason == "stop"
    # without tools in the request, a tool call is text
    out = scripted_client.chat.completions.create(model="scripted", messages=[{"role": "user", "content": "# Tools"}])
    assert "<tool_call>" in out.choices[0].message.content and out.choices[0].message.tool_calls is None


def test_chat_template_kwargs(scripted_client, tmp_path_factory):
    from serve_testing import scripted_server
    model = scripted_server(tmp_path_factory).app.state.server.engine.model
    msgs = [{"role": "user", "content": "hi"}]
    scripted_client.chat.completions.create(model="scripted", messages=msgs,
                                            extra_body={"chat_template_kwargs": {"enable_thinking": False}})
    assert model.prompts[-1].endswith("<|im_start|>assistant\n<think>\n\n</think>\n\n")   # the template saw it
    scripted_client.chat.completions.create(model="scripted", messages=msgs)
    assert model.prompts[-1].endswith("<|im_start|>assistant\n")
    with pytest.raises(openai.BadRequestError, match="may not set chat_template"):
        scripted_client.chat.completions.create(model="scripted", messages=msgs,
                                                extra_body={"chat_template_kwargs": {"chat_template": "{{ 7 * 7 }}"}})


@pytest.mark.parametrize("body,param,match", [
    ({"prompt": [-1], "echo": True}, "prompt", r"token id -1, outside the vocabulary"),   # once an OverflowError (500)
    ({"prompt": [2**70], "echo": True}, "prompt", r"token id 1180591620717411303424, outside"),
    ({"prompt": [[1, 2], [3, -5]], "echo": True}, "prompt", r"prompt\[1\] holds token id -5"),
    ({"prompt": ["a"] * 64, "n": 64}, "n", r"64 prompts x n=64 asks for 4096 sequences; one request may ask for at most 128"),
    ({"prompt": ["a"] * 129}, "prompt", r"129 prompts x n=1"),
    ({"prompt": "a", "logprobs": 30}, "logprobs", r"logprobs"),
    ({"prompt": "a", "stream": "yes"}, "stream", r"stream: Input should be a valid boolean, got 'yes'"),
    ({"prompt": "a", "max_tokens": "5"}, "max_tokens", r"max_tokens"),
])
def test_completion_errors_name_the_field(server, body, param, match):
    r = httpx.post(server.url + "/v1/completions", headers=server.headers, json={"max_tokens": 2, **body})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert err["param"] == param and re.search(match, err["message"]), err


@pytest.mark.parametrize("body,match", [
    ({"logprobs": True, "top_logprobs": 21}, r"top_logprobs must be an int in \[0, 20\], got 21"),
    ({"logprobs": True, "top_logprobs": -1}, r"top_logprobs must be an int in \[0, 20\], got -1"),
    ({"top_logprobs": 2}, "top_logprobs needs logprobs=true"),
])
def test_top_logprobs_errors_name_top_logprobs(server, body, match):
    r = httpx.post(server.url + "/v1/chat/completions", headers=server.headers,
                   json={"messages": MSGS, "max_tokens": 2, **body})
    assert r.status_code == 400 and r.json()["error"]["param"] == "top_logprobs"
    assert re.search(match, r.json()["error"]["message"])


def test_full_context_is_length(client):
    """No max_tokens (or more than fits): generation fills max_seq_len; OpenAI's reason is 'length'."""
    out = client.chat.completions.create(model="tiny-moe", messages=MSGS)
    assert out.choices[0].finish_reason == "length"
    assert out.usage.prompt_tokens + out.usage.completion_tokens == MAX_SEQ_LEN
    chunks = list(client.completions.create(model="tiny-moe", prompt="hello", max_tokens=10**6, stream=True))
    assert chunks[-1].choices[0].finish_reason == "length"


def test_system_and_developer_messages_anywhere(scripted_client, tmp_path_factory):
    """OpenAI allows system / developer messages anywhere; a template that cannot render one after the
    first message (the test template raises) gets its text folded into the leading system prompt."""
    from serve_testing import scripted_server
    model = scripted_server(tmp_path_factory).app.state.server.engine.model
    msgs = [{"role": "developer", "content": "Top."}, {"role": "user", "content": "hi"},
            {"role": "assistant", "content": "hello"}, {"role": "system", "content": [{"type": "text", "text": "Late."}]},
            {"role": "user", "content": "again"}]
    out = scripted_client.chat.completions.create(model="scripted", messages=msgs)
    assert out.choices[0].finish_reason == "stop"
    assert model.prompts[-1].startswith("<|im_start|>system\nTop.\n\nLate.<|im_end|>\n<|im_start|>user\nhi<|im_end|>")
    assert model.prompts[-1].count("<|im_start|>system") == 1
