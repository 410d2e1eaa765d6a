"""A request's mailbox keeps only the newest output: a slow reader costs one unread
snapshot, not one per step; an error stays until read, and wins; an unread final
output is never replaced (not even by an error: the request did complete)."""
import asyncio
from types import SimpleNamespace

from cpuserve.engine.async_engine import Mailbox


def test_a_slow_reader_gets_only_the_newest_output():
    async def run():
        box = Mailbox()
        for i in range(1000):
            box.put(i)
        first = await box.get()
        box.put(1000)
        return first, await box.get()
    assert asyncio.run(run()) == (999, 1000)


def test_an_error_stays_and_wins():
    async def run():
        box = Mailbox()
        box.put(1)
        box.put(RuntimeError("engine died"))
        box.put(2)
        return await box.get(), await box.get()
    a, b = asyncio.run(run())
    assert isinstance(a, RuntimeError) and a is b


def test_a_waiting_reader_wakes_up():
    async def run():
        box = Mailbox()
        reader = asyncio.create_task(box.get())
        await asyncio.sleep(0)
        box.put("out")
        return await asyncio.wait_for(reader, 5)
    assert asyncio.run(run()) == "out"


def test_an_unread_final_output_is_kept():
    async def run():
        box = Mailbox()
        box.put(SimpleNamespace(finished=False))
        final = SimpleNamespace(finished=True)
        box.put(final)
        box.put(RuntimeError("engine died after the request finished"))
        return final, await box.get()
    final, got = asyncio.run(run())
    assert got is final
