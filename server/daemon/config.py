"""The daemon's YAML config: a few keys, checked strictly."""

from __future__ import annotations

import difflib
import grp
import os
import re
from dataclasses import dataclass, field, fields

import yaml

from expertd.errors import ConfigError
from expertd.index import DEFAULT_SHM_DIR
from expertd.partition import ExpertParallel, PartitionError
from expertd.protocol import check_endpoint, default_endpoint, ipc_path, tcp_host
from expertd.units import parse_duration

from ..load.layout_cache import default_folder as default_layout_cache
from ..restart.adopt import VERIFY_MODES
from ..shm.hostpaths import runtime_base
from ..shm.shmdir import inspect as inspect_shm_dir

LOCAL_HOSTS = ("127.0.0.1", "localhost", "[::1]", "::1")
_NAMESPACE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")


@dataclass
class DaemonConfig:
    checkpoint: str
    endpoint: str = field(default_factory=default_endpoint)  # ipc://RUNTIME_BASE/expertd.sock: see runtime_base
    namespace: str = "expertd"
    run_dir: str | None = None  # index JSON, manifest, ledger; default: the ipc socket's folder, else the uid's own
    device: str = "auto"  # "auto" | "cpu" | "cuda" | "cuda:N": where dequant runs
    load_threads: int | None = None  # threads reading, dequantizing and writing at once; None: every usable core
    lease_timeout_s: float = 30.0
    max_generations: int = 3  # live generations at most: a reload or update beyond it is refused
    max_leases_per_client: int = 1024  # leases one holder holds at once (ipc: one uid; tcp: one CURVE key)
    max_leases_per_process: int = 16  # one process's share of them (ipc://, where the kernel names the process)
    max_leases: int = 4096  # leases the daemon grants at once, to every holder together
    revoke_after_s: float = 30.0  # a push refused for room: the oldest generation's leases are revoked this later
    max_old_generations_per_holder: int = 1  # generations older than the latest one holder's leases may pin
    progress: bool = True
    auth_token: str | None = None  # required in every request when set; mandatory for a non-local tcp bind
    group: str | None = None  # serve segments 0640 to this group (shared-group deployments); default 0600
    metrics_port: int | None = None  # serve Prometheus metrics on http://metrics_host:metrics_port/metrics; None: off
    metrics_host: str = "127.0.0.1"
    shm_dir: str = DEFAULT_SHM_DIR  # the tmpfs (or hugetlbfs) folder segments go in, e.g. one mounted huge=always
    expert_parallel: ExpertParallel | None = None  # {size, ranks}: serve only these EP ranks' experts; None: all
    push_token: str | None = None  # when set, pushing weights (update) needs it: auth_token alone may only read
    curve_secret_key: str | None = None  # tcp:// with CURVE: this daemon's NAME.key_secret (`expertd keys`)
    curve_client_keys: str | None = None  # folder of client public keys that may connect (default: any with ours)
    curve_push_keys: str | None = None  # folder of client public keys that may push weights (default: none)
    insecure_tcp: bool = False  # allow a tcp bind beyond 127.0.0.1 without CURVE (token and bytes in clear)
    allow_plain_tcp_tokens: bool = False  # the CLI sends this config's tokens over tcp:// without CURVE all the same
    adopt_verify: str = "full"  # adopting a predecessor's generations: "full" (every checksum) or "sizes"
    admin_token: str | None = None  # when set, reload and stop need it (expertd.messages.PERMISSIONS: "admin")
    curve_admin_keys: str | None = None  # folder of client public keys granted admin under CURVE (ours always is)
    checkpoint_roots: list = field(default_factory=list)  # folders a reload may name a checkpoint under
    stop_timeout_s: float = 10.0  # a stop waits this long for a build; then it is abandoned and the daemon exits
    # derived tensors (casts, gathers) readers may leave, in bytes (whole pages) and files: see server/derived/quota.py
    max_derived_bytes: int | None = None  # the whole daemon's; None: the live generations' served bytes
    max_derived_files: int = 4096
    max_derived_bytes_per_reader: int | None = None  # one uid's (ipc://) or CURVE key's (tcp://); None: the daemon's
    max_derived_files_per_reader: int | None = None
    # a push or reload that changes some experts of a stack writes those experts only; the others stay in the older
    # generation's segment (the index then lists the stack's ranges: schema 3, which every client maps as one view)
    expert_ranges: bool = True
    # transformers' layout answer kept between starts (server/load/layout_cache.py); false: asked at every start
    layout_cache: str | None = field(default_factory=default_layout_cache)

    @property
    def index_path(self) -> str:
        return os.path.join(self.resolved_run_dir, f"{self.namespace}.index.json")

    @property
    def resolved_run_dir(self) -> str:
        """The run folder: `run_dir`, else the ipc socket's folder, else a private one of this uid
        (RUNTIME_BASE/NAMESPACE, see expertd.protocol.runtime_base), never a shared guessable path."""
        if self.run_dir:
            return self.run_dir
        path = ipc_path(self.endpoint)
        if path is not None:
            return os.path.dirname(path) or "."
        return os.path.join(runtime_base(), self.namespace)


def load_config(path: str) -> DaemonConfig:
    """Read a config file; relative paths in it resolve against the file's folder."""
    try:
        with open(path) as f:
            raw = yaml.safe_load(f)
    except OSError as exc:
        raise ConfigError(f"cannot read config {path}: {exc.strerror}; give the path of the daemon's YAML config "
                          "(configs/tiny.yaml is an example; README \"Config keys\" lists the keys)") from exc
    except yaml.YAMLError as exc:
        raise ConfigError(f"config {path} is not valid YAML: {exc}") from exc
    if not isinstance(raw, dict):
        raise ConfigError(f"config {path} must be a mapping of keys, got {type(raw).__name__}")
    return config_from_dict(raw, base_dir=os.path.dirname(os.path.abspath(path)), source=path)


def _guessed(key: str, known: set[str]) -> str:
    """`key`, and the known key it is most likely a slip of: "namspace (did you mean `namespace`?)"."""
    close = difflib.get_close_matches(key, sorted(known), n=1, cutoff=0.6)
    return f"{key} (did you mean `{close[0]}`?)" if close else key


def _layout_cache(folder, base_dir: str, source: str) -> str | None:
    """`layout_cache:` as a folder (true: the default one), or None (false or null: ask transformers every start)."""
    if folder is True:
        return default_layout_cache()
    if folder is False or folder is None:
        return None
    if isinstance(folder, str) and folder:
        return _resolve(folder, base_dir)
    raise ConfigError(f"config {source}: layout_cache must be a folder path, true (the default folder, "
                      f"{default_layout_cache()}) or false (ask transformers at every start)")


def config_from_dict(raw: dict, base_dir: str = ".", source: str = "<config>") -> DaemonConfig:
    known = {f.name for f in fields(DaemonConfig)}
    unknown = sorted(map(str, set(raw) - known))
    if unknown:
        raise ConfigError(f"config {source}: unknown key(s) {', '.join(_guessed(k, known) for k in unknown)} "
                          "(README, \"Config keys\", lists them all)")
    if "checkpoint" not in raw or not isinstance(raw["checkpoint"], str):
        raise ConfigError(f"config {source}: 'checkpoint' (a folder path) is required")
    values = dict(raw)
    values["checkpoint"] = _resolve(raw["checkpoint"], base_dir)
    if "shm_dir" in values:
        if not isinstance(values["shm_dir"], str) or not values["shm_dir"]:
            raise ConfigError(f"config {source}: shm_dir must be a folder path (a tmpfs or hugetlbfs mount)")
        values["shm_dir"] = _resolve(values["shm_dir"], base_dir)
    if "layout_cache" in values:
        values["layout_cache"] = _layout_cache(values["layout_cache"], base_dir, source)
    if values.get("run_dir"):
        values["run_dir"] = _resolve(str(values["run_dir"]), base_dir)
    if "endpoint" in values:
        values["endpoint"] = resolve_endpoint(str(values["endpoint"]), base_dir, f"config {source}")
    for key in ("curve_secret_key", "curve_client_keys", "curve_push_keys", "curve_admin_keys"):
        if values.get(key) is not None:
            values[key] = _resolve(str(values[key]), base_dir)
    if "checkpoint_roots" in values:
        roots = values["checkpoint_roots"] if values["checkpoint_roots"] is not None else []
        if not isinstance(roots, list) or not all(isinstance(r, str) and r for r in roots):
            raise ConfigError(f"config {source}: checkpoint_roots must be a list of folders a reload may read under")
        values["checkpoint_roots"] = [os.path.realpath(_resolve(r, base_dir)) for r in roots]
    if values.get("expert_parallel") is not None:
        try:
            values["expert_parallel"] = ExpertParallel.from_config(values["expert_parallel"])
        except PartitionError as exc:
            raise ConfigError(f"config {source}: {exc}") from None
    cfg = DaemonConfig(**values)
    if not isinstance(cfg.namespace, str) or not _NAMESPACE_RE.match(cfg.namespace):
        raise ConfigError(f"config {source}: namespace {cfg.namespace!r} must be 1-64 of [A-Za-z0-9_.-]")
    if not isinstance(cfg.max_generations, int) or isinstance(cfg.max_generations, bool) or cfg.max_generations < 1:
        raise ConfigError(f"config {source}: max_generations must be an integer >= 1")
    for key in ("max_leases_per_client", "max_leases", "max_leases_per_process", "max_old_generations_per_holder"):
        value = getattr(cfg, key)
        if not isinstance(value, int) or isinstance(value, bool) or not 1 <= value <= 1 << 20:
            raise ConfigError(f"config {source}: {key} must be an integer from 1 to {1 << 20}")
    _check_derived(cfg, source)
    if cfg.adopt_verify not in VERIFY_MODES:
        raise ConfigError(f"config {source}: adopt_verify {cfg.adopt_verify!r} must be 'full' (every checksum) or "
                          "'sizes'")
    if cfg.load_threads is not None and (not isinstance(cfg.load_threads, int) or isinstance(cfg.load_threads, bool)
                                         or cfg.load_threads < 1):
        raise ConfigError(f"config {source}: load_threads must be an integer >= 1 (or leave it out: every usable core)")
    for key in ("lease_timeout_s", "stop_timeout_s", "revoke_after_s"):
        if key == "revoke_after_s" and cfg.revoke_after_s in (0, "0", "0s") and cfg.revoke_after_s is not False:
            cfg.revoke_after_s = 0.0  # revoke at once
            continue
        try:
            setattr(cfg, key, parse_duration(getattr(cfg, key)))
        except ValueError as exc:
            raise ConfigError(f"config {source}: {key}: {exc}") from None
    if cfg.metrics_port is not None and (not isinstance(cfg.metrics_port, int) or isinstance(cfg.metrics_port, bool)
                                         or not 0 < cfg.metrics_port < 65536):
        raise ConfigError(f"config {source}: metrics_port must be a TCP port number 1-65535 (or leave it out: no "
                          "metrics)")
    if not isinstance(cfg.metrics_host, str) or not cfg.metrics_host:
        raise ConfigError(f"config {source}: metrics_host must be a host name or address, e.g. 127.0.0.1 or 0.0.0.0")
    if cfg.auth_token is not None and (not isinstance(cfg.auth_token, str) or len(cfg.auth_token) < 16):
        raise ConfigError(f"config {source}: auth_token must be a string of at least 16 characters")
    check_security(cfg, source, tcp_host(cfg.endpoint))
    if cfg.group is not None:
        try:
            grp.getgrnam(str(cfg.group))
        except KeyError:
            raise ConfigError(f"config {source}: group {cfg.group!r} does not exist") from None
    if "shm_dir" in raw:  # the /dev/shm default is taken as it always was, whatever it is mounted as
        inspect_shm_dir(cfg.shm_dir, where=f"config {source}: shm_dir")
    if not (cfg.device in ("auto", "cpu", "cuda") or re.match(r"^cuda:\d+$", str(cfg.device))):
        raise ConfigError(f"config {source}: device must be auto, cpu, cuda or cuda:N, got {cfg.device!r}")
    return cfg


def _check_derived(cfg: DaemonConfig, source: str) -> None:
    """The limits on derived tensors: whole numbers of bytes or files (server/derived/quota.py)."""
    for key in ("max_derived_bytes", "max_derived_files", "max_derived_bytes_per_reader",
                "max_derived_files_per_reader"):
        value = getattr(cfg, key)
        if (value is not None or key == "max_derived_files") and (
                not isinstance(value, int) or isinstance(value, bool) or value < 0):
            raise ConfigError(f"config {source}: {key} must be an integer >= 0" + (
                "" if key == "max_derived_files" else " (or leave it out: see README \"Config keys\")"))


def check_security(cfg: DaemonConfig, source: str, host: str | None) -> None:
    """CURVE keys readable and only on tcp://; no clear-text tcp beyond this host unless asked for; a push token
    apart from the auth token."""
    from expertd.security import key_pair

    if cfg.push_token is not None and (not isinstance(cfg.push_token, str) or len(cfg.push_token) < 16
                                       or cfg.push_token == cfg.auth_token):
        raise ConfigError(f"config {source}: push_token must be a string of at least 16 characters, not the auth_token")
    if cfg.admin_token is not None and (not isinstance(cfg.admin_token, str) or len(cfg.admin_token) < 16
                                        or cfg.admin_token in (cfg.auth_token, cfg.push_token)):
        raise ConfigError(f"config {source}: admin_token must be a string of at least 16 characters, neither the "
                          "auth_token nor the push_token")
    if not isinstance(cfg.insecure_tcp, bool):
        raise ConfigError(f"config {source}: insecure_tcp must be true or false")
    if not isinstance(cfg.allow_plain_tcp_tokens, bool):
        raise ConfigError(f"config {source}: allow_plain_tcp_tokens must be true or false")
    curve = [k for k in ("curve_secret_key", "curve_client_keys", "curve_push_keys", "curve_admin_keys")
             if getattr(cfg, k) is not None]
    if curve and host is None:
        raise ConfigError(f"config {source}: {', '.join(curve)} apply to tcp:// endpoints (ipc:// stays on this host)")
    if curve and cfg.curve_secret_key is None:
        raise ConfigError(f"config {source}: {', '.join(curve)} need curve_secret_key (this daemon's key pair)")
    if cfg.curve_secret_key is not None:
        key_pair(cfg.curve_secret_key, f"config {source}: curve_secret_key")
        for key in ("curve_client_keys", "curve_push_keys", "curve_admin_keys"):
            if getattr(cfg, key) is not None and not os.path.isdir(getattr(cfg, key)):
                raise ConfigError(f"config {source}: {key} {getattr(cfg, key)} must be a folder of NAME.key files")
    elif host is not None and host not in LOCAL_HOSTS and not cfg.insecure_tcp:
        raise ConfigError(
            f"config {source}: endpoint {cfg.endpoint} binds beyond this host without encryption; set curve_secret_key "
            "(make keys with `expertd keys DIR`), or insecure_tcp: true to send the token and weights in clear"
        )
    elif host is not None and host not in LOCAL_HOSTS and cfg.auth_token is None:
        raise ConfigError(f"config {source}: endpoint {cfg.endpoint} binds beyond this host in clear (insecure_tcp); "
                          "set auth_token too (or bind 127.0.0.1)")


def resolve_endpoint(endpoint: str, base_dir: str | None = None, where: str = "--endpoint") -> str:
    """Check an endpoint. A relative ipc:// path resolves against `base_dir` (a config file's folder); without one
    (a flag, the environment) it is refused. `where` names its origin in errors."""
    check_endpoint(endpoint, where, relative=base_dir is not None)
    path = ipc_path(endpoint)
    return endpoint if path is None or base_dir is None else "ipc://" + _resolve(path, base_dir)


@dataclass
class Target:
    """The daemon (and checkpoint) a command is aimed at."""

    endpoint: str | None  # None: nothing named one
    token: str | None
    config: DaemonConfig | None = None
    server_key: str | None = None  # --server-key

    @property
    def credentials(self):
        """What the CLI presents: the token, and on the daemon's own host (its config read) the daemon's own CURVE
        key pair, which the daemon always accepts; else $EXPERTD_SERVER_KEY / $EXPERTD_CLIENT_KEY."""
        from expertd.security import Credentials, key_pair

        if self.server_key is None and self.config is not None and self.config.curve_secret_key is not None:
            public, secret = key_pair(self.config.curve_secret_key)
            return Credentials(self.token, self.config.push_token, self.config.admin_token, public, public, secret)
        if self.config is not None:  # the daemon's own config: its permission tokens too (the CLI on its host is admin)
            return Credentials.resolve(token=self.token, push_token=self.config.push_token,
                                       admin_token=self.config.admin_token, server_key=self.server_key,
                                       allow_plain_tcp_tokens=self.config.allow_plain_tcp_tokens or None)
        return Credentials.resolve(token=self.token, server_key=self.server_key)

    @property
    def checkpoint(self) -> str | None:
        return self.config.checkpoint if self.config else None

    @property
    def daemon_endpoint(self) -> str:
        return self.endpoint or default_endpoint()


def resolve_target(endpoint: str | None = None, config: str | None = None, token: str | None = None,
                   server_key: str | None = None) -> Target:
    """One precedence for every command: flags, then the daemon's config file, then the environment
    (EXPERTD_ENDPOINT, EXPERTD_TOKEN); the config is read once."""
    cfg = load_config(config) if config else None
    if endpoint:
        endpoint = resolve_endpoint(endpoint)
    elif cfg is not None:
        endpoint = cfg.endpoint
    elif os.environ.get("EXPERTD_ENDPOINT"):
        endpoint = resolve_endpoint(os.environ["EXPERTD_ENDPOINT"], where="$EXPERTD_ENDPOINT")
    token = token or (cfg.auth_token if cfg is not None else None) or os.environ.get("EXPERTD_TOKEN") or None
    return Target(endpoint, token, cfg, server_key)


def _resolve(path: str, base_dir: str) -> str:
    path = os.path.expanduser(path)
    return path if os.path.isabs(path) else os.path.normpath(os.path.join(base_dir, path))


def target_of(args) -> Target:
    """`resolve_target` for a CLI command's parsed arguments (whichever of --endpoint, --config, --token,
    --server-key it has)."""
    return resolve_target(getattr(args, "endpoint", None), getattr(args, "config", None), getattr(args, "token", None),
                          getattr(args, "server_key", None))


def connection_of(args, timeout: float | None = None):
    """The control connection a CLI command's arguments name (timeout: `args.timeout` unless given)."""
    from expertd.connection import Connection

    target = target_of(args)
    return Connection(target.daemon_endpoint, timeout=args.timeout if timeout is None else timeout,
                      credentials=target.credentials)
