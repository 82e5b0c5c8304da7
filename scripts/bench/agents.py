"""Benchmark agent processes: each one holds its own ZooKeeper session and serves commands from the
harness over a pipe. An agent runs one service at a time (a zkq worker, a kazoo LockingQueue
consumer, a Redis queue worker) on a thread, gated by a ``go`` so that every process of a run
starts together, or it runs one-shot commands (producers). Agents are forked
from a forkserver that has imported this module, so starting sixteen of them is cheap. What they
run is in services.py."""

from __future__ import annotations

import json
import os
import threading
import time
import traceback
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

from kazoo.client import KazooClient
from kazoo.handlers.threading import SequentialThreadingHandler
from kazoo.protocol.states import Callback
from kazoo.recipe.queue import LockingQueue

from scripts.bench import wire
from scripts.bench.services import LockingQueueService, RedisService, Service, ZkqService
from workers.runners.echo import EchoRunner
from zkqueue import Client
from zkqueue.plumbing.connection import ConnectionSettings
from zkqueue.plumbing.handler import PollingHandler


def agent_main(conn: Connection, hosts: str) -> None:
    """Entry point of an agent process: serve (command, kwargs) tuples until ``exit``."""
    wire.install()
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


def process_stats(*sessions: KazooClient | None, flush: bool = False) -> dict[str, Any]:
    """The process's wire counters and CPU; with ``flush``, after each session's notifications
    were read (a sync, then its callbacks)."""
    for zk in sessions if flush else ():
        if zk is not None:
            flush_watches(zk)
    return {"wire": wire.snapshot(), "cpu": wire.thread_cpu()}


class Agent:
    """The commands one agent process understands (``cmd_<name>``)."""

    def __init__(self, hosts: str) -> None:
        # zkq's clients run on zkq's kazoo handler (zkqueue.plumbing.handler); LockingQueue on
        # kazoo's own, as kazoo ships it, unless ZKQ_BENCH_LQ_HANDLER=zkq (to tell the handler's
        # share).
        self.hosts = hosts
        self.zk = _start(ConnectionSettings(hosts=hosts, session_timeout=10.0).make_client())
        self._lq_zk: KazooClient | None = None
        self.service: Service | None = None

    @property
    def lq_zk(self) -> KazooClient:
        if self._lq_zk is None:
            zkq = os.environ.get("ZKQ_BENCH_LQ_HANDLER") == "zkq"
            handler = PollingHandler() if zkq else SequentialThreadingHandler()
            self._lq_zk = _start(KazooClient(hosts=self.hosts, timeout=10.0, handler=handler))
        return self._lq_zk

    def handle(self, command: str, kwargs: dict[str, Any]) -> tuple[str, Any]:
        try:
            return "ok", getattr(self, f"cmd_{command}")(**kwargs)
        except Exception:
            return "error", traceback.format_exc()

    def close(self) -> None:
        if self.service is not None:
            self.service.stop()
        for zk in (self.zk, self._lq_zk):
            if zk is not None:
                zk.stop()
                zk.close()

    # -- services ------------------------------------------------------------------------------

    def cmd_zkq_start(
        self, root: str, queue: str, slots: int, profile: bool = False
    ) -> dict[str, Any]:
        return self._start(ZkqService(self.zk, EchoRunner(), root, queue, slots, profile))

    def cmd_lq_start(self, path: str) -> dict[str, Any]:
        return self._start(LockingQueueService(self.lq_zk, path))

    def cmd_redis_start(self, port: int, prefix: str) -> dict[str, Any]:
        return self._start(RedisService(self.zk, port, prefix))

    def _start(self, service: Service) -> dict[str, Any]:
        if self.service is not None:
            self.service.stop()
        self.service = service
        service.start()
        return {"pid": os.getpid()}

    def cmd_go(self) -> None:
        if self.service is None:
            raise RuntimeError("no service started")
        self.service.go.set()

    def cmd_stats(self, flush: bool = False) -> dict[str, Any]:
        out = process_stats(self.zk, self._lq_zk, flush=flush)
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
        lq = LockingQueue(self.lq_zk, path)
        return _timed_producer(lambda i: lq.put(_job_bytes(i)), n, False)

    def cmd_produce_redis(self, port: int, prefix: str, n: int) -> dict[str, Any]:
        from scripts.bench.redis_baseline import RedisQueue  # the bench extra's redis

        producer = RedisQueue(port, prefix)
        try:
            return _timed_producer(lambda i: producer.put(f"j{i}", _prompt(i)), n, False)
        finally:
            producer.close()


# -- helpers --------------------------------------------------------------------------------


def _prompt(i: int) -> str:
    return f"benchmark job number {i}"


def _job_bytes(i: int) -> bytes:
    return json.dumps({"prompt": _prompt(i)}).encode()


def _timed_producer(put: Callable[[int], Any], n: int, profile: bool) -> dict[str, Any]:
    """Call put(i) for i < n one at a time; return the elapsed time and this process's counts."""
    profiler = None
    if profile:
        from pyinstrument import Profiler

        profiler = Profiler(interval=0.0005, async_mode="disabled")
        profiler.start()
    before, cpu0 = wire.snapshot(), wire.thread_cpu()["total"]
    start = time.perf_counter()
    for i in range(n):
        put(i)
    elapsed = time.perf_counter() - start
    out = {
        "elapsed": elapsed,
        "wire": wire.delta(wire.snapshot(), before),
        "cpu": wire.thread_cpu()["total"] - cpu0,
    }
    if profiler is not None:
        profiler.stop()
        out["profile"] = profiler.output_text(show_all=False)
    return out


def _start(zk: KazooClient) -> KazooClient:
    zk.start(timeout=30)
    return zk
