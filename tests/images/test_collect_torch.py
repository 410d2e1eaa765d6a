"""images/engine/collect_torch.py: the engine image's torch closure, worked out on the build
machine from ELF files it never runs. Its ELF reader is checked against binutils' readelf on
libraries of all three architectures (s390x is big-endian), and its dependency walk on small
libraries built here, laid out as a Debian package tree would be."""
from __future__ import annotations

import importlib.util
import os
import re
import shutil
import subprocess
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
_spec = importlib.util.spec_from_file_location("collect_torch", ROOT / "images/engine/collect_torch.py")
ct = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(ct)

TRIPLET = "x86_64-linux-gnu"
LIBSTDCXX = {
    "x86_64": f"/usr/lib/{TRIPLET}/libstdc++.so.6",
    "aarch64": "/usr/aarch64-linux-gnu/lib/libstdc++.so.6",
    "s390x": "/usr/s390x-linux-gnu/lib/libstdc++.so.6",
}


def readelf(path: str) -> tuple[list[str], str | None, list[str]]:
    out = subprocess.run(["readelf", "-dW", path], capture_output=True, text=True, check=True).stdout
    needed = re.findall(r"\(NEEDED\)\s+Shared library: \[(.*)\]", out)
    soname = re.findall(r"\(SONAME\)\s+Library soname: \[(.*)\]", out)
    runpath = re.findall(r"\((?:RUNPATH|RPATH)\)\s+Library (?:runpath|rpath): \[(.*)\]", out)
    return needed, soname[0] if soname else None, runpath[0].split(":") if runpath else []


@pytest.mark.parametrize("arch", sorted(LIBSTDCXX))
def test_read_dynamic_agrees_with_readelf(arch):
    path = LIBSTDCXX[arch]
    if not os.path.exists(path):
        pytest.skip(f"{path} missing: `make host-deps` installs the {arch} cross toolchain")
    info = ct.read_dynamic(Path(os.path.realpath(path)))
    needed, soname, runpath = readelf(path)
    assert (info.needed, info.soname, info.runpath) == (needed, soname, runpath)
    assert "libc.so.6" in info.needed and info.soname == "libstdc++.so.6"


def test_links_resolve_inside_the_root_never_on_this_machine(tmp_path):
    (tmp_path / "usr/lib/x/openblas").mkdir(parents=True)
    (tmp_path / "usr/lib/x/openblas/libblas.so.3").write_bytes(b"blas")
    (tmp_path / "etc/alternatives").mkdir(parents=True)
    os.symlink("/usr/lib/x/openblas/libblas.so.3", tmp_path / "etc/alternatives/libblas.so.3")
    os.symlink("/etc/alternatives/libblas.so.3", tmp_path / "usr/lib/x/libblas.so.3")
    os.symlink("../../bin/sh", tmp_path / "usr/lib/x/sh")  # exists on this machine, not in the root
    os.symlink("loop", tmp_path / "usr/lib/x/loop")
    assert ct.resolve_in(tmp_path, "/usr/lib/x/libblas.so.3") == tmp_path / "usr/lib/x/openblas/libblas.so.3"
    assert ct.resolve_in(tmp_path, "/lib/../usr/lib/x/openblas/libblas.so.3") is None  # no /lib in the root
    assert ct.resolve_in(tmp_path, "/usr/lib/x/sh") is None
    assert ct.resolve_in(tmp_path, "/usr/lib/x/loop") is None


def build_library(out: Path, soname: str, *, needs: list[Path] = (), runpath: str | None = None) -> Path:
    out.parent.mkdir(parents=True, exist_ok=True)
    src = out.parent / f"{out.name}.c"
    src.write_text(f"int f_{re.sub(r'[^a-z0-9]', '_', soname)}(void) {{ return 1; }}\n")
    args = ["gcc", "-shared", "-fPIC", "-o", str(out), str(src), f"-Wl,-soname,{soname}", "-Wl,--no-as-needed"]
    args += [str(n) for n in needs]
    if runpath:
        args.append(f"-Wl,--enable-new-dtags,-rpath,{runpath}")
    subprocess.run(args, check=True)
    src.unlink()
    return out


@pytest.fixture
def stage(tmp_path):
    """A Debian-like tree: torch's package with links into the library directory, a library
    found through $ORIGIN, one through ld.so.conf.d, one the runtime has, one it lacks."""
    if shutil.which("gcc") is None:
        pytest.skip("needs gcc")
    s = tmp_path / "stage"
    lib = s / f"usr/lib/{TRIPLET}"
    build = tmp_path / "build"
    build.mkdir()
    runtime = build_library(build / "libgomp.so.1", "libgomp.so.1")  # the runtime image has it
    deep = build_library(s / "opt/vendor/sub/libdeep.so.2", "libdeep.so.2")
    conf = build_library(s / "opt/blas/libblas.so.3", "libblas.so.3")
    (s / "etc/ld.so.conf.d").mkdir(parents=True)
    (s / "etc/ld.so.conf.d/blas.conf").write_text("# openblas\n/opt/blas\n")
    vendor = build_library(s / "opt/vendor/libvendor.so.1", "libvendor.so.1", needs=[deep], runpath="$ORIGIN/sub")
    c10 = build_library(lib / "libc10.so.1.13", "libc10.so.1.13", needs=[runtime, conf])
    cpu = build_library(lib / "libtorch_cpu.so.1.13", "libtorch_cpu.so.1.13", needs=[c10, vendor],
                        runpath="/opt/vendor")
    build_library(lib / "libtorch_global_deps.so.1.13", "libtorch_global_deps.so.1.13")
    build_library(lib / "libcaffe2_detectron_ops.so.1.13", "libcaffe2_detectron_ops.so.1.13", needs=[cpu])
    torch = s / "usr/lib/python3/dist-packages/torch"
    build_library(torch / "_C.cpython-311-x86_64-linux-gnu.so", "_C", needs=[cpu])
    (torch / "lib").mkdir()
    for name in ("libc10", "libtorch_cpu", "libtorch_global_deps", "libcaffe2_detectron_ops"):
        os.symlink(f"../../../../{TRIPLET}/{name}.so.1.13", torch / "lib" / f"{name}.so")
    for d in ("test", "include", "share", "__pycache__", "utils/__pycache__", "utils/include"):
        (torch / d).mkdir(parents=True)
        (torch / d / "x.py").write_text("")
    (torch / "__init__.py").write_text("")
    info = tmp_path / "info"
    info.mkdir()
    (info / "libgomp1:amd64.list").write_text(f"/.\n/usr/lib/{TRIPLET}/libgomp.so.1\n/usr/share/doc/libgomp1\n")
    (info / "libc6:amd64.list").write_text(f"/lib/{TRIPLET}/libc.so.6\n/lib64/ld-linux-x86-64.so.2\n")
    return s, info


def test_collects_what_torch_loads_and_points_its_links_at_the_copies(stage, tmp_path):
    s, info = stage
    out = tmp_path / "out"
    libs = ct.collect(s, info, TRIPLET, out)
    # _C's closure ($ORIGIN of libvendor's real directory, ld.so.conf.d, RUNPATH), libtorch_global_deps
    # by name, not libgomp (the runtime's); the detectron library is only a root: nothing needs it
    assert sorted(libs) == ["libblas.so.3", "libc10.so.1.13", "libdeep.so.2", "libtorch_cpu.so.1.13",
                            "libtorch_global_deps.so.1.13", "libvendor.so.1"]
    assert sorted(p.name for p in (out / ct.LIBDIR).iterdir()) == sorted(libs)
    links = {p.name: os.readlink(p) for p in (out / ct.SITE / "torch/lib").iterdir()}
    assert links == {"libc10.so": "/usr/lib/cpuserve-torch/libc10.so.1.13",
                     "libtorch_cpu.so": "/usr/lib/cpuserve-torch/libtorch_cpu.so.1.13",
                     "libtorch_global_deps.so": "/usr/lib/cpuserve-torch/libtorch_global_deps.so.1.13"}
    torch = out / ct.SITE / "torch"
    assert sorted(str(p.relative_to(torch)) for p in torch.rglob("*") if p.is_file()) == [
        "_C.cpython-311-x86_64-linux-gnu.so", "__init__.py", "utils/include/x.py"]
    assert (out / "etc/ld.so.conf.d/cpuserve-torch.conf").read_text() == "/usr/lib/cpuserve-torch\n"


def test_a_library_neither_unpacked_nor_in_the_runtime_is_an_error(stage, tmp_path):
    s, info = stage
    (s / "opt/vendor/sub/libdeep.so.2").unlink()
    with pytest.raises(SystemExit, match="libdeep.so.2, needed by /opt/vendor/libvendor.so.1, is neither"):
        ct.collect(s, info, TRIPLET, tmp_path / "out")
