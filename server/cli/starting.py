"""`expertd start`: the daemon in the foreground, from its config (and `--ep-ranks` over the config's ranks)."""

from __future__ import annotations

import logging
import os
import sys

from expertd.errors import ConfigError


def cmd_start(args) -> int:
    from ..daemon.config import load_config
    from ..daemon.loop import Daemon

    cfg = load_config(args.config)
    if args.no_progress:
        cfg.progress = False
    if args.ep_ranks:
        cfg.expert_parallel = ep_ranks_override(cfg, args.ep_ranks)
    code = Daemon(cfg).run()
    # Everything it made is removed (or handed over) by now: end here rather than tear down torch's and
    # transformers' modules, which takes 1-3 s and would hold up `expertd stop`, `restart` and a successor.
    logging.shutdown()
    sys.stdout.flush()
    sys.stderr.flush()
    os._exit(code)


def ep_ranks_override(cfg, value: str):
    """`--ep-ranks 0,1` (or `@FILE` holding them, e.g. a node label an init container wrote) over the config's
    `expert_parallel.ranks`: one config for every host of a deployment."""
    from expertd.partition import ExpertParallel, PartitionError, parse_ranks

    if cfg.expert_parallel is None:
        raise ConfigError("--ep-ranks needs `expert_parallel: {size: N}` in the config (the EP world size)")
    if value.startswith("@"):
        try:
            with open(value[1:]) as f:
                value = f.read()
        except OSError as exc:
            raise ConfigError(f"--ep-ranks {value}: cannot read {value[1:]}: {exc.strerror}") from None
    try:
        return ExpertParallel.from_config({"size": cfg.expert_parallel.size, "ranks": parse_ranks(value)}, "--ep-ranks")
    except PartitionError as exc:
        raise ConfigError(str(exc)) from None
