"""Acceptance (issue 29, VRAM leases): ``gpuwarden lease`` for a local user who is
not root, through the broker's local socket (the user the kernel names owns the
lease), pinned with ``--gpu``; a user ``[commands]`` does not allow is refused
with the rule. The users and the node are tests/acceptance/test_command_jobs.py's."""

from __future__ import annotations

import re

from tests.acceptance.test_command_jobs import Node, User, as_user, node, users, workdir

__all__ = ["node", "users"]  # the fixtures, used by name


def test_a_local_user_leases_a_pinned_gpu_through_the_socket(
    node: Node, users: tuple[User, User]
) -> None:
    user, other = users
    here = workdir(user, "lease")
    # an unknown GPU is refused at the request, with the node's GPUs
    p = as_user(
        user, "--config", str(node.config), "lease", "--vram", "1G", "--gpu", "GPU-nope", cwd=here
    )
    _, stderr = p.communicate(timeout=60)
    assert p.returncode != 0, stderr
    m = re.search(r"no such GPU \(its GPUs: (GPU-\S+), (GPU-\S+)\)", stderr)
    assert m, stderr
    second = m.group(2)
    script = 'echo "cvd=$CUDA_VISIBLE_DEVICES uid=$(id -u)"; exit 4'
    p = as_user(
        user, "--config", str(node.config), "lease", "--vram", "1G", "--gpu", second,
        "--", "sh", "-c", script, cwd=here,
    )  # fmt: skip
    stdout, stderr = p.communicate(timeout=90)
    assert p.returncode == 4, stdout + stderr
    assert f"cvd={second} uid={user.uid}" in stdout, stdout
    lid = re.search(r"lease (\S+): granted on (\S+)", stdout)
    assert lid and lid.group(2) == second, stdout
    job = node.job(lid.group(1))
    assert job["owner"] == f"user:{user.name}", dict(job)
    assert job["state"] == "done", dict(job)
    assert job["reason"] == "ended by its holder: its command exited with 4", dict(job)
    # another user: refused by [commands], saying which rule
    p = as_user(other, "--config", str(node.config), "lease", "--vram", "1G", cwd=other.home)
    _, stderr = p.communicate(timeout=60)
    assert p.returncode != 0
    assert "[commands]" in stderr, stderr
