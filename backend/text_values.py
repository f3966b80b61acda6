"""The one reading of a yes/no written as text, for engine settings, adapter parameters and request fields alike."""
from __future__ import annotations

from typing import Any

TRUE_WORDS = ("1", "true", "yes", "on")
FALSE_WORDS = ("0", "false", "no", "off")


def bool_word(value: Any) -> bool | None:
    """True / False for a bool or one of the words above (any case, spaces ignored); None for anything else."""
    if isinstance(value, bool):
        return value
    if isinstance(value, str):
        text = value.strip().lower()
        if text in TRUE_WORDS:
            return True
        if text in FALSE_WORDS:
            return False
    return None


def parse_bool(name: str, value: Any) -> bool:
    """bool_word's answer, or a ValueError naming the field: a typo is an error, never a silent False."""
    parsed = bool_word(value)
    if parsed is None:
        raise ValueError(f"{name} must be true or false, got {value!r}")
    return parsed
