"""Reasoning parsers (--reasoning-parser): a thinking model's answer split into reasoning_content
and content, the same whole or streamed in any chunks; on the real model (its output forced into
a think block by a regex) through the server, streamed and not."""
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


THINK = r"<think>[a-z ]{4,40}</think>[A-Z][a-z]{2,12}\."


@pytest.fixture(scope="module")
def thinker():
    s = Server("--reasoning-parser", "deepseek_r1")
    yield s
    s.stop()


def test_the_server_answers_reasoning_apart_from_content(thinker):
    body = {"messages": [{"role": "user", "content": "Think, then name a fruit."}], "guided_regex": THINK,
            "temperature": 0, "max_tokens": 60}
    whole = httpx.post(thinker.url + "/v1/chat/completions", json=body, timeout=60).json()
    msg = whole["choices"][0]["message"]
    assert msg["reasoning_content"] and "<think>" not in msg["reasoning_content"]
    assert msg["content"][0].isupper() and msg["content"].endswith(".")
    r = httpx.post(thinker.url + "/v1/chat/completions", json={**body, "stream": True}, timeout=60)
    deltas = [json.loads(line[6:])["choices"][0]["delta"] for line in r.text.splitlines()
              if line.startswith("data: {")]
    assert "".join(d.get("reasoning_content", "") for d in deltas) == msg["reasoning_content"]
    assert "".join(d.get("content") or "" for d in deltas) == msg["content"]
    first_content = next(i for i, d in enumerate(deltas) if d.get("content"))
    assert all("reasoning_content" not in d for d in deltas[first_content:])  # reasoning comes first
    plain = httpx.post(thinker.url + "/v1/chat/completions", timeout=60,
                       json={**body, "guided_regex": "[A-Z][a-z]{2,12}"}).json()["choices"][0]["message"]
    assert plain["reasoning_content"] and plain["content"] is None  # deepseek_r1: no </think>, all of it thought


def test_without_a_parser_the_think_block_is_content(server):
    body = {"messages": [{"role": "user", "content": "Think, then name a fruit."}], "guided_regex": THINK,
            "temperature": 0, "max_tokens": 60}
    msg = httpx.post(server.url + "/v1/chat/completions", json=body, timeout=60).json()["choices"][0]["message"]
    assert msg["content"].startswith("<think>") and "reasoning_content" not in msg
