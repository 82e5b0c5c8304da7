"""Ordering, results, cancellation and attached requests against a real ZooKeeper."""

from __future__ import annotations

import time

import pytest

from tests.conftest import wait_for
from tests.runners import GateRunner, RecordingRunner
from workers.runners.echo import EchoRunner
from zkqueue import Client, JobTimeout, JobWithdrawn
from zkqueue.errors import JobNotFound


def test_priority_then_fifo_with_one_worker(client: Client, start_worker) -> None:
    plan = [
        ("low", "l1"),
        ("normal", "n1"),
        ("high", "h1"),
        ("low", "l2"),
        ("high", "h2"),
        ("normal", "n2"),
        ("high", "h3"),
    ]
    jobs = [client.submit(p, priority=prio, detach=True) for prio, p in plan]
    runner = RecordingRunner()
    start_worker(runner, slots=1)
    records = [j.result(timeout=10) for j in jobs]
    assert runner.seen == ["h1", "h2", "h3", "n1", "n2", "l1", "l2"]
    assert all(r.status == "succeeded" and r.attempts == 1 for r in records)


def test_head_with_several_slots_claims_in_order(client: Client, start_worker) -> None:
    jobs = [client.submit(f"n{i}", detach=True) for i in range(6)]
    jobs.append(client.submit("h", priority="high", detach=True))
    runner = RecordingRunner()
    start_worker(runner, slots=4)
    for j in jobs:
        j.result(timeout=10)
    assert runner.seen == ["h", "n0", "n1", "n2", "n3", "n4", "n5"]


def test_result_record_fields(client: Client, start_worker) -> None:
    start_worker()
    before = time.time()
    record = client.submit("hello", priority="high", max_new_tokens=5).result(timeout=10)
    data = record.to_dict()
    for field in (
        "id",
        "queue",
        "priority",
        "status",
        "output",
        "error",
        "worker",
        "attempts",
        "submitted_at",
        "started_at",
        "finished_at",
    ):
        assert field in data
    assert (record.status, record.output, record.priority, record.queue) == (
        "succeeded",
        "hello",
        "high",
        "default",
    )
    assert record["output"] == "hello"
    assert before - 1 <= record.submitted_at <= record.started_at <= record.finished_at
    assert record.finished_at <= time.time() + 1


def test_attached_result_is_removed_once_read(client: Client, start_worker, layout) -> None:
    start_worker()
    job = client.submit("x")
    job.result(timeout=10)
    assert client.zk.exists(layout.result("default", job.id)) is None
    assert job.status() == "succeeded"  # the handle remembers


def test_detached_result_stays(client: Client, start_worker, layout) -> None:
    start_worker()
    job = client.submit("x", detach=True)
    job.result(timeout=10)
    assert client.zk.exists(layout.result("default", job.id)) is not None
    assert client.job(job.id).status() == "succeeded"


def test_a_pending_job_says_when_it_may_start_at_the_recent_rate(
    client: Client, start_worker, zkq
) -> None:
    assert client.submit("x", detach=True).info()["starts_in_s"] is None  # no worker: no rate
    start_worker(EchoRunner(delay=0.1), slots=1)
    for i in range(60):
        client.submit(f"backlog {i}", detach=True)
    wait_for(lambda: any(w["rate"] > 0 for w in client.workers()), timeout=15, message="a rate")
    last = client.submit("the last one", priority="low", detach=True)
    info = last.info()
    rate = sum(w["rate"] for w in client.workers())
    assert info["state"] == "pending" and info["position"] > 10
    # About its position over the rate of finished jobs (at most 10 a second here).
    assert info["starts_in_s"] >= info["position"] / 10 * 0.9
    assert abs(info["starts_in_s"] - info["position"] / rate) <= 0.5 * info["starts_in_s"]
    assert "s at the recent rate" in zkq("status", last.id).stdout


def test_status_and_position_of_pending_jobs(client: Client) -> None:
    a = client.submit("a", detach=True)
    b = client.submit("b", detach=True)
    c = client.submit("c", priority="high", detach=True)
    assert [j.info()["position"] for j in (c, a, b)] == [1, 2, 3]
    assert a.status() == "pending"
    rows = client.list()
    assert [r["id"] for r in rows] == [c.id, a.id, b.id]
    stats = client.stats()["queues"]["default"]
    assert stats["depth"] == {"high": 1, "normal": 2, "low": 0}
    assert stats["pending"] == 3


def test_named_queues_are_separate(client: Client, start_worker) -> None:
    other = client.submit("for b", queue="b", detach=True)
    mine = client.submit("for default", detach=True)
    start_worker(queue="default")
    assert mine.result(timeout=10).output == "for default"
    assert other.status() == "pending"
    start_worker(queue="b")
    assert other.result(timeout=10).queue == "b"


def test_cancel_pending_job(client: Client, start_worker) -> None:
    job = client.submit("never", detach=True)
    assert job.cancel() is True
    assert job.cancel() is False
    runner = RecordingRunner()
    start_worker(runner)
    record = client.job(job.id).result(timeout=5)
    assert record.status == "cancelled"
    after = client.submit("after", detach=True).result(timeout=10)
    assert after.ok
    assert runner.seen == ["after"]


def test_cancel_running_job_stops_it(client: Client, start_worker) -> None:
    runner = GateRunner()
    handle = start_worker(runner)
    job = client.submit("long", detach=True)
    wait_for(runner.started.is_set, message="job running")
    assert job.status() == "running"
    assert job.cancel() is True
    wait_for(lambda: runner.finished, message="runner stopped")
    assert runner.finished == [(job.id, "cancelled")]
    assert client.job(job.id).result(timeout=5).status == "cancelled"
    wait_for(
        lambda: (
            handle.worker.busy == 0 and not client.zk.get_children(client.layout.claims("default"))
        ),
        message="claim dropped",
    )
    assert handle.worker.stats.completed == 0


def test_attached_request_withdrawn_when_producer_goes_away(
    hosts: str, root: str, client: Client
) -> None:
    producer = Client(hosts, root).start()
    job = producer.submit("orphan")
    assert client.list()[0]["id"] == job.id
    producer.close()
    wait_for(lambda: client.list() == [], message="entry withdrawn")
    with pytest.raises(JobNotFound):
        client.job(job.id)


def test_running_attached_request_withdrawn_writes_no_result(
    hosts: str, root: str, client: Client, start_worker
) -> None:
    runner = GateRunner()
    handle = start_worker(runner)
    producer = Client(hosts, root).start()
    job = producer.submit("orphan")
    wait_for(runner.started.is_set, message="job running")
    producer.close()
    wait_for(lambda: runner.finished, message="generation stopped")
    assert runner.finished == [(job.id, "cancelled")]
    wait_for(lambda: handle.worker.busy == 0, message="slot freed")
    assert client.zk.exists(client.layout.result("default", job.id)) is None


def test_caller_timeout_withdraws_attached_request(client: Client) -> None:
    job = client.submit("nobody serves this")
    with pytest.raises(JobTimeout):
        job.result(timeout=0.3)
    assert client.list() == []
    with pytest.raises(JobWithdrawn):
        job.result(timeout=1)


def test_detached_timeout_keeps_the_job(client: Client) -> None:
    job = client.submit("later", detach=True)
    with pytest.raises(JobTimeout):
        job.result(timeout=0.2)
    assert job.status() == "pending"


def test_queue_timeout_expires_a_job_not_started(client: Client, start_worker) -> None:
    job = client.submit("stale", detach=True, queue_timeout=0.05)
    wait_for(lambda: time.time() - job.info()["submitted_at"] > 0.1, message="deadline passed")
    start_worker()
    record = job.result(timeout=10)
    assert record.status == "expired"
    assert "queue_timeout" in (record.error or "")


def test_failed_job_records_the_error(client: Client, start_worker) -> None:
    from workers.runners.echo import EchoRunner

    start_worker(EchoRunner(fail_marker="boom"))
    record = client.submit("boom now").result(timeout=10)
    assert record.status == "failed"
    assert record.error == "echo runner asked to fail"


def test_submit_many_is_pipelined_and_ordered(client: Client, start_worker) -> None:
    specs = [f"p{i}" for i in range(300)] + [{"prompt": "urgent", "priority": "high"}]
    jobs = client.submit_many(specs)
    assert len({j.id for j in jobs}) == 301
    assert client.stats()["queues"]["default"]["pending"] == 301
    runner = RecordingRunner()
    start_worker(runner, slots=8)
    for j in jobs:
        assert j.result(timeout=30).ok
    assert runner.seen[0] == "urgent"
    assert runner.seen[1:] == [f"p{i}" for i in range(300)]
