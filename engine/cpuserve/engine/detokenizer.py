"""Incremental detokenization and stop strings for one sequence.

Text is produced from the token ids with the tokenizer's own decode (so it is
exactly what a full decode gives), holding back a trailing incomplete UTF-8
character, and searched for stop strings only in the part that can contain a
new match.
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

    def update(self, output_ids: list[int], check_stop: bool = True) -> str | None:
        """Decodes the outputs so far; returns the stop string that matched, if any
        (the text is then cut at it)."""
        text = self.tokenizer.decode(output_ids, skip_special_tokens=self.skip_special)
        if text.endswith("\ufffd"):  # a multi-byte character not complete yet
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
