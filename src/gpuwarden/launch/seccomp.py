"""The sandbox's seccomp filter: the system calls a sandboxed job never needs.

Two forms of one policy (SPEC.md, section 14, "System calls"):

- :func:`bpf_program` is a classic BPF program for bubblewrap's ``--seccomp FD``
  (raw ``struct sock_filter`` entries, native byte order). It allows every
  system call except the deny-list, which returns ``EPERM``; ``clone`` with a
  namespace flag returns ``EPERM``; ``clone3`` returns ``ENOSYS`` (its flags are
  in memory a filter cannot read, and C libraries fall back to ``clone`` on
  ``ENOSYS``, as under Docker's default profile); ``personality`` is allowed
  only with the values Docker's default profile allows. A call from another
  ABI (32-bit x86 or ARM through the compat entry, x32 on x86_64) kills the
  process: the numbers differ there, so the deny-list would not hold.
- :func:`engine_profile` takes a container runtime's default profile (an OCI
  seccomp JSON: an allow-list) and removes the deny-list from it. Podman's
  default profile allows ``unshare``, ``mount``, ``keyctl``, ``clone`` with any
  flag and more, relying on dropped capabilities; with it a job could create a
  user namespace. Docker's built-in default already refuses all of these to a
  container without ``CAP_SYS_ADMIN`` and is used as it is.

The deny-list is modelled on the system calls Docker's default profile refuses
to an unprivileged container, minus those a job may reasonably use (NUMA
placement, ``adjtimex`` to read the clock) and plus ``ptrace`` and its
relatives, which a batch job does not need and which are kernel attack surface.
Only x86_64 and aarch64 are supported.
"""

from __future__ import annotations

import copy
import errno
import platform
import struct
import sys
from collections.abc import Mapping
from typing import Any

from gpuwarden.errors import GpuwardenError

__all__ = [
    "CLONE_NAMESPACE_FLAGS",
    "DENIED",
    "PERSONALITY_ALLOWED",
    "UnsupportedArchError",
    "bpf_program",
    "engine_profile",
    "syscall_numbers",
]


class UnsupportedArchError(GpuwardenError):
    """The filter has no syscall table for this machine."""


#: system calls refused with EPERM, and why (the SPEC table is built from this)
DENIED: dict[str, str] = {
    # the kernel itself
    "kexec_load": "load a new kernel",
    "kexec_file_load": "load a new kernel",
    "init_module": "load a kernel module",
    "finit_module": "load a kernel module",
    "delete_module": "unload a kernel module",
    "create_module": "obsolete module call",
    "get_kernel_syms": "obsolete module call",
    "query_module": "obsolete module call",
    "reboot": "reboot the host",
    "swapon": "host swap",
    "swapoff": "host swap",
    "acct": "process accounting for the host",
    "settimeofday": "set the host's clock",
    "clock_settime": "set the host's clock",
    "clock_adjtime": "adjust the host's clock",
    "quotactl": "file system quotas",
    "quotactl_fd": "file system quotas",
    "syslog": "the kernel log",
    "lookup_dcookie": "kernel profiling",
    "nfsservctl": "obsolete NFS server call",
    "uselib": "obsolete library loading",
    "_sysctl": "obsolete sysctl call",
    "sysfs": "obsolete file system listing",
    "ustat": "obsolete file system statistics",
    "vhangup": "hang up the terminal",
    "iopl": "raw I/O ports",
    "ioperm": "raw I/O ports",
    # mounts and namespaces: the sandbox's shape is fixed
    "mount": "mount a file system",
    "umount2": "unmount a file system",
    "pivot_root": "change the root file system",
    "fsopen": "mount a file system (new mount API)",
    "fsconfig": "mount a file system (new mount API)",
    "fsmount": "mount a file system (new mount API)",
    "fspick": "mount a file system (new mount API)",
    "move_mount": "move a mount (new mount API)",
    "open_tree": "clone a mount (new mount API)",
    "mount_setattr": "change a mount (new mount API)",
    "unshare": "new namespaces (a user namespace gives back capabilities)",
    "setns": "enter another namespace",
    # unprivileged kernel attack surface
    "bpf": "eBPF programs",
    "perf_event_open": "performance counters",
    "userfaultfd": "user-space page faults (used to win kernel races)",
    "keyctl": "the kernel keyring (not namespaced)",
    "add_key": "the kernel keyring (not namespaced)",
    "request_key": "the kernel keyring (not namespaced)",
    "io_uring_setup": "io_uring",
    "io_uring_enter": "io_uring",
    "io_uring_register": "io_uring",
    "open_by_handle_at": "open a file by handle, past the mount namespace",
    "name_to_handle_at": "file handles (pairs with open_by_handle_at)",
    "fanotify_init": "file system wide notification",
    # other processes' memory
    "ptrace": "trace another process",
    "process_vm_readv": "read another process's memory",
    "process_vm_writev": "write another process's memory",
    "pidfd_getfd": "take another process's file descriptor",
    "kcmp": "compare kernel objects of processes",
}

#: ``clone`` flags that make a namespace: refused (Docker's mask 0x7E020000)
CLONE_NAMESPACE_FLAGS = (
    0x00020000  # CLONE_NEWNS
    | 0x02000000  # CLONE_NEWCGROUP
    | 0x04000000  # CLONE_NEWUTS
    | 0x08000000  # CLONE_NEWIPC
    | 0x10000000  # CLONE_NEWUSER
    | 0x20000000  # CLONE_NEWPID
    | 0x40000000  # CLONE_NEWNET
)
#: the ``personality`` values allowed (Docker's default profile): PER_LINUX,
#: PER_LINUX32, UNAME26, UNAME26|PER_LINUX32, and the query 0xffffffff
PERSONALITY_ALLOWED = (0x0, 0x8, 0x20000, 0x20008, 0xFFFFFFFF)

# system call numbers, from the kernel's unistd tables (x86_64: unistd_64.h;
# aarch64: asm-generic/unistd.h); absent: the call does not exist there
_X86_64: dict[str, int] = {
    "kexec_load": 246,
    "kexec_file_load": 320,
    "init_module": 175,
    "finit_module": 313,
    "delete_module": 176,
    "create_module": 174,
    "get_kernel_syms": 177,
    "query_module": 178,
    "reboot": 169,
    "swapon": 167,
    "swapoff": 168,
    "acct": 163,
    "settimeofday": 164,
    "clock_settime": 227,
    "clock_adjtime": 305,
    "quotactl": 179,
    "quotactl_fd": 443,
    "syslog": 103,
    "lookup_dcookie": 212,
    "nfsservctl": 180,
    "uselib": 134,
    "_sysctl": 156,
    "sysfs": 139,
    "ustat": 136,
    "vhangup": 153,
    "iopl": 172,
    "ioperm": 173,
    "mount": 165,
    "umount2": 166,
    "pivot_root": 155,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "move_mount": 429,
    "open_tree": 428,
    "mount_setattr": 442,
    "unshare": 272,
    "setns": 308,
    "bpf": 321,
    "perf_event_open": 298,
    "userfaultfd": 323,
    "keyctl": 250,
    "add_key": 248,
    "request_key": 249,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "open_by_handle_at": 304,
    "name_to_handle_at": 303,
    "fanotify_init": 300,
    "ptrace": 101,
    "process_vm_readv": 310,
    "process_vm_writev": 311,
    "pidfd_getfd": 438,
    "kcmp": 312,
    "clone": 56,
    "clone3": 435,
    "personality": 135,
}
_AARCH64: dict[str, int] = {
    "kexec_load": 104,
    "kexec_file_load": 294,
    "init_module": 105,
    "finit_module": 273,
    "delete_module": 106,
    "reboot": 142,
    "swapon": 224,
    "swapoff": 225,
    "acct": 89,
    "settimeofday": 170,
    "clock_settime": 112,
    "clock_adjtime": 266,
    "quotactl": 60,
    "quotactl_fd": 443,
    "syslog": 116,
    "lookup_dcookie": 18,
    "nfsservctl": 42,
    "vhangup": 58,
    "mount": 40,
    "umount2": 39,
    "pivot_root": 41,
    "fsopen": 430,
    "fsconfig": 431,
    "fsmount": 432,
    "fspick": 433,
    "move_mount": 429,
    "open_tree": 428,
    "mount_setattr": 442,
    "unshare": 97,
    "setns": 268,
    "bpf": 280,
    "perf_event_open": 241,
    "userfaultfd": 282,
    "keyctl": 219,
    "add_key": 217,
    "request_key": 218,
    "io_uring_setup": 425,
    "io_uring_enter": 426,
    "io_uring_register": 427,
    "open_by_handle_at": 265,
    "name_to_handle_at": 264,
    "fanotify_init": 262,
    "ptrace": 117,
    "process_vm_readv": 270,
    "process_vm_writev": 271,
    "pidfd_getfd": 438,
    "kcmp": 272,
    "clone": 220,
    "clone3": 435,
    "personality": 92,
}
#: machine name -> (AUDIT_ARCH_*, syscall table, first x32 number or None)
_ARCHES: dict[str, tuple[int, dict[str, int], int | None]] = {
    "x86_64": (0xC000003E, _X86_64, 0x40000000),
    "aarch64": (0xC00000B7, _AARCH64, None),
}

# classic BPF
_LD_W_ABS = 0x20  # BPF_LD | BPF_W | BPF_ABS
_JEQ_K = 0x15  # BPF_JMP | BPF_JEQ | BPF_K
_JGE_K = 0x35  # BPF_JMP | BPF_JGE | BPF_K
_JSET_K = 0x45  # BPF_JMP | BPF_JSET | BPF_K
_RET_K = 0x06  # BPF_RET | BPF_K
_RET_KILL_PROCESS = 0x80000000
_RET_ERRNO = 0x00050000
_RET_ALLOW = 0x7FFF0000
# struct seccomp_data: int nr; __u32 arch; __u64 instruction_pointer; __u64 args[6]
_OFF_NR = 0
_OFF_ARCH = 4
_MAX_JUMP = 255


def _machine(machine: str | None) -> str:
    name = machine or platform.machine()
    return {"amd64": "x86_64", "arm64": "aarch64"}.get(name.lower(), name.lower())


def syscall_numbers(machine: str | None = None) -> dict[str, int]:
    """The numbers of the calls the filter names, on ``machine`` (default: this one)."""
    arch = _ARCHES.get(_machine(machine))
    if arch is None:
        raise UnsupportedArchError(
            f"no seccomp syscall table for {_machine(machine)!r} (only x86_64 and aarch64)"
        )
    return dict(arch[1])


def _arg_offsets(index: int, byteorder: str) -> tuple[int, int]:
    """Offsets of the low and high 32 bits of ``args[index]`` in seccomp_data."""
    base = 16 + 8 * index
    return (base, base + 4) if byteorder == "little" else (base + 4, base)


class _Program:
    def __init__(self) -> None:
        self.code: list[tuple[int, int, int, int]] = []

    def op(self, code: int, k: int, jt: int = 0, jf: int = 0) -> None:
        if not (0 <= jt <= _MAX_JUMP and 0 <= jf <= _MAX_JUMP):
            raise ValueError("a BPF jump is longer than 255 instructions")
        self.code.append((code, jt, jf, k & 0xFFFFFFFF))

    def pack(self, byteorder: str) -> bytes:
        fmt = ("<" if byteorder == "little" else ">") + "HBBI"
        return b"".join(struct.pack(fmt, *ins) for ins in self.code)


def bpf_program(machine: str | None = None, byteorder: str = sys.byteorder) -> bytes:
    """The filter as bubblewrap's ``--seccomp`` reads it (see the module docstring)."""
    audit_arch, table, x32 = _ARCHES.get(_machine(machine)) or (0, {}, None)
    if not table:
        syscall_numbers(machine)  # raises with the reason
    low, high = _arg_offsets(0, byteorder)
    eperm = _RET_ERRNO | errno.EPERM
    p = _Program()
    p.op(_LD_W_ABS, _OFF_ARCH)
    p.op(_JEQ_K, audit_arch, jt=1)
    p.op(_RET_K, _RET_KILL_PROCESS)
    p.op(_LD_W_ABS, _OFF_NR)
    if x32 is not None:
        p.op(_JGE_K, x32, jf=1)
        p.op(_RET_K, _RET_KILL_PROCESS)
    # clone: refused with a namespace flag in its first argument (the low word:
    # the kernel reads clone()'s flags as 32 bits)
    p.op(_JEQ_K, table["clone"], jf=4)
    p.op(_LD_W_ABS, low)
    p.op(_JSET_K, CLONE_NAMESPACE_FLAGS, jf=1)
    p.op(_RET_K, eperm)
    p.op(_RET_K, _RET_ALLOW)
    # clone3: ENOSYS, so that the C library falls back to clone
    p.op(_JEQ_K, table["clone3"], jf=1)
    p.op(_RET_K, _RET_ERRNO | errno.ENOSYS)
    # personality: only the allowed values, with a zero high word
    allowed = PERSONALITY_ALLOWED
    p.op(_JEQ_K, table["personality"], jf=3 + len(allowed) + 2)
    p.op(_LD_W_ABS, high)
    p.op(_JEQ_K, 0, jf=1 + len(allowed))
    p.op(_LD_W_ABS, low)
    for i, value in enumerate(allowed):
        p.op(_JEQ_K, value, jt=len(allowed) - i)
    p.op(_RET_K, eperm)
    p.op(_RET_K, _RET_ALLOW)
    # the deny-list: each match jumps to the one EPERM at the end
    denied = sorted({table[name] for name in DENIED if name in table})
    for i, nr in enumerate(denied):
        p.op(_JEQ_K, nr, jt=len(denied) - i)
    p.op(_RET_K, _RET_ALLOW)
    p.op(_RET_K, eperm)
    return p.pack(byteorder)


def engine_profile(default: Mapping[str, Any]) -> dict[str, Any]:
    """``default`` (a runtime's OCI seccomp profile) without the deny-list: the
    denied calls are taken out of every rule and refused with EPERM, ``clone``
    is allowed only without namespace flags (with one, the profile's default
    action refuses it) and ``clone3`` answers ENOSYS."""
    profile = copy.deepcopy(dict(default))
    taken = {*DENIED, "clone", "clone3"}
    rules = []
    for rule in profile.get("syscalls") or []:
        if not isinstance(rule, dict):
            continue
        names = [n for n in rule.get("names") or [] if n not in taken]
        if rule.get("name") in taken:
            continue
        if "names" in rule and not names:
            continue
        if "names" in rule:
            rule["names"] = names
        rules.append(rule)
    rules.append({"names": sorted(DENIED), "action": "SCMP_ACT_ERRNO", "errnoRet": errno.EPERM})
    rules.append(
        {
            "names": ["clone"],
            "action": "SCMP_ACT_ALLOW",
            "args": [
                {
                    "index": 0,
                    "value": CLONE_NAMESPACE_FLAGS,
                    "valueTwo": 0,
                    "op": "SCMP_CMP_MASKED_EQ",
                }
            ],
        }
    )
    rules.append({"names": ["clone3"], "action": "SCMP_ACT_ERRNO", "errnoRet": errno.ENOSYS})
    profile["syscalls"] = rules
    return profile
