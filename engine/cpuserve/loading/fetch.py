"""`cpuserve fetch URL --sha256 HEX --dest PATH`: a model file downloaded over http(s) (or from
an S3-compatible store, s3://bucket/key, anonymously or through a presigned https URL) into a
cache volume, verified against its SHA-256 before it becomes visible under its name. A file
already there with the right checksum is kept: a restarted pod does not download it again.
The operator runs it as the engine pod's init container for http(s):// and s3:// models."""
from __future__ import annotations

import hashlib
import logging
import os
import time
import urllib.request
from pathlib import Path

log = logging.getLogger("cpuserve.fetch")
CHUNK = 1 << 20


def http_url(source: str, environ=os.environ) -> str:
    """s3://bucket/key as the https URL of an S3-compatible endpoint (AWS_ENDPOINT_URL, path
    style; else AWS's virtual-hosted style); http(s) URLs as they are."""
    if source.startswith(("http://", "https://")):
        return source
    if source.startswith("s3://"):
        bucket, _, key = source[len("s3://"):].partition("/")
        if not bucket or not key:
            raise ValueError(f"{source!r}: expected s3://bucket/key")
        endpoint = environ.get("AWS_ENDPOINT_URL", "").rstrip("/")
        return f"{endpoint}/{bucket}/{key}" if endpoint else f"https://{bucket}.s3.amazonaws.com/{key}"
    raise ValueError(f"{source!r}: fetch takes http://, https:// or s3:// sources")


def sha256_of(path: Path) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(CHUNK), b""):
            h.update(block)
    return h.hexdigest()


def fetch(source: str, sha256: str, dest: Path, timeout: float = 60, environ=os.environ) -> Path:
    """Downloads `source` to `dest` (a temporary name until its checksum matches)."""
    sha256 = sha256.lower()
    if len(sha256) != 64 or any(c not in "0123456789abcdef" for c in sha256):
        raise ValueError(f"--sha256 must be 64 hex digits, got {sha256!r}")
    dest = Path(dest)
    if dest.exists() and sha256_of(dest) == sha256:
        log.info("%s is already there with sha256 %s", dest, sha256)
        return dest
    dest.parent.mkdir(parents=True, exist_ok=True)
    tmp = dest.with_name(f".{dest.name}.part")
    url = http_url(source, environ)
    t0, h, n = time.monotonic(), hashlib.sha256(), 0
    with urllib.request.urlopen(url, timeout=timeout) as r, open(tmp, "wb") as f:
        for block in iter(lambda: r.read(CHUNK), b""):
            f.write(block)
            h.update(block)
            n += len(block)
    if h.hexdigest() != sha256:
        tmp.unlink()
        raise ValueError(f"{source}: sha256 {h.hexdigest()} of the {n} bytes downloaded is not the expected "
                         f"{sha256}; nothing was kept")
    os.replace(tmp, dest)
    log.info("fetched %s (%.1f MiB in %.1fs) into %s, sha256 verified", source, n / (1 << 20),
             time.monotonic() - t0, dest)
    return dest
