"""A model that cannot fit its container's memory limit is refused with a clear error before
the kernel OOM-kills the engine: the limit read from the process's own cgroup (v1 or v2),
and a real run in a memory cgroup too small for the model."""
import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from cpuserve.worker.kv_cache import TOO_LARGE, check_fits_container, memory_budget, memory_limit


def tree(tmp_path, cgroup_line, files):
    (tmp_path / "proc/self").mkdir(parents=True)
    (tmp_path / "proc/self/cgroup").write_text(cgroup_line + "\n")
    for rel, text in files.items():
        f = tmp_path / "sys/fs/cgroup" / rel
        f.parent.mkdir(parents=True, exist_ok=True)
        f.write_text(text + "\n")
    return str(tmp_path)


def test_limit_from_the_process_own_cgroup(tmp_path):
    v2 = tree(tmp_path / "v2", "0::/kubepods/pod1/c1", {"kubepods/pod1/c1/memory.max": "1073741824",
                                                         "kubepods/pod1/c1/memory.stat": "anon 1000\nfile 99999",
                                                         "memory.max": "max"})
    assert memory_budget(v2) == (1 << 30, 1000)
    v1 = tree(tmp_path / "v1", "9:memory:/kubepods/pod1/c1\n3:cpu,cpuacct:/x",
              {"memory/kubepods/pod1/c1/memory.limit_in_bytes": "536870912"})
    assert memory_limit(v1) == 512 << 20
    inside = tree(tmp_path / "ns", "0::/", {"memory.max": "2147483648"})  # a container's own view
    assert memory_limit(inside) == 2 << 30
    unlimited = tree(tmp_path / "none", "9:memory:/", {"memory/memory.limit_in_bytes": str(2 ** 63 - 4096)})
    assert memory_limit(unlimited) is None


def test_refusal_names_the_limit_and_the_fix():
    check_fits_container("x", 10, None)
    check_fits_container("x", 10, 10)
    with pytest.raises(MemoryError, match=f"{TOO_LARGE}: the weights need 2.00 GiB, more than .* 1.00 GiB.*sizeGiB"):
        check_fits_container("the weights", 2 << 30, 1 << 30)


def _memory_cgroup() -> Path | None:
    v2 = Path("/sys/fs/cgroup/cgroup.controllers")
    if v2.exists():
        return Path("/sys/fs/cgroup") if "memory" in v2.read_text().split() else None
    v1 = Path("/sys/fs/cgroup/memory")
    return v1 if v1.is_dir() else None


@pytest.mark.skipif(os.geteuid() != 0 or _memory_cgroup() is None, reason="needs root and the memory cgroup")
def test_engine_in_a_cgroup_too_small_for_its_model_says_so(tmp_path):
    base = _memory_cgroup()
    cg = base / f"cpuserve-test-{uuid.uuid4().hex[:8]}"
    try:
        cg.mkdir()
    except OSError as e:
        pytest.skip(f"cannot create a cgroup here: {e}")
    try:
        limit = 600 << 20  # above Python + torch, below them + SmolLM2-135M's 0.5 GiB of float32 weights
        limit_file = cg / ("memory.max" if (cg / "memory.max").exists() else "memory.limit_in_bytes")
        limit_file.write_text(str(limit))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        code = f"open('{cg}/cgroup.procs', 'w').write(str(__import__('os').getpid()))\n" \
               "import runpy, sys; sys.argv = ['cpuserve', 'generate', '--prompt', 'Hi', '--max-tokens', '1', " \
               "'--dtype', 'float32', '--kv-cache-space', '0.1']; runpy.run_module('cpuserve', run_name='__main__')"
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode not in (0, -9, 137), r.stderr[-2000:]  # refused, not OOM-killed
        assert TOO_LARGE in r.stderr and "memory limit" in r.stderr, r.stderr[-2000:]
        # and a limit that holds it (page cache included, which the check rightly leaves out) serves
        limit_file.write_text(str(1200 << 20))
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0 and TOO_LARGE not in r.stderr, r.stderr[-2000:]
    finally:
        for _ in range(50):
            try:
                cg.rmdir()
                break
            except OSError:
                import time
                time.sleep(0.1)
