"""Preemption against a real ZooKeeper: a full worker gives back its newest lower-priority job for
a more urgent one, in one multi; the given-back job is pending again, uncounted, and ends with
exactly one result; with preemption off an urgent job waits for a slot, as before."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

from tests.conftest import WorkerThread, flush_watches, result_ids, wait_for
from tests.runners import HoldRunner, RecordingRunner
from workers.loop import Worker
from workers.metrics import WorkerMetrics
from workers.options import WorkerOptions
from workers.runners.echo import EchoRunner
from zkqueue import Client
from zkqueue.protocol.layout import is_line_member
from zkqueue.protocol.spec import JobSpec


def _full_worker(
    start_worker: Callable[..., WorkerThread],
    client: Client,
    slots: int,
    waiting: int = 2,
    **opts: Any,
) -> tuple[HoldRunner, WorkerThread, list[str]]:
    """A worker whose ``slots`` all run low jobs (held), with ``waiting`` more behind them."""
    runner = HoldRunner()
    handle = start_worker(runner, slots=slots, **opts)
    lows = [
        client.submit(f"low-{i}", priority="low", detach=True).id for i in range(slots + waiting)
    ]
    wait_for(lambda: len(runner.running()) == slots, message="every slot busy")
    return runner, handle, lows


def _spec(client: Client, job_id: str) -> JobSpec:
    job = client.job(job_id)
    assert job.info()["state"] == "pending"
    data, _ = client.zk.get(job.entry_path)
    return JobSpec.from_bytes(data)


def test_a_high_job_takes_the_newest_low_jobs_slot(
    client: Client, start_worker: Callable[..., WorkerThread]
) -> None:
    metrics = WorkerMetrics()
    runner, handle, lows = _full_worker(start_worker, client, slots=3, metrics=metrics)
    first = runner.running()
    high = client.submit("urgent", priority="high", detach=True)
    wait_for(lambda: "urgent" in runner.running(), message="the high job running")
    # The newest low job (the last claimed) was given back; the others still run.
    assert sorted(runner.running()) == sorted([*first[:-1], "urgent"])
    victim = lows[int(first[-1].split("-")[1])]
    spec = _spec(client, victim)  # pending again, its preemption counted in its spec
    assert spec.preemptions == 1 and spec.preempted_at is not None
    assert handle.worker.stats.preempted == 1
    preempted = {"queue": "default", "priority": "low"}
    assert metrics.registry.get_sample_value("zkq_preemptions_total", preempted) == 1
    wait_for(
        lambda: [w.get("preempted") for w in client.workers()] == [1],
        message="the registration counting the preemption",
    )
    runner.release_all()
    assert high.result(timeout=10).ok
    # Every low job ends succeeded, once; the preempted one says so, with one attempt.
    results = {job_id: client.job(job_id).result(timeout=15) for job_id in lows}
    assert all(r.ok for r in results.values())
    assert results[victim].get("preemptions") == 1
    assert results[victim].attempts == 1
    assert [r.get("preemptions") for j, r in results.items() if j != victim] == [None] * 4
    assert len(result_ids(client)) == len(lows) + 1


def test_preempted_jobs_are_the_lowest_priority_first(
    client: Client, start_worker: Callable[..., WorkerThread]
) -> None:
    runner = HoldRunner()
    start_worker(runner, slots=2)
    client.submit("normal", priority="normal", detach=True)
    wait_for(lambda: runner.running() == ["normal"], message="the normal job running")
    client.submit("low", priority="low", detach=True)  # newer, but lower: the victim
    wait_for(lambda: len(runner.running()) == 2, message="slots busy")
    high = client.submit("urgent", priority="high", detach=True)
    wait_for(lambda: "urgent" in runner.running(), message="the high job running")
    assert sorted(runner.running()) == ["normal", "urgent"]
    runner.release_all()
    assert high.result(timeout=10).ok


def test_a_normal_job_preempts_a_low_one(
    client: Client, start_worker: Callable[..., WorkerThread]
) -> None:
    runner, _, _ = _full_worker(start_worker, client, slots=2, waiting=0)
    client.submit("normal", priority="normal", detach=True)
    wait_for(lambda: "normal" in runner.running(), message="the normal job running")
    runner.release_all()


def test_an_idle_worker_takes_the_urgent_job_instead(
    client: Client, start_worker: Callable[..., WorkerThread]
) -> None:
    runner, busy, _ = _full_worker(start_worker, client, slots=2, waiting=0)
    idle = start_worker(EchoRunner(), slots=1)
    high = client.submit("urgent", priority="high", detach=True)
    assert high.result(timeout=10).worker == idle.worker.id
    flush_watches(busy.worker.zk)
    assert busy.worker.stats.preempted == 0
    assert len(runner.running()) == 2
    runner.release_all()


def test_jobs_of_the_same_priority_are_never_preempted(
    client: Client, start_worker: Callable[..., WorkerThread]
) -> None:
    runner = HoldRunner()
    handle = start_worker(runner, slots=2)
    for i in range(2):
        client.submit(f"high-{i}", priority="high", detach=True)
    wait_for(lambda: len(runner.running()) == 2, message="slots busy")
    late = client.submit("late", priority="high", detach=True)
    flush_watches(handle.worker.zk)
    assert late.status() == "pending"
    assert handle.worker.stats.preempted == 0
    runner.release_all()
    assert late.result(timeout=10).ok


def test_without_preemption_an_urgent_job_waits_for_a_slot(
    client: Client, start_worker: Callable[..., WorkerThread]
) -> None:
    runner, handle, lows = _full_worker(start_worker, client, slots=2, preempt=False)
    high = client.submit("urgent", priority="high", detach=True)
    # Nobody hears of it (a full worker stands in no line): it waits, every low job runs on.
    flush_watches(handle.worker.zk)
    assert high.status() == "pending"
    assert sorted(runner.running()) == ["low-0", "low-1"]
    runner.release("low-0")
    wait_for(lambda: "urgent" in runner.running(), message="the high job in the freed slot")
    # It went before the low jobs that were still waiting.
    seen = [j.spec.prompt for j in runner.jobs]
    assert seen[:3] == ["low-0", "low-1", "urgent"]
    runner.release_all()
    assert high.result(timeout=10).ok
    assert handle.worker.stats.preempted == 0
    for job_id in lows:
        record = client.job(job_id).result(timeout=10)
        assert record.ok and record.get("preemptions") is None


def test_a_recently_preempted_job_is_protected(
    client: Client, start_worker: Callable[..., WorkerThread]
) -> None:
    runner, handle, lows = _full_worker(
        start_worker, client, slots=1, waiting=1, preempt_protect=600
    )
    client.submit("urgent-1", priority="high", detach=True)
    wait_for(lambda: runner.running() == ["urgent-1"], message="the first preemption")
    runner.release("urgent-1")
    # low-0, given back, is first in line again, and now protected.
    wait_for(lambda: runner.running() == ["low-0"], message="the preempted job running again")
    second = client.submit("urgent-2", priority="high", detach=True)
    flush_watches(handle.worker.zk)
    assert second.status() == "pending"
    assert handle.worker.stats.preempted == 1
    runner.release_all()
    assert second.result(timeout=10).ok
    assert client.job(lows[0]).result(timeout=10).get("preemptions") == 1


def test_preemptions_per_minute_are_capped(
    client: Client, start_worker: Callable[..., WorkerThread]
) -> None:
    runner, handle, _ = _full_worker(start_worker, client, slots=2, preempt_per_minute=1)
    client.submit("urgent-1", priority="high", detach=True)
    wait_for(lambda: "urgent-1" in runner.running(), message="the first preemption")
    second = client.submit("urgent-2", priority="high", detach=True)
    flush_watches(handle.worker.zk)
    assert second.status() == "pending"
    assert handle.worker.stats.preempted == 1
    runner.release_all()
    assert second.result(timeout=10).ok


def _in_line(client: Client) -> int:
    """Members of the default queue's line (workers with a slot free for any job)."""
    names = client.zk.get_children(client.layout.line("default"))
    return sum(is_line_member(n) for n in names)


def test_while_a_high_job_runs_the_worker_holds_no_more_than_its_high_width(
    client: Client, start_worker: Callable[..., WorkerThread]
) -> None:
    runner, handle, lows = _full_worker(start_worker, client, slots=4, waiting=3, high_width=2)
    first = client.submit("urgent-1", priority="high", detach=True)
    wait_for(lambda: "urgent-1" in runner.running(), message="the high job running")
    assert handle.worker.stats.preempted == 1  # one low job given back for it, as before
    running_lows = [p for p in runner.running() if p.startswith("low-")]
    assert len(running_lows) == 3
    # Two low jobs end: their slots are not given to the low jobs waiting (4 of them), since
    # the worker already holds more than 2; it stands in no line meanwhile.
    for prompt in running_lows[:2]:
        runner.release(prompt)
    wait_for(lambda: handle.worker.busy == 2, message="two low jobs ended")
    flush_watches(handle.worker.zk)
    assert _in_line(client) == 0
    assert sorted(runner.running()) == sorted([running_lows[2], "urgent-1"])
    # A second high job takes a free slot, with nothing given back.
    second = client.submit("urgent-2", priority="high", detach=True)
    wait_for(lambda: "urgent-2" in runner.running(), message="the second high job running")
    assert handle.worker.stats.preempted == 1
    assert len(runner.running()) == 3
    handed_in = [j.spec.prompt for j in runner.jobs]
    assert handed_in[4:] == ["urgent-1", "urgent-2"]  # no low job in between
    # The high jobs end: the worker fills its slots with low jobs again.
    runner.release("urgent-1", "urgent-2")
    assert first.result(timeout=10).ok and second.result(timeout=10).ok
    wait_for(lambda: len(runner.running()) == 4, message="every slot busy with low jobs again")
    runner.release_all()
    results = [client.job(job_id).result(timeout=15) for job_id in lows]
    assert all(r.ok for r in results)
    assert len(result_ids(client)) == len(lows) + 2


def test_with_high_width_off_a_low_job_refills_the_slot_beside_a_high_one(
    client: Client, start_worker: Callable[..., WorkerThread]
) -> None:
    runner, handle, _ = _full_worker(start_worker, client, slots=4, waiting=3, high_width="off")
    client.submit("urgent", priority="high", detach=True)
    wait_for(lambda: "urgent" in runner.running(), message="the high job running")
    running_lows = [p for p in runner.running() if p.startswith("low-")]
    runner.release(running_lows[0])
    wait_for(
        lambda: len(runner.running()) == 4 and running_lows[0] not in runner.running(),
        message="a low job in the freed slot",
    )
    assert handle.worker.high_width is None
    runner.release_all()


def test_a_narrowed_worker_takes_a_high_job_into_a_free_slot_with_preemption_off(
    client: Client, start_worker: Callable[..., WorkerThread]
) -> None:
    runner, handle, _ = _full_worker(
        start_worker, client, slots=4, waiting=2, high_width=2, preempt=False
    )
    first = client.submit("urgent-1", priority="high", detach=True)
    runner.release("low-0")  # no preemption: the high job waits for this slot
    wait_for(lambda: "urgent-1" in runner.running(), message="the high job in the freed slot")
    runner.release("low-1", "low-2")
    wait_for(lambda: handle.worker.busy == 2, message="two more low jobs ended")
    second = client.submit("urgent-2", priority="high", detach=True)
    wait_for(lambda: "urgent-2" in runner.running(), message="the second high job running")
    assert sorted(runner.running()) == ["low-3", "urgent-1", "urgent-2"]
    assert handle.worker.stats.preempted == 0
    runner.release_all()
    assert first.result(timeout=10).ok and second.result(timeout=10).ok


def test_a_narrowed_worker_held_back_by_max_running_hears_a_slot_free_elsewhere(
    client: Client, start_worker: Callable[..., WorkerThread]
) -> None:
    """A narrowed worker's free slots are for high jobs; when the queue's max_running leaves
    it no room, it watches claims/, so a job ending on another worker lets the waiting high
    job in at once, not at its next heartbeat (30 s here)."""
    client.set_limits("default", max_running=3)
    runner = HoldRunner()
    handle = start_worker(runner, slots=4, high_width=2, preempt=False, heartbeat_interval=30)
    # A job running elsewhere, as claims/ shows it: one claim node, the test's.
    elsewhere = client.zk.create(f"{client.layout.claims('default')}/elsewhere", ephemeral=True)
    client.submit("low-0", priority="low", detach=True)
    wait_for(lambda: runner.running() == ["low-0"], message="the low job running")
    first = client.submit("urgent-1", priority="high", detach=True)
    wait_for(lambda: "urgent-1" in runner.running(), message="the high job running")
    # 3 running: the cap. Narrowed (a high job runs, 2 held), its 2 free slots wait for high
    # jobs alone, and the cap leaves none of them.
    second = client.submit("urgent-2", priority="high", detach=True)
    wait_for(lambda: handle.worker.preemption.capped, message="the busy head held back by the cap")
    assert "urgent-2" not in runner.running()
    client.zk.delete(elsewhere)  # the job elsewhere ends
    wait_for(lambda: "urgent-2" in runner.running(), timeout=5, message="the second high job")
    runner.release_all()
    assert first.result(timeout=10).ok and second.result(timeout=10).ok


def test_urgent_picks_go_through_when_a_guard_keeps_failing(
    client: Client, new_zk: Callable[..., Any], root: str
) -> None:
    """A claim that holds a less urgent job checks that the more urgent tails did not change
    since the head looked. Under a stream of urgent arrivals that check keeps failing: the
    urgent picks of the claim are then claimed alone, rather than none (here the check is
    made to fail every time)."""
    normal = client.submit_many(["n1", "n2"], priority="normal")
    client.submit_many(["h1", "h2"], priority="high")
    runner = RecordingRunner()
    worker = Worker(new_zk(4.0), runner, WorkerOptions(root=root, max_concurrency=4))
    real = worker.head.view.guards
    high = client.layout.pending("default", "high")

    def failing(lowest: str) -> list[tuple[str, int]]:
        checks = real(lowest)
        return [*checks, (high, 10**6)] if lowest != "high" else checks

    worker.head.view.guards = failing  # type: ignore[method-assign]
    handle = WorkerThread(worker).start()
    try:
        wait_for(lambda: sorted(runner.seen) == ["h1", "h2"], message="the high jobs run")
        assert worker.head.stats.guarded >= 1
        assert [job.status() for job in normal] == ["pending"] * 2
        worker.head.view.guards = real  # type: ignore[method-assign]
        wait_for(lambda: len(runner.seen) == 4, message="the normal jobs run once it holds")
    finally:
        handle.stop()
