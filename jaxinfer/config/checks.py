"""Checks shared by the config groups: a bad value is named as EngineConfig.<field> with what it
may be, before any model is loaded (every group is built through EngineConfig's options)."""

from __future__ import annotations

from typing import Any


def bad(name: str, value: Any, why: str) -> ValueError:
    return ValueError(f"EngineConfig.{name}={value!r}: {why}")


def positive_ints(obj: Any, *names: str) -> None:
    """ValueError unless each named field is None or an integer >= 1."""
    for name in names:
        value = getattr(obj, name)
        if value is not None and (not isinstance(value, int) or isinstance(value, bool) or value < 1):
            raise ValueError(f"EngineConfig.{name} must be a positive integer, got {value!r}")


def bools(obj: Any, *names: str, optional: bool = False) -> None:
    """ValueError unless each named field is a bool (or None where `optional`)."""
    for name in names:
        value = getattr(obj, name)
        if not isinstance(value, bool) and not (optional and value is None):
            raise ValueError(f"EngineConfig.{name} must be a bool{' or None' if optional else ''}, got {value!r}")


def one_of(obj: Any, name: str, allowed: tuple) -> None:
    value = getattr(obj, name)
    if value not in allowed:
        raise ValueError(f"EngineConfig.{name}={value!r}: expected one of {allowed}")
