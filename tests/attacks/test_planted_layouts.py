"""Attacks on the layout cache: a forged answer (two experts swapped: every shape still right, the bytes served
wrong) planted where a daemon looks for it is never used unless it is the daemon's own file in the daemon's own
folder. Each case checks the harm: the layout planned (or the bytes a real daemon serves) equals the true one."""

from __future__ import annotations

import json
import os
import subprocess

import pytest

from expertd.client import ExpertClient
from expertd.server.load.checkpoint import Checkpoint
from expertd.server.load.layout import plan_checkpoint
from expertd.server.load.layout_cache import LayoutCache
from helpers.daemon import DaemonProcess
from helpers.takers import MEMBER, NOBODY, needs_root

STACK = "model.layers.1.mlp.experts.gate_up_proj"  # tiny's first MoE layer's fused experts


def plan_layout(folder: str, cache: LayoutCache | None) -> list:
    ckpt = Checkpoint.open(folder)
    try:
        plan = plan_checkpoint(ckpt, layouts=cache)
    finally:
        ckpt.close()
    return [(t.name, [s.name for s in t.sources]) for t in plan.tensors]


def forged(entry: str) -> str:
    """The entry's text with the first two experts of STACK swapped (gate and up of each: two sources apiece)."""
    with open(entry) as f:
        doc = json.load(f)
    sources = doc["assembly"][STACK][0]
    sources[0:2], sources[2:4] = sources[2:4], sources[0:2]
    return json.dumps(doc)


@pytest.fixture
def genuine(tiny_checkpoint, tmp_path):
    """(the cache folder, the path of tiny's entry in it, the true layout, the forged entry's text)."""
    layouts = tmp_path / "layouts"
    truth = plan_layout(tiny_checkpoint, None)
    assert plan_layout(tiny_checkpoint, LayoutCache(str(layouts))) == truth
    (name,) = os.listdir(layouts)
    entry = str(layouts / name)
    text = forged(entry)
    return layouts, entry, truth, text


def test_the_forgery_would_change_the_layout(tiny_checkpoint, genuine):
    """The daemon's own file (0600, its uid) is trusted: the forgery is a real harm where it is believed."""
    layouts, entry, truth, text = genuine
    with open(entry, "w") as f:
        f.write(text)
    cache = LayoutCache(str(layouts))
    assert plan_layout(tiny_checkpoint, cache) != truth and cache.hit


@pytest.mark.parametrize("how", ["another uid's", "group-writable", "symlink", "garbage"])
def test_a_planted_entry_is_ignored_and_replaced(tiny_checkpoint, genuine, how, caplog):
    layouts, entry, truth, text = genuine
    os.unlink(entry)
    if how == "symlink":  # pointing at a forgery the daemon's uid owns, 0600
        elsewhere = layouts.parent / "forged.json"
        elsewhere.write_text(text)
        elsewhere.chmod(0o600)
        os.symlink(elsewhere, entry)
    else:
        with open(entry, "w") as f:
            f.write("{not json" if how == "garbage" else text)
        os.chmod(entry, 0o664 if how == "group-writable" else 0o600)
        if how == "another uid's":
            os.chown(entry, NOBODY, NOBODY)
    cache = LayoutCache(str(layouts))
    with caplog.at_level("WARNING", logger="expertd.loader"):
        assert plan_layout(tiny_checkpoint, cache) == truth
    assert not cache.hit and f"layout cache: ignored {entry}" in caplog.text
    st = os.lstat(entry)  # replaced by the true answer, the daemon's own
    assert st.st_uid == os.geteuid() and oct(st.st_mode & 0o777) == "0o600"
    assert plan_layout(tiny_checkpoint, LayoutCache(str(layouts))) == truth


def test_a_folder_that_is_a_symlink_is_not_used(tiny_checkpoint, genuine, tmp_path, caplog):
    layouts, entry, truth, text = genuine
    with open(entry, "w") as f:
        f.write(text)
    link = tmp_path / "link"
    os.symlink(layouts, link)
    with caplog.at_level("WARNING", logger="expertd.loader"):
        cache = LayoutCache(str(link))
        assert plan_layout(tiny_checkpoint, cache) == truth
    assert not cache.usable and "a symlink" in caplog.text


@needs_root
def test_a_folder_another_uid_made_is_not_used_by_a_real_daemon(tiny_checkpoint, genuine, tmp_path, namespace):
    """uid 65534 makes the folder a config names (0777, its own) before the daemon first starts, with the forged
    entry under the right key: the daemon says it does not use the folder, serves the true bytes, writes nothing."""
    layouts, entry, truth, text = genuine
    shared = tmp_path / "shared"
    shared.mkdir()
    shared.chmod(0o1777)
    theirs = shared / "layouts"
    plant = (f"mkdir -m 777 {theirs} && cat > {theirs}/{os.path.basename(entry)} && "
             f"chmod 644 {theirs}/{os.path.basename(entry)}")
    subprocess.run([*MEMBER, "sh", "-c", plant], input=text, text=True, check=True, timeout=60)
    assert os.stat(theirs).st_uid == NOBODY

    served = {}
    for name, cache in (("true", str(layouts)), ("planted", str(theirs))):
        if name == "true":
            os.unlink(entry)  # the true answer, asked of transformers
        log = tmp_path / f"{name}.log"
        with open(log, "w") as err:
            daemon = DaemonProcess.launch(tmp_path / name, tiny_checkpoint, namespace, stderr=err, layout_cache=cache)
            try:
                daemon.wait_serving()
                with ExpertClient(daemon.endpoint) as client:
                    served[name] = {t.name: t.checksum for t in client.index().tensors}
            finally:
                assert daemon.stop() == 0
        served[name + " log"] = log.read_text()
    assert served["planted"] == served["true"]
    assert f"layout cache {theirs} is owned by uid {NOBODY}" in served["planted log"]
    assert "not used, every start asks transformers" in served["planted log"]
    assert "asked of transformers" in served["planted log"]
    assert os.listdir(theirs) == [os.path.basename(entry)]  # nothing written into it
