"""The arrival signal's payload: a producer's one new entry carried in its tail bucket's data, and
the head's use of it (claiming a fresh entry without reading it) only when nothing else changed
the bucket since."""

from __future__ import annotations

from typing import Any

import pytest
from kazoo.client import KazooClient

from tests.conftest import wait_for
from tests.runners import GateRunner, RecordingRunner
from zkqueue import Client, defaults
from zkqueue.dispatch.view import PendingView
from zkqueue.errors import ConfigurationError
from zkqueue.protocol import arrival


def _tail(client: Client, priority: str = "normal") -> bytes:
    data, _ = client.zk.get(client.layout.bucket("default", priority, 0))
    return data


def _entry_data(client: Client, name: str, priority: str = "normal") -> bytes:
    data, _ = client.zk.get(client.layout.entry("default", priority, name))
    return data


def test_one_entry_rides_in_its_tail_signal_and_several_or_a_large_one_do_not(
    client: Client,
) -> None:
    job = client.submit("hello", detach=True)
    assert job.entry is not None
    assert arrival.decode(_tail(client)) == (job.id, _entry_data(client, job.entry))
    client.submit_many(["a", "b", "c"])
    assert _tail(client) == b""
    client.submit("x" * (defaults.SIGNAL_SPEC_BYTES + 1), detach=True)
    assert _tail(client) == b""
    assert arrival.decode(b"") is None
    assert arrival.decode(b"no separator") is None


def _waiting_view(client: Client, zk: KazooClient) -> tuple[PendingView, list[Any]]:
    """A head's view (on its own session ``zk``) that has listed the empty queue and waits for
    arrivals, and the parts its watches reported (the worker's loop would invalidate them)."""
    client.ensure_queue("default")
    fired: list[Any] = []
    view = PendingView(zk, client.layout, "default", fired.append)
    view.refresh()
    view.await_arrivals(1, frozenset())
    assert view._waiting
    return view, fired


def _wake(view: PendingView, fired: list[Any]) -> None:
    """Wait for the arrival's notification and refresh as the woken head does."""
    wait_for(lambda: ("normal", 0) in fired, message="the arrival's notification")
    for part in fired:
        view.invalidate(part)
    view.refresh()


def test_the_view_takes_a_signalled_entry_it_sees_for_the_first_time(
    client: Client, new_zk: Any
) -> None:
    view, fired = _waiting_view(client, new_zk())
    job = client.submit("carried", detach=True)
    _wake(view, fired)
    assert job.entry is not None
    spec, stat = view.arrived[("normal", job.entry)]
    assert spec == _entry_data(client, job.entry)
    assert (stat.version, stat.numChildren) == (0, 0)
    _, real = client.zk.get(client.layout.entry("default", "normal", job.entry))
    assert (stat.czxid, stat.ctime) == (real.czxid, real.ctime)
    view._waiting = True
    view.refresh()  # the same entry again: no longer new, so it must be read
    assert view.arrived == {}


def test_an_entry_created_after_the_signal_is_never_taken_for_the_signalled_one(
    client: Client, new_zk: Any
) -> None:
    """A raw producer's bare create after a signalled enqueue, here even under the same id:
    the bucket's children changed since the signal was set, so the newest entry (the bare
    one, with its own spec) is read, not taken for the signalled one."""
    view, fired = _waiting_view(client, new_zk())
    job = client.submit("signalled", detach=True)
    client.zk.create(
        client.layout.entry_prefix("default", "normal", job.id, 0),
        b'{"prompt": "bare"}',
        sequence=True,
    )
    _wake(view, fired)
    assert view.arrived == {}
    assert len(view.listed[("normal", 0)]) == 2


def test_a_signal_is_not_trusted_once_an_entry_ended_in_the_bucket(
    client: Client, new_zk: Any
) -> None:
    view, fired = _waiting_view(client, new_zk())
    first = client.submit("first", detach=True)
    second = client.submit("second", detach=True)
    assert first.cancel()  # deletes the first entry: the bucket changed after the signal
    _wake(view, fired)
    assert view.arrived == {}
    assert [e.job_id for e in view.listed[("normal", 0)]] == [second.id]


def test_an_entry_that_arrived_while_another_worker_was_head_is_read(
    client: Client, new_zk: Any
) -> None:
    """The other head may have claimed and released it (its version is no longer 0): a head
    trusts a signal only for an entry that appeared since its own last listing of the
    bucket, while it stayed head."""
    view, _ = _waiting_view(client, new_zk())
    view.unwatch()  # another worker is head now
    job = client.submit("claimed elsewhere", detach=True)
    entry = client.layout.entry("default", "normal", job.entry or "")
    data, stat = client.zk.get(entry)
    client.zk.set(entry, data, version=stat.version)  # as a claim (then a release) does
    view.refresh()  # head again: its tails were left dirty when it stopped watching
    assert view.arrived == {}
    view.await_arrivals(2, frozenset())
    assert view.arrived == {}
    assert [e.job_id for e in view.listed[("normal", 0)]] == [job.id]


def test_a_client_can_keep_specs_out_of_the_signal(hosts: str, root: str) -> None:
    with Client(hosts, root, signal_spec_bytes=0) as quiet:
        quiet.submit("private", detach=True)
        assert _tail(quiet) == b""
    with pytest.raises(ConfigurationError, match="signal_spec_bytes"):
        Client(hosts, root, signal_spec_bytes=-1)


def test_an_idle_head_claims_a_signalled_job_without_reading_its_entry(
    client: Client, start_worker
) -> None:
    """The first job a fresh worker's waiting head hears of rides in the tail's signal. (Later
    ones do too when the head listed the tail after the previous job ended; one submitted
    sooner is read: BENCHMARKS.md counts how often.)"""
    recorder = RecordingRunner()
    handle = start_worker(recorder, slots=1)
    view = handle.worker.view
    client.ensure_queue("default")
    # The head listed the tail with its data as it began to wait: it has been head since.
    wait_for(lambda: ("normal", 0) in view._headed, message="the idle head watching the tail")
    reads: list[str] = []
    zk = handle.worker.zk
    real_get = zk.get_async

    def get_async(path: str, watch: Any = None) -> Any:
        reads.append(path)
        return real_get(path, watch)

    zk.get_async = get_async  # type: ignore[method-assign]
    record = client.submit("job 0").result(timeout=10)
    assert (record.status, record.output) == ("succeeded", "job 0")
    entries = client.layout.bucket("default", "normal", 0) + "/"
    assert not [p for p in reads if p.startswith(entries)]
    assert handle.worker.head.stats.unread == 1
    assert recorder.seen == ["job 0"]


def test_a_job_claimed_from_its_signal_is_still_fenced(
    client: Client, start_worker, monkeypatch
) -> None:
    """The claim of an unread entry carries the token of a read one: a cancel while the job
    runs (its entry not watched yet) fails the completion's check; no result but the cancel's."""
    monkeypatch.setattr(defaults, "ENTRY_WATCH_DELAY", 60.0)
    gate = GateRunner()
    handle = start_worker(gate, slots=1)
    client.ensure_queue("default")
    view = handle.worker.view
    wait_for(lambda: ("normal", 0) in view._headed, message="the idle head watching the tail")
    job = client.submit("held", detach=True)
    wait_for(gate.started.is_set, message="the job running")
    assert handle.worker.head.stats.unread == 1
    assert gate.running[0].claim is not None and gate.running[0].claim.token == 1
    assert job.cancel()
    gate.gate.set()
    wait_for(lambda: handle.worker.busy == 0, message="the job ended")
    assert handle.worker.stats.completed == 0
    assert job.result(timeout=5).status == "cancelled"


def test_a_result_that_lands_before_the_caller_waits_is_found(client: Client, start_worker) -> None:
    """The caller's result watch is set with the create; a result written before the caller
    asks for it fires that watch, and the wait reads it then."""
    start_worker(slots=1)
    client.ensure_queue("default")
    job = client.submit("early")
    wait_for(lambda: client.zk.exists(job.result_path) is not None, message="the result")
    record = job.result(timeout=10)
    assert (record.status, record.output) == ("succeeded", "early")


def test_a_signalled_entry_with_child_nodes_ends_dead_lettered(
    client: Client, start_worker
) -> None:
    """A raw multi makes an entry with a child and a signal that matches it: the head trusts
    the signal (it cannot see the child), runs the job, fails to complete it, releases it,
    and the next turn reads the entry and dead-letters it: its one result says so."""
    handle = start_worker(slots=1)
    client.ensure_queue("default")
    view = handle.worker.view
    wait_for(lambda: ("normal", 0) in view.armed, message="the idle head watching the tail")
    job_id = "_00000000000000aa"
    entry = client.layout.bucket("default", "normal", 0) + f"/{job_id}-0000000042"
    spec = b'{"prompt": "not a job"}'
    txn = client.zk.transaction()
    txn.set_data(client.layout.bucket("default", "normal", 0), arrival.encode(job_id, spec))
    txn.create(entry, spec)
    txn.create(entry + "/child")
    assert all(not isinstance(r, Exception) for r in txn.commit())
    wait_for(lambda: client.dead("default"), message="the entry dead-lettered")
    assert client.zk.exists(entry) is None
    assert client.job(job_id, "default").result(timeout=5).status == "dead"
