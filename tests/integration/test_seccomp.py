"""The sandbox's seccomp filter loaded into this machine's kernel, in forked
children: what it refuses gets EPERM (each call is made with arguments that the
kernel itself would refuse with another errno, so EPERM is the filter's), the
calls a job needs still work, and another ABI is killed.

No call that could change the host is ever made: only calls that fail harmlessly
if the filter let them through (the tests run as root)."""

from __future__ import annotations

import ctypes
import errno
import os
import platform
import signal
import threading
from collections.abc import Callable

import pytest

from gpuwarden.launch.seccomp import bpf_program, syscall_numbers

if platform.machine() not in ("x86_64", "aarch64"):
    pytest.skip("the filter has tables for x86_64 and aarch64 only", allow_module_level=True)

LIBC = ctypes.CDLL(None, use_errno=True)
LIBC.syscall.restype = ctypes.c_long
NR = syscall_numbers()
_PR_SET_NO_NEW_PRIVS = 38
_PR_SET_SECCOMP = 22
_SECCOMP_MODE_FILTER = 2


class _SockFprog(ctypes.Structure):
    _fields_ = [("len", ctypes.c_ushort), ("filter", ctypes.c_void_p)]


def syscall(nr: int, *args: int) -> int:
    """0 when the call succeeded, else its errno."""
    got = LIBC.syscall(ctypes.c_long(nr), *(ctypes.c_long(a) for a in args))
    return 0 if got >= 0 else ctypes.get_errno()


def filtered(fn: Callable[[], int]) -> int:
    """Run ``fn`` in a child with the filter loaded: its exit status (an errno),
    or minus the signal that killed it."""
    program = bpf_program()
    buf = ctypes.create_string_buffer(program, len(program))
    prog = _SockFprog(len(program) // 8, ctypes.cast(buf, ctypes.c_void_p))
    pid = os.fork()
    if pid == 0:
        try:
            if LIBC.prctl(_PR_SET_NO_NEW_PRIVS, 1, 0, 0, 0) != 0:
                os._exit(200)
            if LIBC.prctl(_PR_SET_SECCOMP, _SECCOMP_MODE_FILTER, ctypes.byref(prog), 0, 0) != 0:
                os._exit(201)
            os._exit(fn())
        except BaseException:
            os._exit(202)
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


def unfiltered(fn: Callable[[], int]) -> int:
    pid = os.fork()
    if pid == 0:
        os._exit(fn())
    return os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])


# calls that are harmless even if they got through: without the filter the kernel
# answers them with success or another errno (EFAULT for a NULL pointer, EBADF
# for fd -1, ...), never EPERM
HARMLESS = [
    ("keyctl", (0, -3, 0)),  # KEYCTL_GET_KEYRING_ID of the session keyring: succeeds
    ("unshare", (0x10000000,)),  # CLONE_NEWUSER, in a child that exits at once: succeeds
    ("mount", (0, 0, 0, 0, 0)),  # no source, no target
    ("umount2", (0, 0)),
    ("setns", (-1, 0)),
    ("bpf", (-1, 0, 0)),
    ("perf_event_open", (0, 0, -1, -1, 0)),
    ("ptrace", (-1, 0, 0, 0)),  # an unknown request for pid 0
    ("io_uring_setup", (0, 0)),
    ("open_by_handle_at", (-1, 0, 0)),
    ("process_vm_readv", (0, 0, 0, 0, 0, 0)),
]


@pytest.mark.parametrize(("name", "args"), HARMLESS, ids=[h[0] for h in HARMLESS])
def test_a_denied_call_gets_eperm_from_the_filter(name: str, args: tuple[int, ...]) -> None:
    nr = NR[name]
    # without the filter the kernel answers otherwise: EPERM below is the filter's
    assert unfiltered(lambda: syscall(nr, *args)) != errno.EPERM, name
    assert filtered(lambda: syscall(nr, *args)) == errno.EPERM, name


def test_unshare_of_a_user_namespace_works_here_without_the_filter() -> None:
    assert unfiltered(lambda: syscall(NR["unshare"], 0x10000000)) == 0


def test_clone_with_a_namespace_flag_is_refused_and_plain_fork_works() -> None:
    def clone_newuser() -> int:
        got = syscall(NR["clone"], 0x10000000 | signal.SIGCHLD, 0, 0, 0, 0)
        return got  # the child, if it existed, would be a copy of this one

    assert filtered(clone_newuser) == errno.EPERM

    def fork_and_thread() -> int:
        pid = os.fork()
        if pid == 0:
            os._exit(7)
        status = os.waitstatus_to_exitcode(os.waitpid(pid, 0)[1])
        # a thread is a clone without namespace flags
        t = threading.Thread(target=lambda: None)
        t.start()
        t.join()
        return 0 if status == 7 else 1

    assert filtered(fork_and_thread) == 0


def test_clone3_answers_enosys_so_that_libc_falls_back() -> None:
    assert filtered(lambda: syscall(NR["clone3"], 0, 0)) == errno.ENOSYS


def test_personality_query_works_and_other_personas_are_refused() -> None:
    assert filtered(lambda: syscall(NR["personality"], 0xFFFFFFFF)) == 0
    assert (
        filtered(lambda: syscall(NR["personality"], 0x0400000)) == errno.EPERM
    )  # READ_IMPLIES_EXEC


@pytest.mark.skipif(platform.machine() != "x86_64", reason="x32 is an x86_64 ABI")
def test_an_x32_call_kills_the_process() -> None:
    assert filtered(lambda: syscall(0x40000000 + 39)) == -signal.SIGSYS  # x32 getpid


def test_everyday_calls_pass() -> None:
    def everyday() -> int:
        with open("/proc/self/status") as f:
            f.read()
        r, w = os.pipe()
        os.write(w, b"x")
        ok = os.read(r, 1) == b"x"
        os.close(r)
        os.close(w)
        return 0 if ok and os.getpid() > 0 else 1

    assert filtered(everyday) == 0
