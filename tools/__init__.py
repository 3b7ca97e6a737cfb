"""Offline and research tools around the weights, apart from the daemon's pipeline and the worker client.

convert, inspect, doctor, evaluate and the test-data generator (the `expertd` subcommands: `cli`), number formats
(`number_formats`, `hif8`), activation capture (`capture`) and simulated formats (`simulate`). They use the
pipeline (reader, layout, kernels) and the client; neither imports them: the `expertd` CLI only inside its tool
subcommands, and `ExpertClient.load_model()` only when `EXPERTD_CAPTURE_DIR` / `EXPERTD_SIMULATE_*` ask for the
tools' model hook (`env_hooks`, through `expertd.client.hooks`).
"""
