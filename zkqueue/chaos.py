"""Fault injection: scenarios that break real ZooKeeper servers and real worker processes while
jobs flow, then audit the queue. The promise under test: every job ends with exactly one result
record (or is withdrawn by design), whatever crashes, hangs, failovers or garbage came first.

Each scenario starts what it needs (ZooKeeper from Debian's package unless it is given one,
``zkq worker`` subprocesses, producers), injects one kind of fault, waits (bounded) for the queue
to drain, and returns a ChaosReport. Everything listens on loopback and everything it started is
torn down in ``finally``. tests/test_chaos.py runs small sizes; scripts/chaos.py runs larger ones
and writes RELIABILITY.md.

Times: faults are stamped with ``time.time()`` and results with their znode's ``ctime``, the
server's clock, which on loopback is this host's clock. So "the first result after the restart"
is the first completion the server committed after it, not when a worker began to write it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from collections import Counter
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionLoss, NoNodeError, OperationTimeoutError, SessionExpiredError

from workers.loop import Worker
from workers.runners.base import Outcome, RunningJob
from workers.runners.echo import EchoRunner
from zkqueue import defaults
from zkqueue import result as results
from zkqueue.client import Client
from zkqueue.connection import ConnectionSettings, close, connect
from zkqueue.errors import JobWithdrawn, ZkqError
from zkqueue.janitor import JanitorService
from zkqueue.job import Job
from zkqueue.layout import Layout, child
from zkqueue.testing import ZkCluster, ZkServer

QUEUE = defaults.QUEUE
_REPO = Path(__file__).resolve().parents[1]
_ZK_TROUBLE = (ConnectionLoss, SessionExpiredError, OperationTimeoutError, ZkqError)
#: Seconds between polls of a bounded wait.
_POLL = 0.05
#: Longest a hung runner stays stuck if nobody releases it (keeps every thread bounded).
_HANG_LIMIT = 300.0

T = TypeVar("T")


class ChaosError(RuntimeError):
    """A scenario could not set up its fault (a worker never registered, no leader...)."""


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


# -- bounded waits ---------------------------------------------------------------------------


def poll(condition: Callable[[], T | None], timeout: float, interval: float = _POLL) -> T | None:
    """Call ``condition`` until it returns something truthy (returned) or ``timeout`` passes
    (None). ZooKeeper being away while we poll counts as "not yet"."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = condition()
        except _ZK_TROUBLE:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            return None
        time.sleep(interval)


def need(condition: Callable[[], T | None], timeout: float, what: str) -> T:
    """Like poll, but a timeout is a setup failure of the scenario."""
    value = poll(condition, timeout)
    if not value:
        raise ChaosError(f"timed out after {timeout:g}s waiting for {what}")
    return value


def hold(seconds: float, check: Callable[[], bool], what: str) -> None:
    """Keep a fault in place for ``seconds`` (its defined duration), checking meanwhile that
    ``check`` stays true (for example: every worker process is still alive)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if not check():
            raise ChaosError(f"during the fault: {what}")
        time.sleep(min(left, 0.2))


# -- worker processes ------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO), env.get("PYTHONPATH")]))
    return env


class WorkerProcess:
    """A ``zkq worker --runner echo`` subprocess with its own log file."""

    def __init__(
        self,
        name: str,
        hosts: str,
        root: str,
        log_dir: Path,
        *,
        delay: float,
        slots: int,
        session_timeout: float,
        extra: Iterable[str] = (),
    ) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        cmd = [
            *("--zk", hosts, "--root", root, "--session-timeout", f"{session_timeout:g}"),
            *("--log-level", "INFO", "worker", "--runner", "echo"),
            *("--echo-delay", f"{delay:g}", "--max-concurrency", str(slots), "--name", name),
            *extra,
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "zkqueue.cli", *cmd],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_env(),
                cwd=_REPO,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, sig: int) -> None:
        if self.alive:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """kill -9: no drain, no goodbye; its session lingers until ZooKeeper expires it."""
        self.send(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def terminate(self, timeout: float = 30.0) -> None:
        """SIGTERM (drain), then SIGKILL if it has not exited within ``timeout``."""
        self.send(signal.SIGCONT)
        self.send(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def log_has(self, text: str) -> bool:
        try:
            return text in self.log_path.read_text(errors="replace")
        except OSError:
            return False


# -- a scenario's world ----------------------------------------------------------------------


class Stage:
    """One scenario's world: ZooKeeper (its own, or a shared one at ``hosts``), a fresh root, an
    audit client, and the worker processes it started. Closing it tears all of them down."""

    def __init__(
        self,
        name: str,
        *,
        hosts: str | None = None,
        servers: int = 1,
        session_timeout: float = 3.0,
    ) -> None:
        self.name = name
        self.session_timeout = session_timeout
        self.dir = Path(tempfile.mkdtemp(prefix=f"zkq-chaos-{name}-"))
        self.cluster: ZkCluster | None = None
        self._hosts = hosts
        self._servers = servers
        self.root = f"/chaos-{name}-{uuid.uuid4().hex[:8]}"
        self.layout = Layout(self.root)
        self.workers: list[WorkerProcess] = []
        self._client: Client | None = None
        self._cleanups: list[Callable[[], None]] = []

    @property
    def hosts(self) -> str:
        if self.cluster is not None:
            return self.cluster.hosts
        assert self._hosts is not None
        return self._hosts

    @property
    def client(self) -> Client:
        assert self._client is not None, "use the stage as a context manager"
        return self._client

    @property
    def zk(self) -> KazooClient:
        return self.client.zk

    def __enter__(self) -> Stage:
        try:
            if self._hosts is None:
                self.cluster = ZkCluster(self._servers, base=self.dir / "zk").start()
            self._client = Client(
                self.hosts, self.root, session_timeout=self.session_timeout
            ).start()
            self.client.ensure_queue(QUEUE)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def on_close(self, cleanup: Callable[[], None]) -> None:
        """Run ``cleanup`` at teardown (before the workers and servers go), last added first."""
        self._cleanups.append(cleanup)

    def close(self) -> None:
        for cleanup in reversed(self._cleanups):
            with contextlib.suppress(Exception):
                cleanup()
        for w in self.workers:
            w.kill()
        if self._client is not None:
            self._client.close()
        if self.cluster is not None:
            self.cluster.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- workers ---------------------------------------------------------------------------

    def spawn(
        self, name: str, *, delay: float, slots: int = 1, extra: Iterable[str] = ()
    ) -> WorkerProcess:
        worker = WorkerProcess(
            name,
            self.hosts,
            self.root,
            self.dir,
            delay=delay,
            slots=slots,
            session_timeout=self.session_timeout,
            extra=extra,
        )
        self.workers.append(worker)
        return worker

    def registered(self) -> set[str]:
        try:
            return set(self.zk.get_children(self.layout.workers()))
        except NoNodeError:
            return set()

    def wait_registered(self, names: Iterable[str], timeout: float = 30.0) -> None:
        wanted = set(names)
        need(lambda: wanted <= self.registered(), timeout, f"workers {sorted(wanted)} registered")

    def all_alive(self, workers: Iterable[WorkerProcess]) -> bool:
        return all(w.alive for w in workers)

    def logs(self) -> str:
        return "\n".join(f"--- {w.name} ---\n{w.log_tail()}" for w in self.workers)

    # -- reading the queue -----------------------------------------------------------------

    def result_ids(self) -> set[str]:
        return set(self.zk.get_children(self.layout.results(QUEUE)))

    def claims_by_worker(self) -> dict[str, set[str]]:
        """Job ids currently claimed, per worker name (from the claim nodes' data)."""
        path = self.layout.claims(QUEUE)
        calls = [(n, self.zk.get_async(child(path, n))) for n in self.zk.get_children(path)]
        out: dict[str, set[str]] = {}
        for name, call in calls:
            with contextlib.suppress(NoNodeError):
                worker = json.loads(call.get()[0]).get("worker")
                out.setdefault(str(worker), set()).add(name.split("-", 1)[0])
        return out

    def drained(self, ids: Iterable[str], timeout: float) -> bool:
        """Bounded wait until every job in ``ids`` has a result."""
        wanted = set(ids)
        return bool(poll(lambda: wanted <= self.result_ids(), timeout, 0.1))

    def audit(
        self,
        expected: Mapping[str, str],
        received: Mapping[str, results.Result] | None = None,
        withdrawn: Iterable[str] = (),
    ) -> Audit:
        return audit(self.zk, self.layout, expected, received or {}, set(withdrawn))

    def finish(self, report: ChaosReport, started: float) -> ChaosReport:
        report.wall_s = time.monotonic() - started
        if not report.ok:
            report.logs = self.logs()
        return report


# -- steady load -----------------------------------------------------------------------------


class Feeder:
    """A producer on its own thread and session: ``total`` detached jobs at ``rate`` per
    second. ``pause()`` holds it (e.g. while the ensemble has no quorum)."""

    def __init__(
        self, hosts: str, root: str, total: int, rate: float, session_timeout: float
    ) -> None:
        self.hosts, self.root = hosts, root
        self.total, self.rate = total, rate
        self.session_timeout = session_timeout
        self.ids: list[str] = []
        self.errors: list[str] = []
        self._stop = threading.Event()
        self._running = threading.Event()
        self._running.set()
        self._thread = threading.Thread(target=self._run, name="chaos-feeder", daemon=True)

    def start(self) -> Feeder:
        self._thread.start()
        return self

    def pause(self) -> None:
        self._running.clear()

    def resume(self) -> None:
        self._running.set()

    @property
    def done(self) -> bool:
        return not self._thread.is_alive()

    def stop(self, timeout: float = 30.0) -> None:
        self._stop.set()
        self._running.set()
        self._thread.join(timeout)

    def wait(self, timeout: float) -> bool:
        self._thread.join(timeout)
        return self.done

    def _run(self) -> None:
        try:
            self._feed()
        except Exception as exc:  # reported: the scenario's audit then misses these jobs
            self.errors.append(f"feeder stopped: {type(exc).__name__}: {exc}")

    def _feed(self) -> None:
        with Client(self.hosts, self.root, session_timeout=self.session_timeout) as client:
            start = time.monotonic()
            for i in range(self.total):
                while not self._running.wait(0.1):
                    if self._stop.is_set():
                        return
                if self._stop.is_set():
                    return
                self._submit(client, i)
                self._stop.wait(max(0.0, start + (i + 1) / self.rate - time.monotonic()))

    def _submit(self, client: Client, i: int) -> None:
        try:
            self.ids.append(client.submit(f"chaos job {i}", detach=True).id)
        except ZkqError as exc:
            # Nothing of ours to audit: the error says the job may not exist (see RELIABILITY.md)
            self.errors.append(f"job {i}: {exc}")


class Waiter:
    """An attached request on its own thread: submit, then wait for the result."""

    def __init__(self, client: Client, prompt: str, timeout: float) -> None:
        self.client = client
        self.prompt = prompt
        self.timeout = timeout
        self.job: Job | None = None
        self.record: results.Result | None = None
        self.withdrawn = False
        self.error: str | None = None
        self._thread = threading.Thread(target=self._run, name="chaos-waiter", daemon=True)

    def start(self) -> Waiter:
        self._thread.start()
        return self

    def join(self, timeout: float) -> None:
        self._thread.join(timeout)

    def _run(self) -> None:
        try:
            self.job = self.client.submit(self.prompt)
            self.record = self.job.result(timeout=self.timeout)
        except JobWithdrawn:
            self.withdrawn = True
        except ZkqError as exc:
            self.error = f"{type(exc).__name__}: {exc}"


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
    path = layout.results(QUEUE)
    names, stat = zk.get_children(path, include_data=True)
    calls = [(n, zk.get_async(layout.result(QUEUE, n))) for n in names]
    records: dict[str, dict[str, Any]] = {}
    ctimes: dict[str, float] = {}
    rewritten = 0
    for name, call in calls:
        data, node = call.get()
        records[name] = json.loads(data)
        ctimes[name] = node.ctime / 1000
        rewritten += node.version > 0
    creates = (stat.cversion + len(names)) // 2
    return records, ctimes, rewritten, creates


def _leftovers(zk: KazooClient, layout: Layout) -> list[str]:
    """Entry names still pending in any priority, and claims still held."""
    names: list[str] = []
    for priority in defaults.PRIORITIES:
        names += zk.get_children(layout.pending(QUEUE, priority))
    claims = zk.get_children(layout.claims(QUEUE))
    return sorted(set(names) | set(claims))


def _expect(ids: Iterable[str], status: str = results.SUCCEEDED) -> dict[str, str]:
    return {i: status for i in ids}


# -- in-process pieces (the hung worker, the janitor) ----------------------------------------


class HungRunner:
    """A runner wedged like a stuck CUDA kernel: it reports no progress and ignores
    cancellation until ``release`` is set, then echoes its jobs (too late: their claims are
    gone)."""

    name = "hung"

    def __init__(self) -> None:
        self.release = threading.Event()
        self.started = threading.Event()
        self.seen: list[str] = []

    def describe(self) -> dict[str, Any]:
        return {"runner": "hung"}

    def run(self, jobs: list[RunningJob]) -> list[Outcome]:
        self.seen.extend(j.id for j in jobs)
        self.started.set()
        self.release.wait(_HANG_LIMIT)
        return [Outcome(results.SUCCEEDED, output=j.spec.prompt) for j in jobs]

    def close(self) -> None:
        self.release.set()


class InProcessWorker:
    """A Worker loop on a thread with its own session, for runners a subprocess cannot take."""

    def __init__(
        self, stage: Stage, runner: HungRunner | EchoRunner, name: str, **kwargs: Any
    ) -> None:
        settings = ConnectionSettings(hosts=stage.hosts, session_timeout=stage.session_timeout)
        self.zk = connect(settings)
        self.worker = Worker(
            self.zk, runner, root=stage.root, name=name, heartbeat_interval=0.5, **kwargs
        )
        self.error: BaseException | None = None
        self._thread = threading.Thread(target=self._run, name=f"chaos-{name}", daemon=True)

    def _run(self) -> None:
        try:
            self.worker.run()
        except BaseException as exc:  # reported by the scenario's checks
            self.error = exc

    def start(self) -> InProcessWorker:
        self._thread.start()
        need(lambda: self.worker.ready.is_set() or self.error, 15, f"{self.worker.id} ready")
        return self

    def stop(self) -> None:
        if self._thread.is_alive():
            self.worker.stop(drain=False)
            self._thread.join(15)
        close(self.zk)


def start_janitor(stage: Stage, interval: float) -> JanitorService:
    """The elected janitor in this process (own session), stopped with the stage."""
    zk = connect(ConnectionSettings(hosts=stage.hosts, session_timeout=stage.session_timeout))
    service = JanitorService(zk, stage.layout, "chaos-janitor", interval=interval).start()

    def stop() -> None:
        service.stop()
        close(zk)

    stage.on_close(stop)
    return service


# -- helpers shared by scenarios -------------------------------------------------------------


def _spawn_fleet(
    st: Stage, prefix: str, count: int, *, delay: float, slots: int, extra: Iterable[str] = ()
) -> list[WorkerProcess]:
    fleet = [st.spawn(f"{prefix}{i}", delay=delay, slots=slots, extra=extra) for i in range(count)]
    st.wait_registered(w.name for w in fleet)
    return fleet


def _feed(st: Stage, total: int, rate: float) -> Feeder:
    feeder = Feeder(st.hosts, st.root, total, rate, st.session_timeout).start()
    st.on_close(feeder.stop)
    return feeder


def _drain(st: Stage, feeder: Feeder, extra_s: float) -> bool:
    """Wait (bounded) for the feeder to finish and every job it submitted to have a result."""
    budget = feeder.total / feeder.rate + extra_s
    feeder.wait(budget)
    return st.drained(feeder.ids, budget)


def _registered_since(st: Stage, name: str, t: float) -> float | None:
    """The registration's creation time if ``name`` registered (a new node) after ``t``."""
    stat = st.zk.exists(st.layout.worker(name))
    if stat is None or stat.ctime / 1000 <= t:
        return None
    return float(stat.ctime) / 1000


def _sessions_kept(st: Stage, fleet: list[WorkerProcess], t_fault: float) -> str:
    """How many workers still hold the registration they made before the fault (their
    session survived it), as "k of n"."""
    kept = [w for w in fleet if (_registered_since(st, w.name, 0) or t_fault) < t_fault]
    return f"{len(kept)} of {len(fleet)}"


def _served_after(a: Audit, worker: str, t: float) -> int:
    return sum(
        1 for i, r in a.records.items() if r.get("worker") == worker and a.ctimes.get(i, 0) > t
    )


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
        fleet = _spawn_fleet(st, "w", workers, delay=delay, slots=slots)
        feeder = _feed(st, jobs, workers * slots / delay * 0.6)
        victims, doomed = _pick_victims(st, fleet, kills)
        t_kill = time.time()
        for victim in victims:
            victim.kill()
        spares = [st.spawn(f"r{i}", delay=delay, slots=slots) for i in range(kills)]
        _drain(st, feeder, session_timeout * 4 + 30)
        a = st.audit(_expect(feeder.ids))
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
        fleet = _spawn_fleet(st, "w", workers, delay=delay, slots=slots)
        victim, others = fleet[0], fleet[1:]
        feeder = _feed(st, jobs, max(1, workers - 1) * slots / delay * 0.6)
        held = need(lambda: st.claims_by_worker().get(victim.name), 30, "the victim running a job")
        t_stop = time.time()
        victim.send(signal.SIGSTOP)
        expired = poll(lambda: victim.name not in st.registered(), pause)
        hold(t_stop + pause - time.time(), lambda: st.all_alive(others), "a worker exited")
        t_cont = time.time()
        victim.send(signal.SIGCONT)
        back = poll(lambda: _registered_since(st, victim.name, t_cont), session_timeout * 3 + 10)
        _drain(st, feeder, session_timeout * 4 + 30)
        follow = _only_victim_left(st, victim, others, workers)
        a = st.audit(_expect([*feeder.ids, *follow]))
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
        fleet = _spawn_fleet(st, "w", workers, delay=delay, slots=slots)
        pids = [w.pid for w in fleet]
        before = [st.client.submit(f"before {i}", detach=True).id for i in range(jobs // 2)]
        waiters = [Waiter(st.client, f"attached {i}", outage + 60).start() for i in range(attached)]
        need(lambda: all(w.job for w in waiters) and st.claims_by_worker(), 30, "jobs running")
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
    return st.audit(_expect(ids), received, withdrawn)


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
    report.details["sessions_kept"] = _sessions_kept(st, fleet, t_stop)
    report.details["waiter_errors"] = [w.error for w in waiters if w.error]
    report.checks["worker processes alive, never restarted"] = (
        st.all_alive(fleet) and [w.pid for w in fleet] == pids
    )
    report.checks["every worker completed jobs after the restart"] = all(
        _served_after(a, w.name, t_restart) for w in fleet
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
        fleet = _spawn_fleet(st, "w", workers, delay=delay, slots=slots)
        pids = [w.pid for w in fleet]
        feeder = _feed(st, jobs, workers * slots / delay * 0.5)
        need(lambda: len(st.result_ids()) >= 3, 30, "results flowing")
        t_leader, killed = _kill_leader_then_follower(st, fleet, feeder, quorum_outage)
        t_restart = time.time()
        for server in killed:
            server.start()
        for server in killed:
            server.wait_serving(60)
        feeder.resume()
        _drain(st, feeder, session_timeout * 4 + 30)
        a = st.audit(_expect(feeder.ids))
        a.fill(report)
        report.workers = workers
        report.recovery_s = a.first_after(t_restart)
        report.details.update(
            failover_s=a.first_after(t_leader),
            drain_s=a.last_of(feeder.ids, t_restart),
            submit_errors=feeder.errors,
            leader_after=next((s.myid for s in st.cluster.servers if s.mode() == "leader"), None),
            sessions_kept=_sessions_kept(st, fleet, t_leader),
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
        _spawn_fleet(st, "w", workers, delay=delay, slots=1, extra=["--no-janitor"])
        rest = [st.client.submit(f"job {i}", detach=True).id for i in range(jobs - 1)]
        st.drained([first.id, *rest], lease * 4 + jobs * delay + 30)
        runner.release.set()
        poll(lambda: hung.worker.busy == 0, 15)
        a = st.audit(_expect([first.id, *rest]))
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


# -- (f) garbage entries ---------------------------------------------------------------------

#: Entries any client could write, each under a valid name ``<kind><n>-<seq>``: each must be
#: dead-lettered with the reason and end with a ``dead`` result for its id.
BAD_DATA: tuple[tuple[str, bytes], ...] = (
    ("badjson", b"{not json"),
    ("notutf8", b"\xff\xfe\x00garbage"),
    ("empty", b""),
    ("nullspec", b"null"),
    ("notobject", b"[1, 2, 3]"),
    ("wrongtype", b'{"prompt": ["a list"]}'),
    ("noprompt", b'{"max_new_tokens": 4}'),
    ("blank", b'{"prompt": "   "}'),
    ("textnumber", b'{"prompt": "x", "max_new_tokens": "ten"}'),
    ("boolnumber", b'{"prompt": "x", "max_new_tokens": true}'),
    ("hugenumber", b'{"prompt": "x", "max_new_tokens": 1e400}'),
    ("nan", b'{"prompt": "x", "temperature": NaN}'),
    ("unknown", b'{"prompt": "x", "gpu": "please"}'),
    ("version", b'{"v": 2, "prompt": "x"}'),
    ("deep", b"[" * 50_000),
    ("oversize", b'{"prompt": "' + b"x" * 70_000 + b'"}'),
)
#: Entry names that are not ``<id>-<sequence>`` (prefix, sequential): dead-lettered with the
#: reason; no result, since there is no id to key it by.
BAD_NAMES: tuple[tuple[str, bool], ...] = (
    ("no_sequence_here{n}", False),
    ("bad-name{n}-", True),
    ("\u00fcn\u00efcode{n}-", True),
    ("-", True),
    ("x" * 70 + "{n}-", True),
)


def garbage_entries(
    jobs: int = 20,
    workers: int = 2,
    *,
    delay: float = 0.05,
    slots: int = 2,
    session_timeout: float = 3.0,
    hosts: str | None = None,
) -> ChaosReport:
    """Malformed entries (bad JSON, not UTF-8, wrong types, oversize, bad names) interleaved
    with good jobs at every priority while workers run, then an entry that reuses the id of a
    finished job. The workers must live, letter each bad entry once with its reason, and run
    every good job; the reused id must not get a second result."""
    started = time.monotonic()
    report = ChaosReport(
        "garbage",
        f"{len(BAD_DATA)} kinds of malformed spec, {len(BAD_NAMES)} kinds of bad name, an "
        "entry with a child node and a reused job id, interleaved with good jobs",
        recovery="n/a: nothing stops; each entry is handled as it comes",
    )
    with Stage("garbage", hosts=hosts, session_timeout=session_timeout) as st:
        fleet = _spawn_fleet(st, "w", workers, delay=delay, slots=slots)
        expected, letters = _interleave(st, jobs)
        good = [i for i, s in expected.items() if s == results.SUCCEEDED]
        st.drained(good, jobs * delay + 30)
        reused = _reuse_id(st, good[0])
        letters.append(reused)
        poll(lambda: set(letters) <= _dead_names(st), 30)
        a = st.audit(expected)
        a.fill(report)
        report.workers = workers
        report.details.update(good_jobs=len(good), garbage_entries=len(letters))
        _garbage_checks(report, a, st, fleet, letters, good[0])
        return st.finish(report, started)


def _interleave(st: Stage, jobs: int) -> tuple[dict[str, str], list[str]]:
    """Write good jobs and garbage alternately, at rotating priorities; returns the expected
    status per job id and the names of the garbage entries."""
    expected: dict[str, str] = {}
    letters: list[str] = []
    kinds = len(BAD_DATA) + len(BAD_NAMES)
    for n in range(max(jobs, kinds)):
        priority = defaults.PRIORITIES[n % 3]
        if n < jobs:
            expected[st.client.submit(f"good {n}", priority=priority, detach=True).id] = "succeeded"
        name, job_id = _write_garbage(st, n % kinds, n, priority)
        letters.append(name)
        if job_id is not None:
            expected[job_id] = results.DEAD
    name = _write_nested(st, jobs)
    letters.append(name)
    expected[name.split("-", 1)[0]] = results.DEAD
    return expected, letters


def _write_garbage(st: Stage, kind: int, n: int, priority: str) -> tuple[str, str | None]:
    """Create one bad entry; returns its node name and its job id (None for a bad name)."""
    if kind < len(BAD_DATA):
        label, data = BAD_DATA[kind]
        path = st.zk.create(
            st.layout.entry_prefix(QUEUE, priority, f"{label}{n}"), data, sequence=True
        )
        return path.rsplit("/", 1)[1], f"{label}{n}"
    pattern, sequential = BAD_NAMES[kind - len(BAD_DATA)]
    path = st.layout.entry(QUEUE, priority, pattern.format(n=n))
    path = st.zk.create(path, b'{"prompt": "x"}', sequence=sequential)
    return path.rsplit("/", 1)[1], None


def _write_nested(st: Stage, n: int) -> str:
    """A valid spec with a node hung under it (created in one multi, so no worker can take
    the entry before its child exists). Its completion could never delete it."""
    name = f"haschild{n}-{9_000_000_000 + n:010d}"
    path = st.layout.entry(QUEUE, "low", name)
    txn = st.zk.transaction()
    txn.create(path, b'{"prompt": "x"}')
    txn.create(child(path, "kid"), b"")
    txn.commit()
    return name


def _reuse_id(st: Stage, job_id: str) -> str:
    """A hand-made entry reusing the id of a job that already has its result."""
    prefix = st.layout.entry_prefix(QUEUE, "normal", job_id)
    path = st.zk.create(prefix, b'{"prompt": "second answer?"}', sequence=True)
    return path.rsplit("/", 1)[1]


def _dead_names(st: Stage) -> set[str]:
    return set(st.zk.get_children(st.layout.dead(QUEUE)))


def _garbage_checks(
    report: ChaosReport,
    a: Audit,
    st: Stage,
    fleet: list[WorkerProcess],
    letters: list[str],
    reused: str,
) -> None:
    path = st.layout.dead(QUEUE)
    names, stat = st.zk.get_children(path, include_data=True)
    bodies = [json.loads(st.zk.get(st.layout.dead_node(QUEUE, n))[0]) for n in names]
    report.details["dead_letters"] = len(names)
    report.checks["every worker alive, no traceback in its log"] = st.all_alive(fleet) and not any(
        w.log_has("Traceback") for w in fleet
    )
    report.checks["each bad entry dead-lettered exactly once"] = sorted(names) == sorted(
        letters
    ) and stat.cversion == len(names)
    report.checks["each letter says why"] = all(b.get("reason") for b in bodies)
    report.checks["the reused id kept its first result"] = (
        a.records.get(reused, {}).get("output") == "good 0"
    )


#: Every scenario by its short name, in the order scripts/chaos.py runs them.
SCENARIOS: dict[str, Callable[..., ChaosReport]] = {
    "kill-9": kill_workers,
    "sigstop": stop_worker,
    "zk-restart": zookeeper_restart,
    "ensemble": ensemble_failover,
    "hung": hung_worker,
    "garbage": garbage_entries,
}
