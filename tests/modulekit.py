"""What the tests of the shipped model modules share: skipping (or, where CI
requires the module's extra, failing) with the reason, and importing a module's
program from its file as the broker never would."""

from __future__ import annotations

import contextlib
import importlib.util
import os
import sys
from collections.abc import Iterator
from pathlib import Path
from types import ModuleType
from typing import NoReturn

import pytest


def skip_or_fail(require_env: str, reason: str) -> NoReturn:
    """Skip, or fail where ``require_env`` is 1 (CI: its tests are required)."""
    if os.environ.get(require_env) == "1":
        pytest.fail(f"{require_env}=1 but {reason}", pytrace=False)
    pytest.skip(reason)


@contextlib.contextmanager
def module_from_file(path: Path, name: str) -> Iterator[ModuleType]:
    """The program at ``path`` imported as module ``name`` (registered in
    ``sys.modules``: its dataclasses need that); afterwards it is dropped and the
    environment it changed at import (Hugging Face variables) is put back."""
    saved = dict(os.environ)
    spec = importlib.util.spec_from_file_location(name, path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[name] = module
    try:
        spec.loader.exec_module(module)
        yield module
    finally:
        sys.modules.pop(name, None)
        os.environ.clear()
        os.environ.update(saved)
