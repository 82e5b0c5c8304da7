"""The worker daemon: SIGTERM drains, a second signal releases, systemd hears READY/STOPPING."""

from __future__ import annotations

import signal
import socket
import time
from pathlib import Path

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionLoss

from tests.conftest import Relay, WorkerThread, running_on, wait_for
from workers.loop import GOODBYE_TIMEOUT, Worker
from workers.options import WorkerOptions
from workers.runners.echo import EchoRunner
from workers.systemd import Notifier
from zkqueue import Client
from zkqueue.plumbing.connection import ConnectionSettings

pytestmark = pytest.mark.slow


def test_sigterm_drains_the_running_job_then_exits_0(client: Client, spawn_worker) -> None:
    proc = spawn_worker("--runner", "echo", "--echo-delay", "2", "--name", "drainer")
    wait_for(lambda: client.workers(), message="worker registered")
    job = client.submit("finish me", detach=True)
    wait_for(lambda: running_on(client, job.id), message="job running")
    proc.send_signal(signal.SIGTERM)
    wait_for(lambda: _draining(client) or proc.poll() is not None, message="draining")
    assert proc.wait(30) == 0
    record = job.result(timeout=1)
    assert (record.status, record.worker) == ("succeeded", "drainer")
    assert client.workers() == []


def test_second_sigterm_releases_at_once(client: Client, spawn_worker) -> None:
    proc = spawn_worker("--runner", "echo", "--echo-delay", "120", "--name", "leaver")
    wait_for(lambda: client.workers(), message="worker registered")
    job = client.submit("hand me over", detach=True)
    wait_for(lambda: running_on(client, job.id), message="job running")
    proc.send_signal(signal.SIGTERM)
    wait_for(lambda: _draining(client), message="draining")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert job.status() == "pending"
    spawn_worker("--runner", "echo", "--name", "taker")
    record = job.result(timeout=20)
    assert (record.status, record.worker, record.attempts) == ("succeeded", "taker", 2)


def test_drain_timeout_releases_what_is_left(client: Client, spawn_worker) -> None:
    proc = spawn_worker("--runner", "echo", "--echo-delay", "120", "--drain-timeout", "1")
    wait_for(lambda: client.workers(), message="worker registered")
    job = client.submit("too slow", detach=True)
    wait_for(lambda: running_on(client, job.id), message="job running")
    proc.send_signal(signal.SIGTERM)
    assert proc.wait(30) == 0
    assert job.status() == "pending"


def test_systemd_notify_protocol(client: Client, spawn_worker, tmp_path: Path) -> None:
    address = str(tmp_path / "notify.sock")
    sock = socket.socket(socket.AF_UNIX, socket.SOCK_DGRAM)
    sock.bind(address)
    sock.settimeout(30)
    try:
        proc = spawn_worker(
            "--runner", "echo", env={"NOTIFY_SOCKET": address, "WATCHDOG_USEC": "400000"}
        )
        messages = [sock.recv(4096).decode() for _ in range(2)]
        assert any(m.startswith("READY=1") for m in messages), messages
        assert any("WATCHDOG=1" in m for m in messages), messages
        assert client.workers(), "READY=1 comes after registration"
        proc.send_signal(signal.SIGTERM)
        seen: list[str] = []
        while not any("STOPPING=1" in m for m in seen):
            seen.append(sock.recv(4096).decode())
        assert proc.wait(30) == 0
    finally:
        sock.close()


def test_notifier_is_a_no_op_outside_systemd(monkeypatch) -> None:
    monkeypatch.delenv("NOTIFY_SOCKET", raising=False)
    assert Notifier().ready() is False


def _draining(client: Client) -> bool:
    """The worker says it is draining (one read: it may unregister between two)."""
    records = client.workers()
    return bool(records) and records[0]["state"] == "draining"


def test_a_worker_says_what_it_does_at_the_default_level(zkq, client: Client) -> None:
    """No --log-level: a worker logs at info (registered, stopped); -q keeps it to warnings."""
    client.submit("one job", detach=True)
    out = zkq("worker", "--burst", timeout=60)
    assert out.returncode == 0, out.stderr
    assert "registered worker" in out.stderr and "queue default" in out.stderr
    assert "stopped" in out.stderr
    quiet = zkq("worker", "--burst", "-q", timeout=60)
    assert quiet.returncode == 0 and "registered worker" not in quiet.stderr


def test_a_worker_stopped_while_zookeeper_is_away_still_stops(relay: Relay, root: str) -> None:
    """kazoo holds a request made while it is disconnected until ZooKeeper comes back: zkq's
    client fails it at once instead (the loop, whatever call it was in, gets to the stop), and
    a worker stopped then sends nothing to leave the line or unregister (its nodes are
    ephemeral, and go with its session); connected, it waits at most GOODBYE_TIMEOUT."""
    zk = ConnectionSettings(hosts=f"127.0.0.1:{relay.port}", session_timeout=4.0).make_client()
    zk.start(timeout=10)
    try:
        opts = WorkerOptions(root=root, heartbeat_interval=0.5)
        worker = WorkerThread(Worker(zk, EchoRunner(), opts)).start()
        relay.cut()  # ZooKeeper goes away
        wait_for(lambda: not zk.connected, message="the worker's client to notice")
        stopping = time.monotonic()
        worker.stop(drain=True, timeout=GOODBYE_TIMEOUT + 15)
        assert not worker.thread.is_alive(), "the worker waits for ZooKeeper to come back"
        assert time.monotonic() - stopping < GOODBYE_TIMEOUT + 10
        assert worker.error is None
    finally:
        zk.stop()
        zk.close()


def test_a_worker_registers_again_though_its_first_try_after_a_lost_session_fails(
    start_worker, client: Client, hosts: str
) -> None:
    """The session expires; the first register under the new one fails (the connection went
    again before it was sent). An idle worker's record never changes, so no rewrite would
    bring it back: the loop keeps the register due until it succeeds."""
    handle = start_worker()
    worker = handle.worker
    real = worker.registry.register
    failed: list[float] = []

    def register_failing_once(wait: float = 0.0) -> None:
        if not failed:
            failed.append(wait)
            raise ConnectionLoss("the connection went again")
        real(wait)

    worker.registry.register = register_failing_once  # type: ignore[method-assign]
    # Expire the worker's session from outside (what a long partition does).
    ghost = KazooClient(hosts=hosts, client_id=worker.zk.client_id)
    ghost.start(timeout=10)
    ghost.stop()
    ghost.close()
    wait_for(lambda: failed, timeout=20, message="a register under the new session")
    wait_for(
        lambda: worker.id in {r["id"] for r in client.workers()},
        message="the worker registered again",
    )
