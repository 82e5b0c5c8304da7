"""Connecting to ZooKeeper: settings, the kazoo client, and the mapping of kazoo's errors."""

from __future__ import annotations

import logging
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionLoss, OperationTimeoutError, SessionExpiredError
from kazoo.handlers.threading import KazooTimeoutError
from kazoo.retry import KazooRetry

from zkqueue import defaults
from zkqueue.errors import ZkqConnectionError

log = logging.getLogger("zkq.connection")


@dataclass(frozen=True)
class ConnectionSettings:
    """How to reach the ensemble. ``hosts`` is a kazoo connection string: "h1:2181,h2:2181"."""

    hosts: str = defaults.HOSTS
    session_timeout: float = defaults.SESSION_TIMEOUT
    connect_timeout: float = defaults.CONNECT_TIMEOUT

    def make_client(self) -> KazooClient:
        # Retry forever on connection loss: zkq decides itself when to give up (timeouts, drains).
        retry = {"max_tries": -1, "delay": 0.1, "max_delay": 1.0, "backoff": 2}
        return KazooClient(
            hosts=self.hosts,
            timeout=self.session_timeout,
            connection_retry=KazooRetry(**retry),
            command_retry=None,
        )


def connect(settings: ConnectionSettings) -> KazooClient:
    """Start a session, or raise ZkqConnectionError with the hosts named."""
    zk = settings.make_client()
    try:
        zk.start(timeout=settings.connect_timeout)
    except KazooTimeoutError:
        zk.stop()
        zk.close()
        raise ZkqConnectionError(
            f"cannot reach ZooKeeper at {settings.hosts} within {settings.connect_timeout:g}s"
        ) from None
    return zk


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
    except (ConnectionLoss, SessionExpiredError, OperationTimeoutError, KazooTimeoutError) as exc:
        raise ZkqConnectionError(f"lost ZooKeeper at {hosts}: {type(exc).__name__}") from exc
