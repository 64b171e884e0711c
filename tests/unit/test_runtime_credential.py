"""A runtime's ``credential_file`` is read following no link on its whole path,
and no byte of it is ever quoted (issue 30, item 2).

The attack: whoever may write a folder on the path (the runtime's service user)
swaps in a link to a folder or a file only root may read. Before the fix the
path was ``resolve()``d when the config was loaded, so the no-follow read saw
only the link's target: root sent a root-only secret as the Bearer header to
the runtime's URL, and a link to ``/etc/shadow`` put that file's text into the
error of ``gpuwarden runtimes``.
"""

from __future__ import annotations

import json
import os
import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from gpuwarden.app import runtime_spec, runtime_token
from gpuwarden.cli import main
from gpuwarden.config import RuntimeSettings, load_config
from gpuwarden.errors import UserError
from gpuwarden.node.runtimes import client_for

#: what only root may read (a token of another service, the text of /etc/shadow)
SECRET = b"root-only-SECRET-9f2c41d7"
SHADOW = b"root:$6$salt$" + SECRET + b":19000:0:99999:7:::\ndaemon:*:19000:0:99999:7:::\n"
#: the token the operator meant
GOOD = "runtime-token-0123456789"


class Recorder(BaseHTTPRequestHandler):
    """A ``generic`` runtime's API that records each request's Authorization header."""

    seen: list[str | None]

    def do_GET(self) -> None:
        self.server.seen.append(self.headers.get("Authorization"))  # type: ignore[attr-defined]
        body = json.dumps({"running": False}).encode()
        self.send_response(200)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(body)))
        self.end_headers()
        self.wfile.write(body)

    def log_message(self, *args: object) -> None:
        return None


@pytest.fixture
def runtime_api() -> Iterator[tuple[str, list[str | None]]]:
    server = ThreadingHTTPServer(("127.0.0.1", 0), Recorder)
    seen: list[str | None] = []
    server.seen = seen  # type: ignore[attr-defined]
    thread = threading.Thread(target=server.serve_forever, daemon=True)
    thread.start()
    try:
        yield f"http://127.0.0.1:{server.server_address[1]}", seen
    finally:
        server.shutdown()
        server.server_close()


@pytest.fixture
def site(tmp_path: Path) -> Path:
    """``secrets/``: root's, 0700, a 0600 secret and a shadow-like file in it;
    ``svc/``: the runtime's service user's folder (it may change anything in it)."""
    secrets = tmp_path / "secrets"
    secrets.mkdir(mode=0o700)
    for name, data in (("token", SECRET), ("shadow", SHADOW)):
        (secrets / name).write_bytes(data)
        (secrets / name).chmod(0o600)
    (tmp_path / "svc").mkdir()
    return tmp_path


def write_config(site: Path, credential: str, url: str = "http://127.0.0.1:9") -> Path:
    path = site / "gpuwarden.toml"
    path.write_text(
        f'state_dir = "state"\n[[runtimes]]\nname = "gen"\nkind = "generic"\nurl = "{url}"\n'
        f'credential_file = "{credential}"\nbusy = {{ path = "/status", busy_key = "running" }}\n'
    )
    return path


def runtime_of(config_path: Path) -> RuntimeSettings:
    (runtime,) = load_config(config_path, check=False).runtimes
    return runtime


def refusal(runtime: RuntimeSettings) -> str:
    with pytest.raises(UserError) as caught:
        runtime_token(runtime)
    return str(caught.value)


def test_a_linked_folder_on_the_path_is_refused_and_the_secret_never_sent(
    site: Path, runtime_api: tuple[str, list[str | None]], capsys: pytest.CaptureFixture[str]
) -> None:
    url, seen = runtime_api
    # the service user turns a folder on the path into a link to root's secrets
    (site / "svc" / "conf").symlink_to(site / "secrets")
    path = site / "svc" / "conf" / "token"
    assert path.read_bytes() == SECRET  # the attack is real: following links, it is the secret
    runtime = runtime_of(write_config(site, "svc/conf/token", url))
    # not resolved at load: the path is still the one written, link and all
    assert runtime.credential_file == path

    said = refusal(runtime)
    assert f"{site}/svc/conf is a symlink" in said, said
    assert SECRET.decode() not in said

    # the command an operator runs: it says why, sends nothing, quotes nothing
    assert main(["--config", str(site / "gpuwarden.toml"), "runtimes", "--json"]) != 0
    out = capsys.readouterr()
    assert "is a symlink" in out.err
    assert SECRET.decode() not in out.out + out.err
    assert seen == []


def test_a_link_to_a_shadow_like_file_never_reaches_an_error(
    site: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    (site / "svc" / "token").symlink_to(site / "secrets" / "shadow")
    assert (site / "svc" / "token").read_bytes() == SHADOW  # the link really leads there
    config = write_config(site, "svc/token")
    said = refusal(runtime_of(config))
    assert "is a symlink" in said and SECRET.decode() not in said and "root:" not in said
    assert main(["--config", str(config), "runtimes"]) != 0
    out = capsys.readouterr()
    assert SECRET.decode() not in out.out + out.err and "daemon:" not in out.out + out.err


def test_a_hard_link_to_a_root_only_file_is_refused(site: Path) -> None:
    os.link(site / "secrets" / "shadow", site / "svc" / "token")  # as with protected_hardlinks=0
    assert (site / "svc" / "token").read_bytes() == SHADOW
    said = refusal(runtime_of(write_config(site, "svc/token")))
    assert "hard links" in said and SECRET.decode() not in said


def test_a_file_that_is_not_one_token_is_refused_unquoted(site: Path) -> None:
    """A plain file the operator named, that holds lines (a shadow file, a config):
    never sent as a header, never quoted."""
    (site / "svc" / "token").write_bytes(SHADOW)
    said = refusal(runtime_of(write_config(site, "svc/token")))
    assert "is not one bearer token" in said and f"{len(SHADOW)} bytes" in said
    assert SECRET.decode() not in said and "root:" not in said


def test_a_fifo_and_a_large_file_are_refused(site: Path) -> None:
    os.mkfifo(site / "svc" / "fifo")
    assert "fifo" in refusal(runtime_of(write_config(site, "svc/fifo")))
    (site / "svc" / "big").write_bytes(b"x" * 5000)
    assert "larger than" in refusal(runtime_of(write_config(site, "svc/big")))


def test_a_plain_path_still_works_and_the_token_is_sent(
    site: Path, runtime_api: tuple[str, list[str | None]], capsys: pytest.CaptureFixture[str]
) -> None:
    url, seen = runtime_api
    (site / "svc" / "token").write_text(GOOD + "\n")
    (site / "svc" / "token").chmod(0o600)
    # ``..`` in the path is taken as written (no link is followed to find it)
    config = write_config(site, "svc/../svc/token", url)
    runtime = runtime_of(config)
    assert runtime.credential_file == site / "svc" / "token"
    assert runtime_token(runtime) == GOOD
    spec = runtime_spec(runtime)
    assert GOOD not in repr(spec)  # a logged setting shows no secret
    client = client_for(spec)
    try:
        client.probe()
    finally:
        client.close()
    assert seen and seen[-1] == f"Bearer {GOOD}"
    assert main(["--config", str(config), "runtimes", "--json"]) == 0
    out = capsys.readouterr()
    assert json.loads(out.out)["runtimes"][0]["state"] == "idle", out.out
    assert GOOD not in out.out + out.err


def test_no_credential_file_and_an_empty_one_send_no_header(site: Path) -> None:
    (site / "svc" / "empty").write_text("\n")
    assert runtime_token(runtime_of(write_config(site, "svc/empty"))) is None
