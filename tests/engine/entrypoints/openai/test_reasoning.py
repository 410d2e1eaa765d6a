"""Reasoning parsers (--reasoning-parser): a thinking model's answer split into reasoning_content
and content, the same whole or streamed in any chunks; on the real model (which thinks first after
a few answers that do) through the server, streamed and not; structured output and enforced tool
calls holding after the reasoning (the grammar side: structured/test_grammar.py); the Responses
API's reasoning item, whole and streamed."""
import json

import httpx
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from cpuserve.entrypoints.openai.reasoning import ReasoningStream, split
from tests.engine.entrypoints.openai.conftest import Server


@pytest.mark.parametrize("parser, text, want", [
    ("deepseek_r1", "<think>Let me see.</think>\n\nIt is 4.", ("Let me see.", "\n\nIt is 4.")),
    ("deepseek_r1", "Let me see.</think>It is 4.", ("Let me see.", "It is 4.")),  # <think> was in the prompt
    ("deepseek_r1", "Still thinking when cut", ("Still thinking when cut", "")),
    ("qwen3", "<think>Let me see.</think>\n\nIt is 4.", ("Let me see.", "\n\nIt is 4.")),
    ("qwen3", "It is 4.", ("", "It is 4.")),  # enable_thinking: false
    ("qwen3", "<think>cut short", ("cut short", "")),
    ("qwen3", "<thi", ("", "<thi")),  # not a tag after all
])
def test_the_parts_of_a_whole_answer(parser, text, want):
    assert split(parser, text) == want


@settings(max_examples=300, deadline=None)
@given(parser=st.sampled_from(["deepseek_r1", "qwen3"]),
       text=st.sampled_from(["<think>a < b, so </thi not yet</think>\n\nb", "<think></think>x", "<th", "x</think>y",
                             "<think>no end", "plain <think>late</think> tags", "</think>"]),
       cuts=st.lists(st.integers(0, 40), max_size=8))
def test_streamed_in_any_chunks_the_parts_are_the_whole_answers(parser, text, cuts):
    points = sorted({min(c, len(text)) for c in cuts} | {len(text)})
    stream, got, start = ReasoningStream(parser), ["", ""], 0
    for end in points:
        r, c = stream.push(text[start:end], done=end == len(text))
        got[0] += r
        got[1] += c
        start = end
    assert tuple(got) == split(parser, text)


# a few answers that think first: the model, which never writes a think block of its own, copies them
SHOTS = [("What is 2+2?", "<think>two plus two is four</think>4"),
         ("Colour of the sky?", "<think>the sky looks blue</think>Blue"),
         ("Capital of Italy?", "<think>italy has rome as its capital</think>Rome")]
FEW_SHOT = [m for q, a in SHOTS for m in ({"role": "user", "content": q}, {"role": "assistant", "content": a})] + \
    [{"role": "user", "content": "Capital of France?"}]


@pytest.fixture(scope="module")
def thinker():
    s = Server("--reasoning-parser", "deepseek_r1")
    yield s
    s.stop()


def test_the_server_answers_reasoning_apart_from_content(thinker):
    body = {"messages": FEW_SHOT, "temperature": 0, "max_tokens": 30}
    whole = httpx.post(thinker.url + "/v1/chat/completions", json=body, timeout=60).json()
    msg = whole["choices"][0]["message"]
    assert msg["reasoning_content"] and "think>" not in msg["reasoning_content"] + (msg["content"] or "")
    assert msg["content"]
    r = httpx.post(thinker.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60)
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.text.splitlines()
              if line.startswith("data: {")]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == msg["content"]
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("reasoning_content" not in d for d in deltas[first_content:])  # reasoning comes first
    cut = httpx.post(thinker.url + "/v1/chat/completions", json={**body, "max_tokens": 7}, timeout=60).json()
    msg = cut["choices"][0]["message"]
    assert msg["reasoning_content"] and msg["content"] is None  # cut short while thinking: all of it thought


def test_structured_output_and_tool_calls_hold_after_the_reasoning(thinker):
    schema = {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}
    body = {"messages": FEW_SHOT, "max_tokens": 40, "temperature": 0,
            "response_format": {"type": "json_schema", "json_schema": {"name": "c", "schema": schema}}}
    msg = httpx.post(thinker.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
    assert msg["reasoning_content"] and list(json.loads(msg["content"])) == ["city"]
    tools = [{"type": "function", "function": {"name": "capital_of", "parameters": schema}}]
    r = httpx.post(thinker.url + "/v1/chat/completions", timeout=60, json={
        "messages": FEW_SHOT, "max_tokens": 60, "temperature": 0, "tools": tools, "tool_choice": "required"}).json()
    msg = r["choices"][0]["message"]
    call = msg["tool_calls"][0]["function"]
    assert msg["reasoning_content"] and call["name"] == "capital_of" and list(json.loads(call["arguments"])) == ["city"]


def test_without_a_parser_the_think_block_is_content(server):
    body = {"messages": FEW_SHOT, "temperature": 0, "max_tokens": 30}
    msg = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
    assert msg["content"].startswith("<think>") and "</think>" in msg["content"] and "reasoning_content" not in msg


def test_the_responses_api_answers_a_reasoning_item_before_the_message(thinker):
    chat = httpx.post(thinker.url + "/v1/chat/completions", timeout=60,
                      json={"messages": FEW_SHOT, "temperature": 0, "max_tokens": 30}).json()["choices"][0]["message"]
    body = {"input": FEW_SHOT, "temperature": 0, "max_output_tokens": 30}
    r = httpx.post(thinker.url + "/v1/responses", json=body, timeout=60).json()
    assert [o["type"] for o in r["output"]] == ["reasoning", "message"]
    assert r["output"][0]["content"][0]["text"] == chat["reasoning_content"]
    assert r["output"][1]["content"][0]["text"] == chat["content"]
    raw = httpx.post(thinker.url + "/v1/responses", json={**body, "stream": True}, timeout=60).text
    events = [json.loads(line[6:]) for line in raw.splitlines() if line.startswith("data: ")]
    kinds = [e["type"] for e in events]
    thought = [i for i, k in enumerate(kinds) if k == "response.reasoning_text.delta"]
    said = [i for i, k in enumerate(kinds) if k == "response.output_text.delta"]
    assert kinds[2] == "response.output_item.added" and events[2]["item"]["type"] == "reasoning"
    assert thought and said and max(thought) < kinds.index("response.reasoning_text.done") < min(said)
    assert "".join(events[i]["delta"] for i in thought) == chat["reasoning_content"]
    assert "".join(events[i]["delta"] for i in said) == chat["content"]
    assert [e["output_index"] for e in events if e["type"] == "response.output_item.done"] == [0, 1]
    assert [o["content"] for o in events[-1]["response"]["output"]] == [o["content"] for o in r["output"]]
