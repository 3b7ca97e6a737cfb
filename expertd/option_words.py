"""How the client's messages name the caller's options: the CLI's flags by default, an engine's own keys where an
engine attaches (`ExpertClient(..., words=)`), worded where the message is made rather than rewritten after."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class OptionWords:
    """The words for each option a client's hint names."""

    point: str = "point to the right one with --endpoint / $EXPERTD_ENDPOINT"  # how to name the right daemon
    timeout: str = "--timeout"
    server_key: str = "--server-key"


CLI = OptionWords()
