"""The checks every configuration group uses: each raises a ValueError that names the field, the
value and what is allowed."""
from __future__ import annotations

import os


def positive_int(name: str, value, minimum: int = 1) -> None:
    if isinstance(value, bool) or not isinstance(value, int) or value < minimum:
        raise ValueError(f"{name}={value!r} is invalid: it must be an integer >= {minimum}")


def boolean(name: str, value) -> None:
    if not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is invalid: allowed are True, False")


def auto_bool(name: str, value) -> None:
    """None (auto), True (insist) or False (off)."""
    if value is not None and not isinstance(value, bool):
        raise ValueError(f"{name}={value!r} is invalid: allowed are None (auto), True, False")


def choice(name: str, value, allowed: tuple) -> None:
    if value not in allowed:
        raise ValueError(f"{name}={value!r} is invalid: allowed values are " + ", ".join(allowed))


def path_or_none(name: str, value) -> None:
    if value is not None and not isinstance(value, (str, os.PathLike)):
        raise ValueError(f"{name}={value!r} is invalid: it must be a directory path (str) or None")


def check_group_size(group_size: int) -> None:
    if not isinstance(group_size, int) or isinstance(group_size, bool) or group_size < 2 \
            or group_size & (group_size - 1):
        raise ValueError(f"group_size={group_size!r} is invalid: it must be a power of two >= 2 "
                         "(32, 64 and 128 are usual)")
