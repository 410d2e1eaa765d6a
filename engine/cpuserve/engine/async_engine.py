"""The API process's handle on the engine core: spawns it, sends requests,
turns its token outputs into RequestOutputs (output_processor) and hands them
to one asyncio queue per request. If the core dies, every in-flight request
ends with EngineDeadError and `dead` is set (health turns 503)."""
from __future__ import annotations

import asyncio
import itertools
import logging
import multiprocessing
import time
from dataclasses import dataclass, field
from typing import AsyncIterator

from cpuserve.engine import core_process as cp
from cpuserve.engine.channel import ChannelClosed, open_api_channel, socket_pair
from cpuserve.config import EngineConfig
from cpuserve.engine.output_processor import OutputProcessor
from cpuserve.engine.outputs import CoreStats, EmbeddingOutput, RequestOutput
from cpuserve.core.sampling_params import SamplingParams
from cpuserve.core.scheduler import admission_error
from cpuserve.loading.tokenizer import load_tokenizer

log = logging.getLogger("cpuserve.engine")


class EngineDeadError(RuntimeError):
    pass


class RequestRejected(ValueError):
    pass


class Overloaded(RuntimeError):
    pass


@dataclass
class ModelInfo:
    model_dir: str
    max_model_len: int
    vocab_size: int
    num_blocks: int
    block_size: int
    dtype: str
    load_seconds: float
    pid: int
    binding: list = field(default_factory=list)  # per rank: cpus, memoryNode, membind (GET /topology)
    task: str = "generate"  # or "embed": a pooling model (POST /v1/embeddings); "classify": a classifier


class Mailbox:
    """The newest output of one request. Outputs are cumulative snapshots, so a slow
    reader (a client reading its stream slowly) skips the ones it missed: a request
    holds at most one unread output however far its reader falls behind. Nothing
    replaces an unread final output, nor an error (which stays until read, and wins
    over later outputs)."""

    def __init__(self):
        self._item = None
        self._ready = asyncio.Event()

    def put(self, item) -> None:
        if not isinstance(self._item, Exception) and not getattr(self._item, "finished", False):
            self._item = item
            self._ready.set()

    async def get(self):
        await self._ready.wait()
        item = self._item
        if not isinstance(item, Exception):
            self._item = None
            self._ready.clear()
        return item


class AsyncEngine:
    def __init__(self, config: EngineConfig, max_waiting_requests: int = 1024, on_dead=None):
        self.config = config
        self.max_waiting = max_waiting_requests
        self.on_dead = on_dead
        self.info: ModelInfo | None = None
        self.tokenizer = None
        self.output: OutputProcessor | None = None
        self.stats = CoreStats()
        self.dead = False
        self.dead_reason = ""
        self._queues: dict[str, Mailbox] = {}
        self._unscheduled = 0  # requests sent since the last stats snapshot
        self.listeners = []    # callables(RequestOutput, CoreStats) for metrics
        self._tickets = itertools.count()
        self._lora_waits: dict[int, asyncio.Future] = {}  # LoRA changes sent to the core, by ticket

    # -- lifecycle ------------------------------------------------------------------
    def launch(self) -> None:
        """Spawns the engine core (which then imports torch and loads the model) and returns at
        once: the caller does its own start-up meanwhile, then awaits `start`."""
        if getattr(self, "proc", None) is not None:
            return
        self._sock, core_end = socket_pair()
        mp = multiprocessing.get_context("spawn")
        self.proc = mp.Process(target=cp.run_engine_core, args=(self.config, core_end),
                               name="cpuserve-engine-core", daemon=True)
        self.proc.start()  # the core's end is inherited by the child (multiprocessing's DupFd)
        core_end.close()

    async def start(self, timeout: float = 600.0) -> None:
        """Launches the engine core if that is not done yet, and waits until it is ready."""
        self.launch()
        self._channel = await open_api_channel(self._sock)
        deadline = time.monotonic() + timeout
        tokenizer = None  # read while the core loads the weights
        message = None  # the read under way: one at a time on the stream, none left at READY
        try:
            while True:
                message = message or asyncio.ensure_future(self._channel.recv())
                done, _ = await asyncio.wait({message}, timeout=0.5)
                if done:
                    got, message = message, None
                    try:
                        kind, *payload = got.result()
                    except ChannelClosed:
                        await asyncio.to_thread(self.proc.join, 5)
                        raise RuntimeError(f"engine core exited during start-up (exit code {self.proc.exitcode})")
                    if kind == cp.RESOLVED and tokenizer is None:
                        tokenizer = (payload[0], asyncio.ensure_future(asyncio.to_thread(load_tokenizer, payload[0])))
                        # (its error is raised by the await below; if the core fails first, by nobody)
                        tokenizer[1].add_done_callback(lambda f: f.cancelled() or f.exception())
                    if kind == cp.READY:
                        info = ModelInfo(**payload[0])
                        break
                    if kind == cp.FATAL:
                        raise RuntimeError(f"engine core failed to start: {payload[0]}")
                if not self.proc.is_alive():
                    raise RuntimeError(f"engine core exited during start-up (exit code {self.proc.exitcode})")
                if time.monotonic() > deadline:
                    raise RuntimeError("engine core did not become ready in time")
        except BaseException:
            if message is not None:
                message.cancel()
            raise
        if tokenizer is not None and tokenizer[0] == info.model_dir:
            self.tokenizer = await tokenizer[1]
        else:
            self.tokenizer = load_tokenizer(info.model_dir)
        self.output = OutputProcessor(self.tokenizer)
        self.info = info  # ready: the server answers from here on, its tokenizer there
        self._tasks = [asyncio.create_task(self._read_outputs()), asyncio.create_task(self._watch_process())]
        log.info("engine core ready (pid %d): %s, dtype %s, %d KV blocks of %d, max_model_len %d",
                 self.info.pid, self.info.model_dir, self.info.dtype, self.info.num_blocks, self.info.block_size,
                 self.info.max_model_len)

    async def shutdown(self) -> None:
        if getattr(self, "proc", None) is None:
            return
        if self.proc.is_alive():
            try:  # bounded: the send waits while the core, already closing, reads nothing
                await asyncio.wait_for(self._send(cp.SHUTDOWN), 2.0)
            except Exception:  # noqa: BLE001 - best effort on the way out
                pass
            await asyncio.to_thread(self.proc.join, 5)
            if self.proc.is_alive():
                self.proc.kill()
        for t in getattr(self, "_tasks", []):
            t.cancel()
        if getattr(self, "_channel", None) is not None:
            self._channel.close()
        else:
            self._sock.close()

    @property
    def num_in_flight(self) -> int:
        """Requests started and not yet finished or aborted."""
        return len(self._queues)

    # -- requests -------------------------------------------------------------------
    def check(self, prompt_len: int, params: SamplingParams) -> None:
        """Raises RequestRejected (a 400) for what can never be served."""
        i = self.info
        err = admission_error(prompt_len, params.max_tokens, i.max_model_len, i.num_blocks, i.block_size,
                              self.config.enable_chunked_prefill, self.config.resolve_batched_tokens(i.max_model_len))
        if err:
            raise RequestRejected(err)

    def _admit(self, request_id: str) -> None:
        """What every request must pass: a live engine, room in the queue, an unused id."""
        if self.dead:
            raise EngineDeadError(self.dead_reason)
        if self.stats.num_waiting + self._unscheduled >= self.max_waiting:
            raise Overloaded(f"too many waiting requests ({self.max_waiting}); retry later")
        if request_id in self._queues:
            raise RequestRejected(f"request id {request_id!r} is already in use")

    async def generate(self, request_id: str, prompt: str | None, prompt_token_ids: list[int],
                       params: SamplingParams, lora: str | None = None) -> AsyncIterator[RequestOutput]:
        """The request's outputs as they come; `lora`: a loaded LoRA adapter's name (None: the base model)."""
        self._admit(request_id)
        if prompt_token_ids and (min(prompt_token_ids) < 0 or max(prompt_token_ids) >= self.info.vocab_size):
            raise RequestRejected(f"prompt token ids must be in [0, {self.info.vocab_size})")
        self.check(len(prompt_token_ids), params)
        q = Mailbox()
        self._queues[request_id] = q
        self.output.add_request(request_id, prompt, prompt_token_ids, params)
        finished = False
        try:
            await self._send(cp.ADD, request_id, prompt_token_ids, params, time.monotonic(),
                             *([lora] if lora is not None else []))
            self._unscheduled += 1
            while True:
                item = await q.get()
                if isinstance(item, Exception):
                    raise item
                finished = item.finished
                yield item
                if finished:
                    return
        finally:
            self._queues.pop(request_id, None)
            if not finished:  # cancelled (client gone) or failed: free its blocks in the core
                self.output.abort_request(request_id)
                if not self.dead:
                    await self._send(cp.ABORT, request_id)

    async def embed(self, request_id: str, prompt_token_ids: list[int],
                    token_type_ids: list[int] | None = None) -> EmbeddingOutput:
        """One input's embedding from a pooling model, or a classifier's logits (the core batches
        concurrent ones); `token_type_ids`: a cross-encoder's pair segments (0, then 1)."""
        self._admit(request_id)
        n, limit = len(prompt_token_ids), self.info.max_model_len
        if n > limit:
            raise RequestRejected(f"the input has {n} tokens; this embedding model takes at most {limit}")
        q = Mailbox()
        self._queues[request_id] = q
        done = False
        try:
            await self._send(cp.ADD, request_id, prompt_token_ids, token_type_ids, time.monotonic())
            self._unscheduled += 1
            item = await q.get()
            if isinstance(item, Exception):
                raise item
            done = True
            return item
        finally:
            self._queues.pop(request_id, None)
            if not done and not self.dead:
                await self._send(cp.ABORT, request_id)

    async def change_lora(self, op: str, name: str, path: str | None = None) -> tuple[int, str] | None:
        """Loads ("load") or unloads ("unload") a LoRA adapter in the engine core, between its steps:
        None once done, or the HTTP status and message of why not."""
        if self.dead:
            raise EngineDeadError(self.dead_reason)
        ticket = next(self._tickets)
        done = self._lora_waits[ticket] = asyncio.get_running_loop().create_future()
        try:
            await self._send(cp.LORA, ticket, op, name, path)
            return await done
        finally:
            self._lora_waits.pop(ticket, None)

    async def _send(self, *msg) -> None:
        """Sends to the core; if it is gone, fails every in-flight request (as _watch_process
        would a moment later) instead of raising here."""
        try:
            await self._channel.send(*msg)
        except ConnectionError:
            self._die(self._exit_reason() if not self.proc.is_alive() else "engine core closed the channel")

    # -- background tasks -----------------------------------------------------------
    async def _read_outputs(self) -> None:
        while True:
            try:
                kind, *payload = await self._channel.recv()
            except ChannelClosed:  # the core exited: _watch_process says how
                return
            if kind == cp.OUTPUTS:
                outputs, stats = payload
                self.stats = stats
                self._unscheduled = 0
                if outputs and isinstance(outputs[0], EmbeddingOutput):
                    for out in outputs:
                        if (q := self._queues.get(out.request_id)) is not None:
                            q.put(out)
                    continue
                results, to_stop = self.output.process(outputs)
                for rid, index in to_stop:
                    await self._send(cp.STOP_SEQ, rid, index)
                for ro in results:
                    q = self._queues.get(ro.request_id)
                    if q is not None:
                        q.put(ro)
                    for listener in self.listeners:
                        listener(ro, outputs)
            elif kind == cp.LORA_DONE:
                ticket, result = payload
                if (f := self._lora_waits.get(ticket)) is not None and not f.done():
                    f.set_result(result)
            elif kind == cp.REJECTED:
                rid, msg = payload
                self.output.abort_request(rid)
                q = self._queues.get(rid)
                if q is not None:
                    q.put(RequestRejected(msg))
            elif kind == cp.FATAL:
                self._die(f"engine core failed: {payload[0].strip().splitlines()[-1]}")
                log.error("engine core failed:\n%s", payload[0])
                return

    async def _watch_process(self) -> None:
        while self.proc.is_alive():
            await asyncio.sleep(0.2)
        self._die(self._exit_reason())

    def _exit_reason(self) -> str:
        return f"engine core process exited (exit code {self.proc.exitcode})"

    def _die(self, reason: str) -> None:
        if self.dead:
            return
        self.dead, self.dead_reason = True, reason
        log.error("%s: failing %d in-flight requests", reason, len(self._queues))
        for q in self._queues.values():
            q.put(EngineDeadError(reason))
        for f in self._lora_waits.values():
            if not f.done():
                f.set_exception(EngineDeadError(reason))
        if self.on_dead is not None:
            self.on_dead(reason)
