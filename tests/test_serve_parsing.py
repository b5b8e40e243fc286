"""The serving layer's pure parts: reasoning and tool-call parsers of every family (fed in every possible
split), request conversion into chat-template messages, Anthropic stream events, Prometheus text; and the
special-token markers GPT-OSS writes, kept through the engine's detokenizer into the parser and out of
the client's text (a scripted model behind the real routes)."""
import json

import httpx
import pytest

from dynamoe.serve.anthropic_api import AnthropicEvents, anthropic_messages, anthropic_tools
from dynamoe.serve.errors import APIError
from dynamoe.serve.metrics import Histogram, Metrics
from dynamoe.serve.openai_api import openai_messages
from dynamoe.serve.harmony import HarmonyParser, uses_harmony
from dynamoe.serve.parsing import OutputParser, Part, ReasoningParser, ToolCall, prompt_opens_think
from dynamoe.serve.tool_formats import (deepseek_tool_parser, glm_tool_parser, hermes_tool_parser, kimi_tool_parser,
                                        mistral_tool_parser, tool_parser_for)

QWEN_OUT = ('<think>\nThe user wants the weather.\n</think>\n\nLet me check.\n<tool_call>\n'
            '{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>\n<tool_call>\n'
            '{"name": "get_time", "arguments": "{\\"tz\\": \\"CET\\"}"}\n</tool_call>')


def run(make, text, splits):
    """Feed ``text`` cut at ``splits``; merge the parts the parser returns."""
    p = make()
    parts, last = [], 0
    for s in list(splits) + [len(text)]:
        parts += p.push(text[last:s])
        last = s
    parts += p.flush()
    out = []
    for part in parts:
        if out and part.kind != "tool_call" and out[-1].kind == part.kind:
            out[-1] = Part(part.kind, out[-1].text + part.text)
        else:
            out.append(part)
    return out


def summary(parts):
    return [(p.kind, p.text) if p.kind != "tool_call" else ("tool_call", p.call.name, json.loads(p.call.arguments))
            for p in parts]


def every_split(text, step=1):
    yield []
    for i in range(1, len(text), step):
        yield [i]
    yield list(range(1, len(text)))   # one character at a time


@pytest.mark.parametrize("splits", list(every_split(QWEN_OUT, 7)))
def test_reasoning_then_tool_calls_in_any_pieces(splits):
    parts = run(lambda: OutputParser(("<think>", "</think>"), tool_parser=hermes_tool_parser()), QWEN_OUT, splits)
    assert summary(parts) == [("reasoning", "The user wants the weather."), ("content", "Let me check."),
                              ("tool_call", "get_weather", {"city": "Paris"}), ("tool_call", "get_time", {"tz": "CET"})]


@pytest.mark.parametrize("splits", list(every_split("<think>\nhmm\n\n</think>\n\nAnswer: <b>4</b>")))
def test_reasoning_split(splits):
    text = "<think>\nhmm\n\n</think>\n\nAnswer: <b>4</b>"
    assert summary(run(lambda: ReasoningParser(), text, splits)) == [("reasoning", "hmm"), ("content", "Answer: <b>4</b>")]


def test_reasoning_cases():
    # the template opened <think> in the prompt: the output starts inside it
    assert prompt_opens_think("<|im_start|>assistant\n<think>\n", ("<think>", "</think>"))
    assert not prompt_opens_think("<|im_start|>assistant\n<think>\n\n</think>\n\n", ("<think>", "</think>"))
    assert summary(run(lambda: ReasoningParser(in_reasoning=True), "so...\n</think>\n\nyes", [3])) == \
        [("reasoning", "so..."), ("content", "yes")]
    # no think block: all content, a tag later on is text
    assert summary(run(lambda: ReasoningParser(), "<b>x</b> <think>", [1, 2])) == [("content", "<b>x</b> <think>")]
    # cut off inside the reasoning (max_tokens): everything is reasoning
    assert summary(run(lambda: ReasoningParser(), "<think>\nstill going</th", [9])) == [("reasoning", "still going</th")]


def test_tool_parser_keeps_what_is_not_a_call():
    text = "a <tool_call>not json</tool_call> b <tool_"
    assert summary(run(hermes_tool_parser, text, [5, 20])) == [("content", text)]
    # an unterminated call that parses is still a call (the model hit EOS before the end tag)
    parts = run(hermes_tool_parser, '<tool_call>{"name": "f", "arguments": {}}', [3])
    assert summary(parts) == [("tool_call", "f", {})]
    p = hermes_tool_parser()
    p.push('<tool_call>{"name": "f", "arguments": {}}</tool_call>')
    assert p.num_calls == 1


def test_qwen3_coder_xml_and_deepseek_calls():
    xml = ("<tool_call>\n<function=get_weather>\n<parameter=city>\nParis\n</parameter>\n<parameter=days>\n3\n"
           "</parameter>\n</function>\n</tool_call>")
    assert summary(run(hermes_tool_parser, xml, [17, 40])) == [("tool_call", "get_weather", {"city": "Paris", "days": 3})]
    v3 = ("Sure<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n"
          '{"city": "Paris"}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    assert summary(run(deepseek_tool_parser, v3, [6, 30])) == [("content", "Sure"), ("tool_call", "get_weather", {"city": "Paris"})]
    v31 = ('<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>a<｜tool▁sep｜>{"x": 1}<｜tool▁call▁end｜>'
           '<｜tool▁call▁begin｜>b<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
    assert summary(run(deepseek_tool_parser, v31, [])) == [("tool_call", "a", {"x": 1}), ("tool_call", "b", {})]
    assert tool_parser_for("...<｜tool▁calls▁begin｜>...") is deepseek_tool_parser
    assert tool_parser_for("{% for tool in tools %}<tool_call>") is hermes_tool_parser
    assert tool_parser_for("{{ messages }}") is None


def test_openai_messages():
    msgs = openai_messages([
        {"role": "developer", "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}]},
        {"role": "user", "content": "weather?"},
        {"role": "assistant", "content": None, "reasoning_content": "hmm",
         "tool_calls": [{"id": "c1", "type": "function", "function": {"name": "w", "arguments": '{"city": "P"}'}}]},
        {"role": "tool", "tool_call_id": "c1", "content": "sunny"}])
    assert msgs[0] == {"role": "system", "content": "be brief"}
    assert msgs[2]["tool_calls"][0]["function"] == {"name": "w", "arguments": {"city": "P"}}
    assert msgs[2]["reasoning_content"] == "hmm" and msgs[2]["content"] == ""
    assert msgs[3] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    with pytest.raises(APIError, match="role must be one of"):
        openai_messages([{"role": "wizard", "content": "x"}])
    with pytest.raises(APIError, match="image_url"):
        openai_messages([{"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}}]}])


def test_anthropic_messages_and_tools():
    msgs = anthropic_messages([{"type": "text", "text": "sys1"}, {"type": "text", "text": "sys2"}], [
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": [{"type": "thinking", "thinking": "call it", "signature": ""},
                                          {"type": "text", "text": "Checking."},
                                          {"type": "tool_use", "id": "toolu_1", "name": "w", "input": {"city": "Paris"}}]},
        {"role": "user", "content": [{"type": "tool_result", "tool_use_id": "toolu_1",
                                      "content": [{"type": "text", "text": "sunny"}]},
                                     {"type": "text", "text": "and tomorrow?"}]}])
    assert msgs == [
        {"role": "system", "content": "sys1\nsys2"},
        {"role": "user", "content": "weather in Paris?"},
        {"role": "assistant", "content": "Checking.", "reasoning_content": "call it",
         "tool_calls": [{"id": "toolu_1", "type": "function", "function": {"name": "w", "arguments": {"city": "Paris"}}}]},
        {"role": "tool", "content": "sunny", "tool_call_id": "toolu_1"},
        {"role": "user", "content": "and tomorrow?"}]
    tools = anthropic_tools([{"name": "w", "description": "weather", "input_schema": {"type": "object"}},
                             {"type": "web_search_20250305", "name": "web_search"}])
    assert tools == [{"type": "function", "function": {"name": "w", "description": "weather",
                                                       "parameters": {"type": "object"}}}]
    with pytest.raises(APIError, match="'image' block"):
        anthropic_messages(None, [{"role": "user", "content": [{"type": "image", "source": {}}]}])


def parse_sse(text):
    events = []
    for block in text.strip().split("\n\n"):
        lines = block.split("\n")
        assert lines[0].startswith("event: ") and lines[1].startswith("data: ")
        data = json.loads(lines[1][6:])
        assert data["type"] == lines[0][7:]
        events.append(data)
    return events


def test_anthropic_event_sequence():
    ev = AnthropicEvents("msg_1", "m", 12)
    call = ToolCall("get_weather", '{"city": "Paris"}', id="call_abc")
    text = ev.start() + ev.parts([Part("reasoning", "hmm")]) + ev.parts([Part("reasoning", " ok"), Part("content", "Hi")]) \
        + ev.parts([Part("tool_call", call=call)]) + ev.finish("tool_use", None, 30)
    events = parse_sse(text)
    assert [e["type"] for e in events] == [
        "message_start", "ping",
        "content_block_start", "content_block_delta", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "content_block_start", "content_block_delta", "content_block_stop",
        "message_delta", "message_stop"]
    assert events[0]["message"]["usage"]["input_tokens"] == 12
    starts = [e for e in events if e["type"] == "content_block_start"]
    assert [(s["index"], s["content_block"]["type"]) for s in starts] == [(0, "thinking"), (1, "text"), (2, "tool_use")]
    assert starts[2]["content_block"] == {"type": "tool_use", "id": "toolu_abc", "name": "get_weather", "input": {}}
    assert events[10]["delta"] == {"type": "input_json_delta", "partial_json": '{"city": "Paris"}'}
    assert events[12]["delta"]["stop_reason"] == "tool_use" and events[12]["usage"] == {"input_tokens": 12, "output_tokens": 30, "cache_creation_input_tokens": 0, "cache_read_input_tokens": 0}
    # nothing generated: one empty text block all the same
    e2 = AnthropicEvents("m3", "m", 1)
    types = [e["type"] for e in parse_sse(e2.start() + e2.finish("end_turn", None, 1))]
    assert types == ["message_start", "ping", "content_block_start", "content_block_stop", "message_delta", "message_stop"]


def test_prometheus_text():
    h = Histogram([0.1, 1.0])
    for v in (0.05, 0.1, 0.5, 3.0):
        h.observe(v)
    assert h.lines("x") == ['x_bucket{le="0.1"} 2', 'x_bucket{le="1.0"} 3', 'x_bucket{le="+Inf"} 4', "x_sum 3.65",
                            "x_count 4"]
    m = Metrics()
    m.http_request("/v1/messages", 200)
    m.generation_done(10, 5, "length", 0.2, 0.01)
    text = m.render(model_name='a"b', waiting=1, running=2, max_num_seqs=8, expert_load={3: ([4, 0, 2], 1)})
    assert 'dynamoe_http_requests_total{route="/v1/messages",status="200"} 1' in text
    assert 'dynamoe_model_info{model="a\\"b"} 1' in text
    assert 'dynamoe_moe_expert_tokens_total{layer="3",expert="2"} 2' in text
    assert 'dynamoe_moe_dropped_tokens_total{layer="3"} 1' in text
    assert "dynamoe_queue_depth 1" in text and "dynamoe_running_sequences 2" in text
    for line in text.splitlines():   # every sample line is NAME{labels} VALUE
        if not line.startswith("#"):
            float(line.rsplit(" ", 1)[1].replace("+Inf", "inf"))


# --- the families' tool-call formats -------------------------------------------------------------------

def harmony_parser(tools=True):
    return OutputParser(harmony=HarmonyParser(tools=tools))


GLM45 = ('Let me look.\n<tool_call>get_weather\n<arg_key>city</arg_key>\n<arg_value>Zürich</arg_value>\n'
         '<arg_key>days</arg_key>\n<arg_value>3</arg_value>\n</tool_call>\n<tool_call>search\n<arg_key>query</arg_key>\n'
         '<arg_value>café "best" 🙂</arg_value>\n<arg_key>filters</arg_key>\n<arg_value>{"tags": ["a"], "max": 3}</arg_value>\n'
         '</tool_call>')
GLM47 = ('<tool_call>get_weather<arg_key>city</arg_key><arg_value>Zürich</arg_value><arg_key>days</arg_key>'
         '<arg_value>3</arg_value></tool_call><tool_call>now</tool_call>')
KIMI = ('Checking.<|tool_calls_section_begin|><|tool_call_begin|>functions.get_weather:0<|tool_call_argument_begin|>'
        '{"city": "Zürich", "days": 3}<|tool_call_end|><|tool_call_begin|>functions.now:1<|tool_call_argument_begin|>{}'
        '<|tool_call_end|><|tool_calls_section_end|>')
MISTRAL_V3 = 'Let me look. [TOOL_CALLS] [{"name": "get_weather", "arguments": {"city": "Zürich", "days": 3}}, {"name": "now", "arguments": {}}]'
MISTRAL_V11 = ('[TOOL_CALLS]get_weather[ARGS]{"city": "Zürich", "days": 3}[TOOL_CALLS]now[CALL_ID]abcDEF123[ARGS]{}')
DEEPSEEK_V3 = ('Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>function<｜tool▁sep｜>get_weather\n```json\n'
               '{"city": "Zürich", "days": 3}\n```<｜tool▁call▁end｜>\n<｜tool▁call▁begin｜>function<｜tool▁sep｜>now\n'
               '```json\n{}\n```<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
DEEPSEEK_V31 = ('Checking.<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>get_weather<｜tool▁sep｜>{"city": "Zürich", "days": 3}'
                '<｜tool▁call▁end｜><｜tool▁call▁begin｜>now<｜tool▁sep｜>{}<｜tool▁call▁end｜><｜tool▁calls▁end｜>')
# GPT-OSS: analysis, a preamble, then calls with the recipient after and before <|channel|> (<|call|> is a stop
# token: the engine ends the output there, so the last call simply ends)
HARMONY = ('<|channel|>analysis<|message|>User wants weather in Zürich. Use get_weather.<|end|>'
           '<|start|>assistant<|channel|>commentary<|message|>Checking.<|end|>'
           '<|start|>assistant<|channel|>commentary to=functions.get_weather <|constrain|>json<|message|>'
           '{"city": "Zürich", "days": 3}<|call|>'
           '<|start|>assistant to=functions.now<|channel|>commentary json<|message|>{}')
WEATHER = ("tool_call", "get_weather", {"city": "Zürich", "days": 3})
FORMATS = {
    "glm45": (glm_tool_parser, GLM45, [("content", "Let me look."), WEATHER,
                                       ("tool_call", "search", {"query": 'café "best" 🙂', "filters": {"tags": ["a"], "max": 3}})]),
    "glm47": (glm_tool_parser, GLM47, [WEATHER, ("tool_call", "now", {})]),
    "kimi": (kimi_tool_parser, KIMI, [("content", "Checking."), WEATHER, ("tool_call", "now", {})]),
    "mistral_v3": (mistral_tool_parser, MISTRAL_V3, [("content", "Let me look."), WEATHER, ("tool_call", "now", {})]),
    "mistral_v11": (mistral_tool_parser, MISTRAL_V11, [WEATHER, ("tool_call", "now", {})]),
    "deepseek_v3": (deepseek_tool_parser, DEEPSEEK_V3, [("content", "Checking."), WEATHER, ("tool_call", "now", {})]),
    "deepseek_v31": (deepseek_tool_parser, DEEPSEEK_V31, [("content", "Checking."), WEATHER, ("tool_call", "now", {})]),
    "harmony": (harmony_parser, HARMONY, [("reasoning", "User wants weather in Zürich. Use get_weather."),
                                          ("content", "Checking."), WEATHER, ("tool_call", "now", {})]),
}


@pytest.mark.parametrize("name", FORMATS)
def test_tool_formats_in_any_pieces(name):
    make, text, want = FORMATS[name]
    assert summary(run(make, text, [])) == want                          # whole
    assert summary(run(make, text, range(1, len(text)))) == want         # one character at a time
    for i in range(1, len(text), 3):                                      # cut once, anywhere
        assert summary(run(make, text, [i])) == want, i


def test_no_marker_reaches_a_client_in_pieces():
    markers = ["<tool_call>", "<arg_key>", "<|tool_calls_section_begin|>", "[TOOL_CALLS]", "<｜tool▁calls▁begin｜>",
               "<|channel|>", "<|message|>", "<|start|>", "<|end|>", "<|constrain|>"]
    for make, text, _ in FORMATS.values():
        p = make()
        for ch in text:   # nothing shown may end in the first part of a marker
            for part in p.push(ch):
                if part.kind != "tool_call":
                    assert not any(m[:k] == part.text[-k:] for m in markers for k in range(1, len(m))), part


def test_bodies_that_do_not_parse_pass_as_content():
    cases = [
        (glm_tool_parser, "a <tool_call>get weather<arg_key>x</arg_key><arg_value>1</arg_value></tool_call>"),
        (glm_tool_parser, "<tool_call>f<arg_key>x</arg_key>junk<arg_value>1</arg_value></tool_call>"),
        (kimi_tool_parser, "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0{no args marker}"
                           "<|tool_call_end|><|tool_calls_section_end|>"),
        (kimi_tool_parser, "<|tool_calls_section_begin|><|tool_call_begin|>functions.f:0<|tool_call_argument_begin|>"
                           "{not json<|tool_call_end|><|tool_calls_section_end|>"),
        (mistral_tool_parser, 'x [TOOL_CALLS] [{"name": "f", "arguments": {}'),
        (mistral_tool_parser, "[TOOL_CALLS]f[ARGS][1, 2]"),
        (deepseek_tool_parser, "<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>f<｜tool▁sep｜>{oops}<｜tool▁call▁end｜><｜tool▁calls▁end｜>"),
    ]
    for make, text in cases:
        for splits in ([], range(1, len(text))):
            assert summary(run(make, text, splits)) == [("content", text)], (text, splits)
    # harmony: a call whose arguments are not JSON is its text; headers never show
    text = "<|channel|>commentary to=functions.f <|constrain|>json<|message|>{broken"
    assert summary(run(harmony_parser, text, [])) == [("content", "{broken")]
    # a call between good ones stays content, the others are calls
    text = '[TOOL_CALLS]f[ARGS]{"a": 1}[TOOL_CALLS]g[ARGS]nope[TOOL_CALLS]h[ARGS]{}'
    assert summary(run(mistral_tool_parser, text, [])) == [("tool_call", "f", {"a": 1}), ("content", "[TOOL_CALLS]g[ARGS]nope"),
                                                           ("tool_call", "h", {})]


def test_call_ids_and_argument_types():
    calls = [p.call for p in run(kimi_tool_parser, KIMI, []) if p.kind == "tool_call"]
    assert [c.id for c in calls] == ["functions.get_weather:0", "functions.now:1"]   # the template writes them back
    calls = [p.call for p in run(mistral_tool_parser, MISTRAL_V11, []) if p.kind == "tool_call"]
    assert len(calls[0].id) == 9 and calls[0].id.isalnum() and calls[1].id == "abcDEF123"
    calls = [p.call for p in run(mistral_tool_parser, MISTRAL_V3, []) if p.kind == "tool_call"]
    assert all(len(c.id) == 9 and c.id.isalnum() for c in calls)
    # GLM writes string values bare: the tool's schema tells "3" the string from 3 the number
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object", "properties": {
        "city": {"type": "string"}, "days": {"type": ["string", "null"]}}}}}]
    parts = run(lambda: glm_tool_parser(tools), GLM47, [])
    assert json.loads(parts[0].call.arguments) == {"city": "Zürich", "days": "3"}
    assert json.loads(run(glm_tool_parser, GLM47, [])[0].call.arguments) == {"city": "Zürich", "days": 3}
    xml = "<tool_call>\n<function=get_weather>\n<parameter=days>\n3\n</parameter>\n</function>\n</tool_call>"
    assert json.loads(run(lambda: hermes_tool_parser(tools), xml, [])[0].call.arguments) == {"days": "3"}
    # unicode arrives as itself, not as \\u escapes
    assert "Zürich" in run(kimi_tool_parser, KIMI, [])[1].call.arguments


def test_harmony_channels():
    text = ("<|channel|>analysis<|message|>Simple greeting.<|end|><|start|>assistant<|channel|>final<|message|>"
            "Hello <b>there</b>!")
    assert summary(run(harmony_parser, text, range(1, len(text)))) == [("reasoning", "Simple greeting."),
                                                                       ("content", "Hello <b>there</b>!")]
    # plain text (no harmony at all) is content; so is a message to a tool the client did not define
    assert summary(run(harmony_parser, "to be, or not to be", [2])) == [("content", "to be, or not to be")]
    text = '<|channel|>analysis<|message|>search it<|end|><|start|>assistant to=browser.search<|channel|>commentary code<|message|>{"q": 1}'
    assert summary(run(harmony_parser, text, [])) == [("reasoning", "search it"), ("content", '{"q": 1}')]
    # without tools in the request a call's arguments are content
    p = run(lambda: harmony_parser(tools=False), HARMONY, [])
    assert [x.kind for x in p] == ["reasoning", "content"] and p[1].text.endswith("{}")
    # two messages of one kind are set apart; a header cut off by max_tokens shows nothing
    text = "<|channel|>analysis<|message|>a<|end|><|start|>assistant<|channel|>analysis<|message|>b<|end|><|start|>assistant<|channel|>fi"
    assert summary(run(harmony_parser, text, range(1, len(text)))) == [("reasoning", "a\n\nb")]
    text = "<|channel|>final<|message|>Hi.<|end|><|start|>assistant"
    assert summary(run(harmony_parser, text, range(1, len(text)))) == [("content", "Hi.")]
    assert summary(run(harmony_parser, "to=me", [2])) == [("content", "to=me")]
    # a header broken by a newline or a closing marker is not a header: its text shows, the markers do not
    text = "<|channel|>analysis\nwhat<|end|>"
    assert summary(run(harmony_parser, text, range(1, len(text)))) == [("content", "analysis\nwhat")]
    p = harmony_parser()
    run(lambda: p, HARMONY, [])
    assert p.num_tool_calls == 2 and p.stop_markers == ["<|return|>", "<|call|>"] and "<|channel|>" in p.markers


def test_selection_from_templates():
    glm45 = "{{ '\\n<tool_call>' + tc.name }}\n{% for k, v in _args.items() %}\n<arg_key>{{ k }}</arg_key>\n<arg_value>"
    glm47 = "{{- '<tool_call>' ~ tc.name -}}{% for k, v in _args.items() %}<arg_key>{{ k }}</arg_key><arg_value>"
    kimi = ("<|tool_calls_section_begin|>{%- for tool_call in message['tool_calls'] -%}<|tool_call_begin|>{{ formatted_id }}"
            "<|tool_call_argument_begin|>")
    deepseek = "{{'<｜tool▁calls▁begin｜><｜tool▁call▁begin｜>'+ tool['function']['name'] + '<｜tool▁sep｜>'"
    mixtral = '{%- if tools %}{{- "[AVAILABLE_TOOLS] [" }}{%- for tool in tools %}'
    mistral = '{{- "[TOOL_CALLS]" + tool_call.function.name + "[ARGS]" }}'
    gpt_oss = '{{- "<|start|>assistant to=" }}{{- "functions." + tool_call.name + "<|channel|>commentary " }}'
    qwen = "{% for tool in tools %}<tool_call>"
    assert [tool_parser_for(t) for t in (glm45, glm47, kimi, deepseek, mixtral, mistral, qwen)] == [
        glm_tool_parser, glm_tool_parser, kimi_tool_parser, deepseek_tool_parser, mistral_tool_parser,
        mistral_tool_parser, hermes_tool_parser]
    assert tool_parser_for(gpt_oss) is None and uses_harmony(gpt_oss) and not uses_harmony(kimi)
    assert tool_parser_for("...<|tool_calls_begin|>... tools") is hermes_tool_parser   # not DeepSeek's markers


def test_mistral_templates_get_nine_char_ids():
    from dynamoe.serve.state import _nine_char_ids
    msgs = [{"role": "assistant", "content": "", "tool_calls": [
                {"id": "abcDEF123", "type": "function", "function": {"name": "f", "arguments": {}}},
                {"id": "toolu_xyzXYZ789", "type": "function", "function": {"name": "g", "arguments": {}}},
                {"id": "call_1", "type": "function", "function": {"name": "h", "arguments": {}}}]},
            {"role": "tool", "tool_call_id": "toolu_xyzXYZ789", "content": "ok"},
            {"role": "tool", "tool_call_id": "call_1", "content": "ok"}]
    out = _nine_char_ids(msgs)
    ids = [tc["id"] for tc in out[0]["tool_calls"]]
    assert ids[:2] == ["abcDEF123", "xyzXYZ789"] and len(ids[2]) == 9 and ids[2].isalnum()
    assert [out[1]["tool_call_id"], out[2]["tool_call_id"]] == ids[1:]
    assert msgs[0]["tool_calls"][2]["id"] == "call_1"   # the request's own messages are left alone


# --- GPT-OSS end to end: special-token markers kept for the parser, never shown --------------------------

HARMONY_TOKENS = ["<|start|>", "<|channel|>", "<|message|>", "<|end|>", "<|constrain|>", "<|call|>", "<|return|>"]
# GPT-OSS's template, cut down: tools as a namespace in the developer message, calls and results as messages
HARMONY_TEMPLATE = """\
{%- if tools %}<|start|>developer<|message|># Tools\n\nnamespace functions {\n
{%- for t in tools %}type {{ t.function.name }} = (_: any) => any;\n{% endfor %}} // namespace functions<|end|>{% endif %}
{%- for m in messages %}
{%- if m.role == 'user' %}<|start|>user<|message|>{{ m.content }}<|end|>
{%- elif m.role == 'assistant' and m.tool_calls %}
{%- for tc in m.tool_calls %}<|start|>assistant to=functions.{{ tc.function.name }}<|channel|>commentary json<|message|>
{{- tc.function.arguments | tojson }}<|call|>{% endfor %}
{%- elif m.role == 'assistant' %}<|start|>assistant<|channel|>final<|message|>{{ m.content }}<|end|>
{%- elif m.role == 'tool' %}<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>{{ m.content }}<|end|>
{%- endif %}{%- endfor %}
{%- if add_generation_prompt %}<|start|>assistant{% endif %}"""


def harmony_script(prompt: str) -> str:
    """What the scripted GPT-OSS writes: a call when tools were offered (and, past <|call|>, the tool's answer
    it must never get to write), an answer once the result came back."""
    if "to=assistant" in prompt:
        return "<|channel|>analysis<|message|>It is sunny.<|end|><|start|>assistant<|channel|>final<|message|>Sunny in Zürich.<|return|>"
    if "namespace functions" in prompt:
        return ('<|channel|>analysis<|message|>Need the weather.<|end|><|start|>assistant<|channel|>commentary '
                'to=functions.get_weather <|constrain|>json<|message|>{"city": "Zürich"}<|call|>'
                '<|start|>functions.get_weather to=assistant<|channel|>commentary<|message|>"made up"<|end|>')
    return "<|channel|>analysis<|message|>Greeting.<|end|><|start|>assistant<|channel|>final<|message|>Hi there.<|return|>"


@pytest.fixture(scope="module")
def harmony_engine(tmp_path_factory):
    """A scripted GPT-OSS over a tokenizer whose harmony markers are special tokens, as in the real one.
    No generation_config.json: <|call|> must end the output all the same (the server adds it)."""
    from engine_testing import write_tokenizer_dir
    from serve_testing import ScriptedLM
    from tokenizers import AddedToken
    from tokenizers import Tokenizer as HFTokenizer

    from dynamoe.engine import GenerationEngine, Tokenizer

    d = str(tmp_path_factory.mktemp("harmony_tok"))
    write_tokenizer_dir(d, chat_template=HARMONY_TEMPLATE, jinja_file=True,
                        extra_config={"eos_token": "<|return|>"})
    hf = HFTokenizer.from_file(f"{d}/tokenizer.json")
    hf.add_special_tokens([AddedToken(t, special=True, normalized=False) for t in HARMONY_TOKENS])
    hf.save(f"{d}/tokenizer.json")
    tok = Tokenizer.from_dir(d)
    model = ScriptedLM(tok, harmony_script, eos_token_id=tok.token_to_id("<|return|>"))
    return GenerationEngine(model, tok, max_seq_len=512, max_batch=2, prefix_caching=False), tok


def test_engine_keeps_only_the_special_tokens_asked_for(harmony_engine):
    engine, tok = harmony_engine
    ids = tok.encode_chat([{"role": "user", "content": "hi"}])

    def output(**kw):
        req = engine.add_request(ids, max_tokens=100, **kw)
        while not req.finished:
            engine.step()
        return req.text

    assert output() == "analysisGreeting.assistantfinalHi there."   # what a client would have got before
    keep = [tok.token_to_id(t) for t in ("<|channel|>", "<|message|>")]
    assert output(keep_special_ids=keep) == "<|channel|>analysis<|message|>Greeting.assistant<|channel|>final<|message|>Hi there."


def test_gpt_oss_reasoning_and_tool_calls_through_the_routes(harmony_engine):
    from serve_testing import InProcessServer

    engine, tok = harmony_engine
    srv = InProcessServer(engine, tok)
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}]
    msgs = [{"role": "user", "content": "weather in Zürich?"}]
    try:
        with httpx.Client(base_url=srv.url, timeout=30) as http:
            out = http.post("/v1/chat/completions", json={"messages": msgs, "tools": tools}).json()
            msg = out["choices"][0]["message"]
            assert out["choices"][0]["finish_reason"] == "tool_calls"
            assert msg["reasoning_content"] == "Need the weather." and msg["content"] is None
            (call,) = msg["tool_calls"]
            assert call["function"]["name"] == "get_weather"
            assert json.loads(call["function"]["arguments"]) == {"city": "Zürich"}
            written = harmony_script("namespace functions")   # <|call|> ended it: nothing made up after
            upto_call = written[:written.index("<|call|>") + len("<|call|>")]
            assert out["usage"]["completion_tokens"] == len(tok.encode(upto_call, add_special_tokens=False))

            events = [json.loads(line[6:]) for line in http.post(
                "/v1/chat/completions", json={"messages": msgs, "tools": tools, "stream": True}).text.splitlines()
                if line.startswith("data: {")]
            deltas = [e["choices"][0]["delta"] for e in events if e["choices"]]
            assert "".join(d.get("reasoning_content", "") for d in deltas) == "Need the weather."
            assert [d["tool_calls"][0]["function"]["name"] for d in deltas if d.get("tool_calls")] == ["get_weather"]
            assert not any("<|" in json.dumps(d) for d in deltas)

            msgs += [{"role": "assistant", "content": None, "tool_calls": [call]},
                     {"role": "tool", "tool_call_id": call["id"], "content": "sunny"}]
            out = http.post("/v1/chat/completions", json={"messages": msgs, "tools": tools}).json()
            assert out["choices"][0]["message"]["content"] == "Sunny in Zürich."
            assert out["choices"][0]["message"]["reasoning_content"] == "It is sunny."

            out = http.post("/v1/messages", json={"model": "x", "max_tokens": 100, "messages": msgs[:1], "tools": [
                {"name": "get_weather", "input_schema": {"type": "object"}}]}).json()
            assert [b["type"] for b in out["content"]] == ["thinking", "tool_use"] and out["stop_reason"] == "tool_use"
            assert out["content"][1]["input"] == {"city": "Zürich"}
            # raw completions: special tokens skipped as before
            out = http.post("/v1/completions", json={"prompt": tok.apply_chat_template(msgs[:1]), "max_tokens": 50}).json()
            assert "<|" not in out["choices"][0]["text"]
    finally:
        srv.stop()
