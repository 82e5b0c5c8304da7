"""Fencing: a worker that lost its claim can never write a result or delete the job."""

from __future__ import annotations

import json
from typing import Any

from kazoo.exceptions import ConnectionLoss

from tests.conftest import result_ids, wait_for
from tests.runners import GateRunner
from zkqueue import Client, defaults
from zkqueue.dispatch.line import Line
from zkqueue.protocol.claims import Claims
from zkqueue.protocol.layout import EntryName
from zkqueue.protocol.result import Result


def _claims(client: Client) -> list[str]:
    return client.zk.get_children(client.layout.claims("default"))


def test_stale_worker_whose_claim_was_deleted_cannot_complete(client: Client, start_worker) -> None:
    stale_runner = GateRunner()
    stale = start_worker(stale_runner, name="stale")
    job = client.submit("once", detach=True)
    wait_for(stale_runner.started.is_set, message="stale worker running the job")
    # Its entry watch is set once the job has run ENTRY_WATCH_DELAY: the reclaim then fences it.
    wait_for(
        lambda: (held := list(stale.worker.held.values())) and all(j.watched for j in held),
        message="stale worker watching its entry",
    )
    [claim] = _claims(client)
    assert json.loads(client.zk.get(client.layout.claim("default", claim))[0])["worker"] == "stale"

    client.zk.delete(client.layout.claim("default", claim))  # e.g. a lease reclaimed
    fresh = start_worker(name="fresh")
    record = job.result(timeout=10)
    stale_runner.gate.set()
    wait_for(lambda: stale.worker.busy == 0, message="stale worker gave up")

    assert (record.worker, record.attempts, record.status) == ("fresh", 2, "succeeded")
    assert stale.worker.stats.completed == 0
    assert stale.worker.stats.fenced == 1
    # The caller may read the result before the fresh worker's thread is back from the commit
    # that wrote it (and counted it): wait for that.
    wait_for(lambda: fresh.worker.stats.completed == 1, message="the fresh worker's count")
    assert result_ids(client) == [job.id]


def test_complete_with_an_old_token_writes_nothing(client: Client, new_zk) -> None:
    """The protocol itself, without the worker's watches: the multi fails as a whole."""
    job = client.submit("x", detach=True)
    zk_a, zk_b = new_zk(), new_zk()
    lay = client.layout
    a = Claims(zk_a, lay, "default", "a")
    b = Claims(zk_b, lay, "default", "b")
    from zkqueue.protocol.records import Candidate
    from zkqueue.protocol.spec import JobSpec

    def candidate() -> Candidate:
        data, stat = client.zk.get(job.entry_path or "")
        return Candidate(
            "normal", EntryName.parse(job.entry or ""), data, stat, JobSpec.from_bytes(data)
        )

    line_a = Line(zk_a, lay.line("default"), "a", lambda: None)
    line_b = Line(zk_b, lay.line("default"), "b", lambda: None)
    [claim_a] = a.claim([candidate()], line_a, rejoin=False) or []
    zk_a.delete(lay.claim("default", claim_a.entry.name))  # A's claim vanishes
    [claim_b] = b.claim([candidate()], line_b, rejoin=False) or []
    assert (claim_a.token, claim_b.token) == (1, 2)

    stale = Result(
        id=job.id,
        queue="default",
        priority="normal",
        status="succeeded",
        output="stale",
        worker="a",
    )
    assert a.complete(claim_a, stale, None) is False
    assert a.release(claim_a) is False
    assert client.zk.exists(lay.result("default", job.id)) is None
    assert client.zk.exists(job.entry_path or "") is not None

    fresh = Result(
        id=job.id,
        queue="default",
        priority="normal",
        status="succeeded",
        output="fresh",
        worker="b",
        attempts=claim_b.token,
    )
    assert b.complete(claim_b, fresh, None) is True
    assert client.job(job.id).result(timeout=1).output == "fresh"
    assert b.complete(claim_b, fresh, None) is False  # and never twice
    # Why a completion failed: B's retry (a lost reply) finds its own record; A lost its claim.
    assert fresh.finished_at is not None
    assert b.failed_completion(claim_b, fresh.finished_at)[0] == "ours"
    assert a.failed_completion(claim_a, fresh.finished_at)[0] == "lost"

    cancelled = client.submit("y", detach=True)
    data, stat = client.zk.get(cancelled.entry_path or "")
    spec = JobSpec.from_bytes(data)
    entry = EntryName.parse(cancelled.entry or "")
    [claim_c] = a.claim([Candidate("normal", entry, data, stat, spec)], line_a, rejoin=False) or []
    assert cancelled.cancel()
    assert a.failed_completion(claim_c, 0.0)[0] == "gone"


def test_a_job_cancelled_before_its_entry_is_watched_counts_as_cancelled(
    client: Client, start_worker, monkeypatch
) -> None:
    """A short job's entry is not watched (ENTRY_WATCH_DELAY): a cancel meanwhile is found by
    its completion, which fails; the worker drops its claim and counts no lost claim."""
    monkeypatch.setattr(defaults, "ENTRY_WATCH_DELAY", 60.0)
    gate = GateRunner()
    handle = start_worker(gate)
    job = client.submit("short", detach=True)
    wait_for(gate.started.is_set, message="running")
    assert job.cancel()
    gate.gate.set()
    wait_for(lambda: handle.worker.busy == 0, message="the job ended")
    stats = handle.worker.stats
    assert (stats.completed, stats.fenced) == (0, 0)
    assert job.result(timeout=5).status == "cancelled"
    assert _claims(client) == []


def test_every_give_back_moves_the_give_back_signal(client: Client, new_zk) -> None:
    """A release, a preemption, the janitor's reclaim and a swept claim each set claims/'s data
    in their multi (its version is what heads compare to reuse a listing: the job is pending
    again behind its lane's frontier); a claim and a completion do not."""
    from kazoo.protocol.states import ZnodeStat

    from zkqueue.protocol.claims import reclaim
    from zkqueue.protocol.records import Candidate
    from zkqueue.protocol.spec import JobSpec

    jobs = [client.submit(f"job {i}", detach=True) for i in range(2)]
    zk = new_zk()
    lay = client.layout
    claims = Claims(zk, lay, "default", "w")
    line = Line(zk, lay.line("default"), "w", lambda: None)

    def signal() -> int:
        stat: ZnodeStat = client.zk.exists(lay.claims("default"))
        return stat.version

    def claim(index: int, **kwargs) -> list:
        entry = jobs[index].entry or ""
        data, stat = client.zk.get(lay.entry("default", "normal", entry))
        picked = Candidate("normal", EntryName.parse(entry), data, stat, JobSpec.from_bytes(data))
        return claims.claim([picked], line, rejoin=False, **kwargs) or []

    before = signal()
    [first] = claim(0)
    assert signal() == before  # a claim gives nothing back
    assert claims.release(first) and signal() == before + 1
    [first] = claim(0)
    assert claim(1, give_back=[(first, first.spec.to_bytes())]) and signal() == before + 2
    [first] = claim(0, passed=True)  # passes over an entry it leaves pending
    assert signal() == before + 3
    path = lay.claim("default", first.id)
    version = client.zk.exists(path).version
    entry = lay.entry("default", "normal", first.entry.name)
    assert reclaim(client.zk, lay, "default", path, version, (entry, first.token))
    assert signal() == before + 4
    [first] = claim(0)
    assert claims.sweep([], held=set()) and signal() == before + 6  # both claims were stray
    [first] = claim(0)
    done = Result(id=first.id, queue="default", priority="normal", status="succeeded")
    assert claims.complete(first, done, None) and signal() == before + 6


def test_a_completion_whose_accounting_loses_the_connection_counts_once(
    client: Client, start_worker
) -> None:
    """The completion's multi committed; a read made after it, for the fair share's
    correction, fails with the connection. The job is complete and counted once, and the
    worker goes on taking jobs."""
    handle = start_worker()
    completer = handle.worker.completer
    real = completer.corrections
    calls: list[str] = []

    def failing_once(claim: Any, figures: dict[str, Any]) -> None:
        calls.append(claim.id)
        if len(calls) == 1:
            raise ConnectionLoss("the connection went while reading the queue's weights")
        if real is not None:
            real(claim, figures)

    completer.corrections = failing_once
    first = client.submit("first")
    assert first.result(timeout=10).ok
    second = client.submit("second")
    assert second.result(timeout=10).ok
    # The worker accounts a job after its result is written (the producer may see it first).
    wait_for(
        lambda: completer.stats.completed == 2 and len(calls) == 2 and not completer.queued,
        message="two completions accounted",
    )
    assert calls == [first.id, second.id]
    assert completer.stats.completed == 2  # the first one counted once
