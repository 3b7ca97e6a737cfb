"""The layout cache: a start that finds transformers' answer for its checkpoint reads it and never imports
transformers; the answer is keyed by everything it depends on, and one transformers cannot give without its own
objects (a computed parameter) is not kept."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest

from expertd.client import ExpertClient
from expertd.server.load.checkpoint import Checkpoint
from expertd.server.load.layout_cache import LayoutCache
from expertd.tools.generate import generate, generate_model_type
from helpers.daemon import DaemonProcess


def served(endpoint: str) -> dict:
    """name -> (shape, dtype, checksum) of every tensor a daemon serves."""
    with ExpertClient(endpoint) as client:
        return {t.name: (t.shape, t.dtype, t.checksum) for t in client.index().tensors}


def start(folder, checkpoint, namespace, cache) -> tuple[dict, str]:
    """A real daemon with import times on stderr: (what it serves, its stderr)."""
    log = os.path.join(str(folder), "stderr.txt")
    os.makedirs(str(folder), exist_ok=True)
    with open(log, "w") as err:
        daemon = DaemonProcess.launch(folder, checkpoint, namespace, stderr=err, layout_cache=str(cache),
                                      env={**os.environ, "PYTHONPROFILEIMPORTTIME": "1"})
        try:
            daemon.wait_serving()
            tensors = served(daemon.endpoint)
        finally:
            assert daemon.stop() == 0
    with open(log) as f:
        return tensors, f.read()


def imported(stderr: str) -> set[str]:
    return {line.split("|")[-1].strip() for line in stderr.splitlines() if line.startswith("import time:")}


def test_second_start_reads_the_layout_and_never_imports_transformers(tiny_checkpoint, tmp_path, namespace):
    cache = tmp_path / "layouts"
    first, err1 = start(tmp_path / "a", tiny_checkpoint, namespace, cache)
    assert "asked of transformers" in err1 and "transformers.modeling_utils" in imported(err1)
    (entry,) = os.listdir(cache)
    assert oct(os.stat(cache).st_mode & 0o777) == "0o700" and oct(os.stat(cache / entry).st_mode & 0o777) == "0o600"
    second, err2 = start(tmp_path / "b", tiny_checkpoint, namespace, cache)
    assert "read from the layout cache" in err2, err2[-3000:]
    assert not {m for m in imported(err2) if m.split(".")[0] == "transformers"}
    assert second == first  # the same names, shapes, dtypes and bytes


def test_the_config_key_names_a_folder_or_turns_the_cache_off(tiny_checkpoint, tmp_path, namespace, monkeypatch):
    from helpers.daemon import write_config
    from expertd.errors import ConfigError
    from expertd.server.daemon.config import load_config

    assert load_config(write_config(tmp_path, tiny_checkpoint, namespace, layout_cache=False)).layout_cache is None
    monkeypatch.delenv("XDG_CACHE_HOME", raising=False)
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert load_config(write_config(tmp_path, tiny_checkpoint, namespace)).layout_cache == \
        str(tmp_path / "home" / ".cache" / "expertd" / "layouts")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path / "xdg"))
    assert load_config(write_config(tmp_path, tiny_checkpoint, namespace, layout_cache=True)).layout_cache == \
        str(tmp_path / "xdg" / "expertd" / "layouts")

    with pytest.raises(ConfigError, match="layout_cache must be a folder path, true .* or false"):
        load_config(write_config(tmp_path, tiny_checkpoint, namespace, layout_cache=3))


def plan_with(cache: LayoutCache, folder: str):
    from expertd.server.load.layout import plan_checkpoint

    ckpt = Checkpoint.open(folder)
    try:
        return plan_checkpoint(ckpt, layouts=cache)
    finally:
        ckpt.close()


def names_of(folder: str) -> list[str]:
    ckpt = Checkpoint.open(folder)
    try:
        return list(ckpt.tensors)
    finally:
        ckpt.close()


def layout_of(plan) -> list:
    return [(t.name, t.shape, t.dtype, [s.name for s in t.sources]) for t in plan.tensors]


def test_the_key_is_the_config_the_names_and_the_code(tmp_path):
    folder = str(tmp_path / "ckpt")
    generate(folder, preset="tiny", seed=0, shards=2)
    cache = LayoutCache(str(tmp_path / "layouts"))
    cold = plan_with(cache, folder)
    assert not cache.hit and not cold.layout_cached
    warm = plan_with(cache, folder)
    assert cache.hit and warm.layout_cached and layout_of(warm) == layout_of(cold)
    config_path = os.path.join(folder, "config.json")
    with open(config_path) as f:
        config = json.load(f)
    config["rms_norm_eps"] = 1e-5  # any change to config.json is another key
    with open(config_path, "w") as f:
        json.dump(config, f)
    plan_with(cache, folder)
    assert not cache.hit
    plan_with(cache, folder)
    assert cache.hit
    names = names_of(folder)  # the names the planner asks about, and the same less one: two keys more
    cache.assembly(config, names)
    cache.assembly(config, names)
    assert cache.hit
    cache.assembly(config, names[:-1])
    assert not cache.hit
    assert len(os.listdir(tmp_path / "layouts")) == 4


def test_a_computed_layout_is_not_kept(tmp_path):
    """hrm_text's fused projections are Chunked by transformers at load: the answer holds its converter objects."""
    folder = str(tmp_path / "hrm")
    generate_model_type(folder, "hrm_text", fp8=False)
    cache = LayoutCache(str(tmp_path / "layouts"))
    plan = plan_with(cache, folder)
    assert any(t.computed is not None for t in plan.tensors)
    assert os.listdir(tmp_path / "layouts") == []
    plan_with(cache, folder)
    assert not cache.hit


def test_the_least_lately_used_entries_go_first(tmp_path):
    folder = str(tmp_path / "ckpt")
    generate(folder, preset="tiny", seed=0, shards=1)
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    names = names_of(folder)
    layouts = tmp_path / "layouts"
    cache = LayoutCache(str(layouts), max_entries=2)
    entries = []
    for k in range(2):  # two keys (other tensor names), written in turn
        cache.assembly(config, names[: len(names) - k])
        (new,) = set(os.listdir(layouts)) - set(entries)
        entries.append(new)
    os.utime(layouts / entries[0], (1, 1))
    os.utime(layouts / entries[1], (2, 2))
    cache.assembly(config, names[: len(names) - 1])  # a hit: the second is the latest used again
    assert cache.hit and os.stat(layouts / entries[1]).st_mtime > 2
    cache.assembly(config, names[: len(names) - 2])  # a third key: the least lately used goes
    assert set(os.listdir(layouts)) >= {entries[1]} and entries[0] not in os.listdir(layouts)
    assert len(os.listdir(layouts)) == 2


def test_planning_from_the_cache_imports_no_transformers(tiny_checkpoint, tmp_path):
    """`prepare` itself (what the daemon calls) in a fresh process, twice."""
    code = ("import sys; from expertd.server.load.loader import prepare; "
            f"ckpt, plan = prepare({tiny_checkpoint!r}, None, {str(tmp_path / 'layouts')!r}); ckpt.close(); "
            "print(plan.layout_cached, 'transformers' in sys.modules)")
    runs = [subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=300, cwd="/")
            for _ in range(2)]
    assert [r.stdout.split() for r in runs] == [["False", "True"], ["True", "False"]], [r.stderr for r in runs]
