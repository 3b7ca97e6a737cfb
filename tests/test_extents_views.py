"""A tensor of ranges is one read-only view (issue 39, the Python client's composing): extents in the index (schema
3), their pages mapped again into one reserved range with no copy, a newer view of a stack taking the unchanged ranges'
page tables, a write refused by the kernel, and on a huge-page tmpfs a view of 2 MiB ranges mapped by huge pages.
The daemon's side (pushes and reloads that write only changed experts): tests/test_extents.py."""

from __future__ import annotations

import mmap
import os
import subprocess
import sys

import pytest
import torch

from expertd.client.residency import shared_ranges
from expertd.errors import ProtocolError
from expertd.extents import Extent, cut, merge
from expertd.index import SegmentEntry, TensorEntry, TensorIndex, derive_views
from expertd.shm import map_segments, view
from expertd.tools.generate import generate_model_type
from helpers.derived_cases import in_shared_memory

PAGE = mmap.PAGESIZE


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
        assert in_shared_memory(t, "/dev/shm")  # the daemon's pages, mapped as one range: no copy
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
        assert torch.equal(old, want_old) and in_shared_memory(new, "/dev/shm") and in_shared_memory(old, "/dev/shm")
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

