"""File names over HTTP are hostile: an agent's output upload and a client's output
download refuse every bad name with a 4xx that says what is wrong (never a 500),
write only below the attempt's folder, and never serve a link, a FIFO or a device."""

from __future__ import annotations

import json
import os
import stat
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from gpuwarden.core.model import JobSpec
from gpuwarden.store.base import Submission
from tests.integration.test_api import Api, build, done_job
from tests.integration.test_nodes_api import Env, _put, _started

SECRET = "the secret outside every job folder"

# (name as it goes in the URL, what the error says)
BAD_NAMES = [
    ("x" * 300, "is 300 bytes long; a file or folder name may have at most 255 bytes"),
    ("\u00e9" * 128, "is 256 bytes long"),
    ("ok/" + "y" * 256 + "/f", "has a part"),
    ("%FF%FE", "is not valid UTF-8"),
    ("a%C3%28b", "is not valid UTF-8"),
    ("%ED%A0%80", "is not valid UTF-8"),  # a surrogate, encoded
    # dots percent-encoded: a client library would remove "a/../b" before sending,
    # an attacker's does not, and the server decodes %2E
    ("a/%2E%2E/b", "names '.' or '..'"),
    ("%2E%2E", "names '.' or '..'"),
    ("%2E/a", "names '.' or '..'"),
    ("%2Fetc%2Fpasswd", "is absolute"),
    ("a//b", "has an empty part"),
    ("a/", "has an empty part"),
    ("a%5Cb", "has a backslash"),
    ("a%00b", "has a control character"),
    ("a%0Ab", "has a control character"),
    ("a%7Fb", "has a control character"),
    ("d/" * 70 + "f", "is 71 levels deep; at most 64"),
    ("/".join(["z" * 200] * 21), "bytes long; a path may have at most 4096 bytes"),
]


@pytest.fixture
def env(tmp_path: Path) -> Iterator[Env]:
    e = Env(tmp_path / "coord")
    yield e
    e.store.close()


@pytest.fixture
def secret(tmp_path: Path) -> Path:
    p = tmp_path / "secret.txt"
    p.write_text(SECRET)
    return p


def everything_under(top: Path) -> list[str]:
    return sorted(str(p.relative_to(top)) for p in top.rglob("*"))


# -- uploads ------------------------------------------------------------------------


@pytest.mark.parametrize(("name", "says"), BAD_NAMES, ids=[n[:24] for n, _ in BAD_NAMES])
def test_a_bad_upload_name_is_a_422_that_says_why(env: Env, name: str, says: str) -> None:
    env.enrol("a")
    lease = _started(env, "a", "j")
    before = everything_under(env.config.state_dir)
    r = _put(env, "a", f"/v1/node/jobs/j/outputs/{name}", b"x", lease)
    assert r.status_code == 422, r.text
    assert says in r.json()["error"], r.json()
    assert len(r.json()["error"]) < 600  # a long name is shown cut
    # nothing was written (the attempt's folder and the coordinator's .parts aside)
    after = set(everything_under(env.config.state_dir)) - set(before)
    assert after <= {"outputs", "outputs/j", "outputs/j/attempt-1", "outputs/.parts"}, after
    # the refusal is audited (a newline stops the URL matching any route: no row, like
    # any unknown endpoint); the coordinator is up and takes the next upload
    rows = [a for a in env.store.audit_rows() if a.action == "node.upload"]
    if "%0A" not in name:
        assert rows[-1].outcome.startswith("refused") and rows[-1].detail["status"] == 422
    ok = _put(env, "a", "/v1/node/jobs/j/outputs/fine.txt", b"fine", lease)
    assert ok.status_code == 200, ok.text


def test_an_empty_upload_name_is_a_422(env: Env) -> None:
    env.enrol("a")
    lease = _started(env, "a", "j")
    r = _put(env, "a", "/v1/node/jobs/j/outputs/", b"x", lease)
    assert r.status_code == 422 and "is empty" in r.json()["error"], r.text


def test_a_file_under_a_file_and_a_file_over_a_folder_are_422(env: Env) -> None:
    env.enrol("a")
    lease = _started(env, "a", "j")
    folder = env.config.state_dir / "outputs" / "j" / "attempt-1"
    assert _put(env, "a", "/v1/node/jobs/j/outputs/a.txt", b"A", lease).status_code == 200
    assert _put(env, "a", "/v1/node/jobs/j/outputs/sub/x", b"X", lease).status_code == 200
    # the attack is in place: a.txt is a file, sub a folder
    assert (folder / "a.txt").is_file() and (folder / "sub").is_dir()
    r = _put(env, "a", "/v1/node/jobs/j/outputs/a.txt/b", b"B", lease)
    assert r.status_code == 422 and "'a.txt' is a file, not a folder" in r.json()["error"]
    r = _put(env, "a", "/v1/node/jobs/j/outputs/a.txt/b/c", b"C", lease)
    assert r.status_code == 422 and "'a.txt' is a file" in r.json()["error"]
    r = _put(env, "a", "/v1/node/jobs/j/outputs/sub", b"S", lease)
    assert r.status_code == 422 and "exists as a folder" in r.json()["error"], r.text
    # nothing was lost or changed
    assert (folder / "a.txt").read_bytes() == b"A" and (folder / "sub" / "x").read_bytes() == b"X"
    assert everything_under(folder) == ["a.txt", "sub", "sub/x"]
    # the same name sent again (an agent that lost the answer) replaces the file whole
    assert _put(env, "a", "/v1/node/jobs/j/outputs/a.txt", b"A2", lease).status_code == 200
    assert (folder / "a.txt").read_bytes() == b"A2"
    assert not list((env.config.state_dir / "outputs" / ".parts").iterdir())


def test_an_upload_never_follows_a_link_in_the_attempt_folder(
    env: Env, tmp_path: Path, secret: Path
) -> None:
    env.enrol("a")
    lease = _started(env, "a", "j")
    folder = env.config.state_dir / "outputs" / "j" / "attempt-1"
    folder.mkdir(parents=True)
    (folder / "to-file").symlink_to(secret)
    (folder / "to-dir").symlink_to(secret.parent)
    assert (folder / "to-file").is_symlink() and (folder / "to-dir").is_symlink()

    def outside() -> list[str]:
        return [p for p in everything_under(tmp_path) if not p.startswith("coord")]

    before = outside()
    for name in ("to-dir/x.txt", "to-dir/new/x.txt", "to-file/x"):
        r = _put(env, "a", f"/v1/node/jobs/j/outputs/{name}", b"x", lease)
        assert r.status_code == 422, r.text
        assert "symlink" in r.json()["error"] and str(tmp_path) not in r.json()["error"]
    # the name of a link itself: the link is replaced by the file, its target untouched
    r = _put(env, "a", "/v1/node/jobs/j/outputs/to-file", b"new", lease)
    assert r.status_code == 200
    assert secret.read_text() == SECRET and (folder / "to-file").read_bytes() == b"new"
    assert not (tmp_path / "x.txt").exists() and not (tmp_path / "new").exists()
    assert outside() == before


def test_an_upload_the_coordinators_disk_cannot_take_is_a_503_to_try_again(env: Env) -> None:
    env.enrol("a")
    lease = _started(env, "a", "j")
    parts = env.config.state_dir / "outputs" / ".parts"
    parts.parent.mkdir(parents=True, exist_ok=True)
    parts.write_text("not a folder")  # the coordinator's own folder for uploads is broken
    assert parts.is_file()
    r = _put(env, "a", "/v1/node/jobs/j/outputs/o.txt", b"x", lease)
    assert r.status_code == 503 and r.headers["retry-after"] == "30", r.text
    assert "try again later" in r.json()["error"]
    assert str(env.config.state_dir) not in r.text  # no host path
    parts.unlink()
    assert _put(env, "a", "/v1/node/jobs/j/outputs/o.txt", b"x", lease).status_code == 200


# -- downloads -----------------------------------------------------------------------


@pytest.fixture
def api(tmp_path: Path) -> Iterator[Api]:
    a = build(tmp_path / "api")
    yield a
    a.store.close()


def _list_outputs(api: Api, job_id: str, outputs: list[str]) -> Path:
    job = api.store.get_job(job_id)
    assert job is not None
    api.store._db.execute(
        "UPDATE jobs SET result = ? WHERE id = ?",
        (json.dumps({**job.result, "outputs": outputs}), job_id),
    )
    return Path(job.result["output_dir"])


def test_a_link_a_fifo_or_a_device_in_an_output_folder_is_never_served(
    api: Api, tmp_path: Path, secret: Path
) -> None:
    done_job(api, "submitter", "j")
    names = ["out.txt", "link.txt", "fifo", "null", "d/x.txt", "sock"]
    out = _list_outputs(api, "j", names)
    (out / "link.txt").symlink_to(secret)
    os.mkfifo(out / "fifo")
    os.mknod(out / "null", stat.S_IFCHR | 0o600, os.makedev(1, 3))
    outside = tmp_path / "outside"
    outside.mkdir()
    (outside / "x.txt").write_text(SECRET)
    (out / "d").symlink_to(outside)
    import socket

    with socket.socket(socket.AF_UNIX) as s:
        s.bind(str(out / "sock"))
        # the attack is in place
        assert (out / "link.txt").is_symlink() and stat.S_ISFIFO((out / "fifo").lstat().st_mode)
        assert stat.S_ISCHR((out / "null").lstat().st_mode) and (out / "d").is_symlink()
        assert stat.S_ISSOCK((out / "sock").lstat().st_mode)
        for name, why in (
            ("link.txt", "is a symlink"),
            ("fifo", "is a fifo, not a regular file"),
            ("null", "is a character device"),
            ("d/x.txt", "'d' is a symlink"),
            ("sock", "socket"),
        ):
            r = api.client.get(f"/v1/jobs/j/outputs/{name}", headers=api.h("submitter"))
            assert r.status_code == 404, (name, r.text)
            assert why in r.json()["error"], (name, r.json())
            assert SECRET not in r.text and str(tmp_path) not in r.text
    # a name that is not among its outputs, and a bad one: 404 and 422, never 500
    r = api.client.get("/v1/jobs/j/outputs/other.txt", headers=api.h("submitter"))
    assert r.status_code == 404 and "has no output 'other.txt'" in r.json()["error"]
    # the API is up, and the regular output is served
    r = api.client.get("/v1/jobs/j/outputs/out.txt", headers=api.h("submitter"))
    assert r.status_code == 200 and r.content == b"the output"
    assert r.headers["content-length"] == str(len(b"the output"))


@pytest.mark.parametrize(("name", "says"), BAD_NAMES, ids=[n[:24] for n, _ in BAD_NAMES])
def test_a_bad_download_name_is_a_422_that_says_why(api: Api, name: str, says: str) -> None:
    done_job(api, "submitter", "j")
    r = api.client.get(f"/v1/jobs/j/outputs/{name}", headers=api.h("submitter"))
    assert r.status_code == 422, r.text
    assert says in r.json()["error"]
    ok = api.client.get("/v1/jobs/j/outputs/out.txt", headers=api.h("submitter"))
    assert ok.status_code == 200


def test_a_listed_output_under_a_file_or_gone_is_a_404(api: Api) -> None:
    done_job(api, "submitter", "j")
    out = _list_outputs(api, "j", ["out.txt", "out.txt/b", "gone.txt", "sub"])
    (out / "sub").mkdir()
    for name, why in (
        ("out.txt/b", "'out.txt' is a file, not a folder"),
        ("gone.txt", "is not there"),
        ("sub", "is a folder, not a regular file"),
    ):
        r = api.client.get(f"/v1/jobs/j/outputs/{name}", headers=api.h("submitter"))
        assert r.status_code == 404 and why in r.json()["error"], (name, r.text)


def test_a_staged_input_that_is_a_link_is_not_served_to_a_node(
    env: Env, tmp_path: Path, secret: Path
) -> None:
    env.enrol("a")
    staged = tmp_path / "staged"
    staged.mkdir()
    (staged / "in.txt").symlink_to(secret)
    (staged / "ok.txt").write_text("ok")
    assert (staged / "in.txt").is_symlink()
    spec = JobSpec(
        id="c", type="testmods.cat", params={"file": "in.txt"}, inputs=("in.txt", "ok.txt")
    )
    env.store.submit([spec], now=env.clock.t, origin=Submission(input_dir=str(staged)))
    [job] = env.post("/v1/node/claim", "a", {"report": _report()}).json()["jobs"]

    def get(name: str) -> Any:
        return env.client.get(
            f"/v1/node/jobs/c/inputs/{name}",
            params={"lease_id": job["lease_id"]},
            headers=env.h("a"),
        )

    r = get("in.txt")
    assert r.status_code == 404 and "symlink" in r.json()["error"], r.text
    assert SECRET not in r.text
    assert get("x" * 300).status_code == 422
    r = get("ok.txt")
    assert r.status_code == 200 and r.content == b"ok"


def _report() -> dict[str, Any]:
    from tests.integration.test_nodes_api import report

    return report(24)
