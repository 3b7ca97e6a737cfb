"""The model hooks `load_model()` runs (client/hooks.py): registered functions, EXPERTD_MODEL_HOOKS, the tools'."""

from __future__ import annotations

import pytest

from expertd.client import ExpertClient, hooks, on_model_loaded, remove_model_hook

SEEN: list[tuple[str, object]] = []


def seen_by_env(model) -> None:
    SEEN.append(("env", model))


@pytest.fixture(autouse=True)
def clean(monkeypatch):
    for var in (hooks.HOOKS_ENV, *hooks.TOOLS_ENV):
        monkeypatch.delenv(var, raising=False)
    SEEN.clear()
    yield
    SEEN.clear()


def test_registered_and_environment_hooks_run_once_in_order(monkeypatch):
    def registered(model):
        SEEN.append(("registered", model))

    assert on_model_loaded(registered) is registered  # usable as a decorator
    on_model_loaded(registered)  # twice: still called once
    try:
        monkeypatch.setenv(hooks.HOOKS_ENV, f" {__name__}:seen_by_env ,")
        assert hooks.env_hooks() == [f"{__name__}:seen_by_env"]
        model = object()
        hooks.run_model_hooks(model)
        assert SEEN == [("env", model), ("registered", model)]
    finally:
        remove_model_hook(registered)
    remove_model_hook(registered)  # not registered any more: no error
    SEEN.clear()
    other = object()
    hooks.run_model_hooks(other)
    assert SEEN == [("env", other)]  # the registered one is gone


def test_tools_hook_only_when_its_variables_are_set(monkeypatch):
    assert hooks.env_hooks() == []
    monkeypatch.setenv("EXPERTD_CAPTURE_DIR", "")  # empty: off, as before
    assert hooks.env_hooks() == []
    for var in hooks.TOOLS_ENV:
        monkeypatch.setenv(var, "x")
        assert hooks.env_hooks() == [hooks.TOOLS_HOOK]
        monkeypatch.delenv(var)
    monkeypatch.setenv("EXPERTD_SIMULATE_ACTIVATIONS", "hif8")
    monkeypatch.setenv(hooks.HOOKS_ENV, f"{__name__}:seen_by_env")
    assert hooks.env_hooks() == [hooks.TOOLS_HOOK, f"{__name__}:seen_by_env"]
    from expertd.tools.env_hooks import from_env

    assert hooks.resolve(hooks.TOOLS_HOOK) is from_env


@pytest.mark.parametrize("name", ["no_colon", ":fn", "module:"])
def test_a_malformed_name_is_named(name):
    with pytest.raises(ValueError, match=f"EXPERTD_MODEL_HOOKS: {name!r} is not module:function"):
        hooks.resolve(name)


def test_load_model_runs_the_hooks_once(tiny_checkpoint, start_daemon, monkeypatch):
    daemon = start_daemon(tiny_checkpoint)
    monkeypatch.setenv(hooks.HOOKS_ENV, f"{__name__}:seen_by_env")

    @on_model_loaded
    def registered(model):
        SEEN.append(("registered", model))

    try:
        with ExpertClient(daemon.endpoint, heartbeat=False) as client:
            model = client.load_model()
    finally:
        remove_model_hook(registered)
    assert SEEN == [("env", model), ("registered", model)]
