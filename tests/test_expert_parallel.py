"""Expert parallelism beyond one host: each daemon serves only its EP ranks' experts, and workers run
transformers' own expert parallelism (DistributedConfig, torchrun, gloo) over views of their host's
shared memory. Real daemons, real torchrun workers, real tmpfs mounts per simulated host. The partition in
the plan, the index and the config, and workers under torchrun; two simulated hosts: test_expert_parallel_hosts.py;
pushing to a partitioned deployment: test_expert_parallel_push.py."""

from __future__ import annotations

import glob
import json
import os
import subprocess
import sys

import pytest
import torch

from expertd.errors import ConfigError
from expertd.index import TensorIndex
from expertd.partition import ExpertBlock, ExpertParallel, PartitionError
from expertd.server.daemon.config import config_from_dict
from expertd.server.load.loader import prepare
from helpers.daemon import expertd_cmd, write_config
from helpers.ep import EXPERT, HELPERS, experts_of, free_port, reports


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
    from expertd.server.load.filling import dequantized

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
        rows = torch.cat([dequantized(whole_ckpt, s) for s in by_name[t.name].sources])  # read expert by expert
        served = torch.cat([dequantized(ckpt, s) for s in t.sources])
        assert torch.equal(served, torch.cat([rows[quarter: 2 * quarter], rows[3 * quarter:]])), t.name
        read = sum(s.info.nbytes + (s.scale.nbytes if s.scale else 0) for s in t.sources)
        stored = sum(s.info.nbytes + (s.scale.nbytes if s.scale else 0) for s in by_name[t.name].sources)
        assert read * 2 == stored  # half the bytes read
    expert_bytes = sum(t.nbytes for t in stacks)
    assert part.nbytes == whole.nbytes - expert_bytes
    assert [t.name for t in part.tensors if t.experts is None] == [t.name for t in whole.tensors
                                                                    if t.name not in {s.name for s in stacks}]
    whole_ckpt.close()
    ckpt.close()


def test_unused_expert_tensors_are_partitioned_too():
    """Tensors the model does not use (DeepSeek-V3's MTP layer) are served by checkpoint name: of a partition,
    only its ranks' experts; a layer whose experts do not divide into the size is served whole."""
    from expertd.server.load.layout import unused_share

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


def test_expert_block_rows():
    block = ExpertBlock(8, ((2, 2), (6, 2)))
    assert block.experts() == [2, 3, 6, 7] and block.count == 4
    assert block.rows_of(2, 2) == 0 and block.rows_of(6, 2) == 2 and block.rows_of(3, 1) == 1
    assert block.rows_of(0, 2) is None and block.rows_of(3, 2) is None  # 4 is not served
    whole = ExpertBlock(8, ((0, 4), (4, 4)))
    assert whole.rows_of(0, 8) == 0 and whole.rows_of(2, 4) == 2  # consecutive ranges hold any run

# --- workers under torchrun --------------------------------------------------------------------

def torchrun(out, reference: str, namespace: str, endpoint: str, nproc: int = 2,
             *extra: str) -> subprocess.CompletedProcess:
    cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(nproc), "--master_addr", "127.0.0.1",
           "--master_port", str(free_port()), os.path.join(HELPERS, "ep_worker.py"), str(out), reference, namespace,
           *extra]
    # TMPDIR: torchrun's own torchelastic_* log folders go with the test's folder, not into /tmp
    env = {**os.environ, "EXPERTD_ENDPOINT": endpoint, "OMP_NUM_THREADS": "1", "TMPDIR": str(out)}
    return subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=600)



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
