"""A model that cannot fit its container's memory limit is refused with a clear error before
the kernel OOM-kills the engine: the limit read from the process's own cgroup (v1 or v2),
and a real run in a memory cgroup too small for the model."""
import contextlib
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
        limit = 600 << 20  # above Python + torch, below them + SmolLM2-135M's 0.5 GiB of float32 (widened) weights
        limit_file = cg / ("memory.max" if (cg / "memory.max").exists() else "memory.limit_in_bytes")
        limit_file.write_text(str(limit))
        env = dict(os.environ, PYTHONPATH=os.pathsep.join(sys.path))
        code = f"open('{cg}/cgroup.procs', 'w').write(str(__import__('os').getpid()))\n" \
               "import runpy, sys; sys.argv = ['cpuserve', 'generate', '--prompt', 'Hi', '--max-tokens', '1', " \
               "'--dtype', 'float32', '--quantization', 'none', '--kv-cache-space', '0.1']; " \
               "runpy.run_module('cpuserve', run_name='__main__')"
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode not in (0, -9, 137), r.stderr[-2000:]  # refused, not OOM-killed
        assert TOO_LARGE in r.stderr and "memory limit" in r.stderr, r.stderr[-2000:]
        # and a limit that holds it (page cache included, which the check rightly leaves out) serves:
        # in use after loading 0.98 GiB (the weights' huge pages round each region up to 2 MiB; the head's
        # greedy copies 0.08) once the load's freed heap is trimmed: 1.02-1.18 before, run to run
        limit_file.write_text(str(1300 << 20))
        r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)
        assert r.returncode == 0 and TOO_LARGE not in r.stderr, r.stderr[-2000:]
    finally:
        _rmdir_when_empty(cg)


def _cgroup_pair(name: str) -> tuple[Path | None, Path | None]:
    """(memory cgroup, cpu cgroup) directories to create, v2 (one) or v1 (two); None where absent."""
    if Path("/sys/fs/cgroup/cgroup.controllers").exists():
        ctl = Path("/sys/fs/cgroup/cgroup.controllers").read_text().split()
        d = Path("/sys/fs/cgroup") / name
        return (d if "memory" in ctl else None), (d if "cpu" in ctl else None)
    cpu = next((Path("/sys/fs/cgroup", c) for c in ("cpu,cpuacct", "cpu") if Path("/sys/fs/cgroup", c).is_dir()), None)
    mem = Path("/sys/fs/cgroup/memory")
    return (mem / name if mem.is_dir() else None), (cpu / name if cpu else None)


@contextlib.contextmanager
def cgroups(memory: int, cpus: int):
    """A fresh memory cgroup limited to `memory` bytes and a CPU quota of `cpus` CPUs (one
    directory with cgroup v2, two with v1); yields the directories a process must join."""
    mem, cpu = _cgroup_pair(f"cpuserve-test-{uuid.uuid4().hex[:8]}")
    made = []
    try:
        for d in dict.fromkeys((mem, cpu)):
            d.mkdir()
            made.append(d)
        (mem / ("memory.max" if (mem / "memory.max").exists() else "memory.limit_in_bytes")).write_text(str(memory))
        if (cpu / "cpu.max").exists():
            (cpu / "cpu.max").write_text(f"{cpus * 100000} 100000")
        else:
            (cpu / "cpu.cfs_period_us").write_text("100000")
            (cpu / "cpu.cfs_quota_us").write_text(str(cpus * 100000))
        yield made
    finally:
        for d in made:
            _rmdir_when_empty(d)


def _rmdir_when_empty(d: Path) -> None:
    """A cgroup can be removed once its last process has been reaped (a moment after it exits)."""
    import time
    for _ in range(50):
        try:
            d.rmdir()
            return
        except OSError:
            time.sleep(0.1)


def generate_in(dirs: list[Path], *args: str) -> subprocess.CompletedProcess:
    """`cpuserve generate` run inside the given cgroups with no KV size or binding given."""
    env = {k: v for k, v in os.environ.items() if k not in ("VLLM_CPU_KVCACHE_SPACE", "CPUSERVE_KVCACHE_SPACE",
                                                              "VLLM_CPU_OMP_THREADS_BIND")}
    env["PYTHONPATH"] = os.pathsep.join(sys.path)
    join = "".join(f"open('{d}/cgroup.procs', 'w').write(str(__import__('os').getpid()))\n" for d in dirs)
    argv = ["cpuserve", "generate", "--prompt", "Hi", "--max-tokens", "4", "--dtype", "float32", *args]
    code = join + f"import runpy, sys; sys.argv = {argv!r}; runpy.run_module('cpuserve', run_name='__main__')"
    return subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, env=env, timeout=600)


def kv_line(stderr: str, limit: str) -> tuple[float, str]:
    line = next((ln for ln in stderr.splitlines() if "KV cache" in ln and f"memory limit {limit} GiB" in ln), None)
    assert line, stderr[-3000:]
    return float(line.split("KV cache ")[1].split(" GiB")[0]), line


CGROUPS = pytest.mark.skipif(os.geteuid() != 0 or None in _cgroup_pair("x"),
                             reason="needs root and the memory and cpu cgroups")


@CGROUPS
def test_engine_sizes_itself_from_its_cgroup():
    """No KV size given, in a cgroup of 1.6 GiB and one CPU's quota: the KV cache is what the limit
    leaves (logged with the numbers), not 4 GiB, and the engine runs one thread."""
    with cgroups(1600 << 20, 1) as dirs:
        r = generate_in(dirs)
    assert r.returncode == 0, r.stderr[-3000:]
    kv, line = kv_line(r.stderr, "1.56")
    assert 0 < kv < 1.0, line
    assert "quota of 1 CPUs" in r.stderr and "runs 1 thread" in r.stderr, r.stderr[-3000:]


@CGROUPS
@pytest.mark.skipif(len(os.sched_getaffinity(0)) < 2, reason="needs two CPUs")
def test_tensor_parallel_ranks_share_the_limit():
    """Two ranks in one 2.5 GiB cgroup: each gets half of what the limit leaves after the weights,
    both ranks' runtime and rank 1's own process; and an explicit KV size that cannot fit
    two ranks is refused at start with the numbers."""
    with cgroups(2560 << 20, 2) as dirs:
        r = generate_in(dirs, "-tp", "2")
        refused = generate_in(dirs, "-tp", "2", "--kv-cache-space", "1.5")
    assert r.returncode == 0, r.stderr[-3000:]
    kv, line = kv_line(r.stderr, "2.50")
    assert "/ 2 ranks" in line and "per rank" in line and 0 < kv < 1.0, line
    assert refused.returncode == 1 and TOO_LARGE in refused.stderr, refused.stderr[-3000:]
    assert "KV cache (1.50 GiB x 2 ranks)" in refused.stderr, refused.stderr[-3000:]


def test_default_kv_cache_from_the_limit():
    from cpuserve.worker.kv_cache import default_kv_bytes, runtime_reserve
    GiB = 1 << 30
    assert default_kv_bytes(None, 5, 5, 5) == (4 * GiB, "4 GiB (the default; no container memory limit)")
    kv, how = default_kv_bytes(2 * GiB, GiB // 4, GiB // 2, GiB // 4)
    assert kv == GiB and how.startswith("memory limit 2.00 GiB - in use 0.25 - weights 0.50 - runtime reserve 0.25")
    assert default_kv_bytes(64 * GiB, GiB, GiB, GiB)[0] == 4 * GiB  # capped at vLLM's default
    with pytest.raises(MemoryError, match=f"{TOO_LARGE}: no memory is left for a KV cache"):
        default_kv_bytes(GiB, GiB // 2, GiB // 2, 1)
    small, big = runtime_reserve(576, 1536, 49152, 512, 8), runtime_reserve(576, 1536, 49152, 2048, 256)
    assert (256 << 20) < small < big < GiB


def test_default_kv_cache_is_shared_by_the_ranks():
    from cpuserve.worker.kv_cache import default_kv_bytes
    GiB = 1 << 30
    kv, how = default_kv_bytes(4 * GiB, GiB // 2, GiB // 2, GiB, ranks=2)
    assert kv == GiB and how.endswith("= 2.00 GiB, / 2 ranks = 1.00 GiB each")
    assert default_kv_bytes(None, 0, 0, 0, ranks=2)[0] == 4 * GiB  # no limit: vLLM's 4 GiB per rank


def test_head_bytes_beyond_the_files():
    from cpuserve.worker.model_runner import head_bytes_beyond_files
    v, h = 49152, 576
    assert head_bytes_beyond_files(v, h, 4, False, 1, False) == 0
    assert head_bytes_beyond_files(v, h, 4, True, 1, False) == v * h * 4  # the tied head's own packed table
    assert head_bytes_beyond_files(v, h, 2, False, 2, False) == v * h * 2  # the table on rank 1 as well
    copies = v * h * 2 + v * h // 32 * 34 + v * 8  # bfloat16 and Q8_0 copies, a norm and an error a column
    assert head_bytes_beyond_files(v, h, 4, True, 1, True) == v * h * 4 + copies


@pytest.mark.parametrize("dtype,greedy", [("float32", "1"), ("float32", "0"), ("bfloat16", "1")])
def test_weights_estimate_is_what_loading_keeps(monkeypatch, dtype, greedy):
    """The estimate checked against the limit before anything is read, against the bytes of every
    tensor the loaded model holds (the default model: tied, so its head packs its own table; float32
    greedy rows' copies of the head)."""
    from cpuserve.entrypoints.llm import LLM
    from cpuserve.worker.model_runner import loaded_weight_bytes
    monkeypatch.setenv("CPUSERVE_GREEDY_HEAD", greedy)
    llm = LLM(dtype=dtype, quantization="none", kv_cache_space=0.05)
    r = llm.engine.core.runner
    estimate = loaded_weight_bytes(r.model_dir, r.hf_config, r.dtype, r.quantization)
    assert abs(estimate - r.weight_bytes) <= 0.01 * r.weight_bytes, (estimate, r.weight_bytes)
