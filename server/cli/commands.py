"""The `expertd` command: start, stop, status, verify, reload, generate, and the weight tools."""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys

import expertd
from expertd import messages, replies
from expertd.errors import ConfigError, DaemonError, DaemonNotRunning, DaemonTimeout, ExpertdError
from expertd.message_types import ABSENT
from expertd.units import parse_duration, parse_size

from ..daemon.config import connection_of as _connection
from ..daemon.config import target_of as _target
from . import stopping
from .starting import cmd_start

EXIT_ERROR = 2  # a user mistake or no daemon: one line on stderr says what is wrong and the fix
EXIT_LOADING = 3  # `status --wait`: the daemon answers but is still loading its first generation


def _wait_status(args) -> messages.StatusReply:
    """Poll until the daemon serves or `--wait` runs out; what the last attempt raised is raised."""
    import time

    from expertd.connection import Connection

    target = _target(args)
    deadline = time.monotonic() + args.wait
    while True:
        left = deadline - time.monotonic()
        conn = Connection(target.daemon_endpoint,
                          timeout=max(0.1, min(args.timeout, left)) if args.wait else args.timeout,
                          credentials=target.credentials)
        try:
            status = conn.send(messages.Status(), messages.StatusReply)
            if status.state == "serving" or time.monotonic() >= deadline:
                return status
        except (DaemonNotRunning, DaemonTimeout):
            if time.monotonic() >= deadline:
                raise
        finally:
            conn.close()
        time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))


def cmd_status(args) -> int:
    status = _wait_status(args)
    if args.wait and status.state != "serving":
        print(f"expertd status: the daemon at {status.endpoint} (pid {status.pid}) is still loading "
              f"generation {status.generation} after {args.wait:g}s", file=sys.stderr)
        return EXIT_LOADING
    if args.json:
        print(json.dumps({k: v for k, v in status.wire().items() if k != "ok"}, sort_keys=True))
        return 0
    print(f"expertd {status.state} on {status.endpoint} (pid {status.pid}, namespace {status.namespace})")
    print(f"  checkpoint  {status.checkpoint}")
    print(f"  generation  {status.generation}")
    print(f"  tensors     {status.tensors} served, {status.views} per-expert views, {len(status.segments)} segment(s)")
    print(f"  shm_dir     {status.shm_dir}")
    for dtype, n in sorted(status.bytes.items()):
        print(f"  bytes       {dtype:<16} {n:>16,}")
    ep = status.expert_parallel
    if ep:
        blocks = sorted({(b["total"], tuple(map(tuple, b["ranges"]))) for b in ep["experts"].values()})
        ranges = "; ".join(f"{', '.join(f'[{a}, {a + n})' for a, n in r)} of {total}" for total, r in blocks)
        print(f"  experts     EP size {ep['size']}, ranks {ep['ranks']}: experts {ranges} "
              f"in {len(ep['experts'])} fused tensor(s)")
    print(f"  clients     {len(status.leases)}")
    for lease in status.leases:
        print(f"    {lease['client']:<8} pid {lease['pid']:<8} generation {lease['generation']}  "
              f"age {lease['age_s']:.1f}s  idle {lease['idle_s']:.1f}s"
              + ("  (process watched)" if lease.get("watched") else ""))
    for gen in status.generations or ():
        print(f"  generation {gen['generation']:<4} {gen['tensors']} tensors, {gen['bytes']:,} bytes "
              f"({gen['bytes_shared_with_latest']:,} shared with the latest), {len(gen['leases'])} lease(s)")
        derived = (gen.get("derived") or {}).get("tensors") or []
        if derived:  # casts made once for workers whose transformers loads some tensors in another dtype
            kinds = sorted({f"{v['served_dtype'].removeprefix('torch.')} -> {v['dtype'].removeprefix('torch.')}"
                            for v in derived})
            print(f"    derived  {len(derived)} tensor(s), {sum(v['nbytes'] for v in derived):,} bytes "
                  f"({', '.join(kinds)})")
    if status.job:
        print(f"  last build  {_job_line(status.job)}")
    return 0


def _job_line(job: replies.JobState) -> str:
    if job.state == "failed":
        return f"{job.kind} of generation {job.generation} failed: {job.error}: {job.message}"
    written = f": {job.tensors_written} tensor(s), {job.bytes_written:,} bytes written in {job.seconds:.2f}s" \
        if job.bytes_written is not ABSENT else ""
    if job.bytes_read:
        written += f", {job.bytes_read:,} checkpoint bytes read"
    return f"{job.kind} of generation {job.generation} {job.state}{written}"


def cmd_reload(args) -> int:
    """Ask the daemon to build the next generation from a checkpoint folder and wait until it is published."""
    import time

    conn = _connection(args)
    try:
        fields = {"checkpoint": os.path.abspath(args.checkpoint)} if args.checkpoint else {}
        job = conn.send(messages.Reload(**fields), messages.JobReply)
        deadline = time.monotonic() + args.wait
        while job.state in ("building", "built") and time.monotonic() < deadline:
            time.sleep(0.05)
            job = conn.send(messages.Job(job=job.job), messages.JobReply)
    finally:
        conn.close()
    if job.state == "failed":
        raise DaemonError(f"reload failed, the daemon keeps serving its current generation: {job.error}: {job.message}",
                          job.error)
    print(_job_line(job))
    return 0 if job.state == "published" else 1


def cmd_keys(args) -> int:
    """Write a CURVE key pair (ZeroMQ's certificate files) for a daemon or a client."""
    from expertd.security import create_keys

    public, secret = create_keys(args.folder, args.name)
    print(f"public key  {public}  (hand it out: clients' server key, or a daemon's curve_client_keys / "
          "curve_push_keys)")
    print(f"secret key  {secret}  (0600; keep it: the daemon's curve_secret_key or a client's EXPERTD_CLIENT_KEY)")
    return 0


def cmd_verify(args) -> int:
    from expertd.leasing import corrupted_tensors, lease_request, leased_index

    conn = _connection(args)
    try:
        try:
            lease = lease_request(conn)
        except DaemonError as exc:  # the user asked for a verify, not an attach: say which it needed
            raise type(exc)(f"verify reads the served bytes under a lease, and the {exc}", exc.kind) from None
        try:
            index = leased_index(conn, lease, args.timeout)
            bad = corrupted_tensors(index)
        finally:
            conn.send(messages.Release(client=lease.client))
    finally:
        conn.close()
    for name in bad:
        print(f"CHANGED  {name}")
    print(f"verified {len(index.tensors)} tensors of generation {index.generation}: "
          f"{'all bytes match the index' if not bad else f'{len(bad)} changed'}")
    return 1 if bad else 0


def cmd_generate(args) -> int:
    from expertd.tools.generate import PRESETS
    from expertd.tools.generate_formats import generate_checkpoint

    fmt = args.format
    if args.fp8 is not None:  # deprecated: --format names which FP8
        if fmt is not None:
            raise ConfigError(f"--{'' if args.fp8 else 'no-'}fp8 and --format together: give --format alone")
        if args.fp8 is False and not args.model_type:  # as before --format
            raise ConfigError("--no-fp8 needs --model-type (deprecated: for a bf16 preset, give --format bf16)")
        fmt = "fp8-blocks" if args.fp8 else "bf16"
        print(f"expertd generate: --{'' if args.fp8 else 'no-'}fp8 is deprecated; use --format {fmt}", file=sys.stderr)
    if args.model_type and args.preset is not None:
        raise ConfigError("--preset and --model-type together: a preset is a DeepSeek-V3 size; give one of them")
    if not args.model_type and (args.preset or "tiny") not in PRESETS:
        raise ConfigError(f"unknown preset {args.preset!r}; presets: {', '.join(PRESETS)}")
    try:
        generate_checkpoint(args.out, fmt, preset=args.preset or "tiny", model_type=args.model_type, seed=args.seed,
                            shards=args.shards)
    except OSError as exc:
        raise ConfigError(f"cannot write {args.out}: {exc.strerror or exc}; choose a writable folder "
                          "(and enough free disk for the preset)") from exc
    print(args.out)
    return 0


class _Parser(argparse.ArgumentParser):
    """argparse that reports a usage mistake as one line (with where to look), exit code 2, blaming the command it
    belongs to (`expertd start: error: unrecognized arguments: --bogus`, not `expertd: ...`)."""

    def error(self, message: str):
        self.exit(EXIT_ERROR, f"{self.prog}: error: {message} (see `{self.prog} --help`)\n")

    def parse_args(self, args=None, namespace=None):
        parsed, extra = self.parse_known_args(args, namespace)
        if extra:
            self._owner(parsed, sys.argv[1:] if args is None else list(args), extra).error(
                f"unrecognized arguments: {' '.join(extra)}")
        return parsed

    def _owner(self, parsed, argv: list[str], extra: list[str]) -> argparse.ArgumentParser:
        """The (sub)command parser the first unrecognized argument was given to: the deepest command before it."""
        owner, at, first = self, 0, argv.index(extra[0]) if extra[0] in argv else len(argv)
        while True:
            commands = next((a for a in owner._actions if isinstance(a, argparse._SubParsersAction)), None)
            name = getattr(parsed, commands.dest, None) if commands is not None else None
            if name not in (commands.choices if commands is not None else ()) or name not in argv[at:first]:
                return owner
            at = argv.index(name, at) + 1
            owner = commands.choices[name]


class _Help(argparse.ArgumentDefaultsHelpFormatter, argparse.RawDescriptionHelpFormatter):
    """Every option with a value shows its default; descriptions keep their line breaks."""

    def _get_help_string(self, action):
        if action.default in (None, False, argparse.SUPPRESS) or "%(default)" in (action.help or ""):
            return action.help
        return super()._get_help_string(action)


def _duration(text: str) -> float:
    try:
        return parse_duration(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _size(text: str) -> int:
    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise argparse.ArgumentTypeError(f"{text!r} is not a positive integer")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = _Parser(prog="expertd", description=__doc__, formatter_class=_Help,
                     epilog="Exit codes: 0 ok; 1 the command ran and found a problem (verify, doctor); "
                            "2 a mistake or no daemon (one line on stderr says what and how to fix it); "
                            "3 status --wait: the daemon is still loading.")
    parser.add_argument("--version", action="version", version=f"expertd {expertd.__version__}")
    sub = parser.add_subparsers(dest="command", required=True, metavar="COMMAND",
                                parser_class=_Parser)

    def add(name: str, help_: str) -> argparse.ArgumentParser:
        return sub.add_parser(name, help=help_, description=help_[:1].upper() + help_[1:] + ".", formatter_class=_Help)

    _add_daemon_commands(add)
    _add_client_commands(add)
    _add_generate(add)
    from expertd.tools.cli import add_tool_commands  # convert, inspect, doctor: tools around the weights

    add_tool_commands(sub, formatter_class=_Help)
    return parser


def _add_daemon_commands(add) -> None:
    """start, restart, keys: the commands that run or equip a daemon on this host."""
    p = add("start", "load a checkpoint into shared memory and serve it (foreground)")
    p.add_argument("--config", required=True, help="the daemon's YAML config file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (same as `progress: false`)")
    p.add_argument("--ep-ranks", metavar="RANKS",
                   help="the EP ranks this host serves (0,1 or 0-3, or @FILE holding them), over expert_parallel.ranks")
    p.set_defaults(func=cmd_start)

    p = add("restart", "hand a running daemon's generations over (stop --keep) and start a successor that adopts them "
                       "(foreground)")
    p.add_argument("--config", required=True, help="the daemon's YAML config file")
    p.add_argument("--no-progress", action="store_true", help="no progress bar (same as `progress: false`)")
    p.add_argument("--ep-ranks", metavar="RANKS", help="as for start")
    p.add_argument("--timeout", type=_duration, default=60.0, help="seconds to wait for the running daemon to exit")
    p.set_defaults(func=stopping.cmd_restart)

    p = add("keys", "write a CURVE key pair for tcp:// encryption (NAME.key public, NAME.key_secret secret)")
    p.add_argument("folder", help="folder to write them into (made 0700 if missing)")
    p.add_argument("--name", default="expertd", help="file name stem")
    p.set_defaults(func=cmd_keys)


def _add_client_commands(add) -> None:
    """status, stop, verify, reload: the commands that talk to a running daemon (its endpoint and credentials)."""
    for name, func, help_ in (
        ("status", cmd_status, "show what a daemon serves (exit 0 when it answers)"),
        ("stop", stopping.cmd_stop, "stop a daemon and say which one stopped"),
        ("verify", cmd_verify, "re-read shared memory and report tensors whose bytes changed"),
        ("reload", cmd_reload, "build the next generation from a checkpoint (only what changed) and publish it"),
    ):
        p = add(name, help_)
        where = p.add_mutually_exclusive_group()
        where.add_argument("--endpoint", help="the daemon's ZeroMQ endpoint, ipc://PATH or tcp://HOST:PORT "
                                              "(default: --config's endpoint, then $EXPERTD_ENDPOINT, then "
                                              "ipc:///run/expertd/expertd.sock as root, else "
                                              "$XDG_RUNTIME_DIR/expertd/ or /tmp/expertd-UID/expertd.sock)")
        where.add_argument("--config", help="the daemon's YAML config (its endpoint and auth_token are used)")
        p.add_argument("--timeout", type=_duration, default=5.0 if name != "verify" else 60.0,
                       help="seconds to wait for each answer")
        p.add_argument("--token", help="auth token (default: the config's auth_token, then $EXPERTD_TOKEN)")
        p.add_argument("--server-key", help="a CURVE daemon's public key (z85 or its NAME.key file; default: from "
                                            "--config on the daemon's host, then $EXPERTD_SERVER_KEY)")
        if name == "status":
            p.add_argument("--json", action="store_true", help="print one JSON object")
            p.add_argument("--wait", type=float, default=0.0, metavar="SECONDS",
                           help="wait up to SECONDS for the daemon to serve: exit 0 when it does, 3 when it is "
                                "still loading then, 2 when none answers (for healthchecks and scripts)")
        if name == "stop":
            p.add_argument("--keep", action="store_true",
                           help="leave the generations in shared memory for a successor (`expertd start` adopts them)")
        if name == "reload":
            p.add_argument("--checkpoint", help="checkpoint folder to serve next (default: the configured one, "
                           "re-read); any other must lie under the config's checkpoint_roots. Needs the admin "
                           "permission (the admin_token, read from --config, or $EXPERTD_ADMIN_TOKEN)")
            p.add_argument("--wait", type=_duration, default=3600.0,
                           help="seconds to wait for the new generation to be published")
        p.set_defaults(func=func)


def _add_generate(add) -> None:
    p = add("generate", "write a deterministic DeepSeek-V3 checkpoint, or a tiny one of any MoE model type, in any "
                        "stored format expertd serves")
    p.add_argument("out", help="folder to write")
    p.add_argument("--preset", default=None,
                   help="DeepSeek-V3 size when no --model-type: tiny (the bundled test model; the default), bench-1g "
                        "(~1 GB bf16), dsv3-counts (DeepSeek-V3's 61 layers, 256 experts, MTP layer and ~92k tensors "
                        "at tiny dims), dsv3-bytes (about dsv3-counts' bytes in ~70 tensors)")
    p.add_argument("--model-type",
                   help="a tiny checkpoint of this transformers model type, written by its save_pretrained")
    from expertd.tools.stored_formats import FORMATS, release_formats_text

    p.add_argument("--format", choices=FORMATS, default=None,
                   help="the stored format: " + "; ".join(f"{k}: {v}" for k, v in FORMATS.items()) +
                        f". Default: as the family's releases ({release_formats_text()})")
    p.add_argument("--fp8", action=argparse.BooleanOptionalAction, default=None,
                   help="deprecated: --fp8 is --format fp8-blocks, --no-fp8 is --format bf16")
    p.add_argument("--seed", type=int, default=0, help="random seed (same seed, same bytes)")
    p.add_argument("--shards", type=_positive_int, default=None,
                   help="number of safetensors shard files (default: 2 for a preset; for --model-type, "
                        "save_pretrained's 400KB pieces)")
    p.set_defaults(func=cmd_generate)


def main(argv: list[str] | None = None) -> int:
    args = build_parser().parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    try:
        code = args.func(args)
        sys.stdout.flush()  # here, where a closed pipe is caught, not at exit
        return code
    except ExpertdError as exc:
        print(f"expertd {args.command}: error: {type(exc).__name__}: {exc}", file=sys.stderr)
        return EXIT_ERROR
    except BrokenPipeError:  # `expertd status | head`: the reader has what it wanted
        os.dup2(os.open(os.devnull, os.O_WRONLY), sys.stdout.fileno())  # nothing more to flush into the closed pipe
        return 0
    except KeyboardInterrupt:
        print(f"expertd {args.command}: interrupted", file=sys.stderr)
        return 130


if __name__ == "__main__":
    sys.exit(main())
