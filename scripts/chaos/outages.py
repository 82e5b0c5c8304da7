"""ZooKeeper servers that stop: the standalone server stopped and restarted on the same data,
and a 3-server ensemble that loses its leader, then its quorum. Nobody else is restarted."""

from __future__ import annotations

import time

from scripts.chaos.audit import Audit, ChaosReport, expect
from scripts.chaos.load import Feeder, Waiter, drain, feed, served_after, sessions_kept, spawn_fleet
from scripts.chaos.stage import Stage, WorkerProcess, hold, need
from zkqueue.testing import ZkServer

# -- (c) the ZooKeeper server stops and comes back ------------------------------------------


def zookeeper_restart(
    jobs: int = 30,
    workers: int = 3,
    *,
    outage: float = 15.0,
    delay: float = 0.5,
    slots: int = 2,
    attached: int = 3,
    session_timeout: float = 3.0,
) -> ChaosReport:
    """Stop the (standalone) ZooKeeper server for ``outage`` seconds while jobs run and
    attached producers wait on their results, then start it again on the same data dir and
    port. Nobody is restarted: the workers and the producers must carry on by themselves."""
    started = time.monotonic()
    report = ChaosReport(
        "zk-restart",
        f"standalone ZooKeeper stopped for {outage:g}s mid-load (session timeout "
        f"{session_timeout:g}s), restarted on the same data dir and port",
        recovery="from the server restart until the first result committed after it",
    )
    with Stage("zkrestart", session_timeout=session_timeout) as st:
        assert st.cluster is not None
        server = st.cluster.servers[0]
        fleet = spawn_fleet(st, "w", workers, delay=delay, slots=slots)
        pids = [w.pid for w in fleet]
        before = [st.client.submit(f"before {i}", detach=True).id for i in range(jobs // 2)]
        waiters = [Waiter(st.client, f"attached {i}", outage + 60).start() for i in range(attached)]
        # Every worker holds jobs through the outage: then each must complete some after it.
        need(
            lambda: all(w.job for w in waiters) and len(st.claims_by_worker()) == workers,
            30,
            "jobs running on every worker",
        )
        t_stop = time.time()
        server.stop()
        hold(
            outage, lambda: st.all_alive(fleet), "a worker process exited while ZooKeeper was down"
        )
        t_restart = time.time()
        server.start()
        server.wait_serving(60)
        serving = time.time() - t_restart
        after = [st.client.submit(f"after {i}", detach=True).id for i in range(jobs - len(before))]
        drained = st.drained([*before, *after], session_timeout * 4 + 60)
        for w in waiters:
            w.join(30)
        a = _audit_with_waiters(st, [*before, *after], waiters)
        a.fill(report)
        report.workers = workers
        report.recovery_s = a.first_after(t_restart)
        report.details.update(serving_s=round(serving, 2), drained=drained, outage_s=outage)
        report.details["drain_s"] = a.last_of(after, t_restart)
        _restart_checks(report, a, st, fleet, pids, waiters, t_stop, t_restart)
        return st.finish(report, started)


def _audit_with_waiters(st: Stage, detached: list[str], waiters: list[Waiter]) -> Audit:
    ids = [*detached, *(w.job.id for w in waiters if w.job)]
    received = {w.job.id: w.record for w in waiters if w.job and w.record}
    withdrawn = [w.job.id for w in waiters if w.job and w.withdrawn]
    return st.audit(expect(ids), received, withdrawn)


def _restart_checks(
    report: ChaosReport,
    a: Audit,
    st: Stage,
    fleet: list[WorkerProcess],
    pids: list[int],
    waiters: list[Waiter],
    t_stop: float,
    t_restart: float,
) -> None:
    report.details["sessions_kept"] = sessions_kept(st, fleet, t_stop)
    report.details["waiter_errors"] = [w.error for w in waiters if w.error]
    report.checks["worker processes alive, never restarted"] = (
        st.all_alive(fleet) and [w.pid for w in fleet] == pids
    )
    report.checks["every worker completed jobs after the restart"] = all(
        served_after(a, w.name, t_restart) for w in fleet
    )
    report.checks["attached producers got their results"] = all(w.record for w in waiters)


# -- (d) ensemble failover -------------------------------------------------------------------


def ensemble_failover(
    jobs: int = 60,
    workers: int = 3,
    *,
    delay: float = 0.3,
    slots: int = 2,
    quorum_outage: float = 3.0,
    session_timeout: float = 4.0,
) -> ChaosReport:
    """A 3-server ensemble under a steady load: kill -9 the leader (the other two elect a new
    one), then a follower (one server left: no quorum, nothing can be written), hold that for
    ``quorum_outage`` seconds, then start both again. Workers and the producer know all three
    servers and are never restarted."""
    started = time.monotonic()
    report = ChaosReport(
        "ensemble",
        f"3-server ensemble under steady load: kill -9 of the leader, then of a follower "
        f"(no quorum for {quorum_outage:g}s), then both restarted",
        recovery="from restarting the two killed servers until the first result committed "
        "after it (quorum back)",
    )
    with Stage("ensemble", servers=3, session_timeout=session_timeout) as st:
        assert st.cluster is not None
        fleet = spawn_fleet(st, "w", workers, delay=delay, slots=slots)
        pids = [w.pid for w in fleet]
        feeder = feed(st, jobs, workers * slots / delay * 0.5)
        need(lambda: len(st.result_ids()) >= 3, 30, "results flowing")
        t_leader, killed = _kill_leader_then_follower(st, fleet, feeder, quorum_outage)
        t_restart = time.time()
        for server in killed:
            server.start()
        for server in killed:
            server.wait_serving(60)
        feeder.resume()
        drain(st, feeder, session_timeout * 4 + 30)
        a = st.audit(expect(feeder.ids))
        a.fill(report)
        report.workers = workers
        report.recovery_s = a.first_after(t_restart)
        report.details.update(
            failover_s=a.first_after(t_leader),
            drain_s=a.last_of(feeder.ids, t_restart),
            submit_errors=feeder.errors,
            leader_after=next((s.myid for s in st.cluster.servers if s.mode() == "leader"), None),
            sessions_kept=sessions_kept(st, fleet, t_leader),
        )
        report.checks["worker processes alive, never restarted"] = (
            st.all_alive(fleet) and [w.pid for w in fleet] == pids
        )
        report.checks["the producer never saw an error"] = not feeder.errors
        report.checks["jobs completed between the leader's and the follower's death"] = (
            report.details["failover_s"] is not None
        )
        return st.finish(report, started)


def _kill_leader_then_follower(
    st: Stage, fleet: list[WorkerProcess], feeder: Feeder, quorum_outage: float
) -> tuple[float, list[ZkServer]]:
    """kill -9 the leader; once the other two serve again and a job completed, kill -9 a
    follower and hold the quorum loss. Returns the leader's kill time and the killed servers."""
    assert st.cluster is not None
    cluster = st.cluster
    leader = need(cluster.leader, 30, "a leader")
    t_leader = time.time()
    leader.kill()
    need(cluster.leader, 30, "a new leader")
    done = len(st.result_ids())
    need(lambda: len(st.result_ids()) > done, 30, "a result after the leader died")
    follower = need(cluster.followers, 30, "a follower")[0]
    feeder.pause()  # a create in flight at the kill would fail ambiguously (see RELIABILITY.md)
    follower.kill()
    hold(quorum_outage, lambda: st.all_alive(fleet), "a worker exited while there was no quorum")
    return t_leader, [leader, follower]
