#!/usr/bin/env python3
"""The engine image's torch, collected on the build machine for any target architecture.

Debian's python3-torch pulls libtorch1.13's whole dependency tree (OpenCV, FFmpeg, GDAL, Qt,
LLVM: about 1.2 GB) for caffe2 operators the engine never calls. The image keeps only torch's
Python package and the shared libraries its extension modules load, found by walking their ELF
DT_NEEDED entries the way the dynamic loader resolves them. Nothing of the target runs: the
packages are unpacked with dpkg-deb (no maintainer scripts) into STAGE, and the ELF files are
read, not executed, so a foreign architecture costs no emulation (installing torch with apt
under qemu-user took about 9 minutes per architecture).

  collect_torch.py STAGE RUNTIME_INFO TRIPLET OUT

STAGE: the root where the packages apt found missing from the runtime image were unpacked.
RUNTIME_INFO: the runtime image's /var/lib/dpkg/info (its *.list files say which libraries it
has: those are not copied). OUT: gets usr/lib/python3/dist-packages/torch, the libraries in
usr/lib/cpuserve-torch and the ld.so.conf.d entry naming that directory.
"""
from __future__ import annotations

import os
import shutil
import struct
import sys
from pathlib import Path

SITE = "usr/lib/python3/dist-packages"
LIBDIR = "usr/lib/cpuserve-torch"
DT_NEEDED, DT_STRTAB, DT_SONAME, DT_RPATH, DT_RUNPATH = 1, 5, 14, 15, 29
PT_LOAD, PT_DYNAMIC = 1, 2


class ElfInfo:
    def __init__(self, needed: list[str], soname: str | None, runpath: list[str]):
        self.needed, self.soname, self.runpath = needed, soname, runpath


def is_elf(path: Path) -> bool:
    try:
        with open(path, "rb") as f:
            return f.read(4) == b"\x7fELF"
    except OSError:
        return False


def read_dynamic(path: Path) -> ElfInfo:
    """DT_NEEDED, DT_SONAME and DT_RUNPATH (or DT_RPATH) of a 64-bit ELF file of either
    byte order (x86_64 and aarch64 are little-endian, s390x big-endian)."""
    data = path.read_bytes()
    if data[:4] != b"\x7fELF" or data[4] != 2:
        raise ValueError(f"{path}: not a 64-bit ELF file")
    e = "<" if data[5] == 1 else ">"
    phoff, = struct.unpack_from(e + "Q", data, 0x20)
    phentsize, phnum = struct.unpack_from(e + "HH", data, 0x36)
    loads, dynamic = [], None
    for i in range(phnum):
        p_type, _, p_offset, p_vaddr, _, p_filesz, _, _ = struct.unpack_from(e + "IIQQQQQQ", data, phoff + i * phentsize)
        if p_type == PT_LOAD:
            loads.append((p_vaddr, p_offset, p_filesz))
        elif p_type == PT_DYNAMIC:
            dynamic = (p_offset, p_filesz)
    if dynamic is None:
        return ElfInfo([], None, [])
    entries = []
    for off in range(dynamic[0], dynamic[0] + dynamic[1], 16):
        tag, val = struct.unpack_from(e + "qQ", data, off)
        if tag == 0:
            break
        entries.append((tag, val))
    strtab_vaddr = next(v for t, v in entries if t == DT_STRTAB)
    strtab = next(o + strtab_vaddr - va for va, o, size in loads if va <= strtab_vaddr < va + size)

    def string(index: int) -> str:
        end = data.index(b"\0", strtab + index)
        return data[strtab + index:end].decode()

    needed = [string(v) for t, v in entries if t == DT_NEEDED]
    soname = next((string(v) for t, v in entries if t == DT_SONAME), None)
    runpath = next((string(v) for t, v in entries if t == DT_RUNPATH), None)
    if runpath is None:
        runpath = next((string(v) for t, v in entries if t == DT_RPATH), None)
    return ElfInfo(needed, soname, [p for p in (runpath or "").split(":") if p])


def resolve_in(root: Path, path: str) -> Path | None:
    """PATH (absolute, as seen inside ROOT) with every symbolic link followed inside ROOT, as
    a chroot would: an absolute link target is taken from ROOT, never from this machine.
    None when something on the way is missing."""
    parts, seen, hops = [p for p in path.split("/") if p], [], 0
    while parts:
        part = parts.pop(0)
        if part == ".":
            continue
        if part == "..":
            seen = seen[:-1]
            continue
        here = root.joinpath(*seen, part)
        if here.is_symlink():
            hops += 1
            if hops > 40:
                return None
            target = os.readlink(here)
            parts = [p for p in target.split("/") if p] + parts
            if target.startswith("/"):
                seen = []
            continue
        if not here.exists():
            return None
        seen.append(part)
    return root.joinpath(*seen)


def search_dirs(root: Path, triplet: str) -> list[str]:
    """The loader's default directories, after those its configuration names."""
    dirs = []
    conf = root / "etc/ld.so.conf.d"
    if conf.is_dir():
        for f in sorted(conf.glob("*.conf")):
            dirs += [line.strip() for line in f.read_text().splitlines() if line.strip().startswith("/")]
    return dirs + [f"/lib/{triplet}", f"/usr/lib/{triplet}", "/lib", "/usr/lib"]


def runtime_libraries(info: Path) -> set[str]:
    """File names of the shared libraries the runtime image's packages installed."""
    names = set()
    for f in info.glob("*.list"):
        names.update(os.path.basename(p) for p in f.read_text().splitlines() if ".so" in os.path.basename(p))
    return names


def closure(root: Path, roots: list[str], provided: set[str], triplet: str) -> dict[str, Path]:
    """Soname -> file in ROOT for every library ROOTS (paths inside ROOT) need, directly or
    not, that PROVIDED (the runtime's library names) does not hold."""
    dirs, found, todo = search_dirs(root, triplet), {}, list(roots)
    while todo:
        inside = todo.pop()
        real = resolve_in(root, inside)
        info = read_dynamic(real)
        origin = "/" + str(real.parent.relative_to(root))  # the loader's $ORIGIN: the file's real directory
        for name in info.needed:
            if name in found or name in provided:
                continue
            candidates = [p.replace("$ORIGIN", origin).replace("${ORIGIN}", origin) for p in info.runpath] + dirs
            hit = next((f"{d}/{name}" for d in candidates if resolve_in(root, f"{d}/{name}") is not None), None)
            if hit is None:
                raise SystemExit(f"collect_torch: {name}, needed by {inside}, is neither unpacked nor in the runtime")
            found[name] = resolve_in(root, hit)
            todo.append(hit)
    return found


def collect(stage: Path, runtime_info: Path, triplet: str, out: Path) -> dict[str, Path]:
    torch = stage / SITE / "torch"
    def skipped(directory: str, names: list[str]) -> set[str]:  # no tests, headers, CMake files or stale bytecode
        top = {"test", "include", "share"} if Path(directory) == torch else set()
        return {n for n in names if n in top or n == "__pycache__"}

    shutil.copytree(torch, out / SITE / "torch", symlinks=True, ignore=skipped)
    inside = ["/" + str(p.relative_to(stage)) for p in torch.rglob("*.so*")]
    elves = sorted(p for p in inside if (real := resolve_in(stage, p)) is not None and is_elf(real))
    libs = closure(stage, elves, runtime_libraries(runtime_info), triplet)
    # torch/__init__ loads libtorch_global_deps itself (ctypes); the rest through the extension modules
    global_deps = resolve_in(stage, f"/{SITE}/torch/lib/libtorch_global_deps.so")
    libs.setdefault(read_dynamic(global_deps).soname or global_deps.name, global_deps)
    (out / LIBDIR).mkdir(parents=True, exist_ok=True)
    for name, real in sorted(libs.items()):
        shutil.copy2(real, out / LIBDIR / name)
    # torch/lib holds links into the system's library directory: point them at the copies
    for link in sorted((out / SITE / "torch/lib").iterdir()):
        if not link.is_symlink():
            continue
        target = resolve_in(stage, f"/{SITE}/torch/lib/{link.name}")
        name = read_dynamic(target).soname if target is not None else None
        link.unlink()
        if name in libs:
            link.symlink_to(f"/{LIBDIR}/{name}")
    (out / "etc/ld.so.conf.d").mkdir(parents=True, exist_ok=True)
    (out / "etc/ld.so.conf.d/cpuserve-torch.conf").write_text(f"/{LIBDIR}\n")
    return libs


def main(argv: list[str]) -> None:
    if len(argv) != 4:
        raise SystemExit(__doc__)
    stage, info, triplet, out = Path(argv[0]), Path(argv[1]), argv[2], Path(argv[3])
    libs = collect(stage, info, triplet, out)
    size = sum(p.stat().st_size for p in (out / LIBDIR).iterdir())
    print(f"torch closure: {len(libs)} libraries, {size / 2**20:.0f} MiB")


if __name__ == "__main__":
    main(sys.argv[1:])
