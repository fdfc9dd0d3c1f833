"""Files replaced whole: written under a temporary name beside the target and renamed over it,
so a reader never sees half a file (the GGUF index, the executable store, prepared weights)."""

from __future__ import annotations

import contextlib
import os
import tempfile
from collections.abc import Iterator
from pathlib import Path


@contextlib.contextmanager
def atomic_target(path: Path) -> Iterator[Path]:
    """A temporary path beside `path` (its folder made if missing) to write to; renamed to `path`
    when the block ends, removed if it raises."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp = tempfile.mkstemp(dir=path.parent, suffix=".tmp")
    os.close(fd)
    try:
        yield Path(tmp)
        os.replace(tmp, path)
    except BaseException:
        with contextlib.suppress(OSError):
            os.unlink(tmp)
        raise
