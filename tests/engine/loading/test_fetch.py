"""`cpuserve fetch`: a model file over HTTP from a real local server, verified by SHA-256,
kept only when it matches, not downloaded twice; s3:// names an S3-compatible endpoint."""
import hashlib
import os
import subprocess
import sys
import threading
from functools import partial
from http.server import SimpleHTTPRequestHandler, ThreadingHTTPServer

import pytest

from cpuserve.loading.fetch import http_url


@pytest.fixture
def served(tmp_path):
    root = tmp_path / "www"
    root.mkdir()
    data = os.urandom(3 << 20)
    (root / "model.gguf").write_bytes(data)
    hits = []

    class Handler(SimpleHTTPRequestHandler):
        def do_GET(self):  # noqa: N802
            hits.append(self.path)
            super().do_GET()

        def log_message(self, *_):
            pass

    srv = ThreadingHTTPServer(("127.0.0.1", 0), partial(Handler, directory=str(root)))
    threading.Thread(target=srv.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{srv.server_port}", hashlib.sha256(data).hexdigest(), data, hits
    srv.shutdown()


def run(*args):
    env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
    return subprocess.run([sys.executable, "-m", "cpuserve", "fetch", *args], capture_output=True, text=True,
                          env=env, timeout=120)


def test_fetch_verifies_and_does_not_fetch_twice(served, tmp_path):
    url, digest, data, hits = served
    dest = tmp_path / "cache" / "model.gguf"
    r = run(f"{url}/model.gguf", "--sha256", digest, "--dest", str(dest))
    assert r.returncode == 0, r.stderr
    assert dest.read_bytes() == data and "sha256 verified" in r.stderr
    r = run(f"{url}/model.gguf", "--sha256", digest.upper(), "--dest", str(dest))
    assert r.returncode == 0 and len(hits) == 1  # already there, verified: no second download


def test_wrong_checksum_keeps_nothing(served, tmp_path):
    url, digest, _, _ = served
    dest = tmp_path / "cache" / "model.gguf"
    r = run(f"{url}/model.gguf", "--sha256", "0" * 64, "--dest", str(dest))
    assert r.returncode == 2 and f"sha256 {digest}" in r.stderr and "nothing was kept" in r.stderr
    assert not dest.exists() and not list(dest.parent.iterdir())
    r = run(f"{url}/missing.gguf", "--sha256", "0" * 64, "--dest", str(dest))
    assert r.returncode == 2 and "404" in r.stderr


def test_s3_urls():
    assert http_url("s3://models/llama/8b.gguf", {}) == "https://models.s3.amazonaws.com/llama/8b.gguf"
    assert http_url("s3://models/llama/8b.gguf", {"AWS_ENDPOINT_URL": "http://minio:9000/"}) == \
        "http://minio:9000/models/llama/8b.gguf"
    with pytest.raises(ValueError, match="s3://bucket/key"):
        http_url("s3://models", {})
