"""Leases, the janitor, retention, dead letters and backpressure against a real ZooKeeper."""

from __future__ import annotations

import json
import time

import pytest
from prometheus_client import CollectorRegistry

from tests.conftest import result_ids, wait_for
from tests.runners import GateRunner
from workers.metrics import WorkerMetrics
from zkqueue import Client, QueueFull
from zkqueue.errors import ExitCode, InvalidJob, JobNotFound
from zkqueue.operations.janitor import Janitor, JanitorService


@pytest.fixture
def janitor(client: Client) -> Janitor:
    return Janitor(client.zk, client.layout, result_ttl=3600)


def test_hung_worker_loses_its_lease_and_is_fenced(
    client: Client, start_worker, janitor: Janitor
) -> None:
    hung_runner = GateRunner()  # never reports progress: a stuck generation
    hung = start_worker(hung_runner, name="hung", lease=1.0)
    job = client.submit("rescue me", detach=True)
    wait_for(hung_runner.started.is_set, message="hung worker running the job")
    # Its session stays alive (kazoo's own thread pings); only the lease can free the slot.
    reclaimed = wait_for(
        lambda: janitor.run_pass().reclaimed, timeout=15, message="lease reclaimed"
    )
    assert reclaimed == [job.id]
    start_worker(name="healthy")
    record = job.result(timeout=15)
    assert (record.worker, record.attempts, record.status) == ("healthy", 2, "succeeded")
    hung_runner.gate.set()
    wait_for(lambda: hung.worker.busy == 0, message="hung worker woke up")
    assert hung.worker.stats.completed == 0
    assert result_ids(client) == [job.id]


def test_progressing_worker_keeps_its_lease(client: Client, start_worker, janitor: Janitor) -> None:
    from workers.runners.echo import EchoRunner

    handle = start_worker(EchoRunner(delay=3.0), lease=1.0)
    job = client.submit("slow but alive", detach=True)
    wait_for(lambda: handle.worker.busy == 1, message="running")
    deadline = time.monotonic() + 2.5
    while time.monotonic() < deadline and handle.worker.busy:
        assert janitor.run_pass().reclaimed == []
        time.sleep(0.2)
    record = job.result(timeout=10)
    assert (record.status, record.attempts) == ("succeeded", 1)


def test_queue_deadline_expires_jobs_while_every_worker_is_busy(
    client: Client, start_worker, janitor: Janitor
) -> None:
    busy = GateRunner()
    start_worker(busy)
    client.submit("occupies the only slot", detach=True)
    wait_for(busy.started.is_set, message="slot busy")
    waiting = client.submit("too late", detach=True, queue_timeout=0.2)
    wait_for(lambda: janitor.run_pass().expired, timeout=10, message="expired by the janitor")
    record = waiting.result(timeout=1)
    assert record.status == "expired" and "queue_timeout of 0.2s" in (record.error or "")
    busy.gate.set()


def test_old_results_are_removed(client: Client, start_worker) -> None:
    start_worker()
    kept = client.submit("a", detach=True)
    kept.result(timeout=10)
    assert Janitor(client.zk, client.layout, result_ttl=3600).run_pass().results_removed == 0
    wait_for(
        lambda: Janitor(client.zk, client.layout, result_ttl=0.05).run_pass().results_removed == 1,
        message="result removed",
    )
    assert result_ids(client) == []


def test_one_janitor_is_active_and_another_takes_over(client: Client, new_zk) -> None:
    client.ensure_queue("default")
    services = [
        JanitorService(new_zk(), client.layout, f"j{i}", interval=0.1).start() for i in range(3)
    ]
    try:
        wait_for(lambda: sum(s.passes > 0 for s in services) == 1, message="one leader")
        leader = next(s for s in services if s.passes > 0)
        assert [s.passes for s in services if s is not leader] == [0, 0]
        leader.stop()
        wait_for(
            lambda: sum(s.passes > 0 for s in services if s is not leader) == 1,
            message="a successor",
        )
    finally:
        for s in services:
            s.stop()


def test_dead_letters_can_be_listed_and_requeued(client: Client, start_worker, zkq) -> None:
    client.ensure_queue("default")
    pending = client.layout.bucket("default", "normal", 0)
    client.zk.create(f"{pending}/fixable-", b'{"prompt": "x", "max_new_tokens": 2}', sequence=True)
    client.zk.create(f"{pending}/broken-", b"not json", sequence=True)
    # Simulate a poison job: three claims already spent.
    path = client.zk.create(f"{pending}/poison-", b'{"prompt": "retry me"}', sequence=True)
    for _ in range(3):
        client.zk.set(path, b'{"prompt": "retry me"}')
    handle = start_worker()
    assert client.job("fixable").result(timeout=10).ok
    wait_for(lambda: handle.worker.stats.dead_lettered == 2, message="two letters")
    letters = json.loads(zkq("dead", "--json").stdout)
    assert sorted(x["id"] for x in letters) == ["broken", "poison"]
    out = zkq("requeue", "broken")
    assert out.returncode == ExitCode.USAGE and "cannot be requeued" in out.stderr
    out = zkq("requeue", "--all")
    assert out.returncode == 0 and "requeued poison" in out.stdout
    record = client.job("poison").result(timeout=10)
    assert (record.status, record.output, record.attempts) == ("succeeded", "retry me", 1)
    assert [x["id"] for x in client.dead()] == ["broken"]
    with pytest.raises(JobNotFound):
        client.requeue("nope")
    with pytest.raises(InvalidJob):
        client.requeue("broken")


def test_queue_full_fails_fast(client: Client, zkq) -> None:
    client.set_max_pending("default", 2)
    client.submit("1", detach=True)
    client.submit("2", detach=True)
    with pytest.raises(QueueFull, match="queue 'default' is full: 2 jobs waiting, the limit is 2"):
        client.submit("3", detach=True)
    with pytest.raises(QueueFull):
        client.submit_many(["a"])
    out = zkq("submit", "--detach", "4")
    assert out.returncode == ExitCode.QUEUE_FULL and "is full" in out.stderr
    assert client.stats()["queues"]["default"]["pending"] == 2
    assert zkq("queue-limit", "default", "none").returncode == 0
    client.limits._cache.clear()
    client.submit("5", detach=True)


def test_a_janitor_that_loses_the_election_stops_reporting_its_gauges(
    client: Client, new_zk
) -> None:
    """Only the elected janitor sets the stored-results gauges: one that finds another
    elected (here its place in the election was lost, as with its session) clears its own, so
    a sum over processes counts each queue's results once."""
    client.ensure_queue("default")
    registries = [CollectorRegistry(), CollectorRegistry()]
    metrics = [WorkerMetrics(r) for r in registries]
    services = [
        JanitorService(
            new_zk(),
            client.layout,
            f"j{i}",
            interval=0.1,
            on_pass=metrics[i].janitor_pass,
            on_resign=metrics[i].janitor_resigned,
        ).start()
        for i in range(2)
    ]

    def stored(i: int) -> float | None:
        return registries[i].get_sample_value("zkq_results_stored", {"queue": "default"})

    try:
        wait_for(lambda: sum(s.passes > 0 for s in services) == 1, message="one leader")
        first = next(i for i, s in enumerate(services) if s.passes > 0)
        wait_for(lambda: stored(first) == 0, message="the leader's gauge")
        node = services[first]._line.node
        client.zk.delete(f"{client.layout.janitor()}/{node}")  # its place is gone
        wait_for(lambda: services[1 - first].passes > 0, message="the other elected")
        wait_for(lambda: stored(first) is None, message="the former leader's gauge cleared")
        assert stored(1 - first) == 0
    finally:
        for s in services:
            s.stop()
