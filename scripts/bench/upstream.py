"""The openai runner against the server it fronts: the same requests sent straight to
``transformers serve --continuous-batching`` and through zkq (``zkq worker --upstream``), same run.

    .venv/bin/python -m scripts.bench.upstream [--jobs 64] [--concurrency 16] [--reps 3]
        [--ttft-jobs 20] [--json FILE]

On the tiny model (CPU), one server, one ZooKeeper, one worker process with ``--max-concurrency
--concurrency``; direct requests are streamed by one asyncio client (httpx) with at most
``--concurrency`` in flight, each with the body the worker would send (``request_for``).

1. Throughput: ``--jobs`` greedy jobs of mixed prompt (4-200 words) and output (16-160 tokens)
   lengths, the direct and the zkq passes taking turns ``--reps`` times (which goes first
   alternates). A pass's tokens/s is its
   completion tokens over the wall time from its first send to its last answer (through zkq:
   from the submit to the last ``finished_at``). Also the CPU seconds the server, the worker and
   ZooKeeper spent per job in each pass, and the ZooKeeper requests per job.
2. Time to first token at concurrency 1: ``--ttft-jobs`` short greedy jobs one at a time, direct
   (from the request's send to its first content chunk) and through zkq: from the claim (the
   result's ``started_at``) to the first token the worker received, and from the submit.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import random
import statistics
import subprocess
import sys
import time
from typing import Any

import httpx

from scripts.bench.core import (
    ZKQ_CLI,
    CpuMeter,
    child_env,
    report,
    stop_processes,
    tiny_model_served,
)
from workers.runners.upstream import request_for
from workers.testing import InferenceServer
from zkqueue import Client
from zkqueue.protocol.spec import JobSpec
from zkqueue.testing import four_letter

BENCH_ROOT = "/bench-upstream"
_TEXT = (
    "a priority queue hands the most urgent job to the next free worker high comes before "
    "normal and inside one priority the first job submitted is the first job served zookeeper "
    "keeps the shared state pending entries claims results and the line of idle workers"
)
WORDS = _TEXT.split()


def mixed_jobs(count: int, seed: int = 7) -> list[tuple[str, int]]:
    """(prompt, max_new_tokens) pairs of mixed lengths, the same for every pass."""
    rng = random.Random(seed)
    jobs = []
    for _ in range(count):
        words = rng.randint(4, 200)
        prompt = " ".join(rng.choice(WORDS) for _ in range(words))
        jobs.append((prompt, rng.randint(16, 160)))
    return jobs


async def _direct(
    server: InferenceServer, jobs: list[tuple[str, int]], concurrency: int
) -> list[dict[str, Any]]:
    """Every job streamed straight to the server, ``concurrency`` in flight; per job its
    completion tokens, its time to first content and when it ended."""
    gate = asyncio.Semaphore(concurrency)
    limits = httpx.Limits(max_connections=concurrency, max_keepalive_connections=concurrency)
    async with httpx.AsyncClient(timeout=600, limits=limits) as http:

        async def one(prompt: str, new: int) -> dict[str, Any]:
            async with gate:
                _, body = request_for(JobSpec(prompt, max_new_tokens=new), server.model_dir)
                sent = time.monotonic()
                first = None
                tokens = 0
                async with http.stream("POST", server.url + "/completions", json=body) as reply:
                    async for line in reply.aiter_lines():
                        if not line.startswith("data:") or line[5:].strip() == "[DONE]":
                            continue
                        event = json.loads(line[5:])
                        if first is None and any(c.get("text") for c in event["choices"]):
                            first = time.monotonic() - sent
                        if event.get("usage"):
                            tokens = event["usage"]["completion_tokens"]
                return {"tokens": tokens, "ttft_s": first, "ended": time.monotonic()}

        return await asyncio.gather(*(one(p, n) for p, n in jobs))


def direct_pass(
    server: InferenceServer, jobs: list[tuple[str, int]], concurrency: int, cpu: Any
) -> dict[str, Any]:
    before = cpu()
    start = time.monotonic()
    answers = asyncio.run(_direct(server, jobs, concurrency))
    wall = max(a["ended"] for a in answers) - start
    tokens = sum(a["tokens"] for a in answers)
    return {"tokens": tokens, "wall_s": wall, "tok_s": tokens / wall, "cpu": cpu.since(before)}


def zkq_pass(
    client: Client, queue: str, jobs: list[tuple[str, int]], cpu: Any, hosts: str
) -> dict[str, Any]:
    before = cpu()
    requests_before = _zk_requests(hosts)
    start = time.time()
    handles = client.submit_many([{"prompt": p, "max_new_tokens": n} for p, n in jobs], queue=queue)
    records = [h.result(timeout=900) for h in handles]
    wall = max(float(r.finished_at or 0) for r in records) - start
    failed = [r.error for r in records if not r.ok]
    tokens = sum(int(r.extra.get("output_tokens") or 0) for r in records)
    return {
        "tokens": tokens,
        "wall_s": wall,
        "tok_s": tokens / wall,
        "failed": failed,
        "cpu": cpu.since(before),
        "zk_requests_per_job": (_zk_requests(hosts) - requests_before) / len(jobs),
    }


def ttft_direct(server: InferenceServer, count: int) -> list[float]:
    times = []
    for i in range(count):
        answers = asyncio.run(_direct(server, [(f"The quick brown fox {i}", 16)], 1))
        times.append(float(answers[0]["ttft_s"]))
    return times


def ttft_zkq(client: Client, queue: str, count: int) -> dict[str, list[float]]:
    from_claim, from_submit = [], []
    for i in range(count):
        record = client.submit(f"The quick brown fox {i}", queue=queue, max_new_tokens=16).result(
            timeout=60
        )
        first = float(record.extra["first_token_at"])
        from_claim.append(first - float(record.started_at or 0))
        from_submit.append(first - float(record.submitted_at or 0))
    return {"from_claim": from_claim, "from_submit": from_submit}


def _zk_requests(hosts: str) -> int:
    port = int(hosts.split(",")[0].rsplit(":", 1)[1])
    for line in four_letter(port, "mntr").splitlines():
        if line.startswith("zk_packets_received"):
            return int(line.split()[1])
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.upstream")
    parser.add_argument("--jobs", type=int, default=64)
    parser.add_argument("--concurrency", type=int, default=16)
    parser.add_argument("--reps", type=int, default=3)
    parser.add_argument("--ttft-jobs", type=int, default=20)
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    jobs = mixed_jobs(args.jobs)
    out: dict[str, Any] = {"args": vars(args), "direct": [], "zkq": []}
    with tiny_model_served("zkq-bench-upstream-") as (tmp, server, cluster):
        queue = "upstream"
        log = open(tmp / "worker.log", "w")  # noqa: SIM115 (closed below)
        command = [*ZKQ_CLI, "--zk", cluster.hosts, "--root", BENCH_ROOT, "worker"]
        command += ["--queue", queue]
        command += ["--upstream", server.url, "--max-concurrency", str(args.concurrency)]
        worker = subprocess.Popen(
            [*command, "--no-janitor"],
            env=child_env(),
            stdout=log,
            stderr=subprocess.STDOUT,
        )
        try:
            assert server.proc is not None and cluster.servers[0].process is not None
            cpu = CpuMeter(
                {
                    "server": server.proc.pid,
                    "worker": worker.pid,
                    "zookeeper": cluster.servers[0].process.pid,
                }
            )
            with Client(cluster.hosts, root=BENCH_ROOT) as client:
                _wait_worker(client, queue)
                zkq_pass(client, queue, jobs[:4], cpu, cluster.hosts)  # warm both paths
                direct_pass(server, jobs[:4], args.concurrency, cpu)
                for rep in range(args.reps):
                    # The order alternates, so a drift of the host's load favours neither side.
                    if rep % 2:
                        z = zkq_pass(client, queue, jobs, cpu, cluster.hosts)
                        d = direct_pass(server, jobs, args.concurrency, cpu)
                    else:
                        d = direct_pass(server, jobs, args.concurrency, cpu)
                        z = zkq_pass(client, queue, jobs, cpu, cluster.hosts)
                    out["direct"].append(d)
                    out["zkq"].append(z)
                    print(
                        f"rep {rep}: direct {d['tok_s']:.0f} tok/s, zkq {z['tok_s']:.0f} tok/s "
                        f"(x{z['tok_s'] / d['tok_s']:.3f}); cpu direct {d['cpu']} zkq {z['cpu']}",
                        flush=True,
                    )
                out["ttft_direct"] = ttft_direct(server, args.ttft_jobs)
                out["ttft_zkq"] = ttft_zkq(client, queue, args.ttft_jobs)
        finally:
            stop_processes([worker], 30)
            log.close()
    report(out, summarize(out), args.json)
    return 0


def _wait_worker(client: Client, queue: str, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        for w in client.workers():
            if w.get("queue") == queue and (w.get("engine") or {}).get("gate") == "open":
                return
        time.sleep(0.2)
    raise TimeoutError(f"no worker of {queue} with an open gate in {timeout:.0f}s")


def summarize(out: dict[str, Any]) -> list[str]:
    ratios = [z["tok_s"] / d["tok_s"] for d, z in zip(out["direct"], out["zkq"], strict=True)]
    direct = statistics.median(d["tok_s"] for d in out["direct"])
    through = statistics.median(z["tok_s"] for z in out["zkq"])
    lines = [
        f"throughput: direct {direct:.0f} tok/s, through zkq {through:.0f} tok/s, ratio median "
        f"x{statistics.median(ratios):.3f} (runs: {', '.join(f'{r:.3f}' for r in ratios)})",
    ]
    jobs = out["args"]["jobs"]
    for side in ("direct", "zkq"):
        passes = out[side]
        cpu = {k: statistics.median(p["cpu"][k] for p in passes) / jobs for k in passes[0]["cpu"]}
        parts = ", ".join(f"{k} {v * 1000:.1f} ms" for k, v in cpu.items())
        lines.append(f"cpu per job, {side}: {parts}")
    zk = statistics.median(z["zk_requests_per_job"] for z in out["zkq"])
    lines.append(f"zookeeper requests per job: {zk:.1f}")
    if "ttft_direct" in out:
        d50 = statistics.median(out["ttft_direct"]) * 1000
        c50 = statistics.median(out["ttft_zkq"]["from_claim"]) * 1000
        s50 = statistics.median(out["ttft_zkq"]["from_submit"]) * 1000
        lines.append(
            f"ttft at concurrency 1, p50: direct {d50:.1f} ms; through zkq from the claim "
            f"{c50:.1f} ms (+{c50 - d50:.1f} ms), from the submit {s50:.1f} ms"
        )
    return lines


if __name__ == "__main__":
    sys.exit(main())
