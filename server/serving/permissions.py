"""Who may do what: the permission a request's credential is granted, checked against the one its op needs.

Three permissions (`expertd.messages.PERMISSIONS`), each implying those below it: read < push < admin. A credential
is granted:

- under CURVE (tcp:// with curve_secret_key), by its client key: admin for a key in `curve_admin_keys` and the
  daemon's own key (what the CLI on its host presents), push for a key in `curve_push_keys`, read for any other
  key the handshake let in; the push_token / admin_token raise it on any transport;
- without CURVE, by the token it carries: the admin_token grants admin, the push_token push, the auth_token read;
  a permission whose own token the config does not set goes with the next token below it that it does set (an
  auth_token-only daemon lets its token holders do everything, as before; one with auth_token and push_token lets
  the push_token holders reload and stop too). A bare connection (no token needed) counts only in a single-user
  config: one that sets no token, no CURVE key and no `group`, where every op is allowed as it always was; in a
  `group` config without tokens it may read, and may do everything when the kernel says (SO_PEERCRED) it comes
  from the daemon's own uid (`expertd stop --config` in the daemon's container, as a Kubernetes preStop runs it).

A request whose credential lacks what its op needs gets PermissionDenied (PushDenied for the push ops), naming the
op and the permission, before the op runs: nothing changes. `reload` may moreover read only the configured
checkpoint or a folder under `checkpoint_roots` (`allowed_checkpoint`), whoever asks.
"""

from __future__ import annotations

import hmac
import os

from expertd.errors import PermissionDenied, PushDenied
from expertd.messages import ADMIN, PUSH, RANKS, READ, Request, grants

from .peers import Peer

LADDER = (READ, PUSH, ADMIN)


def _matches(presented, expected: str | None) -> bool:
    return expected is not None and isinstance(presented, str) and \
        hmac.compare_digest(presented.encode(), expected.encode())


class Permissions:
    def __init__(self, cfg, curve=None):
        self.cfg, self.curve = cfg, curve
        self.single_user = not any((cfg.auth_token, cfg.push_token, cfg.admin_token, cfg.curve_secret_key, cfg.group))

    def granted(self, msg: dict, peer: Peer) -> str:
        """The highest permission the credential of `msg` (a decoded request: its tokens) and its `peer` (its CURVE key,
        its uid) holds."""
        cfg = self.cfg
        if self.single_user or _matches(msg.get("admin_token"), cfg.admin_token):
            return ADMIN
        if self.curve is not None:
            key = peer.key
            if self.curve.may_admin(key):
                return ADMIN
            return PUSH if self.curve.may_push(key) or _matches(msg.get("push_token"), cfg.push_token) else READ
        if _matches(msg.get("push_token"), cfg.push_token):
            held = PUSH
        elif cfg.auth_token is not None:
            held = READ  # the daemon checked the auth_token before this
        elif cfg.push_token is None and cfg.admin_token is None and peer.uid == os.geteuid():
            return ADMIN  # a group daemon without tokens: its own uid (SO_PEERCRED) is the single user
        else:
            return READ  # a bare connection to a shared (group) daemon: read only
        tokens = {PUSH: cfg.push_token, ADMIN: cfg.admin_token}
        for higher in LADDER[RANKS[held] + 1:]:  # a permission without a token of its own goes with the one below
            if tokens[higher] is not None:
                break
            held = higher
        return held

    def check(self, request: Request, msg: dict, peer: Peer) -> None:
        """PermissionDenied (PushDenied for a push op) unless the request's credential grants what its op needs."""
        needs = request.permission
        granted = self.granted(msg, peer)
        if grants(granted, needs):
            return
        what = f"op {request.op!r} needs the {needs!r} permission and this credential has {granted!r}"
        if needs == PUSH and self.curve is not None:
            raise PushDenied(f"this client's CURVE key may only read, and {what}: a key in curve_push_keys "
                             f"({self.cfg.curve_push_keys or 'not set: no client may push'}) or the push_token")
        if needs == PUSH:
            raise PushDenied(f"this credential may only read: pushing weights needs the daemon's push_token ({what}; "
                             "ExpertClient(push_token=...) or $EXPERTD_PUSH_TOKEN)")
        raise PermissionDenied(f"{what}: it needs the daemon's admin_token ($EXPERTD_ADMIN_TOKEN, or `expertd "
                               f"{request.op} --config` on the daemon's host) or, under CURVE, a key in "
                               "curve_admin_keys")


def allowed_checkpoint(cfg, checkpoint: str | None) -> str:
    """The folder a reload builds from: the configured checkpoint when none (or that one) is named, else the named
    folder resolved (realpath) if it lies under a `checkpoint_roots` folder after resolving `..` and links; else
    PermissionDenied, before anything in it is opened."""
    if checkpoint is None:
        return cfg.checkpoint
    real = os.path.realpath(os.path.abspath(checkpoint))
    if real == os.path.realpath(cfg.checkpoint):
        return cfg.checkpoint
    if any(os.path.commonpath([real, root]) == root for root in cfg.checkpoint_roots):
        return real
    roots = ", ".join(cfg.checkpoint_roots) or "none set"
    raise PermissionDenied(f"op 'reload' may read only the configured checkpoint {cfg.checkpoint} or a folder "
                           f"under checkpoint_roots ({roots}); {checkpoint!r} resolves to {real}, outside them")
