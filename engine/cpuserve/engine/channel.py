"""The API process's link with the engine core: one Unix stream socket pair, framed pickled
tuples (an 8-byte little-endian length, then the pickle).

A socketpair made by the API process, the core's end inherited by the spawned process: no
path on a filesystem, nobody else can connect, and either side sees the other's exit as the
end of the stream. No I/O threads: the core reads and writes its end directly between steps
(`CoreChannel`), the API process through asyncio streams (`open_api_channel`). Against the
two ZeroMQ PUSH/PULL sockets this replaces, a message's trip is one write and one read, with
no background thread to wake on either side of a 2-CPU machine where the engine's threads
hold both CPUs.
"""
from __future__ import annotations

import asyncio
import pickle
import select
import socket
import struct

HEADER = struct.Struct("<Q")
# room for a 64-stream step's outputs, so that the core does not wait on the API process's reads
BUFFER_BYTES = 4 << 20


class ChannelClosed(EOFError):
    """The other side closed its end (its process exited)."""


def frame(msg: tuple) -> bytes:
    data = pickle.dumps(msg, protocol=pickle.HIGHEST_PROTOCOL)
    return HEADER.pack(len(data)) + data


def socket_pair() -> tuple[socket.socket, socket.socket]:
    """(the API process's end, the core's end), both with room for BUFFER_BYTES."""
    ends = socket.socketpair(socket.AF_UNIX, socket.SOCK_STREAM)
    for s in ends:
        for opt in (socket.SO_SNDBUF, socket.SO_RCVBUF):
            s.setsockopt(socket.SOL_SOCKET, opt, BUFFER_BYTES)
    return ends


class CoreChannel:
    """The core's end: blocking sends, and reads that poll first so that the busy loop steps
    while nothing has come in."""

    def __init__(self, sock: socket.socket):
        sock.setblocking(True)
        self.sock = sock
        self._buf = bytearray()
        self._poll = select.poll()
        self._poll.register(sock, select.POLLIN)

    def send(self, *msg) -> None:
        self.sock.sendall(frame(msg))

    def _complete(self) -> int:
        """The length of the first whole message buffered (header included), else 0."""
        if len(self._buf) < HEADER.size:
            return 0
        n = HEADER.size + HEADER.unpack_from(self._buf)[0]
        return n if len(self._buf) >= n else 0

    def _fill(self) -> None:
        chunk = self.sock.recv(1 << 20)
        if not chunk:
            raise ChannelClosed("the API process closed the channel")
        self._buf += chunk

    def poll(self, timeout: float) -> bool:
        """Whether a message can be read now, waiting up to `timeout` seconds for one to start
        arriving. True also at the end of the stream (recv then raises ChannelClosed)."""
        return self._complete() > 0 or bool(self._poll.poll(max(0, int(timeout * 1000))))

    def recv(self) -> tuple:
        while not (n := self._complete()):
            self._fill()
        with memoryview(self._buf) as view:
            msg = pickle.loads(view[HEADER.size:n])
        del self._buf[:n]
        return msg

    def close(self) -> None:
        self.sock.close()


class ApiChannel:
    """The API process's end, on its event loop: writes are queued in the transport (whole
    frames, so concurrent senders never interleave) and drained; reads take whole frames."""

    def __init__(self, reader: asyncio.StreamReader, writer: asyncio.StreamWriter):
        self.reader, self.writer = reader, writer

    async def send(self, *msg) -> None:
        self.writer.write(frame(msg))
        await self.writer.drain()

    async def recv(self) -> tuple:
        try:
            (n,) = HEADER.unpack(await self.reader.readexactly(HEADER.size))
            return pickle.loads(await self.reader.readexactly(n))
        except asyncio.IncompleteReadError as e:
            raise ChannelClosed("the engine core closed the channel") from e

    def close(self) -> None:
        self.writer.close()


async def open_api_channel(sock: socket.socket) -> ApiChannel:
    reader, writer = await asyncio.open_unix_connection(sock=sock, limit=BUFFER_BYTES)
    return ApiChannel(reader, writer)
