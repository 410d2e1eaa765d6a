"""Server-sent events: merging several engine streams into one, and the text and
token deltas each chunk carries."""
from __future__ import annotations

import asyncio
import json
from dataclasses import dataclass
from typing import AsyncIterator


@dataclass(frozen=True)
class StreamUsage:
    """Where a stream reports its token usage: in a last chunk without choices (`final`), and in
    every chunk with the counts so far (`every_chunk`)."""
    final: bool = False
    every_chunk: bool = False


def sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else json.dumps(obj, ensure_ascii=False)}\n\n"


async def merge(gens: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Runs several async generators concurrently, yielding (which, item)."""
    if len(gens) == 1:
        async for item in gens[0]:
            yield 0, item
        return
    q: asyncio.Queue = asyncio.Queue()
    done = object()

    async def pump(i, g):
        try:
            async for item in g:
                await q.put((i, item))
        except Exception as e:  # noqa: BLE001 - re-raised in the consumer
            await q.put((i, e))
        finally:
            await q.put((i, done))

    tasks = [asyncio.create_task(pump(i, g)) for i, g in enumerate(gens)]
    try:
        left = len(gens)
        while left:
            i, item = await q.get()
            if item is done:
                left -= 1
            elif isinstance(item, Exception):
                raise item
            else:
                yield i, item
    finally:
        for t in tasks:
            t.cancel()
        await asyncio.gather(*tasks, return_exceptions=True)


async def first_then_rest(gens: list[AsyncIterator]) -> AsyncIterator[tuple[int, object]]:
    """Waits for the first item of the merged streams, so that a rejection surfaces
    as a proper status before the 200 of a stream is sent; then yields everything."""
    merged = merge(gens)
    try:
        first = await merged.__anext__()
    except StopAsyncIteration:
        first = None

    async def rest():
        if first is not None:
            yield first
        async for item in merged:
            yield item
    return rest()


class DeltaTracker:
    """What a stream has sent of each completion: yields the new text and token
    range. Until a completion ends, the last len(longest stop) - 1 characters are
    held back, so text later cut by a stop string is never sent."""

    def __init__(self, stop_strings: list[str]):
        self.holdback = max((len(s) for s in stop_strings), default=1) - 1
        self.text: dict[int, int] = {}
        self.tokens: dict[int, int] = {}

    def advance(self, key: int, c) -> tuple[str, int, int, bool] | None:
        """(text delta, first new token, text offset, done), or None when nothing is new."""
        done = c.finish_reason is not None
        sent = self.text.get(key, 0)
        upto = len(c.text) if done else max(sent, len(c.text) - self.holdback)
        t0 = self.tokens.get(key, 0)
        if upto == sent and not done and t0 == len(c.token_ids):
            return None
        self.text[key], self.tokens[key] = upto, len(c.token_ids)
        return c.text[sent:upto], t0, sent, done

    def completion_tokens(self) -> int:
        return sum(self.tokens.values())
