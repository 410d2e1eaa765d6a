"""Tool calling's pure parts: the tool_choice rules, the constraint each choice implies,
the parsers of the formats models write (Hermes/Qwen, Llama 3 JSON), and the streamed
parse, which must equal the whole-text parse however the text is cut into deltas."""
import json

import jsonschema
import pytest
from hypothesis import given, settings, strategies as st

from cpuserve.entrypoints.openai import tools as tl

WEATHER = tl.ToolDef(function=tl.FunctionDef(name="get_weather", parameters={
    "type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]}))
TIME = tl.ToolDef(function=tl.FunctionDef(name="get_time"))


@pytest.mark.parametrize("tools, choice, auto, want", [
    ([WEATHER], None, True, "auto"),
    ([WEATHER], None, False, "none"),
    (None, None, True, "none"),
    ([WEATHER], "none", False, "none"),
    ([WEATHER], "required", False, "required"),
    ([WEATHER, TIME], tl.NamedToolChoice(function=tl.NamedFunction(name="get_time")), False, "function:get_time"),
])
def test_tool_choice(tools, choice, auto, want):
    assert tl.resolve_choice(tools, choice, auto) == want


@pytest.mark.parametrize("tools, choice, auto, says", [
    ([WEATHER], "auto", False, "--enable-auto-tool-choice"),
    (None, "required", True, "needs tools"),
    ([WEATHER], tl.NamedToolChoice(function=tl.NamedFunction(name="nope")), True, "not among tools"),
])
def test_tool_choice_mistakes(tools, choice, auto, says):
    with pytest.raises(tl.ToolError, match=says) as e:
        tl.resolve_choice(tools, choice, auto)
    assert e.value.param == "tool_choice"


def test_required_schema_accepts_calls_of_the_tools_and_nothing_else():
    schema = json.loads(tl.constraint([WEATHER, TIME], "required").text)
    jsonschema.validate([{"name": "get_weather", "parameters": {"city": "Oslo"}},
                         {"name": "get_time", "parameters": {}}], schema)
    for bad in ([], [{"name": "get_weather", "parameters": {}}], [{"name": "rm_rf", "parameters": {}}]):
        with pytest.raises(jsonschema.ValidationError):
            jsonschema.validate(bad, schema)
    one = json.loads(tl.constraint([WEATHER], "required", parallel=False).text)
    assert one["maxItems"] == 1
    assert json.loads(tl.constraint([WEATHER], "function:get_weather").text) == WEATHER.function.parameters
    assert tl.constraint([WEATHER], "auto") is None and tl.constraint([WEATHER], "none") is None


def test_constraints_keep_the_parameters_property_order():
    params = {"type": "object", "properties": {"unit": {"type": "string"}, "city": {"type": "string"}}}
    tool = tl.ToolDef(function=tl.FunctionDef(name="f", parameters=params))
    assert list(json.loads(tl.constraint([tool], "function:f").text)["properties"]) == ["unit", "city"]
    item = json.loads(tl.constraint([tool], "required").text)["items"]["anyOf"][0]
    assert list(item["properties"]) == ["name", "parameters"]
    assert list(item["properties"]["parameters"]["properties"]) == ["unit", "city"]


def test_enforced_outputs_parse():
    calls = tl.parse_enforced("required", '[{"name": "get_time", "parameters": {}}, '
                                          '{"name": "get_weather", "parameters": {"city": "Zürich"}}]')
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [("get_time", {}), ("get_weather", {"city": "Zürich"})]
    assert len({c.id for c in calls}) == 2 and all(c.id.startswith("chatcmpl-tool-") for c in calls)
    assert tl.parse_enforced("function:f", '{"a": 1}')[0].arguments == '{"a": 1}'


@pytest.mark.parametrize("text, content, calls", [
    ("Hello there", "Hello there", []),
    ('<tool_call>\n{"name": "f", "arguments": {"x": 1}}\n</tool_call>', None, [("f", {"x": 1})]),
    ('Checking. <tool_call>{"name": "f", "arguments": {}}</tool_call>\n<tool_call>{"name": "g", "arguments": '
     '{"y": "z"}}</tool_call>', "Checking.", [("f", {}), ("g", {"y": "z"})]),
    ('<tool_call>{"name": "f", "arguments": {"x": 1}}', None, [("f", {"x": 1})]),  # EOS before the end tag
    ("<tool_call>not json</tool_call>", "<tool_call>not json</tool_call>", []),
])
def test_hermes(text, content, calls):
    got_content, got = tl.HermesParser().extract(text)
    assert got_content == content and [(c.name, json.loads(c.arguments)) for c in got] == calls


@pytest.mark.parametrize("text, content, calls", [
    ("The answer is 4.", "The answer is 4.", []),
    ('{"name": "f", "parameters": {"x": 1}}', None, [("f", {"x": 1})]),
    ('<|python_tag|>{"name": "f", "arguments": {"x": 1}}; {"name": "g", "parameters": {}}', None,
     [("f", {"x": 1}), ("g", {})]),
    ('{"not": "a call"}', '{"not": "a call"}', []),
    ('{"name": "f", "parameters": {', '{"name": "f", "parameters": {', []),
])
def test_llama3_json(text, content, calls):
    got_content, got = tl.Llama3JsonParser().extract(text)
    assert got_content == content and [(c.name, json.loads(c.arguments)) for c in got] == calls


@pytest.mark.parametrize("text, content, calls", [
    ("No tools needed.", "No tools needed.", []),
    ('Sure. [TOOL_CALLS][{"name": "f", "arguments": {"x": 1}}, {"name": "g", "arguments": {}}]', "Sure.",
     [("f", {"x": 1}), ("g", {})]),  # v3 tokenizers: a JSON list
    ('[TOOL_CALLS]f[ARGS]{"x": 1}[TOOL_CALLS]g[ARGS]{}', None, [("f", {"x": 1}), ("g", {})]),  # v11: name[ARGS]{}
    ("[TOOL_CALLS]not json", "[TOOL_CALLS]not json", []),
    ('[TOOL_CALLS][{"name": "f", "arguments": {}}] and more', '[TOOL_CALLS][{"name": "f", "arguments": {}}] and more',
     []),
])
def test_mistral(text, content, calls):
    got_content, got = tl.MistralParser().extract(text)
    assert got_content == content and [(c.name, json.loads(c.arguments)) for c in got] == calls


@pytest.mark.parametrize("text, content, calls", [
    ('[get_weather(city="Oslo", days=3), get_time()]', None, [("get_weather", {"city": "Oslo", "days": 3}),
                                                             ("get_time", {})]),
    ('<|python_start|>[tools.lookup(q="x", exact=True, page=None)]<|python_end|>', None,
     [("tools.lookup", {"q": "x", "exact": True, "page": None})]),  # Llama 4's tags, a dotted name
    ("[f(1)]", "[f(1)]", []),  # positional arguments: not a call the format writes
    ("[f(x=g())]", "[f(x=g())]", []),  # a value that is not a literal
    ("Hello [world]", "Hello [world]", []),
    ("[]", "[]", []),
    ("[" * 5000, "[" * 5000, []),
])
def test_pythonic(text, content, calls):
    got_content, got = tl.PythonicParser().extract(text)
    assert got_content == content and [(c.name, json.loads(c.arguments)) for c in got] == calls


def test_the_cli_offers_every_parser():
    import argparse

    from cpuserve.entrypoints import cli
    p = argparse.ArgumentParser()
    sub = p.add_subparsers()
    cli._add_serve(sub)
    serve = sub.choices["serve"]
    assert tuple(next(a for a in serve._actions if a.dest == "tool_call_parser").choices) == tl.PARSERS


TEXTS = ["Sure! <tool_call>{\"name\": \"f\", \"arguments\": {\"q\": \"<tool\"}}</tool_call>",
         "I think <tool_ it is < not a tag", '{"name": "f", "parameters": {"a": [1, 2]}}', "  plain words, then <",
         "<|python_tag|>{\"name\": \"g\", \"arguments\": {}}",
         'Let me see [TOOL_CALLS][{"name": "f", "arguments": {"q": "[TOOL"}}]', "[TOOL_CALLS]g[ARGS]{\"a\": 1}",
         'One [TOOL_ not a tag', '[get_weather(city="Oslo"), get_time()]', "[not, a call]"]


@settings(max_examples=300, deadline=None)
@given(st.sampled_from(TEXTS), st.sampled_from(list(tl.PARSERS)),
       st.lists(st.integers(0, 80), max_size=8))
def test_streamed_parse_equals_whole_parse(text, parser, cuts):
    content, calls = tl.make_parser(parser).extract(text)
    ts, sent, deltas = tl.ToolStream("auto", tl.make_parser(parser)), "", []
    bounds = sorted({min(c, len(text)) for c in cuts}) + [len(text)]
    start = 0
    for i, end in enumerate(bounds):
        piece, got = ts.push(text[start:end], done=i == len(bounds) - 1)
        sent += piece
        deltas += got
        start = end
    assert sent == (content or "") if calls else sent == text
    assert [(d["function"]["name"], d["function"]["arguments"]) for d in deltas] == \
        [(c.name, c.arguments) for c in calls]


def test_named_function_arguments_stream_as_generated():
    ts = tl.ToolStream("function:get_weather")
    first = ts.push('{"ci', False)[1]
    assert first[0]["function"] == {"name": "get_weather", "arguments": '{"ci'} and first[0]["id"]
    assert ts.push('ty": "Oslo"}', True)[1] == [{"index": 0, "function": {"arguments": 'ty": "Oslo"}'}}]
    assert ts.calls[0].arguments == '{"city": "Oslo"}'
