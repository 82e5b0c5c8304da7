"""Benchmark agent processes: each one holds its own ZooKeeper session and serves commands from the
harness over a pipe. An agent runs one service at a time (a zkq worker, a kazoo LockingQueue
consumer, a Redis queue worker) on a thread, gated by a ``go`` so that every process of a run
starts together, or it runs one-shot commands (producers, direct ``generate``). Agents are forked
from a forkserver that has imported this module, so starting sixteen of them is cheap."""

from __future__ import annotations

import json
import os
import threading
import time
import traceback
from collections.abc import Callable
from dataclasses import asdict
from multiprocessing.connection import Connection
from typing import Any

import bench_redis
import bench_wire
from kazoo.client import KazooClient
from kazoo.protocol.states import Callback
from kazoo.recipe.queue import LockingQueue

from workers.loop import Worker
from workers.runners.base import Runner
from workers.runners.echo import EchoRunner
from zkqueue import Client

_JOIN_TIMEOUT = 20.0


def agent_main(conn: Connection, hosts: str) -> None:
    """Entry point of an agent process: serve (command, kwargs) tuples until ``exit``."""
    bench_wire.install()
    agent = Agent(hosts)
    try:
        while True:
            try:
                command, kwargs = conn.recv()
            except EOFError:
                break
            if command == "exit":
                conn.send(("ok", None))
                break
            conn.send(agent.handle(command, kwargs))
    finally:
        agent.close()


def flush_watches(zk: KazooClient) -> None:
    """Return once every notification the server sent this session so far has been handled."""
    zk.sync("/")
    done = threading.Event()
    zk.handler.dispatch_callback(Callback("watch", done.set, ()))
    done.wait(10)


def process_stats(zk: KazooClient | None, flush: bool = False) -> dict[str, Any]:
    if flush and zk is not None:
        flush_watches(zk)
    return {"wire": bench_wire.snapshot(), "cpu": bench_wire.thread_cpu()}


class Agent:
    """The commands one agent process understands (``cmd_<name>``)."""

    def __init__(self, hosts: str) -> None:
        self.zk = KazooClient(hosts=hosts, timeout=10.0)
        self.zk.start(timeout=30)
        self.service: Service | None = None
        self.go_at = 0.0
        self._runners: dict[str, Any] = {}

    def handle(self, command: str, kwargs: dict[str, Any]) -> tuple[str, Any]:
        try:
            return "ok", getattr(self, f"cmd_{command}")(**kwargs)
        except Exception:
            return "error", traceback.format_exc()

    def close(self) -> None:
        if self.service is not None:
            self.service.stop()
        for runner in self._runners.values():
            runner.close()
        self.zk.stop()
        self.zk.close()

    # -- services ------------------------------------------------------------------------------

    def cmd_zkq_start(
        self,
        root: str,
        queue: str,
        slots: int,
        profile: bool = False,
        model_dir: str | None = None,
    ) -> dict[str, Any]:
        runner = self._hf_runner(model_dir) if model_dir else EchoRunner()
        return self._start(ZkqService(self.zk, runner, root, queue, slots, profile))

    def cmd_lq_start(self, path: str) -> dict[str, Any]:
        return self._start(LockingQueueService(self.zk, path))

    def cmd_redis_start(self, port: int, prefix: str) -> dict[str, Any]:
        return self._start(RedisService(self.zk, port, prefix))

    def _start(self, service: Service) -> dict[str, Any]:
        if self.service is not None:
            self.service.stop()
        self.service = service
        service.start()
        return {"pid": _pid()}

    def cmd_go(self) -> None:
        if self.service is None:
            raise RuntimeError("no service started")
        self.go_at = time.perf_counter()
        self.service.go.set()

    def cmd_wait_completed(self, n: int, limit: float) -> float | None:
        """Seconds from ``go`` until this process's worker has completed ``n`` jobs (None after
        ``limit`` seconds). Timed here, from the worker's own counter, so that nothing polls
        ZooKeeper while it runs."""
        service = self.service
        if not isinstance(service, ZkqService):
            raise RuntimeError("no zkq worker started")
        deadline = time.perf_counter() + limit
        while service.worker.stats.completed < n:
            if time.perf_counter() > deadline:
                return None
            time.sleep(0.002)
        return time.perf_counter() - self.go_at

    def cmd_stats(self, flush: bool = False) -> dict[str, Any]:
        out = process_stats(self.zk, flush)
        if self.service is not None:
            out.update(self.service.stats())
        return out

    def cmd_stop(self) -> dict[str, Any]:
        if self.service is None:
            return self.cmd_stats()
        service, self.service = self.service, None
        service.stop()
        return {**process_stats(self.zk), **service.stats(), **service.final()}

    # -- producers -----------------------------------------------------------------------------

    def cmd_produce_zkq(
        self, root: str, queue: str, n: int, profile: bool = False
    ) -> dict[str, Any]:
        client = Client(root=root, zk=self.zk)
        client.ensure_queue(queue)
        return _timed_producer(
            lambda i: client.submit(_prompt(i), queue=queue, detach=True), n, profile
        )

    def cmd_produce_lq(self, path: str, n: int) -> dict[str, Any]:
        lq = LockingQueue(self.zk, path)
        return _timed_producer(lambda i: lq.put(_job_bytes(i)), n, False)

    def cmd_produce_redis(self, port: int, prefix: str, n: int) -> dict[str, Any]:
        producer = bench_redis.RedisQueue(port, prefix)
        try:
            return _timed_producer(lambda i: producer.put(f"j{i}", _prompt(i)), n, False)
        finally:
            producer.close()

    # -- the model -----------------------------------------------------------------------------

    def cmd_hf_load(
        self,
        model_dir: str,
        prompts: list[str],
        max_new_tokens: int,
        batches: list[int],
        torch_threads: int | None,
    ) -> dict[str, Any]:
        """Write and load the tiny model, then warm both paths on every prompt at every batch
        size: the first call on new tensor shapes is several times slower than the next.
        ``torch_threads`` sets OMP_NUM_THREADS before torch is imported, which is what every
        thread of the process (the worker's executor threads included) starts with."""
        if torch_threads is not None:
            os.environ["OMP_NUM_THREADS"] = str(torch_threads)
        import bench_model_agent

        start = time.perf_counter()
        bench_model_agent.ensure_model(model_dir)
        runner = self._hf_runner(model_dir)
        load = time.perf_counter() - start
        for batch in batches:
            bench_model_agent.runner_direct(runner, prompts, max_new_tokens, batch)
        bench_model_agent.direct_generate(model_dir, prompts, max_new_tokens, max(batches))
        import torch

        return {
            "load_s": load,
            "warm_s": time.perf_counter() - start - load,
            "torch_threads": torch.get_num_threads(),
        }

    def cmd_hf_direct(
        self, model_dir: str, prompts: list[str], max_new_tokens: int, batch: int
    ) -> dict[str, Any]:
        import bench_model_agent

        return bench_model_agent.direct_generate(model_dir, prompts, max_new_tokens, batch)

    def cmd_hf_runner_direct(
        self, model_dir: str, prompts: list[str], max_new_tokens: int, batch: int
    ) -> dict[str, Any]:
        import bench_model_agent

        runner = self._hf_runner(model_dir)
        return bench_model_agent.runner_direct(runner, prompts, max_new_tokens, batch)

    def _hf_runner(self, model_dir: str) -> Any:
        if model_dir not in self._runners:
            import bench_model_agent

            self._runners[model_dir] = bench_model_agent.load_runner(model_dir)
        return self._runners[model_dir]


# -- services -------------------------------------------------------------------------------


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
        self.worker = Worker(zk, runner, queue=queue, root=root, slots=slots)
        self.timers = bench_wire.Timers()
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

        w._dispatch = timed_dispatch
        t.wrap(w.view, "refresh", "view_refresh")
        t.wrap(w, "_pick", "pick")
        t.wrap(w.claims, "claim", "claim_multi")
        t.wrap(w.claims, "complete", "complete_multi")
        t.wrap(w.line, "_ask_head", "ask_head")
        t.wrap(w, "_watch_entries", "watch_entries")
        t.wrap(w, "_execute", "execute")

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
    """A reliable-queue worker on Redis (see bench_redis.RedisQueue)."""

    def __init__(self, zk: KazooClient, port: int, prefix: str) -> None:
        super().__init__()
        self.queue = bench_redis.RedisQueue(port, prefix, worker=f"w{_pid()}")
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


# -- helpers --------------------------------------------------------------------------------


def _prompt(i: int) -> str:
    return f"benchmark job number {i}"


def _job_bytes(i: int) -> bytes:
    return json.dumps({"prompt": _prompt(i)}).encode()


def _pid() -> int:
    return os.getpid()


def _timed_producer(put: Callable[[int], Any], n: int, profile: bool) -> dict[str, Any]:
    """Call put(i) for i < n one at a time; return the elapsed time and this process's counts."""
    profiler = None
    if profile:
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.0005, async_mode="disabled")
        profiler.start()
    before, cpu0 = bench_wire.snapshot(), bench_wire.thread_cpu()["total"]
    start = time.perf_counter()
    for i in range(n):
        put(i)
    elapsed = time.perf_counter() - start
    out = {
        "elapsed": elapsed,
        "wire": bench_wire.delta(bench_wire.snapshot(), before),
        "cpu": bench_wire.thread_cpu()["total"] - cpu0,
    }
    if profiler is not None:
        profiler.stop()
        out["profile"] = profiler.output_text(show_all=False)
    return out
