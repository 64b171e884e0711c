"""images/base-rootfs.sh and images/build.sh, run for real with podman.

A session fixture makes the base image once with ``images/base-rootfs.sh``
(debootstrap, no registry; the root filesystem is cached under
``~/.cache/gpuwarden``, so a warm run takes about a second) unless
``GPUWARDEN_TEST_BASE_IMAGE`` names a base image to use instead. Without
podman (or, for a cold cache, without root and debootstrap) the tests skip with
the reason; with ``GPUWARDEN_REQUIRE_CONTAINERS=1`` they fail instead.

The argument checks that stop before the runtime is used run everywhere, with a
stub ``podman`` on PATH.
"""

from __future__ import annotations

import json
import os
import re
import shutil
import subprocess
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

from tests.conftest import REQUIRE_CONTAINERS

REPO = Path(__file__).resolve().parents[2]
IMAGES = REPO / "images"
BUILD = IMAGES / "build.sh"
BASE_ROOTFS = IMAGES / "base-rootfs.sh"

#: the one line `build.sh --pin` prints for the config
PIN_LINE = re.compile(r'^sandbox_image = "(sha256:[0-9a-f]{64})"$')
#: what the config accepts as a pinned local image id (see core/launchrules.py)
IMAGE_ID = re.compile(r"(sha256:)?[0-9a-f]{12,64}")

BASE_TIMEOUT_S = 600  # a cold cache runs debootstrap (45-100 s, mirror permitting)
BUILD_TIMEOUT_S = 300

#: the first test that needs the base image may run debootstrap (a cold cache)
pytestmark = [pytest.mark.slow, pytest.mark.timeout(BASE_TIMEOUT_S + BUILD_TIMEOUT_S)]


def _unavailable(why: str) -> None:
    if REQUIRE_CONTAINERS:
        pytest.fail(f"{why}, but GPUWARDEN_REQUIRE_CONTAINERS=1 requires the container tests")
    pytest.skip(why)


def _run(
    argv: list[str], timeout: float = BUILD_TIMEOUT_S, env: dict[str, str] | None = None
) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        argv, capture_output=True, text=True, timeout=timeout, env=env, check=False
    )


def _explain(done: subprocess.CompletedProcess[str]) -> str:
    return f"exit {done.returncode}\n--- stdout\n{done.stdout}\n--- stderr\n{done.stderr}"


@pytest.fixture(scope="session")
def podman() -> str:
    exe = shutil.which("podman")
    if exe is None:
        _unavailable("podman is not installed (apt-get install podman)")
    return exe  # type: ignore[return-value]


@pytest.fixture(scope="session")
def base_image(podman: str) -> str:
    """A base image with python3: GPUWARDEN_TEST_BASE_IMAGE, or one made (once,
    from the cache when warm) by images/base-rootfs.sh."""
    given = os.environ.get("GPUWARDEN_TEST_BASE_IMAGE")
    if given:
        return given
    if os.geteuid() != 0 or shutil.which("debootstrap") is None or shutil.which("unshare") is None:
        _unavailable(
            "images/base-rootfs.sh needs root, debootstrap and unshare "
            "(or set GPUWARDEN_TEST_BASE_IMAGE to a base image with python3.11)"
        )
    name = "localhost/gpuwarden-test-base:latest"
    done = _run([str(BASE_ROOTFS), "--runtime", "podman", name], timeout=BASE_TIMEOUT_S)
    assert done.returncode == 0, f"base-rootfs.sh failed: {_explain(done)}"
    image_id = done.stdout.strip().splitlines()[-1]
    assert IMAGE_ID.fullmatch(image_id), _explain(done)
    return name


def _tag() -> str:
    return f"localhost/gpuwarden-test-sandbox:{uuid.uuid4().hex[:10]}"


@pytest.fixture
def tag(podman: str) -> Iterator[str]:
    name = _tag()
    yield name
    _run([podman, "rmi", "--force", name], timeout=60)


def _image_exists(podman: str, ref: str) -> bool:
    return _run([podman, "image", "exists", ref], timeout=60).returncode == 0


def _sandbox_run(podman: str, image: str, *cmd: str) -> subprocess.CompletedProcess[str]:
    """Run ``cmd`` in ``image`` with the broker's lock-down flags. On hosts where
    crun refuses cgroups ("hybrid mode"), again in a private mount namespace
    without the cgroup2 mount and with --cgroups=disabled (see images/README.md)."""
    flags = [
        "--rm", "--network", "none", "--read-only", "--cap-drop", "all",
        "--security-opt", "no-new-privileges", "--user", "65534:65534",
        "--ulimit", "nofile=1024:1024", "--ulimit", "nproc=512:512",
    ]  # fmt: skip
    done = _run([podman, "run", *flags, image, *cmd], timeout=120)
    if done.returncode != 0 and "cgroup" in done.stderr and os.geteuid() == 0:
        script = 'umount /sys/fs/cgroup/unified 2>/dev/null; exec "$@"'
        wrap = ["unshare", "--mount", "--propagation", "private", "sh", "-c", script, "sh"]
        done = _run([*wrap, podman, "run", "--cgroups=disabled", *flags, image, *cmd], timeout=120)
    return done


# -- for real, with podman ---------------------------------------------------------


def test_build_echo_pins_an_image_that_runs_python(podman: str, base_image: str, tag: str) -> None:
    done = _run([str(BUILD), "--runtime", "podman", "--only", "echo", "--pin",
                 "--base", base_image, "--tag", tag])  # fmt: skip
    assert done.returncode == 0, _explain(done)

    pins = [ln for ln in done.stdout.splitlines() if ln.startswith("sandbox_image")]
    assert len(pins) == 1, _explain(done)
    match = PIN_LINE.fullmatch(pins[0])
    assert match, pins[0]
    image_id = match.group(1)
    assert IMAGE_ID.fullmatch(image_id)
    try:
        from gpuwarden.core.launchrules import image_is_pinned
    except ImportError:  # pragma: no cover - the config's rule moved
        pass
    else:
        assert image_is_pinned(image_id), image_id

    # the pinned id names the image that was tagged, with its labels
    inspect = _run([podman, "image", "inspect", "--format",
                    '{{.Id}} {{index .Labels "gpuwarden.modules"}}', tag], timeout=60)  # fmt: skip
    assert inspect.returncode == 0, _explain(inspect)
    assert inspect.stdout.split() == [image_id.removeprefix("sha256:"), "echo"]

    ran = _sandbox_run(
        podman,
        image_id,
        "python3",
        "-c",
        "import json, socket, os; "
        "print(json.dumps([os.getuid(), sorted(os.listdir('/opt/gpuwarden/modules/echo'))]))",
    )
    assert ran.returncode == 0, _explain(ran)
    uid, files = json.loads(ran.stdout.strip().splitlines()[-1])
    assert uid == 65534
    assert "provision.sh" in files and "module.toml" in files


def test_failing_provision_names_the_module_and_pins_nothing(
    podman: str, base_image: str, tag: str, tmp_path: Path
) -> None:
    modules = tmp_path / "modules"
    for name, body in {
        "fine": "exit 0\n",
        "broken": "echo 'installing frobnicator'\necho 'E: no frobnicator here' >&2\nexit 1\n",
        "_ignored": "exit 3\n",
    }.items():
        (modules / name).mkdir(parents=True)
        (modules / name / "provision.sh").write_text("#!/bin/sh\n" + body)

    logs = tmp_path / "tmp"
    logs.mkdir()
    done = _run([str(BUILD), "--runtime", "podman", "--modules", str(modules), "--pin",
                 "--base", base_image, "--tag", tag],
                env={**os.environ, "TMPDIR": str(logs)})  # fmt: skip
    out = done.stdout + done.stderr
    assert done.returncode == 1, _explain(done)
    assert "module 'broken'" in done.stderr, _explain(done)
    assert "installing frobnicator" in done.stderr  # the module's own output
    assert "E: no frobnicator here" in done.stderr
    assert "sandbox_image =" not in out
    assert done.stdout.strip() == ""
    assert not _image_exists(podman, tag)
    assert "_ignored" not in out
    # the whole build log is kept, and named
    kept = list(logs.glob("gpuwarden-build-*.log"))
    assert len(kept) == 1, _explain(done)
    assert str(kept[0]) in done.stderr
    assert "@@gpuwarden@@ failed broken 1" in kept[0].read_text()


def test_unknown_module_exits_2(podman: str) -> None:
    done = _run([str(BUILD), "--runtime", "podman", "--only", "echo,no-such-module", "--pin"])
    assert done.returncode == 2, _explain(done)
    assert "unknown module 'no-such-module'" in done.stderr
    assert "echo" in done.stderr  # lists what there is
    assert "sandbox_image" not in done.stdout + done.stderr


# -- argument checks: they stop before the runtime is used ----------------------------


@pytest.fixture
def stub_path(tmp_path: Path) -> str:
    """A PATH with a ``podman`` that must never run and the few tools the
    scripts need before they call the runtime."""
    bin_dir = tmp_path / "bin"
    bin_dir.mkdir()
    stub = bin_dir / "podman"
    stub.write_text("#!/bin/sh\necho 'stub podman must not run' >&2\nexit 99\n")
    stub.chmod(0o755)
    for tool in ("dirname", "basename"):
        found = shutil.which(tool)
        assert found, tool
        (bin_dir / tool).symlink_to(found)
    return str(bin_dir)


def _script(script: Path, path: str, *args: str) -> subprocess.CompletedProcess[str]:
    bash = shutil.which("bash") or "/bin/bash"
    return _run([bash, str(script), *args], timeout=30, env={"PATH": path, "HOME": "/nonexistent"})


def test_unknown_module_is_refused_before_the_runtime_runs(stub_path: str) -> None:
    done = _script(BUILD, stub_path, "--only", "nope")
    assert done.returncode == 2, _explain(done)
    assert "unknown module 'nope'" in done.stderr
    assert "stub podman" not in done.stderr


@pytest.mark.parametrize(
    "args",
    [["--frobnicate"], ["--only"], ["--runtime", "lxc"], ["--isolation", "vm"], ["stray"]],
)
def test_bad_flags_print_usage_and_exit_2(stub_path: str, args: list[str]) -> None:
    done = _script(BUILD, stub_path, *args)
    assert done.returncode == 2, _explain(done)
    assert "usage:" in done.stderr
    assert done.stdout == ""


def test_missing_runtime_exits_2(tmp_path: Path, stub_path: str) -> None:
    (Path(stub_path) / "podman").unlink()
    for script, args in ((BUILD, ["--only", "echo"]), (BASE_ROOTFS, ["localhost/x:y"])):
        done = _script(script, stub_path, "--runtime", "podman", *args)
        assert done.returncode == 2, _explain(done)
        assert "'podman' is not installed" in done.stderr


def test_base_rootfs_bad_flags_exit_2(stub_path: str) -> None:
    for args in (["--bogus", "x"], [], ["a", "b"], ["--runtime", "rkt", "x"]):
        done = _script(BASE_ROOTFS, stub_path, *args)
        assert done.returncode == 2, (args, _explain(done))
        assert "usage:" in done.stderr
