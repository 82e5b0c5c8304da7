"""Scenario 1 (dispatch throughput: zkq against kazoo's LockingQueue) and scenario 7 (the Redis
baseline): echo jobs with zero work, P worker processes, N jobs pre-filled or streamed by one
producer process submitting one job at a time."""

from __future__ import annotations

import json
import time
from collections.abc import Callable
from typing import Any

from kazoo.recipe.queue import LockingQueue

from scripts.bench import wire
from scripts.bench.core import QUEUE, AgentHandle, Bench, call_all, pid_cpu, wait_until
from scripts.bench.scenarios import raw_rates


def run_dispatch(bench: Bench, log: Callable[[str], None]) -> dict[str, Any]:
    cfg = bench.config
    raw = raw_rates(bench, 300, 4000)
    log(
        f"  raw: sync create p50 {raw['sync_create_p50_ms']:.2f} ms "
        f"({raw['sync_creates_per_s']:.0f}/s), pipelined {raw['async_creates_per_s']:.0f}/s"
    )
    rows = []
    for _ in range(cfg.reps):
        for procs in cfg.procs:
            for mode in cfg.modes:
                for slots in cfg.slots:
                    rows.append(zkq_run(bench, procs, slots, mode, cfg.dispatch_jobs))
                    log(_line(rows[-1]))
                rows.append(lq_run(bench, procs, mode, cfg.lq_jobs))
                log(_line(rows[-1]))
    return {"raw": raw, "rows": rows}


def run_redis(bench: Bench, log: Callable[[str], None]) -> dict[str, Any]:
    cfg = bench.config
    server = bench.redis_server()
    rows = []
    for rep in range(cfg.reps):
        for durable in (True, False):
            server.durable(durable)
            for procs in cfg.procs:
                for mode in cfg.modes:
                    rows.append(redis_run(bench, procs, mode, cfg.redis_jobs, durable, rep))
                    log(_line(rows[-1]))
    server.durable(True)
    return {"rows": rows}


def _line(row: dict[str, Any]) -> str:
    slots = f"x{row['slots']}" if row["system"] == "zkq" else ""
    done = "" if row["completed"] else f"  INCOMPLETE {row['done']}/{row['n']}"
    return (
        f"  {row['system']:<13} {row['procs']:>2}{slots:<3} {row['mode']:<8} "
        f"{row['rate']:8.1f} jobs/s{done}"
    )


# -- zkq ------------------------------------------------------------------------------------


def zkq_run(bench: Bench, procs: int, slots: int, mode: str, n: int) -> dict[str, Any]:
    root = bench.fresh_root(f"d{procs}x{slots}{mode[0]}")
    client = bench.client(root)
    client.ensure_queue(QUEUE)
    agents = bench.agents(procs)
    call_all(agents, "zkq_start", root=root, queue=QUEUE, slots=slots)
    producer_wire: dict[str, Any] = {}
    if mode == "prefill":
        before = wire.snapshot()
        client.submit_many([_prompt(i) for i in range(n)], queue=QUEUE, detach=True)
        producer_wire = wire.delta(wire.snapshot(), before)
    results = client.layout.expiry(QUEUE)
    run = _Run(bench, agents, lambda: bench.indexed(results) >= n, n)
    if mode == "prefill":
        run.go()
    else:
        call_all(agents, "go")
        run.start_producer("produce_zkq", root=root, queue=QUEUE, n=n)
    row = run.finish(done=lambda: bench.indexed(results))
    call_all(agents, "stop")
    row.update(system="zkq", procs=procs, slots=slots, mode=mode, root=root)
    if mode == "prefill":
        row["producer_wire"] = producer_wire
    return _per_job(row)


# -- LockingQueue ---------------------------------------------------------------------------


def lq_run(bench: Bench, procs: int, mode: str, n: int) -> dict[str, Any]:
    path = bench.fresh_root(f"lq{procs}{mode[0]}")
    lq = LockingQueue(bench.zk, path)
    lq._ensure_paths()
    agents = bench.agents(procs)
    call_all(agents, "lq_start", path=path)
    producer_wire: dict[str, Any] = {}
    if mode == "prefill":
        before = wire.snapshot()
        _prefill_lq(bench, path, n)
        producer_wire = wire.delta(wire.snapshot(), before)
    entries = f"{path}/entries"

    def drained() -> bool:
        return bench.child_count(entries) == 0

    run = _Run(bench, agents, drained, n)
    if mode == "prefill":
        run.go()
    else:
        call_all(agents, "go")
        run.start_producer("produce_lq", path=path, n=n)
    row = run.finish(done=lambda: n - bench.child_count(entries))
    stopped = call_all(agents, "stop")
    row["consumed"] = sum(s.get("consumed", 0) for s in stopped)
    row.update(system="LockingQueue", procs=procs, slots=1, mode=mode, root=path)
    if mode == "prefill":
        row["producer_wire"] = producer_wire
    return _per_job(row)


def _prefill_lq(bench: Bench, path: str, n: int) -> None:
    """What LockingQueue.put does (one sequential create each), pipelined to save time."""
    prefix = f"{path}/entries/entry-100-"
    for start in range(0, n, 512):
        calls = [
            bench.zk.create_async(prefix, _job_bytes(i), sequence=True)
            for i in range(start, min(n, start + 512))
        ]
        for call in calls:
            call.get()


# -- Redis ----------------------------------------------------------------------------------


def redis_run(
    bench: Bench, procs: int, mode: str, n: int, durable: bool, rep: int
) -> dict[str, Any]:
    from scripts.bench.redis_baseline import RedisQueue  # the bench extra's redis

    server = bench.redis_server()
    prefix = f"b{procs}{mode[0]}{int(durable)}r{rep}"
    queue = RedisQueue(server.port, prefix)
    agents = bench.agents(procs)
    call_all(agents, "redis_start", port=server.port, prefix=prefix)
    if mode == "prefill":
        queue.put_many([(f"j{i}", _prompt(i)) for i in range(n)])
    run = _Run(bench, agents, lambda: queue.done() >= n, n, redis_pid=server.pid)
    if mode == "prefill":
        run.go()
    else:
        call_all(agents, "go")
        run.start_producer("produce_redis", port=server.port, prefix=prefix, n=n)
    row = run.finish(done=queue.done)
    stopped = call_all(agents, "stop")
    queue.close()
    calls: dict[str, int] = {}
    for s in stopped:
        for key, count in s.get("redis_calls", {}).items():
            calls[key] = calls.get(key, 0) + count
    row["redis_calls_per_job"] = {k: v / n for k, v in calls.items()}
    system = "redis-aof" if durable else "redis-memory"
    row.update(system=system, procs=procs, slots=1, mode=mode, root=prefix)
    return _per_job(row)


# -- one timed run ----------------------------------------------------------------------------


class _Run:
    """Times a run from ``go`` (pre-filled) or the producer's start (streamed) to completion and
    collects the counters of every process in between."""

    def __init__(
        self,
        bench: Bench,
        agents: list[AgentHandle],
        complete: Callable[[], bool],
        n: int,
        redis_pid: int | None = None,
    ) -> None:
        self.bench, self.agents, self.complete, self.n = bench, agents, complete, n
        self.redis_pid = redis_pid
        self.producer: AgentHandle | None = None
        self.before = call_all(agents, "stats")
        self.server0 = bench.server_cpu()
        self.redis0 = pid_cpu(redis_pid)
        self.t0 = 0.0

    def go(self) -> None:
        self.t0 = time.perf_counter()
        call_all(self.agents, "go")

    def start_producer(self, command: str, **kwargs: Any) -> None:
        self.producer = self.bench.special("producer")
        self.t0 = time.perf_counter()
        self.producer.send(command, **kwargs)

    def finish(self, done: Callable[[], int]) -> dict[str, Any]:
        timeout = max(30.0, self.n / 15)
        if self.producer is not None:
            producer = self.producer
            finished = wait_until(lambda: producer.ready() and self.complete(), timeout)
        else:
            finished = wait_until(self.complete, timeout)
        elapsed = time.perf_counter() - self.t0
        after = call_all(self.agents, "stats")
        row: dict[str, Any] = {
            "n": self.n,
            "completed": finished,
            "done": self.n if finished else done(),
            "elapsed": elapsed,
            "rate": (self.n if finished else done()) / elapsed,
            "server_cpu": self.bench.server_cpu() - self.server0,
            "redis_cpu": pid_cpu(self.redis_pid) - self.redis0,
            "workers_wire": _sum_delta(after, self.before, "wire"),
            "workers_cpu": _sum_delta(after, self.before, "cpu"),
            "timers": _merge_timers(after),
            "worker_stats": _sum_worker_stats(after),
        }
        if self.producer is not None:
            produced = self.producer.recv(timeout)
            row["producer_wire"] = produced["wire"]
            row["producer_cpu"] = produced["cpu"]
            row["producer_elapsed"] = produced["elapsed"]
        return row


def _sum_delta(after: list[dict[str, Any]], before: list[dict[str, Any]], key: str) -> Any:
    total: dict[str, Any] = {}
    for a, b in zip(after, before, strict=True):
        total = wire.add(total, wire.delta(a[key], b[key]))
    return total


def _merge_timers(stats: list[dict[str, Any]]) -> dict[str, dict[str, float]]:
    """Sum counts and totals of each timer over the processes; keep the mean in ms."""
    merged: dict[str, dict[str, float]] = {}
    for s in stats:
        for name, t in s.get("timers", {}).items():
            m = merged.setdefault(name, {"count": 0, "total_s": 0.0})
            m["count"] += t["count"]
            m["total_s"] += t["total_s"]
    for m in merged.values():
        m["mean_ms"] = m["total_s"] / m["count"] * 1e3 if m["count"] else 0.0
    return merged


def _sum_worker_stats(stats: list[dict[str, Any]]) -> dict[str, int]:
    total: dict[str, int] = {}
    for s in stats:
        for k, v in s.get("worker", {}).items():
            total[k] = total.get(k, 0) + v
    return total


def _per_job(row: dict[str, Any]) -> dict[str, Any]:
    """Round trips, notifications and CPU per job, from the run's totals."""
    n = max(1, row["done"])
    w_reads, w_writes = wire.split_requests(row["workers_wire"].get("requests", {}))
    p_wire = row.get("producer_wire", {})
    p_reads, p_writes = wire.split_requests(p_wire.get("requests", {}))
    row["per_job"] = {
        "worker_reads": w_reads / n,
        "worker_writes": w_writes / n,
        "producer_reads": p_reads / n,
        "producer_writes": p_writes / n,
        "reads": (w_reads + p_reads) / n,
        "writes": (w_writes + p_writes) / n,
        "worker_requests": {k: v / n for k, v in row["workers_wire"].get("requests", {}).items()},
        "producer_requests": {k: v / n for k, v in p_wire.get("requests", {}).items()},
        "multi_ops": {
            k: v / n
            for k, v in wire.add(
                row["workers_wire"].get("multi_ops", {}), p_wire.get("multi_ops", {})
            ).items()
        },
        "notifications": sum(row["workers_wire"].get("watches", {}).values()) / n,
        "worker_cpu_ms": row["workers_cpu"].get("total", 0.0) / n * 1e3,
        "server_cpu_ms": row["server_cpu"] / n * 1e3,
        "redis_cpu_ms": row["redis_cpu"] / n * 1e3,
        "producer_cpu_ms": row.get("producer_cpu", 0.0) / n * 1e3,
    }
    return row


def _prompt(i: int) -> str:
    return f"benchmark job number {i}"


def _job_bytes(i: int) -> bytes:
    return json.dumps({"prompt": _prompt(i)}).encode()
