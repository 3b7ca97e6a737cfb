"""Running `release_worker.py` under other transformers releases, and what its report must say."""

from __future__ import annotations

import json
import os
import subprocess

from helpers.inputs import INPUT_IDS

WORKER = os.path.join(os.path.dirname(os.path.abspath(__file__)), "release_worker.py")

# model types a 4.57 worker cannot run on this machine whatever expertd does (4.57's own from_pretrained fails too)
CANNOT_RUN_4_57 = {"jamba": "transformers 4.57's Jamba forward needs the CUDA mamba kernels"}


def with_released_keys(folder: str) -> None:
    """Make a generated config.json name its experts as the family's released configs do: transformers 5.24's
    save_pretrained writes Qwen3-MoE's `num_local_experts` where releases (and 4.57) say `num_experts`."""
    path = os.path.join(folder, "config.json")
    with open(path) as f:
        config = json.load(f)
    if config.get("model_type") == "qwen3_moe" and "num_experts" not in config:
        config["num_experts"] = config["num_local_experts"]
        with open(path, "w") as f:
            json.dump(config, f, indent=2)


class ReleaseWorker:
    """One `release_worker.py --serve` process under `python` that runs job after job (the torch and transformers
    imports paid once for a module's families); its stderr goes to a file in `folder`. A job the worker fails raises
    here with its traceback and the next one still runs; a worker that died is started again at the next job."""

    def __init__(self, python: str, folder):
        self.python, self.folder, self.proc, self.started = python, str(folder), None, 0

    def run(self, endpoint: str, reference: str, use_cache: bool = False) -> dict:
        self.send(endpoint, reference, use_cache)
        return self.receive()

    def send(self, endpoint: str, reference: str, use_cache: bool = False) -> None:
        """Start a job (`receive` waits for its report): workers sent jobs one after another attach together."""
        if self.proc is None or self.proc.poll() is not None:
            self.close()
            self.started += 1
            self.stderr = open(os.path.join(self.folder, f"worker{self.started}.stderr"), "w")
            self.proc = subprocess.Popen([self.python, WORKER, "--serve"], cwd=self.folder, stdin=subprocess.PIPE,
                                         stdout=subprocess.PIPE, stderr=self.stderr, text=True)
        job = {"endpoint": endpoint, "reference": reference, "ids": INPUT_IDS, "use_cache": use_cache}
        self.proc.stdin.write(json.dumps(job) + "\n")
        self.proc.stdin.flush()

    def receive(self) -> dict:
        line = self.proc.stdout.readline()
        if not line:
            self.proc.wait(60)
            with open(self.stderr.name) as f:
                raise RuntimeError(f"the release worker exited {self.proc.returncode}: {f.read()[-3000:]}")
        report = json.loads(line)
        assert "error" not in report, report.get("error")
        return report

    def close(self) -> None:
        if self.proc is not None:
            self.proc.stdin.close()
            try:
                self.proc.wait(60)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
            self.proc.stdout.close()
            self.stderr.close()
            self.proc = None


def check_report(report: dict, release: str) -> None:
    """Logits equal to the worker's own from_pretrained, its dtypes, and nothing outside the daemon's shared memory."""
    assert report["transformers"].startswith(release), report["transformers"]
    assert report["equal"], f"logits differ from transformers {release}'s own from_pretrained"
    assert report["dtypes"] == report["ref_dtypes"]
    assert report["private"] == []  # every parameter and loaded buffer: the daemon's read-only shared memory
    assert report["writable_maps"] == 0
    assert report["tensors"] > 0
