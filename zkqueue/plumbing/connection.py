"""Connecting to ZooKeeper: settings, the kazoo client, and the mapping of kazoo's errors.

Security: with ``auth`` ("user:password") the session authenticates with ZooKeeper's digest
scheme and every node zkq creates carries an ACL giving that identity all rights and anyone else
none. With ``tls_ca`` (and, for mutual TLS, ``tls_cert``/``tls_key``) the connection is TLS.
"""

from __future__ import annotations

import asyncio
import logging
import re
import threading
import time
from collections.abc import Awaitable, Callable, Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kazoo.client import KazooClient
from kazoo.exceptions import (
    AuthFailedError,
    ConnectionLoss,
    NoAuthError,
    OperationTimeoutError,
    SessionExpiredError,
)
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.protocol.states import KazooState, KeeperState
from kazoo.retry import KazooRetry
from kazoo.security import make_digest_acl

from zkqueue import defaults
from zkqueue.errors import AccessDenied, ConfigurationError, ZkqConnectionError
from zkqueue.plumbing.handler import PollingHandler

log = logging.getLogger("zkq.connection")
#: ZooKeeper errors that mean "the connection is away for now": wait for it and try again.
TRANSIENT = (ConnectionLoss, SessionExpiredError, OperationTimeoutError)
#: How often a caller waiting for kazoo to reconnect looks at the connection state.
RECONNECT_POLL = 0.05
_T = TypeVar("_T")


class _RedactAuth(logging.Filter):
    """kazoo logs every request at DEBUG, digest credentials included: scrub them."""

    _PATTERN = re.compile(r"auth='[^']*'")

    def filter(self, record: logging.LogRecord) -> bool:
        message = record.getMessage()
        if "auth=" in message:
            record.msg, record.args = self._PATTERN.sub("auth='***'", message), ()
        return True


for _name in ("kazoo.client", "kazoo.protocol.connection"):
    logging.getLogger(_name).addFilter(_RedactAuth())


class FailFastClient(KazooClient):
    """kazoo's client, except that a request made while the connection is away fails at once
    with ConnectionLoss.

    kazoo holds such a request until it reconnects, however long that takes, so a thread that
    made it (a worker's loop asked to stop, a producer's pool thread) hangs while ZooKeeper is
    away. zkq treats ConnectionLoss everywhere as "wait for the connection and try again"
    (``TRANSIENT``), with its own bounds; requests already sent or queued when a connection
    drops fail with ConnectionLoss in kazoo too, so this is the one case it left unbounded."""

    def _call(self, request: Any, async_object: Any) -> Any:
        if self.client_state == KeeperState.CONNECTING:
            async_object.set_exception(ConnectionLoss("not connected to ZooKeeper"))
            return False
        return super()._call(request, async_object)


@dataclass(frozen=True)
class ConnectionSettings:
    """How to reach the ensemble. ``hosts`` is a kazoo connection string: "h1:2181,h2:2181"."""

    hosts: str = defaults.HOSTS
    session_timeout: float = defaults.SESSION_TIMEOUT
    connect_timeout: float = defaults.CONNECT_TIMEOUT
    #: "user:password" for digest authentication; never logged or shown.
    auth: str | None = field(default=None, repr=False)
    tls_ca: str | None = None
    tls_cert: str | None = None
    tls_key: str | None = None

    def __post_init__(self) -> None:
        if self.auth is not None:
            user, sep, password = self.auth.partition(":")
            if not sep or not user or not password:
                raise ConfigurationError("--auth must be USER:PASSWORD (both non-empty)")
        if bool(self.tls_cert) != bool(self.tls_key):
            raise ConfigurationError("--tls-cert and --tls-key go together")
        if (self.tls_cert or self.tls_key) and not self.tls_ca:
            raise ConfigurationError("TLS client certificates need --tls-ca too")
        for name in ("tls_ca", "tls_cert", "tls_key"):
            value = getattr(self, name)
            if value and not Path(value).is_file():
                raise ConfigurationError(f"--{name.replace('_', '-')} {value}: no such file")

    def make_client(self) -> KazooClient:
        # Retry forever on connection loss: zkq decides itself when to give up (timeouts, drains).
        retry = {"max_tries": -1, "delay": 0.1, "max_delay": 1.0, "backoff": 2}
        return FailFastClient(
            hosts=self.hosts,
            timeout=self.session_timeout,
            connection_retry=KazooRetry(**retry),
            command_retry=None,
            handler=PollingHandler(),
            **self._security(),
        )

    def _security(self) -> dict[str, Any]:
        options: dict[str, Any] = {}
        if self.auth is not None:
            user, _, password = self.auth.partition(":")
            options["auth_data"] = [("digest", self.auth)]
            options["default_acl"] = [make_digest_acl(user, password, all=True)]
        if self.tls_ca:
            options.update(
                use_ssl=True,
                verify_certs=True,
                ca=self.tls_ca,
                certfile=self.tls_cert,
                keyfile=self.tls_key,
            )
        return options


def connect(settings: ConnectionSettings) -> KazooClient:
    """Start a session, or raise ZkqConnectionError with the hosts named (ConfigurationError
    for a connection string that is no list of host:port)."""
    try:
        zk = settings.make_client()
    except ValueError as exc:
        raise _bad_hosts(settings.hosts, exc) from None
    try:
        zk.start(timeout=settings.connect_timeout)
    except ValueError as exc:  # kazoo resolves some addresses only when it connects
        close(zk)
        raise _bad_hosts(settings.hosts, exc) from None
    except AuthFailedError:
        close(zk)
        raise AccessDenied(f"ZooKeeper at {settings.hosts} refused the credentials") from None
    except KazooTimeoutError:
        zk.stop()
        zk.close()
        raise ZkqConnectionError(
            f"cannot reach ZooKeeper at {settings.hosts} within {settings.connect_timeout:g}s"
        ) from None
    return zk


def _bad_hosts(hosts: str, exc: ValueError) -> ConfigurationError:
    return ConfigurationError(
        f"bad ZooKeeper address {hosts!r} (--zk, ZKQ_ZK): {exc}; "
        "write host:port, or several separated by commas"
    )


def close(zk: KazooClient) -> None:
    """Close the session (its ephemeral nodes go at once), never raising."""
    try:
        zk.stop()
        zk.close()
    except Exception:  # closing is best effort: the session expires on its own anyway
        log.debug("error while closing the ZooKeeper client", exc_info=True)


@contextmanager
def mapped_errors(hosts: str) -> Iterator[None]:
    """Turn kazoo's connection errors into ZkqConnectionError at the library boundary."""
    try:
        yield
    except (*TRANSIENT, KazooTimeoutError) as exc:
        raise ZkqConnectionError(f"lost ZooKeeper at {hosts}: {type(exc).__name__}") from exc
    except NoAuthError:
        raise AccessDenied(
            f"ZooKeeper at {hosts} denied access: the zkq root belongs to another identity "
            "(check --auth / ZKQ_AUTH)"
        ) from None


def await_connected(
    zk: KazooClient, settings: ConnectionSettings, deadline: float, doing: str
) -> None:
    """Bounded wait for kazoo to reconnect (to this server or another of the ensemble; after
    an expired session kazoo opens a new one by itself)."""
    while not zk.connected:
        if time.monotonic() > deadline:
            raise _not_back(settings, doing)
        time.sleep(RECONNECT_POLL)


def _not_back(settings: ConnectionSettings, doing: str) -> ZkqConnectionError:
    return ZkqConnectionError(
        f"lost ZooKeeper at {settings.hosts} while {doing} and it did not come back "
        f"within {settings.connect_timeout:g}s"
    )


def lost_error(settings: ConnectionSettings, doing: str, exc: Exception) -> ZkqConnectionError:
    """The error for a call that failed with the connection (``exc``) while ``doing``."""
    return ZkqConnectionError(
        f"lost ZooKeeper at {settings.hosts} while {doing}: {type(exc).__name__}"
    )


def send_when_connected(zk: KazooClient, send: Callable[[], Any]) -> None:
    """Send a request nobody waits for (``send`` makes it, asynchronously) now, or, if the
    connection is away, once it is back: what kazoo itself does with a request made while it
    is disconnected, which zkq's client fails at once. For writes that may be sent twice (a
    delete whose node may be gone); it tries again after every reconnect until one is not
    lost with the connection, and gives up with the session (its ephemeral nodes went with
    it) or the client (closed)."""
    lock = threading.Lock()
    waiting = False  # for a reconnect, with on_state among the listeners

    def attempt() -> None:
        send().rawlink(check)

    def check(call: Any) -> None:
        nonlocal waiting
        if not isinstance(call.exception, TRANSIENT) or zk.client_state == KeeperState.CLOSED:
            return
        with lock:
            if waiting:
                return
            waiting = True
        zk.add_listener(on_state)
        if zk.connected:  # back before the listener was in place: it may not be told
            on_state(KazooState.CONNECTED)

    def on_state(state: KazooState) -> bool:
        nonlocal waiting
        if state == KazooState.SUSPENDED:
            return False
        with lock:
            if not waiting:
                return False
            waiting = False
        zk.remove_listener(on_state)
        if state == KazooState.CONNECTED:
            attempt()
        return False  # removed already (LOST: the session, or the client, is gone)

    attempt()


def read_through_loss(
    zk: KazooClient, settings: ConnectionSettings, read: Callable[[], _T], doing: str
) -> _T:
    """Run ``read`` (reads, or writes that are idempotent) once kazoo is connected, and if the
    connection goes away meanwhile (lost, or the session expired while ZooKeeper was down) wait
    for kazoo to reconnect and run it again, all within ``connect_timeout``; past it,
    ZkqConnectionError. The wait comes first: a request made while kazoo is disconnected
    fails at once (``FailFastClient``)."""
    deadline = time.monotonic() + settings.connect_timeout
    while True:
        await_connected(zk, settings, deadline, doing)
        try:
            return read()
        except TRANSIENT as exc:
            if time.monotonic() > deadline:
                raise lost_error(settings, doing, exc) from exc


async def read_through_loss_async(
    zk: KazooClient,
    settings: ConnectionSettings,
    read: Callable[[], Awaitable[_T]],
    doing: str,
) -> _T:
    """``read_through_loss`` for an event loop: the same bound, waited for without blocking."""
    deadline = time.monotonic() + settings.connect_timeout
    while True:
        while not zk.connected:
            if time.monotonic() > deadline:
                raise _not_back(settings, doing)
            await asyncio.sleep(RECONNECT_POLL)
        try:
            return await read()
        except TRANSIENT as exc:
            if time.monotonic() > deadline:
                raise lost_error(settings, doing, exc) from exc
