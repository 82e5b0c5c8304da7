"""Soak: a steady rate of attached jobs for a while with the janitor on, watching the tail
latency, the process's RSS, errors, lost and duplicated jobs.

Producers submit at ``rate`` jobs/s (one thread per in-flight job, each waiting for its result);
two 4-slot echo workers run them; a janitor service (its own session, a pass every 2 s, results
kept 60 s so that expiry works during the run) runs beside them. p99 of the first and of the
last window (a fifth of the run, at most 5 minutes) are compared. Workers, janitor and producers
share this process, so its RSS is everyone's; the ZooKeeper server's RSS is sampled beside it.
``ZKQ_SOAK_SECONDS`` sets the duration (300 s by default, 60 s with --quick).
"""

from __future__ import annotations

import gc
import os
import statistics
import threading
import time
from array import array
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any

from scripts.bench.core import QUEUE, Bench
from scripts.bench.scale import _Fleet, rss_kib
from zkqueue import Client
from zkqueue.operations.janitor import JanitorService

Log = Callable[[str], None]


def run_soak(bench: Bench, log: Log) -> dict[str, Any]:
    quick = bench.config.quick
    seconds = float(os.environ.get("ZKQ_SOAK_SECONDS", 60 if quick else 300))
    rate = float(os.environ.get("ZKQ_SOAK_RATE", 50))
    root = bench.fresh_root("soak")
    fleet = _Fleet(bench.hosts, root, 2, 4)
    client = Client(bench.hosts, root).start()
    client.ensure_queue(QUEUE)
    janitor = JanitorService(
        None,
        client.layout,
        "soak-janitor",
        interval=2.0,
        result_ttl=60.0,
        settings=replace(client.settings, hosts=bench.hosts),
    ).start()
    # Compact per-job bookkeeping (two doubles a job): the process's RSS is the system's, and a
    # list of tuples would itself grow by ~200 bytes a job.
    starts, latencies = array("d"), array("d")
    errors: list[str] = []
    lock = threading.Lock()
    rss: list[tuple[float, int]] = []
    server_rss: list[tuple[float, int]] = []

    def one(i: int) -> None:
        start = time.perf_counter()
        try:
            job = client.submit(f"soak {i}", queue=QUEUE)
            job.result(timeout=60)
            with lock:
                starts.append(start)
                latencies.append(time.perf_counter() - start)
        except Exception as exc:  # every failure counts, none stops the run
            with lock:
                errors.append(f"{type(exc).__name__}: {exc}")

    began = time.perf_counter()
    with ThreadPoolExecutor(max_workers=64) as pool:
        i = 0
        while (now := time.perf_counter()) - began < seconds:
            due = began + i / rate
            if due > now:
                time.sleep(due - now)
            pool.submit(one, i)
            i += 1
            if i % int(rate * 10) == 0:
                gc.collect()
                rss.append((time.perf_counter() - began, rss_kib()))
                server_rss.append((time.perf_counter() - began, _server_rss(bench)))
    submitted = i
    janitor.stop()
    completed = sum(w.stats.completed for w in fleet.workers)
    fleet.stop()
    stored = client.stats()["queues"][QUEUE]["results"]
    client.close()
    window = min(seconds / 5, 300.0)
    done = list(zip(starts, latencies, strict=True))
    first = [lat for at, lat in done if at - began < window]
    last = [lat for at, lat in done if at - began >= seconds - window]
    row = {
        "seconds": seconds,
        "rate": rate,
        "submitted": submitted,
        "answered": len(done),
        "errors": len(errors),
        "error_samples": errors[:5],
        "lost": submitted - len(done) - len(errors),
        "duplicated": max(0, completed - submitted),
        "p99_first_ms": _p99(first) * 1000,
        "p99_last_ms": _p99(last) * 1000,
        "p50_ms": statistics.median(lat for _, lat in done) * 1000 if done else None,
        "window_s": window,
        "rss_kib": rss,
        "server_rss_kib": server_rss,
        "janitor_passes": janitor.passes,
        "results_left": stored,
    }
    row["p99_ratio"] = row["p99_last_ms"] / max(row["p99_first_ms"], 1e-9)
    log(
        f"  soak {seconds:.0f} s at {rate:g}/s: {submitted} submitted, {len(done)} answered, "
        f"{len(errors)} errors, p99 first {row['p99_first_ms']:.1f} ms / last "
        f"{row['p99_last_ms']:.1f} ms ({row['p99_ratio']:.2f}x), RSS "
        f"{rss[0][1] if rss else 0} -> {rss[-1][1] if rss else 0} KiB (ZooKeeper "
        f"{server_rss[0][1] if server_rss else 0} -> {server_rss[-1][1] if server_rss else 0}), "
        f"{janitor.passes} janitor passes"
    )
    return row


def _server_rss(bench: Bench) -> int:
    process = bench.cluster.servers[0].process
    if process is None:
        return 0
    try:
        with open(f"/proc/{process.pid}/status") as f:
            return next((int(x.split()[1]) for x in f if x.startswith("VmRSS:")), 0)
    except OSError:
        return 0


def _p99(values: list[float]) -> float:
    if not values:
        return 0.0
    ordered = sorted(values)
    return ordered[min(len(ordered) - 1, int(len(ordered) * 0.99))]
