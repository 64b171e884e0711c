"""``token create --save FILE`` never replaces a file silently (issue 31): an
existing FILE is refused before a token is made, ``--force`` replaces it, and a
link is never written through (the CLI may run as root)."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuwarden import cli
from gpuwarden.store.sqlite import SqliteStore


def _create(config: Path, save: Path, *extra: str) -> int:
    return cli.main(
        ["--config", str(config), "token", "create", "ci", "--role", "submitter",
         "--save", str(save), *extra]
    )  # fmt: skip


@pytest.fixture
def config(tmp_path: Path) -> Path:
    path = tmp_path / "gpuwarden.toml"
    path.write_text(f'state_dir = "{tmp_path / "state"}"\n')
    return path


def _tokens(config: Path) -> int:
    store = SqliteStore(config.parent / "state" / "gpuwarden.db")
    try:
        return len(store.list_tokens())
    finally:
        store.close()


def test_an_existing_file_is_refused_before_a_token_is_made(
    config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    held = tmp_path / "token"
    assert _create(config, held) == 0
    first = held.read_text()
    assert first.startswith("gw_") and _tokens(config) == 1
    capsys.readouterr()
    assert _create(config, held) == 2  # the file holds a token already
    err = capsys.readouterr().err
    assert "the file exists (it may hold another token" in err and "--force" in err
    assert held.read_text() == first and _tokens(config) == 1  # kept; none made
    assert _create(config, held, "--force") == 0
    assert held.read_text() != first and _tokens(config) == 2
    assert held.stat().st_mode & 0o777 == 0o600


def test_a_link_is_not_written_through_and_the_token_is_still_shown(
    config: Path, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    victim = tmp_path / "victim"
    victim.write_text("precious\n")
    link = tmp_path / "link"
    link.symlink_to(victim)
    assert os.path.islink(link)  # the planted link
    capsys.readouterr()
    assert _create(config, link, "--force") == 1
    out, err = capsys.readouterr()
    assert victim.read_text() == "precious\n"  # nothing written through it
    assert "could not be written there" in err and "made all the same" in err
    assert out.strip().startswith("gw_") and _tokens(config) == 1  # shown, not lost
