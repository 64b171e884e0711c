"""Acceptance: a new user's first hour, through the real CLI in subprocesses and a
real `serve --api`: typos get "did you mean", `logs` shows a job's streams (also
while it runs, and over HTTP), `submit --wait` says why a job waits when piped,
every command with an endpoint works with --url, and /docs works offline."""

from __future__ import annotations

import itertools
import json
import os
import re
import signal
import subprocess
from collections.abc import Iterator
from pathlib import Path

import httpx
import pytest

from tests.acceptance.test_cli import GW, Broker, env, run, wait_for, write_config
from tests.acceptance.test_cli_api import ApiBroker, run_env


@pytest.fixture
def served(tmp_path: Path) -> Iterator[tuple[Path, ApiBroker]]:
    config = write_config(tmp_path)
    b = ApiBroker(config)
    yield config, b
    if b.proc.poll() is None:
        b.proc.send_signal(signal.SIGKILL)
        b.proc.wait(10)


def token(config: Path, name: str, role: str) -> str:
    made = run("--config", config, "token", "create", name, "--role", role, "--json")
    assert made.returncode == 0, made.stderr
    return str(json.loads(made.stdout)["token"])


def background(
    args: list[str | Path], out: Path, token: str | None = None
) -> subprocess.Popen[str]:
    """The CLI in the background; its stdout and stderr go to ``out``.stdout/.stderr."""
    e = env()
    if token is not None:
        e["GPUWARDEN_TOKEN"] = token
    return subprocess.Popen(
        [*GW, *map(str, args)],
        stdout=out.with_suffix(".stdout").open("w"),
        stderr=out.with_suffix(".stderr").open("w"),
        text=True,
        env=e,
        start_new_session=True,
    )


def text(path: Path) -> str:
    return path.read_text() if path.exists() else ""


# -- typos ------------------------------------------------------------------------


SUBMIT = ["submit", "echo.echo", "--text", "x"]
WIAT = "unknown option --wiat (did you mean --wait?)"


@pytest.mark.parametrize(
    ("args", "said"),
    [
        ([*SUBMIT, "--wiat"], WIAT),
        ([*SUBMIT, "--wiat", "5"], WIAT),
        (["submit", "echo.echo", "--txet", "x"], "unknown option --txet (did you mean --text?)"),
        ([*SUBMIT, "--exit-cod", "1"], "(did you mean --exit-code?)"),
        (["submit", "echo.ehco"], "unknown job type 'echo.ehco' (did you mean echo.echo?)"),
        (["jobs", "--jsno"], "unknown option --jsno (did you mean --json?)"),
        (["logs", "j", "--folow"], "unknown option --folow (did you mean --follow?)"),
        (["sumbit", "echo.echo"], "unknown command 'sumbit' (did you mean submit?)"),
        (["token", "lisst"], "unknown command 'lisst' (did you mean list?)"),
        (["jobs", "--state-dir", "s"], "--state-dir is a global option: put it before the command"),
        ([*SUBMIT, "--state-dir", "s"], "--state-dir is a global option"),
    ],
)  # fmt: skip
def test_typos_say_what_was_meant(args: list[str], said: str, tmp_path: Path) -> None:
    run("--state-dir", tmp_path / "s", "token", "create", "a", "--role", "owner")  # a state
    r = run("--state-dir", tmp_path / "s", *args)
    assert r.returncode == 2, r.stdout + r.stderr
    assert said in r.stderr, r.stderr
    assert "needs a value" not in r.stderr and "Traceback" not in r.stderr
    assert run("--state-dir", tmp_path / "s", "jobs", "--json").stdout.strip() == "[]"


# -- logs -------------------------------------------------------------------------


def test_logs_of_a_job_here_and_over_http(served: tuple[Path, ApiBroker], tmp_path: Path) -> None:
    config, broker = served
    owner = token(config, "admin", "owner")
    alice = token(config, "alice", "submitter")
    bob = token(config, "bob", "submitter")

    r = run("--config", config, "submit", "echo.echo", "--text", "hello", "--id", "e1", "--wait")
    assert r.returncode == 0, r.stdout + r.stderr
    r = run("--config", config, "logs", "e1")
    assert r.returncode == 0 and r.stdout == "hello\n", r.stdout + r.stderr
    r = run("--config", config, "logs", "e1", "--stderr")
    assert r.returncode == 0 and r.stdout == ""
    show = run("--config", config, "show", "e1")
    assert "output: `gpuwarden logs e1` (stdout; add --stderr for stderr)" in show.stdout
    # a job that fails says why on its stderr
    r = run(
        "--config", config, "submit", "echo.echo", "--text", "x", "--output", "../escape",
        "--id", "e2", "--wait",
    )  # fmt: skip
    assert r.returncode == 1
    r = run("--config", config, "logs", "e2", "--stderr")
    assert r.returncode == 0 and "must stay inside the output directory" in r.stdout
    r = run("--config", config, "logs", "e2", "--attempt", "3")
    assert r.returncode == 2 and "job e2 has no attempt 3 (its attempts: 1)" in r.stderr

    # the same through the API
    r = run_env("logs", "--url", broker.url, "e2", "--stderr", token=owner)
    assert r.returncode == 0 and "must stay inside the output directory" in r.stdout
    # a submitter reads its own job's streams; another's is a job that does not exist
    r = run_env(
        "submit", "--url", broker.url, "echo.echo", "--text", "hi alice", "--id", "a1",
        "--wait", token=alice,
    )  # fmt: skip
    assert r.returncode == 0, r.stdout + r.stderr
    r = run_env("logs", "--url", broker.url, "a1", token=alice)
    assert r.returncode == 0 and r.stdout == "hi alice\n"
    theirs = run_env("logs", "--url", broker.url, "a1", token=bob)
    nope = run_env("logs", "--url", broker.url, "nope", token=bob)
    assert theirs.returncode == nope.returncode == 2
    assert theirs.stderr.replace("a1", "X") == nope.stderr.replace("nope", "X")
    assert "no job with id 'a1'" in theirs.stderr
    assert run_env("logs", "--url", broker.url, "e1", token=alice).returncode == 2  # the host's
    assert broker.stop() == 0


@pytest.mark.parametrize("over", ["here", "http"])
def test_logs_follow_a_running_job_until_it_ends(
    served: tuple[Path, ApiBroker], tmp_path: Path, over: str
) -> None:
    config, broker = served
    owner = token(config, "admin", "owner")
    where = ["--config", config] if over == "here" else []
    remote = ["--url", broker.url] if over == "http" else []
    release = tmp_path / "release"
    follower = background(
        [*where, "logs", *remote, "h1", "--follow"], tmp_path / "follow", token=owner
    )
    # the job does not exist yet: with --follow on a missing job, logs says so
    follower.wait(60)
    assert follower.returncode == 2
    assert "no job with id 'h1'" in text(tmp_path / "follow.stderr")

    r = run_env(*where, "submit", *remote, "testmods.hold", "--until", release, "--id", "h1",
                token=owner)  # fmt: skip
    assert r.returncode == 0, r.stderr
    follower = background(
        [*where, "logs", *remote, "h1", "--follow"], tmp_path / "follow", token=owner
    )
    try:
        wait_for(lambda: "holding until" in text(tmp_path / "follow.stdout"), "the first line")
        assert follower.poll() is None  # it goes on while the attempt runs
        release.touch()
        assert follower.wait(60) == 0, text(tmp_path / "follow.stderr")
    finally:
        if follower.poll() is None:
            follower.kill()
    lines = text(tmp_path / "follow.stdout").splitlines()
    assert lines[0].endswith(f"holding until {release} exists") and lines[-1] == "released"
    assert broker.stop() == 0


def test_logs_never_follow_a_link_or_open_a_fifo(
    served: tuple[Path, ApiBroker], tmp_path: Path
) -> None:
    config, broker = served
    owner = token(config, "admin", "owner")
    r = run("--config", config, "submit", "echo.echo", "--text", "mine", "--id", "v1", "--wait")
    assert r.returncode == 0, r.stdout + r.stderr
    folder = tmp_path / "state" / "jobs" / "v1" / "attempt-1"
    secret = tmp_path / "secret"
    secret.write_text("root's secret\n")
    # what a host job (it runs as the broker's user) can leave behind
    (folder / "stdout.log").unlink()
    (folder / "stdout.log").symlink_to(secret)
    (folder / "stderr.log").unlink()
    os.mkfifo(folder / "stderr.log")
    assert (folder / "stdout.log").is_symlink() and (folder / "stderr.log").is_fifo()
    for remote in ([], ["--url", broker.url]):
        r = run_env("--config", config, "logs", *remote, "v1", token=owner, timeout=30)
        assert r.returncode == 1, r.stdout + r.stderr
        assert "secret" not in r.stdout
        assert r.stdout == "mine\n"  # the copy kept with the attempt
        assert "stdout.log of attempt 1 is a symlink, not a regular file: it is not read" in (
            r.stderr
        )
        r = run_env("--config", config, "logs", *remote, "v1", "--stderr", "--follow",
                    token=owner, timeout=30)  # fmt: skip
        assert r.returncode == 1 and "stderr.log of attempt 1 is a fifo" in r.stderr
    # the broker is up, nothing was written outside, and the next job completes
    assert secret.read_text() == "root's secret\n"
    r = run("--config", config, "submit", "echo.echo", "--text", "next", "--id", "v2", "--wait")
    assert r.returncode == 0 and run("--config", config, "logs", "v2").stdout == "next\n"
    assert broker.stop() == 0


# -- waiting ------------------------------------------------------------------------


def test_wait_without_a_broker_says_so_when_piped(tmp_path: Path) -> None:
    b = Broker(write_config(tmp_path), tmp_path / "events.jsonl")
    assert b.stop() == 0  # the state exists; no broker runs now
    r = run(
        "--config", b.config, "submit", "echo.echo", "--text", "x", "--id", "w1", "--wait",
        "--wait-timeout", "1.5",
    )  # fmt: skip
    assert r.returncode == 1
    lines = r.stderr.splitlines()
    assert re.fullmatch(r"\d\d:\d\d:\d\d job w1: submitted", lines[0]), lines
    assert any(
        ln.endswith("job w1: queued: no broker is running here, so nothing will start it: "
                    "run `gpuwarden serve`") for ln in lines
    ), lines  # fmt: skip
    assert "gave up waiting after 1.5 s; job is queued" in r.stderr
    assert "is `gpuwarden serve` running?" not in r.stderr


@pytest.mark.parametrize("over", ["here", "http"])
def test_wait_prints_a_line_when_the_reason_changes(
    served: tuple[Path, ApiBroker], tmp_path: Path, over: str
) -> None:
    config, broker = served
    owner = token(config, "admin", "owner")
    where = ["--config", config] if over == "here" else []
    remote = ["--url", broker.url] if over == "http" else []
    release = tmp_path / "release"
    waiter = background(
        [*where, "submit", *remote, "testmods.hold", "--until", release, "--id", "w2", "--wait"],
        tmp_path / "wait",
        token=owner,
    )
    try:
        wait_for(
            lambda: (
                "job w2: running: attempt 1 runs on a cpu slot" in text(tmp_path / "wait.stderr")
            ),
            "the running line",
        )
        release.touch()
        assert waiter.wait(60) == 0, text(tmp_path / "wait.stderr")
    finally:
        if waiter.poll() is None:
            waiter.kill()
    lines = text(tmp_path / "wait.stderr").splitlines()
    said = [ln.split(" ", 1)[1] for ln in lines]  # without the time
    assert said[0] == "job w2: submitted"
    assert all(a != b for a, b in itertools.pairwise(said)), said  # one line a change
    assert all(re.match(r"\d\d:\d\d:\d\d job w2: ", ln) for ln in lines), lines
    assert re.search(r"status\s+done", text(tmp_path / "wait.stdout"))
    assert broker.stop() == 0


# -- every command with an endpoint works over HTTP too ------------------------------


def test_tokens_audit_types_and_gpu_clear_over_http(
    served: tuple[Path, ApiBroker], tmp_path: Path
) -> None:
    config, broker = served
    owner = token(config, "admin", "owner")
    url = ["--url", broker.url]
    local = run("--config", config, "types")
    remote = run_env("types", *url, token=owner)
    assert local.returncode == remote.returncode == 0, remote.stderr
    # the same table; the local one adds this host's runtime and module folders around it
    assert "echo.echo" in remote.stdout and remote.stdout in local.stdout
    assert local.stdout.startswith("container runtime: ") and "modules from: " in local.stdout

    first = run("token", "create", "x", "--role", "owner", *url, "--token-file", tmp_path / "no")
    assert first.returncode == 2 and "the first token is made in the store, without --url" in (
        first.stderr
    )
    made = run_env("token", "create", "ci", "--role", "submitter", "--json", *url, token=owner)
    assert made.returncode == 0, made.stderr
    ci = json.loads(made.stdout)
    assert ci["name"] == "ci" and ci["token"].startswith("gw_")
    listed = run_env("token", "list", "--json", *url, token=owner)
    here = run("--config", config, "token", "list", "--json")
    assert json.loads(listed.stdout) == json.loads(here.stdout)
    assert {t["name"] for t in json.loads(listed.stdout)} == {"admin", "ci"}
    assert "ci" in run_env("token", "list", *url, token=owner).stdout

    r = run_env("audit", *url, token=ci["token"])  # a submitter may not
    assert r.returncode == 2
    assert "audit.read needs the role owner or operator" in r.stderr, r.stderr
    r = run_env("token", "revoke", ci["id"], *url, token=owner)
    assert r.returncode == 0 and f"revoked token {ci['id']} (ci)" in r.stdout
    assert run_env("jobs", *url, token=ci["token"]).returncode == 2  # refused now

    wait_for(lambda: run("--config", config, "status").returncode == 0, "a fresh status")
    gpu = json.loads(run("--config", config, "status", "--json").stdout)["nodes"][0]["gpus"][0]
    r = run_env("gpu", "clear", gpu["uuid"], "--reason", "checked", *url, token=owner)
    assert r.returncode == 0 and f"clear the fault on {gpu['uuid']}" in r.stdout, r.stderr

    remote_audit = run_env("audit", "--json", *url, token=owner)
    local_audit = run("--config", config, "audit", "--json")
    assert json.loads(remote_audit.stdout) == json.loads(local_audit.stdout)
    actions = [(a["action"], a["outcome"]) for a in json.loads(local_audit.stdout)]
    for done in ("token.create", "token.revoke", "gpu.clear"):
        assert (done, "ok") in actions, actions
    assert "token.revoke" in run_env("audit", *url, token=owner).stdout
    assert broker.stop() == 0


def test_docs_load_nothing_from_elsewhere(served: tuple[Path, ApiBroker]) -> None:
    _, broker = served
    page = httpx.get(f"{broker.url}/docs", timeout=30)
    assert page.status_code == 200 and "text/html" in page.headers["content-type"]
    assert "SwaggerUIBundle" in page.text
    assert "://" not in page.text  # no URL of another host, no CDN
    assert "default-src 'none'" in page.headers["content-security-policy"]
    refs = re.findall(r'(?:src|href)="([^"]+)"', page.text) + re.findall(
        r"url: '([^']+)'", page.text
    )
    assert {"/openapi.json", "/docs/swagger-ui-bundle.js", "/docs/swagger-ui.css"} <= set(refs)
    for ref in refs:
        assert ref.startswith("/") and not ref.startswith("//"), ref
        got = httpx.get(f"{broker.url}{ref}", timeout=30)
        assert got.status_code == 200 and got.content, ref
        if ref.endswith(".css"):  # what a style sheet loads: only data: URLs
            assert all(u.strip("'\"").startswith("data:")
                       for u in re.findall(r"url\(([^)]*)\)", got.text)), ref  # fmt: skip
    assert httpx.get(f"{broker.url}/docs/swagger-ui-bundle.js?name=../x").status_code == 200
    assert httpx.get(f"{broker.url}/docs/..%2Fopenapi.json").status_code == 404
    assert broker.stop() == 0
