"""Expert parallelism beyond one host: each daemon serves only its EP ranks' experts, and workers run
transformers' own expert parallelism (DistributedConfig, torchrun, gloo) over views of their host's
shared memory. Real daemons, real torchrun workers, real tmpfs mounts per simulated host."""

from __future__ import annotations

import glob
import json
import os
import shutil
import socket
import subprocess
import sys

import pytest
import torch

from expertd.errors import ConfigError
from expertd.index import TensorIndex
from expertd.partition import ExpertBlock, ExpertParallel, PartitionError
from expertd.server.config import config_from_dict
from expertd.server.loader import prepare
from expertd.server.tools.generate import generate, generate_model_type
from helpers.checkpoints import edit_checkpoint
from helpers.daemon import expertd_cmd, write_config
from helpers.reference import write_reference_bf16

HELPERS = os.path.join(os.path.dirname(__file__), "helpers")
EXPERT = "model.layers.1.mlp.experts."


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def dsv3(tmp_path_factory) -> tuple[str, str]:
    """The tiny DeepSeek-V3 FP8 checkpoint (its published config at tiny dims, MTP layer included) and its
    reference-dequantized bf16 twin."""
    root = tmp_path_factory.mktemp("ep-dsv3")
    folder = str(root / "fp8")
    generate(folder, preset="tiny", seed=3, shards=3)
    return folder, write_reference_bf16(folder, str(root / "bf16"))


@pytest.fixture(scope="module")
def qwen3(tmp_path_factory) -> tuple[str, str]:
    root = tmp_path_factory.mktemp("ep-qwen3")
    folder = str(root / "fp8")
    generate_model_type(folder, "qwen3_moe")
    return folder, write_reference_bf16(folder, str(root / "bf16"))


@pytest.fixture(scope="module")
def gpt_oss(tmp_path_factory) -> tuple[str, str]:
    """A tiny gpt-oss checkpoint as released (MXFP4 blocks and scales, expert stacks pre-fused [E, ...] in the
    checkpoint) and its bf16 reference."""
    from expertd.server.tools.requantize import write_mxfp4

    root = tmp_path_factory.mktemp("ep-gpt-oss")
    folder = str(root / "mxfp4")
    generate_model_type(folder, "gpt_oss", fp8=False)
    write_mxfp4(folder)
    return folder, write_reference_bf16(folder, str(root / "bf16"))


def experts_of(folder: str) -> int:
    with open(os.path.join(folder, "config.json")) as f:
        config = json.load(f)
    return config.get("n_routed_experts") or config.get("num_experts") or config["num_local_experts"]


# --- the partition in the plan, the index and the config ------------------------------------------

def test_plan_serves_dense_tensors_and_only_its_ranks_experts(dsv3):
    folder, _ = dsv3
    _, whole = prepare(folder)
    ckpt, part = prepare(folder, ExpertParallel(4, (1, 3)))
    total = experts_of(folder)
    by_name = {t.name: t for t in whole.tensors}
    fused = [t for t in part.tensors if t.experts is not None]
    assert fused and all(t.experts == ExpertBlock(total, ((total // 4, total // 4), (3 * total // 4, total // 4)))
                         for t in fused)
    for t in fused:  # half the experts, back to back in rank order, their checkpoint tensors as the only sources
        assert t.shape == (total // 2, *by_name[t.name].shape[1:])
        served = [int(s.name[len(EXPERT):].split(".")[0]) for s in t.sources if s.name.startswith(EXPERT)]
        assert not served or served == sorted(served) and {e // (total // 4) for e in served} == {1, 3}
    dense = [t for t in whole.tensors if ".experts." not in t.name]
    assert {t.name for t in dense} <= {t.name for t in part.tensors}
    expert_bytes = sum(t.nbytes for t in whole.tensors if ".experts." in t.name)
    assert part.nbytes == whole.nbytes - expert_bytes // 2
    ckpt.close()


def test_pre_fused_expert_stacks_serve_only_their_ranks_rows(gpt_oss):
    """gpt-oss stores each layer's experts as one [E, ...] tensor (MXFP4 blocks, scales, biases): a partitioned
    daemon reads only its ranks' rows of them, and serves exactly those rows of what the whole stack decodes to."""
    from expertd.server.filling import dequantized

    folder, _ = gpt_oss
    whole_ckpt, whole = prepare(folder)
    ckpt, part = prepare(folder, ExpertParallel(4, (1, 3)))
    total = experts_of(folder)
    quarter = total // 4
    by_name = {t.name: t for t in whole.tensors}
    stacks = [t for t in part.tensors if t.experts is not None]
    assert {t.name.rsplit(".", 1)[-1] for t in stacks} == {"gate_up_proj", "gate_up_proj_bias", "down_proj",
                                                           "down_proj_bias"}
    for t in stacks:
        assert t.experts == ExpertBlock(total, ((quarter, quarter), (3 * quarter, quarter)))
        assert t.shape == (total // 2, *by_name[t.name].shape[1:]) and t.source_names == by_name[t.name].source_names
        rows = dequantized(whole_ckpt, by_name[t.name].sources[0])
        served = torch.cat([dequantized(ckpt, s) for s in t.sources])
        assert torch.equal(served, torch.cat([rows[quarter: 2 * quarter], rows[3 * quarter:]])), t.name
        read = sum(s.info.nbytes + (s.scale.nbytes if s.scale else 0) for s in t.sources)
        stored = by_name[t.name].sources[0]
        assert read * 2 == stored.info.nbytes + (stored.scale.nbytes if stored.scale else 0)  # half the bytes read
    expert_bytes = sum(t.nbytes for t in stacks)
    assert part.nbytes == whole.nbytes - expert_bytes
    assert [t.name for t in part.tensors if t.experts is None] == [t.name for t in whole.tensors
                                                                    if t.name not in {s.name for s in stacks}]
    whole_ckpt.close()
    ckpt.close()


def test_unused_expert_tensors_are_partitioned_too():
    """Tensors the model does not use (DeepSeek-V3's MTP layer) are served by checkpoint name: of a partition,
    only its ranks' experts; a layer whose experts do not divide into the size is served whole."""
    from expertd.server.layout import unused_share

    mtp = [f"model.layers.61.mlp.experts.{e}.{p}.weight" for e in range(8) for p in ("gate_proj", "down_proj")]
    odd = [f"model.layers.62.mlp.experts.{e}.down_proj.weight" for e in range(3)]
    other = ["model.layers.61.enorm.weight", "model.layers.61.eh_proj.weight"]
    kept = unused_share(mtp + odd + other, ExpertParallel(4, (1, 3)))
    assert kept == [n for n in mtp if int(n.split(".")[5]) in (2, 3, 6, 7)] + odd + other


def test_index_records_the_partition_and_expert_blocks(dsv3, start_daemon, namespace):
    folder, _ = dsv3
    d = start_daemon(folder, expert_parallel={"size": 2, "ranks": [1]})
    status = d.status()
    total = experts_of(folder)
    assert status["expert_parallel"]["size"] == 2 and status["expert_parallel"]["ranks"] == [1]
    blocks = status["expert_parallel"]["experts"]
    assert blocks and all(b == {"total": total, "ranges": [[total // 2, total // 2]]} for b in blocks.values())
    with open(os.path.join(os.path.dirname(d.endpoint[len("ipc://"):]), f"{namespace}.index.json")) as f:
        data = json.load(f)
    index = TensorIndex.from_dict(data)
    assert index.expert_parallel == ExpertParallel(2, (1,))
    blocks = [t for t in index.tensors if t.experts is not None]
    assert blocks and all(t.shape[0] == total // 2 and t.sources[0].startswith(t.name.rsplit("experts.", 1)[0])
                          for t in blocks)
    assert TensorIndex.from_dict(index.to_dict()).to_dict() == index.to_dict()
    text = subprocess.run(expertd_cmd("status", "--endpoint", d.endpoint), capture_output=True, text=True).stdout
    assert f"EP size 2, ranks [1]: experts [{total // 2}, {total}) of {total}" in text


@pytest.mark.parametrize("setting, message", [
    ({"size": 0}, "expert_parallel.size must be an integer >= 1"),
    ({"size": 4, "ranks": [4]}, "expert_parallel.ranks [4] out of range: ranks are 0 to 3 for size 4"),
    ({"size": 4, "ranks": [1, 1]}, "names a rank twice"),
    ({"ranks": [0]}, "must be a mapping with `size`"),
    ({"size": 2, "rank": [0]}, "must be a mapping with `size`"),
])
def test_bad_expert_parallel_settings_are_config_errors(tmp_path, setting, message):
    with pytest.raises(ConfigError, match="expert_parallel") as err:
        config_from_dict({"checkpoint": str(tmp_path), "expert_parallel": setting})
    assert message in str(err.value)


def test_size_that_does_not_divide_the_experts_exits_2_naming_the_valid_sizes(dsv3, tmp_path, namespace):
    folder, _ = dsv3
    config = write_config(tmp_path, folder, namespace, expert_parallel={"size": 3, "ranks": [0]})
    done = subprocess.run(expertd_cmd("start", "--config", config), capture_output=True, text=True, timeout=120)
    assert done.returncode == 2
    lines = done.stderr.strip().splitlines()
    assert len(lines) == 1 and "Traceback" not in done.stderr
    total = experts_of(folder)
    assert f"expert_parallel.size 3 does not divide the {total} experts" in lines[0]
    assert "valid sizes for this model: 1, 2, 4, 8" in lines[0]
    assert not glob.glob(f"/dev/shm/{namespace}*")


# --- workers under torchrun --------------------------------------------------------------------

def torchrun(out, reference: str, namespace: str, endpoint: str, nproc: int = 2, *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), os.path.join(HELPERS, "ep_worker.py"), str(out), reference, namespace, *extra]
    # TMPDIR: torchrun's own torchelastic_* log folders go with the test's folder, not into /tmp
    env = {**os.environ, "EXPERTD_ENDPOINT": endpoint, "OMP_NUM_THREADS": "1", "TMPDIR": str(out)}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)


def reports(out, ranks) -> list[dict]:
    return [json.load(open(os.path.join(out, f"rank{r}.json"))) for r in ranks]


@pytest.mark.parametrize("family, partition", [("dsv3", {"size": 2}), ("qwen3", {"size": 2}), ("dsv3", None),
                                               ("qwen3", {"size": 4, "ranks": [0, 1, 2, 3]}),
                                               ("gpt_oss", {"size": 2})])
def test_one_host_torchrun_logits_equal_transformers_ep(family, partition, request, start_daemon, namespace, tmp_path):
    """One daemon serving every expert (EP ranks of the workers' size, of another size, or no partition at all),
    two torchrun workers: logits torch.equal to from_pretrained of the bf16 reference with the same
    DistributedConfig, same DTensor placements, every local shard in shared memory."""
    folder, reference = request.getfixturevalue(family)
    d = start_daemon(folder, **({"expert_parallel": partition} if partition else {}))
    out = tmp_path / "out"
    out.mkdir()
    done = torchrun(out, reference, namespace, d.endpoint)
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for report in reports(out, (0, 1)):
        assert report["equal"], f"rank {report['rank']}: max |diff| {report['max_diff']}"
        assert report["placements"] == report["reference_placements"]
        experts = [n for n in report["placements"] if ".experts." in n]
        assert experts and all(report["placements"][n][1][0] == experts_of(folder) // 2 for n in experts)
        outside = [n for n, inside in report["shm"].items() if not inside]
        assert not outside, f"rank {report['rank']}: not views of shared memory: {outside}"


def test_worker_of_another_ep_size_or_unserved_rank_gets_a_typed_error(dsv3, start_daemon, namespace, tmp_path):
    folder, reference = dsv3
    d = start_daemon(folder, expert_parallel={"size": 2, "ranks": [1]})
    out = tmp_path / "out"
    out.mkdir()
    done = torchrun(out, reference, namespace, d.endpoint, 2, "--expect-error")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    r0, r1 = reports(out, (0, 1))
    assert r0["error"] == "PartitionError"
    assert "EP rank 0 of 2, which this host does not serve" in r0["message"] and d.endpoint in r0["message"]
    assert "serves EP ranks [1] of EP size 2" in r0["message"]
    assert r1["error"] is None  # rank 1 is this daemon's
    # a worker of another ep_size (4 ranks of 1 expert... here: ep_size 1 = no EP) and plain load_model
    from expertd.client import ExpertClient

    with ExpertClient(d.endpoint) as client:
        with pytest.raises(PartitionError, match="the model is partitioned") as err:
            client.load_model()
        assert "DistributedConfig(ep_size=2" in str(err.value)


def test_worker_ep_size_differs_from_the_daemons(dsv3, start_daemon, namespace, tmp_path):
    """A daemon with part of the experts serves only workers of its EP size (one with all of them serves any)."""
    folder, reference = dsv3
    d = start_daemon(folder, expert_parallel={"size": 4, "ranks": [0, 1]})
    out = tmp_path / "out"
    out.mkdir()
    done = torchrun(out, reference, namespace, d.endpoint, 2, "--expect-error")
    assert done.returncode == 0, done.stdout[-3000:] + done.stderr[-3000:]
    for report in reports(out, (0, 1)):
        assert report["error"] == "PartitionError"
        assert "runs ep_size 2" in report["message"] and "serves EP ranks [0, 1] of EP size 4" in report["message"]


# --- two hosts on one machine --------------------------------------------------------------------

needs_root = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("unshare") is None,
                                reason="simulating hosts needs root (unshare --ipc --mount and a tmpfs mount)")


def changed_experts(folder: str, dst: str) -> str:
    """A copy of an FP8 checkpoint with one expert changed in each half of layer 1 (its FP8 rows reversed)."""
    total = experts_of(folder)
    names = [f"{EXPERT}{e}.{part}.weight" for e in (1, total - 2) for part in ("gate_proj", "down_proj")]
    return edit_checkpoint(folder, dst, replace={name: reversed_rows(folder, name) for name in names})


def reversed_rows(folder: str, name: str) -> torch.Tensor:
    from safetensors import safe_open

    with open(os.path.join(folder, "model.safetensors.index.json")) as f:
        shard = json.load(f)["weight_map"][name]
    with safe_open(os.path.join(folder, shard), framework="pt") as f:
        codes = f.get_tensor(name)
    return codes.view(torch.uint8).flip(0).view(codes.dtype)


@needs_root
def test_two_hosts_each_serve_half_and_workers_refresh_after_a_reload(dsv3, tmp_path):
    """Two `unshare --ipc --mount` hosts, each with a private /dev/shm and its own daemon (ranks [0] / [1]),
    `torchrun --nnodes 2` over loopback: logits equal transformers' EP; each host serves the dense tensors and
    its half of the experts and reads about its share of the expert bytes; a reload onto a checkpoint with
    experts changed in both halves reaches both hosts' workers through refresh()."""
    folder, reference = dsv3
    changed = changed_experts(folder, str(tmp_path / "changed"))
    changed_reference = write_reference_bf16(changed, str(tmp_path / "changed-bf16"))
    out = tmp_path / "out"
    out.mkdir()
    port = free_port()
    hosts = []
    for node in (0, 1):
        ns = f"ep{node}{os.getpid()}"
        config = write_config(tmp_path / f"host{node}", folder, ns, expert_parallel={"size": 2, "ranks": [node]},
                              load_threads=1)
        cmd = ["unshare", "--ipc", "--mount", "--fork", sys.executable, os.path.join(HELPERS, "ep_host.py"), config,
               str(node), "2", "1", str(port), str(out), reference, ns, "--reload", changed, changed_reference]
        hosts.append(subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                                      env={**os.environ, "PYTHONPATH": os.path.dirname(HELPERS)}))
    logs = [h.communicate(timeout=900)[0] for h in hosts]
    assert [h.returncode for h in hosts] == [0, 0], logs
    host = [json.load(open(out / f"host{n}.json")) for n in (0, 1)]
    for n, h in enumerate(host):
        assert h["torchrun"][0] == 0, h["torchrun"][1]
        assert h["reload"][0] == 0, h["reload"]
        assert h["daemon_exit"] == 0 and h["left_in_shm"] == [], h
    _, whole = prepare(folder)
    dense = sum(t.nbytes for t in whole.tensors if ".experts." not in t.name)
    experts = whole.nbytes - dense
    for n, h in enumerate(host):
        served = h["loaded"]["bytes"]["total"]
        assert served == dense + experts // 2, (n, served, dense, experts)
        assert h["loaded"]["expert_parallel"]["ranks"] == [n]
    # bytes read from the checkpoint per host: its plan's sources (scales twice: checked, then used), plus what
    # span reads of small neighbouring tensors take in between (at most 16 KiB per tensor)
    for n, h in enumerate(host):
        _, share = prepare(folder, ExpertParallel(2, (n,)))
        sources = [s for t in share.tensors for s in t.sources]
        expected = sum(s.info.nbytes + 2 * (s.scale.nbytes if s.scale else 0) for s in sources)
        read = h["loaded"]["job"]["bytes_read"]
        assert expected <= read <= expected + (16 << 10) * len(sources), (n, read, expected)
        assert read < 0.8 * sum(s.info.nbytes for t in whole.tensors for s in t.sources)
    for report in reports(out, (0, 1)):
        assert report["equal"] and report["refreshed_equal"], report
        assert report["placements"] == report["reference_placements"]
        assert report["refreshed_generation"] == report["generation"] + 1
        assert all(report["shm"].values()) and all(report["refreshed_shm"].values())
        assert any(".experts." in n for n in report["rebound"])  # this rank's changed expert block was rebound


# --- pushing weights to a partitioned deployment ---------------------------------------------------

TOKEN = "push-token-0123456789abcdef"


@pytest.fixture
def two_tcp_daemons(dsv3, tmp_path, namespace):
    """Two daemons on tcp://127.0.0.1 with an auth token, serving EP ranks [0] and [1] of 2."""
    from helpers.daemon import DaemonProcess

    folder, _ = dsv3
    started = []
    try:
        for rank in (0, 1):
            started.append(DaemonProcess.launch(tmp_path / f"host{rank}", folder, f"{namespace}h{rank}",
                                                endpoint=f"tcp://127.0.0.1:{free_port()}", auth_token=TOKEN,
                                                expert_parallel={"size": 2, "ranks": [rank]}))
        for d in started:
            d.wait_serving()
        yield started
    finally:
        for d in started:
            d.stop()


def served(d) -> dict[str, torch.Tensor]:
    from expertd.client import ExpertClient

    with ExpertClient(d.endpoint, token=TOKEN) as client:
        return {k: v.clone() for k, v in client.served_tensors().items()}


def test_push_all_over_tcp_gives_each_daemon_its_share(two_tcp_daemons, dsv3):
    """One call pushes a state dict to both hosts over tcp (bytes in ZeroMQ frames): dense tensors reach both,
    a whole fused expert block is cut into each daemon's rows, FP8 expert weights go with their scales to
    the daemon that serves them; both publish generation 2."""
    from expertd.client import push_all

    folder, _ = dsv3
    a, b = two_tcp_daemons
    before = [served(d) for d in (a, b)]
    total = experts_of(folder)
    fused = f"{EXPERT}down_proj"
    block = torch.randn(total, *before[0][fused].shape[1:]).to(torch.bfloat16)
    norm = torch.randn(before[0]["model.norm.weight"].shape).to(torch.bfloat16)
    done = push_all([a.endpoint, b.endpoint], {fused: block, "model.norm.weight": norm}, token=TOKEN)
    assert done == {a.endpoint: 2, b.endpoint: 2}
    after = [served(d) for d in (a, b)]
    half = total // 2
    assert torch.equal(after[0][fused], block[:half]) and torch.equal(after[1][fused], block[half:])
    assert all(torch.equal(s["model.norm.weight"], norm) for s in after)
    unchanged = [n for n in before[0] if n not in (fused, "model.norm.weight")]
    assert all(torch.equal(after[0][n], before[0][n]) for n in unchanged)
    for d in (a, b):
        status = d.status()
        assert status["generation"] == 2 and status["job"]["kind"] == "update"


def test_push_all_publishes_nowhere_when_one_daemon_refuses(two_tcp_daemons, dsv3):
    from expertd.client import push_all
    from expertd.errors import AuthError, DaemonError, UpdateRejected

    folder, _ = dsv3
    a, b = two_tcp_daemons
    total = experts_of(folder)
    norm = served(a)["model.norm.weight"]
    # a tensor nobody serves: refused before anything is staged
    nobody = f"{EXPERT}{total + 3}.down_proj.weight"
    with pytest.raises(UpdateRejected, match=f"served by none of .*{nobody}"):
        push_all([a.endpoint, b.endpoint], {"model.norm.weight": norm, nobody: torch.zeros(2, 2)}, token=TOKEN)
    # the second daemon refuses its share (a wrong shape for an expert only it serves) after the first staged
    theirs = f"{EXPERT}{total - 1}.down_proj.weight"
    with pytest.raises(UpdateRejected, match="does not match the served"):
        push_all([a.endpoint, b.endpoint], {"model.norm.weight": norm, theirs: torch.zeros(3, 3, dtype=torch.bfloat16)},
                 token=TOKEN)
    # a daemon that is not running
    from expertd.errors import DaemonNotRunning

    with pytest.raises(DaemonNotRunning):
        push_all([a.endpoint, "ipc:///tmp/expertd-no-such-daemon/expertd.sock"], {"model.norm.weight": norm}, token=TOKEN)
    # a wrong token
    with pytest.raises(DaemonError) as err:
        push_all([a.endpoint, b.endpoint], {"model.norm.weight": norm}, token="wrong-token-0123456789")
    assert err.value.kind == AuthError.__name__
    for d in (a, b):
        assert d.status()["generation"] == 1
    # nothing held or staged was left behind: the next push goes through at once
    assert push_all([a.endpoint, b.endpoint], {"model.norm.weight": norm * 2}, token=TOKEN) == {a.endpoint: 2, b.endpoint: 2}


def test_update_on_a_partitioned_daemon_names_every_tensor_it_does_not_serve(dsv3, start_daemon):
    from expertd.client import ExpertClient
    from expertd.errors import UpdateRejected

    folder, _ = dsv3
    d = start_daemon(folder, expert_parallel={"size": 2, "ranks": [0]})
    total = experts_of(folder)
    theirs = [f"{EXPERT}{e}.down_proj.weight" for e in (total - 2, total - 1)]
    with ExpertClient(d.endpoint) as client:
        mine = client.tensors()[f"{EXPERT}0.down_proj.weight"]
        with pytest.raises(UpdateRejected) as err:
            client.update({name: mine.clone() for name in theirs})
    message = str(err.value)
    assert all(repr(name) in message for name in theirs) and "EP ranks [0] of 2" in message
    assert d.status()["generation"] == 1


def test_a_partitioned_gpt_oss_daemon_serves_its_rows_and_takes_its_rows_of_a_push(gpt_oss, start_daemon):
    """A daemon serving EP rank 1 of 2 of gpt-oss: its expert stacks are the second half of each whole stack,
    bit for bit; push_all of whole MXFP4 blocks and scales (all experts) gives it its rows only."""
    from safetensors import safe_open

    from expertd.client import ExpertClient, push_all
    from expertd.server.filling import dequantized

    folder, _ = gpt_oss
    total = experts_of(folder)
    half = total // 2
    whole_ckpt, whole = prepare(folder)
    stacks = {t.name: dequantized(whole_ckpt, t.sources[0]) for t in whole.tensors if ".mlp.experts." in t.name}
    whole_ckpt.close()
    d = start_daemon(folder, expert_parallel={"size": 2, "ranks": [1]})
    with ExpertClient(d.endpoint) as client:
        served = client.served_tensors()
        entries = {e.name: e for e in client.index().tensors}
        for name, rows in stacks.items():
            assert entries[name].experts.to_dict() == {"total": total, "ranges": [[half, half]]}
            assert torch.equal(served[name], rows[half:]), name
        assert client.verify() == []
    name = "model.layers.0.mlp.experts.down_proj"
    shard = next(f for f in glob.glob(os.path.join(folder, "*.safetensors"))
                 if name + "_blocks" in safe_open(f, framework="pt").keys())
    with safe_open(shard, framework="pt") as f:
        blocks, scales = f.get_tensor(name + "_blocks"), f.get_tensor(name + "_scales")
    pushed = torch.flip(blocks, dims=[0]).contiguous()  # expert e gets expert E-1-e's codes
    flipped_scales = torch.flip(scales, dims=[0]).contiguous()
    assert push_all([d.endpoint], {name + "_blocks": pushed, name + "_scales": flipped_scales}) == {d.endpoint: 2}
    with ExpertClient(d.endpoint) as client:
        assert client.index().generation == 2
        assert torch.equal(client.served_tensors()[name], torch.flip(stacks[name], dims=[0])[half:])


def test_expert_block_rows():
    block = ExpertBlock(8, ((2, 2), (6, 2)))
    assert block.experts() == [2, 3, 6, 7] and block.count == 4
    assert block.rows_of(2, 2) == 0 and block.rows_of(6, 2) == 2 and block.rows_of(3, 1) == 1
    assert block.rows_of(0, 2) is None and block.rows_of(3, 2) is None  # 4 is not served
    whole = ExpertBlock(8, ((0, 4), (4, 4)))
    assert whole.rows_of(0, 8) == 0 and whole.rows_of(2, 4) == 2  # consecutive ranges hold any run


def test_a_held_update_publishes_only_on_publish_and_goes_on_abort_or_when_its_lease_ends(dsv3, start_daemon):
    """The two-phase commit push_all relies on: built with `hold`, nothing is published until `publish`;
    `abort` (or the updater's lease ending) drops the built generation and the daemon takes the next update."""
    import time

    from expertd.client import ExpertClient
    from expertd import messages
    from expertd.client.push import _stage, _wait
    from expertd.connection import Connection
    from expertd.protocol import PROTOCOL_VERSION

    folder, _ = dsv3
    d = start_daemon(folder)
    with ExpertClient(d.endpoint) as client:
        norm = client.tensors()["model.norm.weight"].clone()
    conn = Connection(d.endpoint, 10)
    try:
        lease = conn.request("lease", pid=os.getpid(), protocol=PROTOCOL_VERSION)["client"]

        def held(value, latest):
            staging, sums = _stage(conn, lease, {"model.norm.weight": torch.full_like(norm, value)})
            job = conn.send(messages.Commit(client=lease, update=staging.update, checksums=sums, hold=True),
                            messages.JobReply)
            job = _wait(conn, job, 30, until=("building",))
            assert job.state == "built" and job.hold
            time.sleep(0.3)  # a few turns of the loop: a held build is not published
            assert d.status()["generation"] == latest
            return staging, job

        staging, job = held(2.0, latest=1)
        assert conn.request("abort", client=lease, update=staging.update)["ok"]
        assert conn.request("job", job=job.job)["error"] == "Aborted" and d.status()["generation"] == 1
        staging, job = held(3.0, latest=1)
        conn.request("publish", client=lease, job=job.job)
        assert _wait(conn, job, 30).state == "published" and d.status()["generation"] == 2
        staging, job = held(4.0, latest=2)
        conn.request("release", client=lease)  # the updater goes away: its held build goes with its lease
        deadline = time.monotonic() + 10
        while conn.request("job", job=job.job)["state"] != "failed" and time.monotonic() < deadline:
            time.sleep(0.05)
        assert conn.request("job", job=job.job)["error"] == "Aborted" and d.status()["generation"] == 2
    finally:
        conn.close()
    with ExpertClient(d.endpoint) as client:
        assert torch.equal(client.tensors()["model.norm.weight"], torch.full_like(norm, 3.0))
        assert client.update({"model.norm.weight": norm}) == 3  # nothing held or staged is in the way
