"""PNG plots of results.json (matplotlib, optional: without it the plots are skipped with a
message)."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from scripts.bench.core import median
from scripts.bench.targets import ENGINES, continuous, find, grouped


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
    bulk, batch = results.get("bulk"), continuous(results)
    if not bulk and not batch:
        return None
    fig, axes = plt.subplots(1, 2, figsize=(10, 4))
    if bulk:
        values = [bulk["raw_median"], bulk["submit_many_median"]]
        axes[0].bar(["raw async creates", "submit_many"], values, color=["grey", "C0"])
        axes[0].set_ylabel("per second")
        axes[0].set_title(f"producer bulk ({bulk['jobs']} jobs)")
    if batch:
        keys = list(batch["throughput"][0]["greedy_only"]["direct_tok_s"])
        bars = [(f"alone, {k} in flight", k) for k in keys] + [("worker", None)]
        width = 0.8 / len(bars)
        for i, (label, key) in enumerate(bars):
            values = [
                median(
                    t[engine]["direct_tok_s"][key] if key else t[engine]["worker_tok_s"]
                    for t in batch["throughput"]
                )
                for engine, _ in ENGINES
            ]
            xs = [j + (i - len(bars) / 2 + 0.5) * width for j in range(len(ENGINES))]
            axes[1].bar(xs, values, width, label=label, color=f"C{i}" if key else "C3")
        axes[1].set_xticks(range(len(ENGINES)), [label for _, label in ENGINES])
        axes[1].set_ylabel("tokens/s (median)")
        axes[1].set_title("continuous batching (tiny model, CPU)")
        axes[1].legend(fontsize=8)
    return fig
