"""Chaos: every scenario of scripts/chaos at a small size against real ZooKeeper servers and real
worker processes (the promise: every job ends with exactly one result), plus regression tests for
the library bugs the scenarios found."""

from __future__ import annotations

import json
import logging
from typing import Any

import pytest
from kazoo.client import KazooClient, TransactionRequest
from kazoo.exceptions import ConnectionLoss
from kazoo.protocol.connection import _CONNECTION_DROP

from scripts.chaos import crashes, garbage, outages, preempt
from scripts.chaos.audit import ChaosReport
from tests.conftest import result_ids, wait_for
from workers.runners.echo import EchoRunner
from zkqueue import Client
from zkqueue.operations.janitor import JanitorService
from zkqueue.testing import ZkCluster

pytestmark = pytest.mark.slow


@pytest.fixture(autouse=True)
def _quiet_kazoo() -> None:
    """The scenarios drop connections on purpose; kazoo would log each reconnect attempt."""
    logging.getLogger("kazoo").setLevel(logging.ERROR)


def assert_promise_held(report: ChaosReport) -> None:
    """No job lost or answered twice, nothing left behind, and the scenario's own checks."""
    context = f"{report.summary()}\n{json.dumps(report.details, default=str)}\n{report.logs}"
    assert report.jobs > 0, context
    assert report.lost == 0, context
    assert report.duplicated == 0, context
    assert report.leftovers == 0 and report.orphans == 0 and report.unexpected == 0, context
    assert report.exactly_once + report.withdrawn == report.jobs, context
    failed = [name for name, passed in report.checks.items() if not passed]
    assert not failed, context
    assert report.ok, context


def test_kill_9_of_workers_mid_job(zk_cluster: ZkCluster) -> None:
    report = crashes.kill_workers(jobs=20, workers=3, kills=1, hosts=zk_cluster.hosts)
    assert_promise_held(report)
    assert report.details["rerun_elsewhere"] >= 1
    assert max(report.attempts) >= 2
    # The dead worker's claim lingers until its session expires (3 s here), not much longer.
    assert report.recovery_s is not None and report.recovery_s < 15


def test_sigstop_longer_than_the_session_then_sigcont(zk_cluster: ZkCluster) -> None:
    report = crashes.stop_worker(jobs=12, workers=2, hosts=zk_cluster.hosts)
    assert_promise_held(report)
    assert report.details["stale_writes"] == 0
    assert report.checks["its session expired while it was stopped"]
    assert report.checks["the same process runs new jobs after SIGCONT"]
    assert report.recovery_s is not None and report.recovery_s < 15


def test_zookeeper_stopped_for_15s_then_restarted() -> None:
    report = outages.zookeeper_restart(jobs=12, workers=2, outage=15.0, attached=2)
    assert_promise_held(report)
    assert report.withdrawn == 0
    assert report.checks["worker processes alive, never restarted"]
    assert report.checks["attached producers got their results"]
    assert report.recovery_s is not None and report.recovery_s < 15


def test_ensemble_leader_then_follower_killed_and_restarted() -> None:
    report = outages.ensemble_failover(jobs=30, workers=3)
    assert_promise_held(report)
    assert report.checks["worker processes alive, never restarted"]
    assert report.details["submit_errors"] == []
    assert report.recovery_s is not None and report.recovery_s < 30


def test_hung_worker_is_fenced_by_its_lease(zk_cluster: ZkCluster) -> None:
    report = crashes.hung_worker(jobs=6, workers=1, hosts=zk_cluster.hosts)
    assert_promise_held(report)
    assert report.details["hung_job_attempts"] == 2
    assert report.details["hung_stats"] == {"completed": 0, "fenced": 1}


def test_garbage_entries_are_dead_lettered_and_good_jobs_run(zk_cluster: ZkCluster) -> None:
    report = garbage.garbage_entries(jobs=8, workers=2, hosts=zk_cluster.hosts)
    assert_promise_held(report)
    kinds = len(garbage.BAD_DATA) + len(garbage.BAD_NAMES)
    assert report.details["dead_letters"] == report.details["garbage_entries"] >= kinds + 2


def test_preemption_forced_often_with_a_worker_killed(zk_cluster: ZkCluster) -> None:
    report = preempt.preemption_storm(lows=24, highs=8, workers=2, hosts=zk_cluster.hosts)
    assert_promise_held(report)
    assert report.details["preemptions"] >= 1
    assert report.checks["high jobs waited less than low ones"]


def test_preemption_forced_often_with_narrowed_workers(zk_cluster: ZkCluster) -> None:
    report = preempt.narrowed_preemption_storm(lows=24, highs=8, workers=2, hosts=zk_cluster.hosts)
    assert_promise_held(report)
    assert report.checks["high jobs waited less than low ones"]


# -- regressions for bugs the scenarios found -----------------------------------------------


def test_connection_lost_while_completing_leaves_the_worker_running(
    client: Client, start_worker
) -> None:
    """A ZooKeeper error while the loop handled a finished batch (its completion in flight when
    the connection dropped) escaped Worker._step and ended the worker: after SIGSTOP/SIGCONT the
    process exited with "lost ZooKeeper". It must wait for the connection and retry."""
    handle = start_worker(EchoRunner(delay=0.1))
    zk = handle.worker.zk
    real_complete = handle.worker.claims.complete_many
    dropped: list[bool] = []

    def flaky_complete(*args: Any) -> list[bool]:
        if not dropped:
            dropped.append(True)
            zk._call(_CONNECTION_DROP, None)  # the connection drops...
            raise ConnectionLoss()  # ...with this completion in flight
        return real_complete(*args)

    handle.worker.claims.complete_many = flaky_complete  # type: ignore[method-assign]
    record = client.submit("survive the drop", detach=True).result(timeout=20)
    assert dropped and (record.status, record.attempts) == ("succeeded", 1)
    assert handle.thread.is_alive() and handle.error is None
    assert client.submit("and the next one", detach=True).result(timeout=10).ok


def _lose_reply_once(zk: KazooClient, kind: str, under: str) -> list[bool]:
    """Make the first multi with a ``kind`` op ("Create", "Delete"...) on a path containing
    ``under`` commit, then drop the connection and raise ConnectionLoss: its reply is lost, as
    when the server the worker talks to dies right after committing. Returns a list that gets
    an item when that happened."""
    real_transaction = zk.transaction
    lost: list[bool] = []

    def transaction() -> TransactionRequest:
        txn = real_transaction()
        real_commit = txn.commit

        def commit() -> list[object]:
            outcome = real_commit()
            ops = [op for op in txn.operations if type(op).__name__ == kind]
            if not lost and any(under in op.path for op in ops):
                lost.append(True)
                zk._call(_CONNECTION_DROP, None)
                raise ConnectionLoss()
            return outcome

        txn.commit = commit
        return txn

    zk.transaction = transaction
    return lost


def _line_nodes(client: Client) -> list[str]:
    return client.zk.get_children(client.layout.line("default"))


def test_claim_whose_reply_was_lost_does_not_stall_the_queue(client: Client, start_worker) -> None:
    """A claim multi that committed while its reply was lost left a claim nobody ran (the job
    waited for the 60 s lease) and a line place nobody held (the line stalled for good: seen
    when the ensemble's leader died). The worker now sweeps its unknown nodes on reconnect."""
    handle = start_worker(EchoRunner(delay=0.05), slots=2)
    lost = _lose_reply_once(handle.worker.zk, "Create", "/claims/")
    record = client.submit("claimed in the dark", detach=True).result(timeout=15)
    wait_for(lambda: bool(lost), message="the claim's reply lost")
    assert (record.status, record.attempts) == ("succeeded", 2)
    assert client.submit("the line still moves", detach=True).result(timeout=10).ok
    wait_for(lambda: len(_line_nodes(client)) == 1, message="one place in the line")
    assert client.zk.get_children(client.layout.claims("default")) == []


def test_completion_whose_reply_was_lost_does_not_stall_the_line(
    client: Client, start_worker
) -> None:
    """A completion that rejoins the line and commits unseen left a line place nobody held, at
    the head: the worker queued up behind its own ghost and nothing was claimed again."""
    handle = start_worker(EchoRunner(delay=0.05))
    lost = _lose_reply_once(handle.worker.zk, "Create", "/results/")
    record = client.submit("answered in the dark", detach=True).result(timeout=15)
    # The caller may hear of the result before the worker's thread is back from the commit
    # whose reply it then drops: wait for that, not only for the result.
    wait_for(lambda: bool(lost), message="the completion's reply lost")
    assert (record.status, record.attempts) == ("succeeded", 1)
    assert client.submit("and the next", detach=True).result(timeout=10).ok
    wait_for(lambda: len(_line_nodes(client)) == 1, message="one place in the line")
    assert len(result_ids(client)) == 2


def test_connection_lost_while_watching_a_claimed_job_still_runs_it(
    client: Client, start_worker
) -> None:
    """Setting the entry watch of a just-claimed job failed with the connection before the job
    was handed to the runner: it stayed 'running' forever and its slot was never freed. The job
    runs well past ENTRY_WATCH_DELAY, so its entry is always watched (one as short as that delay
    could end first, unwatched, and the failure would never be injected), and is still running
    when the worker sweeps after the reconnect: the sweep keeps the claims of the jobs it runs
    (it compared the claims' names, job ids, with entry names, deleted them all, and the job
    ran twice)."""
    handle = start_worker(EchoRunner(delay=0.5))
    worker = handle.worker
    real_watch = worker.bridge.watch
    failed: list[bool] = []

    def watch_fails_once(held: Any) -> None:
        if not failed:
            failed.append(True)
            worker.zk._call(_CONNECTION_DROP, None)
            raise ConnectionLoss()
        real_watch(held)

    worker.bridge.watch = watch_fails_once  # type: ignore[method-assign]
    record = client.submit("run me anyway", detach=True).result(timeout=15)
    assert failed and (record.status, record.attempts) == ("succeeded", 1)
    assert client.submit("and the next", detach=True).result(timeout=10).ok
    wait_for(lambda: all(j.watched for j in worker.held.values()), message="watches set")


def test_janitor_join_whose_reply_was_lost_does_not_block_the_election(
    client: Client, new_zk
) -> None:
    """A janitor candidate whose join committed unseen joined again behind its own ghost, which
    headed the election for as long as its session lived: no janitor ran anywhere."""
    client.ensure_queue("default")
    zk = new_zk()
    real_create = zk.create
    lost: list[bool] = []

    def create(path: str, *args: Any, **kwargs: Any) -> str:
        created: str = real_create(path, *args, **kwargs)
        if not lost and path.startswith(client.layout.janitor() + "/"):
            lost.append(True)
            zk._call(_CONNECTION_DROP, None)
            raise ConnectionLoss()
        return created

    zk.create = create
    service = JanitorService(zk, client.layout, "j", interval=0.1).start()
    try:
        wait_for(lambda: service.passes > 0, message="the janitor running passes")
        assert lost and len(client.zk.get_children(client.layout.janitor())) == 1
    finally:
        service.stop()


def test_entry_with_a_child_node_is_dead_lettered(client: Client, start_worker) -> None:
    """An entry with a node under it could never be deleted (NotEmpty): it ran max_attempts
    times, then dead-lettering failed on every turn and the job never ended."""
    client.ensure_queue("default")
    path = f"{client.layout.bucket('default', 'normal', 0)}/nested-0000000001"
    txn = client.zk.transaction()
    txn.create(path, b'{"prompt": "x"}')
    txn.create(f"{path}/child", b"")
    txn.create(f"{path}/child/grandchild", b"")
    txn.commit()
    handle = start_worker()
    record = client.job("nested").result(timeout=10)
    assert record.status == "dead" and "child node" in (record.error or "")
    assert (record.attempts, handle.worker.stats.claimed) == (0, 0)
    assert client.zk.exists(path) is None
    assert client.submit("next", detach=True).result(timeout=10).ok


def test_junk_node_in_the_line_does_not_kill_workers(client: Client, start_worker) -> None:
    client.ensure_queue("default")
    client.zk.create(f"{client.layout.line('default')}/w-junk", b"written by another client")
    handle = start_worker()
    job = client.submit("still served", detach=True)
    wait_for(
        lambda: handle.error is not None or client.zk.exists(job.result_path),
        message="the job served or the worker dead",
    )
    assert handle.error is None and job.result(timeout=1).ok
