"""A whole daemon life on a huge-page `shm_dir`, run inside the test's private mount namespace.

Usage: shm_dir_scenario.py CHECKPOINT WORK NAMESPACE SHM_DIR SMALL_DIR

SHM_DIR is a tmpfs mounted huge=always (or a hugetlbfs mount) and SMALL_DIR one too small for the
model; both exist only in this mount namespace, so everything that uses them runs here: a reference
daemon on /dev/shm, a daemon on SHM_DIR with a real worker, `expertd verify` and `status`, an update
(staging segment, retirement), a SIGKILL and the successor that adopts, and a start on SMALL_DIR.
Prints one JSON line of what it saw; the test asserts on it. Logits go to WORK/*/logits.pt.
"""

import json
import os
import signal
import subprocess
import sys

import torch

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
from helpers.daemon import DaemonProcess, expertd_cmd, write_config  # noqa: E402
from helpers.workers import Worker  # noqa: E402

from expertd.client import ExpertClient  # noqa: E402


def listing(folder: str, namespace: str) -> dict[str, dict]:
    """The namespace's files in `folder`: name -> size and mode."""
    out = {}
    for name in sorted(os.listdir(folder)):
        if name.startswith(namespace + "."):
            st = os.stat(os.path.join(folder, name))
            out[name] = {"size": st.st_size, "mode": oct(st.st_mode & 0o777)}
    return out


def model_worker(endpoint: str, namespace: str, out_dir: str) -> dict:
    """A worker that loads the model, touches every weight, reports its mappings and saves its logits."""
    worker = Worker(endpoint, timeout=60, namespace=namespace, model=True, save=out_dir)
    try:
        report = dict(worker.hello)
        report["pages"] = worker.ask("pages")
        worker.ask("exit")
        report["exit"] = worker.proc.wait(60)
        report["pid"] = worker.proc.pid
    finally:
        worker.finish()
    return report


def run(cmd: list[str]) -> dict:
    out = subprocess.run(cmd, capture_output=True, text=True, timeout=120)
    return {"rc": out.returncode, "stdout": out.stdout, "stderr": out.stderr}


def main() -> None:
    checkpoint, work, namespace, shm_dir, small_dir = sys.argv[1:6]
    seen: dict = {"pids": []}

    # the reference: the same checkpoint served from /dev/shm
    plain = DaemonProcess.launch(os.path.join(work, "plain"), checkpoint, namespace)
    plain.wait_serving()
    seen["pids"].append(plain.proc.pid)
    seen["plain_worker"] = model_worker(plain.endpoint, namespace, os.path.join(work, "plain", "out"))
    seen["plain_stop"] = plain.stop()

    # the daemon on the huge-page folder
    folder = os.path.join(work, "huge")
    daemon = DaemonProcess.launch(folder, checkpoint, namespace, shm_dir=shm_dir)
    seen["status"] = daemon.wait_serving()
    seen["pids"].append(daemon.proc.pid)
    seen["files"] = listing(shm_dir, namespace)
    seen["dev_shm_while_serving"] = sorted(listing("/dev/shm", namespace))
    seen["worker"] = model_worker(daemon.endpoint, namespace, os.path.join(folder, "out"))
    config = os.path.join(folder, "expertd.yaml")
    seen["verify"] = run(expertd_cmd("verify", "--config", config))
    seen["status_cli"] = run(expertd_cmd("status", "--config", config))

    # an update: a staging segment and a new generation's segment in shm_dir, then the old one retires
    with ExpertClient(daemon.endpoint, timeout=60) as client:
        served = client.served_tensors()
        name = sorted(n for n, t in served.items() if t.dtype == torch.bfloat16 and t.dim() == 2)[0]
        old_segment = next(t.segment for t in client.index().tensors if t.name == name)
        seen["update_generation"] = client.update({name: served[name].float().add(1).to(torch.bfloat16)})
        seen["files_after_update"] = listing(shm_dir, namespace)
        del served
        client.refresh()
        seen["generation_after_refresh"] = client.generation
        new_segment = next(t.segment for t in client.index().tensors if t.name == name)
    seen["update_segments"] = [old_segment, new_segment]
    seen["files_after_retire"] = listing(shm_dir, namespace)
    seen["updated_worker"] = model_worker(daemon.endpoint, namespace, os.path.join(folder, "out1"))

    # a crash, and the successor that adopts what it left in shm_dir (and reaps the rest)
    dead = daemon.proc.pid
    daemon.proc.send_signal(signal.SIGKILL)
    daemon.proc.wait()
    daemon.proc.communicate()
    seen["dead_pid"] = dead
    seen["files_after_kill"] = listing(shm_dir, namespace)
    successor = DaemonProcess(config, daemon.endpoint, namespace=namespace)
    seen["successor_status"] = successor.wait_serving()
    seen["pids"].append(successor.proc.pid)
    seen["files_after_reap"] = listing(shm_dir, namespace)
    seen["successor_worker"] = model_worker(successor.endpoint, namespace, os.path.join(folder, "out2"))
    seen["successor_stop"] = successor.stop()
    seen["files_after_stop"] = listing(shm_dir, namespace)

    # a folder too small for the model: refused before the first segment
    small = os.path.join(work, "small")
    os.makedirs(small)
    seen["small"] = run(expertd_cmd("start", "--config", write_config(small, checkpoint, namespace, shm_dir=small_dir)))
    seen["small_files"] = os.listdir(small_dir)

    seen["dev_shm_at_end"] = sorted(listing("/dev/shm", namespace))
    seen["alive"] = [pid for pid in seen["pids"] + [seen[k]["pid"] for k in ("plain_worker", "worker", "updated_worker",
                                                                            "successor_worker")]
                     if os.path.exists(f"/proc/{pid}")]
    print(json.dumps(seen), flush=True)


if __name__ == "__main__":
    main()
