"""How a message spells an option it advises, for where the user sets it.

From Python an option is an argument (``allow_data_change=True``); under ``lightning-sharding-train``
it is a Hydra override of the ``data`` group (``data.allow_data_change=true``). The train entry sets
:data:`ENV` to ``"hydra"``; its ranks, DataLoader workers and dispatch processes inherit it, so a
message raised in any of them gives advice that works where the user stands.
"""

from __future__ import annotations

import os
from typing import Any

ENV = "LIGHTNING_SHARDING_OPTIONS_FROM"
# ShardedDataModule arguments whose Hydra key is not data.<the same name>.
HYDRA_KEYS = {"sharding": "sharding"}


def from_the_command_line() -> bool:
    """Whether this process serves ``lightning-sharding-train`` (options are Hydra overrides)."""
    return os.environ.get(ENV) == "hydra"


def option(name: str, value: Any) -> str:
    """``name=value`` as the user sets it here: ``allow_data_change=True`` in Python,
    ``data.allow_data_change=true`` under ``lightning-sharding-train``."""
    if not from_the_command_line():
        return f"{name}={value!r}"
    return f"{HYDRA_KEYS.get(name, f'data.{name}')}={hydra_value(value)}"


def hydra_value(value: Any) -> str:
    """``value`` as a Hydra override writes it: ``true``, ``null``, ``skip``, ``{'/old': '/new'}``,
    ``['/data/a b.tar']``."""
    if isinstance(value, (list, tuple)):
        return "[" + ", ".join(hydra_value(v) for v in value) + "]"
    if isinstance(value, bool):
        return "true" if value else "false"
    if value is None:
        return "null"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{hydra_value(str(k))}: {hydra_value(v)}" for k, v in value.items()) + "}"
    text = str(value)
    plain = text.replace("_", "").replace("-", "").replace(".", "").isalnum()
    return text if plain else "'" + text.replace("'", "\\'") + "'"
