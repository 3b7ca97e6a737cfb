"""One error hierarchy for server, client and kernels.

Each error also inherits the standard exception a caller would naturally catch, so
`except ValueError` keeps working for code that does not know expertd.
"""


class ExpertdError(Exception):
    """Base class of every error expertd raises on purpose."""


class ConfigError(ExpertdError, ValueError):
    """The daemon's YAML config is unreadable, has unknown keys or bad values."""


class CheckpointError(ExpertdError, ValueError):
    """A checkpoint is malformed; the message names the file and the tensor."""

    def __init__(self, message: str, *, file: str | None = None, tensor: str | None = None):
        where = []
        if file is not None:
            where.append(f"file {file}")
        if tensor is not None:
            where.append(f"tensor {tensor!r}")
        super().__init__(f"{message} ({', '.join(where)})" if where else message)
        self.file = file
        self.tensor = tensor


class MissingShardError(CheckpointError, FileNotFoundError):
    """A shard named by the index (or the checkpoint itself) does not exist."""


class NotACheckpointError(CheckpointError, FileNotFoundError):
    """The checkpoint folder lacks what every HuggingFace checkpoint holds: config.json and its *.safetensors."""


class ShardFormatError(CheckpointError):
    """A shard is not a readable safetensors file (truncated, bad header, lying offsets)."""


class NotRegularFileError(CheckpointError):
    """A checkpoint file is a FIFO, a device, a folder or a socket: reading it could block or never end."""


class MissingTensorError(CheckpointError, KeyError):
    """A tensor the model or the index needs is not in the checkpoint."""

    def __str__(self) -> str:  # KeyError would quote the message
        return self.args[0]


class ScaleError(CheckpointError):
    """An FP8 weight has no `*_scale_inv`, or the scale has the wrong shape, dtype or values."""


class ShapeError(CheckpointError):
    """A tensor's shape or dtype does not fit the model the config describes."""


class UnsupportedDtypeError(CheckpointError, TypeError):
    """A tensor is stored in a dtype expertd cannot serve."""


class ShmError(ExpertdError, OSError):
    """Creating, sizing or mapping a shared-memory segment failed."""


class ShmSpaceError(ShmError):
    """The shared-memory folder (/dev/shm, or the daemon's shm_dir) has less free space than the model needs."""


class ProtocolError(ExpertdError, ValueError):
    """A control message is malformed, of an unknown op, or of another protocol version."""


class DaemonError(ExpertdError, RuntimeError):
    """The daemon answered a request with an error; `kind` is the error's name on the wire."""

    def __init__(self, message: str, kind: str | None = None):
        super().__init__(message)
        self.kind = kind or type(self).__name__


def refusal(cls: type, what: str, kind: str, message) -> str:
    """The words of a daemon's error reply `kind`: `message` to `what` (a request, in the user's words), raised as
    `cls`: "daemon refused WHAT: MESSAGE", the kind named only when `cls` does not carry that name (a plain
    DaemonError), then the fix when the class knows one (AuthError: where the token goes)."""
    said = message if cls.__name__ == kind else f"{kind}: {message}"
    fix = getattr(cls, "fix", None)
    return f"daemon refused {what}: {said}" + (f"; {fix}" if fix else "")


class NotReady(DaemonError):
    """The daemon is still loading its first generation."""


class LeaseExpired(DaemonError):
    """The lease named in a request is unknown: expired, released, or granted by a daemon that restarted."""


class LeaseLimit(DaemonError):
    """This holder (a uid on ipc://, a CURVE key on tcp://) already holds `max_leases_per_client` leases, or the
    daemon `max_leases` in all: release one (or close a client) first."""


class MappedLimit(LeaseLimit):
    """This holder may still map generations whose leases ended without a release (revoked, or silent while its
    process lives): those count against `max_leases_per_client` until released or until the process is gone."""


class LeaseRevoked(DaemonError):
    """The lease's generation was revoked to make room for a push (`max_generations` reached and `revoke_after_s`
    passed): take a lease on the latest generation (the Python client does so itself) and release this one."""


class Busy(DaemonError):
    """Another reload or update is being built; one at a time."""


class GenerationGone(DaemonError):
    """The generation a client reads is not served any more: the daemon restarted and could not keep it."""


class GenerationLimit(DaemonError):
    """A new generation would exceed `max_generations` while leases pin the old ones. `retry_after_s` (a float, or
    None) says when the oldest generation's leases are revoked and a retry can proceed (`revoke_after_s`)."""

    retry_after_s: float | None = None


class PermissionDenied(DaemonError, PermissionError):
    """The request's credential is not granted the permission its op needs (`expertd.messages.PERMISSIONS`: read,
    push, admin), or a reload named a folder outside the configured checkpoint and `checkpoint_roots`; the message
    names the op and the permission. Nothing changed."""


class PushDenied(PermissionDenied):
    """A request that would change the served weights came with a credential that may only read (a PermissionDenied:
    the push ops keep this name on the wire for clients that catch it)."""


class AuthError(DaemonError, PermissionError):
    """A request lacked the daemon's auth token or carried a wrong one."""

    fix = ("give the daemon's auth_token (its config key) as $EXPERTD_TOKEN, ExpertClient(token=...) or the CLI's "
           "--token")


class UpdateRejected(DaemonError):
    """An update names unknown tensors, or its shapes, dtypes or staged bytes do not fit."""


class DerivedRejected(DaemonError):
    """A dtype cast was asked for a tensor the generation does not serve, or in a dtype that is not a float type."""


class DerivedLimit(DerivedRejected):
    """Derived tensors (casts and gathers) asked past a quota: the reader's or the daemon's bytes (in pages) or
    files, or the shm_dir space kept for pushes and reloads. Nothing of the request was made."""


class DaemonTimeout(ExpertdError, TimeoutError):
    """The daemon did not answer within the client's timeout."""


class DaemonNotRunning(DaemonError, ConnectionError):
    """No daemon listens on the endpoint: its ipc:// socket file does not exist."""


class DaemonNotTrusted(ExpertdError, PermissionError):
    """The daemon's socket folder, socket or a segment belongs to a user this client does not trust (or is
    writable by others): the client refuses before it sends a token or maps a byte."""


class RestoreError(ExpertdError, ValueError):
    """A view does not fit the model parameter it should be bound to."""


class CorruptIndex(ProtocolError):
    """The tensor index in shared memory is truncated, fails its checksum or is another generation's."""


class VersionMismatch(ProtocolError, DaemonError):
    """The client and the daemon speak different protocol versions; the message names both."""


class ModelMismatch(ExpertdError, ValueError):
    """The daemon serves another model than the one an engine was asked to build (a config value, a tensor name or
    a shape differs); the message names the endpoint and the first difference."""


class MissingDependency(ExpertdError, ImportError):
    """An optional integration was used without the package it needs; the message says what to install."""
