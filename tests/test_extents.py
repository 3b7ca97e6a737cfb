"""A changed expert costs its own bytes (issue 39, the Python client's part): a push that changes some experts of a
stack writes those experts only, the new generation's stack is the older segments' ranges with theirs replaced
(index schema 3), and a reader maps the ranges as one contiguous read-only view. Real daemon, real shm segments."""

from __future__ import annotations

import glob
import json
import mmap
import os
import subprocess
import sys

import pytest
import torch

from expertd.client import ExpertClient
from expertd.client.residency import shared_ranges
from expertd.errors import ProtocolError
from expertd.extents import Extent, cut, merge
from expertd.index import TensorEntry, TensorIndex, derive_views, tensor_checksum
from expertd.shm import map_segments, view
from expertd.tools.generate import generate_model_type
from expertd.index import SegmentEntry
from helpers.daemon import expertd_cmd
from helpers.polling import wait_until

PAGE = mmap.PAGESIZE
STACK = "model.layers.1.mlp.experts.gate_up_proj"  # [E, 2I, H]: parts gate and up of each expert
EXPERT = "model.layers.1.mlp.experts.3.up_proj.weight"  # one part of it: I x H bf16 = 64 KiB


@pytest.fixture(scope="module")
def paged(tmp_path_factory) -> str:
    """A Qwen3-MoE bf16 checkpoint whose experts' parts are whole pages (I x H x 2 bytes = 64 KiB)."""
    folder = str(tmp_path_factory.mktemp("paged") / "qwen3_moe")
    generate_model_type(folder, "qwen3_moe", fp8=False, hidden_size=256, moe_intermediate_size=128)
    return folder


def in_one_shared_range(t: torch.Tensor) -> bool:
    lo, hi = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size()
    return any(a <= lo and hi <= b for a, b in shared_ranges("/dev/shm"))


def shm_bytes(namespace: str) -> int:
    return sum(os.path.getsize(p) for p in glob.glob(f"/dev/shm/{namespace}.*"))


def test_extents_round_trip_in_schema_3_and_bad_ones_are_refused():
    extents = [Extent("/a", 0, 2 * PAGE), Extent("/b", PAGE, PAGE), Extent("/a", 3 * PAGE, PAGE)]
    entry = TensorEntry("t", "/a", 0, 4 * PAGE, [4, PAGE // 2], "torch.bfloat16", ["t.0", "t.1", "t.2", "t.3"],
                        extents=extents)
    plain = TensorEntry("u", "/c", 0, PAGE, [PAGE // 2], "torch.bfloat16", ["u"])
    index = TensorIndex(1, "ns", "qwen3_moe", "hf", {}, [SegmentEntry(s, 8 * PAGE) for s in "/a /b /c".split()],
                        [entry, plain], None)
    wire = index.to_dict()
    assert wire["schema"] == 3 and "extents" not in wire["tensors"][1]
    back = TensorIndex.from_dict(wire)
    assert back.tensors[0].extents == extents and back.tensors[1].extents is None
    assert TensorIndex.from_dict({**wire, "tensors": [wire["tensors"][1]]}).to_dict()["schema"] == 2
    views = derive_views(back.tensors)  # expert k: its part of the ranges
    assert [v.extents for v in views[:2]] == [None, None] and (views[0].segment, views[0].offset) == ("/a", 0)
    assert (views[2].segment, views[2].offset, views[3].offset) == ("/b", PAGE, 3 * PAGE)
    assert merge([Extent("/a", 0, PAGE), Extent("/a", PAGE, PAGE), Extent("/b", 0, PAGE)]) == [
        Extent("/a", 0, 2 * PAGE), Extent("/b", 0, PAGE)]
    assert cut(extents, PAGE, 2 * PAGE) == [Extent("/a", PAGE, PAGE), Extent("/b", PAGE, PAGE)]
    for bad, says in (([["/a", 0, PAGE]], "at least two"), ([["/a", 0, PAGE], ["/b", 0, 2 * PAGE]], "hold"),
                      ([["/a", -1, 2 * PAGE], ["/b", 0, 2 * PAGE]], "is not"), ([["/a", 0, 0], ["/b", 0, 4 * PAGE]],
                                                                                 "is not")):
        with pytest.raises(ProtocolError, match=says):
            TensorIndex.from_dict({**wire, "tensors": [{**wire["tensors"][0], "extents": bad}]})


def test_a_tensor_of_several_segments_is_one_read_only_view_of_their_pages(namespace):
    names = [f"/{namespace}.x.{k}" for k in range(2)]
    data = [torch.randint(0, 255, (8 * PAGE,), dtype=torch.uint8) for _ in names]
    for name, d in zip(names, data):
        with open(f"/dev/shm{name}", "wb") as f:
            f.write(d.numpy().tobytes())
    try:
        segments = map_segments([SegmentEntry(n, 8 * PAGE) for n in names])
        extents = [Extent(names[0], 0, 2 * PAGE), Extent(names[1], 5 * PAGE, PAGE), Extent(names[0], 6 * PAGE, 100)]
        entry = TensorEntry("t", names[0], 0, 3 * PAGE + 100, [3 * PAGE + 100], "torch.uint8", extents=extents)
        t = view(segments, entry)
        assert torch.equal(t, torch.cat([data[0][:2 * PAGE], data[1][5 * PAGE:6 * PAGE], data[0][6 * PAGE:][:100]]))
        assert in_one_shared_range(t)  # the daemon's pages, mapped as one range: no copy
        del segments
        for name in names:
            os.unlink(f"/dev/shm{name}")  # the view outlives the segments' mappings and files
        assert int(t[2 * PAGE]) == int(data[1][5 * PAGE])
        lo = t.data_ptr()
        del t
        assert not any(a <= lo < b for a, b in shared_ranges("/dev/shm"))  # unmapped with its last tensor
    finally:
        for name in names:
            if os.path.exists(f"/dev/shm{name}"):
                os.unlink(f"/dev/shm{name}")


def resident(t: torch.Tensor) -> int:
    """Bytes of `t`'s range present in this process's page tables (smaps Rss of the mappings inside it)."""
    lo, hi, total = t.data_ptr(), t.data_ptr() + t.numel() * t.element_size(), 0
    with open("/proc/self/smaps") as f:
        inside = False
        for line in f:
            head = line.split()[0]
            if "-" in head and not head.endswith(":"):
                a, b = (int(x, 16) for x in head.split("-"))
                inside = lo <= a and b <= hi
            elif inside and head == "Rss:":
                total += int(line.split()[1]) << 10
    return total


def test_a_newer_view_of_a_stack_takes_the_unchanged_ranges_page_tables(namespace):
    """A stack of 8 parts viewed, read whole; its next generation (part 5 in another segment) viewed under the same
    name: the unchanged parts' page tables move to the new view (nothing to fault in again but part 5), the new view
    reads the new bytes and the old one still reads the old."""
    names = [f"/{namespace}.p.{k}" for k in range(2)]
    data = [torch.randint(0, 255, (8 * 4 * PAGE,), dtype=torch.uint8) for _ in names]
    for name, d in zip(names, data):
        with open(f"/dev/shm{name}", "wb") as f:
            f.write(d.numpy().tobytes())
    try:
        segments = map_segments([SegmentEntry(n, 32 * PAGE) for n in names])
        part = 4 * PAGE
        first = [Extent(names[0], 0, 4 * part), Extent(names[1], 0, part), Extent(names[0], 5 * part, 3 * part)]
        second = [Extent(names[0], 0, 4 * part), Extent(names[1], 3 * part, part), Extent(names[0], 5 * part, 3 * part)]
        entry = lambda extents: TensorEntry("stack", names[0], 0, 8 * part, [8 * part], "torch.uint8",  # noqa: E731
                                            extents=extents)
        old = view(segments, entry(first))
        want_old = torch.cat([data[0][:4 * part], data[1][:part], data[0][5 * part:]])
        assert torch.equal(old, want_old) and resident(old) == 8 * part  # read whole: every page present
        new = view(segments, entry(second))
        assert resident(new) == 7 * part  # the unchanged parts' pages came with their page tables
        assert torch.equal(new, torch.cat([data[0][:4 * part], data[1][3 * part:4 * part], data[0][5 * part:]]))
        assert torch.equal(old, want_old) and in_one_shared_range(new) and in_one_shared_range(old)
    finally:
        for name in names:
            os.unlink(f"/dev/shm{name}")


def test_a_write_into_the_composed_view_is_sigsegv(namespace):
    code = f"""
import os, torch
from expertd.extents import Extent
from expertd.index import SegmentEntry, TensorEntry
from expertd.shm import map_segments, view
names = ["/{namespace}.w.0", "/{namespace}.w.1"]
for n in names:
    with open("/dev/shm" + n, "wb") as f:
        f.write(bytes(2 * {PAGE}))
segments = map_segments([SegmentEntry(n, 2 * {PAGE}) for n in names])
for n in names:
    os.unlink("/dev/shm" + n)
t = view(segments, TensorEntry("t", names[0], 0, 2 * {PAGE}, [2 * {PAGE}], "torch.uint8",
                               extents=[Extent(names[0], 0, {PAGE}), Extent(names[1], {PAGE}, {PAGE})]))
print("mapped", flush=True)
t[{PAGE} + 1] = 7
print("written", flush=True)
"""
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60)
    assert done.returncode == -11 and "mapped" in done.stdout and "written" not in done.stdout, done


def test_a_push_of_one_expert_writes_that_expert_and_readers_see_each_generation(paged, start_daemon, namespace):
    daemon = start_daemon(paged, expert_ranges=True, max_generations=4)
    with ExpertClient(daemon.endpoint, heartbeat=False) as old, ExpertClient(daemon.endpoint, heartbeat=False) as c:
        before = {n: t.clone() for n, t in c.served_tensors().items()}
        part = c.tensors()[EXPERT].clone()
        grown = shm_bytes(namespace)
        assert c.update({EXPERT: -part}) == 2
        c.refresh()
        grown = shm_bytes(namespace) - grown
        (entry,) = [t for t in c.index().tensors if t.name == STACK]
        assert entry.extents and len(entry.extents) == 3, entry  # the old ranges around the new expert's
        new_index = c.index()
        assert grown <= part.numel() * 2 + os.path.getsize(f"/dev/shm{daemon.status()['index_segment']}"), grown
        served = c.served_tensors()
        want = before[STACK].clone()
        e, half = 3, want.shape[1] // 2
        want[e, half:] = -part
        assert torch.equal(served[STACK], want)
        assert in_one_shared_range(served[STACK])
        assert all(torch.equal(served[n], before[n]) for n in before if n != STACK)
        assert torch.equal(c.tensors()[EXPERT], -part)
        assert c.verify() == [] and tensor_checksum(served[STACK], len(entry.sources)) == entry.checksum
        assert torch.equal(old.served_tensors()[STACK], before[STACK])  # a reader still on generation 1
        assert new_index.generation == 2
        # logits: transformers' own model with that expert changed, and the unchanged one for the old reader
        from transformers import AutoModelForCausalLM

        reference = AutoModelForCausalLM.from_pretrained(paged, dtype=torch.bfloat16).eval()
        ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
        with torch.no_grad():
            old_logits = reference(ids).logits
            dict(reference.named_parameters())[STACK].data[e, half:] = -part
            new_logits = reference(ids).logits
            assert torch.equal(c.load_model()(ids).logits, new_logits)
            assert torch.equal(old.load_model()(ids).logits, old_logits)
        assert not torch.equal(new_logits, old_logits)


def test_generations_of_ranges_share_segments_until_none_uses_them(paged, start_daemon, namespace):
    """A whole push of the stack with one expert changed writes that expert; a second push changes another (the
    stack then lies in three generations' segments); old generations retire without taking a range a live one
    still uses; a push that changes every expert writes the stack whole again and the old segments go."""
    daemon = start_daemon(paged, expert_ranges=True, max_generations=2, revoke_after_s=0)
    with ExpertClient(daemon.endpoint, heartbeat=False) as c:
        want = c.served_tensors()[STACK].clone()
        first_segment = next(t.segment for t in c.index().tensors if t.name == STACK)
        for e in (5, 0):  # pushed whole, equal to what is served but for expert e
            stack = c.served_tensors()[STACK].clone()
            stack[e] = stack[e] * 2 + 1
            want[e] = stack[e]
            c.update({STACK: stack})
            c.refresh()
        (entry,) = [t for t in c.index().tensors if t.name == STACK]
        segments = {x.segment for x in entry.extents}
        assert len(segments) == 3 and first_segment in segments, entry.extents
        assert [g["generation"] for g in daemon.status()["generations"]] == [3]  # 1 and 2 retired
        assert all(os.path.exists(f"/dev/shm{s}") for s in segments)  # their ranges still used by generation 3
        with ExpertClient(daemon.endpoint, heartbeat=False) as fresh:
            assert torch.equal(fresh.served_tensors()[STACK], want) and fresh.verify() == []
        c.update({STACK: -want})
        c.refresh()
        (entry,) = [t for t in c.index().tensors if t.name == STACK]
        assert entry.extents is None and torch.equal(c.served_tensors()[STACK], -want)
    assert not any(os.path.exists(f"/dev/shm{s}") for s in segments)


def test_a_stack_whose_parts_are_not_whole_pages_is_written_whole(tiny_checkpoint, start_daemon, namespace, tmp_path):
    with open(tmp_path / "daemon.log", "w") as log:
        daemon = start_daemon(tiny_checkpoint, expert_ranges=True, stderr=log)
    with ExpertClient(daemon.endpoint, heartbeat=False) as c:
        stack = next(t for t in c.index().tensors if len(t.sources) > 1)
        value = c.served_tensors()[stack.name].clone()
        value[0] = value[0] * 2
        c.update({stack.name: value})
        c.refresh()
        (entry,) = [t for t in c.index().tensors if t.name == stack.name]
        assert entry.extents is None and torch.equal(c.served_tensors()[stack.name], value)
    said = [line for line in (tmp_path / "daemon.log").read_text().splitlines() if "not whole pages" in line]
    assert len(said) == 1 and stack.name in said[0], said


def test_a_successor_adopts_a_generation_of_ranges(paged, start_daemon, namespace):
    """kill -9 after a push that wrote one expert: the next daemon adopts generation 2, its stack still the ranges
    of both generations' segments (each verified range by range), the same bytes; its own push into the stack then
    sums it right."""
    first = start_daemon(paged, expert_ranges=True)
    with ExpertClient(first.endpoint, heartbeat=False) as c:
        part = c.tensors()[EXPERT].clone()
        c.update({EXPERT: -part})
        c.refresh()
        want = c.served_tensors()[STACK].clone()
        (entry,) = [t for t in c.index().tensors if t.name == STACK]
    first.proc.kill()
    first.proc.wait()
    second = start_daemon(paged, expert_ranges=True)
    assert second.status()["generation"] == 2
    with ExpertClient(second.endpoint, heartbeat=False) as c:
        (adopted,) = [t for t in c.index().tensors if t.name == STACK]
        assert adopted.extents == entry.extents and c.verify() == []
        assert torch.equal(c.served_tensors()[STACK], want) and torch.equal(c.tensors()[EXPERT], -part)
        wait_until(lambda: second.status()["job"]["state"] != "building", "the successor's check of the checkpoint")
        c.update({EXPERT: part * 3})  # the successor knows no part's checksum: it hashes the stack's own bytes
        c.refresh()
        assert torch.equal(c.tensors()[EXPERT], part * 3) and c.verify() == []


def test_a_reload_whose_checkpoint_differs_in_two_experts_writes_those_experts(paged, start_daemon, namespace,
                                                                                tmp_path):
    """A reload onto a copy of the checkpoint with two experts' projections changed (one in each stack of layer 1)
    writes those two parts: each stack's entry is the old ranges with one replaced, the served bytes and logits are
    transformers' own of the new folder, a reader still on generation 1 computes the old logits; reloading the
    original folder again writes the two parts back."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from helpers.checkpoints import INDEX, edit_checkpoint

    down = "model.layers.1.mlp.experts.6.down_proj.weight"
    with open(os.path.join(paged, INDEX)) as f:
        shards = json.load(f)["weight_map"]
    old = {n: load_file(os.path.join(paged, shards[n]))[n] for n in (EXPERT, down)}
    changed = edit_checkpoint(paged, str(tmp_path / "changed"), replace={EXPERT: -old[EXPERT], down: old[down] * 2})
    daemon = start_daemon(paged, expert_ranges=True, max_generations=4)
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    with ExpertClient(daemon.endpoint, heartbeat=False) as first, ExpertClient(daemon.endpoint, heartbeat=False) as c:
        grown = shm_bytes(namespace)
        reloaded = subprocess.run(expertd_cmd("reload", "--config", daemon.config, "--checkpoint", changed),
                                  capture_output=True, text=True, timeout=120)
        assert reloaded.returncode == 0, reloaded.stderr
        grown = shm_bytes(namespace) - grown
        status = daemon.status()
        part = old[EXPERT].numel() * 2
        assert status["job"]["bytes_written"] == 2 * part and status["job"]["tensors_written"] == 2, status["job"]
        assert grown <= 2 * part + os.path.getsize(f"/dev/shm{status['index_segment']}"), grown
        c.refresh()
        stacks = [t for t in c.index().tensors if t.name in (STACK, STACK.replace("gate_up", "down"))]
        assert len(stacks) == 2 and all(t.extents and len(t.extents) == 3 for t in stacks), stacks
        with torch.no_grad():
            want = AutoModelForCausalLM.from_pretrained(changed, dtype=torch.bfloat16).eval()
            params = dict(want.named_parameters())
            served = c.served_tensors()
            assert all(torch.equal(served[t.name], params[t.name]) for t in stacks)
            assert torch.equal(c.load_model()(ids).logits, want(ids).logits) and c.verify() == []
            before = AutoModelForCausalLM.from_pretrained(paged, dtype=torch.bfloat16).eval()
            assert torch.equal(first.load_model()(ids).logits, before(ids).logits)
            back = subprocess.run(expertd_cmd("reload", "--config", daemon.config, "--checkpoint", paged),
                                  capture_output=True, text=True, timeout=120)
            assert back.returncode == 0, back.stderr
            assert daemon.status()["job"]["bytes_written"] == 2 * part
            c.refresh()
            assert torch.equal(c.load_model()(ids).logits, before(ids).logits) and c.verify() == []


def test_a_derived_layout_of_a_stack_of_ranges_derives_only_the_changed_experts(paged, start_daemon, namespace):
    """A gather of the stack (each expert's block reversed: an engine's packing) made for generation 1; a push of one
    expert's part; the same gather of generation 2, asked while generation 1 is live (`leasing.pinned`, as an engine's
    refresh does), derives that expert's block only (shm grows by one block) and keeps the others' in generation 1's
    derived segment; it equals the gather of the new bytes, and stays right once generation 1 has retired (its
    derived segment kept while a range of it is used)."""
    from expertd import derived
    from expertd.leasing import pinned

    daemon = start_daemon(paged, expert_ranges=True, max_generations=2, revoke_after_s=0)
    with ExpertClient(daemon.endpoint, heartbeat=False) as c:
        stack = c.served_tensors()[STACK]
        block = stack[0].numel()
        index = torch.arange(block).flip(0)
        item = derived.request(STACK, derived.encode(index), block, tuple(stack.shape))
        (first,) = c.derived([item])
        assert torch.equal(first, stack.reshape(len(stack), -1)[:, index].reshape(stack.shape))
        part = c.tensors()[EXPERT].clone()
        c.update({EXPERT: -part})
        with pinned(c, 1):
            c.refresh()
            grown = shm_bytes(namespace)
            (second,) = c.derived([item])
            grown = shm_bytes(namespace) - grown
        new = c.served_tensors()[STACK]
        want = new.reshape(len(new), -1)[:, index].reshape(new.shape)
        assert torch.equal(second, want) and not torch.equal(second, first)
        assert grown == block * new.element_size(), (grown, block)  # expert 3's block, not the stack
        assert in_one_shared_range(second)
        del first
        wait_until(lambda: [g["generation"] for g in daemon.status()["generations"]] == [2], "generation 1 retires")
        with ExpertClient(daemon.endpoint, heartbeat=False) as fresh:
            (again,) = fresh.derived([item])
            assert torch.equal(again, want)


def test_a_push_into_several_stacks_writes_their_changed_parts_into_one_segment(paged, start_daemon, namespace):
    """Three parts of two stacks in one push: one new segment holds the three (a push is one file and one mapping per
    reader, however many stacks it changes); each stack's new ranges lie in it, every pushed tensor reads back."""
    daemon = start_daemon(paged, expert_ranges=True)
    names = [EXPERT, "model.layers.1.mlp.experts.6.gate_proj.weight", "model.layers.0.mlp.experts.1.down_proj.weight"]
    with ExpertClient(daemon.endpoint, heartbeat=False) as c:
        values = {n: -c.tensors()[n].clone() for n in names}
        before, first = set(glob.glob(f"/dev/shm/{namespace}.*")), {s.name for s in c.index().segments}
        c.update(values)
        c.refresh()
        made = set(glob.glob(f"/dev/shm/{namespace}.*")) - before - {f"/dev/shm{daemon.status()['index_segment']}"}
        assert len(made) == 1 and os.path.getsize(made.pop()) == sum(v.numel() * 2 for v in values.values()), made
        ranged = [t for t in c.index().tensors if t.extents]
        assert len(ranged) == 2 and len({x.segment for t in ranged for x in t.extents} - first) == 1, ranged
        assert all(torch.equal(c.tensors()[n], v) for n, v in values.items()) and c.verify() == []


def test_on_a_huge_page_tmpfs_a_changed_expert_is_its_own_huge_pages_and_the_view_maps_them(tmp_path, namespace):
    """`shm_dir` a tmpfs mounted huge=always (a private mount namespace), experts' parts of 2 MiB: a push of one part
    writes it as its own huge page and the stack's ranges stay on 2 MiB boundaries; the reader's view starts on one,
    is the daemon's shared pages (no copy), maps them by huge pages once read, and the logits are transformers'."""
    import json
    import shutil

    if os.geteuid() != 0 or shutil.which("unshare") is None:
        pytest.skip("mounting a huge-page tmpfs needs root and util-linux unshare (CI has both)")
    folder, huge = str(tmp_path / "ckpt"), tmp_path / "huge"
    generate_model_type(folder, "qwen3_moe", fp8=False, hidden_size=1024, moe_intermediate_size=1024)  # 2 MiB parts
    huge.mkdir()
    scenario = os.path.join(os.path.dirname(__file__), "helpers", "ranges_huge_scenario.py")
    script = (f"mount -t tmpfs -o size=512m,huge=always expertd-huge {huge} || exit 97; "
              f"exec {sys.executable} {scenario} {folder} {tmp_path} {namespace} {huge}")
    out = subprocess.run(["unshare", "-m", "sh", "-c", script], capture_output=True, text=True, timeout=600)
    if out.returncode == 97:
        pytest.skip(f"this kernel cannot mount a huge=always tmpfs: {out.stderr.strip()}")
    assert out.returncode == 0, out.stderr[-4000:]
    seen = json.loads(out.stdout.strip().splitlines()[-1])
    assert len(seen["extents"]) == 3 and all(o % (2 << 20) == 0 and n % (2 << 20) == 0 for _, o, n in seen["extents"])
    assert seen["equal"] and seen["shared"] and seen["aligned"], seen
    assert seen["huge_kb"] > 0, seen  # huge pages in the composed view (every range but a PTE-mapped edge)
    assert seen["logits_equal"] and seen["verify"] == [] and seen["stop"] == 0, seen


def test_a_model_refreshed_over_generations_of_ranges_computes_each_ones_logits(paged, start_daemon):
    """Four generations, each pushing another expert's part of layer 1's stacks: after each, `refresh(model)` (the
    same model object, its stacks' new views taking the unchanged ranges' page tables) gives logits torch.equal to
    transformers' own model with every change so far; a model still on generation 1 computes generation 1's."""
    from transformers import AutoModelForCausalLM

    daemon = start_daemon(paged, expert_ranges=True, max_generations=8)
    ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
    reference = AutoModelForCausalLM.from_pretrained(paged, dtype=torch.bfloat16).eval()
    params = dict(reference.named_parameters())
    with ExpertClient(daemon.endpoint, heartbeat=False) as c, ExpertClient(daemon.endpoint, heartbeat=False) as old, \
            torch.no_grad():
        model, first = c.load_model(), old.load_model()
        want_first = reference(ids).logits
        for g, (e, proj) in enumerate([(3, "up_proj"), (6, "gate_proj"), (1, "down_proj"), (3, "gate_proj")]):
            name = f"model.layers.1.mlp.experts.{e}.{proj}.weight"
            value = c.tensors()[name] * -2
            c.update({name: value})
            rebound = c.refresh(model)
            stack = "model.layers.1.mlp.experts." + ("down_proj" if proj == "down_proj" else "gate_up_proj")
            assert stack in rebound, rebound
            view = params[stack].data[e]
            if proj != "down_proj":
                half = view.shape[0] // 2
                view = view[:half] if proj == "gate_proj" else view[half:]
            view.copy_(value)
            assert torch.equal(model(ids).logits, reference(ids).logits), f"generation {g + 2}"
        assert torch.equal(first(ids).logits, want_first) and c.verify() == []
        assert sum(1 for t in c.index().tensors if t.extents) == 2
