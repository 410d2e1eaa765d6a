"""Keeps the README's benchmark tables equal to the latest `make bench` output:
each bench script replaces the block between its markers. Every table names the CPU it ran on
(cpu_name)."""
from __future__ import annotations

import platform
import subprocess
import time
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def cpu_name(cpuinfo: str | None = None) -> str:
    """The CPU's model name with its family and model numbers: a VM may name two generations
    alike ("AMD EPYC" is Zen 4 as family 25 model 17 and Zen 5 as family 26), and a table must
    say which one it ran on."""
    try:
        text = Path("/proc/cpuinfo").read_text() if cpuinfo is None else cpuinfo
    except OSError:
        return platform.machine()
    fields: dict[str, str] = {}
    for line in text.splitlines():
        key, _, value = line.partition(":")
        fields.setdefault(key.strip(), value.strip())
    name = fields.get("model name") or platform.machine()
    if fields.get("cpu family", "").isdigit() and fields.get("model", "").isdigit():
        family, model = int(fields["cpu family"]), int(fields["model"])
        arch = amd_core(family, model) if fields.get("vendor_id") == "AuthenticAMD" else None
        name += f" (family {family}, model {model}{': ' + arch if arch else ''})"
    return name


def amd_core(family: int, model: int) -> str | None:
    """The Zen generation of an AMD family / model pair (the kernel's and AMD's own tables:
    family 0x17 is Zen to Zen 2, 0x19 Zen 3 and Zen 4, 0x1a Zen 5); None for any other."""
    if family == 0x17:
        return "Zen 2" if model >= 0x30 else "Zen / Zen+"
    if family == 0x19:
        return "Zen 4" if 0x10 <= model <= 0x1f or 0x60 <= model <= 0x7f or 0xa0 <= model <= 0xaf else "Zen 3"
    return "Zen 5" if family == 0x1a else None


def run_stamp(when: float | None = None, commit: str | None = None) -> str:
    """When and from which commit a table was measured: "2026-11-29 17:40 UTC, commit 14a80b8"
    ("+ local changes" where the engine or the benchmarks differ from it)."""
    stamp = time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime(when))
    if commit is None:
        commit = head_commit()
        if commit and _git("status", "--porcelain", "--", "engine", "benchmarks"):
            commit += " + local changes"
    return f"{stamp}, commit {commit}" if commit else stamp


def head_commit() -> str:
    """The checkout's commit, abbreviated; "" outside a git checkout."""
    return _git("rev-parse", "--short", "HEAD")


def _git(*args: str) -> str:
    try:
        out = subprocess.run(["git", *args], cwd=README.parent, capture_output=True, text=True, timeout=10)
    except (OSError, subprocess.SubprocessError):
        return ""
    return out.stdout.strip() if out.returncode == 0 else ""


def update(name: str, lines: list[str]) -> None:
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    text = README.read_text()
    if start not in text or end not in text:
        return
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    README.write_text(head + start + "\n" + "\n".join(lines).strip() + "\n" + end + tail)
