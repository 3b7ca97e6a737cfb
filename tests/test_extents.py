"""A changed expert costs its own bytes (issue 39, the Python client's part): a push that changes some experts of a
stack writes those experts only, the new generation's stack is the older segments' ranges with theirs replaced
(index schema 3), and a reader maps the ranges as one contiguous read-only view (the views themselves:
tests/test_extents_views.py). Real daemon, real shm segments."""

from __future__ import annotations

import glob
import json
import os
import subprocess

import pytest
import torch

from expertd.client import ExpertClient
from expertd.index import tensor_checksum
from expertd.tools.generate import generate_model_type
from helpers.daemon import expertd_cmd
from helpers.derived_cases import in_shared_memory
from helpers.polling import wait_until

STACK = "model.layers.1.mlp.experts.gate_up_proj"  # [E, 2I, H]: parts gate and up of each expert
EXPERT = "model.layers.1.mlp.experts.3.up_proj.weight"  # one part of it: I x H bf16 = 64 KiB
OSS_STACK = "model.layers.1.mlp.experts.gate_up_proj"  # gpt-oss: [E, H, 2I], stored fused


@pytest.fixture(scope="module")
def paged(tmp_path_factory) -> str:
    """A Qwen3-MoE bf16 checkpoint whose experts' parts are whole pages (I x H x 2 bytes = 64 KiB)."""
    folder = str(tmp_path_factory.mktemp("paged") / "qwen3_moe")
    generate_model_type(folder, "qwen3_moe", fp8=False, hidden_size=256, moe_intermediate_size=128)
    return folder


def shm_bytes(namespace: str) -> int:
    return sum(os.path.getsize(p) for p in glob.glob(f"/dev/shm/{namespace}.*"))


def test_a_push_of_one_expert_writes_that_expert_and_readers_see_each_generation(paged, start_daemon, namespace):
    """`expert_ranges` as configured by default."""
    daemon = start_daemon(paged, max_generations=4)
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
        assert in_shared_memory(served[STACK], "/dev/shm")
        assert all(torch.equal(served[n], before[n]) for n in before if n != STACK)
        assert torch.equal(c.tensors()[EXPERT], -part)
        assert c.verify() == [] and tensor_checksum(served[STACK], len(entry.sources)) == entry.checksum
        rows = {g["generation"]: g for g in daemon.status()["generations"]}  # 1 shares all but the pushed part
        assert rows[1]["bytes_shared_with_latest"] == rows[1]["bytes"] - part.numel() * part.element_size(), rows
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


def test_with_expert_ranges_off_a_push_of_one_expert_writes_the_stack_whole(paged, start_daemon, namespace):
    daemon = start_daemon(paged, expert_ranges=False)
    with ExpertClient(daemon.endpoint, heartbeat=False) as c, ExpertClient(daemon.endpoint, heartbeat=False):
        part = c.tensors()[EXPERT].clone()
        c.update({EXPERT: -part})
        c.refresh()
        (entry,) = [t for t in c.index().tensors if t.name == STACK]
        assert entry.extents is None and c.index().to_dict()["schema"] == 2 and torch.equal(c.tensors()[EXPERT], -part)
        rows = {g["generation"]: g for g in daemon.status()["generations"]}
        assert rows[1]["bytes_shared_with_latest"] == rows[1]["bytes"] - entry.nbytes, rows


def test_a_stack_whose_parts_are_not_whole_pages_is_written_whole(tiny_checkpoint, start_daemon, namespace, tmp_path):
    with open(tmp_path / "daemon.log", "w") as log:
        daemon = start_daemon(tiny_checkpoint, expert_ranges=True, stderr=log)
    with ExpertClient(daemon.endpoint, heartbeat=False) as c:
        stacks = [t for t in c.index().tensors if len(t.sources) > 1][:2]
        values = {t.name: c.served_tensors()[t.name].clone() for t in stacks}
        for value in values.values():
            value[0] = value[0] * 2
        c.update(values)
        c.refresh()
        for t in c.index().tensors:
            if t.name in values:
                assert t.extents is None and torch.equal(c.served_tensors()[t.name], values[t.name])
    said = [line for line in (tmp_path / "daemon.log").read_text().splitlines() if "not whole pages" in line]
    assert len(said) == 1 and stacks[0].name in said[0] and "2 changed expert stack(s)" in said[0], said


def test_a_successor_adopts_a_generation_of_ranges(paged, start_daemon, namespace):
    """kill -9 after a push that wrote one expert: the next daemon adopts generation 2, its stack still the ranges
    of both generations' segments (each verified range by range), the same bytes; its own push into the stack then
    sums it right, from the parts' checksums it verified at adoption: a part changed behind its back after that is
    not laundered into the new generation's checksum (verify names the stack until the byte is put back)."""
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
        first_range = adopted.extents[0]  # expert 0's gate lies here, in generation 1's segment: not pushed below
        with open(f"/dev/shm{first_range.segment}", "r+b") as f:
            f.seek(first_range.offset)
            byte = f.read(1)
            f.seek(first_range.offset)
            f.write(bytes([byte[0] ^ 0xFF]))
        try:
            c.update({EXPERT: part * 3})
            c.refresh()
            assert torch.equal(c.tensors()[EXPERT], part * 3) and c.verify() == [STACK]
        finally:
            with open(f"/dev/shm{first_range.segment}", "r+b") as f:
                f.seek(first_range.offset)
                f.write(byte)
        assert c.verify() == []


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
    derived segment kept while a range of it is used, and counted by the quota)."""
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
        assert in_shared_memory(second, "/dev/shm")
        del first
        wait_until(lambda: [g["generation"] for g in daemon.status()["generations"]] == [2], "generation 1 retires")
        # generation 1's layout, kept alive by generation 2's ranges, still counts against the derived quota
        assert daemon.status()["derived"]["bytes"] == stack.nbytes + grown
        with ExpertClient(daemon.endpoint, heartbeat=False) as fresh:
            (again,) = fresh.derived([item])
            assert torch.equal(again, want)


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> str:
    """gpt-oss as released (MXFP4 blocks and scales, each layer's experts fused [E, ...]), experts of whole pages."""
    from expertd.tools.requantize import write_mxfp4

    folder = str(tmp_path_factory.mktemp("gpt_oss") / "mxfp4")
    generate_model_type(folder, "gpt_oss", fp8=False, hidden_size=256, intermediate_size=128)  # 128 KiB experts
    write_mxfp4(folder)
    return folder


def test_a_push_of_one_gpt_oss_expert_writes_that_expert(gpt_oss, start_daemon, namespace):
    """One source per gpt-oss stack, so the stack's parts are its experts. A push that changes expert 2 of a gate/up
    stack writes that expert's 128 KiB; the logits are transformers' own MXFP4 load with that expert changed."""
    from transformers import AutoModelForCausalLM

    daemon = start_daemon(gpt_oss)
    with ExpertClient(daemon.endpoint, heartbeat=False) as c:
        value = c.served_tensors()[OSS_STACK].clone()
        value[2] = -value[2]
        grown = shm_bytes(namespace)
        c.update({OSS_STACK: value})
        c.refresh()
        grown = shm_bytes(namespace) - grown
        (entry,) = [t for t in c.index().tensors if t.name == OSS_STACK]
        assert entry.sources == [OSS_STACK] and len(entry.extents) == 3 and entry.checksum.startswith("xxh3_64x8:")
        assert grown <= value[2].numel() * 2 + os.path.getsize(f"/dev/shm{daemon.status()['index_segment']}"), grown
        assert torch.equal(c.served_tensors()[OSS_STACK], value) and c.verify() == []
        reference = AutoModelForCausalLM.from_pretrained(gpt_oss, dtype=torch.bfloat16).eval()
        ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
        with torch.no_grad():
            dict(reference.named_parameters())[OSS_STACK].data[2] = value[2]
            assert torch.equal(c.load_model()(ids).logits, reference(ids).logits)


def test_a_reload_onto_a_gpt_oss_checkpoint_with_one_expert_changed_writes_that_expert(gpt_oss, start_daemon,
                                                                                      tmp_path):
    """The checkpoint's fused MXFP4 blocks differ in expert 5's rows only: the reload reads and writes that expert
    (the stack is read expert by expert); served bytes and logits are transformers' own MXFP4 load of the new folder."""
    from safetensors.torch import load_file
    from transformers import AutoModelForCausalLM

    from helpers.checkpoints import INDEX, edit_checkpoint

    blocks = OSS_STACK + "_blocks"
    with open(os.path.join(gpt_oss, INDEX)) as f:
        stored = load_file(os.path.join(gpt_oss, json.load(f)["weight_map"][blocks]))[blocks]
    new = stored.clone()
    new[5] = new[5] ^ 0x11
    changed = edit_checkpoint(gpt_oss, str(tmp_path / "changed"), replace={blocks: new})
    daemon = start_daemon(gpt_oss)
    with ExpertClient(daemon.endpoint, heartbeat=False) as c:
        part = c.served_tensors()[OSS_STACK][5].numel() * 2
        reloaded = subprocess.run(expertd_cmd("reload", "--config", daemon.config, "--checkpoint", changed),
                                  capture_output=True, text=True, timeout=120)
        assert reloaded.returncode == 0, reloaded.stderr
        job = daemon.status()["job"]
        assert job["bytes_written"] == part and job["tensors_written"] == 1, job
        c.refresh()
        (entry,) = [t for t in c.index().tensors if t.name == OSS_STACK]
        assert len(entry.extents) == 3 and c.verify() == []
        want = AutoModelForCausalLM.from_pretrained(changed, dtype=torch.bfloat16).eval()
        ids = torch.tensor([[1, 5, 9, 2, 7, 3]])
        with torch.no_grad():
            assert torch.equal(c.served_tensors()[OSS_STACK], dict(want.named_parameters())[OSS_STACK])
            assert torch.equal(c.load_model()(ids).logits, want(ids).logits)


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
