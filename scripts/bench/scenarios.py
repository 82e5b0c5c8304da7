"""The warm-up, raw ZooKeeper rates and scenarios 2, 4 and 5: latency on an idle system, depth and
producer bulk (the herd and the profiles have their own modules). Each uses a fresh root on the
run's one ZooKeeper."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from scripts.bench import wire
from scripts.bench.core import PROMPT, QUEUE, Bench, median, percentile, wait_until
from zkqueue.protocol.layout import new_job_id
from zkqueue.protocol.spec import build_spec

Log = Callable[[str], None]


# -- warm-up and raw rates ----------------------------------------------------------------------


def run_warmup(bench: Bench, log: Log) -> dict[str, Any]:
    """Warm the JVM's JIT and start the agent processes the run needs, outside every timing."""
    cfg = bench.config
    need = max([1, *cfg.procs, *(cfg.herd_sizes if "herd" in cfg.scenarios else ())])
    start = time.perf_counter()
    bench.agents(need)
    spawn = time.perf_counter() - start
    root = bench.fresh_root("warmup")
    bench.zk.ensure_path(root)
    scale = 1 if cfg.quick else 2
    async_create_rate(bench, root, 2000 * scale)
    sync_create_latencies(bench, root, 150 * scale)
    for _ in range(100 * scale):
        bench.zk.get_children(root + "/x")
    client = bench.client(root)
    jobs = 150 * scale
    client.submit_many([f"warm {i}" for i in range(jobs)], queue=QUEUE, detach=True)
    agent = bench.agents(1)[0]
    agent.call("zkq_start", root=root, queue=QUEUE, slots=4)
    agent.call("go")
    results = client.layout.expiry(QUEUE)
    wait_until(lambda: bench.indexed(results) >= jobs, 30)
    agent.call("stop")
    log(f"  {need} agent processes started in {spawn:.1f} s; JIT warmed")
    return {"agents": need, "spawn_s": spawn, "warm_s": time.perf_counter() - start}


def sync_create_latencies(bench: Bench, root: str, n: int) -> list[float]:
    """Seconds per synchronous sequential create (one at a time), spec-sized data."""
    parent = f"{root}/x"
    bench.zk.ensure_path(parent)
    data = _spec_bytes()
    out = []
    for _ in range(n):
        start = time.perf_counter()
        bench.zk.create(f"{parent}/x-", data, sequence=True)
        out.append(time.perf_counter() - start)
    return out


def async_create_rate(bench: Bench, root: str, n: int, window: int = 512) -> float:
    """Creates per second, pipelined ``window`` at a time like submit_many, paths and data
    prepared beforehand: the raw rate ZooKeeper and kazoo allow."""
    parent = f"{root}/y{time.monotonic_ns()}"
    bench.zk.ensure_path(parent)
    data = _spec_bytes()
    paths = [f"{parent}/{new_job_id()}-" for _ in range(n)]
    start = time.perf_counter()
    for i in range(0, n, window):
        calls = [bench.zk.create_async(p, data, sequence=True) for p in paths[i : i + window]]
        for call in calls:
            call.get()
    return n / (time.perf_counter() - start)


def _spec_bytes() -> bytes:
    return build_spec(PROMPT, None, {}).to_bytes()


def raw_rates(bench: Bench, n_sync: int, n_async: int) -> dict[str, float]:
    root = bench.fresh_root("raw")
    bench.zk.ensure_path(root)
    latencies = sync_create_latencies(bench, root, n_sync)
    return {
        "sync_create_p50_ms": median(latencies) * 1e3,
        "sync_creates_per_s": len(latencies) / sum(latencies),
        "async_creates_per_s": async_create_rate(bench, root, n_async),
    }


# -- 2. latency -------------------------------------------------------------------------------


def run_latency(bench: Bench, log: Log) -> dict[str, Any]:
    """One worker, one job at a time: submit (attached) to result, beside one synchronous
    create, interleaved so both see the same conditions."""
    root = bench.fresh_root("lat")
    client = bench.client(root)
    client.ensure_queue(QUEUE)
    scratch = f"{root}/scratch"
    bench.zk.ensure_path(scratch)
    data = _spec_bytes()
    agent = bench.agents(1)[0]
    agent.call("zkq_start", root=root, queue=QUEUE, slots=1)
    agent.call("go")
    line = client.layout.line(QUEUE)
    wait_until(lambda: bench.child_count(line) == 1, 10)
    creates, jobs, dispatch, run, notify = [], [], [], [], []
    deadline = time.monotonic() + 60
    for _ in range(bench.config.latency_samples):
        if time.monotonic() > deadline:
            break
        start = time.perf_counter()
        bench.zk.create(f"{scratch}/x-", data, sequence=True)
        creates.append(time.perf_counter() - start)
        start, wall = time.perf_counter(), time.time()
        record = client.submit(PROMPT, queue=QUEUE).result(timeout=10)
        jobs.append(time.perf_counter() - start)
        end = time.time()
        dispatch.append((record.started_at or 0) - (record.submitted_at or wall))
        run.append((record.finished_at or 0) - (record.started_at or 0))
        notify.append(end - (record.finished_at or end))
        wait_until(lambda: bench.child_count(line) == 1, 5, 0.001)
    agent.call("stop")
    out: dict[str, Any] = {
        "samples": len(jobs),
        "create_p50_ms": median(creates) * 1e3,
        "create_p99_ms": percentile(creates, 99) * 1e3,
        "job_p50_ms": median(jobs) * 1e3,
        "job_p99_ms": percentile(jobs, 99) * 1e3,
        "submit_to_claim_p50_ms": median(dispatch) * 1e3,
        "claim_to_completed_p50_ms": median(run) * 1e3,
        "completed_to_caller_p50_ms": median(notify) * 1e3,
        "jobs_ms": [j * 1e3 for j in jobs],
        "creates_ms": [c * 1e3 for c in creates],
    }
    out["ratio_p50"] = out["job_p50_ms"] / out["create_p50_ms"]
    log(
        f"  job p50 {out['job_p50_ms']:.2f} ms p99 {out['job_p99_ms']:.2f} ms; create p50 "
        f"{out['create_p50_ms']:.2f} ms; ratio {out['ratio_p50']:.1f}x"
    )
    return out


# -- 4. depth ---------------------------------------------------------------------------------


def run_depth(bench: Bench, log: Log) -> dict[str, Any]:
    rows = []
    for depth in bench.config.depths:
        rows.append(_depth_once(bench, depth))
        r = rows[-1]
        log(
            f"  depth {depth:>6}: enqueue p50 {r['enqueue_p50_ms']:.2f} ms, claim turn mean "
            f"{r['claim_turn_ms']:.2f} ms, per-job cycle {r['cycle_ms']:.2f} ms, relist "
            f"{r['list_ms']:.2f} ms"
        )
    return {"rows": rows}


def _depth_once(bench: Bench, depth: int) -> dict[str, Any]:
    cfg = bench.config
    root = bench.fresh_root(f"depth{depth}")
    client = bench.client(root)
    client.ensure_queue(QUEUE)
    start = time.perf_counter()
    client.submit_many(
        [f"depth job {i}" for i in range(depth + cfg.depth_claims)], queue=QUEUE, detach=True
    )
    fill_s = time.perf_counter() - start
    # One bucket's listing: what the head lists at most per refresh, whatever the depth.
    pending = client.layout.bucket(QUEUE, "normal", 0)
    lists = []
    for _ in range(5):
        start = time.perf_counter()
        bench.zk.get_children(pending)
        lists.append(time.perf_counter() - start)
    enqueues = []
    for i in range(cfg.depth_enqueues):
        start = time.perf_counter()
        client.submit(f"late job {i}", queue=QUEUE, detach=True)
        enqueues.append(time.perf_counter() - start)
    agent = bench.agents(1)[0]
    agent.call("zkq_start", root=root, queue=QUEUE, slots=1)
    before = agent.call("stats")
    results = client.layout.expiry(QUEUE)
    start = time.perf_counter()
    agent.call("go")
    finished = wait_until(lambda: bench.indexed(results) >= cfg.depth_claims, 120)
    elapsed = time.perf_counter() - start
    after = agent.call("stats")
    agent.call("stop")
    done = bench.indexed(results) if not finished else cfg.depth_claims
    traffic = wire.delta(after["wire"], before["wire"])
    reads, writes = wire.split_requests(traffic["requests"])
    timers = after.get("timers", {})
    return {
        "depth": depth,
        "fill_s": fill_s,
        "completed": finished,
        "claims": done,
        "list_ms": median(lists) * 1e3,
        "enqueue_p50_ms": median(enqueues) * 1e3,
        "enqueue_p99_ms": percentile(enqueues, 99) * 1e3,
        "cycle_ms": elapsed / max(1, done) * 1e3,
        "claim_turn_ms": _mean_ms(timers.get("head_turn")),
        "refresh_ms": _mean_ms(timers.get("view_refresh")),
        "pick_ms": _mean_ms(timers.get("pick")),
        "complete_ms": _mean_ms(timers.get("complete_multi")),
        "reads_per_job": reads / max(1, done),
        "writes_per_job": writes / max(1, done),
        "worker_cpu_ms_per_job": (after["cpu"]["total"] - before["cpu"]["total"])
        / max(1, done)
        * 1e3,
        "timers": timers,
    }


def _mean_ms(timer: dict[str, float] | None) -> float:
    if not timer or not timer.get("count"):
        return float("nan")
    return timer["total_s"] / timer["count"] * 1e3


# -- 5. producer bulk -------------------------------------------------------------------------


def run_bulk(bench: Bench, log: Log) -> dict[str, Any]:
    """submit_many of N detached jobs against the raw pipelined create rate, alternating."""
    n = bench.config.bulk_jobs
    raw, zkq = [], []
    for rep in range(bench.config.reps):
        order = ("raw", "zkq") if rep % 2 == 0 else ("zkq", "raw")
        for kind in order:
            if kind == "raw":
                root = bench.fresh_root("bulkraw")
                raw.append(async_create_rate(bench, root, n))
            else:
                zkq.append(_submit_many_rate(bench, n))
        log(f"  rep {rep}: raw {raw[-1]:.0f} creates/s, submit_many {zkq[-1]:.0f} jobs/s")
    out: dict[str, Any] = {
        "jobs": n,
        "raw_per_s": raw,
        "submit_many_per_s": zkq,
        "raw_median": median(raw),
        "submit_many_median": median(zkq),
    }
    out["ratio"] = out["submit_many_median"] / out["raw_median"]
    return out


def _submit_many_rate(bench: Bench, n: int, profile: bool = False) -> float:
    root = bench.fresh_root("bulk")
    client = bench.client(root)
    client.ensure_queue(QUEUE)
    specs = [f"bulk job {i}" for i in range(n)]
    start = time.perf_counter()
    client.submit_many(specs, queue=QUEUE, detach=True)
    return n / (time.perf_counter() - start)
