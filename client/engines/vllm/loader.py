"""The "expertd" load format: vLLM builds an unquantized model and takes every weight from the daemon.

The weights reach the model through its own `load_weights` (which fuses q/k/v and gate/up and stacks the experts
the way vLLM's kernels want them); then, after vLLM's post-load processing, every parameter that still equals a
served tensor byte for byte is bound to the shared, read-only view of it, and what vLLM fused or packed to the
daemon's derived tensor of it where that is a gather (`expertd.client.engines`: `binding`, `experts`, `fused`).
What else vLLM derives (oneDNN's packed linear layers) stays a private copy per engine. The engine's state (the
lease, what the load recorded) is an `EngineState` kept beside the model (`state_of(model)`), never on it.
"""

from __future__ import annotations

import logging
import os
import time

import torch
from torch import nn
from vllm.config import ModelConfig, VllmConfig
from vllm.model_executor.model_loader.base_loader import BaseModelLoader
from vllm.model_executor.model_loader.utils import initialize_model, process_weights_after_loading
from vllm.utils.torch_utils import set_default_torch_dtype

from expertd.client import ExpertClient
from expertd.errors import DaemonError, ModelMismatch
from expertd.protocol import default_endpoint

from ..binding import accounting, report
from .. import mapping
from ..checks import check_daemon, check_loaded
from ..experts import expert_sources
from ..following import follow_hook, recording, release_replaced, share
from ..state import EngineState, keep
from .hooks import VllmEngine
from .options import VLLM_WORDS, LoaderOptions

log = logging.getLogger("vllm.expertd")  # under vLLM's logger: its handlers print it beside the engine's lines


def attach(options: LoaderOptions) -> ExpertClient:
    """A lease on the daemon the options name (credentials as `ExpertClient` takes them, else from the environment)."""
    try:
        return ExpertClient(options.endpoint, timeout=options.timeout, token=options.token,
                            server_key=options.server_key, client_key=options.client_key, words=VLLM_WORDS)
    except DaemonError as exc:  # the daemon's refusal (a wrong token, say): name which daemon refused
        endpoint = options.endpoint or os.environ.get("EXPERTD_ENDPOINT") or default_endpoint()
        if endpoint in str(exc):
            raise
        raise type(exc)(f"the daemon at {endpoint}: {exc}", exc.kind) from exc


def unquantized(vllm_config: VllmConfig, model_config: ModelConfig) -> None:
    """Make the engine build unquantized layers whatever `quantization_config` the model folder has: the daemon
    serves dequantized weights."""
    if vllm_config.quant_config is not None or model_config.quantization is not None:
        log.info("expertd serves dequantized weights: building unquantized layers instead of %s",
                 model_config.quantization)
    vllm_config.quant_config = None
    model_config.quantization = None
    for config in {id(c): c for c in (model_config.hf_config, model_config.hf_text_config)}.values():
        if hasattr(config, "quantization_config"):  # some models read it themselves (gpt-oss's load_weights)
            delattr(config, "quantization_config")


class ExpertdModelLoader(BaseModelLoader):
    """`load_format="expertd"`: config from the model folder, weights from the daemon named in
    `model_loader_extra_config` (see `LoaderOptions`)."""

    def __init__(self, load_config):
        super().__init__(load_config)
        self.options = LoaderOptions.parse(load_config.model_loader_extra_config)

    def download_model(self, model_config: ModelConfig) -> None:
        """Nothing to download: the weights are in the daemon's shared memory."""

    def load_weights(self, model: nn.Module, model_config: ModelConfig, client: ExpertClient | None = None,
                     tagged=iter) -> None:
        """Feed the served checkpoint tensors (checkpoint names, bf16 views) to the model's own `load_weights`."""
        own = client is None
        client = client or attach(self.options)
        try:
            try:
                loaded = model.load_weights(tagged(iter(client.tensors().items())))
            except (KeyError, AssertionError) as exc:  # vLLM's loaders: a name the model lacks, a shape that differs
                raise ModelMismatch(f"the daemon at {client.endpoint} serves tensors that {model_config.model}'s model "
                                    f"({type(model).__name__}) cannot take: {type(exc).__name__}: {exc}") from exc
            check_loaded({name for name, _ in model.named_parameters()}, loaded, client.endpoint, model_config.model)
        finally:
            if own:
                client.close()

    def load_model(self, vllm_config: VllmConfig, model_config: ModelConfig, prefix: str = "") -> nn.Module:
        t0 = time.perf_counter()
        client = attach(self.options)
        try:
            check_daemon(client.index(), model_config.hf_config.to_dict(), client.endpoint, model_config.model)
            unquantized(vllm_config, model_config)
            load_config = vllm_config.load_config
            device = torch.device(load_config.device or vllm_config.device_config.device)
            sharing = self.options.zero_copy and device.type == "cpu"
            t1 = time.perf_counter()
            with set_default_torch_dtype(model_config.dtype):
                with device:
                    model = initialize_model(vllm_config=vllm_config, model_config=model_config, prefix=prefix)
                t2 = time.perf_counter()
                state = self._mapped(model, model_config, client, device) if sharing and self.options.map else None
                how = "mapped"
                if state is None:
                    state, how = self._loaded(model, model_config, client, device, sharing), "loaded"
            t3 = time.perf_counter()
            log.info("expertd: attached and checked %.2f s, model built %.2f s, weights %s in %.2f s", t1 - t0,
                     t2 - t1, how, t3 - t2)
        except BaseException:
            client.close()
            raise
        if self.options.zero_copy:
            keep(model, state)  # the lease lives as long as the model holds the views, and is released with it
            if self.options.follow:
                model.register_forward_pre_hook(follow_hook)
        else:
            client.close()
        return model.eval()

    def _loaded(self, model: nn.Module, model_config: ModelConfig, client: ExpertClient, device: torch.device,
                sharing: bool) -> EngineState:
        """Every weight loaded privately, post-processed by vLLM, then bound where it equals the daemon's bytes."""
        state = EngineState(client, VllmEngine(log, model_config, device), follow=self.options.follow)
        with recording(model, state) as tagged:
            self.load_weights(model, model_config, client, tagged)
        sources = expert_sources(model, state.served(), state.feeds) if sharing else {}
        process_weights_after_loading(model, model_config, device)
        if sharing:
            shapes = {owner: {leaf: state.params[f"{owner}.{leaf}"][1:] for leaf in leaves}
                      for owner, leaves in state.owners(sources).items()}
            served, derived = share(model, state, sources, shapes)
            finish(model, state, served, derived)
        return state

    def _mapped(self, model: nn.Module, model_config: ModelConfig, client: ExpertClient, device: torch.device
                ) -> EngineState | None:
        """The model mapped (`expertd.client.engines.mapping`), or None where it cannot be (said in one line)."""
        state = EngineState(client, VllmEngine(log, model_config, device), follow=self.options.follow)
        tensors = state.tensors()
        try:
            loaded = mapping.dry_feeds(model, state, tensors, client.endpoint, model_config.model)
        except mapping.NotMappable as exc:
            log.info("expertd: %s cannot be mapped, loading it: %s", type(model).__name__, exc)
            return None
        check_loaded({name for name, _ in model.named_parameters()}, loaded, client.endpoint, model_config.model)
        mapping.map_model(model, state, tensors)
        finish(model, state, *mapping.bound(model, state))
        return state


def finish(model: nn.Module, state: EngineState, served: list[str], derived: list[str]) -> None:
    """Empty what the post-load step replaced, and log where the engine's weight bytes lie."""
    release_replaced(model, state)
    state.memory = accounting(model, state.params, served, derived)
    log.info("%s", report(state.memory, len(served) + len(derived),
                          sum(t.nbytes for t in state.client.index().tensors)))
