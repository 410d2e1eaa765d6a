"""What a request constrains its output to, from the fields OpenAI and vLLM name it by.

Pure: no grammar engine here. `from_fields` reads OpenAI's `response_format`
(`json_object`, `json_schema`), vLLM's `guided_json` / `guided_regex` /
`guided_choice` / `guided_grammar` extras and its newer `structured_outputs`
object, and returns at most one `GrammarSpec`; two constraints at once, or one of
the wrong shape, is a ValueError that names the field (the server's 400).
"""
from __future__ import annotations

import json
from dataclasses import dataclass

# Bounds of one constraint, named in the 400 a larger one gets (the grammar engine's
# own limits guard the compiled size; these keep a request body from carrying megabytes).
MAX_SPEC_CHARS = 64 * 1024
MAX_CHOICES = 1024

KINDS = ("json", "json_object", "regex", "choice", "grammar")


@dataclass(frozen=True)
class GrammarSpec:
    """One constraint. `text` is canonical: a schema as sorted JSON, choices as a JSON list.
    `whitespace` (JSON kinds only) is the regex of whitespace allowed between tokens; None
    lays the document out on one line. `after_reasoning`: a reasoning parser's name
    (entrypoints/openai/reasoning.py): the constraint holds from the end of the model's
    reasoning on, which is free (as vLLM starts structured output after it)."""
    kind: str
    text: str
    whitespace: str | None = None
    after_reasoning: str | None = None

    def __post_init__(self):
        if self.kind not in KINDS:
            raise ValueError(f"unknown structured output kind {self.kind!r}")


class SpecError(ValueError):
    """A constraint the client got wrong; `param` names the request field."""

    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


def schema_text(schema) -> str:
    """A JSON schema as the grammar engine's text, its keys in the order the client wrote them: the
    grammar generates an object's properties in its schema's order (as xgrammar and llguidance do
    for vLLM), so that a schema listing `reasoning` before `answer` gets the reasoning first."""
    return json.dumps(schema, separators=(",", ":"))


# JSON Schema's keywords whose values are subschemas (closed_schema): the shape of a value inside
# the instance (one schema, a map of them, a list of them), the same instance again (conjuncts:
# each may name only part of its properties), or a test of it (left as written).
_INSIDE = ("additionalProperties", "unevaluatedProperties", "items", "unevaluatedItems")
_INSIDE_MAPS = ("properties", "patternProperties", "$defs", "definitions")
_CONJUNCTS = ("then", "else")
_ALTERNATIVES = ("anyOf", "oneOf")


def closed_schema(schema):
    """The schema as vLLM's default grammar engine reads it (xgrammar's strict mode): an object
    schema that lists `properties` (or `patternProperties`) and says nothing of others gets no
    others (`additionalProperties: false`), and a tuple (`prefixItems`) with nothing said of
    later items no more items (`items: false`). By JSON Schema's letter both are open, and a
    grammar engine that allows them lets a small model add keys a schema never named: a tool
    call's arguments with a parameter the function does not take (seen: `{"city": "Paris",
    "location": "Paris"}`). A schema that says `additionalProperties`, `items` or
    `unevaluated...` keeps its word, and what may describe one object in parts stays open at its
    top: `allOf` members and the definitions they refer to, `then` / `else` /
    `dependentSchemas`, and a schema with properties beside any of those or `anyOf` / `oneOf` /
    `$ref` (and those alternatives). Tests (`if`, `not`, `contains`, `propertyNames`) stay as written.
    Pure: returns a new schema, the argument untouched."""
    shared: set[str] = set()
    _shared_refs(schema, shared)
    return _closed(schema, shared, open_top=False)


def _shared_refs(s, shared: set) -> None:
    """Collects the `$ref`s that are members of an `allOf` (their targets stay open at the top)."""
    if isinstance(s, list):
        for x in s:
            _shared_refs(x, shared)
    elif isinstance(s, dict):
        members = s.get("allOf")
        for m in members if isinstance(members, list) else []:
            if isinstance(m, dict) and isinstance(m.get("$ref"), str):
                shared.add(m["$ref"])
        for v in s.values():
            _shared_refs(v, shared)


def _closed(s, shared: set, open_top: bool):
    if not isinstance(s, dict):
        return s
    out = dict(s)
    parts = "properties" in out or "patternProperties" in out
    in_parts = parts and any(k in out for k in ("anyOf", "oneOf", "allOf", "$ref", "then", "else", "dependentSchemas"))
    for k in _INSIDE:
        v = out.get(k)
        if isinstance(v, dict):
            out[k] = _closed(v, shared, False)
        elif isinstance(v, list):  # draft 7's tuple `items`
            out[k] = [_closed(x, shared, False) for x in v]
    for k in _INSIDE_MAPS:
        if isinstance(out.get(k), dict):
            out[k] = {name: _closed(v, shared, f"#/{k}/{name}" in shared) for name, v in out[k].items()}
    if isinstance(out.get("prefixItems"), list):
        out["prefixItems"] = [_closed(x, shared, False) for x in out["prefixItems"]]
    for k in _ALTERNATIVES:
        if isinstance(out.get(k), list):
            out[k] = [_closed(x, shared, in_parts) for x in out[k]]
    if isinstance(out.get("allOf"), list):
        out["allOf"] = [_closed(x, shared, True) for x in out["allOf"]]
    for k in _CONJUNCTS:
        if isinstance(out.get(k), dict):
            out[k] = _closed(out[k], shared, True)
    if isinstance(out.get("dependentSchemas"), dict):
        out["dependentSchemas"] = {name: _closed(v, shared, True) for name, v in out["dependentSchemas"].items()}
    if open_top or in_parts:
        return out
    if parts and not ("additionalProperties" in out or "unevaluatedProperties" in out):
        out["additionalProperties"] = False
    if "prefixItems" in out and not ("items" in out or "unevaluatedItems" in out):
        out["items"] = False
    return out


def _schema_text(schema, param: str) -> str:
    if isinstance(schema, str):
        try:
            schema = json.loads(schema)
        except ValueError as e:
            raise SpecError(f"{param} is not valid JSON: {e}", param) from None
    if not isinstance(schema, (dict, bool)):
        raise SpecError(f"{param} must be a JSON schema (an object), got {type(schema).__name__}", param)
    return schema_text(schema)


def _checked(spec: GrammarSpec, param: str) -> GrammarSpec:
    if len(spec.text) > MAX_SPEC_CHARS:
        raise SpecError(f"{param} may be at most {MAX_SPEC_CHARS} characters, got {len(spec.text)}", param)
    return spec


def _choice(choices, param: str) -> GrammarSpec:
    if not isinstance(choices, list) or not choices or not all(isinstance(c, str) and c for c in choices):
        raise SpecError(f"{param} must be a non-empty list of non-empty strings", param)
    if len(choices) > MAX_CHOICES:
        raise SpecError(f"{param} may hold at most {MAX_CHOICES} choices, got {len(choices)}", param)
    return GrammarSpec("choice", json.dumps(choices))


def _text(value, param: str) -> str:
    if not isinstance(value, str) or not value:
        raise SpecError(f"{param} must be a non-empty string", param)
    return value


def from_response_format(fmt: dict | None, param: str = "response_format") -> GrammarSpec | None:
    """OpenAI's response_format: text (no constraint), json_object, json_schema."""
    if fmt is None:
        return None
    kind = fmt.get("type") if isinstance(fmt, dict) else None
    if kind in (None, "text"):
        return None
    if kind == "json_object":
        return GrammarSpec("json_object", "")
    if kind == "json_schema":
        js = fmt.get("json_schema")
        if not isinstance(js, dict):
            raise SpecError("response_format.json_schema must be an object holding `name` and `schema`", param)
        schema = js.get("schema", js.get("json_schema"))
        if schema is None:
            raise SpecError("response_format.json_schema.schema is missing", param)
        return GrammarSpec("json", _schema_text(schema, f"{param}.json_schema.schema"))
    raise SpecError(f"response_format type must be one of text, json_object, json_schema; got {kind!r}", param)


def from_structured_outputs(so: dict | None) -> GrammarSpec | None:
    """vLLM's `structured_outputs` object: exactly one of json, regex, choice, grammar, json_object."""
    if not so:
        return None
    if not isinstance(so, dict):
        raise SpecError("structured_outputs must be an object", "structured_outputs")
    given = {k: v for k, v in so.items() if k in ("json", "regex", "choice", "grammar", "json_object")
             and v not in (None, False)}
    if len(given) != 1:
        raise SpecError("structured_outputs must set exactly one of json, regex, choice, grammar, json_object; "
                        f"got {sorted(given) or 'none'}", "structured_outputs")
    (key, value), = given.items()
    return _one(key, value, f"structured_outputs.{key}")


def _one(key: str, value, param: str) -> GrammarSpec:
    if key == "json":
        return GrammarSpec("json", _schema_text(value, param))
    if key == "json_object":
        return GrammarSpec("json_object", "")
    if key == "choice":
        return _choice(value, param)
    return GrammarSpec(key, _text(value, param))


def from_fields(response_format: dict | None = None, structured_outputs: dict | None = None,
                guided_json=None, guided_regex: str | None = None, guided_choice: list | None = None,
                guided_grammar: str | None = None, whitespace_pattern: str | None = None) -> GrammarSpec | None:
    """The one constraint of a request, or None; more than one is the client's error."""
    spec = _from_fields(response_format, structured_outputs, guided_json, guided_regex, guided_choice,
                        guided_grammar)
    if whitespace_pattern is not None:
        if spec is None or spec.kind not in ("json", "json_object"):
            raise SpecError("guided_whitespace_pattern applies to JSON constraints only", "guided_whitespace_pattern")
        spec = GrammarSpec(spec.kind, spec.text, _text(whitespace_pattern, "guided_whitespace_pattern"))
    return spec


def _from_fields(response_format, structured_outputs, guided_json, guided_regex, guided_choice,
                 guided_grammar) -> GrammarSpec | None:
    found: list[tuple[str, GrammarSpec]] = []
    for param, spec in (("response_format", lambda: from_response_format(response_format)),
                        ("structured_outputs", lambda: from_structured_outputs(structured_outputs)),
                        ("guided_json", lambda: guided_json is not None and _one("json", guided_json, "guided_json")),
                        ("guided_regex", lambda: guided_regex is not None and _one("regex", guided_regex,
                                                                                    "guided_regex")),
                        ("guided_choice", lambda: guided_choice is not None and _choice(guided_choice,
                                                                                         "guided_choice")),
                        ("guided_grammar", lambda: guided_grammar is not None and _one("grammar", guided_grammar,
                                                                                        "guided_grammar"))):
        s = spec()
        if s:
            found.append((param, _checked(s, param)))
    if len(found) > 1:
        names = ", ".join(p for p, _ in found)
        raise SpecError(f"a request may carry one output constraint; got {names}", found[1][0])
    return found[0][1] if found else None
