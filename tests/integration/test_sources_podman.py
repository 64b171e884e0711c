"""Jobs from a pinned commit on a podman node: the image is built from the
commit's Containerfile once and reused; the events name the source, the image
and the node. Needs podman and the test base image (tests/conftest.py); skipped
with the reason where they are missing, failed where GPUWARDEN_REQUIRE_CONTAINERS=1."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest

from gpuwarden.app import Node, open_node
from gpuwarden.config import Config
from gpuwarden.core.model import JobSpec
from gpuwarden.core.sources import JobSource
from gpuwarden.core.states import JobState
from gpuwarden.errors import ValidationError
from gpuwarden.launch.imagebuild import BUILD_CAPS, image_tag
from tests.brokerkit import run_until, submit
from tests.sourcerepo import make_repo

pytestmark = pytest.mark.timeout(900)


@pytest.fixture
def node(tmp_path: Path, podman_base_image: str) -> Iterator[tuple[Node, str, str]]:
    base_id = subprocess.run(
        ["podman", "image", "inspect", "--format", "{{.Id}}", podman_base_image],
        capture_output=True,
        text=True,
        check=True,
    ).stdout.strip()
    commit = make_repo(tmp_path / "repo", base=podman_base_image)
    config = Config.model_validate(
        {
            "state_dir": tmp_path / "state",
            "node_name": "srcnode",
            "gpu": "sim",
            "sim_gpu": {"count": 1, "vram_gib": 24, "release_delay_s": 0},
            "broker": {"poll_interval_s": 0.02, "kill_grace_s": 1},
            "container_runtime": "podman",
            "sandbox_image": base_id,
            "sources": {"allow": [f"file://{tmp_path}/*"]},
        }
    )
    with open_node(config, mock_gpu=True) as n:
        n.broker.recover()
        yield n, f"file://{tmp_path / 'repo'}", commit
        n.broker.shutdown(2)
    subprocess.run(
        ["podman", "rmi", "--force", image_tag(commit)], capture_output=True, check=False
    )


def test_a_commit_is_built_once_run_twice_and_its_events_say_so(
    node: tuple[Node, str, str],
) -> None:
    n, url, commit = node
    source = JobSource(url, commit)
    submit(n, JobSpec(id="src-1", type="mymod.train", source=source))
    run_until(n, lambda: _ended(n, "src-1"), timeout=300)
    submit(n, JobSpec(id="src-2", type="mymod.train", source=source))
    run_until(n, lambda: _ended(n, "src-2"), timeout=120)
    images = []
    for job_id, reused in (("src-1", False), ("src-2", True)):
        job = n.store.get_job(job_id)
        assert job is not None and job.state is JobState.DONE, job.reason if job else None
        assert job.type == f"mymod.train@{commit}" and job.source == source
        attempt = n.config.state_dir / "jobs" / job_id / "attempt-1"
        assert (attempt / "out" / "said.txt").read_text().strip() == "built-into-image"
        log = (attempt / "build.log").read_text()
        assert ("reused" in log) is reused, log
        events = [e for e in n.store.events(limit=100_000) if e.job_id == job_id]
        start = next(e for e in events if e.to_state == "running")
        end = next(e for e in events if e.from_state == "running")
        for e in (start, end):
            assert e.detail["source_repo"] == url and e.detail["source_commit"] == commit
            assert e.detail["node"] == "srcnode"
        assert end.detail["image_id"] and end.detail["image_reused"] is reused
        images.append(end.detail["image_id"])
    assert images[0] == images[1]


def test_a_branch_and_a_url_outside_the_allow_list_are_refused(
    node: tuple[Node, str, str],
) -> None:
    n, url, commit = node
    with pytest.raises(ValidationError, match="branches and tags are refused"):
        submit(n, JobSpec(id="b", type="mymod.train", source=JobSource(url, "main")))
    with pytest.raises(ValidationError, match="is not allowed on this node"):
        submit(
            n,
            JobSpec(id="u", type="mymod.train", source=JobSource("file:///elsewhere/r", commit)),
        )
    assert n.store.get_job("b") is None and n.store.get_job("u") is None


#: capability numbers (linux/capability.h) of the ones a build keeps
_CAP_BITS = {"CHOWN": 0, "DAC_OVERRIDE": 1, "FOWNER": 3, "SETGID": 6, "SETUID": 7}


def test_a_builds_run_steps_keep_only_a_few_capabilities(
    node: tuple[Node, str, str], tmp_path: Path, podman_base_image: str
) -> None:
    """Issue 30, item 13: a commit's RUN steps run as the image's root, with every
    capability dropped but BUILD_CAPS (podman's defaults add KILL, SETPCAP,
    NET_BIND_SERVICE, SYS_CHROOT, SETFCAP); the usual steps (write, chown, chmod)
    still work and the job runs in the image."""
    n, _, _ = node
    steps = (
        f"FROM {podman_base_image}\n"
        "RUN grep -E '^Cap(Eff|Bnd)' /proc/self/status\n"
        "RUN mkdir /opt/app && chown 65534:65534 /opt/app && chmod 0750 /opt/app"
        " && touch /opt/app/f && echo built-into-image > /opt/said\n"
        "RUN chroot / true 2>/dev/null && echo chroot-allowed || echo chroot-refused\n"
    )
    commit = make_repo(tmp_path / "caps", files={"Containerfile": steps})
    try:
        source = JobSource(f"file://{tmp_path / 'caps'}", commit)
        submit(n, JobSpec(id="caps-1", type="mymod.train", source=source))
        run_until(n, lambda: _ended(n, "caps-1"), timeout=300)
        job = n.store.get_job("caps-1")
        attempt = n.config.state_dir / "jobs" / "caps-1" / "attempt-1"
        log = (attempt / "build.log").read_text()
        assert job is not None and job.state is JobState.DONE, (job and job.reason, log)
        assert set(BUILD_CAPS) <= set(_CAP_BITS)
        mask = sum(1 << _CAP_BITS[c] for c in BUILD_CAPS)
        assert f"CapEff:\t{mask:016x}" in log and f"CapBnd:\t{mask:016x}" in log, log
        assert "\nchroot-refused\n" in log and "\nchroot-allowed\n" not in log, log
        assert (attempt / "out" / "said.txt").read_text().strip() == "built-into-image"
    finally:
        subprocess.run(
            ["podman", "rmi", "--force", image_tag(commit)], capture_output=True, check=False
        )


def _ended(n: Node, job_id: str) -> bool:
    job = n.store.get_job(job_id)
    return job is not None and job.state.terminal
