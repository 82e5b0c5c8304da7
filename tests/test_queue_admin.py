"""Queues as a whole: the queue-wide running cap (enforced by the head of the line across every
worker), limits shown and removed, the queue table, deleting a queue, dead letters in status and
who a cancelled running job was running on."""

from __future__ import annotations

import json
import threading

from kazoo.exceptions import NotEmptyError

from tests.conftest import registered, wait_for
from tests.runners import GateRunner
from workers.runners.base import Outcome, RunningJob
from workers.runners.echo import EchoRunner
from zkqueue import Client
from zkqueue.errors import ExitCode


class Concurrency:
    """Counts the jobs running at once across every runner that shares it."""

    def __init__(self) -> None:
        self.now = 0
        self.most = 0
        self.lock = threading.Lock()

    def enter(self) -> None:
        with self.lock:
            self.now += 1
            self.most = max(self.most, self.now)

    def leave(self) -> None:
        with self.lock:
            self.now -= 1


class CountingRunner(EchoRunner):
    def __init__(self, counter: Concurrency) -> None:
        super().__init__(delay=0.15)
        self.counter = counter

    def run_one(self, job: RunningJob) -> Outcome:
        self.counter.enter()
        try:
            return super().run_one(job)
        finally:
            self.counter.leave()


def _run_batch(client: Client, count: int) -> None:
    jobs = client.submit_many([f"job {i}" for i in range(count)])
    for job in jobs:
        assert job.result(timeout=60).ok


def test_max_running_caps_the_queue_across_all_workers(client: Client, start_worker) -> None:
    counter = Concurrency()
    client.set_limits("default", max_running=2)
    for _ in range(5):
        start_worker(CountingRunner(counter), slots=3)
    _run_batch(client, 30)
    assert counter.most == 2, f"{counter.most} jobs of the queue ran at once; the cap is 2"

    # The head reads the cap from a watch: raising it reaches the running workers.
    counter.most = 0
    client.set_limits("default", max_running=None)
    _run_batch(client, 30)
    assert counter.most > 2


def test_a_capped_queue_is_not_empty_for_a_burst_worker(client: Client, start_worker) -> None:
    runner = GateRunner()
    client.set_limits("default", max_running=1)
    jobs = client.submit_many(["a", "b", "c"])
    worker = start_worker(runner, slots=4, burst=True)
    wait_for(lambda: runner.running, message="one job running")
    info = client.stats()["queues"]["default"]
    assert (info["running"], info["waiting"], info["max_running"]) == (1, 2, 1)
    assert worker.thread.is_alive()  # capped is not empty: a burst worker keeps going
    runner.gate.set()
    for job in jobs:
        assert job.result(timeout=30).ok


def test_limits_from_the_command_line(zkq, client: Client, start_worker) -> None:
    start_worker(EchoRunner(), name="w1", queue="llama")
    out = zkq("queue-limit", "llama", "--max-running", "3", "--max-pending", "50")
    assert out.returncode == 0 and "max pending 50, max running 3" in out.stdout, out.stderr
    assert "max pending 50, max running 3" in zkq("queue-limit", "llama").stdout
    assert "waiting=0 running=0 max_pending=50 max_running=3" in zkq("stats").stdout
    rows = json.loads(zkq("queues", "--json").stdout)
    assert [(r["queue"], r["workers"], r["max_running"]) for r in rows] == [("llama", ["w1"], 3)]
    assert "w1" in zkq("queues").stdout
    out = zkq("queue-limit", "llama", "--max-running", "none")
    assert "max pending 50, max running unlimited" in out.stdout
    out = zkq("queue-limit", "llama", "none")
    assert "max pending unlimited, max running unlimited" in out.stdout


def test_queue_create_and_limits_of_a_missing_queue(zkq, client: Client) -> None:
    out = zkq("queue-limit", "lamma", "--max-pending", "10")  # a misspelt name
    assert out.returncode == ExitCode.NOT_FOUND and "zkq queue create lamma" in out.stderr
    assert client.queue_names() == []  # not made by the attempt
    out = zkq("queue", "create", "llama", "--max-pending", "10")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "created queue llama: max pending 10, max running unlimited\n"
    job = client.submit("x", detach=True, queue="llama")
    out = zkq("queue", "create", "llama")
    assert out.stdout == "queue llama exists: max pending 10, max running unlimited\n"
    assert job.status() == "pending"  # its jobs stay
    assert client.queue_names() == ["llama"]


def test_submit_warns_when_no_worker_serves_the_queue(zkq, start_worker) -> None:
    out = zkq("submit", "--detach", "--queue", "nobody", "x")
    assert out.returncode == 0
    assert "no registered worker serves queue 'nobody'" in out.stderr
    start_worker(EchoRunner(), queue="somebody")
    out = zkq("submit", "--require-worker", "--queue", "somebody", "x")
    assert (out.returncode, out.stdout, out.stderr) == (0, "x\n", "")


def test_queue_delete(zkq, client: Client) -> None:
    job = client.submit("x", detach=True, queue="scratch")
    out = zkq("queue", "delete", "scratch")
    assert out.returncode == ExitCode.QUEUE_FULL and "1 waiting" in out.stderr
    out = zkq("queue", "delete", "scratch", "--force")
    assert out.returncode == 0 and "deleted queue scratch" in out.stdout, out.stderr
    assert client.queue_names() == []
    assert zkq("status", job.id).returncode == ExitCode.NOT_FOUND


def test_status_knows_dead_letters(zkq, client: Client) -> None:
    client.ensure_queue("default")
    layout = client.layout
    job_id = "deadbeef00000001"
    client.zk.create(layout.entry_prefix("default", "normal", job_id), b"{bad", sequence=True)
    from zkqueue.protocol.claims import Claims

    claims = Claims(client.zk, layout, "default", "test", lease=60)
    name = client.zk.get_children(layout.pending("default", "normal"))[0]
    data, stat = client.zk.get(layout.entry("default", "normal", name))
    assert claims.dead_letter("normal", name, data, stat, "invalid job spec", job_id)
    client.zk.delete(layout.result("default", job_id))  # retention removed the result
    out = zkq("status", job_id, "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["state"] == "dead"


def test_cancelled_running_job_says_where_it_ran(client: Client, start_worker) -> None:
    runner = GateRunner()
    start_worker(runner, name="w9")
    job = client.submit("x", detach=True)
    wait_for(lambda: runner.running, message="running")
    assert job.cancel()
    record = job.result(timeout=10)
    assert record.status == "cancelled" and record.worker == "w9"
    assert record.started_at is not None and "while running on w9" in (record.error or "")


def test_janitor_keeps_the_bound_it_is_given(zkq, client: Client, start_worker) -> None:
    start_worker(EchoRunner(), slots=4)
    for job in client.submit_many([f"r{i}" for i in range(12)]):
        job.result(timeout=10)
    out = zkq("janitor", "--once", "--json", "--max-results", "5")
    assert out.returncode == 0, out.stderr
    report = json.loads(out.stdout)
    assert (report["results_removed"], report["results_stored"]) == (7, {"default": 5})
    assert client.stats()["queues"]["default"]["results"] == 5
    bad = zkq("janitor", "--once", "--max-results", "0")
    assert bad.returncode == ExitCode.USAGE and "--max-results" in bad.stderr
    bad = zkq("janitor", "--once", "--max-result-bytes", "0")
    assert bad.returncode == ExitCode.CONFIG and "max_bytes must be at least 1" in bad.stderr
    assert "Traceback" not in bad.stderr


def test_janitor_once_prints_a_summary(zkq, client: Client) -> None:
    client.ensure_queue("default")
    out = zkq("janitor", "--once")
    assert out.returncode == 0, out.stderr
    assert "reclaimed 0 lapsed lease(s)" in out.stdout and "removed 0 result(s)" in out.stdout
    report = json.loads(zkq("janitor", "--once", "--json").stdout)
    assert report == {
        "reclaimed": [],
        "expired": [],
        "results_removed": 0,
        "dead_removed": 0,
        "results_stored": {"default": 0},
        "results_bytes": {"default": 0},
        "lanes_removed": [],
    }


def test_a_queue_a_worker_serves_is_not_deleted(zkq, client: Client, start_worker) -> None:
    """Deleting the tree would take the worker's place in the line and its watches with it: it
    would stay registered and never take a job again. Refused, even with --force."""
    handle = start_worker(EchoRunner(), queue="served", name="keeper")
    wait_for(registered(client, 1), message="the worker registered")
    out = zkq("queue", "delete", "served", "--force")
    assert out.returncode == ExitCode.QUEUE_FULL, out.stderr
    assert "served by 1 worker(s) (keeper)" in out.stderr
    assert client.submit("still served", queue="served").result(timeout=10).ok
    handle.stop()
    wait_for(lambda: not client.workers(), message="the worker gone")
    out = zkq("queue", "delete", "served")
    assert out.returncode == 0, out.stderr


def test_a_worker_and_a_producer_survive_their_queue_deleted_under_them(
    client: Client, start_worker
) -> None:
    """A queue's tree removed by hand (zkCli.sh's deleteall) while a worker serves it and a
    producer knows it: the head finds its place gone at its next heartbeat and makes the queue
    again, and the producer's next submit does the same; the job runs."""
    handle = start_worker(EchoRunner(), queue="gone", slots=2)
    assert client.submit("before", queue="gone").result(timeout=10).ok
    wait_for(lambda: handle.worker.line.known is True, message="the worker at the head")

    def deleted() -> bool:
        try:
            client.zk.delete(client.layout.queue("gone"), recursive=True)
        except NotEmptyError:  # the worker made a node meanwhile: again
            return False
        return True

    wait_for(deleted, message="the queue deleted")
    line = client.layout.line("gone")
    wait_for(lambda: client.zk.exists(line) is not None, message="the worker making it again")
    record = client.submit("after", queue="gone").result(timeout=15)
    assert (record.status, record.output) == ("succeeded", "after")
    wait_for(deleted, message="the queue deleted again")  # now the producer makes it first
    record = client.submit("again", queue="gone").result(timeout=15)
    assert (record.status, record.output) == ("succeeded", "again")


def test_a_job_submitted_during_a_delete_is_kept(client: Client, monkeypatch) -> None:
    """The delete counted no jobs, then a producer's submit landed: the delete stops and the
    job stays (before, the recursive delete took it with the tree)."""
    import pytest

    from zkqueue.errors import QueueBusy
    from zkqueue.producer import queues

    client.ensure_queue("scratch")
    producer = Client(client.settings.hosts, client.layout.root).start()
    counted = queues.queue_stats
    late: list = []

    def count_then_submit(*args):
        stats = counted(*args)
        late.append(producer.submit("late", queue="scratch", detach=True))
        return stats

    monkeypatch.setattr(queues, "queue_stats", count_then_submit)
    try:
        with pytest.raises(QueueBusy, match=r"submitted .* while it was being deleted"):
            client.delete_queue("scratch")
        assert late[0].status() == "pending"
        assert producer.stats()["queues"]["scratch"]["waiting"] == 1
        # The queue is whole again: every priority takes jobs.
        assert producer.submit("urgent", queue="scratch", priority="high", detach=True).id
    finally:
        producer.close()


def test_a_caller_whose_queue_is_deleted_is_told_so(client: Client) -> None:
    import pytest

    from zkqueue.errors import JobWithdrawn

    job = client.submit("waits", queue="doomed")  # attached; nobody serves the queue
    with Client(client.settings.hosts, client.layout.root) as admin:
        admin.delete_queue("doomed", force=True)
    with pytest.raises(JobWithdrawn, match="its queue 'doomed' was deleted"):
        job.result(timeout=10)


def test_a_delete_stopped_halfway_leaves_a_queue_that_works(client: Client, monkeypatch) -> None:
    """A delete that stops after the pending tree went (connection trouble, Ctrl-C, a busy
    directory) must not leave a queue nobody can submit to."""
    import pytest

    from zkqueue.errors import QueueBusy
    from zkqueue.producer import queues

    client.submit("done before", queue="half", detach=True)
    real = queues._delete_tree

    def stop_at_claims(zk, path, queue):
        if path.endswith("/claims"):
            raise QueueBusy("stopped here")
        real(zk, path, queue)

    monkeypatch.setattr(queues, "_delete_tree", stop_at_claims)
    with pytest.raises(QueueBusy):
        client.delete_queue("half", force=True)
    with Client(client.settings.hosts, client.layout.root) as producer:
        for priority in ("high", "normal", "low"):
            assert producer.submit("after", queue="half", priority=priority, detach=True).id
