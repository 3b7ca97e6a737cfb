"""Subcommands for the tools around the weights (convert, inspect, evaluate, doctor)."""

from __future__ import annotations

import argparse
import json
import os

from expertd.errors import ConfigError

DTYPES = ("bfloat16", "float16", "float32")  # --dtype of doctor; torch is imported only when a tool runs


def _size(text: str) -> int:
    from expertd.units import parse_size

    try:
        return parse_size(text)
    except ValueError as exc:
        raise argparse.ArgumentTypeError(str(exc)) from None


def _formats(text: str) -> list[str]:
    from .number_formats import ALIASES, FORMATS

    if text == "all":
        return list(FORMATS)
    if text == "none":
        return []
    names = [f.strip() for f in text.split(",") if f.strip()]
    names = [ALIASES.get(f, f) for f in names]
    unknown = [f for f in names if f not in FORMATS]
    if unknown:
        raise argparse.ArgumentTypeError(f"unknown format(s) {', '.join(unknown)}; known: {', '.join(FORMATS)}, "
                                         "all, none")
    return names


def cmd_convert(args) -> int:
    from .convert import convert

    result = convert(args.src, args.dst, device=args.device, max_shard_size=args.max_shard_size,
                     keep_fp8_where_unscaled=args.keep_fp8_where_unscaled, progress=not args.no_progress)
    if result.noop:
        print(f"{args.dst}: already a complete conversion of {args.src}; nothing to do")
    else:
        kept = f", {len(result.skipped)} kept from an earlier run" if result.skipped else ""
        print(f"{args.dst}: {len(result.written)} shard(s) written{kept}, {result.nbytes:,} bytes of tensors")
    return 0


def cmd_inspect(args) -> int:
    from .inspect import inspect

    from expertd.server.daemon.config import resolve_target

    target = resolve_target(None, args.config, args.token)
    src = args.src or target.endpoint
    if src is None:
        raise ConfigError("give a SRC (checkpoint folder, endpoint or capture folder) or --config")
    report = inspect(src, args.out, formats=args.formats, sample=args.sample, plots=not args.no_plots,
                     timeout=args.timeout, token=target.token)
    totals = report["totals"]
    print(f"{report['source']['kind']} {report['source']['where']}: {totals['tensors']} tensors, "
          f"{totals['bytes']:,} bytes; {len(report['plots'])} picture(s)")
    print(f"{args.out}/index.html" if not args.no_plots else f"{args.out}/stats.md")
    return 0


def _globs(text: str) -> list[str]:
    return [g.strip() for g in text.split(",") if g.strip()]


def cmd_evaluate(args) -> int:
    import torch

    from .evaluate import evaluate_model, load_checkpoint_model, token_batch, write_outputs

    from expertd.server.daemon.config import resolve_target

    target = resolve_target(args.endpoint, args.config, args.token)
    if args.checkpoint is None and target.endpoint is None:
        raise ConfigError("give a CHECKPOINT folder, --endpoint or --config")
    dtype = getattr(torch, args.dtype)
    client = None
    try:
        if args.checkpoint is not None:
            model, where = load_checkpoint_model(args.checkpoint, dtype), args.checkpoint
        else:
            from expertd.client import ExpertClient

            client = ExpertClient(target.endpoint, timeout=args.timeout, heartbeat=False,
                                  **({"token": target.token} if target.token else {}))
            model, where = client.load_model(dtype=dtype), target.endpoint  # zero copy: shared-memory views
        ids = token_batch(args.tokens, args.random, model.config.vocab_size)
        result = evaluate_model(model, ids, args.formats, modules=args.modules, weights=not args.activations_only,
                                activations=not args.weights_only, per_layer=args.per_layer)
        result = write_outputs(result, args.out, where, plots=not args.no_plots)
    finally:
        if client is not None:
            client.close()
    for fmt, r in result["formats"].items():
        print(f"{fmt:>20}: KL mean {r['kl_mean']:.3g}, max {r['kl_max']:.3g}; top-1 {r['top1_agreement']:.4f}; "
              f"max |dlogit| {r['max_abs_dlogit']:.3g}")
    print(f"{args.out}/evaluate.md")
    return 0


def cmd_doctor(args) -> int:
    import torch

    from .doctor import diagnose

    from expertd.server.daemon.config import resolve_target

    target = resolve_target(args.endpoint, args.config, args.token)
    endpoint, token = target.endpoint, target.token
    checkpoint = args.checkpoint or target.checkpoint
    if checkpoint is None and endpoint is None:
        raise ConfigError("give a CHECKPOINT folder, --endpoint or --config")
    if args.load_model and endpoint is None:
        raise ConfigError("--load-model needs a daemon (--endpoint or --config)")
    dtype = getattr(torch, args.dtype)
    client = model = None
    try:
        if endpoint is not None:
            from expertd.client import ExpertClient

            client = ExpertClient(endpoint, timeout=args.timeout, heartbeat=False,
                                  **({"token": token} if token else {}))
            served = client.status().get("checkpoint")
            if checkpoint is None and served and os.path.isdir(served):  # the daemon's own checkpoint, when readable
                checkpoint = served
            if args.load_model:
                model = client.load_model(dtype=dtype)
        report = diagnose(checkpoint, client, model, dtype=dtype)
    finally:
        if client is not None:
            client.close()
    print(json.dumps(report.to_dict(), indent=1) if args.json else report.text())
    return report.exit_code(strict=args.strict)


def _add_daemon_target(p, endpoint_help: str) -> None:
    """The options that name a daemon: --endpoint or --config, then --timeout and --token (see `resolve_target`)."""
    where = p.add_mutually_exclusive_group()
    where.add_argument("--endpoint", help=endpoint_help)
    where.add_argument("--config", help="a running daemon's YAML config")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for the daemon")
    p.add_argument("--token", help="the daemon's auth token (default: the config's auth_token, then $EXPERTD_TOKEN)")


def add_tool_commands(sub, formatter_class=argparse.HelpFormatter) -> None:
    """Register the tool subcommands on the `expertd` parser's subparsers."""
    def add_parser(name: str, help: str):
        return sub.add_parser(name, help=help, description=help[:1].upper() + help[1:] + ".",
                              formatter_class=formatter_class)

    p = add_parser("convert", help="convert an FP8 checkpoint into a bf16 HuggingFace checkpoint")
    p.add_argument("src", help="FP8 checkpoint folder (DeepSeek-V3 format)")
    p.add_argument("dst", help="output folder (created; an interrupted conversion in it is resumed)")
    p.add_argument("--device", default="auto", help="where dequant runs: auto (GPU if present), cpu, cuda, cuda:N")
    p.add_argument("--max-shard-size", type=_size, default="5GB", help="largest output shard, e.g. 5GB, 2GiB")
    p.add_argument("--keep-fp8-where-unscaled", action="store_true",
                   help="copy FP8 weights that have no *_scale_inv through unchanged instead of failing")
    p.add_argument("--no-progress", action="store_true", help="no progress bar")
    p.set_defaults(func=cmd_convert)

    p = add_parser("inspect", help="statistics, format comparison and pictures of a checkpoint, daemon or capture")
    p.add_argument("src", nargs="?",
                   help="checkpoint folder, daemon endpoint (ipc://... or tcp://...) or activation capture folder")
    p.add_argument("--config", help="inspect the daemon this YAML config describes (instead of SRC)")
    p.add_argument("--out", required=True, help="folder for stats.json, stats.md, the PNGs and index.html")
    p.add_argument("--formats", type=_formats, default="all",
                   help="comma-separated formats to compare, 'all' or 'none'")
    p.add_argument("--sample", type=int, default=100_000,
                   help="values per group drawn for histograms, box and QQ plots")
    p.add_argument("--no-plots", action="store_true", help="statistics only")
    p.add_argument("--timeout", type=float, default=30.0, help="seconds to wait for a daemon")
    p.add_argument("--token", help="the daemon's auth token (default: the config's auth_token, then $EXPERTD_TOKEN)")
    p.set_defaults(func=cmd_inspect)

    p = add_parser("evaluate", help="end-to-end cost of number formats: KL of the next token, top-1 agreement")
    p.add_argument("checkpoint", nargs="?", help="checkpoint folder (FP8 or bf16) to load instead of a daemon")
    _add_daemon_target(p, "a running daemon's endpoint (the model is its shared memory, no copy)")
    p.add_argument("--formats", type=_formats, required=True,
                   help="comma-separated formats (or 'all'), e.g. hif8,mxfp4_e2m1")
    p.add_argument("--modules", type=_globs, default=["*"],
                   help="comma-separated globs of the modules simulated (default all)")
    only = p.add_mutually_exclusive_group()
    only.add_argument("--weights-only", action="store_true", help="simulate the weights only")
    only.add_argument("--activations-only", action="store_true", help="simulate the modules' inputs only")
    tokens = p.add_mutually_exclusive_group()
    tokens.add_argument("--tokens", help="token ids: a JSON list of lists, or one sequence of integers per line")
    tokens.add_argument("--random", type=int, default=64, help="N random token ids (fixed seed; default 64)")
    p.add_argument("--per-layer", action="store_true", help="also simulate one layer at a time")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="the dtype the model runs in")
    p.add_argument("--out", required=True, help="folder for evaluate.json, evaluate.md and the PNGs")
    p.add_argument("--no-plots", action="store_true", help="numbers only")
    p.set_defaults(func=cmd_evaluate)

    p = add_parser("doctor", help="check every tensor's dtype across checkpoint, daemon index, shared memory and model")
    p.add_argument("checkpoint", nargs="?", help="checkpoint folder (default: the one the daemon serves)")
    _add_daemon_target(p, "a running daemon's endpoint")
    p.add_argument("--load-model", action="store_true", help="also restore the model from the daemon and check it")
    p.add_argument("--dtype", choices=DTYPES, default="bfloat16", help="the dtype the model is loaded with")
    p.add_argument("--strict", action="store_true", help="warnings (casts that cost memory or precision) fail too")
    p.add_argument("--json", action="store_true", help="print the full report as JSON")
    p.set_defaults(func=cmd_doctor)
