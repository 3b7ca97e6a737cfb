"""Byte sizes and durations as people write them in configs, on command lines and in environment variables."""

from __future__ import annotations

import re

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """'5GB' (10^9), '1GiB' (2^30), '500MB', '4096' -> a positive number of bytes."""
    if isinstance(text, bool):
        raise ValueError(f"size {text!r} is not a number of bytes")
    if isinstance(text, int):
        size = text
    else:
        match = _SIZE_RE.match(str(text))
        if not match:
            raise ValueError(f"size {text!r} is not like 5GB, 1GiB, 500MB or a number of bytes")
        number, unit, binary = match.groups()
        power = "KMGT".find(unit.upper()) + 1 if unit else 0
        size = int(float(number) * (1024 if binary else 1000) ** power)
    if size <= 0:
        raise ValueError(f"size {text!r} must be positive")
    return size


def parse_steps(text: str) -> list[int]:
    """'1-3,10' -> [1, 2, 3, 10]."""
    steps = []
    for part in filter(None, (p.strip() for p in text.split(","))):
        lo, _, hi = part.partition("-")
        if not lo.isdigit() or hi and not hi.isdigit():
            raise ValueError(f"capture steps {text!r}: {part!r} is not N or N-M")
        steps.extend(range(int(lo), int(hi or lo) + 1))
    return steps


_DURATION_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*(ms|s|m|h)?\s*$", re.IGNORECASE)
_DURATION_UNITS = {"ms": 0.001, "s": 1.0, "m": 60.0, "h": 3600.0}


def parse_duration(text: str | int | float) -> float:
    """30, 2.5, '30s', '500ms', '5m', '1h' -> a positive number of seconds (a bare number is seconds)."""
    if isinstance(text, bool):
        raise ValueError(f"duration {text!r} is not a number of seconds")
    if isinstance(text, (int, float)):
        seconds = float(text)
    else:
        match = _DURATION_RE.match(str(text))
        if not match:
            raise ValueError(f"duration {text!r} is not like 30, 2.5, 30s, 500ms, 5m or 1h")
        seconds = float(match.group(1)) * _DURATION_UNITS[(match.group(2) or "s").lower()]
    if not seconds > 0:
        raise ValueError(f"duration {text!r} must be positive")
    return seconds
