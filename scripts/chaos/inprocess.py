"""The in-process pieces, for what a ``zkq worker`` subprocess cannot do: a worker loop on a
thread with a runner that hangs, and the elected janitor. The only place the chaos run builds a
Worker or defines a runner."""

from __future__ import annotations

import threading
from typing import Any

from scripts.chaos.stage import Stage, need
from workers.loop import Worker
from workers.options import WorkerOptions
from workers.runners.base import Outcome, RunningJob, ThreadedRunner
from workers.runners.echo import EchoRunner
from zkqueue.operations.janitor import JanitorService
from zkqueue.plumbing.connection import ConnectionSettings, close, connect
from zkqueue.protocol.result import Status

#: Longest a hung runner stays stuck if nobody releases it (keeps every thread bounded).
_HANG_LIMIT = 300.0


class HungRunner(ThreadedRunner):
    """A runner wedged like a stuck CUDA kernel: it reports no progress and ignores
    cancellation until ``release`` is set, then echoes its jobs (too late: their claims are
    gone)."""

    name = "hung"

    def __init__(self) -> None:
        super().__init__()
        self.release = threading.Event()
        self.started = threading.Event()
        self.seen: list[str] = []

    def run_one(self, job: RunningJob) -> Outcome:
        self.seen.append(job.id)
        self.started.set()
        self.release.wait(_HANG_LIMIT)
        return Outcome(Status.SUCCEEDED, output=job.spec.prompt)

    def close(self) -> None:
        self.release.set()
        super().close()


class InProcessWorker:
    """A Worker loop on a thread with its own session, for runners a subprocess cannot take."""

    def __init__(
        self, stage: Stage, runner: HungRunner | EchoRunner, name: str, **kwargs: Any
    ) -> None:
        settings = ConnectionSettings(hosts=stage.hosts, session_timeout=stage.session_timeout)
        self.zk = connect(settings)
        opts = WorkerOptions(root=stage.root, name=name, heartbeat_interval=0.5, **kwargs)
        self.worker = Worker(self.zk, runner, opts)
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
