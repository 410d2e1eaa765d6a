"""The engine-core process: owns the model and steps it; talks to the API
process over its end of a Unix socket pair (engine/channel.py: requests in,
outputs out, as framed pickled tuples).

Outputs go out after every step with a stats snapshot; an exception in the core
is reported once and the process exits non-zero.
"""
from __future__ import annotations

import logging
import os
import signal
import sys
import traceback

from cpuserve.engine.channel import ChannelClosed, CoreChannel

log = logging.getLogger("cpuserve.core")

# request kinds (API -> core)
ADD, ABORT, STOP_SEQ, SHUTDOWN = "add", "abort", "stop_seq", "shutdown"
LORA = "lora"  # (ticket, "load" | "unload", name, path): a LoRA adapter loaded or unloaded at run time
# message kinds (core -> API); RESOLVED: the model's directory, before its weights are loaded
RESOLVED, READY, OUTPUTS, REJECTED, FATAL = "resolved", "ready", "outputs", "rejected", "fatal"
LORA_DONE = "lora_done"  # (ticket, None or (status, message)): a LORA message applied, or why not


def bound_ranks(runner) -> list[dict]:
    """Where each rank's threads and memory really are (what `GET /topology` answers)."""
    from cpuserve.platform.pinning import describe_binding

    reports = [runner.binding.__dict__] if getattr(runner, "binding", None) is not None else []
    reports += [info["binding"] for info in getattr(runner, "rank_info", None) or [] if info.get("binding")]
    return [describe_binding(r) for r in reports]


def run_engine_core(config, sock) -> None:
    """Entry point of the spawned process (`sock`: its end of the channel): load, report READY
    (or FATAL), then loop."""
    # The API process decides when to stop (SHUTDOWN, or its own exit): a SIGTERM or Ctrl-C
    # sent to the whole process group must not kill the core under in-flight requests.
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    signal.signal(signal.SIGINT, signal.SIG_IGN)

    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    channel = CoreChannel(sock)
    send = channel.send
    parent = os.getppid()
    try:
        from cpuserve.engine.pooling_core import make_core
        from cpuserve.loading.model_loader import resolve

        send(RESOLVED, str(resolve(config.model)))  # the API process reads the tokenizer meanwhile
        core = make_core(config)
        send(READY, dict(model_dir=str(core.runner.model_dir), max_model_len=core.max_model_len,
                         task=getattr(core, "task", "generate"),
                         vocab_size=core.vocab_size, num_blocks=core.runner.num_blocks,
                         block_size=config.block_size, dtype=str(core.runner.dtype).replace("torch.", ""),
                         load_seconds=core.runner.load_seconds, pid=os.getpid(),
                         binding=bound_ranks(core.runner)))
    except Exception as e:  # a bad model or configuration: the API process reports it and exits
        send(FATAL, f"{type(e).__name__}: {e}")
        sys.exit(1)
    try:
        send(OUTPUTS, [], core.snapshot_stats())  # (whether start-up work is left for idle time)
        busy_loop(core, channel, parent)
    except ConnectionError:  # a send to an API process that is gone
        log.error("API process is gone: engine core exiting")
    except Exception:
        send(FATAL, traceback.format_exc())
        raise


def busy_loop(core, channel, parent: int) -> None:
    """Takes in requests, steps while there is work, sends each step's outputs; while idle,
    does the start-up work left for then (worker/idle.py: the KV cache's pages, the weights'
    huge pages). Returns on SHUTDOWN or when the API process is gone."""
    from cpuserve.worker.idle import QUIET_S

    send = channel.send
    idle = core.runner.idle_work
    while True:
        # block while idle (waking up to notice a dead parent, or after a quiet spell for the
        # idle work); drain without waiting while busy
        left = idle.pending
        timeout = 0 if core.has_unfinished() else QUIET_S if left else 1.0
        quiet = True
        while channel.poll(timeout):
            try:
                msg = channel.recv()
            except ChannelClosed:
                log.error("API process closed the channel: engine core exiting")
                return
            if not handle(core, send, *msg):
                return
            timeout, quiet = 0, False
        if os.getppid() != parent:
            log.error("API process is gone: engine core exiting")
            return
        core.runner.check_ranks()  # a dead tensor-parallel rank stops the engine, even while idle
        if core.has_unfinished():
            outputs = core.step()
            send(OUTPUTS, outputs, core.snapshot_stats())
        elif left and quiet:
            idle.run_while(lambda: not channel.poll(0))
            if not idle.pending:  # settled: the API process's /metrics says so
                send(OUTPUTS, [], core.snapshot_stats())


def handle(core, send, kind: str, *payload) -> bool:
    """Applies one message from the API process; False on SHUTDOWN."""
    if kind == ADD:
        request_id, ids, params, arrival, *lora = payload  # (a generation request's LoRA adapter, if any)
        try:
            core.add_request(request_id, ids, params, arrival, *lora)
        except ValueError as e:
            send(REJECTED, request_id, str(e))
    elif kind == ABORT:
        core.abort_request(payload[0])
    elif kind == STOP_SEQ:
        core.stop_sequence(*payload)
    elif kind == LORA:
        send(LORA_DONE, payload[0], lora_change(core, *payload[1:]))
    elif kind == SHUTDOWN:
        return False
    return True


def lora_change(core, op: str, name: str, path: str | None) -> tuple[int, str] | None:
    """Applies a LORA message: None, or the HTTP status and message of why not."""
    if not hasattr(core, "load_lora"):
        return 400, "an embedding or classification model serves no LoRA adapters"
    try:
        core.load_lora(name, path) if op == "load" else core.unload_lora(name)
    except KeyError as e:
        return 404, e.args[0]
    except (ValueError, OSError) as e:
        return 400, str(e)
    return None
