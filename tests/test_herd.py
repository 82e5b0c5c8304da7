"""Herd-freedom: with many idle workers, one new job wakes at most two sessions."""

from __future__ import annotations

from typing import Any

from tests.conftest import flush_watches, wait_for
from tests.runners import GateRunner, RecordingRunner
from workers.runners.echo import EchoRunner
from zkqueue import Client


def _line_size(client: Client) -> int:
    return len(client.zk.get_children(client.layout.line("default")))


def test_one_job_wakes_at_most_two_of_ten_idle_workers(client: Client, start_worker) -> None:
    handles = [start_worker(slots=1) for _ in range(10)]
    wait_for(lambda: _line_size(client) == 10, message="ten workers in line")
    client.ensure_queue("default")
    for h in handles:
        flush_watches(h.worker.zk)
    for round_ in range(3):
        before = [h.worker.stats.watch_events for h in handles]
        record = client.submit(f"job {round_}").result(timeout=10)
        assert record.ok
        wait_for(lambda: _line_size(client) == 10, message="worker back in line")
        for h in handles:
            flush_watches(h.worker.zk)
        woken = [
            h.worker.id
            for h, b in zip(handles, before, strict=True)
            if h.worker.stats.watch_events > b
        ]
        assert 1 <= len(woken) <= 2, f"round {round_}: {len(woken)} sessions woken: {woken}"


def test_a_job_wakes_its_workers_twice_even_when_the_next_head_waits_while_it_runs(
    client: Client, start_worker
) -> None:
    """The head hears the arrival and its successor hears the head leave; nothing else. The
    job runs long enough for the successor to wait (and watch the tail bucket, which still
    holds the running job's entry) and for the running worker to watch its entry: the job's
    completion wakes nobody. Heartbeats (0.1 s) re-list the tails the head watches meanwhile."""
    handles = [
        start_worker(EchoRunner(delay=0.2), slots=1, heartbeat_interval=0.1) for _ in range(4)
    ]
    wait_for(lambda: _line_size(client) == 4, message="four workers in line")
    client.ensure_queue("default")
    for round_ in range(4):
        for h in handles:
            flush_watches(h.worker.zk)
        before = sum(h.worker.stats.watch_events for h in handles)
        assert client.submit(f"job {round_}").result(timeout=10).ok
        wait_for(lambda: _line_size(client) == 4, message="worker back in line")
        for h in handles:
            flush_watches(h.worker.zk)
        events = sum(h.worker.stats.watch_events for h in handles) - before
        assert events == 2, f"round {round_}: {events} notifications to the workers"


def test_an_entry_made_without_the_arrival_signal_is_found_while_jobs_run(
    client: Client, start_worker
) -> None:
    """A raw producer's bare create fires no watch while the waiting head watches the tail
    through its data (a job runs): the head's re-listing at each heartbeat finds it."""
    runner = GateRunner(only="hold")
    handle = start_worker(runner, slots=2, heartbeat_interval=0.3)
    view = handle.worker.view
    wait_for(lambda: ("normal", 0) in view.armed, message="the idle head watching the tail")
    held = client.submit("hold", detach=True)
    wait_for(runner.started.is_set, message="the held job running")
    wait_for(lambda: ("normal", 0) in view.signalled, message="the tail watched by its data")
    client.zk.create(
        client.layout.entry_prefix("default", "normal", "bare1", 0),
        b'{"prompt": "bare"}',
        sequence=True,
    )
    record = client.job("bare1", "default").result(timeout=10)
    assert (record.status, record.output) == ("succeeded", "bare")
    assert held.status() == "running"
    runner.gate.set()
    assert held.result(timeout=10).ok


def test_a_job_completing_unheard_is_never_read_as_a_candidate(
    client: Client, start_worker
) -> None:
    """The waiting head watches the tail through its data while another worker's job runs
    there, so that job's completion notifies nobody; when the head wakes for a later arrival
    (here of a lower priority) it re-lists that tail and never reads the finished entry."""
    gate = GateRunner(only="hold")
    runner = start_worker(gate, name="runner")
    wait_for(lambda: _line_size(client) == 1, message="the first worker in line")
    head = start_worker(name="head")
    wait_for(lambda: _line_size(client) == 2, message="two workers in line")
    held = client.submit("hold", detach=True)
    wait_for(gate.started.is_set, message="the first worker running the job")
    view = head.worker.view
    wait_for(lambda: ("normal", 0) in view.signalled, message="the head watching by data")
    gate.gate.set()
    assert held.result(timeout=10).ok
    wait_for(lambda: _line_size(client) == 2, message="the first worker back in line")
    assert client.submit("later", priority="low").result(timeout=10).worker == "head"
    assert head.worker.head.stats.gone == 0
    assert runner.worker.stats.completed == 1


def test_a_bare_entry_of_a_higher_priority_goes_first_while_jobs_run(
    client: Client, start_worker
) -> None:
    """An entry created without the arrival signal (a raw producer) in a tail watched by its
    data is found when the head wakes for any arrival, and served in priority order."""
    gate = GateRunner(only="hold")
    start_worker(gate, name="runner")
    wait_for(lambda: _line_size(client) == 1, message="the first worker in line")
    recorder = RecordingRunner()
    head = start_worker(recorder, name="head")
    wait_for(lambda: _line_size(client) == 2, message="two workers in line")
    held = client.submit("hold", detach=True)
    view = head.worker.view
    wait_for(lambda: ("high", 0) in view.signalled, message="the high tail watched by its data")
    client.zk.create(
        client.layout.entry_prefix("default", "high", "bare2", 0),
        b'{"prompt": "bare high"}',
        sequence=True,
    )
    assert client.submit("normal").result(timeout=10).ok
    assert client.job("bare2", "default").result(timeout=10).ok
    assert recorder.seen == ["bare high", "normal"]
    gate.gate.set()
    assert held.result(timeout=10).ok


def test_idle_line_holds_every_worker_once(client: Client, start_worker) -> None:
    handles = [start_worker(slots=3) for _ in range(4)]
    wait_for(lambda: _line_size(client) == 4, message="four workers in line")
    owners = [
        client.zk.get(f"{client.layout.line('default')}/{n}")[0].decode()
        for n in client.zk.get_children(client.layout.line("default"))
    ]
    assert sorted(owners) == sorted(h.worker.id for h in handles)


def test_an_idle_fleet_writes_nothing(client: Client, start_worker) -> None:
    """Idle workers' registrations exist (their sessions are alive) and are rewritten only when
    they change: after three heartbeats of every idle worker, no node under the test's root was
    written (the zxid of the last change to any node or its children has not moved; sessions
    of earlier tests expiring meanwhile move the server's zxid, not this)."""
    beats: dict[str, int] = {}

    def count(worker: Any) -> None:
        beats[worker.id] = beats.get(worker.id, 0) + 1

    handles = [start_worker(slots=2, heartbeat_interval=0.2, on_heartbeat=count) for _ in range(5)]
    wait_for(lambda: len(client.workers()) == 5, message="five registrations")
    wait_for(lambda: all(beats.get(h.worker.id, 0) >= 2 for h in handles), message="beats")
    before = last_write(client)
    start = dict(beats)
    wait_for(
        lambda: all(beats[h.worker.id] >= start[h.worker.id] + 3 for h in handles),
        message="three more heartbeats each",
    )
    assert last_write(client) == before


def last_write(client: Client) -> int:
    """The zxid of the last create, delete or setData under the client's root."""
    zk, latest, level = client.zk, 0, [client.layout.root]
    while level:
        calls = [(path, zk.exists_async(path), zk.get_children_async(path)) for path in level]
        level = []
        for path, stat_call, children_call in calls:
            stat = stat_call.get()
            latest = max(latest, stat.mzxid, stat.pzxid)
            level += [f"{path}/{name}" for name in children_call.get()]
    return latest
