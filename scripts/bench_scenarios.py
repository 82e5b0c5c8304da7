"""Scenarios 2-5 and the profile: latency on an idle system, herd, depth, producer bulk, and
pyinstrument profiles of the worker's hot path and the producers. Each uses a fresh root on the
run's one ZooKeeper."""

from __future__ import annotations

import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

import bench_wire
from bench_core import QUEUE, AgentHandle, Bench, call_all, median, percentile, wait_until
from kazoo.recipe.queue import LockingQueue

from zkqueue.client import new_job_id
from zkqueue.spec import build_spec

Log = Callable[[str], None]
_PROMPT = "benchmark job number 0"


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
    results = client.layout.results(QUEUE)
    wait_until(lambda: bench.children(results) >= jobs, 30)
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
    return build_spec(_PROMPT, None, {}).to_bytes()


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
    wait_until(lambda: bench.children(line) == 1, 10)
    creates, jobs, dispatch, run, notify = [], [], [], [], []
    deadline = time.monotonic() + 60
    for _ in range(bench.config.latency_samples):
        if time.monotonic() > deadline:
            break
        start = time.perf_counter()
        bench.zk.create(f"{scratch}/x-", data, sequence=True)
        creates.append(time.perf_counter() - start)
        start, wall = time.perf_counter(), time.time()
        record = client.submit(_PROMPT, queue=QUEUE).result(timeout=10)
        jobs.append(time.perf_counter() - start)
        end = time.time()
        dispatch.append((record.started_at or 0) - (record.submitted_at or wall))
        run.append((record.finished_at or 0) - (record.started_at or 0))
        notify.append(end - (record.finished_at or end))
        wait_until(lambda: bench.children(line) == 1, 5, 0.001)
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


# -- 3. herd ----------------------------------------------------------------------------------


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
    wait_until(lambda: bench.children(line) == size, 30)

    def one_job() -> None:
        client.submit(_PROMPT, queue=QUEUE).result(timeout=10)
        wait_until(lambda: bench.children(line) == size, 10, 0.002)

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
            lambda: bench.children(f"{path}/entries") + bench.children(f"{path}/taken") == 0,
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
    per_job, woken, events = [], [], []
    before = first = call_all(agents, "stats", flush=True)
    for _ in range(bench.config.herd_jobs):
        one_job()
        after = call_all(agents, "stats", flush=True)
        counts = [_watches(a) - _watches(b) for a, b in zip(after, before, strict=True)]
        per_job.append(sum(counts))
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
    pending = client.layout.pending(QUEUE, "normal")
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
    results = client.layout.results(QUEUE)
    start = time.perf_counter()
    agent.call("go")
    finished = wait_until(lambda: bench.children(results) >= cfg.depth_claims, 120)
    elapsed = time.perf_counter() - start
    after = agent.call("stats")
    agent.call("stop")
    done = bench.children(results) if not finished else cfg.depth_claims
    wire = bench_wire.delta(after["wire"], before["wire"])
    reads, writes = bench_wire.split_requests(wire["requests"])
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


# -- profiles ---------------------------------------------------------------------------------


def run_profile(bench: Bench, log: Log) -> dict[str, Any]:
    """pyinstrument on the worker loop thread (1 and 4 processes, pre-filled echo jobs), on
    submit_many and on one-at-a-time submits. Text reports go next to results.json."""
    files = {}
    n = bench.config.dispatch_jobs
    shapes = ((1, 1), (4, 4)) if bench.config.quick else ((1, 1), (4, 1), (4, 4))
    for procs, slots in shapes:
        name = f"profile-worker-{procs}x{slots}.txt"
        text, cpu = _profile_workers(bench, procs, slots, n)
        (bench.out / name).write_text(_relative(cpu + "\n\n" + text))
        files[f"worker_{procs}x{slots}"] = name
    files["submit_many"] = _profile_submit_many(bench, bench.config.bulk_jobs)
    produced = bench.special("producer").call(
        "produce_zkq", root=bench.fresh_root("profsubmit"), queue=QUEUE, n=300, profile=True
    )
    (bench.out / "profile-submit.txt").write_text(_relative(produced["profile"]))
    files["submit"] = "profile-submit.txt"
    log(f"  wrote {', '.join(files.values())}")
    return {"files": files}


def _profile_workers(bench: Bench, procs: int, slots: int, n: int) -> tuple[str, str]:
    root = bench.fresh_root(f"prof{procs}x{slots}")
    client = bench.client(root)
    client.ensure_queue(QUEUE)
    agents = bench.agents(procs)
    call_all(agents, "zkq_start", root=root, queue=QUEUE, slots=slots, profile=True)
    client.submit_many([f"profiled job {i}" for i in range(n)], queue=QUEUE, detach=True)
    before = call_all(agents, "stats")
    call_all(agents, "go")
    results = client.layout.results(QUEUE)
    wait_until(lambda: bench.children(results) >= n, max(30.0, n / 10))
    stopped = call_all(agents, "stop")
    roles: dict[str, float] = {}
    for a, b in zip(stopped, before, strict=True):
        for role, seconds in a["cpu"].items():
            roles[role] = roles.get(role, 0.0) + seconds - b["cpu"].get(role, 0.0)
    cpu = "CPU ms per job by thread, all worker processes: " + ", ".join(
        f"{k} {v / n * 1e3:.2f}" for k, v in sorted(roles.items())
    )
    return stopped[0].get("profile") or "(no profile)", cpu


def _profile_submit_many(bench: Bench, n: int) -> str:
    from pyinstrument import Profiler

    root = bench.fresh_root("profbulk")
    client = bench.client(root)
    client.ensure_queue(QUEUE)
    profiler = Profiler(interval=0.0005, async_mode="disabled")
    profiler.start()
    client.submit_many([f"bulk job {i}" for i in range(n)], queue=QUEUE, detach=True)
    profiler.stop()
    name = "profile-submit-many.txt"
    (bench.out / name).write_text(_relative(profiler.output_text(show_all=False)))
    return name


def _relative(text: str) -> str:
    """Profiles name source files by absolute path: keep them relative to the repository."""
    root = str(Path(__file__).resolve().parents[1]) + "/"
    return text.replace(root, "")
