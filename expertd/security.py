"""What a client presents to a daemon: its auth token, its push token, and ZeroMQ CURVE keys over tcp://.

CURVE (ZeroMQ's elliptic-curve encryption, libsodium inside pyzmq) encrypts every frame and authenticates
both ends: a client must know the daemon's public key, and the daemon sees each client's public key. Key
files are ZeroMQ's own certificate format (`expertd keys` writes them with `zmq.auth.create_certificates`):
`NAME.key` holds the public key, `NAME.key_secret` both. Pushing weights and administering the daemon (reload,
stop) are permissions of their own (which ops need which: `expertd.messages.PERMISSIONS`): a `push_token` /
`admin_token` (any transport) or, under CURVE, a client key on the daemon's push / admin allow-list. Over tcp://
without CURVE nothing is encrypted and nothing says who listens (a local user may bind the port while the daemon is
down): no token goes out there unless the caller says so (`allow_plain_tcp_tokens`, `Credentials.check_transport`).
"""

from __future__ import annotations

import os
from dataclasses import dataclass

from .errors import ConfigError
from .messages import ADMIN, PERMISSIONS, PUSH
from .option_words import CLI, OptionWords

Z85_KEY_CHARS = 40
PLAIN_TCP_ENV = "EXPERTD_ALLOW_PLAIN_TCP_TOKENS"
TOKEN_FIELDS = {"token": "auth_token", "push_token": "push_token", "admin_token": "admin_token"}  # field: config key


def public_key(value: str, where: str = "server key") -> bytes:
    """A CURVE public key: its 40 z85 characters, or a key file (`NAME.key` / `NAME.key_secret`) holding it."""
    value = value.strip()
    if len(value) == Z85_KEY_CHARS and not os.path.exists(value):
        return value.encode("ascii")
    public, _ = _load(value, where)
    return public


def key_pair(path: str, where: str = "client key") -> tuple[bytes, bytes]:
    """(public, secret) from a `NAME.key_secret` file."""
    public, secret = _load(path, where)
    if secret is None:
        raise ConfigError(f"{where} {path}: holds no secret key; use the NAME.key_secret file `expertd keys` wrote")
    return public, secret


def _load(path: str, where: str) -> tuple[bytes, bytes | None]:
    import zmq.auth

    try:
        public, secret = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as exc:
        raise ConfigError(f"{where} {path}: not a readable ZeroMQ key file ({exc}); "
                          "make one with `expertd keys`") from None
    if public is None:
        raise ConfigError(f"{where} {path}: holds no public key")
    return public, secret


def create_keys(folder: str, name: str) -> tuple[str, str]:
    """Write NAME.key (public, to hand out) and NAME.key_secret (0600, to keep) into `folder`."""
    import zmq.auth

    os.makedirs(folder, mode=0o700, exist_ok=True)
    for suffix in (".key", ".key_secret"):
        if os.path.exists(os.path.join(folder, name + suffix)):
            raise ConfigError(f"{os.path.join(folder, name + suffix)} exists; choose another name or folder")
    public, secret = zmq.auth.create_certificates(folder, name)
    os.chmod(secret, 0o600)
    return public, secret


@dataclass(frozen=True)
class Credentials:
    token: str | None = None  # the daemon's auth_token: any request
    push_token: str | None = None  # the daemon's push_token: updates
    admin_token: str | None = None  # the daemon's admin_token: reload, stop (and pushes, when no push_token is given)
    server_key: bytes | None = None  # the daemon's CURVE public key (z85): tcp:// with CURVE
    client_public: bytes | None = None  # this client's CURVE key pair; an ephemeral one when not given
    client_secret: bytes | None = None
    allow_plain_tcp_tokens: bool = False  # send tokens over tcp:// without CURVE all the same (`check_transport`)

    @classmethod
    def resolve(cls, token: str | None = None, push_token: str | None = None, server_key: str | bytes | None = None,
                client_key: str | None = None, admin_token: str | None = None,
                allow_plain_tcp_tokens: bool | None = None) -> "Credentials":
        """Arguments first, then $EXPERTD_TOKEN, $EXPERTD_PUSH_TOKEN, $EXPERTD_ADMIN_TOKEN, $EXPERTD_SERVER_KEY (z85
        or a key file), $EXPERTD_CLIENT_KEY (a NAME.key_secret file) and $EXPERTD_ALLOW_PLAIN_TCP_TOKENS (1)."""
        if allow_plain_tcp_tokens is None:
            allow_plain_tcp_tokens = os.environ.get(PLAIN_TCP_ENV, "").strip().lower() in ("1", "true", "yes")
        token = token if token is not None else os.environ.get("EXPERTD_TOKEN") or None
        push_token = push_token if push_token is not None else os.environ.get("EXPERTD_PUSH_TOKEN") or None
        admin_token = admin_token if admin_token is not None else os.environ.get("EXPERTD_ADMIN_TOKEN") or None
        server_key = server_key if server_key is not None else os.environ.get("EXPERTD_SERVER_KEY") or None
        client_key = client_key if client_key is not None else os.environ.get("EXPERTD_CLIENT_KEY") or None
        if isinstance(server_key, str):
            server_key = public_key(server_key)
        public = secret = None
        if client_key is not None:
            public, secret = key_pair(client_key)
        elif server_key is not None:  # one ephemeral key pair for every connection of this client: the daemon counts
            import zmq                # leases and checks heartbeats per CURVE key

            public, secret = zmq.curve_keypair()
        return cls(token, push_token, admin_token, server_key, public, secret, bool(allow_plain_tcp_tokens))

    def check_transport(self, endpoint: str, message: dict, words: OptionWords = CLI) -> None:
        """ConfigError (naming the endpoint, the option and the risk) before a request carrying a token goes to a
        tcp:// endpoint without CURVE, unless `allow_plain_tcp_tokens`: whoever answers there gets it."""
        carried = [TOKEN_FIELDS[k] for k in TOKEN_FIELDS if message.get(k) is not None]
        if not carried or self.server_key is not None or self.allow_plain_tcp_tokens or not endpoint.startswith("tcp://"):
            return
        raise ConfigError(
            f"not sending the {' and the '.join(carried)} to {endpoint}: tcp:// without CURVE is plain text, and any "
            "local user who binds that port while the daemon is down (or anyone on the path) would receive it; give "
            f"the daemon's public key ({words.server_key}, $EXPERTD_SERVER_KEY, server_key=) or, accepting that risk, "
            "set "
            f"allow_plain_tcp_tokens: true in the config, {PLAIN_TCP_ENV}=1, or ExpertClient(..., "
            "allow_plain_tcp_tokens=True)")

    def for_op(self, op: str) -> dict:
        """The permission tokens a request for `op` carries: the push_token with the push ops (the admin_token when
        there is no push_token), the admin_token with the admin ops; none with the others."""
        needs = PERMISSIONS.get(op)
        if needs == PUSH and self.push_token is not None:
            return {"push_token": self.push_token}
        if needs in (PUSH, ADMIN) and self.admin_token is not None:
            return {"admin_token": self.admin_token}
        return {}

    def secure(self, sock) -> None:
        """Make `sock` a CURVE client of the daemon (when a server key is known)."""
        if self.server_key is None:
            return
        import zmq

        public, secret = self.client_public, self.client_secret
        if public is None:
            public, secret = zmq.curve_keypair()
        sock.curve_serverkey = self.server_key
        sock.curve_publickey = public
        sock.curve_secretkey = secret
