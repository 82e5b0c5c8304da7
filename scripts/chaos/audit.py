"""The audit: what a scenario did and what the queue holds afterwards, against what was
submitted. The promise under test: every job ends with exactly one result record (or is
withdrawn by design), whatever crashes, hangs, failovers or garbage came first."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Iterable, Mapping
from dataclasses import dataclass, field
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError

from zkqueue import defaults
from zkqueue.protocol import counts
from zkqueue.protocol import result as results
from zkqueue.protocol.layout import RESULT_BUCKETS, Layout

#: The one queue every scenario uses.
QUEUE = defaults.QUEUE


# -- the report ------------------------------------------------------------------------------


@dataclass
class ChaosReport:
    """What one scenario did and what the audit found. ``ok`` is the promise held."""

    scenario: str
    fault: str
    #: What ``recovery_s`` measures, in words.
    recovery: str
    jobs: int = 0
    #: Jobs that ended with exactly one result of the status the scenario defines (succeeded,
    #: or dead for a garbage entry that has a job id).
    exactly_once: int = 0
    #: Jobs with no result (withdrawn attached requests are counted apart).
    lost: int = 0
    #: Results written more than once (re-created or overwritten), or a job that still has an
    #: entry next to its result and so could run and answer again.
    duplicated: int = 0
    #: Entries still pending or claimed after the queue drained.
    leftovers: int = 0
    #: Results whose id nobody submitted.
    orphans: int = 0
    #: Jobs that ended with another status than the scenario defines.
    unexpected: int = 0
    #: Attached requests withdrawn by design (their producer's session ended).
    withdrawn: int = 0
    workers: int = 0
    #: Claims per job (the result's ``attempts``) -> number of jobs.
    attempts: dict[int, int] = field(default_factory=dict)
    recovery_s: float | None = None
    wall_s: float = 0.0
    #: Scenario-specific checks, by name.
    checks: dict[str, bool] = field(default_factory=dict)
    #: Scenario-specific figures (other timings, counts).
    details: dict[str, Any] = field(default_factory=dict)
    #: Worker log tails, kept only when something failed.
    logs: str = ""

    @property
    def ok(self) -> bool:
        return not self.failures()

    def failures(self) -> list[str]:
        """Each way the scenario broke the promise, in words (empty when it held)."""
        out = [f"check failed: {name}" for name, passed in self.checks.items() if not passed]
        for name in ("lost", "duplicated", "leftovers", "orphans", "unexpected"):
            if getattr(self, name):
                out.append(f"{name}={getattr(self, name)}")
        if self.exactly_once + self.withdrawn != self.jobs:
            out.append(f"exactly_once={self.exactly_once} of {self.jobs} jobs")
        if not self.jobs:
            out.append("no jobs were submitted")
        return out

    def summary(self) -> str:
        recovery = "n/a" if self.recovery_s is None else f"{self.recovery_s:.2f}s"
        return (
            f"{self.scenario}: {self.exactly_once}/{self.jobs} exactly once, lost {self.lost}, "
            f"duplicated {self.duplicated}, leftovers {self.leftovers}, orphans {self.orphans}, "
            f"recovery {recovery}, wall {self.wall_s:.1f}s, attempts {self.attempts}"
            + ("" if self.ok else f" -- FAILED: {'; '.join(self.failures())}")
        )

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if k != "logs"} | {"ok": self.ok}


# -- the audit -------------------------------------------------------------------------------


@dataclass
class Audit:
    """The queue's state against what was submitted. ``records`` maps a job id to its result
    record; ``ctimes`` to its server-side creation time (unix seconds; absent for results an
    attached producer read and removed)."""

    records: dict[str, dict[str, Any]]
    ctimes: dict[str, float]
    expected: dict[str, str]
    lost: list[str]
    orphans: list[str]
    unexpected: list[str]
    leftovers: list[str]
    duplicated: int
    withdrawn: int

    @property
    def exactly_once(self) -> int:
        return sum(
            1
            for i, status in self.expected.items()
            if self.records.get(i, {}).get("status") == status
        )

    def attempts(self) -> dict[int, int]:
        counts = Counter(
            int(self.records[i].get("attempts") or 0) for i in self.expected if i in self.records
        )
        return dict(sorted(counts.items()))

    def first_after(self, t: float, ids: Iterable[str] | None = None) -> float | None:
        """Seconds from ``t`` to the first result committed after it (among ``ids``)."""
        times = [c for i, c in self.ctimes.items() if c > t and (ids is None or i in set(ids))]
        return min(times) - t if times else None

    def last_of(self, ids: Iterable[str], t: float) -> float | None:
        """Seconds from ``t`` to the last result among ``ids`` (None if one is missing)."""
        times = [self.ctimes.get(i) for i in ids]
        if not times or None in times:
            return None
        return max(c for c in times if c is not None) - t

    def by_worker(self, worker: str) -> list[dict[str, Any]]:
        return [r for r in self.records.values() if r.get("worker") == worker]

    def fill(self, report: ChaosReport) -> ChaosReport:
        report.jobs = len(self.expected)
        report.exactly_once = self.exactly_once
        report.lost = len(self.lost)
        report.duplicated = self.duplicated
        report.leftovers = len(self.leftovers)
        report.orphans = len(self.orphans)
        report.unexpected = len(self.unexpected)
        report.withdrawn = self.withdrawn
        report.attempts = self.attempts()
        if self.lost or self.unexpected or self.leftovers or self.orphans:
            report.details["audit"] = {
                "lost": self.lost[:10],
                "unexpected": {i: self.records[i].get("status") for i in self.unexpected[:10]},
                "leftovers": self.leftovers[:10],
                "orphans": self.orphans[:10],
            }
        return report


def audit(
    zk: KazooClient,
    layout: Layout,
    expected: Mapping[str, str],
    received: Mapping[str, results.Result],
    withdrawn: set[str],
) -> Audit:
    """Read every result, entry and claim of the queue and compare with ``expected`` (job id ->
    the status it must end with). ``received`` are results attached producers read (and so
    removed); ``withdrawn`` attached requests that were withdrawn by design.

    Duplicates: results are keyed by id, so a second answer would have to re-create or overwrite
    a result. The results directory's ``cversion`` counts its children's creates and deletes,
    so ``(cversion + children) / 2`` is how many results were ever created; more than the
    number of distinct ids with a result means one was written twice. A result's own version
    above 0 means it was overwritten."""
    stored, ctimes, rewritten, creates = _read_results(zk, layout)
    records = {i: r.to_dict() for i, r in received.items()} | stored
    distinct = len(set(stored) | set(received))
    leftovers = _leftovers(zk, layout)
    still_pending = {name.split("-", 1)[0] for name in leftovers}
    lost = sorted(i for i in expected if i not in records and i not in withdrawn)
    return Audit(
        records=records,
        ctimes=ctimes,
        expected=dict(expected),
        lost=lost,
        orphans=sorted(i for i in records if i not in expected),
        unexpected=sorted(
            i for i, s in expected.items() if i in records and records[i].get("status") != s
        ),
        leftovers=leftovers,
        duplicated=rewritten + max(0, creates - distinct) + len(still_pending & set(records)),
        withdrawn=len(withdrawn & set(expected)),
    )


def _read_results(
    zk: KazooClient, layout: Layout
) -> tuple[dict[str, dict[str, Any]], dict[str, float], int, int]:
    names: list[str] = []
    creates = 0
    for bucket in RESULT_BUCKETS:
        try:
            found, stat = zk.get_children(layout.result_dir(QUEUE, bucket), include_data=True)
        except NoNodeError:
            continue
        names += found
        # cversion counts the bucket's child creates and deletes: creates = (cversion + kids) / 2
        creates += (stat.cversion + len(found)) // 2
    calls = [(n, zk.get_async(layout.result(QUEUE, n))) for n in names]
    records: dict[str, dict[str, Any]] = {}
    ctimes: dict[str, float] = {}
    rewritten = 0
    for name, call in calls:
        data, node = call.get()
        records[name] = json.loads(data)
        ctimes[name] = node.ctime / 1000
        rewritten += node.version > 0
    return records, ctimes, rewritten, creates


def _leftovers(zk: KazooClient, layout: Layout) -> list[str]:
    """Entry names still pending in any priority, and claims still held."""
    names = [e.leaf for _, e in counts.in_order(zk, layout, QUEUE)]
    for priority in defaults.PRIORITIES:  # entries outside any bucket (garbage)
        names += [n for n in zk.get_children(layout.pending(QUEUE, priority)) if "-" in n]
    claims = zk.get_children(layout.claims(QUEUE))
    return sorted(set(names) | set(claims))


def expect(ids: Iterable[str], status: str = results.SUCCEEDED) -> dict[str, str]:
    return {i: status for i in ids}
