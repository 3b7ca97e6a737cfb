"""CURVE on the daemon's tcp:// control socket: encryption, which clients may connect, which may push.

pyzmq's ZAP authenticator (a thread of the daemon) checks each connecting client's public key: any client
that knows the daemon's public key, or only those in `curve_client_keys`; it stamps each request with the
client's key (`User-Id`), which the daemon compares with `curve_push_keys` and `curve_admin_keys` (server.permissions).
The daemon's own key pair (what `expertd status --config` on its host presents) is always allowed, to connect and as
admin; a key in `curve_admin_keys` may connect too.
"""

from __future__ import annotations

import logging

from expertd.security import key_pair

log = logging.getLogger("expertd.daemon")


def _keys(folder: str | None) -> set[str]:
    import zmq.auth

    return {k.decode("ascii") for k in zmq.auth.load_certificates(folder)} if folder else set()


class Curve:
    def __init__(self, authenticator, own: str, clients: set[str] | None, pushers: set[str], admins: set[str]):
        self.authenticator, self.own = authenticator, own
        self.clients, self.pushers, self.admins = clients, pushers, admins

    @classmethod
    def serve(cls, ctx, sock, cfg) -> "Curve":
        """Make `sock` a CURVE server with the config's keys, its authenticator running."""
        from zmq.auth.thread import ThreadAuthenticator

        public, secret = key_pair(cfg.curve_secret_key, "curve_secret_key")
        own = public.decode("ascii")
        admins = _keys(cfg.curve_admin_keys) | {own}
        clients = _keys(cfg.curve_client_keys) | admins if cfg.curve_client_keys else None
        curve = cls(ThreadAuthenticator(ctx, log=log.getChild("zap")), own, clients,
                    _keys(cfg.curve_push_keys) | admins, admins)
        curve.authenticator.start()
        curve.authenticator.configure_curve_callback("*", curve)
        sock.curve_secretkey, sock.curve_publickey, sock.curve_server = secret, public, True
        log.info("CURVE on: %s client key(s) may connect, %d may push, %d are admin",
                 "any" if clients is None else len(clients), len(curve.pushers), len(admins))
        if clients is None:
            log.warning("CURVE without curve_client_keys: anyone with this daemon's public key can connect and take "
                        "leases; every key not named in curve_push_keys or curve_admin_keys counts as one reader, "
                        "'anonymous', for leases (max_leases_per_client=%d), derived tensors and the derivation "
                        "queue; set curve_client_keys to name who may connect", cfg.max_leases_per_client)
        return curve

    def callback(self, domain: str, key: bytes) -> bool:
        """ZAP: may this client key connect at all?"""
        return self.clients is None or key.decode("ascii") in self.clients

    def listed(self, key: str) -> bool:
        """Whether the config names `key` (a client, pusher or admin key): an unlisted one is "anonymous"."""
        return (self.clients is not None and key in self.clients) or key in self.pushers or key in self.admins

    def may_push(self, key: str | None) -> bool:
        return key is not None and key in self.pushers

    def may_admin(self, key: str | None) -> bool:
        return key is not None and key in self.admins

    def stop(self) -> None:
        self.authenticator.stop()
