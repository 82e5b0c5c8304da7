"""Streaming through ``zkq serve`` against the same model behind ``transformers serve
--continuous-batching``, same run, with the official ``openai`` client.

    .venv/bin/python -m scripts.bench.streaming [--reps 6] [--c1 10] [--c16-rounds 2]
        [--max-tokens 64] [--warmup 60]
        [--split-cores [--client-with-engines | --client-apart] | --client-alone]
        [--shared-session] [--sampling] [--device cpu|cuda] [--json FILE]
    .venv/bin/python -m scripts.bench.streaming --pool RUN.json [RUN.json ...]

On the tiny model (CPU): one ``transformers serve`` process (the reference), and one ZooKeeper,
one model worker (``zkq worker --model DIR --max-concurrency 16``, the hf runner: transformers'
continuous batching in process) and one gateway (``zkq serve``) as processes of their own.
Every request is a streamed completion (``/v1/completions``, ``stream_options.include_usage``;
the tiny model has no chat template, which ``transformers serve`` needs for chats) of a short
prompt, ``--max-tokens`` at most, greedy. A request's time to first content runs from the call
to the first chunk with non-empty text; its chunks are the chunks with text. The server sends no
usage while streaming: its tokens per answer are not known, only its chunks.

Each rep runs, on each side (which side goes first alternates):

1. ``--c1`` requests one after another (concurrency 1);
2. ``--c16-rounds`` rounds of 16 requests sent at once (concurrency 16).

Reported: the p50 (concurrency 1) and p99 (concurrency 16, nearest rank:
``scripts.bench.core.percentile``) time to first content of each side,
over all reps; the chunks per answer against its completion tokens; the CPU seconds each
process spent per request; and where the time to first content goes through zkq at concurrency
16: when each job was submitted, claimed, had its first token in the worker, and had its first
text sent by the gateway, from its request's arrival there (the gateway's info line for each
finished job).

Every process of the run has a session of its own, as each service has its own unit (and
cgroup) where it is deployed: Linux groups a busy core's time by session (autogroup) before
sharing it among threads, so a process in this client's session would share one group's time
with it. ``--shared-session`` leaves the worker and the gateway in this process's session, as
runs before 6 December 2026 did (ZooKeeper and the server had their own).

Before the reps, each side takes ``--warmup`` seconds of bursts: ZooKeeper's JVM goes on
compiling its hot code for a minute or so under this load (a long-running ensemble has), and its
compiler's thread would otherwise take a core's share from everything else.

Both engines run on ``--device`` (cpu by default; ``cuda`` on a GPU host, where the engines'
work leaves the cores that ZooKeeper, the gateway and the client use, as the layouts below
emulate on a CPU host). The worker runs greedy-only (``--greedy-only``), as the server decodes
these requests: it builds its engine from the first request's settings, greedy for all.
``--sampling`` runs the worker's default engine instead, which also serves sampled jobs and pays
for sampling at every step.

With ``--split-cores`` both engines run on the first core and ZooKeeper, the gateway and this
client on the others: each engine has the same core to itself, as where the control plane runs
on hosts of its own (and as on a GPU host, where the engine's work leaves the cores). This
client then shares a core with zkq's control plane but not with the server: with
``--client-with-engines`` it runs on the engines' core instead (where it shares with the server
but not with the control plane), which shows how much of a difference is that sharing; with
``--client-apart`` (3 cores at least) it has the third core and those after to itself, and
the control plane the second alone: neither side shares with the client.

With ``--client-alone`` this client has the last core to itself and everything else (both
engines, ZooKeeper, the gateway) shares the others: on two cores, each side's whole system runs
on one core, its engine beside its own request handling (the server's HTTP in its process; zkq's
ZooKeeper, gateway and worker), and neither shares with the client, which stands for callers on
hosts of their own. zkq's control plane then takes its CPU from the engine's core, which a
deployment with hosts of its own for ZooKeeper and the gateway would not. Through
zkq, with ``--no-direct`` the worker writes streams into the jobs' claims instead (``zkq worker
--no-stream``): the figure before the data plane.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import os
import re
import statistics
import subprocess
import sys
import time
from typing import Any

from scripts.bench.core import (
    ZKQ_CLI,
    CpuMeter,
    child_env,
    percentile,
    pin,
    report,
    stop_processes,
    tiny_model_served,
    wait_until,
    wait_up,
)
from zkqueue import Client
from zkqueue.testing import free_port

BENCH_ROOT = "/bench-streaming"
SIDES = ("zkq", "direct")
QUEUE = "tiny"
PROMPTS = [
    "Tell me about the priority queue.",
    "What does ZooKeeper keep?",
    "Name the workers in the line.",
    "Why does the urgent job go first?",
]


async def one(client: Any, model: str, prompt: str, max_tokens: int) -> dict[str, Any]:
    """One streamed completion: time to first content, content chunks, tokens (the text of
    the tiny random model is not kept: the 1,000-stream bench checks texts)."""
    sent = time.monotonic()
    first = None
    chunks, tokens, answer_id = 0, None, None
    stream = await client.completions.create(
        model=model,
        prompt=prompt,
        max_tokens=max_tokens,
        temperature=0,
        stream=True,
        stream_options={"include_usage": True},
    )
    async for chunk in stream:
        answer_id = chunk.id
        if chunk.usage is not None:
            tokens = chunk.usage.completion_tokens
        for choice in chunk.choices:
            piece = choice.text
            if piece:
                if first is None:
                    first = time.monotonic() - sent
                chunks += 1
    return {
        "ttft_s": first,
        "id": answer_id,
        "chunks": chunks,
        "tokens": tokens,
        "total_s": time.monotonic() - sent,
    }


async def side(
    base_url: str, model: str, c1: int, rounds: int, max_tokens: int
) -> dict[str, list[dict[str, Any]]]:
    from openai import AsyncOpenAI

    async with AsyncOpenAI(base_url=base_url, api_key="bench", max_retries=0) as client:
        serial = [
            await one(client, model, PROMPTS[i % len(PROMPTS)], max_tokens) for i in range(c1)
        ]
        burst = []
        for _ in range(rounds):
            calls = [one(client, model, PROMPTS[i % len(PROMPTS)], max_tokens) for i in range(16)]
            burst += await asyncio.gather(*calls)
    return {"c1": serial, "c16": burst}


def summarize(out: dict[str, Any]) -> list[str]:
    lines = []
    figures: dict[str, dict[str, float]] = {}
    for name in ("direct", "zkq"):
        reps = out[name]
        c1 = [r["ttft_s"] for rep in reps for r in rep["c1"] if r["ttft_s"] is not None]
        c16 = [r["ttft_s"] for rep in reps for r in rep["c16"] if r["ttft_s"] is not None]
        rows = [r for rep in reps for r in rep["c1"] + rep["c16"]]
        answers = [r for r in rows if r["tokens"]] or [{"chunks": 0, "tokens": 0}]
        ratio = [r["chunks"] / r["tokens"] for r in answers if r["tokens"]] or [0.0]
        figures[name] = {
            "c1_p50_ms": 1000 * statistics.median(c1),
            "c16_p50_ms": 1000 * statistics.median(c16),
            "c16_p99_ms": 1000 * percentile(c16, 99),
            "chunks_per_token": statistics.median(ratio),
            "chunks": statistics.median(r["chunks"] for r in rows),
            "tokens": statistics.median(r["tokens"] for r in answers),
            "requests": len(c1) + len(c16),
        }
    d, z = figures["direct"], figures["zkq"]
    out["figures"] = figures
    lines.append(
        f"concurrency 1, time to first content p50: zkq {z['c1_p50_ms']:.1f} ms, direct "
        f"{d['c1_p50_ms']:.1f} ms (zkq - direct = {z['c1_p50_ms'] - d['c1_p50_ms']:+.1f} ms)"
    )
    lines.append(
        f"concurrency 16, time to first content p99: zkq {z['c16_p99_ms']:.1f} ms, direct "
        f"{d['c16_p99_ms']:.1f} ms ({z['c16_p99_ms'] / d['c16_p99_ms']:.2f}x); p50 "
        f"{z['c16_p50_ms']:.1f} / {d['c16_p50_ms']:.1f} ms"
    )
    lines.append(
        f"chunks per answer (median): zkq {z['chunks']:.0f} of {z['tokens']:.0f} tokens "
        f"({z['chunks_per_token']:.2f} a token); direct {d['chunks']:.0f} (its stream has no "
        f"usage)"
    )
    steps = _steps_summary(out)
    if steps:
        lines.append(steps)
    cpu = out.get("cpu_per_request_ms")
    if cpu:
        lines.append(
            "CPU per request: "
            + ", ".join(f"{k} {v:.1f} ms" for k, v in cpu.items())
            + " (the gateway, the worker and ZooKeeper for zkq; the server for direct; the"
            " measuring client, this process, for each side)"
        )
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.streaming")
    parser.add_argument("--reps", type=int, default=6)
    parser.add_argument("--c1", type=int, default=10)
    parser.add_argument("--c16-rounds", type=int, default=2)
    parser.add_argument("--max-tokens", type=int, default=64)
    parser.add_argument("--no-direct", action="store_true", help="the worker with --no-stream")
    parser.add_argument(
        "--worker-threads", type=int, default=None, help="torch CPU threads of the worker"
    )
    parser.add_argument(
        "--sampling",
        action="store_true",
        help="the worker's engine also serves sampled jobs (its default), where the server's "
        "decodes greedily, as these requests ask: every step pays for sampling",
    )
    parser.add_argument(
        "--split-cores",
        action="store_true",
        help="both engines (the server, the worker) on the first core; ZooKeeper, the gateway "
        "and this client on the others, as where the control plane has hosts of its own",
    )
    placing = parser.add_mutually_exclusive_group()
    placing.add_argument(
        "--client-with-engines",
        action="store_true",
        help="with --split-cores: this client on the engines' core, not the control plane's",
    )
    placing.add_argument(
        "--client-apart",
        action="store_true",
        help="with --split-cores, on 3 cores at least: this client on cores of its own (the "
        "third on), the control plane on the second alone",
    )
    parser.add_argument(
        "--client-alone",
        action="store_true",
        help="this client on the last core alone, everything else (both engines, ZooKeeper, "
        "the gateway) on the others: each side's whole system on the same core(s), the "
        "client apart from both",
    )
    parser.add_argument(
        "--shared-session",
        action="store_true",
        help="the worker and the gateway in this process's session (so one scheduling group "
        "with this client), as runs before 6 December 2026 had them; by default each "
        "process has a session of its own, as ZooKeeper and the server always have",
    )
    parser.add_argument(
        "--warmup",
        type=float,
        default=60.0,
        help="seconds of bursts sent to each side before the reps: ZooKeeper's JVM compiles "
        "its hot code for a minute or so under this load (a long-running ensemble has)",
    )
    parser.add_argument(
        "--device",
        default="cpu",
        help="where both engines run: cpu, cuda or cuda:N (the worker's and the server's --device)",
    )
    parser.add_argument("--json", default=None)
    parser.add_argument(
        "--pool",
        nargs="+",
        metavar="JSON",
        help="run nothing: the figures of runs saved with --json, each run's ratio and every "
        "request of them all as one sample (a p99 of one run is its few slowest requests)",
    )
    args = parser.parse_args(argv)
    if (args.client_with_engines or args.client_apart) and not args.split_cores:
        parser.error("--client-with-engines and --client-apart need --split-cores")
    if args.client_alone and args.split_cores:
        parser.error("--client-alone and --split-cores are different layouts: give one")
    if args.client_apart and len(os.sched_getaffinity(0)) < 3:
        parser.error("--client-apart needs 3 cores at least")
    if args.pool:
        print("\n".join(pooled(args.pool)))
        return 0
    out: dict[str, Any] = {"args": vars(args), "direct": [], "zkq": []}
    with tiny_model_served("zkq-bench-streaming-", args.device) as (tmp, server, cluster):
        model = str(tmp / "tiny")
        log = open(tmp / "zkq.log", "w")  # noqa: SIM115 (closed below)
        base = [*ZKQ_CLI, "--zk", cluster.hosts, "--root", BENCH_ROOT]
        worker_cmd = [*base, "worker", "--queue", QUEUE, "--model", model, "--no-janitor"]
        worker_cmd += ["--max-concurrency", "16", "--device", args.device]
        if not args.sampling:
            worker_cmd.append("--greedy-only")
        if args.no_direct:
            worker_cmd.append("--no-stream")
        port = free_port()
        own_sessions = not args.shared_session
        threads = {"OMP_NUM_THREADS": str(args.worker_threads)} if args.worker_threads else {}
        procs = [
            subprocess.Popen(
                worker_cmd,
                env=child_env(**threads),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=own_sessions,
            ),
            subprocess.Popen(
                [*base, "serve", "--port", str(port), "--log-level", "info"],
                env=child_env(),
                stdout=log,
                stderr=subprocess.STDOUT,
                start_new_session=own_sessions,
            ),
        ]
        try:
            with Client(cluster.hosts, root=BENCH_ROOT) as client:
                running = lambda: any(  # noqa: E731
                    w.get("queue") == QUEUE and w.get("state") == "running"
                    for w in client.workers()
                )
                if not wait_until(running, 300, 0.2):
                    raise TimeoutError(f"no worker of {QUEUE} in 300s")
            zkq_url = f"http://127.0.0.1:{port}/v1"
            assert server.proc is not None and cluster.servers[0].process is not None
            cpu = CpuMeter(
                {
                    "server": server.proc.pid,
                    "worker": procs[0].pid,
                    "gateway": procs[1].pid,
                    "zookeeper": cluster.servers[0].process.pid,
                    "client": os.getpid(),
                }
            )
            wait_up(zkq_url.removesuffix("/v1"))
            if args.split_cores:
                placed = "engines" if args.client_with_engines else "control"
                split_cores(cpu.pids, client="apart" if args.client_apart else placed)
            elif args.client_alone:
                client_alone(cpu.pids)
            for url, name in ((zkq_url, QUEUE), (server.url, model)):  # warm both paths
                asyncio.run(side(url, name, 4, 1, args.max_tokens))
                warm_until = time.monotonic() + args.warmup
                while time.monotonic() < warm_until:
                    asyncio.run(side(url, name, 0, 2, args.max_tokens))
            spent = {k: 0.0 for k in cpu.pids if k != "client"}
            # The measuring client's CPU, by the side it measured.
            measuring = dict.fromkeys(SIDES, 0.0)
            for rep in range(args.reps):
                order = [("direct", server.url, model), ("zkq", zkq_url, QUEUE)]
                for name, url, model_name in order if rep % 2 == 0 else order[::-1]:
                    before = cpu()
                    result = asyncio.run(
                        side(url, model_name, args.c1, args.c16_rounds, args.max_tokens)
                    )
                    for k, v in cpu.since(before, digits=None).items():
                        if k == "client":
                            measuring[name] += v
                        else:
                            spent[k] += v
                    out[name].append(result)
                d, z = out["direct"][-1], out["zkq"][-1]
                print(
                    f"rep {rep}: c1 p50 zkq {_p50(z['c1']):.1f} ms direct {_p50(d['c1']):.1f} ms; "
                    f"c16 p99 zkq {_p99(z['c16']):.1f} ms direct {_p99(d['c16']):.1f} ms",
                    flush=True,
                )
            per_side = args.reps * (args.c1 + 16 * args.c16_rounds)
            out["cpu_per_request_ms"] = {k: 1000 * v / per_side for k, v in spent.items()}
            for side_name, seconds in measuring.items():
                out["cpu_per_request_ms"][f"client ({side_name})"] = 1000 * seconds / per_side
        except BaseException:
            log.flush()
            print((tmp / "zkq.log").read_text()[-3000:], file=sys.stderr)
            print(server.log_tail(), file=sys.stderr)
            raise
        finally:
            stop_processes(procs, 30)
            log.close()
            logged = steps_logged((tmp / "zkq.log").read_text())
    for rep in out["direct"]:
        for row in rep["c1"] + rep["c16"]:
            del row["id"]
    for rep in out["zkq"]:
        for row in rep["c1"] + rep["c16"]:
            row["steps"] = logged.get((row.pop("id") or "").split("-", 1)[-1])
    report(out, summarize(out), args.json)
    return 0


def pooled(paths: list[str]) -> list[str]:
    """The figures of saved runs: each run's concurrency-16 p99 ratio, then ``summarize`` over
    every request of them all."""
    runs = []
    for path in paths:
        with open(path) as f:
            runs.append(json.load(f))
    lines = []
    for path, run in zip(paths, runs, strict=True):
        p99 = {name: _p99([r for rep in run[name] for r in rep["c16"]]) for name in SIDES}
        lines.append(
            f"{path}: concurrency 16 p99 zkq {p99['zkq']:.1f} ms, direct {p99['direct']:.1f} ms "
            f"({p99['zkq'] / p99['direct']:.2f}x)"
        )
    merged = {name: [rep for run in runs for rep in run[name]] for name in SIDES}
    lines.append(f"all {len(runs)} runs as one sample:")
    lines += summarize(merged)
    c16 = {
        name: [r["ttft_s"] for rep in merged[name] for r in rep["c16"] if r["ttft_s"] is not None]
        for name in SIDES
    }
    parts = []
    for q in (50, 90, 95, 99):
        z, d = (1000 * percentile(c16[name], q) for name in SIDES)
        parts.append(f"p{q} {z:.1f} / {d:.1f} ms ({z / d:.2f}x)")
    lines.append("concurrency 16, zkq / direct: " + ", ".join(parts))
    return lines


def split_cores(pids: dict[str, int], client: str = "control") -> None:
    """The engines (``pids`` named server and worker) on the first core, every other
    process of the run (ZooKeeper, the gateway) on the rest. The one named client (this
    process) goes with the ``control`` plane, with the ``engines``, or ``apart``: on the
    third core and those after, the control plane then on the second alone."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < (3 if client == "apart" else 2):
        raise SystemExit(f"--split-cores with the client {client} needs more cores")
    engines = {cores[0]}
    control = {cores[1]} if client == "apart" else set(cores[1:])
    own = {"engines": engines, "control": control, "apart": set(cores[2:])}[client]
    for name, pid in pids.items():  # the client: this process
        if name == "client":
            pin(pid, own)
        else:
            pin(pid, engines if name in ("server", "worker") else control)


def client_alone(pids: dict[str, int]) -> None:
    """The one of ``pids`` named client (this process) on the last core alone, every other
    process of the run on the cores before it."""
    cores = sorted(os.sched_getaffinity(0))
    if len(cores) < 2:
        raise SystemExit("--client-alone needs 2 cores at least")
    for name, pid in pids.items():
        pin(pid, {cores[-1]} if name == "client" else set(cores[:-1]))


#: The gateway's line for each finished job (``zkq serve --log-level info``): its steps in
#: milliseconds from the request's arrival.
_STEPS_LINE = re.compile(r"zkq\.gateway: \w+ \w+: (.*) from the request \[job=(\S+)")
_STEP = re.compile(r"([a-z ]+) ([+-][0-9.]+) ms")


def steps_logged(log_text: str) -> dict[str, dict[str, float]]:
    """Each job's steps (ms from its request's arrival at the gateway), by job id."""
    found = {}
    for said, job_id in _STEPS_LINE.findall(log_text):
        found[job_id] = {step.strip(): float(ms) for step, ms in _STEP.findall(said)}
    return found


def _steps_summary(out: dict[str, Any]) -> str | None:
    """p50 / p99 of each step of the requests at concurrency 16 through zkq."""
    rows = [r["steps"] for rep in out["zkq"] for r in rep["c16"] if r.get("steps")]
    if not rows:
        return None
    parts = []
    for step in ("submitted", "claimed", "first token", "first text sent"):
        values = [r[step] for r in rows if step in r]
        if values:
            parts.append(f"{step} {statistics.median(values):.1f} / {percentile(values, 99):.1f}")
    return (
        f"through zkq at concurrency 16, ms from a request's arrival at the gateway, p50 / p99 "
        f"({len(rows)} requests): " + ", ".join(parts)
    )


def _p50(rows: list[dict[str, Any]]) -> float:
    return 1000 * statistics.median(r["ttft_s"] for r in rows if r["ttft_s"] is not None)


def _p99(rows: list[dict[str, Any]]) -> float:
    return 1000 * percentile([r["ttft_s"] for r in rows if r["ttft_s"] is not None], 99)


if __name__ == "__main__":
    sys.exit(main())
