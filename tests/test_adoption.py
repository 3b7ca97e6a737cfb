"""Restart without reloading: a daemon killed with SIGKILL (or handed over with `stop --keep`) leaves its generations
in shared memory, and the next `expertd start` on the same config adopts them — verified, repaired from the
checkpoint where it can be, under the same numbers — while workers keep computing through the restart."""

from __future__ import annotations

import glob
import json
import os
import shutil
import signal
import subprocess
import time

import pytest
import torch

from expertd.client import ExpertClient
from expertd.errors import GenerationGone
from expertd.server.restart import ledger, sealed
from expertd.server.serving.leases import lease_tag
from expertd.server.restart.runstate import RunState
from helpers.daemon import expertd_cmd
from helpers.reference import reference_tensors

NORM = "model.norm.weight"
EXPERT = "model.layers.1.mlp.experts.3.down_proj.weight"


def kill9(daemon) -> None:
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait()


def segments(namespace: str) -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(f"/dev/shm/{namespace}.*"))


def log_of(daemon) -> str:
    """Everything the daemon wrote to stderr (it has exited)."""
    return daemon.proc.communicate()[1] if daemon.proc.stderr else ""


def stop_and_read(daemon) -> str:
    daemon.proc.send_signal(signal.SIGTERM)
    out = daemon.proc.communicate(timeout=60)[1]
    assert daemon.proc.returncode == 0, out
    return out


def wait_job(daemon, timeout: float = 60) -> dict:
    """The daemon's last job once it has ended."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        job = daemon.status().get("job")
        if job and job["state"] != "building":
            return job
        time.sleep(0.1)
    raise TimeoutError("the job did not end")


def entry_of(index, name: str):
    return next(t for t in index.tensors if t.name == name)


def test_kill9_then_start_serves_the_pushed_generation_and_workers_compute_through(
        tiny_checkpoint, start_daemon, workers, namespace):
    first = start_daemon(tiny_checkpoint, lease_timeout_s=6)
    with ExpertClient(first.endpoint) as client:
        pushed = client.tensors()[NORM] * 2
        assert client.update({NORM: pushed}) == 2
    worker = workers(first.endpoint, timeout=30, namespace=namespace, model=True)
    assert worker.hello["ready"]
    before = worker.ask("logits")
    assert before["generation"] == 2
    worker.send("loop 14")  # forwards back to back through the whole restart
    time.sleep(1.5)
    kill9(first)
    time.sleep(1)
    t0 = time.monotonic()
    second = start_daemon(tiny_checkpoint, lease_timeout_s=6)
    status = second.status()
    assert status["generation"] == 2 and time.monotonic() - t0 < 30
    looped = worker.receive()
    assert "error" not in looped, looped
    assert looped["forwards"] > 0 and looped["digests"] == [before["logits"]] and looped["generations"] == [2]
    after = worker.ask("logits")  # heartbeats reached the successor: the same lease, the same generation
    assert after == before
    leases = {c["client"]: c for c in second.status()["leases"]}
    assert lease_tag(worker.ask("lease")["lease"]) in leases
    with ExpertClient(second.endpoint) as client:
        assert client.verify() == [] and client.generation == 2
        assert torch.equal(client.tensors()[NORM], pushed)
    assert wait_job(second)["state"] == "unchanged"  # the checkpoint, read after serving, is what it was
    out = stop_and_read(second)
    assert "adopted generation(s) 2" in out and "nothing to rebuild" in out, out


def test_a_corrupt_byte_and_a_truncated_segment_rebuild_only_those_tensors(tiny_checkpoint, start_daemon, namespace):
    first = start_daemon(tiny_checkpoint)
    with ExpertClient(first.endpoint) as client:
        index = client.index()
    kill9(first)
    norm, expert = entry_of(index, NORM), entry_of(index, "model.layers.1.mlp.experts.down_proj")
    with open(f"/dev/shm/{norm.segment.lstrip('/')}", "r+b") as f:
        f.seek(norm.offset + 3)
        byte = f.read(1)
        f.seek(norm.offset + 3)
        f.write(bytes([byte[0] ^ 0xFF]))
    os.truncate(f"/dev/shm/{expert.segment.lstrip('/')}", 4096)
    second = start_daemon(tiny_checkpoint)
    with ExpertClient(second.endpoint) as client:
        assert client.index().generation == 1 and client.verify() == []
        served, reference = client.tensors(), reference_tensors(tiny_checkpoint)
        assert all(torch.equal(served[n].view(-1).view(torch.uint8),  # (in the dtype served: 5.24's fp32 routers)
                               reference[n].to(served[n].dtype).view(-1).view(torch.uint8)) for n in reference)
        del served
    out = stop_and_read(second)
    assert "2 tensor(s) failed verification" in out and NORM in out and "2 tensor(s) rebuilt" in out


def test_an_updates_own_bytes_cannot_be_rebuilt_so_its_generation_goes(tiny_checkpoint, start_daemon, namespace):
    """A tensor an update() wrote exists nowhere else: corrupt, its generation is dropped (a log line names it),
    and a worker that read it is told with GenerationGone on its next call; refresh() moves it to the latest."""
    first = start_daemon(tiny_checkpoint, lease_timeout_s=3)
    holder = ExpertClient(first.endpoint)
    try:
        holder.update({NORM: holder.tensors()[NORM] + 1})
        holder.refresh()
        assert holder.generation == 2
        entry = entry_of(holder.index(), NORM)
        kill9(first)
        with open(f"/dev/shm/{entry.segment.lstrip('/')}", "r+b") as f:
            f.seek(entry.offset)
            f.write(b"\x00" * 8)
        second = start_daemon(tiny_checkpoint, lease_timeout_s=3)
        assert second.status()["generation"] == 3  # nothing adoptable: loaded afresh, counting on
        deadline = time.monotonic() + 10
        while time.monotonic() < deadline and not holder.lease_lost:
            time.sleep(0.1)
        with pytest.raises(GenerationGone, match="generation 2 is not served any more"):
            holder.tensors()
        holder.refresh()
        assert holder.generation == 3 and holder.verify() == []
    finally:
        holder.close()
    out = stop_and_read(second)
    assert "dropping adopted generation 2 (update)" in out and NORM in out


def test_a_checkpoint_changed_while_dead_becomes_the_next_generation(tiny_checkpoint, start_daemon, tmp_path):
    folder = str(tmp_path / "ckpt")
    shutil.copytree(tiny_checkpoint, folder)
    first = start_daemon(folder)
    kill9(first)
    shard = sorted(glob.glob(os.path.join(folder, "*.safetensors")))[-1]
    from safetensors.torch import load_file, save_file

    tensors = load_file(shard)
    name = next(n for n, t in tensors.items() if t.dtype == torch.bfloat16)
    tensors[name] = tensors[name] * 3
    save_file(tensors, shard, metadata={"format": "pt"})
    second = start_daemon(folder)
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline and second.status()["generation"] != 2:
        time.sleep(0.1)
    status = second.status()
    assert status["generation"] == 2 and status["job"]["kind"] == "check" and status["job"]["tensors_written"] <= 2
    with ExpertClient(second.endpoint) as client:
        assert torch.equal(client.tensors()[name], reference_tensors(folder)[name])
    out = stop_and_read(second)
    assert "adopted generation(s) 1" in out and "the checkpoint changed while no daemon served it" in out


def test_stop_keep_hands_over_even_to_another_version(tiny_checkpoint, start_daemon, namespace, tmp_path):
    first = start_daemon(tiny_checkpoint)
    done = subprocess.run(expertd_cmd("stop", "--keep", "--config", first.config), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0 and "generations left for a successor" in done.stdout
    assert first.proc.wait(5) == 0 and segments(namespace)
    manifest_path = os.path.join(str(tmp_path), "run", f"{namespace}.manifest.json")
    with open(manifest_path) as f:
        manifest = json.load(f)
    assert manifest["state"] == "handover"
    # a predecessor of the release before: expertd 0.0.1, ledger format 2 (each source identity a list beside its
    # digest), sealed by it under the run folder's key
    manifest["expertd"], manifest["ledger"] = "0.0.1", 2
    manifest.pop("hmac")
    state = RunState(namespace, os.path.dirname(manifest_path))
    key = sealed.load_key(state.run_dir, namespace)
    sealed.write(manifest_path, manifest, state.purpose, key, indent=1)
    record = ledger.read(state.run_dir, namespace, 1)
    with open(ledger.record_path(state.run_dir, namespace, 1)) as f:
        written = json.load(f)
    written.pop("hmac")
    written["ledger"], written["expertd"] = 2, "0.0.1"
    written["known"] = [[list(identity), digest] for identity, digest in record.known.items()]
    sealed.write(ledger.record_path(state.run_dir, namespace, 1), written, ledger.purpose(namespace, 1), key)
    assert ledger.read(state.run_dir, namespace, 1).known == record.known
    second = start_daemon(tiny_checkpoint)
    assert second.status()["generation"] == 1
    assert wait_job(second)["state"] == "unchanged"  # the identities it read match the checkpoint's
    out = stop_and_read(second)
    assert "adopted generation(s) 1" in out
    assert not segments(namespace)


def wait_pid(daemon, pid: int, timeout: float = 60) -> dict:
    """The status once the daemon answering on `daemon`'s endpoint is process `pid` and serves."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        status = daemon.status()
        if status and status["pid"] == pid and status["state"] == "serving":
            return status
        time.sleep(0.1)
    raise TimeoutError(f"pid {pid} did not serve on {daemon.endpoint}")


def test_sigusr2_and_restart_hand_over(tiny_checkpoint, start_daemon, namespace):
    first = start_daemon(tiny_checkpoint)
    first.proc.send_signal(signal.SIGUSR2)
    assert first.proc.wait(30) == 0 and segments(namespace)
    started = []
    try:
        for _ in range(2):  # the first finds no daemon and starts one (adopting); the second hands over from it
            proc = subprocess.Popen(expertd_cmd("restart", "--config", first.config), stdout=subprocess.PIPE,
                                    stderr=subprocess.PIPE, text=True)
            started.append(proc)
            assert wait_pid(first, proc.pid)["generation"] == 1
        assert started[0].wait(60) == 0
        started[1].send_signal(signal.SIGTERM)
        assert started[1].wait(60) == 0
        logs = [p.communicate()[1] for p in started]
        assert all("adopted generation(s) 1" in log for log in logs), logs
        assert "generations left for a successor" in started[1].stdout.read() if not started[1].stdout.closed else True
    finally:
        for proc in started:
            if proc.poll() is None:
                proc.kill()
                proc.wait()
    assert not segments(namespace)


def test_what_was_built_under_another_checkpoint_or_user_is_reaped(tiny_checkpoint, start_daemon, namespace,
                                                                   tmp_path):
    other = str(tmp_path / "other")
    shutil.copytree(tiny_checkpoint, other)
    first = start_daemon(tiny_checkpoint)
    kill9(first)
    second = start_daemon(other)  # same namespace and run folder, another checkpoint: never adopted
    assert second.status()["generation"] == 2
    kill9(second)
    victim = segments(namespace)[0]
    os.chown(f"/dev/shm/{victim}", 12345, -1)  # a segment another user could have written
    third = start_daemon(other)
    assert third.status()["generation"] == 3
    out = log_of(second) + stop_and_read(third)
    assert "its checkpoint was" in out and "owned by uid 12345" in out
    assert segments(namespace) == [victim] and "alone" in out  # not adopted, and not this daemon's to unlink
    os.unlink(f"/dev/shm/{victim}")


def test_two_successors_race_and_a_kill_during_adoption(tiny_checkpoint, start_daemon, namespace):
    first = start_daemon(tiny_checkpoint)
    kill9(first)
    racers = [subprocess.Popen(expertd_cmd("start", "--config", first.config), stdout=subprocess.PIPE,
                               stderr=subprocess.PIPE, text=True) for _ in range(2)]
    try:
        loser = None
        deadline = time.monotonic() + 60
        while time.monotonic() < deadline and loser is None:
            loser = next((p for p in racers if p.poll() is not None), None)
            time.sleep(0.05)
        assert loser is not None and loser.returncode == 2, loser.communicate() if loser else None
        err = loser.communicate()[1].strip().splitlines()
        assert len(err) == 1 and "NamespaceBusy" in err[0]
        winner = next(p for p in racers if p is not loser)
        time.sleep(0.5)
        winner.send_signal(signal.SIGKILL)  # mid-adoption or just after: the next start still succeeds
        winner.wait()
        winner.communicate()
    finally:
        for p in racers:
            if p.poll() is None:
                p.kill()
                p.wait()
                p.communicate()
    last = start_daemon(tiny_checkpoint)
    with ExpertClient(last.endpoint) as client:
        assert client.verify() == []
    stop_and_read(last)
    assert not segments(namespace)
