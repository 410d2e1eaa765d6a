"""OpenAI request and response shapes (the subset cpuserve serves) and their
translation to SamplingParams. Unknown fields are ignored, with a warning in the server's log
naming them (as vLLM does: a client's extra that this server does not know must not pass
unnoticed); invalid values become a 400 with the offending parameter named."""
from __future__ import annotations

import json
import logging
import time
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, model_validator

from cpuserve.core.sampling_params import SamplingParams
from cpuserve.entrypoints.openai.streaming import StreamUsage
from cpuserve.entrypoints.openai.tools import FunctionDef, NamedFunction, NamedToolChoice, ToolDef
from cpuserve.core.generation_config import SamplingDefaults
from cpuserve.structured.spec import GrammarSpec, SpecError, from_fields, from_response_format

log = logging.getLogger("cpuserve.api")

MAX_TOOLS = 128


class StreamOptions(BaseModel):
    include_usage: bool = False
    continuous_usage_stats: bool = False  # vLLM's: with include_usage, every chunk carries the usage so far


def lone_surrogate(value) -> str | None:
    """The path of the first string holding a lone UTF-16 surrogate (JSON allows the
    escape "\\ud800"; no tokenizer or UTF-8 response can carry it), or None."""
    stack = [("", value)]
    while stack:
        path, v = stack.pop()
        if isinstance(v, str):
            try:
                v.encode("utf-8")  # fails exactly on surrogates, at C speed
            except UnicodeEncodeError:
                return path or "body"
        elif isinstance(v, dict):
            stack.extend((f"{path}.{k}" if path else str(k), x) for k, x in v.items())
        elif isinstance(v, list):
            stack.extend((f"{path}[{i}]", x) for i, x in enumerate(v))
    return None


class RequestBody(BaseModel):
    """Every request body: unknown fields ignored (and logged), text that is valid Unicode."""
    model_config = ConfigDict(extra="ignore")

    @model_validator(mode="before")
    @classmethod
    def no_lone_surrogates(cls, data):
        where = lone_surrogate(data)
        if where is not None:
            raise ValueError(f"{where} holds a lone UTF-16 surrogate, which is not valid Unicode text")
        if isinstance(data, dict):
            unknown = sorted(k for k in data if k not in cls.model_fields)
            if unknown:
                log.warning("%s: ignored the request's fields %s (not served here)", cls.__name__, ", ".join(unknown))
        return data


class SamplingFields(RequestBody):
    """Fields both endpoints share (OpenAI's plus vLLM's extras)."""

    model: str | None = None
    n: int = Field(1, ge=1, le=128)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    top_k: int | None = Field(None, ge=-1)
    min_p: float | None = Field(None, ge=0, le=1)
    seed: int | None = Field(None, ge=-(2 ** 63), lt=2 ** 63)
    stop: str | list[str] | None = None
    stop_token_ids: list[int] | None = None
    presence_penalty: float | None = Field(None, ge=-2, le=2)
    frequency_penalty: float | None = Field(None, ge=-2, le=2)
    repetition_penalty: float | None = Field(None, gt=0, le=10)
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[int] | None = None   # vLLM's: only these may be sampled
    truncate_prompt_tokens: int | None = Field(None, ge=-1)  # vLLM's: the prompt's last k tokens (-1: max_model_len)
    prompt_logprobs: int | None = Field(None, ge=0)  # vLLM's: each prompt token's logprob and the top k
    # vLLM's, not served here: a 400 when asked for, never an answer that ignored them
    use_beam_search: bool = False
    bad_words: list[str] | None = None
    ignore_eos: bool = False
    min_tokens: int = Field(0, ge=0)
    stream: bool = False
    stream_options: StreamOptions | None = None
    include_stop_str_in_output: bool = False
    skip_special_tokens: bool = True
    # vLLM's: logprobs name tokens "token_id:{id}", not their text (None: --return-tokens-as-token-ids)
    return_tokens_as_token_ids: bool | None = None
    user: str | None = None
    # structured output: OpenAI's response_format, vLLM's guided_* extras and structured_outputs
    response_format: dict | None = None
    guided_json: dict | str | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    guided_decoding_backend: str | None = None  # accepted as vLLM does; the one backend is llguidance
    guided_whitespace_pattern: str | None = None
    structured_outputs: dict | None = None

    def constraint(self) -> GrammarSpec | None:
        """The request's output constraint (SpecError, a ValueError naming the field, when malformed)."""
        return from_fields(self.response_format, self.structured_outputs, self.guided_json, self.guided_regex,
                           self.guided_choice, self.guided_grammar, self.guided_whitespace_pattern)

    def sampling_params(self, max_tokens: int | None, logprobs: int | None,
                        structured: GrammarSpec | None = None, prompt_logprobs: int | None = None,
                        defaults: SamplingDefaults = SamplingDefaults()) -> SamplingParams:
        """The engine's parameters, the fields the request leaves out from `defaults` (the model's
        generation config) and max_tokens under its cap; prompt_logprobs: the top N an endpoint needs
        of the prompt besides the request's own prompt_logprobs (completions' echo with logprobs),
        the larger taken."""
        if self.prompt_logprobs is not None:
            if self.stream:  # as vLLM: they would come only with the last chunk
                raise ValueError("prompt_logprobs is not available with stream=true")
            prompt_logprobs = max(self.prompt_logprobs, prompt_logprobs or 0)
        if self.use_beam_search:
            raise ValueError("use_beam_search is not supported: this server samples (greedy with temperature 0)")
        if self.bad_words:
            raise ValueError("bad_words is not supported (logit_bias bans single tokens)")
        bias = None
        if self.logit_bias:
            try:
                bias = {int(k): float(v) for k, v in self.logit_bias.items()}
            except ValueError:
                raise ValueError("logit_bias keys must be token ids") from None
        d = defaults
        return SamplingParams(
            n=self.n, temperature=d.temperature if self.temperature is None else self.temperature,
            top_p=d.top_p if self.top_p is None else self.top_p,
            top_k=d.top_k if self.top_k is None else (-1 if self.top_k == 0 else self.top_k),
            min_p=d.min_p if self.min_p is None else self.min_p, seed=self.seed,
            presence_penalty=self.presence_penalty or 0.0, frequency_penalty=self.frequency_penalty or 0.0,
            repetition_penalty=d.repetition_penalty if self.repetition_penalty is None else self.repetition_penalty,
            max_tokens=d.cap(max_tokens), min_tokens=self.min_tokens, stop=self.stop, stop_token_ids=self.stop_token_ids,
            ignore_eos=self.ignore_eos, logprobs=logprobs, prompt_logprobs=prompt_logprobs, logit_bias=bias,
            allowed_token_ids=self.allowed_token_ids,
            include_stop_str_in_output=self.include_stop_str_in_output, skip_special_tokens=self.skip_special_tokens,
            structured=structured)

    def stream_usage(self, forced: bool = False) -> StreamUsage:
        """Where a stream reports its usage: stream_options' include_usage (a last chunk), and
        vLLM's continuous_usage_stats (every chunk too: only with include_usage, as in vLLM);
        forced (--enable-force-include-usage): a last chunk whatever the request says."""
        o = self.stream_options or StreamOptions()
        return StreamUsage(o.include_usage or forced, (o.include_usage or forced) and o.continuous_usage_stats)


class CompletionRequest(SamplingFields):
    prompt: str | list[str] | list[int] | list[list[int]]
    max_tokens: int | None = Field(16, ge=0)  # 0: only with echo (the prompt and its logprobs back)
    logprobs: int | None = Field(None, ge=0)  # at most --max-logprobs (20)
    echo: bool = False  # the prompt before each choice's text, its logprobs before the choice's
    suffix: str | None = None
    best_of: int | None = None


class ContentPart(BaseModel):
    type: Literal["text"]
    text: str


class ToolCallFunction(BaseModel):
    name: str
    arguments: str


class ToolCallItem(BaseModel):
    model_config = ConfigDict(extra="ignore")
    id: str
    type: Literal["function"] = "function"
    function: ToolCallFunction


class ChatMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[ContentPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallItem] | None = None  # an assistant turn that called tools
    tool_call_id: str | None = None                # a tool's answer: which call it answers

    def as_template_dict(self) -> dict:
        content = self.content
        if isinstance(content, list):
            content = "".join(p.text for p in content)
        out = {"role": "system" if self.role == "developer" else self.role, "content": content or ""}
        if self.tool_calls:  # templates index the arguments as a mapping (as vLLM hands them over)
            out["tool_calls"] = [{"id": c.id, "type": "function", "function": {
                "name": c.function.name, "arguments": _arguments(c.function.arguments)}} for c in self.tool_calls]
        if self.tool_call_id is not None:
            out["tool_call_id"] = self.tool_call_id
        if self.name is not None:
            out["name"] = self.name
        return out


def _arguments(text: str):
    try:
        value = json.loads(text)
    except ValueError:
        return text
    return value if isinstance(value, dict) else text


# the variables a chat template gets from the server, which chat_template_kwargs may not replace
TEMPLATE_VARIABLES = frozenset({"messages", "add_generation_prompt", "continue_final_message", "tools", "bos_token",
                                "eos_token", "pad_token", "unk_token"})


class ChatTemplateFields(RequestBody):
    """How a conversation is rendered (vLLM's fields): the generation prompt after it, or its last
    (assistant) message left open to be continued; further variables for the template (e.g.
    `enable_thinking`)."""
    add_generation_prompt: bool = True
    continue_final_message: bool = False
    chat_template_kwargs: dict[str, Any] | None = None

    def render(self, tok, messages: list[dict], chat_template: str | None = None, **extra) -> str:
        """The conversation's text; ValueError (the client's mistake) when the fields conflict or the
        template fails."""
        kwargs = dict(self.chat_template_kwargs or {})
        clash = sorted(TEMPLATE_VARIABLES & kwargs.keys())
        if clash:
            raise ValueError(f"chat_template_kwargs may not set {', '.join(clash)} (the request's own fields do)")
        return tok.apply_chat_template(messages, add_generation_prompt=self.add_generation_prompt,
                                       chat_template=chat_template,
                                       continue_final_message=self.continue_final_message, **extra, **kwargs)


class ChatCompletionRequest(SamplingFields, ChatTemplateFields):
    messages: list[ChatMessage] = Field(min_length=1)
    max_tokens: int | None = Field(None, ge=1)
    max_completion_tokens: int | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0)  # at most --max-logprobs (20)
    chat_template: str | None = None
    tools: list[ToolDef] | None = Field(None, max_length=MAX_TOOLS)
    tool_choice: Literal["none", "auto", "required"] | NamedToolChoice | None = None
    parallel_tool_calls: bool | None = None
    echo: bool = False  # vLLM's: the last message's content before the answer, where it is the answer's role

    @property
    def echoed(self) -> str:
        """What echo puts before the answer (vLLM's rule): the last message's text where its role is the
        answer's: an assistant turn being continued, or any last turn without a generation prompt."""
        if not self.echo:
            return ""
        last = self.messages[-1]
        role = "assistant" if self.add_generation_prompt else last.role
        return (last.as_template_dict()["content"] or "") if last.role == role else ""


class InputText(BaseModel):
    """A text part of a Responses API input message (input_text, or an earlier answer's output_text)."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(BaseModel):
    model_config = ConfigDict(extra="ignore")
    type: Literal["message"] = "message"
    role: Literal["system", "developer", "user", "assistant"]
    content: str | list[InputText]


class FunctionCallInput(BaseModel):
    """An earlier answer's function call, sent back in a Responses API input."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call"]
    call_id: str
    name: str
    arguments: str


class FunctionCallOutput(BaseModel):
    """The result of a function call, for the model to read (a chat `tool` message)."""
    model_config = ConfigDict(extra="ignore")
    type: Literal["function_call_output"]
    call_id: str
    output: str


class ResponsesRequest(ChatTemplateFields):
    """OpenAI's Responses API (POST /v1/responses), stateless: the conversation comes whole in
    `input` (a string: one user message; or messages, function calls and their outputs) after
    `instructions` (a system message); `text.format` constrains the answer as chat's
    response_format does (its json_schema flattened); function `tools` are chat's, in the
    Responses shape. What this server does not serve is a 400 naming it: stored responses
    (previous_response_id), tools of other types (web search, files, MCP), background runs."""
    model: str | None = None
    input: str | list[InputMessage | FunctionCallInput | FunctionCallOutput]
    instructions: str | None = None
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0, le=2)
    top_p: float | None = Field(None, gt=0, le=1)
    stream: bool = False
    text: dict | None = None
    store: bool | None = None  # accepted; nothing is stored, so the answer says store: false
    previous_response_id: str | None = None
    background: bool = False
    tools: list[dict] | None = None
    tool_choice: Any = None
    parallel_tool_calls: bool | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    reasoning: dict | None = None  # accepted, as OpenAI's models without reasoning do
    truncation: Literal["auto", "disabled"] | None = None
    chat_template: str | None = None  # vLLM's: a template of the request's own

    def unserved(self) -> tuple[str, str] | None:
        """(message, field) for what the request asks that this server does not serve, else None."""
        if self.previous_response_id is not None:
            return ("this server stores no responses: send the whole conversation as input",
                    "previous_response_id")
        if self.background:
            return "background responses are not served here", "background"
        other = sorted({str(t.get("type")) for t in self.tools or () if t.get("type") != "function"})
        if other:
            return f"only function tools are served here, not {', '.join(other)}", "tools"
        if isinstance(self.input, list) and not self.input:
            return "input must be a string or at least one message", "input"
        return None

    @property
    def messages(self) -> list[ChatMessage]:
        """The conversation for the chat template: instructions first, as the system message; a run
        of function calls as one assistant turn with tool_calls, each output as a tool message."""
        turns = [InputMessage(role="user", content=self.input)] if isinstance(self.input, str) else self.input
        out = [ChatMessage(role="system", content=self.instructions)] if self.instructions is not None else []
        for t in turns:
            if isinstance(t, FunctionCallInput):
                call = ToolCallItem(id=t.call_id, function=ToolCallFunction(name=t.name, arguments=t.arguments))
                if out and out[-1].role == "assistant" and out[-1].tool_calls:
                    out[-1].tool_calls.append(call)
                else:
                    out.append(ChatMessage(role="assistant", content=None, tool_calls=[call]))
            elif isinstance(t, FunctionCallOutput):
                out.append(ChatMessage(role="tool", content=t.output, tool_call_id=t.call_id))
            else:
                out.append(ChatMessage(role=t.role, content=t.content if isinstance(t.content, str)
                                       else "".join(p.text for p in t.content)))
        return out

    def chat_tools(self) -> list[ToolDef] | None:
        """The function tools in chat's shape (a ValueError for a malformed one)."""
        return [ToolDef(function=FunctionDef(**{k: v for k, v in t.items() if k != "type"}))
                for t in self.tools or ()] or None

    def chat_tool_choice(self) -> str | NamedToolChoice | None:
        """tool_choice in chat's shape (a ValueError for a malformed one)."""
        choice = self.tool_choice
        if isinstance(choice, dict):
            if choice.get("type") != "function" or not isinstance(choice.get("name"), str):
                raise ValueError('tool_choice is "none", "auto", "required" or {"type": "function", "name": ...}')
            choice = NamedToolChoice(function=NamedFunction(name=choice["name"]))
        elif choice not in (None, "none", "auto", "required"):
            raise ValueError('tool_choice is "none", "auto", "required" or {"type": "function", "name": ...}')
        return choice

    @property
    def format(self) -> dict:
        return (self.text or {}).get("format") or {"type": "text"}

    def sampling_params(self, room: int, structured: GrammarSpec | None,
                        defaults: SamplingDefaults = SamplingDefaults()) -> SamplingParams:
        """The engine's parameters: max_output_tokens (else the context's room) under the defaults'
        cap, temperature and top_p from the defaults where the request leaves them out."""
        d = defaults
        return SamplingParams(temperature=d.temperature if self.temperature is None else self.temperature,
                              top_p=d.top_p if self.top_p is None else self.top_p, top_k=d.top_k, min_p=d.min_p,
                              repetition_penalty=d.repetition_penalty,
                              max_tokens=d.cap(self.max_output_tokens or room), structured=structured)

    def constraint(self) -> GrammarSpec | None:
        """text.format as chat's response_format (its json_schema's name, schema and strict flattened)."""
        fmt = self.format
        if isinstance(fmt, dict) and fmt.get("type") == "json_schema":
            if fmt.get("schema") is None:
                raise SpecError("text.format.schema is missing (a json_schema format holds name and schema)",
                                "text.format")
            fmt = {"type": "json_schema", "json_schema": {k: v for k, v in fmt.items() if k != "type"}}
        return from_response_format(fmt, "text.format")


class TokenizeRequest(ChatTemplateFields):
    model: str | None = None
    prompt: str | None = None
    messages: list[ChatMessage] | None = None
    add_special_tokens: bool = True
    return_token_strs: bool = False  # vLLM's: each token's own text (token_strs) beside the ids


class DetokenizeRequest(RequestBody):
    model: str | None = None
    tokens: list[int]


def usage(prompt_tokens: int, completion_tokens: int, cached_tokens: int | None = None) -> dict:
    """OpenAI's usage object; cached_tokens (the prompt's tokens the prefix cache held) as its
    prompt_tokens_details where given (--enable-prompt-tokens-details)."""
    out = {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
           "total_tokens": prompt_tokens + completion_tokens}
    if cached_tokens is not None:
        out["prompt_tokens_details"] = {"cached_tokens": cached_tokens}
    return out


def now() -> int:
    return int(time.time())
