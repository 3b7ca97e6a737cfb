"""Inference engines take their weights from expertd: the engine-neutral part, and one adapter per engine.

An engine builds its model, loads the served tensors through the model's own `load_weights`, runs its post-load
steps (fusing, padding, packing for its kernels), then binds every parameter it can to the daemon's shared views.
What does not depend on the engine lives here and imports no engine:

- `probes`: probes whose elements carry their own position (base-255 digits) and the gather index read back;
- `experts`: stacked experts in the engine's own layout (the loader's and the post-load step's rearrangement),
  derived by the daemon once per host;
- `fused`: what the engine fuses or pads from several served tensors (q/k/v, gate/up, a padded vocabulary);
- `binding`: re-pointing parameters at shared views, where each parameter's bytes lie, the load's log line;
- `following`: what a load records, a refresh onto the daemon's latest generation;
- `state`: `EngineState` (what a load kept, found by the model: `state_of`) and `Engine` (an adapter's steps);
- `checks`: the daemon serves the engine's model (config values, every parameter fed).

Adapters know their engine's loader API and post-load hooks only: `expertd.client.engines.vllm` (vLLM's
`load_format="expertd"`, which needs vLLM installed).
"""

from .state import Engine, EngineState, state_of

__all__ = ["Engine", "EngineState", "state_of"]
