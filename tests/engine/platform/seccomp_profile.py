"""Runs a command under a seccomp profile in the OCI runtime-spec JSON format (what
containerd passes to runc for a Localhost profile), loaded the way runc loads it, through
libseccomp: the default action and errno, the profile's architectures, and each rule's
action, errno and argument conditions (conditions on distinct arguments all must hold; several
on one argument are alternatives, one rule each). `python seccomp_profile.py PROFILE -m module
args...` or `... PROFILE script.py args...`."""
import ctypes
import json
import os
import sys

sys.path.insert(0, os.path.dirname(__file__))
from seccomp_numa import run_rest  # noqa: E402

EPERM = 1
OPS = {"SCMP_CMP_NE": 1, "SCMP_CMP_LT": 2, "SCMP_CMP_LE": 3, "SCMP_CMP_EQ": 4, "SCMP_CMP_GE": 5, "SCMP_CMP_GT": 6,
       "SCMP_CMP_MASKED_EQ": 7}


class ArgCmp(ctypes.Structure):
    _fields_ = [("arg", ctypes.c_uint), ("op", ctypes.c_int), ("datum_a", ctypes.c_uint64),
                ("datum_b", ctypes.c_uint64)]


def action(name: str, errno_ret: int | None) -> int:
    if name == "SCMP_ACT_ALLOW":
        return 0x7FFF0000
    if name == "SCMP_ACT_ERRNO":
        return 0x00050000 | ((EPERM if errno_ret is None else errno_ret) & 0xFFFF)
    if name == "SCMP_ACT_KILL_PROCESS":
        return 0x80000000
    raise ValueError(f"unsupported seccomp action {name}")


def conditions(args: list[dict]) -> list[list[dict]]:
    """runc's rule: all conditions in one rule when their argument indexes differ, else one rule each."""
    if not args:
        return [[]]
    if len({a["index"] for a in args}) == len(args):
        return [args]
    return [[a] for a in args]


def load(profile: dict) -> None:
    lib = ctypes.CDLL("libseccomp.so.2", use_errno=True)
    lib.seccomp_init.restype = ctypes.c_void_p
    lib.seccomp_arch_resolve_name.restype = ctypes.c_uint32
    lib.seccomp_rule_add_array.argtypes = [ctypes.c_void_p, ctypes.c_uint32, ctypes.c_int, ctypes.c_uint,
                                           ctypes.POINTER(ArgCmp)]
    for fn in ("seccomp_arch_add", "seccomp_load", "seccomp_attr_set"):
        getattr(lib, fn).argtypes = [ctypes.c_void_p, ctypes.c_uint32] if fn != "seccomp_load" else [ctypes.c_void_p]
    ctx = lib.seccomp_init(action(profile["defaultAction"], profile.get("defaultErrnoRet")))
    for arch in profile.get("architectures", []):
        token = lib.seccomp_arch_resolve_name(arch.replace("SCMP_ARCH_", "").lower().encode())
        rc = lib.seccomp_arch_add(ctx, token) if token else 0
        if rc not in (0, -17):  # -EEXIST: the native one
            raise OSError(-rc, f"seccomp_arch_add {arch}")
    for rule in profile.get("syscalls", []):
        act = action(rule["action"], rule.get("errnoRet"))
        for name in rule["names"]:
            nr = lib.seccomp_syscall_resolve_name(name.encode())
            if nr == -1:  # __NR_SCMP_ERROR: no such call on this architecture (runc skips it too)
                continue
            for conds in conditions(rule.get("args") or []):
                arr = (ArgCmp * max(1, len(conds)))(*[ArgCmp(a["index"], OPS[a["op"]], a["value"], a.get("valueTwo", 0))
                                                      for a in conds])
                rc = lib.seccomp_rule_add_array(ctx, act, nr, len(conds), arr)
                if rc != 0:
                    raise OSError(-rc, f"seccomp_rule_add {name} {conds}")
    rc = lib.seccomp_load(ctx)
    if rc != 0:
        raise OSError(-rc, "seccomp_load")


if __name__ == "__main__":
    with open(sys.argv[1]) as f:
        load(json.load(f))
    run_rest(sys.argv[2:])
