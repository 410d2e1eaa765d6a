"""Installs a seccomp filter that makes the NUMA syscalls fail with EPERM, the
way Docker's default profile does without CAP_SYS_NICE, then runs the rest of
the command line (`python seccomp_numa.py -m cpuserve ...` or `... script.py`)."""
import ctypes
import errno
import platform
import runpy
import struct
import sys

# mbind, set_mempolicy, get_mempolicy, migrate_pages
NUMA_SYSCALLS = {"x86_64": (237, 238, 239, 256), "aarch64": (235, 237, 236, 238), "s390x": (268, 270, 269, 287)}


def install() -> None:
    install_filter("SCMP_ACT_ALLOW", {nr: ("SCMP_ACT_ERRNO", errno.EPERM) for nr in NUMA_SYSCALLS[platform.machine()]})


def _ret(action: str, err: int) -> int:
    if action == "SCMP_ACT_ALLOW":
        return 0x7FFF0000                           # SECCOMP_RET_ALLOW
    if action == "SCMP_ACT_ERRNO":
        return 0x00050000 | (err & 0xFFFF)          # SECCOMP_RET_ERRNO | errno
    raise ValueError(f"unsupported seccomp action {action}")


def install_filter(default: str, by_nr: dict) -> None:
    """default action for unlisted syscalls; by_nr: {number: (action, errno)}."""
    ld_nr, jeq, ret = 0x20, 0x15, 0x06             # BPF_LD|W|ABS, BPF_JMP|JEQ|K, BPF_RET|K
    prog = [(ld_nr, 0, 0, 0)]                        # A = seccomp_data.nr
    for nr, (action, err) in sorted(by_nr.items()):
        prog += [(jeq, 0, 1, nr), (ret, 0, 0, _ret(action, err))]  # match: return its action, else skip it
    prog.append((ret, 0, 0, _ret(default, errno.EPERM)))
    buf = b"".join(struct.pack("HBBI", *ins) for ins in prog)
    filt = ctypes.create_string_buffer(buf)

    class Prog(ctypes.Structure):
        _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]

    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(38, 1, 0, 0, 0) != 0:               # PR_SET_NO_NEW_PRIVS
        raise OSError(ctypes.get_errno(), "PR_SET_NO_NEW_PRIVS")
    fprog = Prog(len(prog), ctypes.cast(filt, ctypes.c_void_p))
    if libc.prctl(22, 2, ctypes.byref(fprog), 0, 0) != 0:  # PR_SET_SECCOMP, SECCOMP_MODE_FILTER
        raise OSError(ctypes.get_errno(), "PR_SET_SECCOMP")


def run_rest(args: list[str]) -> None:
    if args[0] == "-m":
        sys.argv = args[1:]
        runpy.run_module(args[1], run_name="__main__", alter_sys=True)
    else:
        sys.argv = args
        runpy.run_path(args[0], run_name="__main__")


if __name__ == "__main__":
    install()
    run_rest(sys.argv[1:])
