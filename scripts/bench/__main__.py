"""zkq benchmarks: every suite, against a ZooKeeper (and a Redis) this command starts itself.

Results go to an output folder: results.json, results.md and PNG plots. From the repository root:

    .venv/bin/python -m scripts.bench --quick              # under 2 minutes, one repetition
    .venv/bin/python -m scripts.bench                      # full: 3 repetitions, ~10-15 minutes
    .venv/bin/python -m scripts.bench dispatch herd --out bench-results/x
    .venv/bin/python -m scripts.bench --report-only --out docs/bench

Suites: warmup (always runs), dispatch (zkq vs kazoo LockingQueue), latency, herd, depth, bulk,
batching (continuous batching, tiny model on CPU), redis (baseline), profile (pyinstrument);
knee (admission at the engine's knee; runs only when named, ~5 minutes).
See BENCHMARKS.md.
Suites that start their own processes and servers run as modules of this package:
``python -m scripts.bench.gateway`` (zkq serve).
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
from dataclasses import asdict
from importlib.metadata import version as package_version
from pathlib import Path
from typing import Any

from scripts.bench import (
    dispatch,
    herd,
    model,
    plots,
    profile,
    report,
    scale,
    scenarios,
    soak,
    targets,
)
from scripts.bench.core import Bench, Config
from zkqueue import defaults

Log = Callable[[str], None]

#: Every suite, in the order a run takes them, and the function that runs it.
SUITES: dict[str, Callable[[Bench, Log], Any]] = {
    "warmup": scenarios.run_warmup,
    "dispatch": dispatch.run_dispatch,
    "latency": scenarios.run_latency,
    "herd": herd.run_herd,
    "depth": scenarios.run_depth,
    "bulk": scenarios.run_bulk,
    "batching": model.run_batching,
    "knee": model.run_knee,
    "redis": dispatch.run_redis,
    "profile": profile.run_profile,
    "scale": scale.run_scale,
    "soak": soak.run_soak,
}
#: Suites that run only when named (minutes each).
OPT_IN = {"scale", "soak", "knee"}


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        prog="python -m scripts.bench", description=(__doc__ or "").splitlines()[0]
    )
    parser.add_argument("suites", nargs="*", help=f"suites to run (all by default): {list(SUITES)}")
    parser.add_argument("--quick", action="store_true", help="small counts, one repetition")
    parser.add_argument("--out", default="bench-results", help="output folder")
    parser.add_argument(
        "--only", default="", help="comma-separated suites (as the positional ones)"
    )
    parser.add_argument("--skip", default="", help="comma-separated suites to leave out")
    parser.add_argument("--reps", type=int, default=None, help="repetitions (override)")
    parser.add_argument("--no-plots", action="store_true", help="skip the PNG plots")
    parser.add_argument(
        "--report-only",
        action="store_true",
        help="rebuild results.md and the plots from OUT/results.json without running anything",
    )
    return parser.parse_args(argv)


def chosen(args: argparse.Namespace) -> tuple[str, ...]:
    only = {s for s in args.only.split(",") if s} | set(args.suites)
    skip = {s for s in args.skip.split(",") if s}
    unknown = (only | skip) - set(SUITES)
    if unknown:
        raise SystemExit(f"unknown suite(s): {', '.join(sorted(unknown))}")
    # The long suites run only when named.
    default = [s for s in SUITES if s not in OPT_IN]
    return tuple(
        s
        for s in SUITES
        if (s in only or s == "warmup" or (not only and s in default)) and s not in skip
    )


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.report_only:
        return rebuild(Path(args.out), not args.no_plots)
    suites = chosen(args)
    config = Config.make(args.quick, suites)
    if args.reps is not None:
        config.reps = args.reps
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    started = time.time()
    log(f"zkq bench: {'quick' if args.quick else 'full'} mode, suites {', '.join(suites)}")
    bench = Bench(config, out)
    results: dict[str, Any] = {"meta": meta(args, config, bench)}
    errors: dict[str, str] = {}
    try:
        for name in suites:
            try:
                results[name] = run_suite(name, bench)
            except Exception:  # one failed suite must not lose the others' figures
                errors[name] = traceback.format_exc()
                log(f"[{name}] FAILED:\n{errors[name]}")
    finally:
        bench.close()
    results["errors"] = errors
    results["meta"]["wall_s"] = time.time() - started
    results["meta"]["load_average_at_end"] = os.getloadavg()
    results["targets"] = targets.targets(results)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / "results.md").write_text(report.markdown(results))
    if not args.no_plots:
        plots.plots(results, out, log)
    log(f"done in {results['meta']['wall_s']:.0f} s: {out / 'results.md'}")
    for target in results["targets"]:
        log(f"  {'MET ' if target['met'] else 'MISS'} {target['name']}: {target['value']}")
    return 1 if errors else 0


def rebuild(out: Path, with_plots: bool) -> int:
    results = json.loads((out / "results.json").read_text())
    results["targets"] = targets.targets(results)
    (out / "results.json").write_text(json.dumps(results, indent=1, default=str) + "\n")
    (out / "results.md").write_text(report.markdown(results))
    if with_plots:
        plots.plots(results, out, log)
    log(f"rebuilt {out / 'results.md'}")
    return 0


def run_suite(name: str, bench: Bench) -> Any:
    start = time.time()
    log(f"[{name}]")
    value = SUITES[name](bench, log)
    log(f"[{name}] {time.time() - start:.1f} s")
    return value


def meta(args: argparse.Namespace, config: Config, bench: Bench) -> dict[str, Any]:
    version = bench.zk.command(b"srvr").splitlines()[0].split(",")[0] if bench.zk.connected else ""
    return {
        "command": " ".join(["python -m scripts.bench", *sys.argv[1:]]),
        "mode": "quick" if args.quick else "full",
        "started": time.strftime("%Y-%m-%d %H:%M:%S %Z"),
        "host": platform.node(),
        "cpus": os.cpu_count(),
        "python": platform.python_version(),
        "kazoo": package_version("kazoo"),
        "lockingqueue_handler": os.environ.get("ZKQ_BENCH_LQ_HANDLER") or "kazoo",
        "zookeeper": version,
        "default_worker_slots": defaults.WORKER_SLOTS,
        "load_average_at_start": os.getloadavg(),
        "config": asdict(config),
    }


def log(message: str) -> None:
    print(message, flush=True)


if __name__ == "__main__":
    sys.exit(main())
