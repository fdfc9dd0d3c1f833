"""API keys of the HTTP API: `Authorization: Bearer <key>`.

Keys come from a file (one per line, `#` comments and blank lines skipped) and/or the
JAXINFER_API_KEYS variable (comma-separated). Only their SHA-256 digests are kept; a presented
key is hashed and compared with every digest in constant time, so neither timing nor a log line
reveals a key. Logs and metrics name a key by its id: the first 8 hex digits of its digest.
"""

from __future__ import annotations

import hashlib
import hmac

API_KEYS_ENV = "JAXINFER_API_KEYS"


def key_id(key: str) -> str:
    return hashlib.sha256(key.encode("utf-8")).hexdigest()[:8]


def read_api_keys(file: str | None = None, env_value: str | None = None) -> list[str]:
    """The keys of `--api-keys-file` and of the environment variable's value, in that order."""
    keys: list[str] = []
    if file:
        with open(file, encoding="utf-8") as f:
            keys += [line.split("#", 1)[0].strip() for line in f]
    if env_value:
        keys += [k.strip() for k in env_value.split(",")]
    keys = [k for k in keys if k]
    if (file or env_value) and not keys:
        raise ValueError(f"no API key in {file or API_KEYS_ENV}")
    for k in keys:
        if any(ch.isspace() for ch in k):
            raise ValueError(f"API key {key_id(k)} (sha256 prefix) contains whitespace")
    return keys


class APIKeys:
    def __init__(self, keys: list[str]):
        if not keys:
            raise ValueError("APIKeys needs at least one key")
        self._digests = [hashlib.sha256(k.encode("utf-8")).digest() for k in keys]

    def check(self, authorization: str | None) -> tuple[bool, str | None]:
        """(accepted, key id of the presented key or None when none was presented)."""
        scheme, _, key = (authorization or "").partition(" ")
        key = key.strip()
        if scheme.lower() != "bearer" or not key:
            return False, None
        digest = hashlib.sha256(key.encode("utf-8", "replace")).digest()
        accepted = False
        for known in self._digests:  # no early exit: the time does not depend on which key matched
            accepted |= hmac.compare_digest(digest, known)
        return accepted, digest.hex()[:8]
