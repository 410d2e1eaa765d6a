"""`cpuserve serve`: the API process. Starts the engine core, then uvicorn; exits
non-zero when the engine core dies, so that a supervisor (the kubelet) restarts it."""
from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass
from typing import TYPE_CHECKING

from cpuserve.config import EngineConfig

if TYPE_CHECKING:  # the web stack is imported once the engine core is launching (serve())
    from cpuserve.entrypoints.openai.serving import RequestLog

log = logging.getLogger("cpuserve.serve")


@dataclass(frozen=True)
class Cors:
    """Which browser pages may call the API (vLLM's --allowed-origins, --allowed-methods,
    --allowed-headers, --allow-credentials; its defaults: any origin, no credentials)."""
    origins: tuple[str, ...] = ("*",)
    methods: tuple[str, ...] = ("*",)
    headers: tuple[str, ...] = ("*",)
    credentials: bool = False


@dataclass(frozen=True)
class Tls:
    """HTTPS (vLLM's --ssl-keyfile, --ssl-certfile), and with ca_certs and cert_reqs (ssl.CERT_OPTIONAL
    1, CERT_REQUIRED 2) clients' certificates checked against that CA (mutual TLS)."""
    keyfile: str
    certfile: str
    ca_certs: str | None = None
    cert_reqs: int = 0  # ssl.CERT_NONE


@dataclass
class ServeOptions:
    """The HTTP side of `cpuserve serve` (the engine's knobs are in EngineConfig)."""
    host: str = "0.0.0.0"
    port: int = 8000
    served_model_name: str | None = None
    api_key: str | None = None
    max_waiting_requests: int = 1024      # queue bound: further requests get 503
    max_request_body_bytes: int = 16 << 20  # larger bodies get 413 before they are parsed
    drain_timeout: float = 25.0           # after SIGTERM, at most this long for in-flight requests
    tool_call_parser: str | None = None   # --enable-auto-tool-choice --tool-call-parser NAME
    chat_template: str | None = None      # --chat-template: in place of the model's
    cors: Cors = Cors()                   # --allowed-origins and the rest: which pages may call
    stats_interval: float | None = 10.0   # seconds between stats lines while busy; None: --disable-log-stats
    tls: Tls | None = None                # --ssl-*: HTTPS, and mutual TLS with a CA
    root_path: str = ""                   # --root-path: the prefix a proxy serves the API under
    docs: bool = True                     # /docs, /redoc, /openapi.json (--disable-fastapi-docs: none)
    log_level: str = "warning"            # --uvicorn-log-level: uvicorn's own lines
    access_log: bool = True               # a log line per request (--disable-uvicorn-access-log: none)
    prompt_tokens_details: bool = False   # --enable-prompt-tokens-details: usage names the cached tokens
    force_usage: bool = False             # --enable-force-include-usage: every stream ends with its usage
    tokens_as_ids: bool = False           # --return-tokens-as-token-ids: logprobs name tokens by id
    log_requests: RequestLog | None = None  # --enable-log-requests (off: None)
    reasoning_parser: str | None = None   # --reasoning-parser: deepseek_r1 | qwen3
    model_aliases: tuple[str, ...] = ()   # --served-model-name's further names: requests may use them too

    @property
    def url(self) -> str:
        return f"{'https' if self.tls else 'http'}://{self.host}:{self.port}{self.root_path}/v1"


def uvicorn_options(opts: ServeOptions) -> dict:
    """uvicorn.Config's arguments for the options (its own access log stays off: RequestContext
    logs each request, with its id)."""
    kw = dict(host=opts.host, port=opts.port, log_level=opts.log_level, access_log=False, timeout_graceful_shutdown=5)
    if opts.tls is not None:
        kw.update(ssl_keyfile=opts.tls.keyfile, ssl_certfile=opts.tls.certfile, ssl_ca_certs=opts.tls.ca_certs,
                  ssl_cert_reqs=opts.tls.cert_reqs)
    return kw


def draining_server(config, st, drain_timeout: float):
    """A uvicorn server that drains on SIGTERM, as Kubernetes expects before its SIGKILL:
    new requests (and /health, so readiness fails) get 503 while in-flight ones finish,
    then it exits, after drain_timeout seconds at most. A second signal, or SIGINT, exits
    at once."""
    import time

    import uvicorn

    class DrainingServer(uvicorn.Server):
        deadline: float | None = None

        def handle_exit(self, sig, frame) -> None:
            if sig == signal.SIGTERM and self.deadline is None and st.engine.info is not None:
                self.deadline = time.monotonic() + drain_timeout
                st.draining = True  # handled here: nothing for uvicorn to re-raise afterwards
                return
            super().handle_exit(sig, frame)

        async def on_tick(self, counter: int) -> bool:
            if self.deadline is not None and not self.should_exit:
                left = st.engine.num_in_flight
                if left == 0 or time.monotonic() > self.deadline:
                    log.info("SIGTERM: drained, %d request(s) still in flight; exiting", left)
                    self.should_exit = True
            return await super().on_tick(counter)

    return DrainingServer(config)


async def serve(config: EngineConfig, opts: ServeOptions) -> int:
    from cpuserve.engine.async_engine import AsyncEngine

    server = None

    def on_dead(reason: str) -> None:
        log.error("shutting down: %s", reason)
        if server is not None:
            server.should_exit = True

    engine = AsyncEngine(config, opts.max_waiting_requests, on_dead=on_dead)
    # The engine core first: it imports torch and loads the model (seconds) while this process
    # imports the web stack (0.9 s of a 2-CPU Zen 3 VM's start, spent before the spawn until then).
    engine.launch()
    import uvicorn

    from cpuserve.entrypoints.openai.app import build_app

    name = opts.served_model_name or default_served_name(config)
    app = build_app(engine, name, opts)
    server = draining_server(uvicorn.Config(app, **uvicorn_options(opts)), app.state.server, opts.drain_timeout)
    # Listen from the start: /health and every route answer 503 until the model is loaded.
    serving = asyncio.create_task(server.serve())
    try:
        await engine.start()
        if engine.info.task == "generate":
            app.state.server.defaults = model_defaults(config, engine.info.model_dir)
    except (RuntimeError, ValueError) as e:  # ValueError: the model's generation_config.json
        log.error("%s", e)
        server.should_exit = True
        await serving
        await engine.shutdown()
        return 1
    if opts.chat_template is not None:  # before any request is served (no await since start)
        engine.tokenizer.chat_template = opts.chat_template
    log.info("serving %s on %s", name, opts.url)
    stats = None
    if opts.stats_interval is not None:
        from cpuserve.entrypoints.openai.metrics import log_stats
        stats = asyncio.create_task(log_stats(engine, opts.stats_interval, logging.getLogger("cpuserve.stats")))
    try:
        await serving
    finally:
        if stats is not None:
            stats.cancel()
        await engine.shutdown()
    return 1 if engine.dead else 0


def default_served_name(config: EngineConfig) -> str:
    """The model's name for clients where none is given: smollm2, or the model's file or directory name."""
    return "smollm2" if config.model in (None, "", "default") else str(config.model).rstrip("/").split("/")[-1]


def model_defaults(config: EngineConfig, model_dir):
    """The sampling defaults of the model's generation config (logged where they are not the
    plain ones, as vLLM warns); the options were checked before the model loaded."""
    from cpuserve.core.generation_config import sampling_defaults

    defaults = sampling_defaults(model_dir, config.generation_config, config.override_generation_config)
    if defaults.changed():
        log.warning("default sampling parameters from the model's generation config: %s (requests' own "
                    "fields win; --generation-config vllm ignores the model's)", defaults.changed())
    return defaults


def prepare_platform(config: EngineConfig) -> None:
    """Plans the CPU binding here, where the whole allowed CPU set is visible, hands
    the plan to the engine processes, pins this (API) process to the reserved CPUs,
    and preloads tcmalloc into the engine processes."""
    from cpuserve.platform.binding import plan_from_env
    from cpuserve.platform.pinning import pin_process, preload_tcmalloc_for_children
    from cpuserve_topology import format_cpulist, read_topology

    if config.binding is None:
        config.binding = plan_from_env(read_topology(), config.tensor_parallel_size)
    lib = preload_tcmalloc_for_children()
    log.info("tcmalloc: %s", f"preloaded into the engine processes ({lib})" if lib else
             "not found (install libtcmalloc-minimal4, or set LD_PRELOAD); using glibc malloc")
    if config.binding.reserved_cpus:
        pin_process(config.binding.reserved_cpus)
        log.info("API process pinned to reserved CPUs %s", format_cpulist(config.binding.reserved_cpus))


def run(config: EngineConfig, opts: ServeOptions) -> int:
    prepare_platform(config)
    signal.signal(signal.SIGTERM, signal.default_int_handler)
    try:
        return asyncio.run(serve(config, opts))
    except KeyboardInterrupt:
        return 0
