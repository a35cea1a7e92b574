"""Switches read from the environment when a call is traced."""

from __future__ import annotations

import os


def flag(name: str, default: bool) -> bool:
    """An on/off switch: "1" on, "0" off, unset the default; anything else is a ValueError naming it."""
    value = os.environ.get(name, "1" if default else "0")
    if value not in ("0", "1"):
        raise ValueError(f"{name} must be '0' or '1', got {value!r}")
    return value == "1"
