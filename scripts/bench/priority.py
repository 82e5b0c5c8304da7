"""Priority under load: how fast a high job finishes on a busy fleet of model workers, against the
same jobs on an idle one.

    .venv/bin/python -m scripts.bench.priority [--workers 1 4] [--lows 300] [--highs 5]
        [--configs default no-preempt] [--reps N] [--json FILE] [--upstream]

For each worker count and each configuration, fresh ``zkq worker --model`` processes serve a
fresh queue, on the tiny model (CPU), each with the flags the configuration names:

1. Idle: ``--highs`` high jobs (about 100 prompt tokens, 256 new, end of sequence ignored) sent
   at once; their latency is the result's ``finished_at - submitted_at``.
2. Load: ``--lows`` low jobs of the same shape queued first, then, ``--after`` seconds later,
   the same high jobs; their latency, and the place each one finished among every job that ended
   meanwhile. The low jobs left are then cancelled.

The figure is the ratio of the loaded p50 to the idle p50 (the target: at most 2x), both from
the same run of a configuration; with ``--reps N`` every configuration runs N times, the
configurations taking turns within each repetition, and the summary gives the median ratio and
each repetition's. ZooKeeper, the workers and this harness share the host's cores.

With ``--upstream`` each worker is the openai runner in front of its own ``transformers serve
--continuous-batching`` on the tiny model (``zkq worker --upstream URL``), not an in-process
engine; that server takes no ``ignore_eos``, so the jobs end at the model's end of sequence or
at ``max_new_tokens`` (the random model rarely stops early).
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path
from typing import Any

from scripts.bench.core import stop_processes
from workers.testing import InferenceServer
from zkqueue import Client
from zkqueue.errors import JobTimeout
from zkqueue.protocol.result import Result
from zkqueue.testing import ZkCluster

ROOT = Path(__file__).resolve().parents[2]
BENCH_ROOT = "/bench-priority"
#: The flags each configuration adds to ``zkq worker`` (the defaults are the new admission and
#: preemption; "wide" keeps the knee's width while a high job runs, as workers did before
#: ``--high-width``; "before" is what a worker did before the knee and preemption: up to 256
#: jobs in flight, no preemption).
CONFIGS = {
    "default": [],
    "wide": ["--high-width", "off"],
    "no-preempt": ["--no-preempt"],
    "before": ["--no-preempt", "--max-concurrency", "256"],
}
#: ~100 tokens of the tiny model's tokenizer (its own corpus, so words are whole tokens).
PROMPT = (
    "A priority queue hands the most urgent job to the next free worker. High comes before "
    "normal, normal before low, and inside one priority the first job submitted is the first "
    "job served. ZooKeeper keeps the shared state: pending entries, claims, results and the "
    "line of idle workers. Each worker watches only its predecessor in the line, so a new job "
    "wakes one session, not all. A GPU worker loads the model weights once and keeps them "
    "resident in device memory."
)


def spawn_worker(hosts: str, queue: str, engine: list[str], flags: list[str], log: Path) -> Any:
    """``engine``: ``["--model", DIR]`` or ``["--upstream", URL]``."""
    cmd = [sys.executable, "-m", "zkqueue.cli", "--zk", hosts, "--root", BENCH_ROOT]
    cmd += ["worker", "--queue", queue, *engine, "--no-janitor", *flags]
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    out = open(log, "a")  # noqa: SIM115 (closed with the process)
    return subprocess.Popen(cmd, env=env, stdout=out, stderr=subprocess.STDOUT)


def wait_ready(client: Client, queue: str, count: int, timeout: float = 300.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        ready = [
            w for w in client.workers() if w.get("queue") == queue and w.get("state") == "running"
        ]
        if len(ready) >= count:
            return
        time.sleep(0.2)
    raise TimeoutError(f"{count} worker(s) of {queue} not ready in {timeout:.0f}s")


#: Whether jobs ask to ignore the end of sequence (not with --upstream: see the docstring).
IGNORE_EOS = [True]


def job_spec(prompt: str, new_tokens: int) -> dict[str, Any]:
    spec: dict[str, Any] = {"prompt": prompt, "max_new_tokens": new_tokens}
    if IGNORE_EOS[0]:
        spec["ignore_eos"] = True
    return spec


def latencies(records: list[Result]) -> list[float]:
    return [float(r.finished_at or 0) - float(r.submitted_at or 0) for r in records]


def phase_idle(client: Client, queue: str, prompt: str, highs: int, new: int) -> dict[str, Any]:
    jobs = client.submit_many(
        [job_spec(f"{prompt} {i}", new) for i in range(highs)], priority="high", queue=queue
    )
    records = [job.result(timeout=600) for job in jobs]
    times = latencies(records)
    return {
        "p50_s": statistics.median(times),
        "max_s": max(times),
        "prompt_tokens": records[0].get("prompt_tokens"),
        "ok": sum(r.ok for r in records),
    }


def phase_load(
    client: Client, queue: str, prompt: str, lows: int, highs: int, new: int, after: float
) -> dict[str, Any]:
    began = time.time()
    low_jobs = client.submit_many(
        [job_spec(f"{prompt} {i}", new) for i in range(lows)], priority="low", queue=queue
    )
    time.sleep(after)
    sent = time.time()
    high_jobs = client.submit_many(
        [job_spec(f"{prompt} {i}", new) for i in range(highs)], priority="high", queue=queue
    )
    records = [job.result(timeout=900) for job in high_jobs]
    done_by = max(float(r.finished_at or 0) for r in records)
    ended = []
    for job in low_jobs:
        if job.status() in ("pending", "running"):
            job.cancel()
            continue
        try:  # ended, or between states (given back, claimed again): neither pending nor running
            ended.append(float(job.result(timeout=5).finished_at or 0))
        except JobTimeout:
            job.cancel()
    finished = sorted([*ended, *(float(r.finished_at or 0) for r in records)])
    places = sorted(finished.index(float(r.finished_at or 0)) + 1 for r in records)
    times = latencies(records)
    preempted = sum(1 for t in ended if t > sent)  # low jobs that ended after the highs came
    return {
        "p50_s": statistics.median(times),
        "max_s": max(times),
        "places": places,
        "lows_ended": len(ended),
        "lows_ended_after_highs_sent": preempted,
        # Low jobs finished a second until the last high one ended (the cost of narrowing).
        "lows_per_s": sum(1 for t in ended if t <= done_by) / (done_by - began),
        "highs_done_after_s": done_by - sent,
        "ok": sum(r.ok for r in records),
    }


def run_config(
    hosts: str, model: str, workers: int, name: str, args: argparse.Namespace, logs: Path
) -> dict[str, Any]:
    queue = f"prio-{name}-{workers}-{int(time.time())}"
    servers = []
    if args.upstream:
        servers = [InferenceServer(model, logs / f"{queue}-serve-{i}.log") for i in range(workers)]
        for server in servers:
            server.start()
    engines = [["--upstream", s.url] for s in servers] or [["--model", model]] * workers
    procs = [
        spawn_worker(hosts, queue, engines[i], CONFIGS[name], logs / f"{queue}-{i}.log")
        for i in range(workers)
    ]
    try:
        with Client(hosts, root=BENCH_ROOT) as client:
            wait_ready(client, queue, workers)
            slots = [w.get("slots_max") for w in client.workers() if w.get("queue") == queue]
            prompt = " ".join(PROMPT.split()[: args.words])
            # A warm-up job per worker slot shape: the first steps of an engine are slower.
            warm = client.submit_many([job_spec(prompt, 8)] * workers, priority="high", queue=queue)
            for job in warm:
                job.result(timeout=300)
            idle = phase_idle(client, queue, prompt, args.highs, args.new_tokens)
            load = phase_load(
                client, queue, prompt, args.lows, args.highs, args.new_tokens, args.after
            )
            info = [w.get("runner_info") for w in client.workers() if w.get("queue") == queue]
    finally:
        stop_processes(procs, 30)
        for server in servers:
            server.stop()
    return {
        "config": name,
        "workers": workers,
        "flags": CONFIGS[name],
        "slots": slots,
        "idle": idle,
        "load": load,
        "ratio": load["p50_s"] / idle["p50_s"],
        "runner_info": info,
    }


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.priority")
    parser.add_argument("--workers", type=int, nargs="+", default=[1, 4])
    parser.add_argument("--configs", nargs="+", default=["default", "no-preempt"])
    parser.add_argument("--lows", type=int, default=300)
    parser.add_argument("--highs", type=int, default=5)
    parser.add_argument("--new-tokens", type=int, default=256)
    parser.add_argument("--words", type=int, default=64, help="prompt words (~100 tokens)")
    parser.add_argument("--after", type=float, default=2.0, help="seconds between lows and highs")
    parser.add_argument("--reps", type=int, default=1, help="runs of each configuration")
    parser.add_argument("--json", default=None, help="write the figures here")
    parser.add_argument(
        "--upstream", action="store_true", help="openai runners, each before a transformers serve"
    )
    args = parser.parse_args(argv)
    IGNORE_EOS[0] = not args.upstream
    runs = []
    with tempfile.TemporaryDirectory(prefix="zkq-bench-prio-") as tmp:
        model = str(Path(tmp) / "tiny")
        subprocess.run(
            [sys.executable, "-m", "zkqueue.cli", "tiny-model", model],
            check=True,
            env={**os.environ, "PYTHONPATH": str(ROOT)},
            stdout=subprocess.DEVNULL,
        )
        cluster = ZkCluster(1).start()
        try:
            for workers in args.workers:
                for rep in range(args.reps):
                    for name in args.configs:
                        run = run_config(cluster.hosts, model, workers, name, args, Path(tmp))
                        run["rep"] = rep
                        runs.append(run)
                        print(
                            f"{workers} worker(s), {name:10s} rep {rep} slots {run['slots']}: "
                            f"idle p50 {run['idle']['p50_s']:.2f}s, loaded p50 "
                            f"{run['load']['p50_s']:.2f}s (x{run['ratio']:.2f}), "
                            f"places {run['load']['places']}",
                            flush=True,
                        )
        finally:
            cluster.stop()
    summary = summarize(runs)
    for line in summary:
        print(line)
    if args.json:
        Path(args.json).write_text(json.dumps({"runs": runs, "summary": summary}, indent=2))
    return 0


def summarize(runs: list[dict[str, Any]]) -> list[str]:
    """Per worker count and configuration: median idle and loaded p50, the median of the
    per-run ratios, and each run's ratio."""
    lines = []
    for key in dict.fromkeys((r["workers"], r["config"]) for r in runs):
        group = [r for r in runs if (r["workers"], r["config"]) == key]
        idle = statistics.median(r["idle"]["p50_s"] for r in group)
        load = statistics.median(r["load"]["p50_s"] for r in group)
        ratios = [r["ratio"] for r in group]
        lows = statistics.median(r["load"].get("lows_per_s", 0.0) for r in group)
        lines.append(
            f"{key[0]} worker(s) {key[1]:10s} runs {len(group)}: idle p50 {idle:.2f}s, loaded "
            f"p50 {load:.2f}s, ratio median x{statistics.median(ratios):.2f} "
            f"(runs: {', '.join(f'{x:.2f}' for x in ratios)}), low jobs/s {lows:.2f}"
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
