"""The API process's channel to the engine core (engine/channel.py): whole messages in order
both ways, however the stream cuts them; many concurrent senders never interleave their frames;
either side's exit is the other's end of stream; a spawned process inherits its end."""
import asyncio
import multiprocessing
import threading

import pytest

from cpuserve.engine.channel import HEADER, ChannelClosed, CoreChannel, frame, open_api_channel, socket_pair


def test_messages_cross_in_order_both_ways():
    async def run():
        api_end, core_end = socket_pair()
        core = CoreChannel(core_end)
        api = await open_api_channel(api_end)
        big = bytes(range(256)) * 40_000  # 10 MB: more than both socket buffers
        await api.send("add", "r1", [1, 2, 3])
        await api.send("abort", "r1")
        assert core.poll(1.0)
        assert core.recv() == ("add", "r1", [1, 2, 3])
        assert core.poll(0) and core.recv() == ("abort", "r1")
        assert not core.poll(0)
        writer = threading.Thread(target=lambda: [core.send("outputs", i, big) for i in range(3)])
        writer.start()  # blocks on the full buffers until the API side reads
        got = [await api.recv() for _ in range(3)]
        writer.join()
        assert [(k, i) for k, i, _ in got] == [("outputs", 0), ("outputs", 1), ("outputs", 2)]
        assert all(b == big for *_, b in got)
        api.close()
        core.close()
    asyncio.run(run())


def test_a_message_cut_anywhere_reads_whole():
    api_end, core_end = socket_pair()
    core = CoreChannel(core_end)
    data = frame(("add", "r", list(range(100)))) + frame(("shutdown",))
    for i in range(len(data)):  # a byte at a time: every cut of the header and of the pickle
        api_end.sendall(data[i:i + 1])
    assert core.recv() == ("add", "r", list(range(100)))
    assert core.recv() == ("shutdown",)
    assert HEADER.size == 8


def test_concurrent_senders_never_interleave():
    async def run():
        api_end, core_end = socket_pair()
        core = CoreChannel(core_end)
        api = await open_api_channel(api_end)
        payload = "x" * 300_000

        async def sender(i):
            for j in range(5):
                await api.send("add", i, j, payload)
        reader = asyncio.create_task(asyncio.to_thread(lambda: [core.recv() for _ in range(100)]))
        await asyncio.gather(*(sender(i) for i in range(20)))
        got = await reader
        assert sorted((i, j) for _, i, j, _ in got) == [(i, j) for i in range(20) for j in range(5)]
        for i in range(20):  # each sender's messages in its own order
            assert [j for _, k, j, _ in got if k == i] == list(range(5))
    asyncio.run(run())


def test_either_side_closing_ends_the_other_stream():
    async def run():
        api_end, core_end = socket_pair()
        core = CoreChannel(core_end)
        api = await open_api_channel(api_end)
        core.send("ready", {})
        core.close()
        assert await api.recv() == ("ready", {})  # what was sent before the close still arrives
        with pytest.raises(ChannelClosed):
            await api.recv()

        api_end, core_end = socket_pair()
        core = CoreChannel(core_end)
        api_end.close()
        assert core.poll(1.0)  # the end of the stream wakes the busy loop's poll ...
        with pytest.raises(ChannelClosed):  # ... and its read says so
            core.recv()
        with pytest.raises(ConnectionError):  # a send to a closed API process's end fails, not hangs
            for _ in range(100):
                core.send("outputs", b"x" * 100_000)
    asyncio.run(run())


def _echo_core(sock) -> None:
    core = CoreChannel(sock)
    while True:
        try:
            msg = core.recv()
        except ChannelClosed:
            return
        core.send("echo", *msg)


def test_a_spawned_core_inherits_its_end():
    async def run():
        api_end, core_end = socket_pair()
        proc = multiprocessing.get_context("spawn").Process(target=_echo_core, args=(core_end,), daemon=True)
        proc.start()
        core_end.close()
        api = await open_api_channel(api_end)
        await api.send("add", "r1", [5, 6])
        assert await api.recv() == ("echo", "add", "r1", [5, 6])
        api.close()  # the core sees the end of its stream and returns
        await asyncio.to_thread(proc.join, 30)
        return proc.exitcode
    assert asyncio.run(run()) == 0


def _exit_at_once() -> None:
    pass


def test_a_send_to_a_dead_core_fails_the_requests_not_the_sender():
    """AsyncEngine._send after the core has exited (before its watcher notices): no exception
    in the sender (a request's clean-up sends an abort); every in-flight request gets the
    engine's death, with the core's exit code."""
    from cpuserve.config import EngineConfig
    from cpuserve.engine.async_engine import AsyncEngine, EngineDeadError, Mailbox

    async def run():
        engine = AsyncEngine(EngineConfig())
        engine._sock, core_end = socket_pair()
        engine.proc = multiprocessing.get_context("spawn").Process(target=_exit_at_once, daemon=True)
        engine.proc.start()
        await asyncio.to_thread(engine.proc.join, 30)
        core_end.close()
        engine._channel = await open_api_channel(engine._sock)
        box = engine._queues["r1"] = Mailbox()
        for _ in range(50):  # the first writes may still land in the socket buffer
            await engine._send("abort", "r1", b"x" * 100_000)
            if engine.dead:
                break
        return engine, await asyncio.wait_for(box.get(), 5)
    engine, got = asyncio.run(run())
    assert engine.dead and engine.dead_reason == "engine core process exited (exit code 0)"
    assert isinstance(got, EngineDeadError) and str(got) == engine.dead_reason
