"""An expert-parallel worker that stays up, launched by torchrun on every host of a deployment:

    torchrun --nnodes 2 --nproc_per_node 1 --node_rank R --master_addr HOST0 --master_port 29500 \
        examples/ep_worker.py [--ep-size 2] [--poll 5] [--ready-file /tmp/ready]

Each rank attaches to its own host's daemon ($EXPERTD_ENDPOINT; the daemon must serve this rank's
experts: `expert_parallel` in its config) and builds the model transformers' own expert parallelism
gives (`DistributedConfig(ep_size=world, fsdp_size=world)` by default), every local shard a view of the
host's shared memory. It runs one forward pass; once every rank has, rank 0 writes --ready-file. Then it
waits: every --poll seconds rank 0 shares the newest generation it has seen, and when one is newer every
rank refreshes the same model together (a collective forward needs all ranks on one generation). SIGTERM
(or SIGINT) to any rank ends all ranks at their next poll: each detaches, leaves the process group and exits
0, so torchrun exits 0
(`kill -TERM $(pgrep -P TORCHRUN_PID)`; a SIGTERM to torchrun itself stops the ranks the same way, but
torchrun then reports its own SignalException with a traceback).

Where SIGTERM goes to the process you started (a container's PID 1, Ctrl-C), start it through this script
instead: without torchrun's environment it runs torchrun itself, in a session of its own, and turns its
SIGTERM or SIGINT into a SIGTERM of the ranks, then exits with torchrun's status (0 after a clean stop):

    python examples/ep_worker.py --nnodes 2 --nproc_per_node 1 --node_rank R --master_addr HOST0 -- [--poll 5 ...]
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import threading

import torch
import torch.distributed as dist


stop = threading.Event()  # set by SIGTERM or SIGINT: the ranks leave together at their next poll


def main() -> int:
    for signum in (signal.SIGTERM, signal.SIGINT):  # first: a signal during the imports or the load is a stop too
        signal.signal(signum, lambda *_: stop.set())
    from transformers.distributed import DistributedConfig

    from expertd.client import ExpertClient

    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--ep-size", type=int, default=None, help="EP world size (default: the torchrun world size)")
    ap.add_argument("--poll", type=float, default=5.0)
    ap.add_argument("--ready-file", default=None)
    ap.add_argument("--wait", type=float, default=1800.0, help="seconds to wait for this host's daemon to serve")
    args = ap.parse_args()
    dist.init_process_group("nccl" if torch.cuda.is_available() else "gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    with ExpertClient(timeout=args.wait) as client:
        config = DistributedConfig(ep_size=args.ep_size or world, fsdp_size=world)
        model = client.load_model(distributed_config=config)
        probe = torch.arange(8).reshape(1, 8) % model.config.vocab_size
        with torch.no_grad():
            model(probe)
        print(f"rank {rank}/{world}: serving generation {client.generation} from {client.endpoint}", flush=True)
        dist.barrier()  # the ready file says every rank serves (and has said so), not rank 0 alone
        if args.ready_file and rank == 0:
            open(args.ready_file, "w").close()
        while True:
            # rank 0's newest generation, and whether any rank was asked to stop: all ranks act on the same
            state = torch.tensor([client.latest_generation if rank == 0 else 0, int(stop.is_set())])
            dist.all_reduce(state, op=dist.ReduceOp.MAX)
            if state[1]:
                print(f"rank {rank}: stopping", flush=True)
                break
            if state[0] > client.generation:
                client.refresh(model)
                with torch.no_grad():
                    model(probe)
                print(f"rank {rank}: refreshed to generation {client.generation}", flush=True)
            stop.wait(args.poll)
    dist.destroy_process_group()
    return 0


def ranks_of(pid: int) -> list[int]:
    """The processes `pid` started (torchrun's ranks), from /proc."""
    try:
        with open(f"/proc/{pid}/task/{pid}/children") as f:
            return [int(p) for p in f.read().split()]
    except OSError:
        return []


def launch(argv: list[str]) -> int:
    """torchrun [its options, before `--`] on this script [with the options after `--`]; a SIGTERM or SIGINT here
    is a SIGTERM to every rank (until they have all gone), never to torchrun (which would report it as a failure)."""
    split = argv.index("--") if "--" in argv else len(argv)
    torchrun = subprocess.Popen([sys.executable, "-m", "torch.distributed.run", *argv[:split],
                                 os.path.abspath(__file__), *argv[split + 1:]],
                                start_new_session=True)  # Ctrl-C reaches this process alone
    for signum in (signal.SIGTERM, signal.SIGINT):
        signal.signal(signum, lambda *_: stop.set())
    told: set[int] = set()  # each rank once: one exiting already has Python's default handler back
    while True:
        try:
            return torchrun.wait(0.2)
        except subprocess.TimeoutExpired:
            pass
        if stop.is_set():  # each round: ranks torchrun had not started yet get it too
            for pid in set(ranks_of(torchrun.pid)) - told:
                os.kill(pid, signal.SIGTERM)
                told.add(pid)


if __name__ == "__main__":
    sys.exit(main() if "LOCAL_RANK" in os.environ else launch(sys.argv[1:]))
