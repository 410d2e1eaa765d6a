"""POST /v1/responses through the official openai client: the same answer as chat on the same
conversation, its stream of events, text.format, function tools (calls as output items, streamed
as OpenAI's events, and sent back as input), and what it refuses."""
import json

import httpx
import jsonschema
import pytest

from cpuserve.structured import grammar

ASK = "Name three fruits."
RULES = "Answer in one line."


def test_a_response_is_chats_answer_to_the_same_conversation(client):
    chat = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=12, messages=[
        {"role": "system", "content": RULES}, {"role": "user", "content": ASK}])
    r = client.responses.create(model="smollm2", instructions=RULES, input=ASK, temperature=0, max_output_tokens=12)
    c = chat.choices[0]
    assert r.output_text == c.message.content and r.object == "response" and r.id.startswith("resp_")
    assert (r.status, r.incomplete_details and r.incomplete_details.reason) == \
        (("incomplete", "max_output_tokens") if c.finish_reason == "length" else ("completed", None))
    assert (r.usage.input_tokens, r.usage.output_tokens) == (chat.usage.prompt_tokens, chat.usage.completion_tokens)
    assert r.output[0].role == "assistant" and r.output[0].content[0].type == "output_text"
    parts = client.responses.create(model="smollm2", temperature=0, max_output_tokens=12, input=[
        {"role": "developer", "content": RULES},
        {"role": "user", "content": [{"type": "input_text", "text": "Name three "}, {"type": "input_text",
                                                                                     "text": "fruits."}]}])
    assert parts.output_text == r.output_text  # developer is the system turn, parts joined


def test_the_stream_sends_openais_events_in_order(client):
    kw = dict(model="smollm2", input=ASK, temperature=0, max_output_tokens=10)
    whole = client.responses.create(**kw)
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    assert kinds[:4] == ["response.created", "response.in_progress", "response.output_item.added",
                         "response.content_part.added"]
    assert kinds[-4:] == ["response.output_text.done", "response.content_part.done", "response.output_item.done",
                          f"response.{whole.status}"]
    assert set(kinds[4:-4]) == {"response.output_text.delta"}
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == whole.output_text == events[-4].text
    assert events[-1].response.usage.output_tokens == whole.usage.output_tokens


@pytest.mark.skipif(not grammar.available(), reason=grammar.UNAVAILABLE)
def test_text_format_constrains_the_answer(client):
    schema = {"type": "object", "properties": {"fruit": {"type": "string", "maxLength": 12}}, "required": ["fruit"]}
    r = client.responses.create(model="smollm2", input=ASK, temperature=0, max_output_tokens=40,
                                text={"format": {"type": "json_schema", "name": "fruit", "schema": schema}})
    assert r.status == "completed"
    jsonschema.validate(json.loads(r.output_text), {**schema, "additionalProperties": False})


@pytest.mark.parametrize("body, param", [
    ({"previous_response_id": "resp_1"}, "previous_response_id"),
    ({"tools": [{"type": "web_search_preview"}]}, "tools"),
    ({"tools": [{"type": "function", "name": "bad name!"}]}, "tools"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": {"type": "mcp"}}, "tool_choice"),
    ({"tool_choice": "required"}, "tool_choice"),
    ({"tools": [{"type": "function", "name": "f"}], "tool_choice": "required",
      "text": {"format": {"type": "json_object"}}}, "tool_choice"),
    ({"background": True}, "background"),
    ({"input": []}, "input"),
    ({"text": {"format": {"type": "json_schema", "name": "x"}}}, "text.format"),
    ({"text": {"format": {"type": "regex"}}}, "text.format"),
    ({"max_output_tokens": 0}, "max_output_tokens"),
])
def test_what_is_not_served_is_a_400_naming_it(server, body, param):
    r = httpx.post(server.url + "/v1/responses", json={"model": "smollm2", "input": "hi", **body}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param, r.text


WEATHER = {"type": "function", "name": "get_weather", "description": "The weather in a city",
           "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 20}},
                          "required": ["city"]}}


@pytest.mark.skipif(not grammar.available(), reason=grammar.UNAVAILABLE)
@pytest.mark.parametrize("choice", ["required", {"type": "function", "name": "get_weather"}])
def test_function_calls_are_output_items_streamed_and_not(client, choice):
    kw = dict(model="smollm2", input="What is the weather in Paris?", tools=[WEATHER], tool_choice=choice,
              temperature=0, max_output_tokens=60)
    r = client.responses.create(**kw)
    calls = [o for o in r.output if o.type == "function_call"]
    assert r.status == "completed" and calls and not [o for o in r.output if o.type == "message"]
    assert calls[0].name == "get_weather" and set(json.loads(calls[0].arguments)) == {"city"}
    assert calls[0].call_id.startswith("chatcmpl-tool-") and r.tools[0].name == "get_weather"
    events = list(client.responses.create(**kw, stream=True))
    kinds = [e.type for e in events]
    n = len(calls)
    assert kinds == ["response.created", "response.in_progress"] + [
        "response.output_item.added", "response.function_call_arguments.delta",
        "response.function_call_arguments.done", "response.output_item.done"] * n + ["response.completed"]
    done = [e.item for e in events if e.type == "response.output_item.done"]
    assert [(d.name, d.arguments) for d in done] == [(c.name, c.arguments) for c in calls]
    assert [e.sequence_number for e in events] == list(range(len(events)))


def test_calls_and_their_outputs_go_back_as_chat_would_send_them(client):
    call = {"type": "function_call", "call_id": "call_1", "name": "get_weather", "arguments": '{"city": "Paris"}'}
    out = {"type": "function_call_output", "call_id": "call_1", "output": '{"temperature": 21}'}
    r = client.responses.create(model="smollm2", temperature=0, max_output_tokens=16, tools=[WEATHER],
                                tool_choice="none", input=[{"role": "user", "content": "Weather in Paris?"}, call, out])
    chat = client.chat.completions.create(model="smollm2", temperature=0, max_tokens=16, tool_choice="none", tools=[
        {"type": "function", "function": {k: v for k, v in WEATHER.items() if k != "type"}}], messages=[
        {"role": "user", "content": "Weather in Paris?"},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": '{"temperature": 21}'}])
    assert r.output_text == chat.choices[0].message.content and r.usage.input_tokens == chat.usage.prompt_tokens
