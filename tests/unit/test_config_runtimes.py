"""``[[runtimes]]`` in the config: managed runtimes, checked when the file is read."""

from __future__ import annotations

from pathlib import Path

import pytest

from gpuwarden.config import load_config
from gpuwarden.core.runtime import RuntimeKind
from gpuwarden.errors import ConfigError


def write(tmp_path: Path, text: str) -> Path:
    path = tmp_path / "gpuwarden.toml"
    path.write_text('state_dir = "state"\n' + text)
    return path


def test_runtimes_are_read_with_their_defaults_and_paths_resolved(tmp_path: Path) -> None:
    path = write(
        tmp_path,
        """
[[runtimes]]
name = "ollama"
kind = "ollama"
url = "http://127.0.0.1:11434"

[[runtimes]]
name = "comfy"
kind = "comfyui"
url = "http://127.0.0.1:8188"
credential_file = "secrets/comfy.token"
gpus = ["GPU-1234"]
idle_grace_s = 60

[[runtimes]]
name = "mine"
kind = "generic"
url = "http://127.0.0.1:9000"
busy = { path = "/status", busy_key = "running" }
release = { method = "POST", path = "/unload" }
""",
    )
    config = load_config(path, check=False)
    ollama, comfy, mine = config.runtimes
    assert (ollama.kind, ollama.idle_grace_s, ollama.credential_file) == (
        RuntimeKind.OLLAMA,
        300.0,
        None,
    )
    assert comfy.credential_file == (tmp_path / "secrets" / "comfy.token").resolve()
    assert (comfy.gpus, comfy.idle_grace_s) == (["GPU-1234"], 60.0)
    assert mine.busy is not None and mine.busy.busy_key == "running"
    assert mine.release is not None and mine.release.method == "POST"


@pytest.mark.parametrize(
    ("entry", "said"),
    [
        ('name = "x"\nkind = "triton"\nurl = "http://h:1"', "runtimes.0.kind"),
        ('name = "x"\nkind = "ollama"\nurl = "ftp://h:1"', "runtimes.0.url"),
        ('name = "x y"\nkind = "ollama"\nurl = "http://h:1"', "runtimes.0.name"),
        ('name = "x"\nkind = "ollama"\nurl = "http://h:1"\nport = 3', "allowed keys here:"),
        (
            'name = "x"\nkind = "ollama"\nurl = "http://h:1"\nrelease = { path = "/free" }',
            'kind = "generic" only',
        ),
        (
            'name = "x"\nkind = "generic"\nurl = "http://h:1"\nbusy = { path = "/s" }',
            "busy needs busy_key",
        ),
    ],
)
def test_a_bad_runtime_entry_says_which_key_and_what_is_allowed(
    tmp_path: Path, entry: str, said: str
) -> None:
    with pytest.raises(ConfigError) as caught:
        load_config(write(tmp_path, f"[[runtimes]]\n{entry}\n"), check=False)
    assert said in str(caught.value)


def test_two_runtimes_of_one_name_are_refused(tmp_path: Path) -> None:
    entry = '[[runtimes]]\nname = "o"\nkind = "ollama"\nurl = "http://h:1"\n'
    with pytest.raises(ConfigError, match="runtime names must be unique; given twice: o"):
        load_config(write(tmp_path, entry + entry), check=False)
