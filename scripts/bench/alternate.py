"""One dispatch shape on two trees, alternating: whether a change made dispatch slower where the
suites' few short runs cannot tell (on a shared 2-core host single runs of one shape differ by up
to 2x).

    .venv/bin/python -m scripts.bench.alternate OLD_DIR NEW_DIR [--procs 1] [--slots 1]
        [--mode prefill] [--jobs 600] [--runs 3] [--pairs 8] [--cold] [--json FILE]

OLD_DIR and NEW_DIR are checkouts of the two commits (``git worktree add DIR COMMIT``). Each
pair runs one process in each tree, which goes first alternating. A process imports that tree's
own bench harness (``scripts.bench.core.Bench``: a ZooKeeper and agent processes of its own, the
tree's zkq), runs the shape once with 100 jobs to warm up (not with ``--cold``: then the timed
run is the process's first, as the suites' first shape is), then ``--runs`` timed runs
(``scripts.bench.dispatch.zkq_run``, the suites' own run). Any two commits since the bench became
the package ``scripts.bench`` (67c0787) compare: their harness has these names.

Reported: the medians over every run of the rate, the workers' and ZooKeeper's CPU a job and
the head's timers, each tree's and new / old.
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path
from typing import Any

from scripts.bench.core import report

#: Run in each tree (``python -c``, the tree first on the path): the shape's runs, as one JSON
#: line. Only names every tree's bench harness has.
_PROGRAM = """
import json, sys, tempfile
from pathlib import Path
from scripts.bench.core import Bench, Config
from scripts.bench.dispatch import zkq_run

def main():
    shape = json.loads(sys.argv[1])
    with tempfile.TemporaryDirectory() as out:
        run(Bench(Config.make(quick=False, scenarios=()), Path(out)), *shape)

def run(bench, procs, slots, mode, jobs, runs, cold):
    try:
        if not cold:
            zkq_run(bench, procs, slots, mode, 100)
        rows = []
        for _ in range(runs):
            row = zkq_run(bench, procs, slots, mode, jobs)
            timers = {k: v["mean_ms"] for k, v in row["timers"].items() if "mean_ms" in v}
            rows.append({
                "rate": row["rate"],
                "worker_cpu_ms": row["per_job"]["worker_cpu_ms"],
                "server_cpu_ms": row["per_job"]["server_cpu_ms"],
                **{f"{k}_ms": v for k, v in timers.items() if k != "jobs_per_turn"},
            })
        print("ROWS " + json.dumps(rows))
    finally:
        bench.close()

if __name__ == "__main__":
    main()
"""


def run_tree(tree: Path, shape: list[Any]) -> list[dict[str, float]]:
    """One process's runs of the shape in ``tree``."""
    done = subprocess.run(
        [sys.executable, "-c", _PROGRAM, json.dumps(shape)],
        cwd=tree,
        env={**os.environ, "PYTHONPATH": str(tree)},
        capture_output=True,
        text=True,
        check=False,
    )
    found = [line for line in done.stdout.splitlines() if line.startswith("ROWS ")]
    if done.returncode or not found:
        raise SystemExit(f"the run in {tree} failed:\n{done.stderr[-3000:]}")
    rows: list[dict[str, float]] = json.loads(found[0].removeprefix("ROWS "))
    return rows


def summarize(out: dict[str, Any]) -> list[str]:
    old, new = out["old"], out["new"]
    lines = [
        f"{out['shape']}: {len(old)} runs a tree; medians, old / new (new / old)",
    ]
    for name in old[0]:
        if not all(name in r for r in old + new):
            continue
        a = statistics.median(r[name] for r in old)
        b = statistics.median(r[name] for r in new)
        ratio = f"{b / a:.3f}" if a else "-"
        lines.append(f"  {name:<18} {a:9.3f} / {b:9.3f}  ({ratio})")
    return lines


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.alternate")
    parser.add_argument("old", type=Path, help="checkout of the commit before")
    parser.add_argument("new", type=Path, help="checkout of the commit after")
    parser.add_argument("--procs", type=int, default=1, help="worker processes")
    parser.add_argument("--slots", type=int, default=1, help="slots a worker")
    parser.add_argument("--mode", choices=("prefill", "stream"), default="prefill")
    parser.add_argument("--jobs", type=int, default=600, help="jobs a timed run")
    parser.add_argument("--runs", type=int, default=3, help="timed runs a process")
    parser.add_argument("--pairs", type=int, default=8)
    parser.add_argument("--cold", action="store_true", help="no warm-up run (and --runs 1)")
    parser.add_argument("--json", default=None)
    args = parser.parse_args(argv)
    for tree in (args.old, args.new):
        if not (tree / "scripts" / "bench" / "dispatch.py").is_file():
            parser.error(f"{tree} is not a checkout of zkq with its bench")
    if args.pairs < 1 or args.runs < 1 or args.jobs < 1:
        parser.error("--pairs, --runs and --jobs take a whole number from 1")
    runs = 1 if args.cold else args.runs
    shape = [args.procs, args.slots, args.mode, args.jobs, runs, args.cold]
    name = f"{args.procs}x{args.slots} {args.mode}{' cold' if args.cold else ''}"
    out: dict[str, Any] = {"args": {**vars(args), "old": str(args.old), "new": str(args.new)}}
    out.update(shape=name, old=[], new=[])
    trees = [("old", args.old.resolve()), ("new", args.new.resolve())]
    for pair in range(args.pairs):
        for label, tree in trees if pair % 2 == 0 else trees[::-1]:
            rows = run_tree(tree, shape)
            out[label] += rows
            rates = ", ".join(f"{r['rate']:.1f}" for r in rows)
            print(f"pair {pair} {label}: {rates} jobs/s", flush=True)
    report(out, summarize(out), args.json)
    return 0


if __name__ == "__main__":
    sys.exit(main())
