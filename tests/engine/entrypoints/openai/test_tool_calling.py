"""Tool calling through the running server on the default model (started with
--enable-auto-tool-choice --tool-call-parser hermes): calls enforced by the grammar
("required", a named function), found by the parser ("auto"), streamed and not, and a
round trip that sends the call and the tool's answer back through the chat template."""
import json

import httpx
import jsonschema
import pytest

from cpuserve.structured import grammar

pytestmark = pytest.mark.skipif(not grammar.available(), reason=grammar.UNAVAILABLE)

PARAMS = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30},
                                           "unit": {"enum": ["celsius", "fahrenheit"]}},
          "required": ["city", "unit"], "additionalProperties": False}
TOOLS = [{"type": "function", "function": {"name": "get_weather", "description": "Current weather in a city",
                                           "parameters": PARAMS}},
         {"type": "function", "function": {"name": "get_time", "description": "Local time in a city",
                                           "parameters": {"type": "object", "properties": {"city": {
                                               "type": "string", "maxLength": 30}}, "required": ["city"]}}}]
ASK = [{"role": "user", "content": "What is the weather in Paris?"}]
NAMED = {"type": "function", "function": {"name": "get_weather"}}


def create(client, **kw):
    kw = {"messages": ASK, "tools": TOOLS, "temperature": 0, "max_tokens": 80, **kw}
    return client.chat.completions.create(model="smollm2", **kw)


def streamed_calls(chunks) -> tuple[list[dict], str, str]:
    """The calls as a client rebuilds them from deltas, the content, the last finish_reason."""
    calls: dict[int, dict] = {}
    content = ""
    for ch in chunks:
        if not ch.choices:
            continue
        d = ch.choices[0].delta
        content += d.content or ""
        for tc in d.tool_calls or ():
            c = calls.setdefault(tc.index, {"id": tc.id, "name": "", "arguments": ""})
            c["name"] += tc.function.name or ""
            c["arguments"] += tc.function.arguments or ""
    return [calls[i] for i in sorted(calls)], content, chunks[-1].choices[0].finish_reason


@pytest.mark.parametrize("choice", ["required", NAMED])
def test_enforced_calls_parse_against_the_schema_streamed_and_not(client, choice):
    r = create(client, tool_choice=choice)
    c = r.choices[0]
    assert c.finish_reason == ("tool_calls" if choice == "required" else "stop")
    assert c.message.content is None and c.message.tool_calls
    for call in c.message.tool_calls:
        assert call.type == "function" and call.id.startswith("chatcmpl-tool-")
        schema = next(t["function"]["parameters"] for t in TOOLS if t["function"]["name"] == call.function.name)
        jsonschema.validate(json.loads(call.function.arguments), schema)
    calls, content, reason = streamed_calls(list(create(client, tool_choice=choice, stream=True)))
    assert reason == c.finish_reason and content == ""
    assert [(x["name"], x["arguments"]) for x in calls] == \
        [(t.function.name, t.function.arguments) for t in c.message.tool_calls]
    assert all(x["id"] for x in calls)


def test_enforced_arguments_hold_only_the_parameters_the_function_names(client):
    """A parameters schema that says nothing of other keys gets none (as vLLM's xgrammar reads
    it): the 135M model, free to, added `"location": "Paris"` beside `city`."""
    city = {"type": "object", "properties": {"city": {"type": "string", "maxLength": 30}}, "required": ["city"]}
    tools = [{"type": "function", "function": {"name": "get_weather", "parameters": city}}]
    ask = [{"role": "user", "content": "Weather in Paris and Rome?"}]
    for choice in ("required", NAMED):
        r = create(client, messages=ask, tools=tools, tool_choice=choice, parallel_tool_calls=False)
        args = [json.loads(c.function.arguments) for c in r.choices[0].message.tool_calls]
        assert args and all(set(a) == {"city"} for a in args), args


def test_round_trip_through_the_chat_template(client):
    first = create(client, tool_choice=NAMED).choices[0].message
    call = first.tool_calls[0]
    convo = ASK + [first.model_dump(exclude_none=True),
                   {"role": "tool", "tool_call_id": call.id, "content": json.dumps({"temperature": 18})}]
    r = create(client, messages=convo, tool_choice="none")
    assert r.choices[0].message.content and r.choices[0].message.tool_calls is None
    assert r.usage.prompt_tokens > create(client, tool_choice="none", max_tokens=1).usage.prompt_tokens


def test_auto_finds_the_call_the_model_writes(client):
    """The 135M model does not call tools of itself: a regex makes it write a Hermes call,
    which the server's parser must find (content before it stays content)."""
    forced = (r'Let me check\. <tool_call>\{"name": "get_time", "arguments": \{"city": "[A-Z][a-z]{2,10}"\}\}'
              r'</tool_call>')
    r = create(client, tool_choice="auto", extra_body={"guided_regex": forced})
    c = r.choices[0]
    assert c.finish_reason == "tool_calls" and c.message.content == "Let me check."
    assert c.message.tool_calls[0].function.name == "get_time"
    assert set(json.loads(c.message.tool_calls[0].function.arguments)) == {"city"}
    calls, content, reason = streamed_calls(list(create(client, tool_choice="auto", stream=True,
                                                        extra_body={"guided_regex": forced})))
    assert (content, reason) == ("Let me check.", "tool_calls")
    assert [(x["name"], x["arguments"]) for x in calls] == [("get_time", c.message.tool_calls[0].function.arguments)]
    plain = create(client, tool_choice="auto", max_tokens=20).choices[0]
    assert plain.message.tool_calls is None and plain.message.content


@pytest.mark.parametrize("body, param", [
    ({"tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice"),
    ({"tool_choice": "required", "tools": None}, "tool_choice"),
    ({"tool_choice": NAMED, "guided_regex": "a"}, "tool_choice"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, None),
    ({"tool_choice": "sometimes"}, None),
])
def test_tool_mistakes_are_400s(server, body, param):
    r = httpx.post(server.url + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 4, "tools": TOOLS,
                                                              **body}, timeout=30)
    assert r.status_code == 400, r.text
    if param:
        assert r.json()["error"]["param"] == param
