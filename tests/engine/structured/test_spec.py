"""The constraint a request carries, read from OpenAI's and vLLM's fields (pure), and
the grammar engine's verdict on it."""
import json

import pytest

from cpuserve.structured import grammar
from cpuserve.structured.spec import MAX_CHOICES, GrammarSpec, SpecError, closed_schema, from_fields

SCHEMA = {"type": "object", "properties": {"a": {"type": "integer"}}}


@pytest.mark.parametrize("fields, want", [
    ({}, None),
    ({"response_format": {"type": "text"}}, None),
    ({"response_format": {"type": "json_object"}}, GrammarSpec("json_object", "")),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": SCHEMA}}},
     GrammarSpec("json", json.dumps(SCHEMA, separators=(",", ":")))),
    ({"guided_json": json.dumps(SCHEMA)}, GrammarSpec("json", json.dumps(SCHEMA, separators=(",", ":")))),
    ({"guided_regex": "[0-9]+"}, GrammarSpec("regex", "[0-9]+")),
    ({"guided_choice": ["a", "b"]}, GrammarSpec("choice", '["a", "b"]')),
    ({"guided_grammar": 'root ::= "x"'}, GrammarSpec("grammar", 'root ::= "x"')),
    ({"structured_outputs": {"json_object": True}}, GrammarSpec("json_object", "")),
    ({"structured_outputs": {"regex": "a+", "choice": None}}, GrammarSpec("regex", "a+")),
    ({"guided_json": SCHEMA, "whitespace_pattern": " ?"},
     GrammarSpec("json", json.dumps(SCHEMA, separators=(",", ":")), " ?")),
])
def test_fields_to_spec(fields, want):
    assert from_fields(**fields) == want


def test_a_schema_keeps_the_clients_property_order():
    """The grammar generates properties in the schema's order: sorting the keys (as this once did)
    turned {"reasoning", "answer"} into the answer first."""
    schema = {"type": "object", "properties": {"reasoning": {"type": "string"}, "answer": {"type": "integer"}},
              "required": ["reasoning", "answer"]}
    for fields in ({"guided_json": schema}, {"guided_json": json.dumps(schema)},
                   {"response_format": {"type": "json_schema", "json_schema": {"name": "x", "schema": schema}}}):
        assert list(json.loads(from_fields(**fields).text)["properties"]) == ["reasoning", "answer"]


@pytest.mark.parametrize("fields, param", [
    ({"guided_json": SCHEMA, "guided_regex": "a"}, "guided_regex"),
    ({"response_format": {"type": "json_object"}, "guided_choice": ["a"]}, "guided_choice"),
    ({"guided_json": "[1"}, "guided_json"),
    ({"guided_json": 3}, "guided_json"),
    ({"guided_choice": "a"}, "guided_choice"),
    ({"guided_choice": ["a", ""]}, "guided_choice"),
    ({"guided_choice": [str(i) for i in range(MAX_CHOICES + 1)]}, "guided_choice"),
    ({"guided_regex": ""}, "guided_regex"),
    ({"response_format": {"type": "json_schema", "json_schema": {"name": "x"}}}, "response_format"),
    ({"response_format": {"type": "grammar"}}, "response_format"),
    ({"structured_outputs": {}}, None),
    ({"structured_outputs": {"regex": "a", "grammar": "b"}}, "structured_outputs"),
    ({"guided_regex": "a", "whitespace_pattern": " "}, "guided_whitespace_pattern"),
    ({"guided_regex": "a" * 70000}, "guided_regex"),
])
def test_client_mistakes_name_the_field(fields, param):
    if param is None:
        assert from_fields(**fields) is None
        return
    with pytest.raises(SpecError) as e:
        from_fields(**fields)
    assert e.value.param == param


@pytest.mark.skipif(not grammar.available(), reason=grammar.UNAVAILABLE)
@pytest.mark.parametrize("spec, ok", [
    (GrammarSpec("json", json.dumps(SCHEMA)), True),
    (GrammarSpec("json", '{"type": "nope"}'), False),
    (GrammarSpec("regex", "(a|b"), False),
    (GrammarSpec("grammar", "root ::= missing"), False),
    (GrammarSpec("grammar", "start: \"a\" | \"b\""), True),  # Lark as well as GBNF
    (GrammarSpec("choice", '["x", "y"]'), True),
    (GrammarSpec("json_object", ""), True),
])
def test_validate(spec, ok):
    assert (grammar.validate(spec) == "") == ok


OBJ = {"type": "object", "properties": {"a": {"type": "integer"}}}
CLOSED = {**OBJ, "additionalProperties": False}


@pytest.mark.parametrize("schema, want", [
    (OBJ, CLOSED),
    ({"type": "object"}, {"type": "object"}),  # no properties named: any object, as json_object
    (True, True),
    ({**OBJ, "additionalProperties": True}, {**OBJ, "additionalProperties": True}),
    ({**OBJ, "additionalProperties": {"type": "string"}}, {**OBJ, "additionalProperties": {"type": "string"}}),
    ({**OBJ, "unevaluatedProperties": True}, {**OBJ, "unevaluatedProperties": True}),
    ({"patternProperties": {"^x": {}}}, {"patternProperties": {"^x": {}}, "additionalProperties": False}),
    # nested: inside properties, items, definitions and alternatives
    ({"type": "object", "properties": {"p": OBJ}}, {"type": "object", "properties": {"p": CLOSED},
                                                    "additionalProperties": False}),
    ({"type": "array", "items": OBJ}, {"type": "array", "items": CLOSED}),
    ({"$defs": {"T": OBJ}, "$ref": "#/$defs/T"}, {"$defs": {"T": CLOSED}, "$ref": "#/$defs/T"}),
    ({"anyOf": [OBJ, {"type": "null"}]}, {"anyOf": [CLOSED, {"type": "null"}]}),
    # tuples: no items past prefixItems unless said
    ({"prefixItems": [{"type": "integer"}]}, {"prefixItems": [{"type": "integer"}], "items": False}),
    ({"prefixItems": [{"type": "integer"}], "items": {"type": "string"}},
     {"prefixItems": [{"type": "integer"}], "items": {"type": "string"}}),
    # one object in parts stays open at the top: allOf members (and their $ref targets), a
    # schema with properties beside alternatives or a $ref, then / else
    ({"allOf": [OBJ, {"properties": {"b": OBJ}}]},
     {"allOf": [OBJ, {"properties": {"b": CLOSED}}]}),
    ({"$defs": {"Base": OBJ}, "allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"b": {}}}]},
     {"$defs": {"Base": OBJ}, "allOf": [{"$ref": "#/$defs/Base"}, {"properties": {"b": {}}}]}),
    ({**OBJ, "anyOf": [{"properties": {"b": {}}}, {"properties": {"c": {}}}]},
     {**OBJ, "anyOf": [{"properties": {"b": {}}}, {"properties": {"c": {}}}]}),
    ({**OBJ, "if": OBJ, "then": {"properties": {"b": {}}}},
     {**OBJ, "if": OBJ, "then": {"properties": {"b": {}}}}),
    # tests of the instance stay as written
    ({"not": OBJ}, {"not": OBJ}),
])
def test_closed_schema_closes_what_says_nothing_of_more(schema, want):
    before = json.dumps(schema)
    assert closed_schema(schema) == want
    assert json.dumps(schema) == before  # the client's schema is untouched
