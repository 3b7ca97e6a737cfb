"""Derived tensors survive a restart: the dtype casts and derived layouts a daemon made are recorded beside its
ledger (`server/restart/derived_records.py`), and a successor adopts them with their generation — checked as its
segments are, and with `adopt_verify: full` by their checksums — so that the same cast or gather asked again is
answered from the same segment, nothing made anew. One whose bytes changed is dropped and its segment unlinked; a
record planted or rewritten without the run folder's key is never read, and the segments it names are reaped."""

from __future__ import annotations

import glob
import json
import os
import re
import signal
import subprocess
import time

import torch

from expertd import derived, messages
from expertd.client import ExpertClient
from expertd.connection import Connection
from expertd.index import bytes_checksum, checksum_parts
from expertd.server.restart import ledger, sealed, derived_records as derived_records
from helpers.daemon import expertd_cmd

NORM = "model.norm.weight"
STACK = "model.layers.1.mlp.experts.down_proj"
OTHER = "model.layers.0.input_layernorm.weight"  # what an update changes (neither derived tensor is made of it)


def kill9(daemon) -> str:
    """SIGKILL the daemon; what it wrote to stderr."""
    daemon.proc.send_signal(signal.SIGKILL)
    return daemon.proc.communicate(timeout=60)[1]


def stop_and_read(daemon) -> str:
    daemon.proc.send_signal(signal.SIGTERM)
    out = daemon.proc.communicate(timeout=60)[1]
    assert daemon.proc.returncode == 0, out
    return out


def hand_over(daemon) -> None:
    done = subprocess.run(expertd_cmd("stop", "--keep", "--config", daemon.config), capture_output=True, text=True,
                          timeout=60)
    assert done.returncode == 0, done.stderr
    assert daemon.proc.wait(30) == 0


def derived_segments(namespace: str) -> list[str]:
    return sorted(os.path.basename(p) for p in glob.glob(f"/dev/shm/{namespace}.*")
                  if re.search(r"\.v\d+\.\d{3}", os.path.basename(p)))


def run_dir(daemon) -> str:
    return os.path.join(os.path.dirname(daemon.config), "run")


def ask(endpoint: str, lease: str, request: messages.DerivedRequest) -> dict:
    """The daemon's one derived tensor answering a one-item cast or gather (asked again while it says `building`)."""
    conn = Connection(endpoint, timeout=60)
    try:
        for _ in range(600):
            reply = conn.send(request)
            if not reply.get("building"):
                (tensor,) = reply["tensors"]
                return tensor
            time.sleep(0.1)
    finally:
        conn.close()
    raise TimeoutError("the derived tensor was not made")


def cast(endpoint: str, lease: str, dtype: str = "torch.float32") -> dict:
    return ask(endpoint, lease, messages.Cast(client=lease, tensors=[messages.CastItem(name=NORM, dtype=dtype)]))


def gather_item(source: torch.Tensor) -> tuple[messages.GatherItem, torch.Tensor]:
    """A gather of STACK (every block reversed, 64 zeros after it) and the bytes it must make."""
    blocks, n = source.shape[0], source[0].numel()
    index = torch.cat([torch.arange(n - 1, -1, -1), torch.full((64,), -1, dtype=torch.int64)])
    want = torch.cat([source.reshape(blocks, -1).flip(1), torch.zeros(blocks, 64, dtype=source.dtype)], 1)
    return derived.request(STACK, derived.encode(index), index.numel(), [blocks, n + 64]), want


def gather(endpoint: str, lease: str, item: messages.GatherItem) -> dict:
    return ask(endpoint, lease, messages.Gather(client=lease, tensors=[item]))


def bytes_of(made: dict) -> bytes:
    with open(f"/dev/shm/{made['segment'].lstrip('/')}", "rb") as f:
        f.seek(made["offset"])
        return f.read(made["nbytes"])


def summed(made: dict) -> bool:
    """The derived tensor's bytes in its segment hash to the checksum it was handed out with."""
    return bytes_checksum(bytes_of(made), checksum_parts(made["checksum"])) == made["checksum"]


def listed(daemon, generation: int) -> dict[str, str]:
    """Derivation name -> segment of the derived tensors `status` lists for `generation`."""
    (gen,) = [g for g in daemon.status()["generations"] if g["generation"] == generation]
    return {v["derivation"]: v["segment"] for v in gen["derived"]["tensors"]}


def recorded(daemon, generation: int, count: int, timeout: float = 30) -> dict:
    """The derived tensors record of `generation` once it lists `count` derived tensors (it is written between requests,
    at most every RECORD_EVERY_S: a tampered one the daemon did not adopt stays until then)."""
    folder, deadline = run_dir(daemon), time.monotonic() + timeout
    index = ledger.read(folder, daemon.namespace, generation).index
    while time.monotonic() < deadline:
        try:
            found = derived_records.read(folder, index)
        except sealed.Unsealed:  # a record the daemon refused to adopt, until it rewrites it
            found = {}
        if len(found) == count:
            return found
        time.sleep(0.05)
    raise TimeoutError(f"generation {generation}'s derived tensors record did not list {count} derived tensor(s)")


def flip_byte(made: dict) -> None:
    with open(f"/dev/shm/{made['segment'].lstrip('/')}", "r+b") as f:
        f.seek(made["offset"] + 3)
        byte = f.read(1)
        f.seek(made["offset"] + 3)
        f.write(bytes([byte[0] ^ 0xFF]))


def test_a_handover_keeps_casts_and_gathers_and_the_same_asks_get_the_same_segments(tiny_checkpoint, start_daemon,
                                                                                     namespace):
    first = start_daemon(tiny_checkpoint, lease_timeout_s=4)
    old = ExpertClient(first.endpoint, timeout=60)  # stays on generation 1 through the handover
    item, want = gather_item(old.served_tensors()[STACK])
    casted, gathered = cast(first.endpoint, old.lease), gather(first.endpoint, old.lease, item)
    newer = old.update({OTHER: old.served_tensors()[OTHER] * 2})
    with ExpertClient(first.endpoint, timeout=60) as client:  # generation 2 reuses the gather (same source bytes)
        assert client.index().generation == newer
        assert gather(first.endpoint, client.lease, item)["segment"] == gathered["segment"]
    made = derived_segments(namespace)
    assert len(made) == 2 and {listed(first, 1)[v["derivation"]] for v in (casted, gathered)} == {
        casted["segment"], gathered["segment"]}
    hand_over(first)
    assert os.path.exists(ledger.derived_path(run_dir(first), namespace, 1))

    second = start_daemon(tiny_checkpoint, lease_timeout_s=4)
    assert listed(second, 1) == {casted["derivation"]: casted["segment"], gathered["derivation"]: gathered["segment"]}
    assert listed(second, 2) == {gathered["derivation"]: gathered["segment"]}
    assert old.index().generation == 1  # its lease was re-granted: it asks on generation 1 again
    again = cast(second.endpoint, old.lease)
    assert again == casted and summed(again)
    with ExpertClient(second.endpoint, timeout=60) as client:
        assert client.index().generation == newer
        assert gather(second.endpoint, client.lease, item) == gathered
        (out,) = client.derived([item])  # mapped, and checked against its checksum by the client
        assert torch.equal(out, want.reshape(out.shape)) and summed(gathered)
        del out
    assert derived_segments(namespace) == made  # nothing made again
    old.close()
    deadline = time.monotonic() + 30  # generation 1's hold ends (one lease timeout): the shared gather stays
    while 1 in {g["generation"] for g in second.status()["generations"]} and time.monotonic() < deadline:
        time.sleep(0.2)
    assert 1 not in {g["generation"] for g in second.status()["generations"]}
    assert derived_segments(namespace) == [os.path.basename(gathered["segment"])]
    assert not os.path.exists(ledger.derived_path(run_dir(first), namespace, 1))  # gone with its generation
    out = stop_and_read(second)
    assert "2 derived tensor segment(s) kept" in out, out
    assert not glob.glob(f"/dev/shm/{namespace}*") and not glob.glob(os.path.join(run_dir(first), "*.json"))


def test_a_derived_tensor_whose_bytes_changed_is_dropped_under_full_and_kept_under_sizes(tiny_checkpoint, start_daemon,
                                                                                    namespace):
    first = start_daemon(tiny_checkpoint)
    with ExpertClient(first.endpoint, timeout=60) as client:
        item, want = gather_item(client.served_tensors()[STACK])
        casted, gathered = cast(first.endpoint, client.lease), gather(first.endpoint, client.lease, item)
        recorded(first, 1, 2)
    kill9(first)
    flip_byte(gathered)

    second = start_daemon(tiny_checkpoint)
    assert listed(second, 1) == {casted["derivation"]: casted["segment"]}
    assert not os.path.exists(f"/dev/shm/{gathered['segment'].lstrip('/')}")  # dropped: unlinked
    with ExpertClient(second.endpoint, timeout=60) as client:
        remade = gather(second.endpoint, client.lease, item)  # made anew, numbered after the adopted cast's segment
        assert remade["segment"] not in (gathered["segment"], casted["segment"]) and summed(remade)
        assert ".v1.001." in remade["segment"], remade
        (out,) = client.derived([item])
        assert torch.equal(out, want.reshape(out.shape))
        del out
        assert set(recorded(second, 1, 2)) == {casted["derivation"], gathered["derivation"]}
    log = kill9(second)
    flip_byte(casted)

    third = start_daemon(tiny_checkpoint, adopt_verify="sizes")  # sizes: its bytes are not read
    assert listed(third, 1) == {casted["derivation"]: casted["segment"], gathered["derivation"]: remade["segment"]}
    out = log + stop_and_read(third)
    assert "1 derived tensor(s) dropped" in out and "its bytes fail their checksum" in out and STACK in out, out
    assert not glob.glob(f"/dev/shm/{namespace}*")


def test_a_tampered_or_planted_derived_record_is_never_read_and_its_segments_are_reaped(tiny_checkpoint,
                                                                                         start_daemon, namespace):
    first = start_daemon(tiny_checkpoint)
    with ExpertClient(first.endpoint, timeout=60) as client:
        casted = cast(first.endpoint, client.lease)
    hand_over(first)
    folder = run_dir(first)
    path = ledger.derived_path(folder, namespace, 1)
    with open(path) as f:
        text = f.read()
    with open(path, "w") as f:  # the record rewritten without the key: its MAC no longer matches
        f.write(text.replace(casted["checksum"], "xxh3_64:0000000000000000"))

    second = start_daemon(tiny_checkpoint)
    assert second.status()["generation"] == 1 and listed(second, 1) == {}
    assert not os.path.exists(f"/dev/shm/{casted['segment'].lstrip('/')}")  # not trusted: reaped
    with ExpertClient(second.endpoint, timeout=60) as client:
        made = cast(second.endpoint, client.lease)
        assert made["derivation"] == casted["derivation"] and made["segment"] != casted["segment"]
        recorded(second, 1, 1)
    hand_over(second)
    log = second.proc.stderr.read()
    record = json.loads(open(path).read())
    record.pop("hmac")  # planted: a record of the right shape that no one with the key sealed
    with open(path, "w") as f:
        json.dump(record, f)

    third = start_daemon(tiny_checkpoint)
    assert listed(third, 1) == {} and not os.path.exists(f"/dev/shm/{made['segment'].lstrip('/')}")
    out = log + stop_and_read(third)
    assert "not adopting the derived tensors of generation 1" in out and "MAC does not match" in out, out
    assert "carries no MAC" in out, out
    assert not glob.glob(f"/dev/shm/{namespace}*")
    key = sealed.key_path(folder, namespace)
    assert not os.path.exists(key) and not os.path.exists(path)


def test_a_successor_adopts_a_derived_layout_that_keeps_an_older_layouts_blocks(start_daemon, namespace, tmp_path):
    """`expert_ranges`: a push of one expert makes the stack ranges; the same gather asked on it derives that expert's
    block only and lies in both layouts' segments (extents). After kill -9 the successor adopts it (its record lists
    the extents, each segment's size and the request's form; every range checked with `adopt_verify: full`): asked
    again, it is answered from the same segments, nothing made anew, the bytes the reference gather makes; and after
    the successor's own push of another expert, the same gather derives that expert's block only again."""
    from expertd.leasing import pinned
    from expertd.tools.generate import generate_model_type

    paged, stack = str(tmp_path / "paged"), "model.layers.1.mlp.experts.gate_up_proj"
    generate_model_type(paged, "qwen3_moe", fp8=False, hidden_size=256, moe_intermediate_size=128)  # 64 KiB parts
    first = start_daemon(paged, max_generations=4)
    with ExpertClient(first.endpoint, timeout=60) as client:
        source = client.served_tensors()[stack]
        block = source[0].numel()
        index = torch.arange(block).flip(0)
        item = derived.request(stack, derived.encode(index), block, tuple(source.shape))
        gather(first.endpoint, client.lease, item)
        expert = "model.layers.1.mlp.experts.3.up_proj.weight"
        client.update({expert: -client.tensors()[expert]})
        with pinned(client, 1):
            client.refresh()
            made = gather(first.endpoint, client.lease, item)
        assert len(made["extents"]) == 3, made
        new = client.served_tensors()[stack]
        want = new.reshape(len(new), -1)[:, index].reshape(new.shape).clone()
    generation = first.status()["generation"]
    found = recorded(first, generation, 1)
    assert [v.entry.extents for v in found.values()] and all(v.sizes for v in found.values())
    before = derived_segments(namespace)
    kill9(first)
    second = start_daemon(paged, max_generations=4)
    assert second.status()["generation"] == generation
    with ExpertClient(second.endpoint, timeout=60) as client:
        assert gather(second.endpoint, client.lease, item) == made
        (out,) = client.derived([item])  # mapped as one view of its ranges, checked against its checksum
        assert torch.equal(out, want)
        del out
        assert derived_segments(namespace) == before  # nothing made again
        expert = "model.layers.1.mlp.experts.5.gate_proj.weight"
        client.update({expert: client.tensors()[expert] * 2})
        with pinned(client, 1):
            client.refresh()
            again = gather(second.endpoint, client.lease, item)
        new = client.served_tensors()[stack]
        (out,) = client.derived([item])
        assert torch.equal(out, new.reshape(len(new), -1)[:, index].reshape(new.shape))
        del out
    assert len(again["extents"]) == 5, again  # the adopted layout's ranges, expert 5's block cut out of them
    made_now = sorted(set(derived_segments(namespace)) - set(before))
    assert [os.path.getsize(f"/dev/shm/{name}") for name in made_now] == [block * source.element_size()], made_now


def test_an_older_expertds_derived_record_is_discarded_with_one_line_and_its_derived_tensors_made_again(
        tiny_checkpoint, start_daemon, namespace):
    """A derived tensors record in an older format (sealed with the run folder's key, as a predecessor of an older
    expertd wrote it) is not adopted: one warning names it, its segments are reaped, and the same gather asked again is
    made anew under the same name."""
    first = start_daemon(tiny_checkpoint)
    with ExpertClient(first.endpoint, timeout=60) as client:
        item, want = gather_item(client.served_tensors()[STACK])
        gathered = gather(first.endpoint, client.lease, item)
    recorded(first, 1, 1)
    hand_over(first)
    path, folder = ledger.derived_path(run_dir(first), namespace, 1), run_dir(first)
    key = sealed.load_key(folder, namespace)
    record = sealed.read(path, derived_records.purpose(namespace, 1), key)
    record["derived"] = derived_records.RECORD_VERSION - 1  # as an older expertd recorded it
    sealed.write(path, record, derived_records.purpose(namespace, 1), key)

    second = start_daemon(tiny_checkpoint)
    assert second.status()["generation"] == 1 and listed(second, 1) == {}
    assert not os.path.exists(f"/dev/shm/{gathered['segment'].lstrip('/')}")  # discarded: reaped
    with ExpertClient(second.endpoint, timeout=60) as client:
        again = gather(second.endpoint, client.lease, item)
        assert again["derivation"] == gathered["derivation"]
        (out,) = client.derived([item])
        assert torch.equal(out, want.reshape(out.shape))
        del out
    out = stop_and_read(second)
    lines = [line for line in out.splitlines() if "not adopting the derived tensors of generation 1" in line]
    assert len(lines) == 1 and f"format {derived_records.RECORD_VERSION - 1}" in lines[0], out
    assert not glob.glob(f"/dev/shm/{namespace}*")
