"""The tools' model hook: what `EXPERTD_CAPTURE_DIR` and `EXPERTD_SIMULATE_*` ask of each model `load_model()` returns.

`expertd.client.hooks` names `from_env` and imports this module only when one of those variables is set.
"""

from __future__ import annotations

from .capture import capture_from_env
from .simulate import simulate_from_env


def from_env(model) -> None:
    """Capture activations (EXPERTD_CAPTURE_DIR), then simulate number formats (EXPERTD_SIMULATE_*): no code changes."""
    capture_from_env(model)
    simulate_from_env(model)
