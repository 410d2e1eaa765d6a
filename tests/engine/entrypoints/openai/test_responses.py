"""POST /v1/responses through the official openai client: the same answer as chat on the same
conversation, its stream of events, text.format, and what it refuses."""
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
    ({"tools": [{"type": "function", "name": "f"}]}, "tools"),
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
