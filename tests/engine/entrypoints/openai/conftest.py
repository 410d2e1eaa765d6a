"""Starts `cpuserve serve` as a real process on a free loopback port."""
import os
import socket
import subprocess
import sys
import tempfile
import time

import httpx
import pytest


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


class Server:
    def __init__(self, *args: str, env: dict | None = None, new_session: bool = False, tls=None):
        """tls: the ssl.SSLContext a client of a server started with --ssl-* options connects with."""
        self.port = free_port()
        self.url = f"{'https' if tls else 'http'}://127.0.0.1:{self.port}"
        self.verify = tls or True
        extra = env or {}
        env = {k: v for k, v in os.environ.items() if k != "VLLM_CPU_OMP_THREADS_BIND"}  # served: `auto`
        env.update(PYTHONUNBUFFERED="1", **extra)
        # a file, not a pipe: an unread pipe fills up and would block the server's logging
        self.log = tempfile.TemporaryFile(mode="w+")
        self.proc = subprocess.Popen([sys.executable, "-m", "cpuserve", "serve", "--host", "127.0.0.1", "--port",
                                      str(self.port), "--dtype", "float32", "--block-size", "16",
                                      "--kv-cache-space", "1", *args],
                                     stdout=self.log, stderr=subprocess.STDOUT, env=env, text=True,
                                     start_new_session=new_session)
        deadline = time.monotonic() + 180
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise RuntimeError(f"server exited ({self.proc.returncode}):\n{self.output()}")
            try:
                if httpx.get(self.url + "/health", timeout=1, verify=self.verify).status_code == 200:
                    return
            except httpx.HTTPError:
                pass
            time.sleep(0.3)
        self.stop()
        raise RuntimeError("server did not become healthy in time")

    def output(self) -> str:
        self.log.seek(0)
        return self.log.read()

    def stop(self) -> str:
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(20)
            except subprocess.TimeoutExpired:
                self.proc.kill()
        return self.output()


@pytest.fixture(scope="session")
def server():
    s = Server("--served-model-name", "smollm2", "--enable-auto-tool-choice", "--tool-call-parser", "hermes")
    yield s
    s.stop()


@pytest.fixture(scope="session")
def client(server):
    from openai import OpenAI
    return OpenAI(base_url=server.url + "/v1", api_key="unused", max_retries=0, timeout=120)
