"""The seccomp filter, run through a small classic-BPF interpreter for both
architectures (tests/integration/test_seccomp.py loads it into the kernel of
this machine), and the podman profile derived from a default profile."""

from __future__ import annotations

import errno
import struct

import pytest

from gpuwarden.launch.seccomp import (
    CLONE_NAMESPACE_FLAGS,
    DENIED,
    PERSONALITY_ALLOWED,
    UnsupportedArchError,
    bpf_program,
    engine_profile,
    syscall_numbers,
)

ARCHES = {"x86_64": 0xC000003E, "aarch64": 0xC00000B7}
ALLOW = 0x7FFF0000
KILL = 0x80000000
EPERM = 0x00050000 | errno.EPERM
ENOSYS = 0x00050000 | errno.ENOSYS
# everyday calls that must stay allowed (read, write, openat, mmap, exit_group, getpid)
EVERYDAY = {"x86_64": (0, 1, 257, 9, 231, 39), "aarch64": (63, 64, 56, 222, 94, 172)}


def run_bpf(program: bytes, nr: int, arch: int, args: tuple[int, ...] = ()) -> int:
    """What the filter returns for one call (the opcodes the generator uses)."""
    data = struct.pack("<iIQ6Q", nr, arch, 0, *(list(args) + [0] * (6 - len(args))))
    code = [struct.unpack("<HBBI", program[i : i + 8]) for i in range(0, len(program), 8)]
    acc, pc = 0, 0
    while True:
        op, jt, jf, k = code[pc]
        if op == 0x20:  # ld [k]
            (acc,) = struct.unpack_from("<I", data, k)
            pc += 1
        elif op in (0x15, 0x35, 0x45):  # jeq, jge, jset
            hit = {0x15: acc == k, 0x35: acc >= k, 0x45: bool(acc & k)}[op]
            pc += 1 + (jt if hit else jf)
        elif op == 0x06:
            return k
        else:
            raise AssertionError(f"unexpected opcode {op:#x}")


@pytest.mark.parametrize("machine", list(ARCHES))
def test_the_deny_list_gets_eperm_and_everyday_calls_pass(machine: str) -> None:
    program = bpf_program(machine)
    arch = ARCHES[machine]
    table = syscall_numbers(machine)
    assert len(program) % 8 == 0 and len(program) // 8 < 4096
    denied = [n for n in DENIED if n in table]
    assert {"mount", "keyctl", "unshare", "setns", "bpf", "ptrace", "userfaultfd"} <= set(denied)
    for name in denied:
        assert run_bpf(program, table[name], arch) == EPERM, name
    for nr in EVERYDAY[machine]:
        assert run_bpf(program, nr, arch) == ALLOW, nr
    assert run_bpf(program, table["clone3"], arch) == ENOSYS  # libc falls back to clone


@pytest.mark.parametrize("machine", list(ARCHES))
def test_clone_is_refused_with_any_namespace_flag_only(machine: str) -> None:
    program, arch = bpf_program(machine), ARCHES[machine]
    clone = syscall_numbers(machine)["clone"]
    thread = 0x3D0F00  # what pthread_create passes
    assert run_bpf(program, clone, arch, (thread,)) == ALLOW
    assert run_bpf(program, clone, arch, (17,)) == ALLOW  # fork(): SIGCHLD
    for bit in range(32):
        flag = 1 << bit
        if flag & CLONE_NAMESPACE_FLAGS:
            assert run_bpf(program, clone, arch, (flag | 17,)) == EPERM, hex(flag)


@pytest.mark.parametrize("machine", list(ARCHES))
def test_personality_allows_only_the_docker_values(machine: str) -> None:
    program, arch = bpf_program(machine), ARCHES[machine]
    nr = syscall_numbers(machine)["personality"]
    for value in PERSONALITY_ALLOWED:
        assert run_bpf(program, nr, arch, (value,)) == ALLOW, hex(value)
    for value in (0x0400000, 0x1, 0x20000 | 0x0400000, (1 << 32) | 0x8, 2**64 - 1):
        assert run_bpf(program, nr, arch, (value,)) == EPERM, hex(value)


def test_another_abi_is_killed() -> None:
    x86 = bpf_program("x86_64")
    assert run_bpf(x86, 39, 0x40000003) == KILL  # i386 through int 0x80
    assert run_bpf(x86, 0x40000000 + 39, ARCHES["x86_64"]) == KILL  # x32
    arm = bpf_program("aarch64")
    assert run_bpf(arm, 20, 0x40000028) == KILL  # 32-bit ARM compat
    assert run_bpf(arm, 172, ARCHES["x86_64"]) == KILL


def test_big_endian_programs_read_the_argument_words_the_other_way() -> None:
    little, big = bpf_program("aarch64", "little"), bpf_program("aarch64", "big")
    assert len(little) == len(big) and little != big


def test_an_unknown_machine_is_refused_clearly() -> None:
    with pytest.raises(UnsupportedArchError, match="only x86_64 and aarch64"):
        bpf_program("riscv64")


PODMAN_LIKE = {
    "defaultAction": "SCMP_ACT_ERRNO",
    "defaultErrnoRet": 38,
    "archMap": [{"architecture": "SCMP_ARCH_X86_64", "subArchitectures": ["SCMP_ARCH_X86"]}],
    "syscalls": [
        {
            "names": ["read", "write", "unshare", "mount", "keyctl", "clone", "clone3"],
            "action": "SCMP_ACT_ALLOW",
        },
        {"names": ["setns"], "action": "SCMP_ACT_ALLOW", "includes": {"caps": ["CAP_SYS_ADMIN"]}},
        {"names": ["bpf"], "action": "SCMP_ACT_ERRNO", "errnoRet": 1},
        {"name": "ptrace", "action": "SCMP_ACT_ALLOW"},
        {
            "names": ["personality"],
            "action": "SCMP_ACT_ALLOW",
            "args": [{"index": 0, "value": 8, "op": "SCMP_CMP_EQ"}],
        },
    ],
}


def test_the_engine_profile_is_the_default_without_the_deny_list() -> None:
    profile = engine_profile(PODMAN_LIKE)
    assert profile["defaultAction"] == "SCMP_ACT_ERRNO" and profile["archMap"]
    allowed = {
        n for r in profile["syscalls"] if r["action"] == "SCMP_ACT_ALLOW" for n in r["names"]
    }
    assert {"read", "write", "personality"} <= allowed
    for name in ("unshare", "mount", "keyctl", "setns", "bpf", "ptrace", "clone3"):
        assert name not in allowed, name
    (denied,) = [
        r for r in profile["syscalls"] if r.get("errnoRet") == errno.EPERM and "mount" in r["names"]
    ]
    assert set(denied["names"]) == set(DENIED) and denied["action"] == "SCMP_ACT_ERRNO"
    (clone,) = [r for r in profile["syscalls"] if r["names"] == ["clone"]]
    assert clone["action"] == "SCMP_ACT_ALLOW"
    assert clone["args"] == [
        {"index": 0, "value": CLONE_NAMESPACE_FLAGS, "valueTwo": 0, "op": "SCMP_CMP_MASKED_EQ"}
    ]
    (clone3,) = [r for r in profile["syscalls"] if r["names"] == ["clone3"]]
    assert (clone3["action"], clone3["errnoRet"]) == ("SCMP_ACT_ERRNO", errno.ENOSYS)
    assert PODMAN_LIKE["syscalls"][0]["names"][2] == "unshare"  # the input is left as it was
