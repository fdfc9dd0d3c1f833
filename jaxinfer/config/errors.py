"""What reading a model configuration raises: `ConfigError`, a ValueError naming the bad field.

The shared readers (model.py) and every family's own (jaxinfer/models/<family>/config.py) raise
it, so a user sees one kind of error for a wrong or unsupported config, wherever it was read.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any


class ConfigError(ValueError):
    """A model configuration is missing a field or asks for something unsupported."""


def require(cfg: Mapping[str, Any], key: str, source: str) -> Any:  # a config.json value
    """cfg[key], or a ConfigError naming the field and where it was looked for."""
    if key not in cfg or cfg[key] is None:
        raise ConfigError(f"{source}: missing required field {key!r}")
    return cfg[key]
