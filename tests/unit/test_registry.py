"""The module registry: the shipped modules, the template, and every module.toml error."""

from __future__ import annotations

import importlib
import shutil
import sys
from pathlib import Path

import pytest

from gpuwarden.core.lease import LEASE_MODULE, LEASE_TYPE
from gpuwarden.core.model import GIB, JobType, Lane, LaunchMode, ParamSpec, ParamType
from gpuwarden.errors import ModuleError, UserError, ValidationError
from gpuwarden.registry import (
    BUILTIN_DIR,
    ModuleSource,
    Registry,
    SourceKind,
    fingerprint,
    parse_module,
)

MODULES = Path(__file__).parents[2] / "src" / "gpuwarden" / "modules"

GOOD_TYPE = """
[types.run]
lane = "cpu"
command = ["{python}", "src/run.py"]
"""


def make_module(root: Path, folder: str, toml: str | None) -> Path:
    path = root / folder
    (path / "src").mkdir(parents=True)
    (path / "src" / "run.py").write_text("print('hi')\n")
    if toml is not None:
        (path / "module.toml").write_text(toml)
    return path


def module_error(path: Path) -> str:
    with pytest.raises(ModuleError) as info:
        parse_module(path)
    assert isinstance(info.value, UserError)
    message = str(info.value)
    assert message.startswith(str(path / "module.toml") + ": ")
    return message


def head(name: str = "mine") -> str:
    return f'[module]\nname = "{name}"\n'


def only(*paths: Path) -> Registry:
    """The modules on ``paths`` alone: none installed with pip, none shipped."""
    return Registry.load(list(paths), installed=False, builtin=False)


# --- the shipped modules --------------------------------------------------------------


@pytest.fixture(scope="module")
def shipped() -> Registry:
    return Registry.load([MODULES])


def test_shipped_modules_load(shipped: Registry) -> None:
    assert "echo" in shipped.modules
    assert "_TEMPLATE" not in shipped.modules
    assert "echo.echo" in shipped.types
    assert not any(name.startswith("_") for name in shipped.types)


def test_echo_type(shipped: Registry) -> None:
    echo = shipped.get("echo.echo")
    assert echo.name == "echo.echo"
    assert echo.module == "echo"
    assert echo.module_dir == str((MODULES / "echo").resolve())
    assert echo.lane is Lane.CPU
    assert echo.launch is LaunchMode.HOST
    assert echo.command == ("{python}", "src/echo.py")
    assert echo.vram_bytes == 0
    assert echo.coresident is False
    assert echo.timeout_s == 60.0
    assert echo.max_retries == 1
    assert [p.name for p in echo.params] == ["text", "output", "sleep_s", "exit_code"]
    assert echo.param("text") == ParamSpec(
        "text", ParamType.STRING, required=True, description="The text to write."
    )
    output = echo.param("output")
    assert output is not None
    assert (output.type, output.required, output.default) == (ParamType.STRING, False, "echo.txt")
    sleep_s = echo.param("sleep_s")
    assert sleep_s is not None
    assert (sleep_s.type, sleep_s.default) == (ParamType.NUMBER, 0)
    exit_code = echo.param("exit_code")
    assert exit_code is not None
    assert (exit_code.type, exit_code.default) == (ParamType.INTEGER, 0)
    assert echo.param("nope") is None


def test_echo_module(shipped: Registry) -> None:
    module = shipped.module_of(shipped.get("echo.echo"))
    assert module.name == "echo"
    assert module.path == (MODULES / "echo").resolve()
    assert module.description.startswith("Writes a text to an output file.")
    assert module.fingerprint == fingerprint(MODULES / "echo" / "src")
    assert module.fingerprint.startswith("sha256:")
    assert len(module.fingerprint) == len("sha256:") + 64


def test_describe(shipped: Registry) -> None:
    described = {d["type"]: d for d in shipped.describe()}
    echo = described["echo.echo"]
    assert {k: echo[k] for k in ("type", "lane", "launch", "vram_bytes", "runs_here")} == {
        "type": "echo.echo",
        "lane": "cpu",
        "launch": "host",
        "vram_bytes": 0,
        "runs_here": True,
    }
    assert echo["description"].startswith("Write `text` to the output file")
    assert echo["source"] == {"kind": "built-in", "where": str(MODULES.resolve())}
    assert echo["refused"] is None and echo["runs_as"] == "host process"
    assert echo["unsandboxed"] is None and echo["sandboxed"] is False
    assert [p["name"] for p in echo["params"]] == ["text", "output", "sleep_s", "exit_code"]
    assert echo["params"][0] == {
        "name": "text",
        "type": "string",
        "required": True,
        "default": None,
        "description": "The text to write.",
    }
    # the default rules (no runtime, nothing allowed) refuse container types, and say why
    container = described["echo.container"]
    assert container["runs_here"] is False and container["runs_as"] == "refused"
    assert 'container_runtime is "local"' in container["refused"]


def test_get_unknown_type_lists_known_types(shipped: Registry) -> None:
    with pytest.raises(ValidationError) as info:
        shipped.get("nope.x")
    known = ", ".join(sorted(shipped.types))
    assert str(info.value) == f"unknown job type 'nope.x'; known types: {known}"
    assert "echo.echo" in str(info.value)


def test_get_on_an_empty_registry() -> None:
    with pytest.raises(ValidationError) as info:
        Registry([]).get("echo.echo")
    assert str(info.value) == ("unknown job type 'echo.echo'; known types: lease")


def test_argv_replaces_python(shipped: Registry) -> None:
    assert shipped.argv(shipped.get("echo.echo")) == (sys.executable, "src/echo.py")


def test_argv_replaces_only_whole_python_arguments() -> None:
    jt = JobType(
        name="m.t",
        module="m",
        module_dir="/m",
        lane=Lane.CPU,
        launch=LaunchMode.HOST,
        command=("{python}", "-u", "main.py", "--python={python}", "{python}"),
    )
    assert Registry([]).argv(jt) == (
        sys.executable,
        "-u",
        "main.py",
        "--python={python}",
        sys.executable,
    )


# --- the template ---------------------------------------------------------------------


def test_template_is_skipped_even_under_another_root(tmp_path: Path) -> None:
    shutil.copytree(MODULES / "_TEMPLATE", tmp_path / "_TEMPLATE")
    registry = only(tmp_path)
    # only the built-in lease type (core/lease.py)
    assert list(registry.modules) == [LEASE_MODULE]
    assert list(registry.types) == [LEASE_TYPE]


def test_template_is_valid_when_copied_and_renamed(tmp_path: Path) -> None:
    dest = tmp_path / "example"
    shutil.copytree(MODULES / "_TEMPLATE", dest)
    toml = (dest / "module.toml").read_text()
    assert 'name = "_TEMPLATE"' in toml
    (dest / "module.toml").write_text(toml.replace('name = "_TEMPLATE"', 'name = "example"'))
    module = parse_module(dest)
    assert module.name == "example"
    assert module.path == dest.resolve()
    assert [t.name for t in module.types] == ["example.example", "example.served"]
    served = module.types[1]
    assert served.launch is LaunchMode.SERVE and served.load_timeout_s == 600.0
    assert not served.keep_warm and served.expected_device_bytes is None
    jt = module.types[0]
    assert jt.lane is Lane.VRAM
    assert jt.launch is LaunchMode.HOST
    assert jt.vram_bytes == 2 * GIB
    assert jt.timeout_s == 600.0
    assert jt.max_retries == 2
    prompt, steps = jt.params
    assert (prompt.name, prompt.type, prompt.required) == ("prompt", ParamType.STRING, True)
    assert (steps.name, steps.type, steps.default) == ("steps", ParamType.INTEGER, 10)
    # and the registry loads it under its new name
    assert "example.example" in Registry.load([tmp_path]).types


def test_template_copied_without_renaming_is_refused(tmp_path: Path) -> None:
    dest = tmp_path / "example"
    shutil.copytree(MODULES / "_TEMPLATE", dest)
    message = module_error(dest)
    assert "key 'module.name' is '_TEMPLATE' but the folder is 'example'" in message


# --- Registry.load --------------------------------------------------------------------


def test_load_missing_module_path(tmp_path: Path) -> None:
    with pytest.raises(ModuleError) as info:
        Registry.load([tmp_path / "nope"])
    assert str(info.value) == (
        f"module path {tmp_path / 'nope'} is not a directory (config key module_paths)"
    )


def test_load_skips_folders_without_module_toml_and_hidden_ones(tmp_path: Path) -> None:
    make_module(tmp_path, "empty", None)
    make_module(tmp_path, ".hidden", head(".hidden") + GOOD_TYPE)
    (tmp_path / "stray.txt").write_text("not a module")
    make_module(tmp_path, "mine", head() + GOOD_TYPE)
    registry = only(tmp_path)
    assert list(registry.modules) == ["mine", LEASE_MODULE]
    assert list(registry.types) == ["mine.run", LEASE_TYPE]


def test_load_first_path_wins(tmp_path: Path) -> None:
    make_module(tmp_path / "a", "mine", head() + 'description = "first"\n' + GOOD_TYPE)
    make_module(tmp_path / "b", "mine", head() + 'description = "second"\n' + GOOD_TYPE)
    registry = Registry.load([tmp_path / "a", tmp_path / "b"])
    assert registry.modules["mine"].description == "first"
    assert registry.modules["mine"].path == (tmp_path / "a" / "mine").resolve()


def test_load_reports_a_broken_module(tmp_path: Path) -> None:
    make_module(tmp_path, "mine", head("other") + GOOD_TYPE)
    with pytest.raises(ModuleError) as info:
        Registry.load([tmp_path])
    assert str(tmp_path / "mine" / "module.toml") in str(info.value)


def test_load_several_modules_and_types(tmp_path: Path) -> None:
    make_module(tmp_path, "alpha", head("alpha") + GOOD_TYPE)
    make_module(
        tmp_path,
        "beta",
        head("beta")
        + GOOD_TYPE
        + '[types.gen]\nlane = "vram"\nvram_gib = 1.5\ncoresident = true\ncommand = ["x"]\n',
    )
    registry = only(tmp_path)
    assert sorted(registry.types) == ["alpha.run", "beta.gen", "beta.run", LEASE_TYPE]
    gen = registry.get("beta.gen")
    assert gen.vram_bytes == int(1.5 * GIB)
    assert gen.coresident is True
    described = [d["type"] for d in registry.describe()]
    assert described == ["alpha.run", "beta.gen", "beta.run", LEASE_TYPE]


# --- parse_module errors: each names the file and the key -----------------------------


def test_missing_module_toml(tmp_path: Path) -> None:
    path = make_module(tmp_path, "mine", None)
    assert module_error(path) == (
        f"{path / 'module.toml'}: missing (every module folder needs one)"
    )


def test_bad_toml(tmp_path: Path) -> None:
    path = make_module(tmp_path, "mine", head() + "[types.run\nlane = 'cpu'\n")
    assert module_error(path).startswith(f"{path / 'module.toml'}: not valid TOML: ")


@pytest.mark.parametrize(
    ("toml", "key"),
    [
        (head() + 'colour = "red"\n' + GOOD_TYPE, "module.colour"),
        (head() + GOOD_TYPE + 'colour = "red"\n', "types.run.colour"),
        (
            head() + GOOD_TYPE + "[types.run.params.p]\ntype = 'string'\nhelp = 'x'\n",
            "types.run.params.p.help",
        ),
        (head() + GOOD_TYPE + "[extra]\nx = 1\n", "extra"),
    ],
    ids=["module", "type", "param", "top"],
)
def test_unknown_key(tmp_path: Path, toml: str, key: str) -> None:
    path = make_module(tmp_path, "mine", toml)
    message = module_error(path)
    assert f"key {key!r}: Extra inputs are not permitted" in message


def test_name_folder_mismatch(tmp_path: Path) -> None:
    path = make_module(tmp_path, "mine", head("other") + GOOD_TYPE)
    assert module_error(path) == (
        f"{path / 'module.toml'}: key 'module.name' is 'other' but the folder is 'mine'; "
        "they must match"
    )


def test_module_name_must_be_lower_case(tmp_path: Path) -> None:
    path = make_module(tmp_path, "Mine", head("Mine") + GOOD_TYPE)
    assert module_error(path) == (
        f"{path / 'module.toml'}: key 'module.name' must be lower-case letters, digits and _ "
        "(got 'Mine')"
    )


def test_missing_module_name(tmp_path: Path) -> None:
    path = make_module(tmp_path, "mine", "[module]\n" + GOOD_TYPE)
    assert "key 'module.name': Field required" in module_error(path)


def test_no_types(tmp_path: Path) -> None:
    path = make_module(tmp_path, "mine", head())
    assert "key 'types': Field required" in module_error(path)


def test_bad_type_name(tmp_path: Path) -> None:
    path = make_module(tmp_path, "mine", head() + GOOD_TYPE.replace("types.run", "types.Run"))
    assert module_error(path) == (
        f"{path / 'module.toml'}: [types.Run]: a type name must be lower-case letters, digits and _"
    )


@pytest.mark.parametrize(
    "toml",
    [
        '[types."run\\n"]\nlane = "cpu"\ncommand = ["x"]\n',
        GOOD_TYPE + '[types.run.params."p\\n"]\ntype = "string"\n',
    ],
    ids=["type", "param"],
)
def test_names_with_trailing_newline_are_refused(tmp_path: Path, toml: str) -> None:
    path = make_module(tmp_path, "mine", head() + toml)
    assert "must be lower-case" in module_error(path)


def test_vram_lane_with_zero_vram(tmp_path: Path) -> None:
    toml = head() + '[types.run]\nlane = "vram"\nvram_gib = 0\ncommand = ["x"]\n'
    path = make_module(tmp_path, "mine", toml)
    assert module_error(path) == (
        f"{path / 'module.toml'}: [types.run]: key 'vram_gib' must be > 0 on the vram lane"
    )


def test_vram_lane_without_vram_gib(tmp_path: Path) -> None:
    path = make_module(tmp_path, "mine", head() + '[types.run]\nlane = "vram"\ncommand = ["x"]\n')
    assert "key 'vram_gib' must be > 0 on the vram lane" in module_error(path)


def test_cpu_lane_with_vram(tmp_path: Path) -> None:
    path = make_module(tmp_path, "mine", head() + GOOD_TYPE + "vram_gib = 2\n")
    assert module_error(path) == (
        f"{path / 'module.toml'}: [types.run]: key 'vram_gib' must be 0 on the cpu lane (got 2.0)"
    )


def test_coresident_on_cpu_lane(tmp_path: Path) -> None:
    path = make_module(tmp_path, "mine", head() + GOOD_TYPE + "coresident = true\n")
    assert module_error(path) == (
        f"{path / 'module.toml'}: [types.run]: key 'coresident' only makes sense on the vram lane"
    )


def test_required_param_with_default(tmp_path: Path) -> None:
    toml = head() + GOOD_TYPE + '[types.run.params.p]\ntype = "string"\nrequired = true\n'
    path = make_module(tmp_path, "mine", toml + 'default = "x"\n')
    assert module_error(path) == (
        f"{path / 'module.toml'}: [types.run].params.p: a required parameter cannot have a default"
    )


@pytest.mark.parametrize(
    ("ptype", "default", "shown"),
    [
        ("integer", '"ten"', "'ten'"),
        ("integer", "1.5", "1.5"),
        ("integer", "true", "True"),
        ("number", '"0.5"', "'0.5'"),
        ("boolean", "1", "1"),
        ("string", "5", "5"),
        ("input", "false", "False"),
    ],
)
def test_default_of_wrong_type(tmp_path: Path, ptype: str, default: str, shown: str) -> None:
    toml = head() + GOOD_TYPE + f'[types.run.params.p]\ntype = "{ptype}"\ndefault = {default}\n'
    path = make_module(tmp_path, "mine", toml)
    assert module_error(path) == (
        f"{path / 'module.toml'}: [types.run].params.p: key 'default' {shown} is not a {ptype}"
    )


@pytest.mark.parametrize(
    ("ptype", "default", "value"),
    [("integer", "7", 7), ("number", "7", 7), ("number", "0.5", 0.5), ("boolean", "false", False)],
)
def test_default_of_right_type(tmp_path: Path, ptype: str, default: str, value: object) -> None:
    toml = head() + GOOD_TYPE + f'[types.run.params.p]\ntype = "{ptype}"\ndefault = {default}\n'
    jt = parse_module(make_module(tmp_path, "mine", toml)).types[0]
    assert jt.params[0].default == value


def test_bad_param_type(tmp_path: Path) -> None:
    toml = head() + GOOD_TYPE + '[types.run.params.p]\ntype = "float"\n'
    assert "key 'types.run.params.p.type'" in module_error(make_module(tmp_path, "mine", toml))


def test_bad_param_name(tmp_path: Path) -> None:
    toml = head() + GOOD_TYPE + '[types.run.params.Bad]\ntype = "string"\n'
    path = make_module(tmp_path, "mine", toml)
    assert module_error(path) == (
        f"{path / 'module.toml'}: [types.run]: parameter name 'Bad' must be lower-case "
        "letters, digits, _"
    )


def test_bad_launch_mode(tmp_path: Path) -> None:
    path = make_module(tmp_path, "mine", head() + GOOD_TYPE + 'launch = "docker"\n')
    message = module_error(path)
    assert "key 'types.run.launch'" in message
    assert "'host', 'container', 'serve' or 'service'" in message


def test_bad_lane(tmp_path: Path) -> None:
    toml = head() + '[types.run]\nlane = "gpu"\ncommand = ["x"]\n'
    message = module_error(make_module(tmp_path, "mine", toml))
    assert "key 'types.run.lane'" in message
    assert "'vram' or 'cpu'" in message


@pytest.mark.parametrize(
    ("extra", "key"),
    [
        ("timeout_s = 0\n", "types.run.timeout_s"),
        ("max_retries = -1\n", "types.run.max_retries"),
        ("max_retries = 101\n", "types.run.max_retries"),
        ('vram_gib = "a lot"\n', "types.run.vram_gib"),
    ],
)
def test_out_of_range_values(tmp_path: Path, extra: str, key: str) -> None:
    path = make_module(tmp_path, "mine", head() + GOOD_TYPE + extra)
    assert f"key {key!r}" in module_error(path)


def test_empty_command(tmp_path: Path) -> None:
    toml = head() + '[types.run]\nlane = "cpu"\ncommand = []\n'
    assert "key 'types.run.command'" in module_error(make_module(tmp_path, "mine", toml))


def test_choices_are_kept(tmp_path: Path) -> None:
    toml = (
        head()
        + GOOD_TYPE
        + '[types.run.params.mode]\ntype = "string"\nchoices = ["a", "b"]\ndefault = "a"\n'
    )
    spec = parse_module(make_module(tmp_path, "mine", toml)).types[0].params[0]
    assert spec.choices == ("a", "b")
    assert spec.default == "a"


def test_default_outside_choices_is_refused(tmp_path: Path) -> None:
    toml = (
        head()
        + GOOD_TYPE
        + '[types.run.params.mode]\ntype = "string"\nchoices = ["a", "b"]\ndefault = "zzz"\n'
    )
    message = module_error(make_module(tmp_path, "mine", toml))
    assert "params.mode" in message
    assert "'zzz'" in message


def test_non_utf8_module_toml_is_a_module_error(tmp_path: Path) -> None:
    path = make_module(tmp_path, "mine", None)
    (path / "module.toml").write_bytes(head().encode() + b'description = "\xff"\n')
    module_error(path)


# --- fingerprint ----------------------------------------------------------------------


def test_fingerprint_follows_src_contents(tmp_path: Path) -> None:
    src = tmp_path / "src"
    (src / "pkg").mkdir(parents=True)
    (src / "main.py").write_text("print(1)\n")
    (src / "pkg" / "util.py").write_text("X = 1\n")
    first = fingerprint(src)
    assert first == fingerprint(src)  # deterministic

    (src / "pkg" / "util.py").write_text("X = 2\n")
    changed = fingerprint(src)
    assert changed != first

    (src / "pkg" / "util.py").write_text("X = 1\n")
    assert fingerprint(src) == first  # content, not mtime

    (src / "pkg" / "util.py").rename(src / "pkg" / "other.py")
    assert fingerprint(src) != first  # names count too
    (src / "pkg" / "other.py").rename(src / "pkg" / "util.py")

    (src / "new.py").write_text("")
    assert fingerprint(src) != first
    (src / "new.py").unlink()
    assert fingerprint(src) == first


def test_fingerprint_ignores_pycache(tmp_path: Path) -> None:
    src = tmp_path / "src"
    src.mkdir()
    (src / "main.py").write_text("print(1)\n")
    first = fingerprint(src)
    (src / "__pycache__").mkdir()
    (src / "__pycache__" / "main.cpython-311.pyc").write_bytes(b"\x00\x01junk")
    (src / "pkg" / "__pycache__").mkdir(parents=True)
    (src / "pkg" / "__pycache__" / "x.pyc").write_bytes(b"more")
    assert fingerprint(src) == first


def test_fingerprint_of_a_missing_src_is_stable(tmp_path: Path) -> None:
    missing = fingerprint(tmp_path / "nope")
    assert missing == fingerprint(tmp_path / "also-nope")
    assert missing.startswith("sha256:")
    (tmp_path / "src").mkdir()
    (tmp_path / "src" / "a").write_text("a")
    assert fingerprint(tmp_path / "src") != missing


def test_module_fingerprint_changes_with_its_src(tmp_path: Path) -> None:
    path = make_module(tmp_path, "mine", head() + GOOD_TYPE)
    before = parse_module(path).fingerprint
    (path / "src" / "run.py").write_text("print('changed')\n")
    assert parse_module(path).fingerprint != before
    # files outside src/ (README, provision.sh) do not count
    after = parse_module(path).fingerprint
    (path / "README.md").write_text("docs")
    assert parse_module(path).fingerprint == after


# --- where modules come from: module_paths, pip packages, the shipped ones --------------


def test_the_shipped_modules_come_with_any_module_paths(tmp_path: Path) -> None:
    make_module(tmp_path, "mine", head() + GOOD_TYPE)
    registry = Registry.load([tmp_path], installed=False)
    assert {"mine.run", "echo.echo", "burn.llm", "probe.gpu"} <= set(registry.types)
    assert registry.modules["mine"].source == ModuleSource(SourceKind.PATH, str(tmp_path))
    assert registry.modules["echo"].source == ModuleSource(SourceKind.BUILTIN, str(BUILTIN_DIR))
    assert registry.modules["echo"].path == BUILTIN_DIR / "echo"
    assert str(registry.modules["echo"].source) == "built-in"
    assert str(registry.modules["mine"].source) == f"module_paths {tmp_path}"
    assert registry.passed_over == ()


def test_the_shipped_folder_on_module_paths_is_not_passed_over() -> None:
    registry = Registry.load([MODULES], installed=False)
    assert registry.modules["echo"].source.kind is SourceKind.BUILTIN
    assert registry.passed_over == ()


def test_a_module_on_module_paths_comes_before_the_shipped_one_and_says_so(
    tmp_path: Path,
) -> None:
    make_module(tmp_path, "echo", head("echo") + GOOD_TYPE)
    registry = Registry.load([tmp_path], installed=False)
    assert registry.modules["echo"].path == (tmp_path / "echo").resolve()
    assert "echo.run" in registry.types and "echo.echo" not in registry.types
    assert registry.passed_over == (
        f"echo from built-in (the one from module_paths {tmp_path} comes first)",
    )


def fake_dist(
    site: Path, dist: str, entries: dict[str, str], packages: dict[str, str | None]
) -> None:
    """An installed distribution as pip leaves one: ``dist-info`` with its entry
    points, and for each package folder a module.toml (or none). Each package's
    ``__init__.py`` writes a marker if it is ever imported."""
    info = site / f"{dist}-1.0.dist-info"
    info.mkdir(parents=True)
    (info / "METADATA").write_text(f"Metadata-Version: 2.1\nName: {dist}\nVersion: 1.0\n")
    lines = "".join(f"{k} = {v}\n" for k, v in entries.items())
    (info / "entry_points.txt").write_text(f"[gpuwarden.modules]\n{lines}")
    for dotted, toml in packages.items():
        folder = site.joinpath(*dotted.split("."))
        folder.mkdir(parents=True, exist_ok=True)
        for parent in folder.relative_to(site).parents:  # the module folder needs none
            init = site / parent / "__init__.py"
            if parent != Path(".") and not init.exists():
                marker = site / "imported"
                init.write_text(f"open({str(marker)!r}, 'a').write({str(parent)!r})\n")
        if toml is not None:
            (folder / "module.toml").write_text(toml)
            (folder / "src").mkdir()
            (folder / "src" / "run.py").write_text("print('hi')\n")


@pytest.fixture
def site(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> Path:
    site = tmp_path / "site"
    site.mkdir()
    monkeypatch.syspath_prepend(str(site))
    return site


def installed(site: Path) -> Registry:
    importlib.invalidate_caches()
    return Registry.load([], builtin=False)


def test_a_pip_package_declares_a_module_by_entry_point_and_is_never_imported(
    site: Path,
) -> None:
    fake_dist(
        site,
        "third_party",
        {"third": "thirdpkg.gw_third"},
        {"thirdpkg.gw_third": head("third") + GOOD_TYPE},
    )
    registry = installed(site)
    module = registry.modules["third"]
    assert module.path == (site / "thirdpkg" / "gw_third").resolve()
    assert module.source == ModuleSource(
        SourceKind.ENTRY_POINT, "thirdpkg.gw_third", "third_party 1.0"
    )
    assert str(module.source) == "pip package third_party 1.0 (entry point thirdpkg.gw_third)"
    assert "third.run" in registry.types
    assert not (site / "imported").exists()  # found, not imported: none of it ran


def test_module_paths_come_before_pip_packages_which_come_before_the_shipped_ones(
    site: Path, tmp_path: Path
) -> None:
    fake_dist(
        site,
        "both",
        {"echo": "bothpkg.echo", "mine": "bothpkg.mine"},
        {"bothpkg.echo": head("echo") + GOOD_TYPE, "bothpkg.mine": head("mine") + GOOD_TYPE},
    )
    make_module(tmp_path / "paths", "mine", head() + GOOD_TYPE)
    importlib.invalidate_caches()
    registry = Registry.load([tmp_path / "paths"])
    assert registry.modules["mine"].source.kind is SourceKind.PATH
    assert registry.modules["echo"].source.kind is SourceKind.ENTRY_POINT
    assert registry.passed_over == (
        f"mine from pip package both 1.0 (entry point bothpkg.mine) (the one from "
        f"module_paths {tmp_path / 'paths'} comes first)",
        "echo from built-in (the one from pip package both 1.0 (entry point "
        "bothpkg.echo) comes first)",
    )


@pytest.mark.parametrize(
    ("entry", "packages", "expected"),
    [
        (
            "thirdpkg.gw",
            {"thirdpkg.gw": head("other") + GOOD_TYPE},
            "key 'module.name' is 'other' but the entry point (gpuwarden.modules) that "
            "names this folder is 'third'; they must match",
        ),
        (
            "thirdpkg.gw:folder",
            {"thirdpkg.gw": head("third") + GOOD_TYPE},
            "the value must name a package (a folder holding module.toml)",
        ),
        ("nopkg.gw", {}, "package 'nopkg.gw' is not installed here"),
        (
            "thirdpkg.nope",
            {"thirdpkg.gw": head("third") + GOOD_TYPE},
            "package 'thirdpkg.nope' is not installed here (no folder 'nope')",
        ),
        ("thirdpkg.gw", {"thirdpkg.gw": None}, "has no module.toml"),
    ],
)
def test_a_broken_entry_point_names_itself_and_what_is_wrong(
    site: Path, entry: str, packages: dict[str, str | None], expected: str
) -> None:
    fake_dist(site, "third_party", {"third": entry}, packages)
    with pytest.raises(ModuleError) as info:
        installed(site)
    message = str(info.value)
    assert expected in message, message
    if "module.name" not in expected:
        assert message.startswith(
            f"entry point third = {entry!r} (group gpuwarden.modules, from third_party 1.0): "
        )
    assert not (site / "imported").exists()


def test_an_entry_point_that_names_a_plain_module_is_refused(site: Path) -> None:
    fake_dist(site, "third_party", {"third": "thirdmod"}, {})
    (site / "thirdmod.py").write_text("raise SystemExit('imported')\n")
    with pytest.raises(ModuleError) as info:
        installed(site)
    assert "'thirdmod' is a module, not a package" in str(info.value)


def test_an_entry_point_that_is_not_a_module_name_is_refused(site: Path) -> None:
    fake_dist(site, "third_party", {"Bad-Name": "thirdpkg.gw"}, {"thirdpkg.gw": None})
    with pytest.raises(ModuleError) as info:
        installed(site)
    assert "the name must be the module's name" in str(info.value)
