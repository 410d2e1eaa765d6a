"""Reasoning parsers (vLLM's --reasoning-parser): a thinking model's answer split into its
reasoning (between <think> and </think>) and its content, whole or as a stream. Pure.

    deepseek_r1  DeepSeek-R1 and its distills: the chat template opens <think> in the prompt, so
                 the output is reasoning until </think> (a leading <think> is dropped too); an
                 answer cut short before </think> is all reasoning.
    qwen3        Qwen3: reasoning only where the output opens with <think> (enable_thinking: false
                 renders an empty think block in the prompt and the output is all content). A
                 template that opens <think> in the prompt itself (Qwen3's Thinking-2507) wants
                 deepseek_r1.
"""
from __future__ import annotations

from dataclasses import dataclass

START, END = "<think>", "</think>"
PARSERS = ("deepseek_r1", "qwen3")


def _held(text: str, tag: str) -> int:
    """How many characters at the end of `text` could begin `tag` (held back while streaming)."""
    for n in range(min(len(tag) - 1, len(text)), 0, -1):
        if text.endswith(tag[:n]):
            return n
    return 0


def split(parser: str, text: str, final: bool = True) -> tuple[str, str]:
    """(reasoning, content) of the text so far. Not final (a stream): characters that may still
    turn out to be a tag are in neither, so that each part only grows as text arrives."""
    if START.startswith(text) and not final:
        return "", ""  # "<thi": a start tag, or not, is not known yet
    opened = text.startswith(START)
    if parser == "qwen3" and not opened:
        return "", text
    body = text[len(START):] if opened else text
    at = body.find(END)
    if at >= 0:
        return body[:at], body[at + len(END):]
    keep = 0 if final else _held(body, END)
    return body[:len(body) - keep], ""


@dataclass
class ReasoningStream:
    """A choice's stream: push() each text delta, get the (reasoning, content) deltas it releases."""
    parser: str
    text: str = ""
    sent: tuple[int, int] = (0, 0)

    def push(self, delta: str, done: bool = False) -> tuple[str, str]:
        self.text += delta
        reasoning, content = split(self.parser, self.text, final=done)
        r, c = self.sent
        self.sent = (len(reasoning), len(content))
        return reasoning[r:], content[c:]
