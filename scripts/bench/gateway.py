"""Benchmark of ``zkq serve``: many streams held by one gateway process, and its latency.

    .venv/bin/python -m scripts.bench.gateway [--streams N] [--hold S] [--rounds R] [--samples N]

1. Hold: ``--streams`` concurrent streaming completions (httpx, one connection each) against
   one gateway process and an echo worker that takes ``--hold`` seconds, so they are all open at
   once. The gateway's thread count and RSS are read from /proc/PID/status every 0.2 s. A stream
   counts as ok when it ends with ``[DONE]`` and its text is the job's output (the echo runner
   answers with the prompt, a word at a time, each word a chunk straight from the worker).
2. Latency: the same echo job (no delay) submitted and awaited ``--samples`` times over HTTP
   (non-streaming, one keep-alive connection) and as many times with the blocking Python API,
   in alternating blocks, sequentially; the p50 of each and their ratio.

ZooKeeper, the workers and the gateway each run in their own process on this host.
"""

from __future__ import annotations

import argparse
import asyncio
import http.client
import json
import os
import resource
import signal
import statistics
import subprocess
import sys
import threading
import time
from pathlib import Path
from typing import Any

import httpx

from scripts.bench.core import stop_processes, wait_up
from zkqueue import Client
from zkqueue.testing import ZkCluster, free_port

ROOT = Path(__file__).resolve().parents[2]
BENCH_ROOT = "/bench-gateway"


def run_worker(hosts: str, queue: str, delay: float, slots: int) -> None:
    """The worker process (``--as-worker``): an echo worker until SIGTERM."""
    from workers.loop import Worker
    from workers.options import WorkerOptions
    from workers.runners.echo import EchoRunner
    from zkqueue.plumbing.connection import ConnectionSettings

    zk = ConnectionSettings(hosts=hosts, session_timeout=10).make_client()
    zk.start(10)
    opts = WorkerOptions(root=BENCH_ROOT, queue=queue, max_concurrency=slots)
    worker = Worker(zk, EchoRunner(delay=delay), opts)
    signal.signal(signal.SIGTERM, lambda *_: worker.stop(drain=False))
    worker.run()


def spawn(*args: str) -> subprocess.Popen[bytes]:
    env = {**os.environ, "PYTHONPATH": str(ROOT)}
    return subprocess.Popen([sys.executable, *args], env=env, stdout=subprocess.DEVNULL)


def proc_status(pid: int) -> tuple[int, int]:
    """(threads, RSS in KiB) of a process."""
    fields = dict(
        line.split(":", 1) for line in Path(f"/proc/{pid}/status").read_text().splitlines()
    )
    return int(fields["Threads"]), int(fields["VmRSS"].split()[0])


class Sampler(threading.Thread):
    """Reads a process's threads and RSS every 0.2 s until stopped."""

    def __init__(self, pid: int) -> None:
        super().__init__(daemon=True)
        self.pid = pid
        self.samples: list[tuple[float, int, int]] = []
        self.halt = threading.Event()

    def run(self) -> None:
        start = time.monotonic()
        while not self.halt.wait(0.2):
            self.samples.append((time.monotonic() - start, *proc_status(self.pid)))


async def hold(url: str, streams: int) -> dict[str, Any]:
    """Open every stream at once; count those that ended with [DONE] and whose text is the
    job's output (the echo runner's output is the prompt), and the chunks each came in."""
    limits = httpx.Limits(max_connections=streams + 8, max_keepalive_connections=streams + 8)
    async with httpx.AsyncClient(limits=limits, timeout=300) as http:

        async def one(i: int) -> tuple[int, bool, float, bool, int]:
            prompt = f"held request number {i}"
            body = {"model": "slow", "prompt": prompt, "stream": True}
            started = time.monotonic()
            async with http.stream("POST", f"{url}/v1/completions", json=body) as response:
                lines = [line async for line in response.aiter_lines()]
            done = lines[-2:] == ["data: [DONE]", ""]
            chunks = [json.loads(line[6:]) for line in lines if line.startswith("data: {")]
            pieces = [c["choices"][0]["text"] for c in chunks if c.get("choices")]
            texts = [p for p in pieces if p]
            same = "".join(texts) == prompt
            return response.status_code, done, time.monotonic() - started, same, len(texts)

        results = await asyncio.gather(*(one(i) for i in range(streams)))
    return {
        "ok": sum(1 for code, done, _, same, _ in results if code == 200 and done and same),
        "text_equal": sum(1 for r in results if r[3]),
        "chunks_p50": statistics.median(r[4] for r in results),
        "seconds_p50": statistics.median(r[2] for r in results),
    }


def latency(url: str, client: Client, samples: int) -> dict[str, float]:
    """Sequential submit-to-result over HTTP and over the Python API, in alternating blocks.
    The HTTP side uses the standard library's client on one keep-alive connection, so the
    figure is the gateway's path rather than a client library's own overhead."""
    http_times: list[float] = []
    api_times: list[float] = []
    host, port = url.removeprefix("http://").split(":")
    body = json.dumps({"model": "fast", "prompt": "echo this back", "max_tokens": 8})
    headers = {"Content-Type": "application/json"}
    conn = http.client.HTTPConnection(host, int(port), timeout=30)

    def over_http() -> None:
        conn.request("POST", "/v1/completions", body, headers)
        response = conn.getresponse()
        assert response.status == 200, response.read()
        json.loads(response.read())

    def over_api() -> None:
        assert client.submit("echo this back", queue="fast", max_new_tokens=8).result(30).ok

    for _ in range(10):  # warm up both paths
        over_http()
        over_api()
    for _ in range(4):
        for call, times in ((over_http, http_times), (over_api, api_times)):
            for _ in range(samples // 4):
                t = time.perf_counter()
                call()
                times.append(time.perf_counter() - t)
    conn.close()
    http_p50, api_p50 = statistics.median(http_times), statistics.median(api_times)
    return {
        "http_p50_ms": round(http_p50 * 1000, 2),
        "api_p50_ms": round(api_p50 * 1000, 2),
        "ratio": round(http_p50 / api_p50, 2),
        "http_p90_ms": round(statistics.quantiles(http_times, n=10)[-1] * 1000, 2),
        "api_p90_ms": round(statistics.quantiles(api_times, n=10)[-1] * 1000, 2),
    }


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--streams", type=int, default=1000)
    parser.add_argument("--hold", type=float, default=8.0, help="seconds each held job takes")
    parser.add_argument("--samples", type=int, default=200)
    parser.add_argument("--rounds", type=int, default=2, help="hold phases, one after another")
    parser.add_argument("--as-worker", nargs=4, metavar=("HOSTS", "QUEUE", "DELAY", "SLOTS"))
    args = parser.parse_args()
    if args.as_worker:
        hosts, queue, delay, slots = args.as_worker
        return run_worker(hosts, queue, float(delay), int(slots))
    # Each process holds one socket per stream: lift the soft limit (children inherit it).
    _, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
    cluster = ZkCluster(1).start()
    procs: list[subprocess.Popen[bytes]] = []
    try:
        me = ["-m", "scripts.bench.gateway", "--as-worker", cluster.hosts]
        procs.append(spawn(*me, "slow", str(args.hold), "1000"))
        procs.append(spawn(*me, "fast", "0", "4"))
        port = free_port()
        gateway = spawn(
            "-m",
            "gateway",
            "--zk",
            cluster.hosts,
            "--root",
            BENCH_ROOT,
            "--port",
            str(port),
            "--log-level",
            "WARNING",
        )
        procs.append(gateway)
        url = f"http://127.0.0.1:{port}"
        wait_up(url)
        with Client(cluster.hosts, BENCH_ROOT) as client:
            while len({w["queue"] for w in client.workers()}) < 2:
                time.sleep(0.1)
            figures = measure(url, client, gateway.pid, args)
        print(json.dumps(figures, indent=2))
    finally:
        stop_processes(procs, 15)
        cluster.stop()


def measure(url: str, client: Client, pid: int, args: argparse.Namespace) -> dict[str, Any]:
    idle_threads, idle_rss = proc_status(pid)
    rounds = []
    for _ in range(args.rounds):  # a second round shows the memory stays bounded
        sampler = Sampler(pid)
        sampler.start()
        started = time.monotonic()
        held = asyncio.run(hold(url, args.streams))
        sampler.halt.set()
        sampler.join()
        rounds.append(
            {
                "streams_ok": held["ok"],
                "text_equal_to_output": held["text_equal"],
                "chunks_per_stream_p50": held["chunks_p50"],
                "stream_seconds_p50": round(held["seconds_p50"], 2),
                "seconds": round(time.monotonic() - started, 1),
                "threads_max": max(s[1] for s in sampler.samples),
                "rss_max_mib": round(max(s[2] for s in sampler.samples) / 1024, 1),
            }
        )
    after_threads, after_rss = proc_status(pid)
    return {
        "streams": args.streams,
        "hold_seconds": args.hold,
        "gateway_idle": {"threads": idle_threads, "rss_mib": round(idle_rss / 1024, 1)},
        "rounds": rounds,
        "gateway_after": {"threads": after_threads, "rss_mib": round(after_rss / 1024, 1)},
        "latency": latency(url, client, args.samples),
    }


if __name__ == "__main__":
    main()
