"""The `expertd` command: start, stop, status, generate."""

from __future__ import annotations

import argparse
import json
import logging
import sys

from expertd.errors import ExpertdError

EXIT_ERROR = 2


def _endpoint(args) -> str:
    if getattr(args, "endpoint", None):
        from .config import resolve_endpoint

        return resolve_endpoint(args.endpoint)
    if getattr(args, "config", None):
        from .config import load_config

        return load_config(args.config).endpoint
    from .config import DEFAULT_ENDPOINT

    return DEFAULT_ENDPOINT


def cmd_start(args) -> int:
    from .config import load_config
    from .daemon import Daemon

    cfg = load_config(args.config)
    if args.no_progress:
        cfg.progress = False
    return Daemon(cfg).run()


def _token(args) -> str | None:
    if getattr(args, "token", None):
        return args.token
    if getattr(args, "config", None):
        from .config import load_config

        return load_config(args.config).auth_token
    return None


def cmd_status(args) -> int:
    from expertd.client.connection import Connection

    conn = Connection(_endpoint(args), timeout=args.timeout, token=_token(args))
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
        print(f"    {lease['client']:<8} pid {lease['pid']:<8} age {lease['age_s']:.1f}s  idle {lease['idle_s']:.1f}s")
    return 0


def cmd_stop(args) -> int:
    from expertd.client.connection import Connection

    conn = Connection(_endpoint(args), timeout=args.timeout, token=_token(args))
    try:
        conn.request("stop")
    finally:
        conn.close()
    return 0


def cmd_verify(args) -> int:
    from expertd.client import ExpertClient

    with ExpertClient(_endpoint(args), timeout=args.timeout, heartbeat=False, token=_token(args)) as client:
        index = client.index()
        bad = client.verify()
    for name in bad:
        print(f"CHANGED  {name}")
    print(f"verified {len(index.tensors)} tensors of generation {index.generation}: "
          f"{'all bytes match the index' if not bad else f'{len(bad)} changed'}")
    return 1 if bad else 0


def cmd_generate(args) -> int:
    from .tools.generate import generate

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
        p.set_defaults(func=func)

    p = sub.add_parser("generate", help="write a deterministic DeepSeek-V3-format FP8 checkpoint")
    p.add_argument("out", help="folder to write")
    p.add_argument("--preset", default="tiny")
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
