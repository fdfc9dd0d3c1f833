"""The journal of a batch job: what makes `jaxinfer batch` exactly once across kills.

Beside the output file O the job keeps `O.journal`, one JSON line per finished input line:
    {"line": N, "sha": first 16 hex digits of sha256(the input line), "record": {...}}
appended, flushed and fsync'ed as each request finishes, in whatever order they finish. A rerun
with the same output reads the journal and serves only the lines it lacks, or whose input text
changed (the hash no longer matches: the line runs again and its new entry supersedes the old).
A line cut short by a kill (no newline at the end) is dropped and the file truncated to its last
whole line before anything is appended.

Order is kept by construction: results also go, in input order, to `O.partial` through a
reorder buffer (a finished line waits until every line before it is done); when every line is
done the partial file is moved over O (os.replace) and the journal removed. Memory holds the
journal's index (line -> offset) and the records of the reorder buffer, never the whole input.
"""

from __future__ import annotations

import hashlib
import json
import os
from pathlib import Path


def line_key(line: str) -> str:
    return hashlib.sha256(line.rstrip("\r\n").encode("utf-8")).hexdigest()[:16]


class Journal:
    def __init__(self, path: str | Path):
        self.path = Path(path)
        self._index: dict[int, tuple[str, int, int]] = {}  # line -> (sha, offset, length)
        if self.path.exists():
            self._load()
        self._file = open(self.path, "ab")
        self._reader = open(self.path, "rb")  # one handle for every resumed record

    def _load(self) -> None:
        data = self.path.read_bytes()
        whole = data.rfind(b"\n") + 1  # a partial last line (killed mid-write) is dropped
        offset = 0
        for raw in data[:whole].splitlines(keepends=True):
            try:
                entry = json.loads(raw)
                self._index[int(entry["line"])] = (str(entry["sha"]), offset, len(raw))
            except (ValueError, KeyError, TypeError) as e:
                raise ValueError(
                    f"{self.path}: entry at byte {offset} is not a journal entry ({e}); "
                    "remove the file to start the job afresh"
                ) from None
            offset += len(raw)
        if whole < len(data):
            with open(self.path, "r+b") as f:
                f.truncate(whole)

    def __len__(self) -> int:
        return len(self._index)

    def __contains__(self, lineno: int) -> bool:
        return lineno in self._index

    def done(self, lineno: int, key: str) -> bool:
        """True if the journal holds a result for this line made from the same input text."""
        found = self._index.get(lineno)
        return found is not None and found[0] == key

    def record(self, lineno: int) -> dict:
        _, offset, length = self._index[lineno]
        self._reader.seek(offset)
        return json.loads(self._reader.read(length))["record"]

    def append(self, lineno: int, key: str, record: dict) -> None:
        raw = (json.dumps({"line": lineno, "sha": key, "record": record}, ensure_ascii=False) + "\n").encode("utf-8")
        offset = self._file.tell()
        self._file.write(raw)
        self._file.flush()
        os.fsync(self._file.fileno())
        self._index[lineno] = (key, offset, len(raw))

    def close(self, remove: bool = False) -> None:
        self._file.close()
        self._reader.close()
        if remove:
            self.path.unlink(missing_ok=True)
