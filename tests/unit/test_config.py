"""load_config: defaults, path resolution, overrides and errors that name the key."""

from __future__ import annotations

import os
from pathlib import Path

import pytest

from gpuwarden.config import Config, load_config
from gpuwarden.core.model import GIB, MIB
from gpuwarden.errors import ConfigError, UserError

TOP_KEYS = (
    "allow_host_jobs, allow_unpinned_images, allow_unsandboxed_containers, api, broker, "
    "cluster, commands, container_runtime, create_queue_roots, database, gpu, gpu_lock, "
    "gpu_lock_group, limits, module_paths, modules, node_name, "
    "queue_roots, runtimes, sandbox, sandbox_image, sim_gpu, sources, state_dir, vram, warm"
)
BROKER_KEYS = (
    "clip_chars, cpu_slots, fair_share_half_life_s, kill_grace_s, max_interruptions, on_stop, "
    "poll_interval_s, ram_floor_gib, shutdown_grace_s, status_interval_s"
)


@pytest.fixture(autouse=True)
def _clean_env(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    for name in ("GPUWARDEN_STATE_DIR", "GPUWARDEN_MODULES", "GPUWARDEN_CONFIG"):
        monkeypatch.delenv(name, raising=False)
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "xdg"))
    work = tmp_path / "cwd"
    work.mkdir()
    monkeypatch.chdir(work)


def write(path: Path, text: str) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(text)
    return path


def config_error(path: Path | None, **kwargs: Path) -> str:
    with pytest.raises(ConfigError) as info:
        load_config(path, **kwargs)
    assert isinstance(info.value, UserError)
    return str(info.value)


# --- defaults -------------------------------------------------------------------------


def test_defaults_without_a_file(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GPUWARDEN_STATE_DIR", str(tmp_path / "state"))
    mods = tmp_path / "mods"
    monkeypatch.setenv("GPUWARDEN_MODULES", f"{mods}{os.pathsep}{tmp_path / 'more'}")
    config = load_config(None)
    assert isinstance(config, Config)
    assert config.state_dir == (tmp_path / "state").resolve()
    assert config.db_path == (tmp_path / "state" / "gpuwarden.db").resolve()
    assert config.module_paths == [mods, tmp_path / "more"]
    assert config.queue_roots == []
    assert config.gpu == "auto"
    assert config.create_queue_roots is True
    assert config.node_name  # the host name
    assert config.broker.cpu_slots == 4
    assert config.broker.poll_interval_s == 0.1
    assert config.broker.clip_chars == 16384
    assert config.sim_gpu.count == 1
    assert config.sim_vram_bytes == 24 * GIB
    assert config.bundle_limits_bytes() == (1024 * MIB, 10_000, 4096 * MIB, 1000)


def test_default_state_dir_from_relative_env_resolves_against_cwd(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("GPUWARDEN_STATE_DIR", "rel/state")
    assert load_config(None).state_dir == (tmp_path / "cwd" / "rel" / "state").resolve()


def test_default_state_dir_without_env_uses_xdg_state_home(tmp_path: Path) -> None:
    assert load_config(None).state_dir == (tmp_path / "xdg" / "gpuwarden").resolve()


def test_empty_file_gives_defaults(monkeypatch: pytest.MonkeyPatch, tmp_path: Path) -> None:
    monkeypatch.setenv("GPUWARDEN_STATE_DIR", str(tmp_path / "envstate"))
    config = load_config(write(tmp_path / "etc" / "gw.toml", ""))
    assert config.state_dir == (tmp_path / "envstate").resolve()
    assert config.broker.cpu_slots == 4
    assert config.queue_roots == []


def test_values_from_the_file(tmp_path: Path) -> None:
    path = write(
        tmp_path / "gw.toml",
        """
node_name = "box1"
gpu = "sim"
create_queue_roots = false

[sim_gpu]
count = 2
vram_gib = 48.0

[broker]
cpu_slots = 8
clip_chars = 1000

[limits]
max_bundle_mib = 2
max_jobs_per_bundle = 3
""",
    )
    config = load_config(path)
    assert config.node_name == "box1"
    assert config.gpu == "sim"
    assert config.create_queue_roots is False
    assert config.sim_gpu.count == 2
    assert config.sim_vram_bytes == 48 * GIB
    assert config.broker.cpu_slots == 8
    assert config.broker.clip_chars == 1000
    assert config.bundle_limits_bytes() == (2 * MIB, 10_000, 4096 * MIB, 3)


# --- path resolution ------------------------------------------------------------------


def test_relative_paths_resolve_against_the_config_files_directory(tmp_path: Path) -> None:
    etc = tmp_path / "etc"
    path = write(
        etc / "gw.toml",
        """
state_dir = "state"
queue_roots = ["q1", "../shared/q2"]
module_paths = ["mods", "./more/mods"]
""",
    )
    config = load_config(path)  # cwd is tmp_path/cwd, not etc
    assert config.state_dir == (etc / "state").resolve()
    assert config.queue_roots == [(etc / "q1").resolve(), (tmp_path / "shared" / "q2").resolve()]
    assert config.module_paths == [(etc / "mods").resolve(), (etc / "more" / "mods").resolve()]


def test_relative_config_path_itself(tmp_path: Path) -> None:
    write(tmp_path / "cwd" / "conf" / "gw.toml", 'state_dir = "s"\nqueue_roots = ["q"]\n')
    config = load_config(Path("conf/gw.toml"))
    assert config.state_dir == (tmp_path / "cwd" / "conf" / "s").resolve()
    assert config.queue_roots == [(tmp_path / "cwd" / "conf" / "q").resolve()]


def test_absolute_paths_stay(tmp_path: Path) -> None:
    elsewhere = tmp_path / "abs"
    path = write(
        tmp_path / "etc" / "gw.toml",
        f'state_dir = "{elsewhere / "s"}"\nqueue_roots = ["{elsewhere / "q"}"]\n'
        f'module_paths = ["{elsewhere / "m"}"]\n',
    )
    config = load_config(path)
    assert config.state_dir == (elsewhere / "s").resolve()
    assert config.queue_roots == [(elsewhere / "q").resolve()]
    assert config.module_paths == [(elsewhere / "m").resolve()]


def test_module_paths_default_when_not_in_file(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("GPUWARDEN_MODULES", str(tmp_path / "envmods"))
    config = load_config(write(tmp_path / "etc" / "gw.toml", 'state_dir = "s"\n'))
    assert config.module_paths == [tmp_path / "envmods"]


def test_state_dir_override_wins_over_file_and_env(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> None:
    monkeypatch.setenv("GPUWARDEN_STATE_DIR", str(tmp_path / "envstate"))
    path = write(tmp_path / "etc" / "gw.toml", 'state_dir = "filestate"\n')
    override = tmp_path / "cli-state"
    assert load_config(path, state_dir=override).state_dir == override.resolve()
    assert load_config(None, state_dir=override).state_dir == override.resolve()


def test_relative_state_dir_override_resolves_against_cwd(tmp_path: Path) -> None:
    path = write(tmp_path / "etc" / "gw.toml", 'state_dir = "filestate"\n')
    config = load_config(path, state_dir=Path("cli"))
    assert config.state_dir == (tmp_path / "cwd" / "cli").resolve()


# --- errors ---------------------------------------------------------------------------


def test_unknown_top_level_key(tmp_path: Path) -> None:
    path = write(tmp_path / "gw.toml", "colour = 'red'\n")
    assert config_error(path) == (
        f"config {path} is not valid:\n  unknown key 'colour'; allowed keys here: {TOP_KEYS}"
    )


def test_unknown_nested_key(tmp_path: Path) -> None:
    path = write(tmp_path / "gw.toml", "[broker]\ncpu_slot = 3\n")
    assert config_error(path) == (
        f"config {path} is not valid:\n"
        f"  unknown key 'broker.cpu_slot'; allowed keys here: {BROKER_KEYS}"
    )


def test_unknown_key_in_sim_gpu(tmp_path: Path) -> None:
    path = write(tmp_path / "gw.toml", "[sim_gpu]\nvram = 8\n")
    message = config_error(path)
    assert (
        "unknown key 'sim_gpu.vram'; allowed keys here: count, name, release_delay_s, vram_gib"
        in (message)
    )


def test_wrong_type_names_the_key(tmp_path: Path) -> None:
    path = write(tmp_path / "gw.toml", '[broker]\ncpu_slots = "many"\n')
    message = config_error(path)
    assert message.startswith(f"config {path} is not valid:\n  key 'broker.cpu_slots': ")
    assert "valid integer" in message
    assert "(got 'many')" in message


@pytest.mark.parametrize(
    ("toml", "key", "got"),
    [
        ('gpu = "cuda"', "gpu", "'cuda'"),
        ("state_dir = 5", "state_dir", "5"),
        ('queue_roots = "q"', "queue_roots", "'q'"),
        ("create_queue_roots = 3", "create_queue_roots", "3"),
        ('node_name = ""', "node_name", "''"),
        ("[broker]\ncpu_slots = 0", "broker.cpu_slots", "0"),
        ("[broker]\nclip_chars = 10", "broker.clip_chars", "10"),
        ("[sim_gpu]\nvram_gib = -1", "sim_gpu.vram_gib", "-1"),
        ("[limits]\nmax_entries = 0", "limits.max_entries", "0"),
    ],
)
def test_invalid_values_name_the_key(tmp_path: Path, toml: str, key: str, got: str) -> None:
    path = write(tmp_path / "gw.toml", toml + "\n")
    message = config_error(path)
    assert f"key {key!r}: " in message
    assert f"(got {got})" in message


def test_several_errors_reported_together(tmp_path: Path) -> None:
    path = write(tmp_path / "gw.toml", 'gpu = "cuda"\nbogus = 1\n[broker]\ncpu_slots = -1\n')
    lines = config_error(path).splitlines()
    assert lines[0] == f"config {path} is not valid:"
    assert len(lines) == 4
    assert any(line.startswith("  key 'gpu': ") for line in lines)
    assert any(line.startswith("  key 'broker.cpu_slots': ") for line in lines)
    assert f"  unknown key 'bogus'; allowed keys here: {TOP_KEYS}" in lines


def test_override_does_not_hide_errors(tmp_path: Path) -> None:
    path = write(tmp_path / "gw.toml", "state_dir = 5\n")
    assert "key 'state_dir'" in config_error(path, state_dir=tmp_path / "s")


def test_invalid_toml(tmp_path: Path) -> None:
    path = write(tmp_path / "gw.toml", "[broker\ncpu_slots = 1\n")
    assert config_error(path).startswith(f"config file {path} is not valid TOML: ")


def test_duplicate_key_is_invalid_toml(tmp_path: Path) -> None:
    path = write(tmp_path / "gw.toml", "gpu = 'sim'\ngpu = 'nvml'\n")
    assert config_error(path).startswith(f"config file {path} is not valid TOML: ")


def test_missing_file(tmp_path: Path) -> None:
    path = tmp_path / "nope.toml"
    assert config_error(path) == f"config file {path} does not exist"


def test_non_utf8_file_is_a_config_error(tmp_path: Path) -> None:
    path = tmp_path / "gw.toml"
    path.write_bytes(b"node_name = '\xff\xfe'\n")
    assert str(path) in config_error(path)


def test_directory_as_config_file_is_a_config_error(tmp_path: Path) -> None:
    assert str(tmp_path) in config_error(tmp_path)


# --- the sandbox ------------------------------------------------------------------------


def test_sandbox_defaults_are_local_and_locked() -> None:
    config = Config()
    assert config.container_runtime.value == "local"
    assert not config.allow_unsandboxed_containers and not config.allow_host_jobs
    assert config.sandbox.uid == 65534 and config.sandbox.cgroups


def test_podman_without_an_image_says_how_to_build_one(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('container_runtime = "podman"\n')
    assert "images/build.sh --runtime podman --pin" in config_error(cfg)


def test_an_unpinned_image_is_refused_unless_allowed(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('container_runtime = "docker"\nsandbox_image = "python:3.11-slim"\n')
    assert "is not pinned" in config_error(cfg) and "allow_unpinned_images" in config_error(cfg)
    cfg.write_text(cfg.read_text() + "allow_unpinned_images = true\n")
    assert load_config(cfg).sandbox_image == "python:3.11-slim"
    cfg.write_text(f'container_runtime = "podman"\nsandbox_image = "sha256:{"ab" * 32}"\n')
    assert load_config(cfg).container_runtime.value == "podman"


def test_bubblewrap_needs_no_image_and_weights_resolve_against_the_file(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('container_runtime = "bubblewrap"\n[sandbox]\nweights_dir = "w"\nuid = 1000\n')
    config = load_config(cfg)
    assert config.sandbox.weights_dir == tmp_path / "w"
    assert config.launch_rules.runtime.value == "bubblewrap"


def test_an_unknown_runtime_and_a_root_uid_are_refused(tmp_path: Path) -> None:
    cfg = tmp_path / "c.toml"
    cfg.write_text('container_runtime = "lxc"\n[sandbox]\nuid = 0\n')
    text = config_error(cfg)
    assert "key 'container_runtime'" in text and "key 'sandbox.uid'" in text


def test_gpu_lock_is_off_by_default_and_taken_as_written(tmp_path: Path) -> None:
    assert load_config(None, state_dir=tmp_path).gpu_lock == ""
    path = write(tmp_path / "gw.toml", 'gpu_lock = "/run/gpuwarden/GPU-<uuid>.lock"\n')
    assert load_config(path).gpu_lock == "/run/gpuwarden/GPU-<uuid>.lock"


@pytest.mark.parametrize(
    ("template", "says"),
    [
        ("run/GPU-<uuid>.lock", "must be an absolute path"),
        ("/run/gpuwarden/GPU.lock", "must contain <uuid> or {uuid}"),
        ("/run/<uuid>/GPU.lock", "<uuid> may only be in the file's name"),
    ],
)
def test_a_bad_gpu_lock_is_a_config_error(tmp_path: Path, template: str, says: str) -> None:
    path = write(tmp_path / "gw.toml", f'gpu_lock = "{template}"\n')
    message = config_error(path)
    assert "gpu_lock" in message and says in message


def test_gpu_lock_group_is_a_group_name_or_number(tmp_path: Path) -> None:
    """Who may take a GPU's lock (issue 30, item 10): a group, checked when read."""
    assert load_config(None, state_dir=tmp_path).gpu_lock_group == ""
    for group in ("gpulock", "1234"):
        path = write(tmp_path / "gw.toml", f'gpu_lock_group = "{group}"\n')
        assert load_config(path).gpu_lock_group == group
    path = write(tmp_path / "gw.toml", 'gpu_lock_group = "a b; rm"\n')
    message = config_error(path)
    assert "gpu_lock_group" in message and "not a group name or number" in message


def test_sources_allow_globs_must_name_a_scheme(tmp_path: Path) -> None:
    path = write(tmp_path / "gw.toml", "[sources]\nallow = ['git.example.org/*']\n")
    assert "must start with https://, ssh:// or file://" in config_error(path)


# --- [modules.<name>] ---------------------------------------------------------------


def test_a_modules_model_dir_resolves_against_the_file(tmp_path: Path) -> None:
    (tmp_path / "models" / "sao").mkdir(parents=True)
    cfg = write(
        tmp_path / "gw.toml",
        '[modules.audiogen]\nmodel_dir = "models/sao"\n'
        '[modules.speech]\nmodel_dir = "/srv/voxcpm2"\n[modules.echo]\n',
    )
    config = load_config(cfg)
    assert config.modules["audiogen"].model_dir == tmp_path / "models" / "sao"
    assert config.modules["speech"].model_dir == Path("/srv/voxcpm2")
    assert config.modules["echo"].model_dir is None  # an empty table: nothing given
    assert load_config(None, state_dir=tmp_path).modules == {}
    # the folders are checked when a node starts: audiogen's is there, speech's not
    with pytest.raises(ConfigError, match=r"\[modules\.speech\] model_dir /srv/voxcpm2 does not"):
        config.check_modules()


def test_an_unknown_key_in_a_module_table_is_refused_naming_the_allowed(tmp_path: Path) -> None:
    cfg = write(tmp_path / "gw.toml", '[modules.speech]\nmodel_dirs = "m"\n')
    text = config_error(cfg)
    assert "unknown key 'modules.speech.model_dirs'; allowed keys here: model_dir" in text


@pytest.mark.parametrize("name", ["Speech", "9lives", "a-b", "a.b"])
def test_a_module_table_must_be_named_as_a_module(tmp_path: Path, name: str) -> None:
    cfg = write(tmp_path / "gw.toml", f'[modules."{name}"]\nmodel_dir = "m"\n')
    text = config_error(cfg)
    assert "key 'modules'" in text and f"{name!r} is not a module name" in text


def test_a_missing_model_dir_or_a_file_is_refused_naming_the_key(tmp_path: Path) -> None:
    (tmp_path / "file").write_text("not a folder")
    cfg = write(tmp_path / "gw.toml", '[modules.audiogen]\nmodel_dir = "nowhere"\n')
    with pytest.raises(ConfigError) as info:
        load_config(cfg).check_modules()
    assert str(info.value).startswith(
        f"[modules.audiogen] model_dir {tmp_path / 'nowhere'} does not exist: stage"
    )
    cfg.write_text('[modules.audiogen]\nmodel_dir = "file"\n')
    with pytest.raises(ConfigError, match=r"model_dir .*/file is not a folder"):
        load_config(cfg).check_modules()
