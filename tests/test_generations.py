"""Weight generations: reloads and pushed updates build only what changed, workers move on when they choose,
old bytes leave /dev/shm, bad input changes nothing. Real daemon, real worker processes, generated checkpoints."""

from __future__ import annotations

import glob
import hashlib
import os
import signal
import subprocess
import time

import pytest
import torch

from expertd.client import ExpertClient
from expertd.connection import Connection
from expertd.errors import GenerationLimit, UpdateRejected
from expertd.kernels import quantize_fp8_blockwise
from expertd.protocol import PROTOCOL_VERSION
from helpers.checkpoints import EXPERT, edit_checkpoint
from helpers.daemon import DaemonProcess, expertd_cmd
from helpers.inputs import INPUT_IDS
from helpers.polling import read_available, wait_until
from helpers.reference import reference_tensors, write_reference_bf16

NORM = "model.layers.2.post_attention_layernorm.weight"
FUSED = "model.layers.1.mlp.experts.gate_up_proj"  # EXPERT's served block
FAST = {"lease_timeout_s": 1.5}  # heartbeats every 0.5 s: workers hear of new generations quickly


def logits_digest(folder: str, tmp) -> str:
    """Digest of transformers' own logits for the reference (bit-exact dequant) of a checkpoint."""
    from transformers import AutoModelForCausalLM

    bf16 = write_reference_bf16(folder, str(tmp))
    model = AutoModelForCausalLM.from_pretrained(bf16, dtype=torch.bfloat16)
    with torch.no_grad():
        logits = model(torch.tensor(INPUT_IDS)).logits
    return hashlib.sha256(logits.contiguous().view(torch.uint8).numpy().tobytes()).hexdigest()


@pytest.fixture(scope="module")
def changed(tiny_checkpoint, tmp_path_factory) -> str:
    """The tiny checkpoint with one expert of one layer (re-quantized, new scale) and one norm changed."""
    ref = reference_tensors(tiny_checkpoint)
    q, s = quantize_fp8_blockwise((ref[EXPERT].float() * -1.5), 128, name=EXPERT)
    norm = ref[NORM] * 1.25
    return edit_checkpoint(tiny_checkpoint, str(tmp_path_factory.mktemp("b") / "ckpt"),
                           replace={EXPERT: q, EXPERT + "_scale_inv": s, NORM: norm})


@pytest.fixture(scope="module")
def digests(tiny_checkpoint, changed, tmp_path_factory) -> dict[str, str]:
    out = {"a": logits_digest(tiny_checkpoint, tmp_path_factory.mktemp("ra")),
           "b": logits_digest(changed, tmp_path_factory.mktemp("rb"))}
    assert out["a"] != out["b"]  # the change shows in the logits
    return out


def reload(daemon: DaemonProcess, checkpoint: str | None = None) -> subprocess.CompletedProcess:
    args = ["reload", "--config", daemon.config] + (["--checkpoint", checkpoint] if checkpoint else [])
    return subprocess.run(expertd_cmd(*args), capture_output=True, text=True, timeout=120)


def shm_files(namespace: str) -> dict[str, int]:
    return {os.path.basename(p): os.path.getsize(p) for p in glob.glob(f"/dev/shm/{namespace}.*")}


def latest_bytes(status: dict) -> int:
    """Bytes of the segments the latest generation uses (each served tensor has a segment of its own, and its
    index one more)."""
    return sum(os.path.getsize("/dev/shm" + s) for s in [*status["segments"], status["index_segment"]])


def test_reload_writes_only_what_changed_and_refresh_rebinds_only_that(
        tiny_checkpoint, changed, digests, start_daemon, workers, namespace):
    daemon = start_daemon(tiny_checkpoint)
    w = workers(daemon.endpoint, model=True, namespace=namespace)
    assert w.ask("logits")["logits"] == digests["a"]
    before = daemon.status()
    done = reload(daemon, changed)
    assert done.returncode == 0, done.stderr
    status = daemon.status()
    assert status["generation"] == before["generation"] + 1
    sizes = {t: n for t, n in ((FUSED, 8 * 2 * 200 * 320 * 2), (NORM, 320 * 2))}
    job = status["job"]
    assert job["kind"] == "reload" and job["state"] == "published" and job["tensors_written"] == 2
    assert job["bytes_written"] == sum(sizes.values())  # those tensors' served blocks, not the model
    assert job["bytes_written"] < status["bytes"]["total"] / 4
    # the worker still computes with generation N until it refreshes
    assert w.ask("logits") == {"logits": digests["a"], "generation": before["generation"]}
    moved = w.ask("refresh")
    assert sorted(moved["names"]) == sorted(sizes) and moved["generation"] == status["generation"]
    assert w.ask("logits")["logits"] == digests["b"]
    # nothing changed since: a reload of the same folder writes nothing
    again = reload(daemon, changed)
    assert again.returncode == 0, again.stderr
    assert daemon.status()["job"]["bytes_written"] == 0


def test_forwards_during_reloads_are_old_or_new_exactly(tiny_checkpoint, changed, digests, start_daemon, workers,
                                                        namespace):
    daemon = start_daemon(tiny_checkpoint, **FAST)
    w = workers(daemon.endpoint, model=True, namespace=namespace)
    w.send("loop 8")
    conn = Connection(daemon.endpoint, timeout=30)  # in-process: the pace does not hang on CLI start-up
    try:
        for folder in (changed, tiny_checkpoint, changed, tiny_checkpoint, changed):
            time.sleep(0.8)
            job = conn.request("reload", checkpoint=folder)
            while job["state"] in ("building", "built"):
                time.sleep(0.02)
                job = conn.request("job", job=job["job"])
            assert job["state"] == "published", job
    finally:
        conn.close()
    result = w.receive()
    assert result["forwards"] > 2  # forwards ran across the reloads (how many: the machine's pace, not asserted)
    assert set(result["digests"]) <= {digests["a"], digests["b"]}, "a forward saw a mix of generations"
    assert result["refreshes"] >= 2 and digests["b"] in result["digests"]


def test_old_generation_bytes_leave_dev_shm_once_no_worker_holds_them(tiny_checkpoint, changed, start_daemon, workers,
                                                                      namespace):
    daemon = start_daemon(tiny_checkpoint, **FAST)
    first = workers(daemon.endpoint, model=True, namespace=namespace)
    second = workers(daemon.endpoint, model=True, namespace=namespace)
    assert reload(daemon, changed).returncode == 0
    status = daemon.status()
    assert [g["generation"] for g in status["generations"]] == [status["generation"], status["generation"] - 1]
    held = sum(shm_files(namespace).values())
    assert held > latest_bytes(status)  # generation N's old blocks are still there: workers read them
    first.ask("refresh")
    assert sum(shm_files(namespace).values()) == held  # the second worker still reads generation N
    second.ask("exit")  # a worker that leaves releases its lease
    deadline = time.monotonic() + 10
    while time.monotonic() < deadline and len(daemon.status()["generations"]) > 1:
        time.sleep(0.05)
    status = daemon.status()
    assert len(status["generations"]) == 1
    assert sum(shm_files(namespace).values()) == latest_bytes(status)  # nothing beside the latest generation
    assert first.ask("digest")["digest"]  # and the refreshed worker still reads its weights


def test_update_from_one_process_refresh_in_another(tiny_checkpoint, start_daemon, workers, namespace, tmp_path):
    daemon = start_daemon(tiny_checkpoint, **FAST)
    w = workers(daemon.endpoint, model=True, namespace=namespace)
    heard = []
    with ExpertClient(daemon.endpoint, on_update=heard.append) as updater:
        start = updater.index().generation
        served = updater.tensors()
        original = served[EXPERT].clone()
        pushed = {EXPERT: (served[EXPERT].float() * 0.5 - 0.01).bfloat16(), NORM: served[NORM] * 2}
        generation = updater.update(pushed)
        assert generation == start + 1 and updater.latest_generation == generation
        deadline = time.monotonic() + 10
        while not heard and time.monotonic() < deadline:
            time.sleep(0.05)
        assert heard == [generation]  # on_update, from the heartbeat thread
        moved = w.ask("refresh")
        assert sorted(moved["names"]) == [FUSED, NORM]
        refreshed = updater.refresh()
        assert sorted(refreshed) == [FUSED, NORM] and torch.equal(updater.tensors()[EXPERT], pushed[EXPERT])
        while len(daemon.status()["generations"]) > 1 and time.monotonic() < deadline + 10:
            time.sleep(0.05)
        assert len(daemon.status()["generations"]) == 1  # the old generation is retired ...
        assert torch.equal(served[EXPERT], original)  # ... and views taken from it still read its bytes
        # the model computes with the pushed values: as transformers does from a checkpoint holding them
        expected = edit_checkpoint(tiny_checkpoint, str(tmp_path / "pushed"), replace=pushed)
        assert w.ask("logits")["logits"] == logits_digest(expected, tmp_path / "ref")

        # an FP8 push with its scale is dequantized exactly as at load
        q, s = quantize_fp8_blockwise(pushed[EXPERT].float() * 3, 128, name=EXPERT)
        updater.update({EXPERT: q, EXPERT + "_scale_inv": s})
        updater.refresh()
        again = edit_checkpoint(tiny_checkpoint, str(tmp_path / "fp8"), replace={EXPERT: q, EXPERT + "_scale_inv": s})
        assert torch.equal(updater.tensors()[EXPERT], reference_tensors(again)[EXPERT])

        # several tensors smaller than a page each share the staging segment, each on a page of its own
        small = {name: (served[name].float() * k).bfloat16() for k, name in enumerate(
            (NORM, "model.layers.0.input_layernorm.weight", "model.norm.weight"), start=2)}
        updater.update(small)
        updater.refresh()
        assert all(torch.equal(updater.tensors()[name], value) for name, value in small.items())

        # bad pushes name the tensor and publish nothing
        files, latest = shm_files(namespace), daemon.status()["generation"]
        for bad, words in (
            ({"model.layers.1.mlp.experts.99.up_proj.weight": pushed[EXPERT]}, "experts.99.up_proj"),
            ({EXPERT: pushed[EXPERT][:10]}, "shape"),
            ({EXPERT: pushed[EXPERT].float()}, "dtype"),
            ({EXPERT: q}, "_scale_inv"),
        ):
            with pytest.raises(UpdateRejected, match=words):
                updater.update(bad)
        assert daemon.status()["generation"] == latest and shm_files(namespace) == files


def test_bad_reload_changes_nothing(tiny_checkpoint, start_daemon, workers, namespace, tmp_path):
    daemon = start_daemon(tiny_checkpoint)
    w = workers(daemon.endpoint, model=True, namespace=namespace)
    before, files = daemon.status(), shm_files(namespace)
    unscaled = edit_checkpoint(tiny_checkpoint, str(tmp_path / "unscaled"), drop=[EXPERT + "_scale_inv"])
    truncated = edit_checkpoint(tiny_checkpoint, str(tmp_path / "truncated"))
    shard = sorted(glob.glob(f"{truncated}/*.safetensors"))[0]
    os.truncate(shard, os.path.getsize(shard) - 1000)
    for folder, words in ((unscaled, ["ScaleError", EXPERT]), (truncated, ["truncated", os.path.basename(shard)])):
        done = reload(daemon, folder)
        assert done.returncode != 0 and "Traceback" not in done.stderr
        assert all(word in done.stderr for word in words), done.stderr
        status = daemon.status()
        assert status["generation"] == before["generation"] and status["state"] == "serving"
        assert shm_files(namespace) == files  # nothing new left behind
    assert w.ask("digest")["digest"] == w.hello["digest"]
    assert w.ask("logits")["generation"] == before["generation"]


def test_sigkill_during_reload_then_restart_adopts_the_published_and_reaps_the_half_built(tiny_checkpoint, tmp_path,
                                                                                         namespace):
    other = str(tmp_path / "other")
    subprocess.run(expertd_cmd("generate", other, "--seed", "7"), check=True, capture_output=True)
    daemon = DaemonProcess.launch(tmp_path, tiny_checkpoint, namespace)
    try:
        daemon.wait_serving()
        conn = Connection(daemon.endpoint, timeout=10)
        building = f"/dev/shm/{namespace}.{daemon.proc.pid}.2."
        conn.request("reload", checkpoint=other)
        conn.close()
        deadline = time.monotonic() + 30
        while not glob.glob(building + "*") and time.monotonic() < deadline:
            time.sleep(0.001)
        daemon.proc.send_signal(signal.SIGKILL)
        daemon.proc.wait()
        assert glob.glob(building + "*")  # killed with generation 2 half-built
    finally:
        daemon.stop()
    successor = DaemonProcess.launch(tmp_path, tiny_checkpoint, namespace)
    try:
        assert successor.wait_serving()["generation"] == 1  # the published generation, adopted
        left = {tuple(name.split(".")[1:3]) for name in shm_files(namespace)}
        assert left == {(str(daemon.proc.pid), "1"), (str(successor.proc.pid), "i1")}  # no half-built generation 2
    finally:
        assert successor.stop() == 0
    assert not shm_files(namespace)


def test_max_generations_refusal_names_the_pinning_leases(tiny_checkpoint, changed, start_daemon, workers):
    daemon = start_daemon(tiny_checkpoint, max_generations=2)
    old = workers(daemon.endpoint, model=True)
    assert reload(daemon, changed).returncode == 0
    new = workers(daemon.endpoint, model=True)
    first = daemon.status()["generation"] - 1
    refused = reload(daemon, tiny_checkpoint)
    assert refused.returncode != 0 and "GenerationLimit" in refused.stderr
    assert f"pid {old.hello['pid']}" in refused.stderr and f"generation {first}" in refused.stderr
    assert f"pid {new.hello['pid']}" not in refused.stderr  # on the latest: it pins nothing old
    with ExpertClient(daemon.endpoint) as client, pytest.raises(GenerationLimit, match=f"pid {old.hello['pid']}") as no:
        client.update({NORM: client.tensors()[NORM] * 2}, wait_for_room=0)  # refused at once, not waiting for room
    assert 0 < no.value.retry_after_s <= 30  # when the old generation's leases are revoked (revoke_after_s)
    old.ask("refresh")
    assert reload(daemon, tiny_checkpoint).returncode == 0


def test_sighup_reloads_the_configured_folder_in_place(tiny_checkpoint, start_daemon, namespace, tmp_path):
    folder = edit_checkpoint(tiny_checkpoint, str(tmp_path / "served"))
    daemon = start_daemon(folder)
    before = daemon.status()
    ref = reference_tensors(folder)
    edit_checkpoint(folder, str(tmp_path / "edited"), replace={NORM: ref[NORM] * 3})
    shard = os.path.basename(glob.glob(f"{tmp_path}/edited/*.safetensors")[0])
    for name in os.listdir(tmp_path / "edited"):  # rewrite the served folder's files in place
        os.replace(tmp_path / "edited" / name, os.path.join(folder, name))
    daemon.proc.send_signal(signal.SIGHUP)
    deadline = time.monotonic() + 60
    while daemon.status()["generation"] == before["generation"] and time.monotonic() < deadline:
        time.sleep(0.05)
    status = daemon.status()
    assert status["generation"] == before["generation"] + 1 and status["job"]["kind"] == "reload"
    assert status["job"]["tensors_written"] == 1 and status["job"]["bytes_written"] == 320 * 2, shard
    with ExpertClient(daemon.endpoint) as client:
        assert torch.equal(client.tensors()[NORM], ref[NORM] * 3)


def test_a_push_while_a_reload_builds_waits_for_it_then_publishes_on_top(start_daemon, tmp_path):
    """One build at a time: a push that arrives while a reload builds is refused with Busy when it may not wait
    (wait_for_room=0); by default it waits for the reload, then publishes on the reload's generation."""
    from expertd.errors import Busy
    from expertd.tools.generate import generate

    served, other = str(tmp_path / "roots" / "a"), str(tmp_path / "roots" / "b")
    generate(served, preset="dsv3-bytes", seed=1, shards=3)  # ~0.1 GB once dequantized: a reload takes a while
    generate(other, preset="dsv3-bytes", seed=2, shards=3)  # every tensor differs
    daemon = start_daemon(served, checkpoint_roots=[str(tmp_path / "roots")])
    norm_name = "model.layers.1.input_layernorm.weight"
    with ExpertClient(daemon.endpoint) as client:
        norm = client.tensors()[norm_name].clone()
        job = Connection(daemon.endpoint).request("reload", checkpoint=other)
        assert daemon.status()["job"]["state"] == "building", job
        with pytest.raises(Busy, match="still building"):
            client.update({norm_name: norm * 2}, wait_for_room=0)
        assert client.update({norm_name: norm * 3}) == 3  # after the reload's generation 2
        client.refresh()
        assert torch.equal(client.tensors()[norm_name], norm * 3)
        assert not torch.equal(client.tensors()[EXPERT], reference_tensors(served)[EXPERT])  # b's, not a's


def test_sigquit_prints_every_threads_stack_and_the_daemon_goes_on(tiny_checkpoint, start_daemon):
    """An operator's `kill -QUIT` on a daemon that seems stuck: every thread's Python stack on stderr, and it serves
    on (a stop still ends it with exit 0)."""
    daemon = start_daemon(tiny_checkpoint)
    daemon.proc.send_signal(signal.SIGQUIT)
    said = []
    wait_until(lambda: said.append(read_available(daemon.proc.stderr)) or "server/daemon/loop.py" in "".join(said),
               timeout=30, what="the daemon's stacks on stderr")
    dump = "".join(said)
    assert "Current thread" in dump and "most recent call first" in dump, dump
    assert daemon.status()["generation"] == 1
    os.set_blocking(daemon.proc.stderr.fileno(), True)
    assert daemon.stop() == 0


def test_an_updater_failing_before_commit_aborts_its_staged_update(tiny_checkpoint, start_daemon, namespace,
                                                                   monkeypatch):
    from expertd.client import push as push_mod

    daemon = start_daemon(tiny_checkpoint)
    files = shm_files(namespace)
    with ExpertClient(daemon.endpoint) as updater:
        norm = updater.tensors()[NORM] * 2
        original = push_mod.tensor_checksum

        def broken(raw):
            raise RuntimeError("the updater failed while writing its staged bytes")

        monkeypatch.setattr(push_mod, "tensor_checksum", broken)
        with pytest.raises(RuntimeError, match="while writing its staged bytes"):
            updater.update({NORM: norm})
        assert shm_files(namespace) == files  # the staged segment went at once, not when this lease ends
        monkeypatch.setattr(push_mod, "tensor_checksum", original)
        generation = updater.update({NORM: norm})  # not Busy: nothing is left staged
        updater.refresh()
        assert generation == daemon.status()["generation"] and torch.equal(updater.tensors()[NORM], norm)
        raw = Connection(daemon.endpoint)
        try:
            lease = raw.request("lease", pid=os.getpid(), protocol=PROTOCOL_VERSION)["client"]
            with pytest.raises(UpdateRejected, match="no staged update 99"):
                raw.request("abort", client=lease, update=99)
        finally:
            raw.close()


def test_on_update_hears_every_newer_generation_in_order(tiny_checkpoint, start_daemon):
    """Three updates published between two heartbeats: the callback gets 2, 3 and 4, none skipped."""
    daemon = start_daemon(tiny_checkpoint, lease_timeout_s=3.0)  # a beat every second
    heard = []
    with ExpertClient(daemon.endpoint, on_update=heard.append) as listener, ExpertClient(daemon.endpoint) as updater:
        norm = updater.tensors()[NORM].clone()
        for k in range(3):
            updater.update({NORM: norm * (k + 2)})
        deadline = time.monotonic() + 10
        while len(heard) < 3 and time.monotonic() < deadline:
            time.sleep(0.05)
        assert heard == [2, 3, 4] and listener.latest_generation == 4


def test_a_pusher_whose_own_generation_makes_room_for_its_push_leases_the_latest_and_pushes(tiny_checkpoint,
                                                                                            start_daemon):
    """max_generations 2, revoke_after_s 0: a trainer pushing again without refreshing pins generation 1 itself; its
    second push revokes generation 1's leases, its own among them. The daemon says so (LeaseRevoked) instead of
    handing out a staging segment it then drops; the client leases the latest and pushes: generation 3."""
    from expertd import messages
    from expertd.errors import LeaseRevoked

    daemon = start_daemon(tiny_checkpoint, max_generations=2, revoke_after_s=0)
    with ExpertClient(daemon.endpoint, heartbeat=False) as c, ExpertClient(daemon.endpoint, heartbeat=False) as raw, \
            ExpertClient(daemon.endpoint, heartbeat=False) as worker:
        norm = c.tensors()[NORM].clone()
        assert c.update({NORM: norm * 2}) == 2
        worker.refresh()  # generation 2 pinned too: a third needs generation 1's room
        pushed = messages.PushedTensor(NORM, list(norm.shape), str(norm.dtype))
        ask = messages.Update(client=raw.lease, tensors=[pushed])
        with pytest.raises(LeaseRevoked, match="revoked to make room for this push"):
            raw._conn.send(ask)  # the update op itself refuses: no staging segment handed out, then dropped
        assert c.update({NORM: norm * 3}) == 3
        c.refresh()
        assert torch.equal(c.tensors()[NORM], norm * 3) and c.generation == 3
    wait_until(lambda: [g["generation"] for g in daemon.status()["generations"]] == [3], "generation 2 retires")
