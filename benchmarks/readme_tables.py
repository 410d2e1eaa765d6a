"""Keeps the README's benchmark tables equal to the latest `make bench` output:
each bench script replaces the block between its markers. Every table names the CPU it ran on
(cpu_name)."""
from __future__ import annotations

import platform
from pathlib import Path

README = Path(__file__).resolve().parent.parent / "README.md"


def cpu_name() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return line.split(":", 1)[1].strip()
    return platform.machine()


def update(name: str, lines: list[str]) -> None:
    start, end = f"<!-- bench:{name} -->", f"<!-- /bench:{name} -->"
    text = README.read_text()
    if start not in text or end not in text:
        return
    head, rest = text.split(start, 1)
    _, tail = rest.split(end, 1)
    README.write_text(head + start + "\n" + "\n".join(lines).strip() + "\n" + end + tail)
