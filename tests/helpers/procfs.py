"""What this process holds open, read from /proc: mapped files and file descriptors."""

from __future__ import annotations

import os


def open_paths(fragment: str, pid: int | str = "self") -> list[str]:
    """The paths of process `pid`'s mappings and open file descriptors that contain `fragment` (a deleted
    file shows with " (deleted)" after its path)."""
    with open(f"/proc/{pid}/maps") as f:
        found = [line.split(None, 5)[-1].strip() for line in f if fragment in line]
    for fd in os.listdir(f"/proc/{pid}/fd"):
        try:
            target = os.readlink(f"/proc/{pid}/fd/{fd}")
        except OSError:  # the descriptor listing the folder itself, closed meanwhile
            continue
        if fragment in target:
            found.append(target)
    return found
