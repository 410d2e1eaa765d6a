"""Tool calling for the chat endpoint, as vLLM serves it.

- `tool_choice` "none": the tools reach the chat template, nothing is parsed.
- "auto" (needs `--enable-auto-tool-choice` and a `--tool-call-parser`): the model
  writes calls in its own format and the parser finds them in the text.
- "required" and a named function: the grammar enforces the calls, so the arguments
  always parse against the function's `parameters` schema. "required" generates a JSON
  list of {"name", "parameters"} objects (one item per call), a named function its
  arguments object alone.

Pure: request shapes, the constraint each choice implies, and the parsers (whole text
and streamed, holding back only what may turn out to be a call).
"""
from __future__ import annotations

import ast
import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field

from cpuserve.structured.spec import GrammarSpec, schema_text

PARSERS = ("hermes", "llama3_json", "mistral", "pythonic")


class FunctionDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    name: str = Field(pattern=r"^[a-zA-Z0-9_.-]{1,64}$")
    description: str | None = None
    parameters: dict | None = None
    strict: bool | None = None


class ToolDef(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["function"] = "function"
    function: FunctionDef


class NamedFunction(BaseModel):
    name: str


class NamedToolChoice(BaseModel):
    type: Literal["function"] = "function"
    function: NamedFunction


class ToolError(ValueError):
    def __init__(self, message: str, param: str):
        super().__init__(message)
        self.param = param


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI sends it
    id: str = field(default_factory=lambda: f"chatcmpl-tool-{uuid.uuid4().hex}")

    def as_dict(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def resolve_choice(tools: list[ToolDef] | None, choice, auto_enabled: bool) -> str:
    """'none', 'auto', 'required' or 'function:<name>' (ToolError naming the field otherwise).
    Unset means 'auto' where the server parses calls, 'none' elsewhere (vLLM's default)."""
    if choice is None:
        return "auto" if tools and auto_enabled else "none"
    if isinstance(choice, NamedToolChoice):
        names = {t.function.name for t in tools or ()}
        if choice.function.name not in names:
            raise ToolError(f"tool_choice names {choice.function.name!r}, which is not among tools "
                            f"({', '.join(sorted(names)) or 'none given'})", "tool_choice")
        return f"function:{choice.function.name}"
    if choice != "none" and not tools:
        raise ToolError(f"tool_choice {choice!r} needs tools", "tool_choice")
    if choice == "auto" and not auto_enabled:
        raise ToolError('tool_choice "auto" needs the server started with --enable-auto-tool-choice and '
                        "--tool-call-parser", "tool_choice")
    return choice


def _params(f: FunctionDef) -> dict:
    return f.parameters or {"type": "object", "properties": {}}


def constraint(tools: list[ToolDef] | None, mode: str, parallel: bool = True) -> GrammarSpec | None:
    """The grammar that enforces a 'required' or named choice (one call only unless
    `parallel`, OpenAI's parallel_tool_calls); None for 'none' and 'auto'."""
    if mode.startswith("function:"):
        f = next(t.function for t in tools if t.function.name == mode[9:])
        schema = _params(f)
    elif mode == "required":
        schema = {"type": "array", "minItems": 1, "items": {"anyOf": [
            {"type": "object", "properties": {"name": {"const": t.function.name}, "parameters": _params(t.function)},
             "required": ["name", "parameters"], "additionalProperties": False} for t in tools]}}
        if not parallel:
            schema["maxItems"] = 1
    else:
        return None
    return GrammarSpec("json", schema_text(schema))


def parse_enforced(mode: str, text: str) -> list[ToolCall]:
    """The calls of a grammar-enforced output (complete: the grammar ended it)."""
    if mode.startswith("function:"):
        return [ToolCall(mode[9:], text)]
    return [ToolCall(c["name"], json.dumps(c["parameters"], ensure_ascii=False)) for c in json.loads(text)]


# -- parsers of the formats models write on their own ("auto") -----------------------------
def _call(obj) -> ToolCall | None:
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    args = obj.get("arguments", obj.get("parameters", {}))
    return ToolCall(obj["name"], args if isinstance(args, str) else json.dumps(args, ensure_ascii=False))


class HermesParser:
    """Hermes / Qwen: `<tool_call>{"name": ..., "arguments": {...}}</tool_call>`, after any text."""
    START = "<tool_call>"
    _BLOCK = re.compile(r"<tool_call>\s*(.*?)\s*(?:</tool_call>|$)", re.DOTALL)

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.START not in text:
            return text, []
        calls = []
        for body in self._BLOCK.findall(text):
            try:
                call = _call(json.loads(body))
            except ValueError:
                call = None
            if call is None:
                return text, []  # not what the format promises: the text stays text
            calls.append(call)
        content = text[: text.index(self.START)].rstrip()
        return content or None, calls

    def content_end(self, text: str) -> int:
        return content_before(text, self.START)


def content_before(text: str, tag: str) -> int:
    """How much of a growing text is surely content: up to a call's start tag, or to a tail that
    may become one, less trailing whitespace (the content before a call is sent without it, so
    it is held until the next word shows it is not the end)."""
    end = len(text)
    if tag in text:
        end = text.index(tag)
    else:
        for k in range(min(len(tag) - 1, len(text)), 0, -1):
            if tag.startswith(text[-k:]):
                end = len(text) - k
                break
    return len(text[:end].rstrip())


class Llama3JsonParser:
    """Llama 3.x JSON calls: `{"name": ..., "parameters": {...}}`, optionally after
    `<|python_tag|>`, several separated by `;`. Text that does not start so is content."""
    TAG = "<|python_tag|>"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip()
        if body.startswith(self.TAG):
            body = body[len(self.TAG):].lstrip()
        if not body.startswith("{"):
            return text, []
        calls, dec, i = [], json.JSONDecoder(), 0
        while i < len(body):
            try:
                obj, i = dec.raw_decode(body, i)
            except ValueError:
                return text, []
            call = _call(obj)
            if call is None:
                return text, []
            calls.append(call)
            while i < len(body) and body[i] in "; \n\t\r":
                i += 1
        return None, calls

    def content_end(self, text: str) -> int:
        s = text.lstrip()
        if not s or s.startswith("{") or s.startswith(self.TAG) or self.TAG.startswith(s):
            return 0  # may be a call: hold it all until the end
        return len(text)


class MistralParser:
    """Mistral: `[TOOL_CALLS]` and a JSON list of {"name", "arguments"} (v3 tokenizers), or
    `[TOOL_CALLS]name[ARGS]{...}` for each call (v11 tokenizers and later), after any text."""
    TAG, ARGS = "[TOOL_CALLS]", "[ARGS]"

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        if self.TAG not in text:
            return text, []
        at = text.index(self.TAG)
        calls: list[ToolCall] = []
        for part in text[at + len(self.TAG):].split(self.TAG):
            got = self._calls(part.strip())
            if got is None:
                return text, []  # not what the format promises: the text stays text
            calls += got
        return text[:at].rstrip() or None, calls

    def _calls(self, part: str) -> list[ToolCall] | None:
        dec = json.JSONDecoder()
        try:
            if part.startswith("["):
                objs, end = dec.raw_decode(part)
                calls = [_call(o) for o in objs] if isinstance(objs, list) else [None]
            else:
                name, sep, rest = part.partition(self.ARGS)
                args, end = dec.raw_decode(rest.strip())
                part = rest.strip()
                calls = [_call({"name": name.strip(), "arguments": args})] if sep and name.strip() else [None]
        except ValueError:
            return None
        return None if part[end:].strip() or None in calls else calls

    def content_end(self, text: str) -> int:
        return content_before(text, self.TAG)


class PythonicParser:
    """Llama 3.2 and Llama 4 pythonic calls: the whole answer a Python list of calls with keyword
    arguments of literal values, `[get_weather(city="Oslo"), get_time()]`, optionally between
    `<|python_start|>` and `<|python_end|>`. Anything else is content."""
    TAGS = ("<|python_start|>", "<|python_end|>")

    def extract(self, text: str) -> tuple[str | None, list[ToolCall]]:
        body = text.strip().removeprefix(self.TAGS[0]).removesuffix(self.TAGS[1]).strip()
        if not (body.startswith("[") and body.endswith("]")):
            return text, []
        try:
            tree = ast.parse(body, mode="eval").body
            calls = [self._call(node) for node in tree.elts] if isinstance(tree, ast.List) and tree.elts else [None]
        except (SyntaxError, ValueError, RecursionError):
            return text, []
        return (None, calls) if None not in calls else (text, [])

    @staticmethod
    def _call(node) -> ToolCall | None:
        if not isinstance(node, ast.Call) or node.args or not isinstance(node.func, (ast.Name, ast.Attribute)):
            return None
        if any(kw.arg is None for kw in node.keywords):  # **kwargs
            return None
        args = {kw.arg: ast.literal_eval(kw.value) for kw in node.keywords}  # ValueError: not a literal
        return ToolCall(ast.unparse(node.func), json.dumps(args, ensure_ascii=False))

    def content_end(self, text: str) -> int:
        s = text.lstrip()
        if not s or s.startswith("[") or s.startswith(self.TAGS[0]) or self.TAGS[0].startswith(s):
            return 0  # may be a call: hold it all until the end
        return len(text)


def make_parser(name: str):
    return {"hermes": HermesParser, "llama3_json": Llama3JsonParser, "mistral": MistralParser,
            "pythonic": PythonicParser}[name]()


class ToolStream:
    """One choice's streamed text turned into content deltas and tool-call deltas: text
    that may be a call is held back; calls are sent whole once the output is complete,
    except a named function's arguments, which stream as they are generated."""

    def __init__(self, mode: str, parser=None):
        self.mode, self.parser = mode, parser
        self.text, self.sent = "", 0
        self.calls: list[ToolCall] = []
        self._named: ToolCall | None = ToolCall(mode[9:], "") if mode.startswith("function:") else None

    def push(self, delta: str, done: bool) -> tuple[str, list[dict]]:
        """(content delta, tool-call deltas) after this piece of text."""
        self.text += delta
        if self._named is not None:
            return self._push_named(delta)
        if self.mode == "required":
            if done:
                self.calls = parse_enforced(self.mode, self.text)
            return "", self._call_deltas() if done else []
        if self.mode != "auto" or self.parser is None:
            return delta, []
        if not done:
            end = self.parser.content_end(self.text)
            out, self.sent = self.text[self.sent:end], max(self.sent, end)
            return out, []
        content, self.calls = self.parser.extract(self.text)
        rest = (content or "")[self.sent:] if self.calls else self.text[self.sent:]
        self.sent = len(self.text)
        return rest, self._call_deltas()

    def _push_named(self, delta: str) -> tuple[str, list[dict]]:
        call, first = self._named, not self.calls
        if first:
            self.calls = [call]
        call.arguments += delta
        if first:
            return "", [{"index": 0, **call.as_dict(), "function": {"name": call.name, "arguments": delta}}]
        return "", [{"index": 0, "function": {"arguments": delta}}] if delta else []

    def _call_deltas(self) -> list[dict]:
        return [{"index": i, **c.as_dict()} for i, c in enumerate(self.calls)]
