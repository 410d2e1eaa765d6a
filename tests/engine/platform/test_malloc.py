"""glibc malloc settings of the model's processes: when they apply, and that a step-sized block
then comes from the heap and stays there once freed (instead of a fresh mmap per allocation)."""
from __future__ import annotations

import subprocess
import sys

from cpuserve.platform.malloc import malloc_tuning_skipped, tune_malloc


def test_skipped_when_the_user_or_tcmalloc_decides():
    assert malloc_tuning_skipped({}) is None
    assert malloc_tuning_skipped({"CPUSERVE_MALLOC_TUNE": "0"}) == "CPUSERVE_MALLOC_TUNE=0"
    assert malloc_tuning_skipped({"LD_PRELOAD": "/usr/lib/libtcmalloc_minimal.so.4"}) == "tcmalloc is preloaded"
    assert "GLIBC_TUNABLES" in malloc_tuning_skipped({"GLIBC_TUNABLES": "glibc.malloc.trim_threshold=1"})
    assert malloc_tuning_skipped({"GLIBC_TUNABLES": "glibc.rtld.nns=2"}) is None
    assert tune_malloc({"CPUSERVE_MALLOC_TUNE": "0"}) == "left as it is (CPUSERVE_MALLOC_TUNE=0)"


PROBE = r"""
import ctypes, sys
from cpuserve.platform.malloc import tune_malloc
class MallInfo2(ctypes.Structure):
    _fields_ = [(n, ctypes.c_size_t) for n in
                ("arena", "ordblks", "smblks", "hblks", "hblkhd", "usmblks", "fsmblks", "uordblks", "fordblks", "keepcost")]
libc = ctypes.CDLL(None)
libc.mallinfo2.restype = MallInfo2
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
if sys.argv[1] == "tune":
    print(tune_malloc({}), file=sys.stderr)
before = libc.mallinfo2().hblkhd
p = libc.malloc(12 << 20)  # a 2,048-token step's activation: 2,048 x 1,536 floats
mapped = libc.mallinfo2().hblkhd - before
libc.free(p)
print(mapped, libc.mallinfo2().arena)
"""


def _probe(mode: str) -> tuple[int, int]:
    r = subprocess.run([sys.executable, "-c", PROBE, mode], capture_output=True, text=True, check=True,
                       env={"PATH": "/usr/bin:/bin"})
    mapped, arena = map(int, r.stdout.split())
    return mapped, arena


def test_a_step_sized_block_stays_in_the_heap():
    mapped, _ = _probe("default")
    assert mapped >= 12 << 20  # glibc's default: its own mmap, unmapped again at free
    mapped, arena = _probe("tune")
    assert mapped == 0 and arena >= 12 << 20  # tuned: from the heap, and still there after the free


TRIM_PROBE = r"""
import ctypes
from cpuserve.platform.malloc import release_free_heap
libc = ctypes.CDLL(None)
libc.malloc.restype, libc.malloc.argtypes = ctypes.c_void_p, (ctypes.c_size_t,)
libc.free.argtypes = (ctypes.c_void_p,)
libc.mallopt(-3, 32 << 20)  # loading's temporaries below glibc's raised mmap threshold: heap blocks
libc.mallopt(-1, 1 << 30)
def resident():
    return int(open("/proc/self/statm").read().split()[1]) * 4096
blocks = [libc.malloc(4 << 20) for _ in range(24)]  # 96 MiB of temporaries, touched
for b in blocks:
    ctypes.memset(b, 1, 4 << 20)
for b in blocks[:-1]:  # the last one still in use keeps the heap's top from shrinking
    libc.free(b)
before = resident()
released = release_free_heap()
print(released, before - resident())
"""


def test_the_loads_freed_temporaries_go_back_to_the_kernel():
    r = subprocess.run([sys.executable, "-c", TRIM_PROBE], capture_output=True, text=True, check=True,
                       env={"PATH": "/usr/bin:/bin"})
    released, dropped = map(int, r.stdout.split())
    assert released == 1 and dropped >= 80 << 20, r.stdout
