"""Scale: what a deep queue, a large result store, a long-lived client and an idle fleet cost.

- pending: ``n`` detached jobs waiting; ``zkq ls`` (first 100), stats, a job's status, a ``top``
  snapshot and a janitor pass each timed; a 4-slot worker still dispatches; zkCli lists every
  parent under the root.
- results: ``n`` stored results (written directly, each with its expiry index node); a janitor
  pass and submit-to-result p50 on two workers (one hosting the janitor on its own session,
  passing every second) against the same run with an empty store; this process's RSS.
- attached: one Client submits ``n`` attached jobs in sequence; the watches its session holds at
  the end (``wchc``) and its process's RSS growth.
- idle: ``n`` idle workers in one process; ZooKeeper writes per second from the zxid (``srvr``).

Workers run in this process (one thread and one ZooKeeper session each), so RSS is this
process's: the harness, the workers and the janitor together.
"""

from __future__ import annotations

import gc
import json
import os
import statistics
import subprocess
import threading
import time
from collections.abc import Callable
from dataclasses import replace
from typing import Any

from kazoo.client import KazooClient

from scripts.bench.core import QUEUE, Bench, wait_until
from workers.loop import Worker
from workers.options import WorkerOptions
from workers.runners.echo import EchoRunner
from zkqueue import Client
from zkqueue.operations.expiry import ExpiryLimits
from zkqueue.operations.janitor import Janitor, JanitorService
from zkqueue.plumbing.connection import ConnectionSettings
from zkqueue.protocol import claims
from zkqueue.protocol.layout import RESULT_BUCKETS, Layout
from zkqueue.protocol.nodes import Ticks
from zkqueue.protocol.result import Result
from zkqueue.testing import four_letter

Log = Callable[[str], None]
#: A bound above the largest store measured, so that a pass deletes nothing.
_ROOMY = ExpiryLimits(max_results=10_000_000, max_bytes=2**40)
ZKCLI = "/usr/share/zookeeper/bin/zkCli.sh"


def run_scale(bench: Bench, log: Log) -> dict[str, Any]:
    quick = bench.config.quick
    parts = os.environ.get("ZKQ_SCALE", "pending,results,attached,idle").split(",")
    out: dict[str, Any] = {}
    if "pending" in parts:
        out["pending"] = _pending(bench, 10_000 if quick else 100_000, log)
    if "results" in parts:
        out["results"] = _results(bench, 20_000 if quick else 250_000, log)
    if "attached" in parts:
        out["attached"] = _attached(bench, 1_000 if quick else 20_000, log)
    if "idle" in parts:
        out["idle"] = _idle(bench, 20 if quick else 100, 10.0 if quick else 30.0, log)
    return out


# -- helpers ---------------------------------------------------------------------------------


class _Fleet:
    """In-process workers, each with its own session and thread."""

    def __init__(self, hosts: str, root: str, n: int, slots: int, **opts: Any) -> None:
        settings = ConnectionSettings(hosts=hosts, session_timeout=10.0)
        self.zks = [settings.make_client() for _ in range(n)]
        self.workers = []
        for i, zk in enumerate(self.zks):
            zk.start(timeout=30)
            options = WorkerOptions(
                root=root, queue=QUEUE, max_concurrency=slots, name=f"scale-{i}", **opts
            )
            self.workers.append(Worker(zk, EchoRunner(), options))
        self.threads = [threading.Thread(target=w.run, daemon=True) for w in self.workers]
        for t in self.threads:
            t.start()
        for w in self.workers:
            w.ready.wait(30)

    def stop(self) -> None:
        for w in self.workers:
            w.stop(drain=False)
        for t in self.threads:
            t.join(10)
        for zk in self.zks:
            zk.stop()
            zk.close()


def _timed(fn: Callable[[], Any], repeat: int = 3) -> float:
    """Median seconds of ``repeat`` calls."""
    times = []
    for _ in range(repeat):
        start = time.perf_counter()
        fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times)


def rss_kib() -> int:
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1])
    return 0


def zxid(bench: Bench) -> int:
    port = bench.cluster.servers[0].client_port
    for line in four_letter(port, "srvr").splitlines():
        if line.startswith("Zxid:"):
            return int(line.split(":", 1)[1].strip(), 16)
    return 0


def zkcli_lists(hosts: str, paths: list[str]) -> dict[str, Any]:
    """List each path with Java's zkCli (1 MB jute.maxbuffer): how many it could list."""
    commands = "".join(f"ls {p}\n" for p in paths) + "quit\n"
    done = subprocess.run(
        [ZKCLI, "-server", hosts], input=commands, capture_output=True, text=True, timeout=300
    )
    text = done.stdout + done.stderr
    listed = [line for line in done.stdout.splitlines() if line.startswith("[")]
    largest = max((line.count(",") + 1 for line in listed if line != "[]"), default=0)
    return {
        "parents": len(paths),
        "listed": len(listed),
        "errors": text.count("ConnectionLoss") + text.count("KeeperErrorCode"),
        "largest_listing": largest,
    }


def parents(bench: Bench, layout: Layout) -> list[str]:
    """Every parent directory under a root (buckets: all pending, sampled result buckets)."""
    zk = bench.zk
    out = [layout.root, layout.queues(), layout.queue(QUEUE), f"{layout.queue(QUEUE)}/pending"]
    for priority in ("high", "normal", "low"):
        pending = layout.pending(QUEUE, priority)
        out.append(pending)
        out += [f"{pending}/{b}" for b in zk.get_children(pending)]
    out += [layout.claims(QUEUE), layout.line(QUEUE), layout.dead(QUEUE), layout.workers()]
    out += [layout.results(QUEUE), *(layout.result_dir(QUEUE, b) for b in RESULT_BUCKETS[::32])]
    expiry = layout.expiry(QUEUE)
    ticks = zk.get_children(expiry) if zk.exists(expiry) else []
    out += [expiry, *(f"{expiry}/{t}" for t in sorted(ticks)[:3])]
    return [p for p in out if zk.exists(p) is not None]


# -- pending ---------------------------------------------------------------------------------


def _pending(bench: Bench, n: int, log: Log) -> dict[str, Any]:
    root = bench.fresh_root("pending")
    client = bench.client(root)
    start = time.perf_counter()
    jobs = []
    for i in range(0, n, 10_000):
        jobs += client.submit_many([f"deep {j}" for j in range(i, min(n, i + 10_000))], queue=QUEUE)
    fill = time.perf_counter() - start
    from zkqueue.operations.exporter import read_cluster

    janitor = Janitor(bench.zk, client.layout)
    row: dict[str, Any] = {"pending": n, "fill_s": fill}
    row["ls_s"] = _timed(lambda: client.list(QUEUE, limit=100))
    row["stats_s"] = _timed(client.stats)
    row["status_last_s"] = _timed(lambda: client.job(jobs[-1].id, QUEUE).info())
    row["status_handle_s"] = _timed(jobs[n // 2].info)
    row["top_s"] = _timed(lambda: read_cluster(client))
    row["janitor_first_pass_s"] = _timed(janitor.run_pass, 1)
    row["janitor_pass_s"] = _timed(janitor.run_pass)
    row["zkcli"] = zkcli_lists(bench.hosts, parents(bench, client.layout))
    fleet = _Fleet(bench.hosts, root, 1, 4)
    try:
        start = time.perf_counter()
        wait_until(lambda: bench.indexed(client.layout.expiry(QUEUE)) >= 500, 120)
        row["dispatch_500_s"] = time.perf_counter() - start
    finally:
        fleet.stop()
    log(
        f"  {n} pending: ls {row['ls_s'] * 1000:.0f} ms, stats {row['stats_s'] * 1000:.0f} ms, "
        f"status {row['status_last_s'] * 1000:.0f} ms, top {row['top_s'] * 1000:.0f} ms, "
        f"janitor pass {row['janitor_pass_s'] * 1000:.0f} ms "
        f"(first {row['janitor_first_pass_s'] * 1000:.0f}); "
        f"500 jobs dispatched in {row['dispatch_500_s']:.1f} s; zkCli {row['zkcli']}"
    )
    return row


# -- results ---------------------------------------------------------------------------------


def store_results(zk: KazooClient, layout: Layout, n: int, finished: float) -> None:
    """Write ``n`` detached-looking results with their index nodes, 100 to a multi."""
    ticks = Ticks()
    calls = []
    for start in range(0, n, 100):
        txn = zk.transaction()
        for i in range(start, min(n, start + 100)):
            # Spread over an hour of finishing times (~70 results a second at 250,000).
            at = finished - 3600 * (1 - i / max(n, 1))
            ticks.ensure(zk, layout, QUEUE, at)
            record = Result(
                id=f"stored{i}",
                queue=QUEUE,
                priority="normal",
                status="succeeded",
                output="x" * 200,
                worker="bench",
                attempts=1,
                submitted_at=at - 1,
                finished_at=at,
            )
            claims.add_result(txn, layout, QUEUE, record)
        calls.append(txn.commit_async())
        if len(calls) >= 16:
            calls.pop(0).get()
    for call in calls:
        call.get()


def _latencies(client: Client, n: int) -> dict[str, float]:
    """p50 submit-to-result (ms) per worker, attached jobs one at a time."""
    by_worker: dict[str, list[float]] = {}
    for i in range(n):
        start = time.perf_counter()
        record = client.submit(f"probe {i}", queue=QUEUE).result(timeout=30)
        by_worker.setdefault(record.worker or "?", []).append(time.perf_counter() - start)
    return {w: statistics.median(v) * 1000 for w, v in sorted(by_worker.items())}


def _results(bench: Bench, n: int, log: Log) -> dict[str, Any]:
    rows = {}
    for label, count in (("empty", 0), ("stored", n)):
        root = bench.fresh_root(f"results-{label}")
        client = bench.client(root)
        client.ensure_queue(QUEUE)
        start = time.perf_counter()
        if count:
            # The last hour: inside the retention, under the bound (nothing is deleted).
            store_results(bench.zk, client.layout, count, time.time() - 60)
        fill = time.perf_counter() - start
        gc.collect()
        rss_before = rss_kib()
        # A bound above what is stored: the pass has nothing to delete (its cost is measured).
        janitor = Janitor(bench.zk, client.layout, limits=_ROOMY)
        janitor.run_pass()
        pass_s = _timed(janitor.run_pass)
        service = JanitorService(
            None,
            client.layout,
            "scale-janitor",
            interval=1.0,
            settings=replace(client.settings, hosts=bench.hosts),
            limits=_ROOMY,
        )
        fleet = _Fleet(bench.hosts, client.layout.root, 2, 2)
        service.start()
        try:
            _latencies(client, 20)  # warm up
            p50 = _latencies(client, 150 if not bench.config.quick else 60)
        finally:
            service.stop()
            fleet.stop()
        gc.collect()
        rows[label] = {
            "stored": count,
            "fill_s": fill,
            "janitor_pass_s": pass_s,
            "janitor_passes_during": service.passes,
            "p50_ms_by_worker": p50,
            "rss_kib_before": rss_before,
            "rss_kib_after": rss_kib(),
            "stored_after": client.stats()["queues"][QUEUE]["results"],
        }
        log(
            f"  {count} stored results: janitor pass {pass_s * 1000:.1f} ms, p50 by worker "
            f"{ {w: round(v, 2) for w, v in p50.items()} }, RSS {rss_before} -> {rss_kib()} KiB"
        )
    janitor = Janitor(bench.zk, Layout(root))  # the default bound: 100,000 results
    start = time.perf_counter()
    report = janitor.run_pass()
    rows["eviction_pass"] = {
        "seconds": time.perf_counter() - start,
        "removed": report.results_removed,
        "stored_after": report.results_stored.get(QUEUE),
    }
    empty, stored = rows["empty"], rows["stored"]
    rows["pass_ratio"] = stored["janitor_pass_s"] / max(empty["janitor_pass_s"], 1e-9)
    rows["p50_ratio"] = max(
        stored["p50_ms_by_worker"][w] / empty["p50_ms_by_worker"][w]
        for w in stored["p50_ms_by_worker"]
        if w in empty["p50_ms_by_worker"]
    )
    rows["zkcli"] = zkcli_lists(bench.hosts, parents(bench, Layout(root)))
    return rows


# -- attached --------------------------------------------------------------------------------


def _wchc(bench: Bench, session: int) -> int:
    """Watches the server holds for one session (``wchc``: data watches, by session)."""
    text = four_letter(bench.cluster.servers[0].client_port, "wchc")
    key = f"0x{session:x}"
    count, inside = 0, False
    for line in text.splitlines():
        if line.startswith("0x"):
            inside = line.strip() == key
        elif inside and line.strip():
            count += 1
    return count


def _attached(bench: Bench, n: int, log: Log) -> dict[str, Any]:
    root = bench.fresh_root("attached")
    fleet = _Fleet(bench.hosts, root, 2, 4)
    client = Client(bench.hosts, root).start()
    try:
        client.submit("warm", queue=QUEUE).result(timeout=30)
        gc.collect()
        rss0 = rss_kib()
        start = time.perf_counter()
        marks = []
        for i in range(n):
            client.submit(f"attached {i}", queue=QUEUE).result(timeout=30)
            if (i + 1) % max(1, n // 10) == 0:
                gc.collect()
                marks.append(rss_kib() - rss0)
        elapsed = time.perf_counter() - start
        gc.collect()
        watches = _wchc(bench, client.zk.client_id[0])
        row = {
            "jobs": n,
            "seconds": elapsed,
            "watches_at_end": watches,
            "kazoo_watchers": sum(len(v) for v in client.zk._data_watchers.values())
            + sum(len(v) for v in client.zk._child_watchers.values()),
            "rss_growth_kib": rss_kib() - rss0,
            "rss_growth_marks_kib": marks,
            "results_left": client.stats()["queues"][QUEUE]["results"],
        }
    finally:
        client.close()
        fleet.stop()
    log(
        f"  {n} attached jobs through one Client in {row['seconds']:.0f} s: "
        f"{row['watches_at_end']} watches at the end, RSS +{row['rss_growth_kib']} KiB, "
        f"{row['results_left']} results left"
    )
    return row


# -- idle ------------------------------------------------------------------------------------


def _idle(bench: Bench, n: int, seconds: float, log: Log) -> dict[str, Any]:
    root = bench.fresh_root("idle")
    fleet = _Fleet(bench.hosts, root, n, 2, heartbeat_interval=2.0)
    try:
        time.sleep(3.0)  # every worker registered, in line, past its first heartbeat
        before = zxid(bench)
        time.sleep(seconds)
        writes = zxid(bench) - before
    finally:
        fleet.stop()
    row = {"workers": n, "seconds": seconds, "writes": writes, "writes_per_s": writes / seconds}
    log(
        f"  {n} idle workers: {writes} ZooKeeper writes in {seconds:.0f} s "
        f"({row['writes_per_s']:.2f}/s)"
    )
    return row


def dump(row: dict[str, Any]) -> str:
    return json.dumps(row, indent=1, default=str)
