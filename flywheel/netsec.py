"""Security of the links between services: ZeroMQ CURVE and Redis credentials.

CURVE (``security.curve``): every ZeroMQ server socket (the hub's generator and reward ROUTERs,
the learner's weight-sync PUB and ROUTER) is a CURVE server holding the run's server key, and a
ZAP handler lets a client finish the handshake only when its public key lies in
``<keys_dir>/authorized``. A refused peer never gets a message through: ZeroMQ drops it in the
handshake, before the service reads a byte, and the peer receives nothing. Every client socket
(generators, reward service, simulated generators) proves the client key and checks the
server's. ``flywheel keys DIR`` (``create_keys``) makes::

    DIR/server.key          server public key: every client needs it
    DIR/server.key_secret   server keypair: only the hub and the learner need it
    DIR/client.key          client public key
    DIR/client.key_secret   client keypair: every client needs it
    DIR/authorized/*.key    client public keys the servers accept (client.key to start with)

Redis: ``redis_client`` connects with the credentials of ``redis.url``
(``redis://user:pass@host:port/0``) or of ``redis.username`` / ``redis.password_file``;
``mask_credentials`` keeps passwords out of logs and messages.
"""

from __future__ import annotations

import logging
import os
import shutil
import threading
import time
from pathlib import Path
from typing import TYPE_CHECKING, Any

import zmq
import zmq.auth
from zmq.auth.thread import ThreadAuthenticator

from flywheel.config import RedisConfig, SecurityConfig, mask_credentials

if TYPE_CHECKING:
    import redis

log = logging.getLogger(__name__)

SERVER, CLIENT, AUTHORIZED = "server", "client", "authorized"
REREAD_S = 1.0  # an unknown key re-reads authorized/ at most this often: keys added while running count

__all__ = [
    "check_keys",
    "create_keys",
    "curve_client",
    "curve_server",
    "mask_credentials",
    "redis_client",
    "refused_peers",
]


# --------------------------------------------------------------------------- CURVE keys


def create_keys(directory: str | Path, reuse: bool = False) -> Path:
    """Make the server and client keypairs in ``directory`` and authorise the client key. An
    existing set is kept when ``reuse`` (a resumed run), refused otherwise (never overwritten)."""
    d = Path(directory)
    if (d / f"{SERVER}.key_secret").exists():
        if reuse:
            return d
        raise ValueError(f"{d} already holds CURVE keys: pick an empty directory (keys are never overwritten)")
    if not d.exists():
        d.mkdir(parents=True)
        d.chmod(0o700)  # before any secret is written into it
    (d / AUTHORIZED).mkdir(exist_ok=True)
    for name in (SERVER, CLIENT):
        _public, secret = zmq.auth.create_certificates(d, name)
        os.chmod(secret, 0o600)
    shutil.copy(d / f"{CLIENT}.key", d / AUTHORIZED / f"{CLIENT}.key")
    return d


def _keys_dir(sec: SecurityConfig) -> Path:
    if sec.keys_dir is None:
        raise ValueError(
            "security.curve is on but security.keys_dir is unset: make keys with `flywheel keys DIR` and pass "
            "--security.keys_dir DIR (flywheel run makes them itself)"
        )
    return Path(sec.keys_dir)


def _load(path: Path, secret: bool) -> tuple[bytes, bytes]:
    try:
        public, secret_key = zmq.auth.load_certificate(path)
    except (OSError, ValueError) as err:
        raise ValueError(f"CURVE key {path}: {err}; make keys with `flywheel keys DIR`") from None
    if secret and secret_key is None:
        raise ValueError(f"CURVE key {path} holds no secret key")
    return public, secret_key or b""


class _AuthorizedKeys:
    """The ZAP credentials provider: a client key passes when it is in ``directory``."""

    def __init__(self, directory: Path) -> None:
        if not directory.is_dir():
            raise ValueError(f"CURVE authorized-keys directory {directory} not found: see `flywheel keys DIR`")
        self.directory = directory
        self.refused = 0
        self._keys = set(zmq.auth.load_certificates(directory))
        self._read_at = time.monotonic()
        self._logged_at = -1e18

    def callback(self, domain: str, key: bytes) -> bool:  # called on the authenticator's thread
        if key not in self._keys and time.monotonic() - self._read_at >= REREAD_S:
            self._read_at = time.monotonic()
            try:
                self._keys = set(zmq.auth.load_certificates(self.directory))
            except (OSError, ValueError) as err:
                log.error("cannot re-read %s (%s): keeping the keys read before", self.directory, err)
        if key in self._keys:
            return True
        self.refused += 1
        if time.monotonic() - self._logged_at >= 10.0:
            self._logged_at = time.monotonic()
            log.warning(
                "refused a ZeroMQ peer: its CURVE key %s is not in %s (%d refused so far)",
                key.decode(errors="replace"),
                self.directory,
                self.refused,
            )
        return False


_gates: dict[int, tuple[ThreadAuthenticator, _AuthorizedKeys]] = {}  # by id(context): one ZAP handler each
_lock = threading.Lock()


def _gate(ctx: zmq.Context[Any], directory: Path) -> _AuthorizedKeys:
    with _lock:
        entry = _gates.get(id(ctx))
        if entry is None:
            keys = _AuthorizedKeys(directory)
            auth = ThreadAuthenticator(ctx, log=logging.getLogger("flywheel.netsec.zap"))
            auth.start()
            auth.configure_curve_callback("*", credentials_provider=keys)
            entry = _gates[id(ctx)] = (auth, keys)
        elif entry[1].directory != directory:
            raise ValueError(
                f"one process serves one authorized-keys directory ({entry[1].directory}, not {directory})"
            )
        return entry[1]


def curve_server(sock: zmq.Socket[Any], sec: SecurityConfig | None) -> None:
    """Make ``sock`` (before it binds) a CURVE server that accepts only authorised clients.
    Does nothing when ``security.curve`` is off."""
    if sec is None or not sec.curve:
        return
    d = _keys_dir(sec)
    public, secret = _load(d / f"{SERVER}.key_secret", secret=True)
    _gate(sock.context, d / AUTHORIZED)
    sock.curve_secretkey = secret
    sock.curve_publickey = public
    sock.curve_server = True


def curve_client(sock: zmq.Socket[Any], sec: SecurityConfig | None) -> None:
    """Give ``sock`` (before it connects) the client keypair and the server key to check.
    Does nothing when ``security.curve`` is off."""
    if sec is None or not sec.curve:
        return
    d = _keys_dir(sec)
    server_public, _ = _load(d / f"{SERVER}.key", secret=False)
    public, secret = _load(d / f"{CLIENT}.key_secret", secret=True)
    sock.curve_serverkey = server_public
    sock.curve_publickey = public
    sock.curve_secretkey = secret


def check_keys(sec: SecurityConfig, server: bool) -> None:
    """Raise ``ValueError`` (what to fix) unless the keys a server (or client) needs are readable:
    an entry point calls this before it starts anything."""
    if not sec.curve:
        return
    d = _keys_dir(sec)
    if server:
        _load(d / f"{SERVER}.key_secret", secret=True)
        if not (d / AUTHORIZED).is_dir():
            raise ValueError(f"CURVE authorized-keys directory {d / AUTHORIZED} not found: see `flywheel keys DIR`")
    else:
        _load(d / f"{SERVER}.key", secret=False)
        _load(d / f"{CLIENT}.key_secret", secret=True)


def refused_peers() -> int:
    """CURVE handshakes this process refused because the client key was not authorised. (A peer
    without keys fails the handshake before any key is offered: ZeroMQ counts nothing for it.)"""
    return sum(keys.refused for _, keys in _gates.values())


# --------------------------------------------------------------------------- Redis


def redis_password(rcfg: RedisConfig) -> str | None:
    """The password in ``redis.password_file`` (None when unset)."""
    if rcfg.password_file is None:
        return None
    path = Path(rcfg.password_file)
    try:
        password = path.read_text().strip()
    except OSError as err:
        raise ValueError(f"redis.password_file {path}: {err.strerror}") from None
    if not password or any(ord(c) < 32 for c in password):
        raise ValueError(f"redis.password_file {path} must hold one line: the password")
    return password


def redis_client(rcfg: RedisConfig, url: str | None = None, **kwargs: Any) -> redis.Redis:
    """A client of ``url`` (default ``redis.url``) that authenticates as configured; every call
    times out after ``redis.socket_timeout_s`` unless ``kwargs`` say otherwise."""
    import redis

    url = url or rcfg.url
    if url is None:
        raise ValueError("redis.url is required: pass --redis.url redis://HOST:PORT/0")
    password = redis_password(rcfg)
    if password is not None:
        kwargs.setdefault("password", password)
        if rcfg.username is not None:
            kwargs.setdefault("username", rcfg.username)
    kwargs.setdefault("socket_timeout", rcfg.socket_timeout_s)
    return redis.Redis.from_url(url, **kwargs)
