"""Incremental detokenization and stop strings for one sequence.

Text is produced with the tokenizer's own decode, so it is what a full decode of the
outputs gives, holding back a trailing incomplete UTF-8 character, and searched for stop
strings only in the part that can contain a new match.

Each update decodes a window, not the whole output: the tokens whose text came last (the
context: a decoder strips the leading space of the first token it sees, or reads a byte
sequence from its start, alike in both decodes) and the new ones; the new text is the
window's past the context's. A whole decode per token costs O(length), O(length^2) a
sequence (the default model's tokenizer: 10 us a token over 128 tokens, 282 us over 4,096;
a window: 3-4 us). Where the window's text does not start with the context's (a rule across
the boundary: transformers' clean_up_tokenization taking the context's last space before a
new ".", or a byte-fallback group turned invalid), that token's text comes from a whole
decode. One such change is not seen: byte-fallback tokens whose first bytes went out as
valid text, then an invalid byte in the same group, which a whole decode turns all into
U+FFFD; the text keeps what went out (streamed text only grows).
"""
from __future__ import annotations


class Detokenizer:
    def __init__(self, tokenizer, stop: list[str], skip_special_tokens: bool = True,
                 include_stop_str_in_output: bool = False):
        self.tokenizer = tokenizer
        self.stop = stop
        self.skip_special = skip_special_tokens
        self.include_stop = include_stop_str_in_output
        self.text = ""
        self._max_stop = max((len(s) for s in stop), default=0)
        self._start = 0  # the window's first token: the context begins here
        self._done = 0   # tokens whose text is in self.text

    def update(self, output_ids: list[int], check_stop: bool = True) -> str | None:
        """Decodes the outputs so far; returns the stop string that matched, if any
        (the text is then cut at it)."""
        text = self._decode(output_ids)
        if text is None:  # nothing new, or a multi-byte character not complete yet
            return None
        prev = len(self.text)
        self.text = text
        if not (check_stop and self.stop):
            return None
        start = max(0, prev - self._max_stop + 1)
        best = None
        for s in self.stop:
            i = text.find(s, start)
            if i != -1 and (best is None or i < best[0]):
                best = (i, s)
        if best is None:
            return None
        i, s = best
        self.text = text[: i + len(s)] if self.include_stop else text[:i]
        return s

    def finish(self, output_ids: list[int]) -> None:
        """The whole output's text in one decode, for a request that wants only its final text and
        has no stop strings (the offline LLM's): no window a token. As update, a trailing
        incomplete character is held back (it is never completed now)."""
        decode = self.tokenizer.decode
        for end in range(len(output_ids), max(0, len(output_ids) - 8) - 1, -1):
            text = decode(output_ids[:end], skip_special_tokens=self.skip_special)
            if not text.endswith("\ufffd"):
                break
        self.text = text
        self._start, self._done = 0, len(output_ids)

    def _decode(self, ids: list[int]) -> str | None:
        """The text of all of ids, or None while it ends in an incomplete character or
        when no token is new."""
        n = len(ids)
        if n == self._done:
            return None
        if n < self._done:
            return self._decode_whole(ids)
        decode = self.tokenizer.decode
        context = decode(ids[self._start:self._done], skip_special_tokens=self.skip_special)
        window = decode(ids[self._start:], skip_special_tokens=self.skip_special)
        if window.endswith("\ufffd"):
            return None
        if not window.startswith(context):
            return self._decode_whole(ids)
        new = window[len(context):]
        if new:  # these tokens are the next window's context; tokens with no text (skipped special
            self._start = self._done  # ones) would be none: a decoder reads the first token it sees alike
        self._done = n
        return self.text + new

    def _decode_whole(self, ids: list[int]) -> str | None:
        text = self.tokenizer.decode(ids, skip_special_tokens=self.skip_special)
        if text.endswith("\ufffd"):
            return None
        self._start, self._done = 0, len(ids)  # the next window's context: all of ids
        return text
