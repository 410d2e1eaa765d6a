"""Runs a command under a seccomp profile in the OCI/Docker JSON format (the
subset: defaultAction ALLOW or ERRNO, and `syscalls` rules of ALLOW or ERRNO with
errnoRet), compiled to a BPF filter here: `python seccomp_profile.py PROFILE -m
module args...` or `... PROFILE script.py args...`. Syscall numbers come from
this machine's <sys/syscall.h>, through a tiny C program."""
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(__file__))
from seccomp_numa import install_filter, run_rest  # noqa: E402


def syscall_numbers(names: list[str]) -> dict[str, int]:
    src = "#include <stdio.h>\n#include <sys/syscall.h>\nint main(void) {\n"
    for n in names:
        src += f"#ifdef SYS_{n}\n  printf(\"{n} %d\\n\", SYS_{n});\n#endif\n"
    src += "  return 0;\n}\n"
    with tempfile.TemporaryDirectory() as d:
        c, exe = os.path.join(d, "nr.c"), os.path.join(d, "nr")
        with open(c, "w") as f:
            f.write(src)
        subprocess.run(["gcc", c, "-o", exe], check=True)
        out = subprocess.run([exe], check=True, capture_output=True, text=True).stdout
    return {name: int(nr) for name, nr in (line.split() for line in out.splitlines())}


def actions(profile: dict) -> tuple[str, dict[int, tuple[str, int]]]:
    rules: dict[str, tuple[str, int]] = {}
    for rule in profile.get("syscalls", []):
        for name in rule["names"]:
            rules.setdefault(name, (rule["action"], int(rule.get("errnoRet", 1))))
    numbers = syscall_numbers(sorted(rules))
    return profile["defaultAction"], {numbers[n]: a for n, a in rules.items() if n in numbers}


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        default, by_nr = actions(json.load(f))
    install_filter(default, by_nr)
    run_rest(sys.argv[2:])
