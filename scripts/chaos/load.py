"""Load for the scenarios: a steady producer of detached jobs on its own session, attached
requests that wait for their results, and the helpers scenarios share (a fleet of workers,
draining, who kept their session through a fault)."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterable

from scripts.chaos.audit import Audit
from scripts.chaos.stage import Stage, WorkerProcess
from zkqueue.errors import JobWithdrawn, ZkqError
from zkqueue.producer.client import Client
from zkqueue.producer.job import Job
from zkqueue.protocol import result as results

# -- steady load -----------------------------------------------------------------------------


class Feeder:
    """A producer on its own thread and session: ``total`` detached jobs at ``rate`` per
    second. ``pause()`` holds it (e.g. while the ensemble has no quorum)."""

    def __init__(
        self,
        hosts: str,
        root: str,
        total: int,
        rate: float,
        session_timeout: float,
        priority: str = "normal",
    ) -> None:
        self.hosts, self.root = hosts, root
        self.priority = priority
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
            job = client.submit(f"chaos {self.priority} job {i}", self.priority, detach=True)
            self.ids.append(job.id)
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


# -- helpers shared by scenarios -------------------------------------------------------------


def spawn_fleet(
    st: Stage, prefix: str, count: int, *, delay: float, slots: int, extra: Iterable[str] = ()
) -> list[WorkerProcess]:
    fleet = [st.spawn(f"{prefix}{i}", delay=delay, slots=slots, extra=extra) for i in range(count)]
    st.wait_registered(w.name for w in fleet)
    return fleet


def feed(st: Stage, total: int, rate: float, priority: str = "normal") -> Feeder:
    feeder = Feeder(st.hosts, st.root, total, rate, st.session_timeout, priority).start()
    st.on_close(feeder.stop)
    return feeder


def drain(st: Stage, feeder: Feeder, extra_s: float) -> bool:
    """Wait (bounded) for the feeder to finish and every job it submitted to have a result."""
    budget = feeder.total / feeder.rate + extra_s
    feeder.wait(budget)
    return st.drained(feeder.ids, budget)


def registered_since(st: Stage, name: str, t: float) -> float | None:
    """The registration's creation time if ``name`` registered (a new node) after ``t``."""
    stat = st.zk.exists(st.layout.worker(name))
    if stat is None or stat.ctime / 1000 <= t:
        return None
    return float(stat.ctime) / 1000


def sessions_kept(st: Stage, fleet: list[WorkerProcess], t_fault: float) -> str:
    """How many workers still hold the registration they made before the fault (their
    session survived it), as "k of n"."""
    kept = [w for w in fleet if (registered_since(st, w.name, 0) or t_fault) < t_fault]
    return f"{len(kept)} of {len(fleet)}"


def served_after(a: Audit, worker: str, t: float) -> int:
    return sum(
        1 for i, r in a.records.items() if r.get("worker") == worker and a.ctimes.get(i, 0) > t
    )
