"""Zero copy whatever transformers the daemon and the worker run: the newest release a fresh install resolves,
4.57 (per-expert modules) and the release before the newest (5.23, whose DeepSeek-V3 loads routers in bf16
where 5.24 keeps them in float32), daemon and worker in real virtualenvs, real shared memory.

Every worker's logits are `torch.equal` to its own `from_pretrained(dtype=bfloat16)` of the bf16 reference,
its dtypes are that load's, and every parameter and loaded buffer lies in a read-only shared mapping: a
tensor the worker's release loads in another dtype than the daemon serves is the daemon's dtype cast,
cast once per host.
"""

from __future__ import annotations

import os
import subprocess
import sys
import time

import pytest

from expertd import messages
from expertd.protocol import PROTOCOL_VERSION
from expertd.connection import Connection
from expertd.errors import GenerationGone, DerivedRejected
from expertd.tools.generate import generate, generate_model_type
from helpers.releases import ReleaseWorker, check_report, with_released_keys
from helpers.reference import write_reference_bf16

def released_qwen3_moe(folder: str) -> None:
    generate_model_type(folder, "qwen3_moe")
    with_released_keys(folder)


FAMILIES = {
    "deepseek_v3": lambda folder: generate(folder, preset="tiny", seed=0, shards=3),
    "deepseek_v3_counts": lambda folder: generate(folder, preset="dsv3-counts", seed=0, shards=8),
    "qwen3_moe": released_qwen3_moe,
    "gpt_oss": lambda folder: generate_model_type(folder, "gpt_oss"),
}
ROUTERS = {"deepseek_v3", "deepseek_v3_counts"}  # where 5.23 / 4.57 and 5.24 disagree on a dtype


@pytest.fixture(scope="module", params=sorted(FAMILIES))
def family(request, tmp_path_factory):
    """(family, checkpoint, its bf16 reference), made once per module."""
    root = tmp_path_factory.mktemp(request.param)
    checkpoint = str(root / "ckpt")
    FAMILIES[request.param](checkpoint)
    return request.param, checkpoint, write_reference_bf16(checkpoint, str(root / "bf16"))


@pytest.fixture(scope="module")
def release_workers(tf4_python, tf_previous_python, tmp_path_factory) -> dict[str, ReleaseWorker]:
    """Worker processes that attach to each family's daemon in turn: this environment's release (the newest), 4.57,
    and the release before twice."""
    pythons = {"newest": sys.executable, "4.57": tf4_python, "previous": tf_previous_python,
               "previous2": tf_previous_python}
    workers = {name: ReleaseWorker(python, tmp_path_factory.mktemp(f"worker-{name}"))
               for name, python in pythons.items()}
    yield workers
    for worker in workers.values():
        worker.close()


def run_together(workers: list[ReleaseWorker], endpoint: str, reference: str) -> list[dict]:
    """Each worker's report, their jobs started before any is waited for (they attach together)."""
    for worker in workers:
        worker.send(endpoint, reference)
    return [worker.receive() for worker in workers]


def cast_lines(report: dict) -> list[str]:
    return [line for line in report["log"] if "dtype casts" in line or "private copies" in line]


def test_newest_daemon_serves_every_release(family, release_workers, start_daemon):
    name, checkpoint, reference = family
    import transformers

    daemon = start_daemon(checkpoint)
    # four workers at once: this environment's release (the newest), 4.57, and the release before twice
    newest, old4, previous, previous2 = run_together(list(release_workers.values()), daemon.endpoint, reference)
    check_report(newest, transformers.__version__)
    check_report(old4, "4.57")
    check_report(previous, "5.23")
    check_report(previous2, "5.23")
    assert cast_lines(newest) == []  # the daemon serves what this release loads: nothing to cast
    derived = daemon.status()["generations"][0]["derived"]["tensors"]
    if name in ROUTERS:
        # 5.24 keeps the routers in float32, the others load them in bf16: each asked for bf16 derived tensors, in one
        # line per attach, and the daemon cast each router once for all of them
        for report in (old4, previous, previous2):
            (line,) = cast_lines(report)
            assert "dtype casts the daemon cast once" in line and "gate.weight" in line, line
        # (4.57 also loads the e_score_correction_bias 5.x keeps in float32 as bf16)
        assert {v["name"].rsplit(".mlp.", 1)[1] for v in derived} == {"gate.weight", "gate.e_score_correction_bias"}
        assert {(v["served_dtype"], v["dtype"]) for v in derived} == {("torch.float32", "torch.bfloat16")}
        assert len({v["name"] for v in derived}) == len(derived)  # once per host, whichever worker asked first


def test_previous_daemon_serves_the_newest_worker(family, tf_previous_python, release_workers, start_daemon):
    name, checkpoint, reference = family
    import transformers

    daemon = start_daemon(checkpoint, python=tf_previous_python)
    report = release_workers["newest"].run(daemon.endpoint, reference)
    check_report(report, transformers.__version__)
    if name in ROUTERS:  # 5.23 serves routers in bf16; this release wants float32: derived tensors, not copies
        (line,) = cast_lines(report)
        assert "float32" not in line.split("served as")[0] and "_keep_in_fp32_modules_strict" in line, line
        derived = daemon.status()["generations"][0]["derived"]["tensors"]
        assert derived and {(v["served_dtype"], v["dtype"]) for v in derived} == {("torch.bfloat16", "torch.float32")}


def _lease(conn: Connection) -> str:
    return conn.send(messages.Lease(pid=os.getpid(), protocol=PROTOCOL_VERSION), messages.LeaseReply).client


def test_derived_refusals_and_lifetime(tiny_checkpoint, start_daemon, namespace):
    daemon = start_daemon(tiny_checkpoint)
    conn = Connection(daemon.endpoint, timeout=60)
    try:
        lease = _lease(conn)
        def ask(tensors, **kw):
            items = [messages.CastItem(**t) for t in tensors]
            return conn.send(messages.Cast(client=lease, tensors=items, **kw), messages.DerivedReply)

        with pytest.raises(DerivedRejected, match=r"no tensor 'model.nope.weight' in generation 1.*'torch.float32'"):
            ask([{"name": "model.nope.weight", "dtype": "torch.float32"}])
        with pytest.raises(DerivedRejected, match=r"'torch.int8' asked for 'model.norm.weight' is not a float type"):
            ask([{"name": "model.norm.weight", "dtype": "torch.int8"}])
        assert daemon.status()["generations"][0]["derived"]["tensors"] == []  # a refused request makes nothing

        reply = ask([{"name": "model.norm.weight", "dtype": "torch.float16"}])
        (entry,) = reply.tensors
        assert entry["dtype"] == "torch.float16" and entry["served_dtype"] == "torch.bfloat16"
        path = f"/dev/shm{entry['segment']}"
        assert os.path.exists(path) and oct(os.stat(path).st_mode & 0o777) == "0o600"
        assert ask([{"name": "model.norm.weight", "dtype": "torch.float16"}]).tensors == [entry]  # made once
        (listed,) = daemon.status()["generations"][0]["derived"]["tensors"]
        assert listed["segment"] == entry["segment"]
        text = subprocess.run([sys.executable, "-m", "expertd.server.cli", "status", "--endpoint", daemon.endpoint],
                              capture_output=True, text=True, timeout=120).stdout
        assert "derived  1 tensor(s), 640 bytes (bfloat16 -> float16)" in text, text

        only1 = ask([{"name": "model.layers.1.mlp.gate.weight", "dtype": "torch.bfloat16"}]).tensors[0]
        conn.send(messages.Reload())  # generation 2 (the same checkpoint: every tensor shared with 1)
        for _ in range(600):
            if daemon.status()["generation"] == 2 and daemon.status()["state"] == "serving":
                break
            time.sleep(0.1)
        # a derived tensor asked while both live is generation 1's cast, reused (the same bytes), not a second one
        assert ask([{"name": "model.norm.weight", "dtype": "torch.float16"}], generation=2).tensors == [entry]
        conn.send(messages.Refresh(client=lease), messages.IndexSegmentReply)  # generation 1 retires
        with pytest.raises(GenerationGone, match="generation 1 is not served any more"):
            ask([{"name": "model.norm.weight", "dtype": "torch.float16"}], generation=1)
        assert os.path.exists(path)  # generation 2 uses it too
        assert not os.path.exists(f"/dev/shm{only1['segment']}")  # generation 1's alone: freed as it retired
        ask([{"name": "model.layers.0.input_layernorm.weight", "dtype": "torch.float32"}], generation=2)
        (gen2,) = daemon.status()["generations"]
        assert {v["name"] for v in gen2["derived"]["tensors"]} == {"model.norm.weight",
                                                                  "model.layers.0.input_layernorm.weight"}
    finally:
        conn.close()
    assert daemon.stop() == 0
    assert not os.path.exists(path)  # freed with the generation
