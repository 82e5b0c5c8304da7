"""Protocol version 2: bucketed pending entries in exact order, one run per job id, results that
expire through the index, a version 1 root refused then migrated, withdrawn requests."""

from __future__ import annotations

import asyncio
import json
import threading
import time
from typing import Any

import pytest
from kazoo.client import KazooClient

from tests.conftest import result_ids, wait_for
from tests.runners import GateRunner
from workers.runners.echo import EchoRunner
from zkqueue import AsyncClient, Client, defaults
from zkqueue.errors import ExitCode, InvalidJob, JobWithdrawn, ProtocolMismatch
from zkqueue.operations.expiry import ExpiryLimits
from zkqueue.operations.janitor import Janitor
from zkqueue.producer.enqueue import Enqueuer
from zkqueue.protocol import claims
from zkqueue.protocol.migrate import migrate


def test_buckets_roll_over_and_order_stays_exact(client: Client, start_worker) -> None:
    client._enqueue = Enqueuer(client, bucket_size=5)
    jobs = [client.submit(f"job {i}", detach=True) for i in range(7)]
    jobs += client.submit_many([f"job {i}" for i in range(7, 23)])
    buckets = client.zk.get_children(client.layout.pending("default", "normal"))
    assert len(buckets) >= 3  # buckets of about five (a multi of 16 may overfill one)
    assert [j.id for j in jobs] == [r["id"] for r in client.list(limit=None)]
    records = []
    runner = GateRunner()
    runner.gate.set()
    start_worker(runner)
    records = [j.result(timeout=20) for j in jobs]
    started = sorted(records, key=lambda r: r.started_at or 0)
    assert [r.id for r in started] == [j.id for j in jobs]
    wait_for(
        lambda: len(client.zk.get_children(client.layout.pending("default", "normal"))) == 1,
        message="empty buckets before the tail deleted",
    )


def test_async_submits_roll_buckets_over_from_the_loop(
    client: Client, hosts: str, root: str
) -> None:
    """AsyncClient sends a submit's multi from its loop where it knows the tail, and hands the
    rest to a thread: the first read of a tail, a stale tail (another producer filled it), and
    the bucket its entry fills. One after another, entries fill buckets exactly, in order."""

    async def run() -> tuple[list[str], list[str]]:
        async with AsyncClient(hosts, root) as aio:
            # Into a bucket with room: only the first (which reads the tail) needs a thread.
            aio._enqueue = Enqueuer(aio, bucket_size=100)
            real_finish, threaded = aio._enqueue.finish, []
            aio._enqueue.finish = lambda *a: threaded.append(a) or real_finish(*a)  # type: ignore[method-assign]
            for i in range(5):
                await aio.submit(f"job {i}", queue="roomy", detach=True)
            assert len(threaded) == 1
            aio._enqueue = Enqueuer(aio, bucket_size=3)
            ids = []
            for i in range(10):
                ids.append((await aio.submit(f"job {i}", detach=True)).id)
                if i in (4, 5):  # moves the tail under it
                    ids.append(client.submit("from another producer", detach=True).id)
            # At once, they may overfill the tail (as producers at once do): each made once.
            jobs = await asyncio.gather(
                *(aio.submit(f"at once {i}", detach=True) for i in range(8))
            )
            return ids, [j.id for j in jobs]

    client._enqueue = Enqueuer(client, bucket_size=3)
    ids, at_once = asyncio.run(run())
    listed = [r["id"] for r in client.list(limit=None)]
    assert listed[: len(ids)] == ids
    assert sorted(listed[len(ids) :]) == sorted(at_once) and len(set(listed)) == 20
    pending = client.layout.pending("default", "normal")
    buckets = sorted(client.zk.get_children(pending))
    sizes = [len(client.zk.get_children(f"{pending}/{b}")) for b in buckets]
    assert sizes[:4] == [3, 3, 3, 3], sizes


def test_async_submits_at_once_overfill_a_bucket_by_no_more_than_the_threads(
    client: Client, hosts: str, root: str
) -> None:
    """From its loop AsyncClient sends at most a bucket's room of multis at once; the rest wait
    for its threads (one here), as every submit did before: a burst overfills no bucket by
    more than that thread's."""

    async def run() -> None:
        async with AsyncClient(hosts, root, blocking_threads=1) as aio:
            aio._enqueue = Enqueuer(aio, bucket_size=4)
            await aio.submit("the tail, read", detach=True)
            for _ in range(3):
                await asyncio.gather(*(aio.submit(f"job {i}", detach=True) for i in range(12)))

    asyncio.run(run())
    pending = client.layout.pending("default", "normal")
    sizes = [len(client.zk.get_children(f"{pending}/{b}")) for b in client.zk.get_children(pending)]
    assert sum(sizes) == 37 and max(sizes) <= 5, sizes


def test_the_loop_counts_a_threads_multi_in_flight_before_it_sends(
    client: Client, hosts: str, root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A submit whose tail had to be read goes on a thread; its multi is on its way (its reply
    held back here until the burst is sent) when a burst arrives. The loop counts it among the
    bucket's entries on their way, so the bucket takes its size and, at most, the thread's next
    multi (which sends to the tail it knows without counting): 5 of a size of 4, not 6."""
    real = claims.enqueue_async
    release = threading.Event()

    def held_reply(zk: KazooClient, *args: Any) -> Any:
        sent = real(zk, *args)
        if not threading.current_thread().name.startswith("zkq-aio"):
            return sent
        later = zk.handler.async_result()

        def copy(done: Any) -> None:
            release.wait(10)
            if done.successful():
                later.set(done.value)
            else:
                later.set_exception(done.exception)

        sent.rawlink(lambda done: threading.Thread(target=copy, args=(done,)).start())
        return later

    bucket = client.layout.bucket("default", "normal", 0)

    def entries() -> int:
        return len(client.zk.get_children(bucket))

    async def run() -> None:
        async with AsyncClient(hosts, root, blocking_threads=1) as aio:
            aio._enqueue = Enqueuer(aio, bucket_size=4)
            await aio.submit("the tail, read", detach=True)
            monkeypatch.setattr(claims, "enqueue_async", held_reply)
            aio._enqueue._tails.clear()  # the next submit reads the tail again, on the thread
            first = asyncio.create_task(aio.submit("sent by the thread", detach=True))
            await asyncio.to_thread(wait_for, lambda: entries() == 2, message="its entry")
            burst = [asyncio.create_task(aio.submit(f"job {i}", detach=True)) for i in range(6)]
            # the loop sends what it has room for at once (2 with the fix, 3 without)
            await asyncio.to_thread(wait_for, lambda: entries() >= 4, message="the burst")
            release.set()
            await asyncio.gather(first, *burst)

    try:
        asyncio.run(run())
    finally:
        release.set()
    pending = client.layout.pending("default", "normal")
    buckets = sorted(client.zk.get_children(pending))
    sizes = [len(client.zk.get_children(f"{pending}/{b}")) for b in buckets]
    assert sum(sizes) == 8 and sizes[0] == 5, sizes


def test_a_bulk_enqueue_overfills_no_bucket_by_more_than_a_multi(client: Client) -> None:
    """submit_many sends several multis at once, all to the tails read before them: it stops a
    window where a tail fills, so a bucket holds at most one multi (100 entries) more than its
    size, whatever the window (8 multis: 800 entries)."""
    client._enqueue = Enqueuer(client, bucket_size=250)
    jobs = client.submit_many([f"job {i}" for i in range(1500)])
    pending = client.layout.pending("default", "normal")
    buckets = sorted(client.zk.get_children(pending))
    sizes = [len(client.zk.get_children(f"{pending}/{b}")) for b in buckets]
    assert sum(sizes) == 1500
    assert max(sizes) <= 349, sizes
    assert len(buckets) >= 5, sizes
    assert [j.id for j in jobs] == [r["id"] for r in client.list(limit=None)]


def test_the_same_id_submitted_twice_runs_once(client: Client, start_worker) -> None:
    """docs/PROTOCOL.md's zkCli example, twice: the second entry is a duplicate, never run."""
    client.ensure_queue("default")
    bucket = client.layout.bucket("default", "normal", 0)
    runner = GateRunner()
    runner.gate.set()
    handle = start_worker(runner)
    client.zk.create(f"{bucket}/myjob1-", b'{"prompt": "Hello"}', sequence=True)
    assert client.job("myjob1").result(timeout=10).output == "Hello"
    client.zk.create(f"{bucket}/myjob1-", b'{"prompt": "Hello"}', sequence=True)
    wait_for(lambda: handle.worker.stats.dead_lettered == 1, message="duplicate lettered")
    assert handle.worker.stats.completed == 1
    [letter] = client.dead()
    assert "duplicate" in letter["reason"]
    again = client.submit("Hello", job_id="myjob1", detach=True)
    assert again.existing and again.status() == "succeeded"
    assert handle.worker.stats.completed == 1


def test_a_reused_generated_id_writes_nothing_and_is_lettered(client: Client, start_worker) -> None:
    """Ids of the generated kind (``_`` and random hex) skip the head's duplicate check: a raw
    producer that reuses one breaks the contract, so its entry runs, but the completion's
    result create fails, the first result stands and the entry is lettered as a duplicate."""
    job = client.submit("first", detach=True)
    assert job.id.startswith("_")
    handle = start_worker()
    assert job.result(timeout=10).output == "first"
    client.zk.create(
        client.layout.entry_prefix("default", "normal", job.id, 0),
        b'{"prompt": "again"}',
        sequence=True,
    )
    wait_for(lambda: handle.worker.stats.dead_lettered == 1, message="duplicate lettered")
    [letter] = client.dead()
    assert "duplicate" in letter["reason"] and letter["id"] == job.id
    assert client.job(job.id).result(timeout=1).output == "first"
    assert client.zk.get_children(client.layout.claims("default")) == []
    stats = handle.worker.stats
    assert (stats.completed, stats.fenced) == (1, 0)
    with pytest.raises(InvalidJob, match="reserved"):
        client.submit("mine", job_id="_mine")


def test_a_version_1_root_is_refused_then_migrated(
    client: Client, new_zk, start_worker, zkq
) -> None:
    zk = new_zk()
    lay = client.layout
    for path in ("pending/high", "pending/normal", "pending/low", "claims", "line", "results"):
        zk.create(f"{lay.queue('default')}/{path}", makepath=True)
    pending = f"{lay.queue('default')}/pending/normal"
    for i in range(3):
        zk.create(f"{pending}/old{i}-", json.dumps({"prompt": f"v1 {i}"}).encode(), sequence=True)
    zk.create(f"{lay.results('default')}/done1", b'{"id":"done1","queue":"default",'
              b'"priority":"normal","status":"succeeded","finished_at":1.0}')  # fmt: skip
    with pytest.raises(ProtocolMismatch, match="zkq migrate"):
        client.submit("refused", detach=True)
    out = zkq("stats")
    assert out.returncode == ExitCode.CONFIG and "zkq migrate" in out.stderr
    report = migrate(zk, lay)
    assert (report.entries, report.results) == (3, 1)
    assert client.job("done1").status() == "succeeded"
    client._protocol_checked = False
    start_worker()
    assert [client.job(f"old{i}").result(timeout=10).output for i in range(3)] == [
        "v1 0",
        "v1 1",
        "v1 2",
    ]


def test_urgent_jobs_in_new_buckets_pass_a_busy_backlog(client: Client, start_worker) -> None:
    client._enqueue = Enqueuer(client, bucket_size=2)
    backlog = client.submit_many([f"normal {i}" for i in range(30)])
    start_worker(EchoRunner(delay=0.05))
    wait_for(lambda: client.stats()["queues"]["default"]["results"] >= 2, message="worker busy")
    # Five high jobs fill three high buckets while the head still has normal candidates.
    urgent = [client.submit(f"high {i}", priority="high", detach=True) for i in range(5)]
    started = {r.id: r.started_at or 0 for r in (j.result(timeout=30) for j in urgent + backlog)}
    last_urgent = max(started[j.id] for j in urgent)
    after = [j.id for j in backlog if started[j.id] > last_urgent]
    assert len(after) >= 10, f"only {len(after)} normal jobs ran after the last high one"


def test_results_expire_through_the_index_with_a_bound(
    client: Client, start_worker, monkeypatch
) -> None:
    monkeypatch.setattr(defaults, "EXPIRY_TICK", 0.5)  # index buckets of half a second
    start_worker()
    for job in client.submit_many([f"r{i}" for i in range(30)]):
        job.result(timeout=10)
    janitor = Janitor(client.zk, client.layout, limits=ExpiryLimits(max_results=10))
    report = janitor.run_pass()
    assert (report.results_removed, report.results_stored["default"]) == (20, 10)
    assert len(result_ids(client)) == 10
    time.sleep(1.1)  # their tick closes
    report = Janitor(client.zk, client.layout, result_ttl=0.0).run_pass()
    assert report.results_removed == 10 and result_ids(client) == []
    assert client.zk.get_children(client.layout.expiry("default")) == []


def test_an_attached_caller_consumes_its_result(client: Client, start_worker) -> None:
    start_worker()
    record = client.submit("consumed").result(timeout=10)
    wait_for(lambda: not result_ids(client), message="result and index node removed")
    expiry = client.layout.expiry("default")
    ticks = client.zk.get_children(expiry)
    assert [n for t in ticks for n in client.zk.get_children(f"{expiry}/{t}")] == []
    kept = client.submit("kept", keep_result=True)
    kept.result(timeout=10)
    assert result_ids(client) == [kept.id] and record.ok


def test_an_expired_producer_session_withdraws_its_request(
    client: Client, hosts: str, root: str
) -> None:
    producer = Client(hosts, root, session_timeout=2.0).start()
    try:
        job = producer.submit("nobody runs me")  # attached: its entry is ephemeral
        lost = KazooClient(hosts=hosts)
        lost.start()
        # Expire the producer's session from outside (what a long network partition does).
        session_id, password = producer.zk.client_id
        ghost = KazooClient(hosts=hosts, client_id=(session_id, password))
        ghost.start()
        ghost.stop()
        ghost.close()
        lost.stop()
        lost.close()
        with pytest.raises(JobWithdrawn, match="resubmitting is safe") as caught:
            job.result(timeout=20)
        assert caught.value.exit_code == ExitCode.WITHDRAWN == 10
        assert job.status() == "withdrawn"
    finally:
        producer.close()


def test_status_after_a_caller_timeout_is_withdrawn(client: Client) -> None:
    job = client.submit("no worker here")
    with pytest.raises(Exception, match="no result"):
        job.result(timeout=0.2)
    assert job.status() == "withdrawn"


def test_dead_letters_purge(client: Client, start_worker, zkq) -> None:
    client.ensure_queue("default")
    bucket = client.layout.bucket("default", "normal", 0)
    for i in range(3):
        client.zk.create(f"{bucket}/bad{i}-", b"not json", sequence=True)
    start_worker()
    wait_for(lambda: len(client.dead()) == 3, message="three letters")
    out = zkq("dead", "purge", "--older-than", "3600")
    assert out.returncode == 0 and "purged 0" in out.stdout
    out = zkq("dead", "purge")
    assert out.returncode == 0 and "purged 3" in out.stdout
    assert client.dead() == []
