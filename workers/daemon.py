"""The worker daemon: build the runner, connect, register, wire signals and systemd, run the loop.

First SIGTERM (or SIGINT): stop claiming and drain running jobs for up to the drain timeout.
A second one: release what is left at once and exit.
"""

from __future__ import annotations

import logging
import signal
import time
from dataclasses import dataclass
from types import FrameType
from typing import Any

from workers.admission import Admission
from workers.loop import Worker
from workers.runners.base import Runner
from workers.runners.echo import EchoRunner
from workers.systemd import Notifier
from zkqueue import defaults
from zkqueue.connection import ConnectionSettings, close, connect
from zkqueue.errors import ConfigurationError

log = logging.getLogger("zkq.daemon")


@dataclass
class WorkerOptions:
    """Everything ``zkq worker`` takes; the CLI maps its flags onto these fields."""

    queue: str = defaults.QUEUE
    runner: str = "echo"
    echo_delay: float = defaults.ECHO_DELAY
    max_concurrency: int = defaults.WORKER_SLOTS
    name: str | None = None
    max_jobs: int | None = None
    burst: bool = False
    drain_timeout: float = defaults.DRAIN_TIMEOUT
    heartbeat_interval: float = defaults.HEARTBEAT_INTERVAL
    max_attempts: int = defaults.MAX_ATTEMPTS
    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"


def build_runner(opts: WorkerOptions) -> tuple[Runner, Admission]:
    if opts.max_concurrency < 1:
        raise ConfigurationError("--max-concurrency must be at least 1")
    if opts.runner == "echo":
        return EchoRunner(delay=opts.echo_delay), Admission()
    raise ConfigurationError(f"unknown runner {opts.runner!r}")


def run_worker(settings: ConnectionSettings, root: str, opts: WorkerOptions) -> int:
    """Run until stopped; returns the process exit code."""
    runner, admission = build_runner(opts)  # a model that fails to load fails before we register
    notifier = Notifier()
    zk = connect(settings)
    try:
        worker = Worker(
            zk,
            runner,
            queue=opts.queue,
            root=root,
            slots=opts.max_concurrency,
            name=opts.name,
            max_jobs=opts.max_jobs,
            burst=opts.burst,
            drain_timeout=opts.drain_timeout,
            heartbeat_interval=_heartbeat(opts, notifier),
            max_attempts=opts.max_attempts,
            admission=admission,
            on_heartbeat=_watchdog(notifier),
        )
        _install_signals(worker, notifier)

        def ready() -> None:
            notifier.ready(f"worker {worker.id} on queue {opts.queue}")
            log.info(
                "worker %s ready on queue %s (%s, %d slot(s))",
                worker.id,
                opts.queue,
                runner.name,
                opts.max_concurrency,
            )

        worker.run(on_ready=ready)
        return 0
    finally:
        runner.close()
        close(zk)


def _heartbeat(opts: WorkerOptions, notifier: Notifier) -> float:
    interval = opts.heartbeat_interval
    if notifier.watchdog_interval is not None:
        interval = min(interval, notifier.watchdog_interval)
    return interval


def _watchdog(notifier: Notifier) -> Any:
    def beat(_worker: Worker) -> None:
        if notifier.watchdog_interval is not None:
            notifier.watchdog()

    return beat


def _install_signals(worker: Worker, notifier: Notifier) -> None:
    received: list[float] = []

    def handler(signum: int, _frame: FrameType | None) -> None:
        received.append(time.monotonic())
        if len(received) == 1:
            log.info("signal %d: draining (a second signal releases jobs at once)", signum)
            notifier.stopping()
            worker.stop(drain=True)
        else:
            log.info("signal %d again: releasing running jobs and exiting", signum)
            worker.stop(drain=False)

    signal.signal(signal.SIGTERM, handler)
    signal.signal(signal.SIGINT, handler)
