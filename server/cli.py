"""The `expertd` command: start, stop, status, verify, reload, generate, and the weight tools."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from expertd.errors import ConfigError, ExpertdError

EXIT_ERROR = 2


def _target(args):
    from .config import resolve_target

    return resolve_target(getattr(args, "endpoint", None), getattr(args, "config", None), getattr(args, "token", None))


def _connection(args):
    from expertd.client.connection import Connection

    target = _target(args)
    return Connection(target.daemon_endpoint, timeout=args.timeout, token=target.token)


def cmd_start(args) -> int:
    from .config import load_config
    from .daemon import Daemon

    cfg = load_config(args.config)
    if args.no_progress:
        cfg.progress = False
    return Daemon(cfg).run()


def cmd_status(args) -> int:
    conn = _connection(args)
    try:
        status = conn.request("status")
    finally:
        conn.close()
    status.pop("ok", None)
    if args.json:
        print(json.dumps(status, sort_keys=True))
        return 0
    print(f"expertd {status['state']} on {status['endpoint']} (pid {status['pid']}, namespace {status['namespace']})")
    print(f"  checkpoint  {status['checkpoint']}")
    print(f"  generation  {status['generation']}")
    print(f"  tensors     {status['tensors']} served, {status['views']} per-expert views, {len(status['segments'])} segment(s)")
    for dtype, n in sorted(status["bytes"].items()):
        print(f"  bytes       {dtype:<16} {n:>16,}")
    print(f"  clients     {len(status['leases'])}")
    for lease in status["leases"]:
        print(f"    {lease['client']:<8} pid {lease['pid']:<8} generation {lease['generation']}  "
              f"age {lease['age_s']:.1f}s  idle {lease['idle_s']:.1f}s")
    for gen in status.get("generations", []):
        print(f"  generation {gen['generation']:<4} {gen['tensors']} tensors, {gen['bytes']:,} bytes "
              f"({gen['bytes_shared_with_latest']:,} shared with the latest), {len(gen['leases'])} lease(s)")
    job = status.get("job")
    if job:
        print(f"  last build  {_job_line(job)}")
    return 0


def _job_line(job: dict) -> str:
    if job["state"] == "failed":
        return f"{job['kind']} of generation {job['generation']} failed: {job['error']}: {job['message']}"
    written = f": {job['tensors_written']} tensor(s), {job['bytes_written']:,} bytes written in {job['seconds']:.2f}s" \
        if "bytes_written" in job else ""
    return f"{job['kind']} of generation {job['generation']} {job['state']}{written}"


def cmd_reload(args) -> int:
    """Ask the daemon to build the next generation from a checkpoint folder and wait until it is published."""
    import os
    import time

    from expertd.errors import DaemonError

    conn = _connection(args)
    try:
        fields = {"checkpoint": os.path.abspath(args.checkpoint)} if args.checkpoint else {}
        job = conn.request("reload", **fields)
        deadline = time.monotonic() + args.wait
        while job["state"] in ("building", "built") and time.monotonic() < deadline:
            time.sleep(0.05)
            job = conn.request("job", job=job["job"])
    finally:
        conn.close()
    if job["state"] == "failed":
        raise DaemonError(f"reload failed, the daemon keeps serving its current generation: {job['error']}: {job['message']}",
                          job["error"])
    print(_job_line(job))
    return 0 if job["state"] == "published" else 1


def cmd_stop(args) -> int:
    conn = _connection(args)
    try:
        conn.request("stop")
    finally:
        conn.close()
    return 0


def cmd_verify(args) -> int:
    from expertd.client import ExpertClient

    target = _target(args)
    with ExpertClient(target.daemon_endpoint, timeout=args.timeout, heartbeat=False, token=target.token) as client:
        index = client.index()
        bad = client.verify()
    for name in bad:
        print(f"CHANGED  {name}")
    print(f"verified {len(index.tensors)} tensors of generation {index.generation}: "
          f"{'all bytes match the index' if not bad else f'{len(bad)} changed'}")
    return 1 if bad else 0


def cmd_generate(args) -> int:
    from .tools.generate import generate, generate_model_type

    if args.model_type:
        generate_model_type(args.out, args.model_type, fp8=args.fp8, seed=args.seed)
    elif args.fp8 is False:
        raise ConfigError("--no-fp8 needs --model-type (the --preset checkpoints are always FP8)")
    else:
        generate(args.out, preset=args.preset, seed=args.seed, shards=args.shards)
    print(args.out)
    return 0


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(prog="expertd", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)

    p = sub.add_parser("start", help="load a checkpoint into shared memory and serve it (foreground)")
    p.add_argument("--config", required=True, help="YAML config file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_start)

    for name, func, help_ in (
        ("status", cmd_status, "show what a daemon serves"),
        ("stop", cmd_stop, "stop a daemon"),
        ("verify", cmd_verify, "re-read shared memory and report tensors whose bytes changed"),
        ("reload", cmd_reload, "build the next generation from a checkpoint (only what changed) and publish it"),
    ):
        p = sub.add_parser(name, help=help_)
        where = p.add_mutually_exclusive_group()
        where.add_argument("--endpoint", help="ZeroMQ endpoint (ipc://PATH or tcp://HOST:PORT)")
        where.add_argument("--config", help="the daemon's YAML config")
        p.add_argument("--timeout", type=float, default=5.0 if name != "verify" else 60.0,
                       help="seconds to wait for an answer")
        p.add_argument("--token", help="auth token (default: $EXPERTD_TOKEN or the config's auth_token)")
        if name == "status":
            p.add_argument("--json", action="store_true", help="print one JSON object")
        if name == "reload":
            p.add_argument("--checkpoint", help="checkpoint folder to serve next (default: the configured one, re-read)")
            p.add_argument("--wait", type=float, default=3600.0,
                           help="seconds to wait for the new generation to be published (default 3600)")
        p.set_defaults(func=func)

    p = sub.add_parser("generate", help="write a deterministic FP8 DeepSeek-V3 checkpoint, or a tiny one of any MoE model type")
    p.add_argument("out", help="folder to write")
    p.add_argument("--preset", default="tiny", help="DeepSeek-V3 preset (when no --model-type)")
    p.add_argument("--model-type", help="a tiny checkpoint of this transformers model type, written by its save_pretrained")
    p.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=None,
                   help="with --model-type: quantize to FP8 block scales (default: as the family's releases)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--shards", type=int, default=2)
    p.set_defaults(func=cmd_generate)

    from .tools.cli import add_tool_commands  # convert, inspect, doctor: tools around the weights

    add_tool_commands(sub)
    return parser


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        return args.func(args)
    except ExpertdError as exc:
        print(f"expertd {args.command}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_ERROR


if __name__ == "__main__":
    sys.exit(main())
