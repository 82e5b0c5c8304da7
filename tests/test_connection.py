"""zkq's kazoo client: a request made while ZooKeeper is away fails at once, never waits."""

from __future__ import annotations

import threading

import pytest
from kazoo.exceptions import ConnectionLoss

from tests.conftest import Relay, wait_for
from zkqueue.plumbing.connection import ConnectionSettings


def test_a_request_made_while_zookeeper_is_away_fails_at_once(relay: Relay, root: str) -> None:
    """kazoo alone would hold it until the connection is back; the session goes on after."""
    zk = ConnectionSettings(hosts=f"127.0.0.1:{relay.port}", session_timeout=10.0).make_client()
    zk.start(timeout=10)
    try:
        zk.ensure_path(root)
        session = zk.client_id
        relay.cut()
        wait_for(lambda: not zk.connected, message="the client to notice")
        outcome: list[BaseException | list[str]] = []

        def read() -> None:
            try:
                outcome.append(zk.get_children(root))
            except BaseException as exc:
                outcome.append(exc)

        reader = threading.Thread(target=read, daemon=True)
        reader.start()
        reader.join(5.0)
        assert not reader.is_alive(), "the read waits for ZooKeeper to come back"
        assert isinstance(outcome[0], ConnectionLoss)
        multi = zk.transaction()
        multi.create(f"{root}/x")
        with pytest.raises(ConnectionLoss):  # a multi too
            multi.commit()
        relay.restore()
        wait_for(lambda: zk.connected, timeout=15, message="the client to reconnect")
        assert zk.client_id == session  # the same session, resumed
        assert zk.get_children(root) == []
    finally:
        zk.stop()
        zk.close()
