"""Preemption forced often: full workers give low jobs back for a high job every second or so,
while a worker is killed with -9 mid-run. The promise: every job, low and high, ends succeeded
exactly once; a preempted job is pending again and runs to its end later."""

from __future__ import annotations

import statistics
import time
from typing import Any

from scripts.chaos.audit import Audit, ChaosReport, expect
from scripts.chaos.load import drain, feed, spawn_fleet
from scripts.chaos.stage import Stage, need


def preemption_storm(
    lows: int = 60,
    highs: int = 16,
    workers: int = 3,
    *,
    delay: float = 3.0,
    slots: int = 2,
    high_every: float = 1.0,
    session_timeout: float = 3.0,
    hosts: str | None = None,
    high_width: int | None = None,
) -> ChaosReport:
    """Low jobs faster than ``workers`` x ``slots`` echo slots serve them, so every slot is
    busy; jobs last ``delay`` seconds, long against the time a preemption takes, so that a high
    job finds every slot busy rather than one that freed a moment before (with 1 s jobs in four
    slots a slot frees every 0.25 s, and a loaded run once saw no preemption at all); a high
    job every ``high_every`` seconds, each taking the slot of a low one
    (``--preempt-protect 0.5``: the same low job may be preempted again half a second later);
    one worker killed with -9 once the preemptions have begun, and a replacement started.
    With ``high_width`` the workers also narrow while they run a high job (``--high-width``):
    low jobs that end are not replaced beyond it, and later high jobs take those free slots
    with nothing given back."""
    started = time.monotonic()
    narrowed = (
        "" if high_width is None else f", at most {high_width} job(s) held while a high one runs"
    )
    report = ChaosReport(
        "preempt" if high_width is None else "preempt-narrow",
        f"a high job every {high_every:g}s into {workers} full echo workers ({slots} slots, "
        f"{delay:g}s jobs{narrowed}) under {lows} low jobs, preemption protected for 0.5s; "
        "one worker killed with -9 mid-run",
        recovery="from the kill until the last job the killed worker held had its result",
    )
    extra: tuple[str, ...] = ("--preempt-protect", "0.5", "--preempt-per-minute", "600")
    if high_width is not None:
        extra += ("--high-width", str(high_width))
    with Stage("preempt", hosts=hosts, session_timeout=session_timeout) as st:
        fleet = spawn_fleet(st, "p", workers, delay=delay, slots=slots, extra=extra)
        low_feed = feed(st, lows, workers * slots / delay * 2, priority="low")
        need(lambda: len(st.claims_by_worker()) == workers, 30, "every worker busy")
        high_feed = feed(st, highs, 1 / high_every, priority="high")
        victim = fleet[0]
        need(lambda: victim.name in st.claims_by_worker(), 30, "the victim running jobs")
        time.sleep(highs * high_every / 2)  # half the high jobs have come: kill mid-run
        held = st.claims_by_worker().get(victim.name, set())
        t_kill = time.time()
        victim.kill()
        spare = st.spawn("p-spare", delay=delay, slots=slots, extra=extra)
        budget = session_timeout * 4 + lows * delay / (workers * slots) + 60
        drain(st, high_feed, budget)
        drain(st, low_feed, budget)
        a = st.audit(expect([*low_feed.ids, *high_feed.ids]))
        a.fill(report)
        report.workers = workers + 1
        report.recovery_s = a.last_of(sorted(held), t_kill)
        _checks(report, a, low_feed.ids, high_feed.ids)
        report.checks["the replacement served jobs"] = bool(a.by_worker(spare.name))
        report.details["submit_errors"] = low_feed.errors + high_feed.errors
        return st.finish(report, started)


def narrowed_preemption_storm(**sizes: Any) -> ChaosReport:
    """``preemption_storm`` with workers that hold one job at most while a high one runs: they
    add no low job beside a high one."""
    return preemption_storm(**sizes, high_width=1)


def _checks(report: ChaosReport, a: Audit, lows: list[str], highs: list[str]) -> None:
    preempted = [a.records[i].get("preemptions", 0) for i in lows if i in a.records]
    report.details["preemptions"] = sum(preempted)
    report.details["low_jobs_preempted"] = sum(1 for n in preempted if n)
    report.details["most_preemptions_of_one_job"] = max(preempted, default=0)
    report.checks["jobs were preempted"] = sum(preempted) > 0
    report.checks["no high job was preempted"] = not any(
        a.records.get(i, {}).get("preemptions") for i in highs
    )

    def waits(ids: list[str]) -> list[float]:
        return [
            float(r["started_at"]) - float(r["submitted_at"])
            for i in ids
            if (r := a.records.get(i)) and r.get("started_at") and r.get("submitted_at")
        ]

    high_wait, low_wait = waits(highs), waits(lows)
    if high_wait and low_wait:
        report.details["wait_p50_s"] = {
            "high": round(statistics.median(high_wait), 3),
            "low": round(statistics.median(low_wait), 3),
        }
        report.checks["high jobs waited less than low ones"] = statistics.median(
            high_wait
        ) < statistics.median(low_wait)
