"""Where the start-up caches live, and the code version their entries are keyed by (free of JAX:
the executable store and the prepared weights both use them)."""

from __future__ import annotations

import functools
import hashlib
import os
from pathlib import Path

OFF = ("", "none")


def cache_path(directory: str | None, variable: str, default: str) -> Path | None:
    """A cache directory option's path: "auto" is $`variable` where that is set, else
    `default`; None, "" or "none" (in either) is no cache."""
    if directory == "auto":
        directory = os.environ.get(variable, default)
    if directory is None or directory.strip().lower() in OFF:
        return None
    return Path(directory).expanduser()


@functools.cache
def code_version(packages: tuple[str, ...]) -> str:
    """sha256 over the path and bytes of every .py file of `packages` (once per process)."""
    digest = hashlib.sha256()
    root = Path(__file__).resolve().parents[2]
    for package in packages:
        for path in sorted((root / package).rglob("*.py")):
            digest.update(str(path.relative_to(root)).encode() + b"\0" + path.read_bytes() + b"\0")
    return digest.hexdigest()
