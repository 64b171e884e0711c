"""Per-sandbox pids cgroups: found from the mount table, made for real on this
host (cgroup v1 with a writable pids controller, as in CI, the broker as root),
binding, emptied and removed."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from gpuwarden.launch.cgroups import PidsCgroups, find_pids_cgroups

V1 = """\
tmpfs /sys/fs/cgroup tmpfs rw,relatime,mode=755 0 0
cgroup /sys/fs/cgroup/memory cgroup rw,relatime,memory 0 0
cgroup /sys/fs/cgroup/pids cgroup rw,relatime,pids 0 0
cgroup2 /sys/fs/cgroup/unified cgroup2 rw,relatime 0 0
"""


def test_v1_pids_is_found_from_the_mount_table(tmp_path: Path) -> None:
    pids = tmp_path / "pids"
    pids.mkdir()
    text = V1.replace("/sys/fs/cgroup/pids", str(pids))
    assert find_pids_cgroups(text, euid=0) == PidsCgroups(pids, 1)
    assert find_pids_cgroups(text.replace(",pids", ""), euid=0) is None  # no pids controller


def test_v2_is_used_only_with_the_pids_controller(tmp_path: Path) -> None:
    root = tmp_path / "cgroup"
    root.mkdir()
    text = f"cgroup2 {root} cgroup2 rw,nosuid,nodev,noexec,relatime 0 0\n"
    (root / "cgroup.controllers").write_text("cpuset cpu io memory\n")
    assert find_pids_cgroups(text, euid=0) is None
    (root / "cgroup.controllers").write_text("cpuset cpu io memory pids\n")
    assert find_pids_cgroups(text, euid=0) == PidsCgroups(root, 2)


def test_v2_enables_the_pids_controller_on_the_way_down(tmp_path: Path) -> None:
    # a stand-in for cgroupfs: its control files already exist there
    root = tmp_path / "cgroup"
    (root / "gpuwarden" / "s1").mkdir(parents=True)
    (root / "cgroup.subtree_control").write_text("")
    (root / "gpuwarden" / "cgroup.subtree_control").write_text("")
    (root / "gpuwarden" / "s1" / "pids.max").write_text("")
    made = PidsCgroups(root, 2).create("s1", 64)
    assert made == root / "gpuwarden" / "s1"
    assert (root / "cgroup.subtree_control").read_text() == "+pids"
    assert (root / "gpuwarden" / "cgroup.subtree_control").read_text() == "+pids"
    assert PidsCgroups(root, 2).pids_max(made) == 64


def test_a_cgroup_name_cannot_leave_the_parent() -> None:
    cg = PidsCgroups(Path("/sys/fs/cgroup/pids"), 1)
    for bad in ("", "..", "a/b", "."):
        with pytest.raises(ValueError, match="not a cgroup name"):
            cg.path(bad)


@pytest.fixture
def host_pids() -> PidsCgroups:
    found = find_pids_cgroups()
    if found is None:
        pytest.skip("no writable pids cgroup here (CI has one: cgroup v1, root)")
    return found


def test_a_real_cgroup_binds_is_emptied_and_removed(host_pids: PidsCgroups) -> None:
    name = f"test-{uuid.uuid4().hex[:12]}"
    path = host_pids.create(name, 8)
    try:
        assert host_pids.pids_max(path) == 8
        # a process that joins it before it forks can have at most 8 tasks
        script = (
            "import os, sys, time\n"
            f"open('{path}/cgroup.procs', 'w').write(str(os.getpid()))\n"
            "made = 0\n"
            "try:\n"
            "    for _ in range(32):\n"
            "        if os.fork() == 0:\n"
            "            time.sleep(30); os._exit(0)\n"
            "        made += 1\n"
            "except OSError as exc:\n"
            "    print(made, exc.errno, flush=True)\n"
            "time.sleep(30)\n"
        )
        proc = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True)
        assert proc.stdout is not None
        made, err = proc.stdout.readline().split()
        assert int(made) < 8 and int(err) == 11  # EAGAIN
        inside = host_pids.processes(path)
        assert proc.pid in inside and len(inside) == int(made) + 1
        assert host_pids.kill_all(path) == []
        proc.wait(timeout=10)
        assert host_pids.processes(path) == []
    finally:
        host_pids.kill_all(path)
        assert host_pids.remove(path)
    assert not path.exists()
    assert host_pids.processes(path) == []  # a removed cgroup holds nothing


def test_removing_a_cgroup_that_is_gone_is_fine(host_pids: PidsCgroups) -> None:
    assert host_pids.remove(host_pids.path(f"never-{os.getpid()}"))
