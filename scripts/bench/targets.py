"""From results.json to the targets: repetitions grouped into medians, then each target the
benchmarks set (dispatch against LockingQueue, writes per job, latency, herd, depth, bulk,
batching) as met or missed."""

from __future__ import annotations

from collections.abc import Iterable
from typing import Any

from scripts.bench.core import median

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


#: Dispatch against kazoo's LockingQueue with as many consumers, by slots per worker: the
#: same-run ratio each configuration must reach.
DISPATCH_GOALS = {(4, 1): 1.5, (4, 4): 3.0, (16, 4): 3.0}
#: Share of the write bound the 4 x 4 configuration must reach.
WRITE_BOUND_SHARE = 0.4


def _t_dispatch(results: dict[str, Any]) -> list[Row]:
    if "dispatch" not in results:
        return []
    rows = grouped(results["dispatch"]["rows"])
    out = []
    for (procs, slots), goal in DISPATCH_GOALS.items():
        for mode in ("prefill", "stream"):
            lq = find(rows, system="LockingQueue", procs=procs, mode=mode)
            zkq = find(rows, system="zkq", procs=procs, slots=slots, mode=mode)
            if not lq or not zkq:
                continue
            ratio = zkq["rate"] / lq["rate"]
            out.append(
                _target(
                    f"dispatch {procs} procs x {slots} slot(s), {mode}",
                    f"zkq >= {goal:g}x LockingQueue",
                    f"{ratio:.1f}x ({zkq['rate']:.0f} vs {lq['rate']:.0f} jobs/s)",
                    ratio >= goal,
                )
            )
    return out


def _t_writes(results: dict[str, Any]) -> list[Row]:
    """The write bound: pipelined creates per second over the write requests a job costs (a
    multi is one), taken from the streamed 4 x 4 run, whose figure includes the producer's
    create."""
    if "dispatch" not in results:
        return []
    rows = grouped(results["dispatch"]["rows"])
    row = find(rows, system="zkq", procs=4, slots=4, mode="stream")
    if row is None:
        return []
    writes = row["per_job"]["writes"]
    bound = results["dispatch"]["raw"]["async_creates_per_s"] / writes
    share = row["rate"] / bound
    return [
        _target(
            "4 x 4 share of the write bound",
            f">= {WRITE_BOUND_SHARE:.0%} of pipelined creates/s / writes per job",
            f"{share:.0%} ({row['rate']:.0f} of {bound:.0f} jobs/s; {writes:.2f} writes a job)",
            share >= WRITE_BOUND_SHARE,
        )
    ]


def _t_latency(results: dict[str, Any]) -> list[Row]:
    lat = results.get("latency")
    if not lat:
        return []
    return [
        _target(
            "idle latency p50",
            "<= 6x sync create p50",
            f"{lat['ratio_p50']:.1f}x ({lat['job_p50_ms']:.2f} vs {lat['create_p50_ms']:.2f} ms)",
            lat["ratio_p50"] <= 6,
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
            "herd: notifications per new job (the caller's included)",
            "<= 3 at 1, 8, 32 idle workers, at most 2 sessions woken",
            ", ".join(f"{r['workers']}: {r['notifications_per_job']:.2f}" for r in rows)
            + f" (sessions woken at most {woken})",
            worst["notifications_per_job"] <= 3 and woken <= 2,
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


def spread(values: Iterable[float], digits: int = 2, unit: str = "") -> str:
    """The median of ``values``, and their min-max when there is more than one."""
    data = list(values)
    text = f"{median(data):.{digits}f}{unit}"
    if len(data) > 1:
        text += f" ({min(data):.{digits}f}-{max(data):.{digits}f}{unit})"
    return text


#: The engine configurations of the throughput measurement, and how the report names them.
ENGINES = (("greedy_only", "greedy-only engine"), ("sampling", "sampling engine"))


def continuous(results: dict[str, Any]) -> dict[str, Any] | None:
    """results["batching"] when it holds continuous-batching figures (results of the static
    batching suite it replaced carry other ones)."""
    b = results.get("batching")
    return b if b and "throughput" in b else None


def _t_batching(results: dict[str, Any]) -> list[Row]:
    b = continuous(results)
    if not b:
        return []
    hol, arr, greedy = b["head_of_line"], b["arrivals"], b["greedy"]
    before = sum(bool(r["all_short_before_half"] and r["ok"]) for r in hol)
    out = [
        _target(
            "continuous batching: head-of-line",
            "7 short results before the long job is half done",
            f"{before}/{len(hol)} repetition(s); the last short result "
            f"{median(r['last_short_after_long_start_s'] for r in hol):.2f} s into a "
            f"{median(r['long_run_s'] for r in hol):.2f} s long job (medians)",
            before == len(hol),
        ),
        _target(
            "continuous batching: arrivals",
            "short p99 <= 0.25x the long jobs' median run time",
            f"{spread((r['ratio'] for r in arr), unit='x')}; p99 "
            f"{median(r['short_p99_s'] for r in arr):.2f} s vs "
            f"{median(r['long_run_median_s'] for r in arr):.2f} s (medians)",
            median(r["ratio"] for r in arr) <= 0.25 and all(r["ok"] for r in arr),
        ),
    ]
    for engine, label in ENGINES:
        runs = [t[engine] for t in b["throughput"]]
        ratio = median(r["ratio_to_best_direct"] for r in runs)
        best = [max(r["direct_tok_s"].values()) for r in runs]
        out.append(
            _target(
                f"continuous batching: throughput, {label}",
                ">= 0.8x the engine alone (its best of 8/16/64 in flight)",
                f"{spread((r['ratio_to_best_direct'] for r in runs), unit='x')}; "
                f"{median(r['worker_tok_s'] for r in runs):.0f} vs {median(best):.0f} tok/s "
                "(medians)",
                ratio >= 0.8,
            )
        )
    out.append(
        _target(
            "continuous batching: greedy outputs",
            "identical to single-prompt generate",
            f"{'identical' if greedy['identical'] else 'different'} ({greedy['jobs']} jobs)",
            greedy["identical"],
        )
    )
    return out
