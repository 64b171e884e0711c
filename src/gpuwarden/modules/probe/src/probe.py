"""probe.sandbox and probe.gpu: report what the environment a job runs in allows.

Writes ``report.json`` to the output directory (and prints it), and a one-line
summary to ``$GPUWARDEN_RESULT``. It judges nothing: the caller (a test,
``gpuwarden doctor``, an operator) decides what is acceptable. The job exits 0
when the report was written and 1 when it could not be.

Standard library only: it must run with the bare python3 of a sandbox image.
Follows docs/MODULE_GUIDE.md.
"""

from __future__ import annotations

import ctypes
import errno
import fnmatch
import json
import os
import platform
import resource
import secrets
import socket
import sys
import time
from collections.abc import Callable
from typing import Any

CONNECT_TIMEOUT_S = 3.0
#: how long ``wait_for`` waits for its file at most
WAIT_FOR_S = 30.0
#: keyctl's number (the probe's own: it runs with a bare python3)
KEYCTL_NR = {"x86_64": 250, "aarch64": 219}
_CLONE_NEWUSER = 0x10000000
_KEYCTL_GET_KEYRING_ID = 0
_KEY_SPEC_SESSION_KEYRING = -3
_MIB = 2**20
#: what a check of a path says when the environment variable naming it is unset
UNSET = "is not set"


def describe(exc: BaseException) -> str:
    """``"EROFS: Read-only file system"`` for an OSError, else ``"Type: message"``."""
    if isinstance(exc, socket.gaierror):
        return f"gaierror: {exc.strerror or exc}"
    if isinstance(exc, OSError) and exc.errno:
        name = errno.errorcode.get(exc.errno, str(exc.errno))
        return f"{name}: {exc.strerror}"
    text = str(exc)
    return f"{type(exc).__name__}: {text}" if text else type(exc).__name__


def check(path: str, ok: bool, error: str = "") -> dict[str, Any]:
    return {"path": path, "ok": ok, "error": error}


# ---------------------------------------------------------------------------
# identity and privileges


def proc_status() -> dict[str, str]:
    fields: dict[str, str] = {}
    with open("/proc/self/status") as f:
        for line in f:
            key, _, value = line.partition(":")
            fields[key.strip()] = value.strip()
    return fields


def uid_map() -> str:
    """``/proc/self/uid_map`` on one line. Inside bubblewrap it reads the same
    whether the sandbox's user is root on the host or not (bubblewrap nests a
    user namespace): the host uid is seen from the host, not from here."""
    with open("/proc/self/uid_map") as f:
        return " ".join(f.read().split())


def int_or_none(text: str | None) -> int | None:
    try:
        return None if text is None else int(text)
    except ValueError:
        return None


# ---------------------------------------------------------------------------
# network


def interfaces(errors: dict[str, str]) -> list[str]:
    try:
        return [name for _, name in socket.if_nameindex()]
    except OSError as exc:
        first = f"if_nameindex: {describe(exc)}"
    try:
        names = sorted(os.listdir("/sys/class/net"))
    except OSError as exc:
        raise RuntimeError(f"{first}; /sys/class/net: {describe(exc)}") from None
    errors["interfaces"] = f"{first}; listed /sys/class/net instead"
    return names


def split_target(target: str) -> tuple[str, int]:
    host, sep, port = target.rpartition(":")
    if not sep or not host or not port.isdigit():
        raise ValueError(f"connect must look like host:port, got {target!r}")
    return host.strip("[]"), int(port)


def connect(target: str) -> dict[str, Any]:
    """Try one TCP connection. ``kind`` is a short word for the summary."""
    result: dict[str, Any] = {"target": target, "ok": False, "error": "", "kind": "skipped"}
    if not target:
        return result
    try:
        host, port = split_target(target)
        with socket.create_connection((host, port), timeout=CONNECT_TIMEOUT_S):
            pass
    except ValueError as exc:
        result.update(error=describe(exc), kind="bad target")
    except TimeoutError as exc:  # before OSError: it is one
        result.update(error=describe(exc), kind="timed out")
    except socket.gaierror as exc:
        result.update(error=describe(exc), kind="no name resolution")
    except OSError as exc:
        kind = {
            errno.ECONNREFUSED: "refused",
            errno.ENETUNREACH: "network unreachable",
            errno.EHOSTUNREACH: "host unreachable",
            errno.EACCES: "not permitted",
            errno.EPERM: "not permitted",
        }.get(exc.errno or 0, "failed")
        result.update(error=describe(exc), kind=kind)
    else:
        result.update(ok=True, kind="ok")
    return result


# ---------------------------------------------------------------------------
# file systems


def try_create(directory: str | None, what: str = "") -> dict[str, Any]:
    """Create, write and remove a new file in ``directory``; ok when the write succeeded."""
    if not directory:
        return check("", False, f"{what} {UNSET}".strip())
    path = os.path.join(directory, f".gpuwarden-probe-{os.getpid()}-{secrets.token_hex(4)}")
    result = check(directory, False)
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        result["error"] = describe(exc)
        return result
    try:
        os.write(fd, b"gpuwarden probe\n")
        result["ok"] = True
    except OSError as exc:
        result["error"] = describe(exc)
    finally:
        os.close(fd)
        try:
            os.unlink(path)
        except OSError as exc:
            result["cleanup_error"] = describe(exc)
    return result


def try_read(path: str) -> dict[str, Any]:
    try:
        with open(path, "rb") as f:
            f.read(1)
    except OSError as exc:
        return check(path, False, describe(exc))
    return check(path, True)


def try_open_for_writing(path: str) -> dict[str, Any]:
    """ok when the file opens for writing (append, nothing is written: it stays as it was)."""
    try:
        fd = os.open(path, os.O_WRONLY | os.O_APPEND)
    except OSError as exc:
        return check(path, False, describe(exc))
    os.close(fd)
    return check(path, True)


def marker(path: str) -> dict[str, Any]:
    """``visible``: True when the path can be stat'ed, False when it is not there
    (ENOENT, ENOTDIR), None when that cannot be told (EACCES: a folder on the way
    cannot be searched; the path may be there)."""
    result: dict[str, Any] = {
        "path": path,
        "exists": os.path.exists(path),
        "stat": None,
        "error": "",
    }
    try:
        st = os.stat(path)
    except OSError as exc:
        result["error"] = describe(exc)
        gone = exc.errno in {errno.ENOENT, errno.ENOTDIR} and not result["exists"]
        result["visible"] = False if gone else None
    else:
        result["stat"] = {
            "mode": oct(st.st_mode),
            "uid": st.st_uid,
            "gid": st.st_gid,
            "size": st.st_size,
            "ino": st.st_ino,
        }
        result["visible"] = True
    return result


def mounts() -> list[dict[str, str]]:
    out = []
    with open("/proc/self/mounts") as f:
        for line in f:
            parts = line.split()
            if len(parts) >= 4:
                out.append({"target": parts[1], "fstype": parts[2], "options": parts[3]})
    return out


# ---------------------------------------------------------------------------
# processes, limits, devices


def rlimits() -> dict[str, dict[str, int | None]]:
    def value(v: int) -> int | None:
        return None if v == resource.RLIM_INFINITY else v  # None: unlimited

    out = {}
    for name in ("RLIMIT_NPROC", "RLIMIT_NOFILE", "RLIMIT_CPU"):
        soft, hard = resource.getrlimit(getattr(resource, name))
        out[name] = {"soft": value(soft), "hard": value(hard)}
    return out


def pid1() -> str:
    with open("/proc/1/cmdline", "rb") as f:
        raw = f.read()
    return " ".join(p.decode(errors="replace") for p in raw.split(b"\0") if p)


def nvidia_devices() -> list[str]:
    return sorted(n for n in os.listdir("/dev") if fnmatch.fnmatch(n, "nvidia*"))


# ---------------------------------------------------------------------------
# what the kernel lets it do: namespaces, mounts, the keyring (seccomp), limits


def _libc() -> Any:
    return ctypes.CDLL(None, use_errno=True)


def _errno_check(result: int) -> dict[str, Any]:
    if result == 0:
        return {"ok": True, "error": ""}
    err = ctypes.get_errno()
    return {"ok": False, "error": f"{errno.errorcode.get(err, str(err))}: {os.strerror(err)}"}


def userns() -> dict[str, Any]:
    """Whether a child can make a user namespace (``unshare -U``): it tries in a
    forked child, so the probe itself keeps its namespaces."""
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: one try, its errno back through the pipe
        os.close(read)
        code = 0 if _libc().unshare(ctypes.c_int(_CLONE_NEWUSER)) == 0 else ctypes.get_errno()
        os.write(write, str(code).encode())
        os._exit(0)
    os.close(write)
    with os.fdopen(read) as f:
        said = f.read()
    os.waitpid(pid, 0)
    code = int(said or -1)
    if code == 0:
        return {"ok": True, "error": ""}
    if code < 0:
        return {"ok": False, "error": "the child said nothing"}
    return {"ok": False, "error": f"{errno.errorcode.get(code, str(code))}: {os.strerror(code)}"}


def try_mount() -> dict[str, Any]:
    """Whether it can mount a tmpfs (on a fresh folder in /tmp; unmounted again)."""
    target = f"/tmp/.gpuwarden-probe-mount-{os.getpid()}"
    try:
        os.mkdir(target)
    except OSError as exc:
        return {"ok": False, "error": f"cannot make {target}: {describe(exc)}"}
    try:
        libc = _libc()
        result = _errno_check(libc.mount(b"none", target.encode(), b"tmpfs", 0, None))
        if result["ok"]:
            libc.umount2(target.encode(), 2)  # MNT_DETACH
        return result
    finally:
        os.rmdir(target)


def keyctl() -> dict[str, Any]:
    """keyctl(KEYCTL_GET_KEYRING_ID, session): allowed for any process by the
    kernel; a seccomp filter that refuses it answers EPERM."""
    nr = KEYCTL_NR.get(platform.machine())
    if nr is None:
        return {"ok": False, "error": f"no keyctl number for {platform.machine()}"}
    libc = _libc()
    libc.syscall.restype = ctypes.c_long
    got = libc.syscall(
        ctypes.c_long(nr),
        ctypes.c_long(_KEYCTL_GET_KEYRING_ID),
        ctypes.c_long(_KEY_SPEC_SESSION_KEYRING),
        ctypes.c_long(0),
    )
    return _errno_check(0 if got >= 0 else -1)


def tmp_size() -> dict[str, Any]:
    st = os.statvfs("/tmp")
    return {"size_bytes": st.f_blocks * st.f_frsize, "free_bytes": st.f_bavail * st.f_frsize}


def fill(path: str, mib: int) -> dict[str, Any]:
    """Write ``mib`` MiB to a new file at ``path`` (1 MiB at a time, each
    flushed to the file system) until done or refused; the file is left."""
    result: dict[str, Any] = {"path": path, "asked_mib": mib, "written_bytes": 0, "error": ""}
    chunk = b"\0" * _MIB
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
    except OSError as exc:
        result["error"] = describe(exc)
        return result
    try:
        for _ in range(mib):
            os.write(fd, chunk)
            result["written_bytes"] += len(chunk)
    except OSError as exc:
        result["error"] = describe(exc)
    finally:
        os.close(fd)
    return result


def fork_many(count: int) -> dict[str, Any]:
    """Fork up to ``count`` children that wait (all alive at once), then let them
    go: how many it got before fork failed, and why it failed."""
    result: dict[str, Any] = {"asked": count, "made": 0, "error": ""}
    read, write = os.pipe()
    children = []
    try:
        for _ in range(count):
            try:
                pid = os.fork()
            except OSError as exc:
                result["error"] = describe(exc)
                break
            if pid == 0:  # wait until the parent closes the pipe, then leave
                os.close(write)
                try:
                    os.read(read, 1)
                finally:
                    os._exit(0)
            children.append(pid)
    finally:
        os.close(write)
        os.close(read)
        for pid in children:
            os.waitpid(pid, 0)
    result["made"] = len(children)
    return result


def wait_for(name: str) -> dict[str, Any]:
    """Wait (up to WAIT_FOR_S) for the file ``name`` in the output folder: the
    caller checks the sandbox from outside first, then lets the probe go on."""
    path = os.path.join(os.environ.get("GPUWARDEN_OUTPUT_DIR", "."), name)
    deadline = time.monotonic() + WAIT_FOR_S
    while not os.path.exists(path):
        if time.monotonic() >= deadline:
            return {"path": path, "ok": False}
        time.sleep(0.05)
    return {"path": path, "ok": True}


# ---------------------------------------------------------------------------
# CUDA (probe.gpu)


def libcuda() -> dict[str, Any]:
    """cuInit(0) and cuDeviceGetCount through the driver library, with ctypes."""
    import ctypes

    res: dict[str, Any] = {
        "ok": False,
        "error": "",
        "driver_version": None,
        "device_count": None,
        "devices": [],
    }
    try:
        lib = ctypes.CDLL("libcuda.so.1")
    except OSError as exc:
        res["error"] = f"cannot load libcuda.so.1: {exc}"
        return res

    def name(code: int) -> str:
        text = ctypes.c_char_p()
        if lib.cuGetErrorName(code, ctypes.byref(text)) == 0 and text.value:
            return f"{text.value.decode()} ({code})"
        return str(code)

    rc = lib.cuInit(0)
    if rc != 0:
        res["error"] = f"cuInit(0) failed: {name(rc)}"
        return res
    version = ctypes.c_int()
    if lib.cuDriverGetVersion(ctypes.byref(version)) == 0:
        res["driver_version"] = version.value
    count = ctypes.c_int()
    rc = lib.cuDeviceGetCount(ctypes.byref(count))
    if rc != 0:
        res["error"] = f"cuDeviceGetCount failed: {name(rc)}"
        return res
    res["device_count"] = count.value
    get_uuid = getattr(lib, "cuDeviceGetUuid_v2", None) or getattr(lib, "cuDeviceGetUuid", None)
    for i in range(count.value):
        dev = ctypes.c_int()
        if lib.cuDeviceGet(ctypes.byref(dev), i) != 0:
            continue
        info: dict[str, Any] = {"index": i, "name": None, "uuid": None, "total_bytes": None}
        buf = ctypes.create_string_buffer(256)
        if lib.cuDeviceGetName(buf, 256, dev) == 0:
            info["name"] = buf.value.decode(errors="replace")
        raw = (ctypes.c_ubyte * 16)()
        if get_uuid is not None and get_uuid(raw, dev) == 0:
            h = bytes(raw).hex()
            info["uuid"] = f"GPU-{h[:8]}-{h[8:12]}-{h[12:16]}-{h[16:20]}-{h[20:]}"
        total = ctypes.c_size_t()
        if lib.cuDeviceTotalMem_v2(ctypes.byref(total), dev) == 0:
            info["total_bytes"] = total.value
        res["devices"].append(info)
    res["ok"] = True
    return res


def torch_cuda() -> dict[str, Any]:
    """What torch sees, if torch can be imported (it is not in the bare sandbox image)."""
    try:
        import torch
    except Exception as exc:  # ImportError, or a broken install
        return {"importable": False, "ok": False, "error": describe(exc)}
    res: dict[str, Any] = {
        "importable": True,
        "ok": False,
        "error": "",
        "version": str(torch.__version__),
        "cuda_build": torch.version.cuda,
        "available": False,
        "device_count": 0,
        "devices": [],
    }
    try:
        res["available"] = bool(torch.cuda.is_available())
        res["device_count"] = int(torch.cuda.device_count())
        if not res["available"]:
            res["error"] = "torch.cuda.is_available() is False"
            return res
        torch.cuda.init()
        x = torch.ones(4, device="cuda")
        if float((x * 2).sum().item()) != 8.0:
            raise RuntimeError("a computation on the GPU gave a wrong result")
        res["devices"] = [torch.cuda.get_device_name(i) for i in range(res["device_count"])]
        res["ok"] = True
    except Exception as exc:
        res["error"] = describe(exc)
    return res


def cuda() -> dict[str, Any]:
    lib = libcuda()
    tch = torch_cuda()
    counts = [c for c in (lib.get("device_count"), tch.get("device_count")) if c is not None]
    via = [n for n, r in (("libcuda", lib), ("torch", tch)) if r["ok"]]
    return {
        "ok": bool(via),
        "via": via,
        "device_count": max(counts) if counts else 0,
        "libcuda": lib,
        "torch": tch,
    }


# ---------------------------------------------------------------------------
# the report


def load_params(errors: dict[str, str]) -> dict[str, Any]:
    path = os.environ.get("GPUWARDEN_PARAMS")
    if not path:
        return {}
    try:
        with open(path) as f:
            params = json.load(f)
    except (OSError, ValueError) as exc:
        errors["params"] = describe(exc)
        return {}
    return params if isinstance(params, dict) else {}


def build(params: dict[str, Any], errors: dict[str, str]) -> dict[str, Any]:
    report: dict[str, Any] = {}

    def section(key: str, fn: Callable[..., Any], *args: Any) -> None:
        try:
            report[key] = fn(*args)
        except Exception as exc:
            report[key] = None
            errors[key] = describe(exc)

    env = os.environ
    report["job_type"] = env.get("GPUWARDEN_JOB_TYPE")
    report["uid"], report["gid"], report["euid"] = os.getuid(), os.getgid(), os.geteuid()
    report["pid"] = os.getpid()
    report["groups"] = os.getgroups()
    section("uid_map", uid_map)
    section("cwd", os.getcwd)
    report["python"] = sys.version.split()[0]

    try:
        status = proc_status()
    except OSError as exc:
        status = {}
        errors["proc_status"] = describe(exc)
    for key, field in (("cap_eff", "CapEff"), ("cap_prm", "CapPrm"), ("cap_bnd", "CapBnd")):
        report[key] = status.get(field)
    report["no_new_privs"] = int_or_none(status.get("NoNewPrivs"))
    report["seccomp"] = int_or_none(status.get("Seccomp"))

    section("interfaces", interfaces, errors)
    report["connect"] = connect(str(params.get("connect") or ""))

    report["root_writable"] = {p: try_create(p) for p in ("/", "/usr")}
    report["tmp_writable"] = try_create("/tmp")
    report["cwd_writable"] = try_create(report["cwd"] or ".")
    report["output_writable"] = try_create(env.get("GPUWARDEN_OUTPUT_DIR"), "GPUWARDEN_OUTPUT_DIR")
    report["scratch_writable"] = try_create(
        env.get("GPUWARDEN_SCRATCH_DIR"), "GPUWARDEN_SCRATCH_DIR"
    )
    report["input_dir_writable"] = try_create(env.get("GPUWARDEN_INPUT_DIR"), "GPUWARDEN_INPUT_DIR")
    given = params.get("input")
    report["input_readable"] = try_read(given) if given else None
    report["input_writable"] = try_open_for_writing(given) if given else None
    report["marker_visible"] = marker(params["marker"]) if params.get("marker") else None

    section("mounts", mounts)
    section("rlimits", rlimits)
    section("userns", userns)
    section("mount", try_mount)
    section("keyctl", keyctl)
    section("tmp", tmp_size)
    section("pid1", pid1)
    section("hostname", socket.gethostname)
    report["env_keys"] = sorted(env)
    section("devices", nvidia_devices)
    report["gpu"] = {
        "cuda_visible_devices": env.get("CUDA_VISIBLE_DEVICES"),
        "cuda": None,  # not asked for (probe.sandbox, or cuda = false)
    }
    if params.get("cuda"):
        try:
            report["gpu"]["cuda"] = cuda()
        except Exception as exc:
            errors["gpu"] = describe(exc)
    return report


def summary(report: dict[str, Any]) -> str:
    parts = [f"uid {report['uid']}"]
    cap = report.get("cap_eff")
    parts.append(f"CapEff {int(cap, 16):x}" if cap else "CapEff ?")
    if report.get("no_new_privs") is not None:
        parts.append(f"NoNewPrivs {report['no_new_privs']}")
    names = report.get("interfaces")
    parts.append(f"interfaces {','.join(names) or 'none'}" if names is not None else "interfaces ?")
    parts.append(f"connect {report['connect']['kind']}")
    writable = [p for p, r in report["root_writable"].items() if r["ok"]]
    parts.append(f"root WRITABLE ({', '.join(writable)})" if writable else "root read-only")
    if report["input_writable"] is not None:
        parts.append("input WRITABLE" if report["input_writable"]["ok"] else "input read-only")
    if report["input_dir_writable"]["ok"]:
        parts.append("input dir WRITABLE")
    seen = report["marker_visible"]
    if seen is not None:
        word = {True: "VISIBLE", False: "hidden"}.get(seen["visible"], f"unknown ({seen['error']})")
        parts.append(f"marker {word}")
    for key, word in (("userns", "user namespace"), ("keyctl", "keyctl")):
        got = report.get(key)
        if isinstance(got, dict):
            parts.append(f"{word} {'ALLOWED' if got['ok'] else 'refused'}")
    parts.append(f"{len(report.get('devices') or [])} nvidia devices")
    got = report["gpu"]["cuda"]
    if got is not None:
        if got["ok"]:
            parts.append(f"cuda {got['device_count']} device(s) via {'+'.join(got['via'])}")
        else:
            parts.append(f"cuda unavailable ({got['libcuda']['error'] or got['torch']['error']})")
    if report.get("errors"):
        parts.append(f"{len(report['errors'])} probe error(s)")
    return ", ".join(parts)


def attacks(params: dict[str, Any]) -> dict[str, Any]:
    """The limits, tried for real when asked (after ``wait_for``)."""
    done: dict[str, Any] = {}
    if params.get("wait_for"):
        done["wait_for"] = wait_for(str(params["wait_for"]))
    if int(params.get("fork") or 0) > 0:
        done["fork"] = fork_many(int(params["fork"]))
    if int(params.get("tmp_fill_mib") or 0) > 0:
        done["tmp_fill"] = fill(
            f"/tmp/.gpuwarden-probe-fill-{os.getpid()}", int(params["tmp_fill_mib"])
        )
        os.unlink(done["tmp_fill"]["path"])
    if int(params.get("output_fill_mib") or 0) > 0:
        out = os.environ.get("GPUWARDEN_OUTPUT_DIR", ".")
        done["output_fill"] = fill(os.path.join(out, "fill.bin"), int(params["output_fill_mib"]))
    if float(params.get("hold_s") or 0) > 0:
        print("holding", flush=True)
        time.sleep(float(params["hold_s"]))
    return done


def main() -> int:
    errors: dict[str, str] = {}
    params = load_params(errors)
    tried = attacks(params)
    hog = int(params.get("hog_mib") or 0)
    if hog > 0:
        # hold this much memory (every page touched) before reporting: a sandbox
        # with a smaller memory limit kills the job here (exit 137)
        held = bytearray(hog * 2**20)
        for i in range(0, len(held), 4096):
            held[i] = 1
        print(f"holding {hog} MiB", flush=True)
    report = build(params, errors)
    report["tried"] = tried
    report["errors"] = errors
    text = json.dumps(report, indent=2, sort_keys=True, default=str)
    print(text, flush=True)

    try:
        message = summary(report)
    except Exception as exc:  # the report matters more than its summary
        message = f"report written; no summary: {describe(exc)}"
    result_path = os.environ.get("GPUWARDEN_RESULT")
    if result_path:
        try:
            with open(result_path, "w") as f:
                json.dump({"message": message}, f)
        except OSError as exc:
            print(f"cannot write {result_path}: {describe(exc)}", file=sys.stderr)

    out_dir = os.environ.get("GPUWARDEN_OUTPUT_DIR")
    if not out_dir:
        print(f"GPUWARDEN_OUTPUT_DIR {UNSET}: no report written", file=sys.stderr)
        return 1
    try:
        with open(os.path.join(out_dir, "report.json"), "w") as f:
            f.write(text + "\n")
    except OSError as exc:
        print(f"cannot write report.json in {out_dir}: {describe(exc)}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
