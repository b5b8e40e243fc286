"""The serving layer's pure parts: reasoning and tool-call parsers (fed in every possible split), request
conversion into chat-template messages, Anthropic stream events, Prometheus text."""
import json

import pytest

from dynamoe.serve.anthropic_api import AnthropicEvents, anthropic_messages, anthropic_tools
from dynamoe.serve.errors import APIError
from dynamoe.serve.metrics import Histogram, Metrics
from dynamoe.serve.openai_api import openai_messages
from dynamoe.serve.parsing import (OutputParser, Part, ReasoningParser, ToolCall, deepseek_tool_parser,
                                   hermes_tool_parser, prompt_opens_think, tool_parser_for)

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
    assert events[12]["delta"]["stop_reason"] == "tool_use" and events[12]["usage"] == {"output_tokens": 30}
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
