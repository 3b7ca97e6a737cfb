"""Byte sizes as people write them on command lines and in environment variables."""

from __future__ import annotations

import re

_SIZE_RE = re.compile(r"^\s*(\d+(?:\.\d+)?)\s*([KMGT]?)(i?)B?\s*$", re.IGNORECASE)


def parse_size(text: str | int) -> int:
    """'5GB' (10^9), '1GiB' (2^30), '500MB', '4096' -> a positive number of bytes."""
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
