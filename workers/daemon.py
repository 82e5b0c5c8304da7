"""The worker daemon: build the runner, connect, register, wire signals and systemd, run the loop.

First SIGTERM (or SIGINT): stop claiming and drain running jobs for up to the drain timeout.
A second one: release what is left at once and exit.
"""

from __future__ import annotations

import gc
import logging
import signal
import threading
import time
from dataclasses import asdict, replace
from types import FrameType
from typing import TYPE_CHECKING, Any

from workers.admission import Admission
from workers.loop import Worker
from workers.metrics import WorkerMetrics
from workers.options import WorkerOptions, default_worker_id, slots_for
from workers.runners.base import Runner
from workers.runners.echo import EchoRunner
from workers.systemd import Notifier
from zkqueue.errors import ConfigurationError
from zkqueue.operations.expiry import ExpiryLimits
from zkqueue.operations.janitor import Janitor, JanitorService
from zkqueue.plumbing.connection import ConnectionSettings, close, connect, mapped_errors
from zkqueue.protocol.layout import Layout

if TYPE_CHECKING:
    from kazoo.client import KazooClient

log = logging.getLogger("zkq.daemon")


def build_runner(opts: WorkerOptions) -> tuple[Runner, Admission]:
    """The runner and its admission rule. A model is loaded here (and its cache sized), so a
    model that fails to load is an error before the worker registers."""
    if opts.max_concurrency is not None and opts.max_concurrency < 1:
        raise ConfigurationError("--max-concurrency must be at least 1")
    if opts.upstream is not None or opts.runner == "openai":
        return _upstream_runner(opts), Admission()
    if opts.model is None and opts.runner == "echo":
        return EchoRunner(delay=opts.echo_delay), Admission()
    if opts.model is None:
        raise ConfigurationError("the hf runner needs --model DIR")
    from workers.model import build_model_runner  # imports torch: only for model workers

    return build_model_runner(opts)


def _upstream_runner(opts: WorkerOptions) -> Runner:
    """The openai runner, after asking its server what it serves (``UpstreamRunner.probe``)."""
    from workers.calibration import Slots
    from workers.runners.upstream import UpstreamRunner, UpstreamSettings

    if opts.upstream is None:
        raise ConfigurationError("the openai runner needs --upstream URL")
    if opts.model is not None:
        raise ConfigurationError("--model is for the hf runner; the openai runner takes --upstream")
    settings = UpstreamSettings(
        opts.upstream,
        model=opts.upstream_model,
        api_key=opts.upstream_api_key,
        send_priority=opts.upstream_priority,
        max_waiting=opts.upstream_max_waiting,
        max_kv_use=opts.upstream_max_kv_use,
        timeout=opts.upstream_timeout,
    )
    count = opts.max_concurrency
    slots = None if count is None else Slots(count, "flag", detail="--max-concurrency")
    runner = UpstreamRunner(settings, slots=slots, default_max_runtime=opts.max_runtime)
    runner.probe()
    return runner


def run_worker(settings: ConnectionSettings, opts: WorkerOptions) -> int:
    """Run until stopped; returns the process exit code."""
    runner, admission = build_runner(opts)  # a bad model fails before registering
    opts = replace(opts, max_concurrency=slots_for(opts, admission.pages_total, runner))
    try:
        zk = connect(settings)
        try:
            with mapped_errors(settings.hosts):
                _serve(zk, opts, runner, admission, settings)
            return 0
        finally:
            close(zk)
    finally:
        runner.close()


def _serve(
    zk: KazooClient,
    opts: WorkerOptions,
    runner: Runner,
    admission: Admission,
    settings: ConnectionSettings,
) -> None:
    notifier = Notifier()
    metrics = WorkerMetrics()
    server = metrics.serve(opts.metrics_port, opts.metrics_addr) if opts.metrics_port else None
    loop_opts = replace(opts, heartbeat_interval=_heartbeat(opts, notifier))
    worker = Worker(
        zk,
        runner,
        loop_opts,
        admission=admission,
        metrics=metrics,
        on_heartbeat=_watchdog(notifier),
    )
    _install_signals(worker, notifier)

    def ready() -> None:
        notifier.ready(f"worker {worker.id} on queue {opts.queue}")
        narrowed = worker.high_width
        log.info(
            "registered worker %s on queue %s: runner %s, %d slot(s)%s, cache %s",
            worker.id,
            opts.queue,
            runner.name,
            opts.max_concurrency,
            "" if narrowed is None else f" ({narrowed} while a high-priority job runs)",
            _cache_text(admission),
        )

    janitor = _start_janitor(settings, opts.root, worker.id, opts, metrics)
    # What start-up made (a model, its tokenizer, torch and transformers: hundreds of thousands
    # of objects) lives as long as the process: kept out of the collector's full passes, each
    # of which would stop every thread while it walks them all (50-150 ms on the tiny model's
    # worker). The HF runner unfreezes them if its engine dies, so that the dead one is freed.
    gc.collect()
    gc.freeze()
    try:
        worker.run(on_ready=ready)
    finally:
        if janitor is not None:
            janitor.stop()
        if server is not None:
            server.shutdown()


def _start_janitor(
    settings: ConnectionSettings,
    root: str,
    member_id: str,
    opts: WorkerOptions,
    metrics: WorkerMetrics,
) -> JanitorService | None:
    """The janitor on a session and thread of its own: it cannot slow this worker's dispatch.
    While elected it sets the stored-results gauges after each pass."""
    if not opts.janitor:
        return None
    return JanitorService(
        None,
        Layout(root),
        member_id,
        interval=opts.janitor_interval,
        result_ttl=opts.result_ttl,
        settings=settings,
        limits=ExpiryLimits(max_results=opts.max_results, max_bytes=opts.max_result_bytes),
        on_pass=metrics.janitor_pass,
        on_resign=metrics.janitor_resigned,
    ).start()


def janitor_pass(
    settings: ConnectionSettings, root: str, *, result_ttl: float, limits: ExpiryLimits
) -> dict[str, Any]:
    """``zkq janitor --once``: one pass now; what it did, as plain data."""
    zk = connect(settings)
    try:
        with mapped_errors(settings.hosts):
            report = Janitor(zk, Layout(root), result_ttl=result_ttl, limits=limits).run_pass()
        return asdict(report)
    finally:
        close(zk)


def run_janitor(
    settings: ConnectionSettings,
    root: str,
    *,
    interval: float,
    result_ttl: float,
    limits: ExpiryLimits,
) -> int:
    """``zkq janitor``: the elected janitor until SIGTERM/SIGINT."""
    zk = connect(settings)
    try:
        service = JanitorService(
            zk,
            Layout(root),
            default_worker_id(),
            interval=interval,
            result_ttl=result_ttl,
            limits=limits,
        )
        stop = threading.Event()
        for sig in (signal.SIGTERM, signal.SIGINT):
            signal.signal(sig, lambda *_: stop.set())
        service.start()
        Notifier().ready("janitor")
        log.info("janitor standing for election under %s, a pass every %gs", root, interval)
        stop.wait()
        service.stop()
        log.info("janitor stopped")
        return 0
    finally:
        close(zk)


def _cache_text(admission: Admission) -> str:
    tokens = admission.capacity_tokens
    if tokens is None:
        return "unbounded (no memory admission)"
    return f"{admission.pages_total} KV pages ({tokens} tokens)"


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
