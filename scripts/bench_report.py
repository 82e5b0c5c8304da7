"""Turning results.json into the targets, a Markdown report and PNG plots (matplotlib, optional:
without it the plots are skipped with a message)."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterable
from pathlib import Path
from typing import Any

from bench_core import median

Row = dict[str, Any]
_KEY = ("system", "procs", "slots", "mode")


# -- aggregation ----------------------------------------------------------------------------


def grouped(rows: Iterable[Row]) -> list[Row]:
    """One row per (system, procs, slots, mode): medians over repetitions, plus min/max rate."""
    groups: dict[tuple[Any, ...], list[Row]] = {}
    for row in rows:
        groups.setdefault(tuple(row[k] for k in _KEY), []).append(row)
    out = []
    for key, reps in groups.items():
        rates = [r["rate"] for r in reps]
        per_job = {
            name: median(r["per_job"][name] for r in reps)
            for name, value in reps[0]["per_job"].items()
            if isinstance(value, int | float)
        }
        out.append(
            {
                **dict(zip(_KEY, key, strict=True)),
                "reps": len(reps),
                "rate": median(rates),
                "rate_min": min(rates),
                "rate_max": max(rates),
                "complete": all(r["completed"] for r in reps),
                "per_job": per_job,
                "requests": _median_dicts([r["per_job"]["worker_requests"] for r in reps]),
                "producer_requests": _median_dicts(
                    [r["per_job"]["producer_requests"] for r in reps]
                ),
                "multi_ops": _median_dicts([r["per_job"]["multi_ops"] for r in reps]),
                "turn_ms": median(_timer(r, "head_turn", "mean_ms") for r in reps),
                "jobs_per_turn": median(_timer(r, "jobs_per_turn", "mean_ms") / 1e3 for r in reps),
            }
        )
    return out


def _timer(row: Row, name: str, field: str) -> float:
    value = row.get("timers", {}).get(name, {}).get(field)
    return float(value) if value is not None else float("nan")


def _median_dicts(dicts: list[dict[str, float]]) -> dict[str, float]:
    keys = {k for d in dicts for k in d}
    return {k: median(d.get(k, 0.0) for d in dicts) for k in sorted(keys)}


def find(rows: list[Row], **match: Any) -> Row | None:
    return next((r for r in rows if all(r.get(k) == v for k, v in match.items())), None)


# -- targets --------------------------------------------------------------------------------


def targets(results: dict[str, Any]) -> list[Row]:
    out: list[Row] = []
    for check in (_t_dispatch, _t_writes, _t_latency, _t_herd, _t_depth, _t_bulk, _t_batching):
        out.extend(check(results))
    return out


def _target(name: str, goal: str, value: str, met: bool) -> Row:
    return {"name": name, "goal": goal, "value": value, "met": bool(met)}


def _t_dispatch(results: dict[str, Any]) -> list[Row]:
    if "dispatch" not in results:
        return []
    rows = grouped(results["dispatch"]["rows"])
    out = []
    for procs in (4, 16):
        for mode in ("prefill", "stream"):
            lq = find(rows, system="LockingQueue", procs=procs, mode=mode)
            for slots in sorted({r["slots"] for r in rows if r["system"] == "zkq"}):
                zkq = find(rows, system="zkq", procs=procs, slots=slots, mode=mode)
                if not lq or not zkq:
                    continue
                ratio = zkq["rate"] / lq["rate"]
                out.append(
                    _target(
                        f"dispatch {procs} procs x {slots} slot(s), {mode}",
                        "zkq >= 3x LockingQueue",
                        f"{ratio:.1f}x ({zkq['rate']:.0f} vs {lq['rate']:.0f} jobs/s)",
                        ratio >= 3,
                    )
                )
    return out


def _t_writes(results: dict[str, Any]) -> list[Row]:
    if "dispatch" not in results:
        return []
    rows = [r for r in grouped(results["dispatch"]["rows"]) if r["system"] == "zkq"]
    if not rows:
        return []
    worst = max(rows, key=lambda r: r["per_job"]["writes"])
    return [
        _target(
            "ZooKeeper writes per job",
            "<= 4 write round trips",
            f"at most {worst['per_job']['writes']:.2f} ({worst['procs']} procs x "
            f"{worst['slots']} slots, {worst['mode']})",
            worst["per_job"]["writes"] <= 4,
        )
    ]


def _t_latency(results: dict[str, Any]) -> list[Row]:
    lat = results.get("latency")
    if not lat:
        return []
    return [
        _target(
            "idle latency p50",
            "<= 5x sync create p50",
            f"{lat['ratio_p50']:.1f}x ({lat['job_p50_ms']:.2f} vs {lat['create_p50_ms']:.2f} ms)",
            lat["ratio_p50"] <= 5,
        )
    ]


def _t_herd(results: dict[str, Any]) -> list[Row]:
    herd = results.get("herd")
    if not herd:
        return []
    rows = [r for r in herd["rows"] if r["system"] == "zkq"]
    worst = max(rows, key=lambda r: r["notifications_per_job"])
    woken = max(r["max_sessions_woken"] for r in rows)
    return [
        _target(
            "herd: notifications per new job",
            "<= 2 at 1, 8, 32 idle workers",
            ", ".join(f"{r['workers']}: {r['notifications_per_job']:.2f}" for r in rows)
            + f" (sessions woken at most {woken})",
            worst["notifications_per_job"] <= 2,
        )
    ]


def _t_depth(results: dict[str, Any]) -> list[Row]:
    depth = results.get("depth")
    if not depth or len(depth["rows"]) < 2:
        return []
    low, high = depth["rows"][0], depth["rows"][-1]
    out = []
    for field, label in (("enqueue_p50_ms", "enqueue p50"), ("claim_turn_ms", "claim turn")):
        ratio = high[field] / low[field]
        out.append(
            _target(
                f"depth: {label}",
                f"at {high['depth']} within 2x of {low['depth']}",
                f"{ratio:.1f}x ({high[field]:.2f} vs {low[field]:.2f} ms)",
                ratio <= 2,
            )
        )
    return out


def _t_bulk(results: dict[str, Any]) -> list[Row]:
    bulk = results.get("bulk")
    if not bulk:
        return []
    return [
        _target(
            "producer bulk",
            ">= 70% of raw async create rate",
            f"{bulk['ratio'] * 100:.0f}% ({bulk['submit_many_median']:.0f} vs "
            f"{bulk['raw_median']:.0f}/s)",
            bulk["ratio"] >= 0.7,
        )
    ]


def _t_batching(results: dict[str, Any]) -> list[Row]:
    b = results.get("batching")
    if not b:
        return []
    return [
        _target(
            "batching speedup",
            ">= 3x (8 slots vs 1)",
            f"{b['speedup']:.1f}x",
            b["speedup"] >= 3,
        ),
        _target(
            "queue overhead on batches",
            "8-slot worker within 15% of direct generate",
            f"{b['overhead_vs_generate'] * 100:+.0f}% (vs the runner alone "
            f"{b['overhead_vs_runner'] * 100:+.0f}%; the queue's own time, wall minus "
            f"runner, {b['queue_own_vs_generate'] * 100:.0f}% of direct generate)",
            b["overhead_vs_generate"] <= 0.15,
        ),
    ]


# -- Markdown -------------------------------------------------------------------------------


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
        ("Batching, tiny model on CPU (scenario 6)", _md_batching),
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
    rows = [[k.replace("_", " "), v, b["jobs"] / v, ", ".join(f"{s:.2f}" for s in b["seconds"][k])]
            for k, v in ((k, median(s)) for k, s in b["seconds"].items())]  # fmt: skip
    return (
        _table(["run", "seconds (median)", "jobs/s", "each repetition"], rows)
        + _md_batch_split(b)
        + (
            f"\n\n{b['jobs']} jobs, max_new_tokens={b['max_new_tokens']}, greedy. 8 slots vs 1: "
            f"{b['speedup']:.1f}x. The 8-slot worker against batched `generate` called directly: "
            f"{b['overhead_vs_generate'] * 100:+.0f}%; against the HF runner called directly: "
            f"{b['overhead_vs_runner'] * 100:+.0f}%. The queue's own time (the worker's wall "
            f"time minus its time inside the runner, median) is {b['queue_own_s']:.2f} s, "
            f"{b['queue_own_vs_generate'] * 100:.0f}% of direct generate. torch ran on "
            f"{b['torch_threads']} intra-op thread(s)."
        )
        + _md_default_threads(b)
    )


def _md_default_threads(b: dict[str, Any]) -> str:
    d = b.get("torch_default_threads")
    if not d:
        return ""
    secs = {k: median(v) for k, v in d["seconds"].items()}
    return (
        f"\n\nWith torch's default thread count ({d['torch_threads']}), one repetition: "
        + ", ".join(f"{k.replace('_', ' ')} {v:.2f} s" for k, v in secs.items())
        + ". The worker runs the model on its executor thread, which starts with the "
        "process-wide OpenMP default rather than the main thread's setting."
    )


def _md_batch_split(b: dict[str, Any]) -> str:
    """Where a worker's run went: the runner (on its executor thread), claim turns, completions."""
    lines = []
    for name, runs in b.get("worker_timers", {}).items():

        def total(timer: str, runs: list[dict[str, Any]] = runs) -> float:
            return median(r.get(timer, {}).get("total_s", float("nan")) for r in runs)

        watches = total("watch_entries")
        if watches != watches:  # results from before the watches were pipelined
            watches = total("watch_entry")
        lines.append(
            [name.replace("_", " "), total("execute"), total("head_turn"),
             total("complete_multi"), watches]
        )  # fmt: skip
    if not lines:
        return ""
    return "\n\nInside the worker (seconds, medians):\n\n" + _table(
        ["run", "runner (executor thread)", "claim turns", "completions", "entry watches"], lines
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


# -- plots ----------------------------------------------------------------------------------


def plots(results: dict[str, Any], out: Path, log: Callable[[str], None]) -> list[str]:
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError:
        log("matplotlib is not installed (pip install -e '.[bench]'): no plots")
        return []
    made = []
    for name, draw in (
        ("dispatch.png", _plot_dispatch),
        ("latency.png", _plot_latency),
        ("herd.png", _plot_herd),
        ("depth.png", _plot_depth),
        ("bulk-batching.png", _plot_bulk_batching),
    ):
        fig = draw(plt, results)
        if fig is None:
            continue
        fig.tight_layout()
        fig.savefig(out / name, dpi=110)
        plt.close(fig)
        made.append(name)
    log(f"plots: {', '.join(made)}")
    return made


def _plot_dispatch(plt: Any, results: dict[str, Any]) -> Any:
    if "dispatch" not in results:
        return None
    rows = grouped(results["dispatch"]["rows"] + results.get("redis", {}).get("rows", []))
    series = [("zkq", 1, "zkq, 1 slot"), ("zkq", 4, "zkq, 4 slots"),
              ("LockingQueue", 1, "kazoo LockingQueue"), ("redis-aof", 1, "Redis (AOF always)"),
              ("redis-memory", 1, "Redis (no persistence)")]  # fmt: skip
    fig, axes = plt.subplots(1, 2, figsize=(11, 4.2), sharey=True)
    procs = sorted({r["procs"] for r in rows})
    width = 0.8 / len(series)
    for ax, mode in zip(axes, ("prefill", "stream"), strict=True):
        for i, (system, slots, label) in enumerate(series):
            values = [
                (find(rows, system=system, procs=p, slots=slots, mode=mode) or {}).get("rate", 0)
                for p in procs
            ]
            xs = [j + (i - len(series) / 2 + 0.5) * width for j in range(len(procs))]
            ax.bar(xs, values, width, label=label)
        ax.set_xticks(range(len(procs)), [f"{p} proc" for p in procs])
        ax.set_title(f"echo jobs, {mode}")
        ax.set_yscale("log")
        ax.grid(axis="y", alpha=0.3)
    axes[0].set_ylabel("jobs/s (log)")
    axes[1].legend(fontsize=8)
    return fig


def _plot_latency(plt: Any, results: dict[str, Any]) -> Any:
    lat = results.get("latency")
    if not lat:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for key, label in (("jobs_ms", "submit to result"), ("creates_ms", "one sync create")):
        values = sorted(lat[key])
        ax.plot(values, [(i + 1) / len(values) for i in range(len(values))], label=label)
    ax.axvline(5 * lat["create_p50_ms"], color="grey", ls="--", lw=1, label="5x create p50")
    ax.set_xscale("log")
    ax.set_xlabel("ms (log)")
    ax.set_ylabel("fraction")
    ax.set_title("latency on an idle system (CDF)")
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def _plot_herd(plt: Any, results: dict[str, Any]) -> Any:
    herd = results.get("herd")
    if not herd:
        return None
    fig, ax = plt.subplots(figsize=(6.5, 4))
    for color, system in (("C0", "zkq"), ("C1", "LockingQueue")):
        rows = [r for r in herd["rows"] if r["system"] == system]
        xs = [r["workers"] for r in rows]
        ax.plot(xs, [r["notifications_per_job"] for r in rows], marker="o", color=color,
                label=f"{system}: notifications")  # fmt: skip
        ax.plot(xs, [r["sessions_woken_per_job"] for r in rows], marker="s", ls=":",
                color=color, label=f"{system}: sessions woken")  # fmt: skip
    ax.axhline(2, color="grey", ls="--", lw=1, label="target 2")
    ax.set_xlabel("idle workers")
    ax.set_ylabel("per new job")
    ax.set_xscale("log", base=2)
    ax.set_yscale("log")
    ax.legend()
    ax.grid(alpha=0.3)
    return fig


def _plot_depth(plt: Any, results: dict[str, Any]) -> Any:
    depth = results.get("depth")
    if not depth:
        return None
    rows = depth["rows"]
    fields = [("enqueue_p50_ms", "enqueue p50"), ("claim_turn_ms", "claim turn"),
              ("cycle_ms", "per-job cycle")]  # fmt: skip
    fig, ax = plt.subplots(figsize=(6.5, 4))
    width = 0.8 / len(rows)
    for i, r in enumerate(rows):
        xs = [j + (i - len(rows) / 2 + 0.5) * width for j in range(len(fields))]
        ax.bar(xs, [r[f] for f, _ in fields], width, label=f"{r['depth']} pending")
    ax.set_xticks(range(len(fields)), [label for _, label in fields])
    ax.set_ylabel("ms (log)")
    ax.set_yscale("log")
    ax.legend()
    ax.grid(axis="y", alpha=0.3)
    return fig


def _plot_bulk_batching(plt: Any, results: dict[str, Any]) -> Any:
    bulk, batch = results.get("bulk"), results.get("batching")
    if not bulk and not batch:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    if bulk:
        values = [bulk["raw_median"], bulk["submit_many_median"]]
        axes[0].bar(["raw async creates", "submit_many"], values, color=["grey", "C0"])
        axes[0].set_ylabel("per second")
        axes[0].set_title(f"producer bulk ({bulk['jobs']} jobs)")
    if batch:
        names = list(batch["jobs_per_s"])
        axes[1].bar([n.replace("_", " ") for n in names], [batch["jobs_per_s"][n] for n in names])
        axes[1].set_ylabel("jobs/s")
        axes[1].set_title(f"batching ({batch['jobs']} jobs, tiny model, CPU)")
        axes[1].tick_params(axis="x", labelsize=8)
    return fig
