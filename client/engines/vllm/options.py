"""The options of vLLM's `load_format="expertd"` (`model_loader_extra_config`), checked before the engine builds
anything (the model checks are engine-neutral: `expertd.client.engines.checks`).

Plain Python (no vLLM, no torch).
"""

from __future__ import annotations

from dataclasses import dataclass

from expertd.errors import ConfigError
from expertd.option_words import OptionWords

# how the client's hints name these options for a vLLM user (`ExpertClient(..., words=)`)
VLLM_WORDS = OptionWords(
    point='name the right one: model_loader_extra_config={"endpoint": ...}, for vllm serve --model-loader-extra-config '
          '\'{"endpoint": ...}\', or $EXPERTD_ENDPOINT',
    timeout='model_loader_extra_config\'s "timeout"', server_key='model_loader_extra_config\'s "server_key"')


@dataclass(frozen=True)
class LoaderOptions:
    """`model_loader_extra_config` of `load_format="expertd"`; what is left out comes from the environment as in
    `ExpertClient` ($EXPERTD_ENDPOINT, $EXPERTD_TOKEN, $EXPERTD_SERVER_KEY, $EXPERTD_CLIENT_KEY)."""

    endpoint: str | None = None
    token: str | None = None
    server_key: str | None = None
    client_key: str | None = None
    timeout: float = 30.0
    zero_copy: bool = True  # bind the parameters vLLM uses as they are served to the shared views
    map: bool = True  # bind each layer to its checked kind's bindings, not a load (`expertd.client.engines.mapping`)
    follow: bool = False  # refresh on its own before the first forward pass after the daemon publishes a generation

    @classmethod
    def parse(cls, extra: dict | None) -> "LoaderOptions":
        extra = dict(extra or {})
        unknown = sorted(set(extra) - set(cls.__dataclass_fields__))
        if unknown:
            raise ConfigError(f"model_loader_extra_config of load_format 'expertd' has unknown keys {unknown}; "
                              f"known: {sorted(cls.__dataclass_fields__)}")
        where = "model_loader_extra_config"
        for key in ("endpoint", "token", "server_key", "client_key"):
            if extra.get(key) is not None and not isinstance(extra[key], str):
                raise ConfigError(f"{where}[{key!r}] must be a string, not {type(extra[key]).__name__}")
        if not isinstance(extra.get("timeout", 30.0), (int, float)) or isinstance(extra.get("timeout"), bool):
            raise ConfigError(f"{where}['timeout'] must be a number of seconds, not {extra['timeout']!r}")
        for key in ("zero_copy", "follow", "map"):
            if not isinstance(extra.get(key, False), bool):
                raise ConfigError(f"{where}[{key!r}] must be true or false, not {extra[key]!r}")
        if extra.get("follow") and extra.get("zero_copy") is False:
            raise ConfigError(f"{where}: 'follow' needs 'zero_copy' (the engine follows the daemon by remapping)")
        return cls(**extra)
