"""What inference workers import: attach to expertd, get zero-copy views and a ready model.

Never imports server code or Triton.
"""

from expertd.errors import (
    AuthError, Busy, CorruptIndex, DaemonError, DaemonNotRunning, DaemonNotTrusted, DaemonTimeout, ExpertdError,
    GenerationGone, GenerationLimit, LeaseExpired, LeaseLimit, NotReady, PermissionDenied, ProtocolError, PushDenied,
    RestoreError, ShmError, UpdateRejected, VersionMismatch,
)
from expertd.partition import PartitionError

from .client import ExpertClient
from .hooks import on_model_loaded, remove_model_hook
from .push import push_all
from .restore import RestoreResult, restore

__all__ = ["ExpertClient", "on_model_loaded", "remove_model_hook", "restore", "RestoreResult", "push_all",
           "ExpertdError", "DaemonError", "DaemonNotRunning", "DaemonNotTrusted", "DaemonTimeout", "NotReady",
           "LeaseExpired", "LeaseLimit", "Busy", "GenerationGone", "GenerationLimit", "UpdateRejected",
           "PermissionDenied", "PushDenied", "AuthError", "VersionMismatch", "ProtocolError", "CorruptIndex",
           "ShmError", "RestoreError", "PartitionError"]
