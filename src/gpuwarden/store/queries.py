"""Load named SQL queries and ordered migrations from the package's ``sql/`` folder."""

from __future__ import annotations

import re
from importlib import resources

_NAME = re.compile(r"^--\s*name:\s*(\w+)\s*$", re.MULTILINE)


def load_queries(backend: str, file: str = "queries") -> dict[str, str]:
    """Parse ``sql/<backend>/<file>.sql`` into ``{name: sql}``."""
    text = resources.files("gpuwarden.store").joinpath(f"sql/{backend}/{file}.sql").read_text()
    parts = _NAME.split(text)
    queries: dict[str, str] = {}
    # parts = [preamble, name1, body1, name2, body2, ...]
    for name, body in zip(parts[1::2], parts[2::2], strict=True):
        if name in queries:
            raise ValueError(f"query {name!r} defined twice in sql/{backend}/{file}.sql")
        queries[name] = body.strip()
    return queries


def load_dialect(backend: str) -> dict[str, str]:
    """Every named query of ``backend``: ``queries.sql`` and ``cluster.sql`` together
    (a name may be defined in only one of them)."""
    queries = load_queries(backend)
    cluster = load_queries(backend, "cluster")
    both = sorted(queries.keys() & cluster.keys())
    if both:
        raise ValueError(f"queries {both} defined in both files of sql/{backend}")
    return queries | cluster


def split_sql(script: str) -> list[str]:
    """Split a migration into statements (our migrations hold no ``;`` inside strings)."""
    lines = [ln for ln in script.splitlines() if not ln.strip().startswith("--")]
    return [s.strip() for s in "\n".join(lines).split(";") if s.strip()]


def load_migrations(backend: str) -> list[tuple[int, str, str]]:
    """``[(version, filename, sql)]`` from ``sql/<backend>/migrations/NNNN_*.sql``, in order."""
    folder = resources.files("gpuwarden.store").joinpath(f"sql/{backend}/migrations")
    out: list[tuple[int, str, str]] = []
    for entry in folder.iterdir():
        m = re.match(r"^(\d{4})_.+\.sql$", entry.name)
        if m:
            out.append((int(m.group(1)), entry.name, entry.read_text()))
    out.sort()
    versions = [v for v, _, _ in out]
    if len(set(versions)) != len(versions):
        raise ValueError(f"two migrations share a version in sql/{backend}/migrations")
    return out
