"""The dispatch gate of an inference server behind a worker: may the worker claim another job now?

A worker in front of a server (``workers.runners.upstream``) claims a job only while the server has
room, so the backlog waits in the queue, in priority order, not in the server's first-come queue.
Three things decide:

* **Slots**, always: the worker holds at most ``--max-concurrency`` jobs (the loop counts them).
* **The server's own figures**, where it publishes Prometheus metrics at ``/metrics``: the gate
  is open while its waiting queue holds at most ``max_waiting`` requests (default 0) and its
  KV-cache use is below ``max_kv_use`` (default 0.9). The figures are read four times a second,
  and each reading lets the worker claim ``allowance`` jobs (16, or half what the server runs
  if that is more) until the next one: the jobs in the server grow by half per reading at most,
  so one that fills up takes few jobs beyond its room into its own queue. A reading asked for
  before the worker's last claims does not renew the allowance (it does not count them yet). A
  reading that fails while the server answers otherwise shuts the gate until one succeeds.
  Known engines and the names read (counts summed over their label sets, so a server with
  several engines reads as one; the KV-cache use is the highest of them):

  - vLLM: waiting ``vllm:num_requests_waiting``, running ``vllm:num_requests_running``, KV use
    ``vllm:kv_cache_usage_perc`` (or its older name ``vllm:gpu_cache_usage_perc``);
  - SGLang: ``sglang:num_queue_reqs``, ``sglang:num_running_reqs``, ``sglang:token_usage``;
  - TGI: ``tgi_queue_size``, ``tgi_batch_current_size`` (it publishes no KV-cache use).

  A server without ``/metrics`` (``transformers serve``) is gated by slots alone.
* **Health**: a request that fails for the server's sake (connection refused or reset, a 5xx)
  marks the engine *down*; the gate stays shut until ``/health`` (or ``/v1/models`` where there
  is no ``/health``) answers 200 again. A reading of ``/metrics`` that cannot connect does the
  same, so a server that dies while idle is seen within a reading.

The gate's state is written by the runner's event-loop thread and read by the worker loop's
thread; ``on_change`` (set by the worker) is called when the gate may have opened.
"""

from __future__ import annotations

import contextlib
import enum
import math
import threading
import time
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

from prometheus_client.parser import text_string_to_metric_families

from zkqueue import defaults

#: Jobs a reading of the server's metrics lets the worker claim at least (see ``allowance``).
BURST = 16


@dataclass(frozen=True)
class MetricNames:
    """Where one engine publishes its figures (the first name present is read)."""

    waiting: tuple[str, ...]
    running: tuple[str, ...]
    kv_use: tuple[str, ...] = ()


#: The engines whose metrics the gate reads, by the name the registration shows.
ENGINES: dict[str, MetricNames] = {
    "vllm": MetricNames(
        ("vllm:num_requests_waiting",),
        ("vllm:num_requests_running",),
        ("vllm:kv_cache_usage_perc", "vllm:gpu_cache_usage_perc"),
    ),
    "sglang": MetricNames(
        ("sglang:num_queue_reqs",), ("sglang:num_running_reqs",), ("sglang:token_usage",)
    ),
    "tgi": MetricNames(("tgi_queue_size",), ("tgi_batch_current_size",)),
}


@dataclass(frozen=True)
class EngineFigures:
    """One reading of a server's metrics (None: not published)."""

    engine: str
    waiting: float | None = None
    running: float | None = None
    kv_use: float | None = None


def parse_metrics(text: str) -> EngineFigures | None:
    """The figures of the first known engine found in Prometheus exposition ``text``, or None
    when the text holds none of the known names."""
    totals: dict[str, float] = {}
    highest: dict[str, float] = {}
    for family in text_string_to_metric_families(text):
        for sample in family.samples:
            # The figures are gauges: one sample per label set, named as the family.
            if sample.name == family.name and math.isfinite(sample.value):
                totals[sample.name] = totals.get(sample.name, 0.0) + sample.value
                highest[sample.name] = max(highest.get(sample.name, 0.0), sample.value)
    for engine, names in ENGINES.items():
        waiting = _first(totals, names.waiting)
        running = _first(totals, names.running)
        if waiting is None and running is None:
            continue
        # Requests add up over engines (data-parallel ranks); a cache's use is a fraction of
        # each engine's own cache: the fullest one decides.
        return EngineFigures(engine, waiting, running, _first(highest, names.kv_use))
    return None


def _first(totals: dict[str, float], names: tuple[str, ...]) -> float | None:
    for name in names:
        if name in totals:
            return totals[name]
    return None


class GateState(enum.StrEnum):
    """What the registration shows as ``engine.gate``."""

    #: The worker may claim (slots permitting).
    OPEN = "open"
    #: The server is busy by its own figures (or the last turn's jobs are not counted yet).
    BUSY = "busy"
    #: The server is unreachable or failing: nothing is claimed until its health check passes.
    DOWN = "down"


class Gate:
    """The gate's state; the runner feeds it readings and faults, the worker loop asks it."""

    def __init__(
        self,
        max_waiting: int = defaults.UPSTREAM_MAX_WAITING,
        max_kv_use: float = defaults.UPSTREAM_MAX_KV_USE,
    ) -> None:
        self.max_waiting = max_waiting
        self.max_kv_use = max_kv_use
        #: Called (from the runner's thread) when the gate's state changed.
        self.on_change: Callable[[], None] | None = None
        self._lock = threading.Lock()
        #: Down until the first health check passes: a worker never claims blind.
        self._down: str | None = "not checked yet"
        self._down_since = time.time()
        self._figures: EngineFigures | None = None
        #: A reading failed after metrics were seen: busy until one succeeds.
        self._stale = False
        #: Jobs the worker may still claim before the next reading (None: no metrics, no bound).
        self._allowance: int | None = None
        #: When the worker last claimed (monotonic seconds): a reading asked for before that
        #: does not count those jobs yet, so it does not renew the allowance.
        self._claimed_at = float("-inf")
        self.downs = 0

    # -- what the worker loop asks --------------------------------------------------------------

    @property
    def state(self) -> GateState:
        with self._lock:
            return self._state()

    @property
    def up(self) -> bool:
        with self._lock:
            return self._down is None

    @property
    def server_busy(self) -> bool:
        """Whether the server itself says it is full (not just the claim allowance spent)."""
        with self._lock:
            return self._down is None and self._over()

    def room(self) -> int | None:
        """Jobs the worker may claim now: 0 unless the gate is open; None when no bound but
        the slots applies (a server without metrics)."""
        with self._lock:
            if self._state() != GateState.OPEN:
                return 0
            return self._allowance

    def claimed(self, jobs: int) -> None:
        """The worker claimed ``jobs``: they use up the allowance of the current reading."""
        if jobs > 0:
            with self._changing():
                self._claimed_at = time.monotonic()
                if self._allowance is not None:
                    self._allowance = max(0, self._allowance - jobs)

    def record(self) -> dict[str, Any]:
        """The registration's ``engine`` figures."""
        with self._lock:
            out: dict[str, Any] = {"gate": self._state().value}
            figures = self._figures
            if figures is not None:
                out["engine"] = figures.engine
                for name in ("waiting", "running", "kv_use"):
                    value = getattr(figures, name)
                    if value is not None:
                        out[name] = round(value, 3) if name == "kv_use" else int(value)
            if self._down is not None:
                out["down"] = self._down
                out["down_since"] = round(self._down_since, 3)
            return out

    # -- what the runner tells it ---------------------------------------------------------------

    def reading(self, figures: EngineFigures | None, asked_at: float | None = None) -> None:
        """A reading of the server's metrics (None: it publishes none), asked for at
        ``asked_at`` (monotonic seconds; None: now)."""
        asked = time.monotonic() if asked_at is None else asked_at
        with self._changing():
            self._figures = figures
            self._stale = False
            if figures is None:
                self._allowance = None
            elif asked >= self._claimed_at:
                self._allowance = allowance(figures)

    def stale(self) -> None:
        """A reading failed while the server answers otherwise: busy until one succeeds."""
        with self._changing():
            self._stale = self._figures is not None

    def down(self, reason: str) -> bool:
        """The server failed a request or a reading; returns whether it was up until now."""
        with self._changing():
            was_up = self._down is None
            if was_up:
                self._down = reason
                self._down_since = time.time()
                self.downs += 1
        return was_up

    def healthy(self) -> None:
        """The server's health check passed."""
        with self._changing():
            self._down = None

    def _over(self) -> bool:
        figures = self._figures
        if figures is None:
            return False
        if self._stale:
            return True
        if figures.waiting is not None and figures.waiting > self.max_waiting:
            return True
        return figures.kv_use is not None and figures.kv_use >= self.max_kv_use

    def _state(self) -> GateState:
        if self._down is not None:
            return GateState.DOWN
        if self._over() or self._allowance == 0:
            return GateState.BUSY
        return GateState.OPEN

    @contextlib.contextmanager
    def _changing(self) -> Iterator[None]:
        """Change the state under the lock; then, if the gate's state moved, wake the worker
        (outside the lock): an open gate lets it claim, a shut one makes it leave the line."""
        with self._lock:
            before = self._state()
            yield
            after = self._state()
        if after != before and self.on_change is not None:
            self.on_change()


def allowance(figures: EngineFigures) -> int:
    """Jobs one reading lets the worker claim: ``BURST``, or half what the server runs if that
    is more. Between two readings the jobs in the server can grow by half at most, so a server
    that fills up takes at most that many beyond its room into its own queue, and an empty
    one fills within a few readings."""
    running = int(figures.running or 0)
    return max(BURST, running // 2)
