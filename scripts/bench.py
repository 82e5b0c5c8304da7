#!/usr/bin/env python
"""zkq benchmark harness: starts its own ZooKeeper (and Redis), runs each scenario against them,
and writes results.json, results.md and PNG plots to an output folder.

    .venv/bin/python scripts/bench.py --quick            # under 2 minutes, one repetition
    .venv/bin/python scripts/bench.py                    # full: 3 repetitions, ~10-15 minutes
    .venv/bin/python scripts/bench.py --only dispatch,herd --out bench-results/x

Scenarios: warmup, dispatch (zkq vs kazoo LockingQueue), latency, herd, depth, bulk, batching
(tiny model on CPU), redis (baseline), profile (pyinstrument). See BENCHMARKS.md.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import sys
import time
import traceback
from collections.abc import Callable
from pathlib import Path
from typing import Any

SCRIPTS = Path(__file__).resolve().parent
REPO = SCRIPTS.parent
for entry in (str(SCRIPTS), str(REPO)):
    if entry not in sys.path:
        sys.path.insert(0, entry)

SCENARIOS = (
    "warmup",
    "dispatch",
    "latency",
    "herd",
    "depth",
    "bulk",
    "batching",
    "redis",
    "profile",
)


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--quick", action="store_true", help="small counts, one repetition")
    parser.add_argument("--out", default="bench-results", help="output folder")
    parser.add_argument("--only", default="", help=f"comma-separated subset of {SCENARIOS}")
    parser.add_argument("--skip", default="", help="comma-separated scenarios to leave out")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (override)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="rebuild results.md and the plots from OUT/results.json without running anything",
    )
    return parser.parse_args(argv)


def chosen(args: argparse.Namespace) -> tuple[str, ...]:
    only = {s for s in args.only.split(",") if s}
    skip = {s for s in args.skip.split(",") if s}
    unknown = (only | skip) - set(SCENARIOS)
    if unknown:
        raise SystemExit(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    return tuple(s for s in SCENARIOS if (not only or s in only or s == "warmup") and s not in skip)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    import bench_core
    import bench_report

    if args.report_only:
        return report(Path(args.out), not args.no_plots)
    scenarios = chosen(args)
    config = bench_core.Config.make(args.quick, scenarios)
    if args.reps is not None:
        config.reps = args.reps
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    log(f"zkq bench: {'quick' if args.quick else 'full'} mode, scenarios {', '.join(scenarios)}")
    bench = bench_core.Bench(config, out)
    results: dict[str, Any] = {"meta": meta(args, config, bench)}
    errors: dict[str, str] = {}
    try:
        for name in scenarios:
            try:
                results[name] = run_scenario(name, bench)
            except Exception:  # one failed scenario must not lose the others' figures
                errors[name] = traceback.format_exc()
                log(f"[{name}] FAILED:\n{errors[name]}")
    finally:
        bench.close()
    results["errors"] = errors
    results["meta"]["wall_s"] = time.time() - started
    results["meta"]["load_average_at_end"] = os.getloadavg()
    results["targets"] = bench_report.targets(results)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / "results.md").write_text(bench_report.markdown(results))
    if not args.no_plots:
        bench_report.plots(results, out, log)
    log(f"done in {results['meta']['wall_s']:.0f} s: {out / 'results.md'}")
    for target in results["targets"]:
        log(f"  {'MET ' if target['met'] else 'MISS'} {target['name']}: {target['value']}")
    return 1 if errors else 0


def report(out: Path, with_plots: bool) -> int:
    import bench_report

    results = json.loads((out / "results.json").read_text())
    results["targets"] = bench_report.targets(results)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / "results.md").write_text(bench_report.markdown(results))
    if with_plots:
        bench_report.plots(results, out, log)
    log(f"rebuilt {out / 'results.md'}")
    return 0


def run_scenario(name: str, bench: Any) -> Any:
    import bench_dispatch
    import bench_model
    import bench_scenarios

    runners: dict[str, Callable[..., Any]] = {
        "warmup": bench_scenarios.run_warmup,
        "dispatch": bench_dispatch.run_dispatch,
        "latency": bench_scenarios.run_latency,
        "herd": bench_scenarios.run_herd,
        "depth": bench_scenarios.run_depth,
        "bulk": bench_scenarios.run_bulk,
        "batching": bench_model.run_batching,
        "redis": bench_dispatch.run_redis,
        "profile": bench_scenarios.run_profile,
    }
    start = time.time()
    log(f"[{name}]")
    value = runners[name](bench, log)
    log(f"[{name}] {time.time() - start:.1f} s")
    return value


def meta(args: argparse.Namespace, config: Any, bench: Any) -> dict[str, Any]:
    from dataclasses import asdict
    from importlib.metadata import version as package_version

    from zkqueue import defaults

    version = bench.zk.command(b"srvr").splitlines()[0].split(",")[0] if bench.zk.connected else ""
    return {
        "command": " ".join(["scripts/bench.py", *sys.argv[1:]]),
        "mode": "quick" if args.quick else "full",
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "kazoo": package_version("kazoo"),
        "zookeeper": version,
        "default_worker_slots": defaults.WORKER_SLOTS,
        "load_average_at_start": os.getloadavg(),
        "config": asdict(config),
    }


def log(message: str) -> None:
    print(message, flush=True)


if __name__ == "__main__":
    sys.exit(main())
