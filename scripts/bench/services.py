"""What an agent process runs on a thread, gated by ``go``: a zkq worker (with timers on its hot
path), a kazoo LockingQueue consumer, or a worker of the Redis baseline queue."""

from __future__ import annotations

import json
import os
import threading
import time
from dataclasses import asdict
from typing import Any

from kazoo.client import KazooClient
from kazoo.recipe.queue import LockingQueue

from scripts.bench import wire
from workers.loop import Worker
from workers.options import WorkerOptions
from workers.runners.base import Runner

_JOIN_TIMEOUT = 20.0


class Service:
    """Something that runs on a thread after ``go``: start() returns once it is ready."""

    def __init__(self) -> None:
        self.go = threading.Event()
        self.thread: threading.Thread | None = None

    def start(self) -> None:
        raise NotImplementedError

    def stop(self) -> None:
        raise NotImplementedError

    def stats(self) -> dict[str, Any]:
        return {}

    def final(self) -> dict[str, Any]:
        return {}


class ZkqService(Service):
    """One zkq worker (workers.loop.Worker) with timers on its hot-path methods."""

    def __init__(
        self,
        zk: KazooClient,
        runner: Runner,
        root: str,
        queue: str,
        slots: int,
        profile: bool,
    ) -> None:
        super().__init__()
        opts = WorkerOptions(queue=queue, root=root, max_concurrency=slots)
        self.worker = Worker(zk, runner, opts)
        self.timers = wire.Timers()
        self.profile = profile
        self._profile_text: str | None = None
        self._ready = threading.Event()
        self._wrap_hot_path()

    def _wrap_hot_path(self) -> None:
        w, t = self.worker, self.timers
        claimed_before = [0]

        def turn_start() -> None:
            claimed_before[0] = w.stats.claimed

        dispatch = getattr(w, "_dispatch", None)
        if dispatch is None:
            return

        def timed_dispatch() -> None:
            turn_start()
            start = time.perf_counter()
            dispatch()
            if w.stats.claimed > claimed_before[0]:
                t.add("head_turn", time.perf_counter() - start)
                t.add("jobs_per_turn", float(w.stats.claimed - claimed_before[0]))

        w._dispatch = timed_dispatch  # type: ignore[method-assign]
        t.wrap(w.view, "refresh", "view_refresh")
        t.wrap(w.head, "_pick", "pick")
        t.wrap(w.claims, "claim", "claim_multi")
        t.wrap(w.claims, "complete_many", "complete_multi")
        t.wrap(w.line, "_ask_head", "ask_head")
        t.wrap(w.bridge, "watch", "watch_entries")
        t.wrap(w.bridge, "hand_in", "hand_in")

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="bench-loop", daemon=True)
        self.thread.start()
        if not self._ready.wait(30):
            raise TimeoutError("worker did not register within 30 s")

    def _gate(self) -> None:
        self._ready.set()
        self.go.wait()

    def _run(self) -> None:
        if not self.profile:
            self.worker.run(on_ready=self._gate)
            return
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.0005, async_mode="disabled")

        def gate() -> None:
            self._gate()
            profiler.start()

        try:
            self.worker.run(on_ready=gate)
        finally:
            if profiler.is_running:
                profiler.stop()
                self._profile_text = profiler.output_text(show_all=False)

    def stop(self) -> None:
        self.go.set()
        self.worker.stop(drain=True)
        if self.thread is not None:
            self.thread.join(_JOIN_TIMEOUT)

    def stats(self) -> dict[str, Any]:
        return {"worker": asdict(self.worker.stats), "timers": self.timers.summary()}

    def final(self) -> dict[str, Any]:
        return {"profile": self._profile_text}


class LockingQueueService(Service):
    """A kazoo LockingQueue consumer: get, echo, consume, until stopped."""

    def __init__(self, zk: KazooClient, path: str) -> None:
        super().__init__()
        self.queue = LockingQueue(zk, path)
        self.consumed = 0
        self._stopping = threading.Event()

    def start(self) -> None:
        self.queue._ensure_paths()
        self.thread = threading.Thread(target=self._run, name="bench-consumer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.go.wait()
        while not self._stopping.is_set():
            item = self.queue.get(timeout=0.5)
            if item is None:
                continue
            json.loads(item)  # the echo "work": decode the job
            if self.queue.consume():
                self.consumed += 1

    def stop(self) -> None:
        self._stopping.set()
        self.go.set()
        if self.thread is not None:
            self.thread.join(_JOIN_TIMEOUT)

    def stats(self) -> dict[str, Any]:
        return {"consumed": self.consumed}


class RedisService(Service):
    """A reliable-queue worker on Redis (see redis_baseline.RedisQueue)."""

    def __init__(self, zk: KazooClient, port: int, prefix: str) -> None:
        super().__init__()
        from scripts.bench.redis_baseline import RedisQueue  # the bench extra's redis

        self.queue = RedisQueue(port, prefix, worker=f"w{os.getpid()}")
        self.done = 0
        self.calls = 0
        self._stopping = threading.Event()

    def start(self) -> None:
        self.thread = threading.Thread(target=self._run, name="bench-consumer", daemon=True)
        self.thread.start()

    def _run(self) -> None:
        self.go.wait()
        while not self._stopping.is_set():
            job = self.queue.take(block=0.5)
            if job is None:
                continue
            spec = json.loads(job)
            self.queue.complete(job, spec["id"], spec["prompt"])
            self.done += 1

    def stop(self) -> None:
        self._stopping.set()
        self.go.set()
        if self.thread is not None:
            self.thread.join(_JOIN_TIMEOUT)
        self.queue.close()

    def stats(self) -> dict[str, Any]:
        return {"consumed": self.done, "redis_calls": dict(self.queue.calls)}
