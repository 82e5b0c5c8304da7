"""Scenario 3, the herd: with N idle workers, how many watch notifications and woken sessions
one new job costs, for zkq's line and for kazoo's LockingQueue."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from kazoo.recipe.queue import LockingQueue

from scripts.bench import wire
from scripts.bench.core import PROMPT, QUEUE, AgentHandle, Bench, call_all, wait_until

Log = Callable[[str], None]


def run_herd(bench: Bench, log: Log) -> dict[str, Any]:
    rows = []
    for size in bench.config.herd_sizes:
        rows.append(_herd_zkq(bench, size))
        log(_herd_line(rows[-1]))
        rows.append(_herd_lq(bench, size))
        log(_herd_line(rows[-1]))
    return {"rows": rows}


def _herd_line(row: dict[str, Any]) -> str:
    return (
        f"  {row['system']:<13} {row['workers']:>2} idle: {row['notifications_per_job']:.2f} "
        f"notifications/job, at most {row['max_sessions_woken']} sessions woken"
    )


def _herd_zkq(bench: Bench, size: int) -> dict[str, Any]:
    root = bench.fresh_root(f"herd{size}")
    client = bench.client(root)
    client.ensure_queue(QUEUE)
    agents = bench.agents(size)
    call_all(agents, "zkq_start", root=root, queue=QUEUE, slots=1)
    call_all(agents, "go")
    line = client.layout.line(QUEUE)
    wait_until(lambda: bench.child_count(line) == size, 30)

    def one_job() -> None:
        client.submit(PROMPT, queue=QUEUE).result(timeout=10)
        wait_until(lambda: bench.child_count(line) == size, 10, 0.002)

    row = _herd_measure(bench, agents, one_job)
    call_all(agents, "stop")
    row.update(system="zkq", workers=size)
    return row


def _herd_lq(bench: Bench, size: int) -> dict[str, Any]:
    path = bench.fresh_root(f"lqherd{size}")
    lq = LockingQueue(bench.zk, path)
    lq._ensure_paths()
    agents = bench.agents(size)
    call_all(agents, "lq_start", path=path)
    call_all(agents, "go")
    time.sleep(0.3)  # every consumer into its first get(): it lists and sets its watches

    def one_job() -> None:
        lq.put(b'{"prompt": "benchmark job number 0"}')
        wait_until(
            lambda: bench.child_count(f"{path}/entries") + bench.child_count(f"{path}/taken") == 0,
            10,
            0.002,
        )

    row = _herd_measure(bench, agents, one_job)
    call_all(agents, "stop")
    row.update(system="LockingQueue", workers=size)
    return row


def _herd_measure(
    bench: Bench, agents: list[AgentHandle], one_job: Callable[[], None]
) -> dict[str, Any]:
    """Run jobs one at a time; after each, flush every session's notifications and count them."""
    per_job, woken, events, callers = [], [], [], []
    before = first = call_all(agents, "stats", flush=True)
    for _ in range(bench.config.herd_jobs):
        mine = wire.snapshot()
        one_job()
        after = call_all(agents, "stats", flush=True)
        # The caller's own notifications (its result watch) count too: this process's sessions.
        caller = sum(wire.delta(wire.snapshot(), mine)["watches"].values())
        counts = [_watches(a) - _watches(b) for a, b in zip(after, before, strict=True)]
        per_job.append(sum(counts) + caller)
        callers.append(caller)
        woken.append(sum(1 for c in counts if c > 0))
        events.append(
            sum(
                a.get("worker", {}).get("watch_events", 0)
                - b.get("worker", {}).get("watch_events", 0)
                for a, b in zip(after, before, strict=True)
            )
        )
        before = after
    jobs = max(1, len(per_job))
    return {
        "jobs": len(per_job),
        "notifications_per_job": sum(per_job) / jobs,
        "caller_notifications_per_job": sum(callers) / jobs,
        "max_notifications": max(per_job, default=0),
        "sessions_woken_per_job": sum(woken) / jobs,
        "max_sessions_woken": max(woken, default=0),
        "worker_watch_events_per_job": sum(events) / jobs,
        "by_type": {k: v / jobs for k, v in _watch_types(before, first).items() if v},
    }


def _watches(stats: dict[str, Any]) -> int:
    return sum(stats["wire"].get("watches", {}).values())


def _watch_types(after: list[dict[str, Any]], before: list[dict[str, Any]]) -> dict[str, int]:
    """Notifications by event type and watched path, summed over the sessions."""
    total: dict[str, int] = {}
    for a, b in zip(after, before, strict=True):
        for k, v in a["wire"].get("watches", {}).items():
            total[k] = total.get(k, 0) + v - b["wire"].get("watches", {}).get(k, 0)
    return total
