"""results.json as a Markdown report: the targets, then one section per scenario."""

from __future__ import annotations

import math
from typing import Any

from scripts.bench.targets import ENGINES, Row, continuous, find, grouped, spread


def markdown(results: dict[str, Any]) -> str:
    meta = results["meta"]
    parts = [
        "# zkq benchmark results",
        "",
        f"`{meta['command']}` ({meta['mode']} mode), {meta['started']}, {meta['cpus']} CPUs, "
        f"Python {meta['python']}, kazoo {meta['kazoo']}, {meta['zookeeper']}; "
        f"{meta['wall_s']:.0f} s in all. Medians of {meta['config']['reps']} repetition(s).",
        "",
        "## Targets",
        "",
        _table(
            ["target", "goal", "measured", "met"],
            [[t["name"], t["goal"], t["value"], "yes" if t["met"] else "**no**"]
             for t in results.get("targets", [])],
        ),
    ]  # fmt: skip
    for title, section in (
        ("Dispatch throughput (scenario 1)", _md_dispatch),
        ("Round trips per job, by request type (zkq)", _md_requests),
        ("Latency on an idle system (scenario 2)", _md_latency),
        ("Herd (scenario 3)", _md_herd),
        ("Depth (scenario 4)", _md_depth),
        ("Producer bulk (scenario 5)", _md_bulk),
        ("Continuous batching, tiny model on CPU (scenario 6)", _md_batching),
        ("Redis baseline (scenario 7)", _md_redis),
    ):
        body = section(results)
        if body:
            parts += ["", f"## {title}", "", body]
    for name, error in results.get("errors", {}).items():
        parts += ["", f"## {name}: failed", "", "```", error.strip()[-2000:], "```"]
    return "\n".join(parts) + "\n"


def _table(header: list[str], rows: list[list[Any]]) -> str:
    lines = ["| " + " | ".join(header) + " |", "|" + "---|" * len(header)]
    lines += ["| " + " | ".join(_cell(c) for c in row) + " |" for row in rows]
    return "\n".join(lines)


def _cell(value: Any) -> str:
    if isinstance(value, float):
        if math.isnan(value):
            return "-"
        return f"{value:.2f}" if abs(value) < 100 else f"{value:.0f}"
    return str(value)


def _dispatch_rows(rows: list[Row]) -> list[list[Any]]:
    order = {"zkq": 0, "LockingQueue": 1, "redis-aof": 2, "redis-memory": 3}
    rows = sorted(
        rows, key=lambda r: (r["mode"], r["procs"], order.get(r["system"], 9), r["slots"])
    )
    return [
        [
            r["system"],
            r["procs"],
            r["slots"],
            r["mode"],
            f"{r['rate']:.0f} ({r['rate_min']:.0f}-{r['rate_max']:.0f})"
            + ("" if r["complete"] else " incomplete"),
            r["per_job"]["reads"],
            r["per_job"]["writes"],
            r["per_job"]["notifications"],
            r["per_job"]["worker_cpu_ms"],
            r["per_job"]["server_cpu_ms"] or r["per_job"]["redis_cpu_ms"],
            r["turn_ms"],
            r["jobs_per_turn"],
        ]
        for r in rows
    ]  # fmt: skip


_DISPATCH_HEADER = [
    "system", "procs", "slots", "mode", "jobs/s (min-max)", "reads/job", "writes/job",
    "notifications/job", "worker CPU ms/job", "server CPU ms/job", "head turn ms",
    "jobs/turn",
]  # fmt: skip


def _md_dispatch(results: dict[str, Any]) -> str:
    d = results.get("dispatch")
    if not d:
        return ""
    raw = d["raw"]
    return (
        f"Raw ZooKeeper in the same run: one synchronous sequential create takes "
        f"{raw['sync_create_p50_ms']:.2f} ms (p50), {raw['sync_creates_per_s']:.0f} creates/s "
        f"one at a time; pipelined (512 in flight) {raw['async_creates_per_s']:.0f} creates/s.\n\n"
        + _table(_DISPATCH_HEADER, _dispatch_rows(grouped(d["rows"])))
        + "\n\nRound trips are counted in every benchmark process (a wrapper on kazoo's "
        "`KazooClient._call`): the producer's and the workers', not the harness's polling. A "
        "multi is one write round trip. Notifications are watch events received by the worker "
        "sessions. CPU is user+system time of the worker processes and of the server's JVM."
    )


def _md_requests(results: dict[str, Any]) -> str:
    d = results.get("dispatch")
    if not d:
        return ""
    rows = [r for r in grouped(d["rows"]) if r["system"] == "zkq" and r["mode"] == "prefill"]
    lines = []
    for r in sorted(rows, key=lambda r: (r["procs"], r["slots"])):
        w = ", ".join(f"{k} {v:.2f}" for k, v in r["requests"].items() if v >= 0.005)
        p = ", ".join(f"{k} {v:.2f}" for k, v in r["producer_requests"].items() if v >= 0.005)
        m = ", ".join(f"{k} {v:.2f}" for k, v in r["multi_ops"].items() if v >= 0.005)
        lines.append([f"{r['procs']}x{r['slots']}", p, w, m])
    return _table(["procs x slots", "producer", "workers", "ops inside multis"], lines) + (
        "\n\nWrites on the hot path of one job: the producer's sequential `Create` of the entry; "
        "the claim multi (`Transaction`: create claim + setData entry + delete own line node "
        "[+ create line node], one per turn, shared by the jobs claimed in it); the complete "
        "multi (`Transaction`: check + create result + delete entry + delete claim [+ create "
        "line node]). Off the hot path: registry heartbeats (`SetData` every 2 s per worker) and "
        "line joins (`Create`). Pre-filled runs, per job, medians."
    )


def _md_latency(results: dict[str, Any]) -> str:
    lat = results.get("latency")
    if not lat:
        return ""
    return _table(
        ["what", "p50 ms", "p99 ms"],
        [
            ["submit (attached) to result", lat["job_p50_ms"], lat["job_p99_ms"]],
            ["one synchronous create", lat["create_p50_ms"], lat["create_p99_ms"]],
            ["  of which: submit to claim", lat["submit_to_claim_p50_ms"], ""],
            ["  claim to completed", lat["claim_to_completed_p50_ms"], ""],
            ["  completed to the caller holding the result", lat["completed_to_caller_p50_ms"], ""],
        ],
    ) + f"\n\n{lat['samples']} jobs, one at a time, one worker with one slot; ratio of p50s " \
        f"{lat['ratio_p50']:.1f}x."  # fmt: skip


def _md_herd(results: dict[str, Any]) -> str:
    herd = results.get("herd")
    if not herd:
        return ""
    return _table(
        ["system", "idle workers", "notifications/job", "max in one job", "sessions woken/job",
         "max sessions woken", "per job, by event and watched node"],
        [[r["system"], r["workers"], r["notifications_per_job"], r["max_notifications"],
          r["sessions_woken_per_job"], r["max_sessions_woken"],
          ", ".join(f"{k} {v:.2f}" for k, v in sorted(r["by_type"].items()))]
         for r in herd["rows"]],
    ) + (
        "\n\nCounted on the wire: every watch notification a worker's session receives (a "
        "wrapper on kazoo's watch reader), after a sync and a flush of each session's callbacks "
        "once the job is done."
    )  # fmt: skip


def _md_depth(results: dict[str, Any]) -> str:
    depth = results.get("depth")
    if not depth:
        return ""
    return _table(
        ["pending", "enqueue p50 ms", "enqueue p99 ms", "claim turn ms (mean)",
         "view refresh ms", "per-job cycle ms", "one get_children ms", "reads/job",
         "worker CPU ms/job"],
        [[r["depth"], r["enqueue_p50_ms"], r["enqueue_p99_ms"], r["claim_turn_ms"],
          r["refresh_ms"], r["cycle_ms"], r["list_ms"], r["reads_per_job"],
          r["worker_cpu_ms_per_job"]] for r in depth["rows"]],
    ) + (
        "\n\nOne worker with one slot claims from the front of a queue of that depth; the "
        "claim turn is the worker's dispatch step that claimed (refresh of its view, reading "
        "the candidate, the claim multi). Enqueue is one synchronous `submit(detach=True)`."
    )  # fmt: skip


def _md_bulk(results: dict[str, Any]) -> str:
    bulk = results.get("bulk")
    if not bulk:
        return ""
    return _table(
        ["what", "per second (median)", "each repetition"],
        [
            ["raw pipelined creates (512 in flight)", bulk["raw_median"],
             ", ".join(f"{v:.0f}" for v in bulk["raw_per_s"])],
            [f"submit_many({bulk['jobs']}) detached", bulk["submit_many_median"],
             ", ".join(f"{v:.0f}" for v in bulk["submit_many_per_s"])],
        ],
    ) + f"\n\nsubmit_many reaches {bulk['ratio'] * 100:.0f}% of the raw rate."  # fmt: skip


def _md_batching(results: dict[str, Any]) -> str:
    b = results.get("batching")
    if not b:
        return ""
    c = continuous(results)
    if not c:
        return "Figures of the static-batching suite, superseded by continuous batching: rerun."
    hol, arr = c["head_of_line"], c["arrivals"]
    before = sum(bool(r["all_short_before_half"]) for r in hol)
    parts = [
        f"`python -m scripts.bench.continuous{' --quick' if c.get('quick') else ''}`: tiny model "
        "(64 hidden, 2 layers) on the CPU, one torch thread, a cache of 512 pages of 32 tokens, "
        "256 batch tokens, the engine at 16 requests a step, ignore_eos (exact lengths). "
        f"Medians of {len(hol)} repetition(s), min-max in brackets.",
        "",
        "Head-of-line: 1 job of 300 new tokens and 7 of 4 pending before an 8-slot worker starts.",
        "",
        _table(
            ["what", "seconds"],
            [
                ["the long job's run", spread(r["long_run_s"] for r in hol)],
                ["the last short result, after the long job's start",
                 spread(r["last_short_after_long_start_s"] for r in hol)],
                ["all short results before the long job's half-way point",
                 f"{before}/{len(hol)} repetition(s)"],
            ],
        ),
        "",
        "Arrivals: 80 jobs, one every 50 ms, 3 short (4-16 new tokens) to 1 long (250-300), "
        "at one 16-slot worker.",
        "",
        _table(
            ["what", "value"],
            [
                ["short jobs, submit to result, p50 (s)", spread(r["short_p50_s"] for r in arr)],
                ["short jobs, submit to result, p99 (s)", spread(r["short_p99_s"] for r in arr)],
                ["long jobs' run, median (s)", spread(r["long_run_median_s"] for r in arr)],
                ["short p99 / long median run", spread(r["ratio"] for r in arr)],
            ],
        ),
        "",
        _md_throughput(c),
        "",
        f"Greedy outputs through the worker against single-prompt `generate`: "
        f"{'identical' if c['greedy']['identical'] else '**different**'} "
        f"({c['greedy']['jobs']} jobs).",
    ]  # fmt: skip
    return "\n".join(parts)


def _md_throughput(c: dict[str, Any]) -> str:
    rows = []
    for engine, label in ENGINES:
        runs = [t[engine] for t in c["throughput"]]
        direct = {k: [r["direct_tok_s"][k] for r in runs] for k in runs[0]["direct_tok_s"]}
        rows.append(
            [label, *(spread(v, 0) for v in direct.values()),
             spread((r["worker_tok_s"] for r in runs), 0),
             spread(r["ratio_to_best_direct"] for r in runs)]
        )  # fmt: skip
    keys = list(c["throughput"][0]["greedy_only"]["direct_tok_s"])
    prompts = 16 if c.get("quick") else 64
    return (
        f"Throughput: {prompts} mixed greedy jobs (7-240 prompt tokens, 12-127 new), tokens/s "
        "from the first start to the last completion; the worker has a slot for every job, the "
        "engine alone (the library's continuous batching called directly) runs with 8, 16 or 64 "
        "requests in flight, and the ratio is to its best in the same repetition.\n\n"
        + _table(
            ["engine", *(f"alone, {k} in flight" for k in keys), "worker", "worker / best alone"],
            rows,
        )
    )


def _md_redis(results: dict[str, Any]) -> str:
    r = results.get("redis")
    if not r:
        return ""
    rows = grouped(r["rows"])
    zkq = [x for x in grouped(results.get("dispatch", {}).get("rows", [])) if x["slots"] == 1]
    return _table(
        ["system", "procs", "mode", "jobs/s (min-max)", "server CPU ms/job", "zkq 1-slot jobs/s"],
        [[x["system"], x["procs"], x["mode"],
          f"{x['rate']:.0f} ({x['rate_min']:.0f}-{x['rate_max']:.0f})",
          x["per_job"]["redis_cpu_ms"],
          (find(zkq, system="zkq", procs=x["procs"], mode=x["mode"]) or {}).get("rate", "-")]
         for x in sorted(rows, key=lambda x: (x["system"], x["mode"], x["procs"]))],
    ) + (
        "\n\nredis-aof: append-only file fsynced on every write (`appendfsync always`, the "
        "durability ZooKeeper gives every transaction); redis-memory: no persistence. Same echo "
        "work, same producer (one job at a time) and worker counts."
    )  # fmt: skip
