"""Worker processes that die, freeze or hang mid-job: kill -9, SIGSTOP longer than the session,
and a runner that hangs with its session alive (only the lease can free its job)."""

from __future__ import annotations

import signal
import time

from scripts.chaos.audit import QUEUE, Audit, ChaosReport, expect
from scripts.chaos.inprocess import HungRunner, InProcessWorker, start_janitor
from scripts.chaos.load import drain, feed, registered_since, spawn_fleet
from scripts.chaos.stage import Stage, WorkerProcess, hold, need, poll
from zkqueue.producer.job import Job

# -- (a) kill -9 -----------------------------------------------------------------------------


def kill_workers(
    jobs: int = 40,
    workers: int = 4,
    *,
    kills: int = 2,
    delay: float = 0.5,
    slots: int = 2,
    session_timeout: float = 3.0,
    hosts: str | None = None,
) -> ChaosReport:
    """kill -9 of ``kills`` workers while they run jobs under a steady load of detached jobs;
    as many replacements start at once. The dead workers' claims vanish with their sessions
    (after the session timeout) and the jobs run again elsewhere."""
    started = time.monotonic()
    report = ChaosReport(
        "kill-9",
        f"kill -9 of {kills} of {workers} echo workers ({slots} slots, {delay:g}s jobs) mid-job "
        f"under steady load; {kills} replacement(s) started",
        recovery="from the kill until the last job the killed workers held had its result "
        "(ZooKeeper frees their claims when their sessions expire)",
    )
    with Stage("kill9", hosts=hosts, session_timeout=session_timeout) as st:
        fleet = spawn_fleet(st, "w", workers, delay=delay, slots=slots)
        feeder = feed(st, jobs, workers * slots / delay * 0.6)
        victims, doomed = _pick_victims(st, fleet, kills)
        t_kill = time.time()
        for victim in victims:
            victim.kill()
        spares = [st.spawn(f"r{i}", delay=delay, slots=slots) for i in range(kills)]
        drain(st, feeder, session_timeout * 4 + 30)
        a = st.audit(expect(feeder.ids))
        a.fill(report)
        report.workers = workers + kills
        rerun = [i for i in doomed if a.ctimes.get(i, 0) > t_kill]  # not finished before it
        report.recovery_s = a.last_of(rerun, t_kill)
        _kill_checks(report, a, st, fleet, victims, spares, doomed, t_kill)
        report.details["submit_errors"] = feeder.errors
        return st.finish(report, started)


def _pick_victims(
    st: Stage, fleet: list[WorkerProcess], kills: int
) -> tuple[list[WorkerProcess], set[str]]:
    """Workers that hold claims right now, and the jobs they hold."""
    names = {w.name for w in fleet}

    def busy() -> dict[str, set[str]]:
        held = {w: ids for w, ids in st.claims_by_worker().items() if w in names}
        return held if len(held) >= kills else {}

    held = need(busy, 30, f"{kills} workers running jobs")
    chosen = sorted(held)[:kills]
    victims = [w for w in fleet if w.name in chosen]
    return victims, set().union(*(held[n] for n in chosen))


def _kill_checks(
    report: ChaosReport,
    a: Audit,
    st: Stage,
    fleet: list[WorkerProcess],
    victims: list[WorkerProcess],
    spares: list[WorkerProcess],
    doomed: set[str],
    t_kill: float,
) -> None:
    dead = {v.name for v in victims}
    rerun = [i for i in doomed if a.records.get(i, {}).get("worker") not in dead]
    late = [
        r
        for r in a.records.values()
        if r.get("worker") in dead and a.ctimes.get(r["id"], 0) > t_kill + 1
    ]
    report.details.update(killed_jobs=len(doomed), rerun_elsewhere=len(rerun))
    report.checks["the killed workers' jobs ran again elsewhere"] = bool(rerun)
    report.checks["no result from a killed worker after its kill"] = not late
    report.checks["replacements served jobs"] = any(a.by_worker(s.name) for s in spares)
    survivors = [w for w in fleet if w not in victims] + spares
    report.checks["every other worker still running"] = st.all_alive(survivors)


# -- (b) SIGSTOP longer than the session -----------------------------------------------------


def stop_worker(
    jobs: int = 30,
    workers: int = 3,
    *,
    delay: float = 0.5,
    slots: int = 1,
    session_timeout: float = 3.0,
    pause: float | None = None,
    hosts: str | None = None,
) -> ChaosReport:
    """SIGSTOP one worker mid-job for longer than its session timeout (a VM freeze, a GC pause,
    a debugger), then SIGCONT. ZooKeeper expires its session, so its claim goes and the job runs
    elsewhere; when it wakes it must write nothing for the old claim, notice the lost session,
    register again and take new jobs, all in the same process."""
    pause = session_timeout * 2 + 1 if pause is None else pause
    started = time.monotonic()
    report = ChaosReport(
        "sigstop",
        f"SIGSTOP of 1 of {workers} workers mid-job for {pause:g}s (session timeout "
        f"{session_timeout:g}s), then SIGCONT",
        recovery="from SIGCONT until the stopped worker was registered again (new session)",
    )
    with Stage("sigstop", hosts=hosts, session_timeout=session_timeout) as st:
        fleet = spawn_fleet(st, "w", workers, delay=delay, slots=slots)
        victim, others = fleet[0], fleet[1:]
        feeder = feed(st, jobs, max(1, workers - 1) * slots / delay * 0.6)
        held = need(lambda: st.claims_by_worker().get(victim.name), 30, "the victim running a job")
        t_stop = time.time()
        victim.send(signal.SIGSTOP)
        expired = poll(lambda: victim.name not in st.registered(), pause)
        hold(t_stop + pause - time.time(), lambda: st.all_alive(others), "a worker exited")
        t_cont = time.time()
        victim.send(signal.SIGCONT)
        back = poll(lambda: registered_since(st, victim.name, t_cont), session_timeout * 3 + 10)
        drain(st, feeder, session_timeout * 4 + 30)
        follow = _only_victim_left(st, victim, others, workers)
        a = st.audit(expect([*feeder.ids, *follow]))
        a.fill(report)
        report.workers = workers
        report.recovery_s = None if back is None else back - t_cont
        report.details.update(held_at_stop=sorted(held), submit_errors=feeder.errors)
        report.checks["its session expired while it was stopped"] = bool(expired)
        _stop_checks(report, a, victim, held, follow, t_stop, t_cont)
        return st.finish(report, started)


def _only_victim_left(
    st: Stage, victim: WorkerProcess, others: list[WorkerProcess], count: int
) -> list[str]:
    """Drain the other workers away, then submit ``count`` jobs only the victim can run."""
    for w in others:
        w.terminate()
    ids = [st.client.submit(f"after SIGCONT {i}", detach=True).id for i in range(count)]
    st.drained(ids, 30)
    return ids


def _stop_checks(
    report: ChaosReport,
    a: Audit,
    victim: WorkerProcess,
    held: set[str],
    follow: list[str],
    t_stop: float,
    t_cont: float,
) -> None:
    mine = a.by_worker(victim.name)
    stale = [r for r in mine if r.get("started_at", 0) < t_stop and a.ctimes[r["id"]] >= t_cont]
    elsewhere = [i for i in held if a.records.get(i, {}).get("worker") not in (None, victim.name)]
    report.details.update(stale_writes=len(stale), held_rerun_elsewhere=len(elsewhere))
    report.checks["no result from the stale worker for a claim made before SIGSTOP"] = not stale
    report.checks["the job it held ran again elsewhere"] = len(elsewhere) == len(held)
    report.checks["the same process runs new jobs after SIGCONT"] = victim.alive and all(
        a.records.get(i, {}).get("worker") == victim.name for i in follow
    )


# -- (e) a hung worker -----------------------------------------------------------------------


def hung_worker(
    jobs: int = 10,
    workers: int = 2,
    *,
    lease: float = 1.0,
    janitor_interval: float = 0.2,
    delay: float = 0.2,
    session_timeout: float = 3.0,
    hosts: str | None = None,
) -> ChaosReport:
    """A worker whose runner hangs (its session stays alive, kazoo keeps pinging) holds the
    first job. Only the lease can free it: the worker stops renewing without progress, the
    elected janitor deletes the lapsed claim, a healthy worker runs the job, and when the hung
    runner finally returns its completion is refused (fenced by the entry's version)."""
    started = time.monotonic()
    report = ChaosReport(
        "hung",
        f"a worker's runner hangs mid-job with its session alive (lease {lease:g}s, janitor "
        f"every {janitor_interval:g}s); {workers} healthy worker(s)",
        recovery="from the hung worker's claim until another worker's result for that job "
        "(lease + a janitor pass + the run)",
    )
    with Stage("hung", hosts=hosts, session_timeout=session_timeout) as st:
        runner = HungRunner()
        hung = InProcessWorker(st, runner, "hung", lease=lease)
        st.on_close(hung.stop)
        st.on_close(runner.release.set)
        hung.start()
        start_janitor(st, janitor_interval)
        first = st.client.submit("hang on me", detach=True)
        need(runner.started.is_set, 15, "the hung worker running the first job")
        t_claim = _claim_time(st, first)
        spawn_fleet(st, "w", workers, delay=delay, slots=1, extra=["--no-janitor"])
        rest = [st.client.submit(f"job {i}", detach=True).id for i in range(jobs - 1)]
        st.drained([first.id, *rest], lease * 4 + jobs * delay + 30)
        runner.release.set()
        poll(lambda: hung.worker.busy == 0, 15)
        a = st.audit(expect([first.id, *rest]))
        a.fill(report)
        report.workers = workers + 1
        report.recovery_s = a.last_of([first.id], t_claim)
        _hung_checks(report, a, hung, first.id)
        return st.finish(report, started)


def _claim_time(st: Stage, job: Job) -> float:
    stat = st.zk.exists(st.layout.claim(QUEUE, job.entry or ""))
    return time.time() if stat is None else stat.ctime / 1000


def _hung_checks(report: ChaosReport, a: Audit, hung: InProcessWorker, job_id: str) -> None:
    record = a.records.get(job_id, {})
    stats = hung.worker.stats
    report.details.update(
        hung_job_worker=record.get("worker"),
        hung_job_attempts=record.get("attempts"),
        hung_stats={"completed": stats.completed, "fenced": stats.fenced},
    )
    report.checks["the hung job was reclaimed and finished elsewhere"] = (
        record.get("worker") not in (None, "hung") and record.get("attempts") == 2
    )
    report.checks["the hung worker wrote no result"] = not a.by_worker("hung")
    report.checks["its late completion was refused (fenced)"] = stats.fenced == 1
    report.checks["the hung worker's loop survived"] = hung.error is None
