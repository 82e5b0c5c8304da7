"""Admission at the engine's knee, against the old admission: the model worker's slots.

    .venv/bin/python -m scripts.bench.knee [--reps 3] [--jobs 200] [--new-tokens 128] [--quick]
        [--json FILE]

Everything runs in this process on the CPU with one torch thread, on the tiny test model, as
``scripts.bench.continuous`` does. First the worker's own calibration (``workers.model
.build_model_runner``, fresh cache): its curve, its knee and how long it took. Then, per
repetition, one low-priority backlog (``--jobs`` jobs of ~100 prompt tokens and ``--new-tokens``
new tokens, end of sequence ignored) submitted before one real worker starts, and one
high-priority job once a third of it is done, for each setting:

* ``knee``: the new default, the calibrated slots, the engine stepping as many;
* ``old_default``: 256 slots (what the cache admits, at most 256), the engine stepping 16;
* ``mc16`` / ``mc32`` / ``mc64``: ``--max-concurrency`` N before the knee (the engine stepping 16).

Each gives tokens/s (first start to last completion), CPU seconds of this process per job, the
high-priority job's submit-to-result and run seconds, and the knee's throughput ratio to the best
other setting of the same repetition. Last, the arrivals trace of
``scripts.bench.continuous`` (short p99 against the long median; must stay <= 0.25x) at a worker
with the knee's slots.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
import time
from pathlib import Path
from typing import Any

import torch

from scripts.bench.continuous import OLD_STEP, Stage, arrivals, prompt_of
from workers.calibration import Slots
from workers.model import build_model_runner
from workers.options import MODEL_SLOTS, WorkerOptions

#: Setting name -> (slots, engine step) for the old admission.
OLD = {"old_default": (MODEL_SLOTS, OLD_STEP), "mc16": (16, 16), "mc32": (32, 16), "mc64": (64, 16)}


def calibrate(stage: Stage, workdir: Path) -> tuple[Slots, int, float]:
    """The worker's own calibration on a fresh cache: (slots, cache pages, seconds)."""
    opts = WorkerOptions(
        model=str(workdir / "tiny"), device="cpu", calibration_cache=str(workdir / "cache")
    )
    began = time.monotonic()
    runner, _ = build_model_runner(opts)
    seconds = time.monotonic() - began
    try:
        assert runner.slots is not None
        return runner.slots, runner.cache_pages, seconds
    finally:
        runner.close()


def backlog(
    stage: Stage, slots: int, step: int, pages: int, jobs: int, new_tokens: int
) -> dict[str, float]:
    """One low-priority backlog through a worker of ``slots`` slots stepping ``step``; once a
    third of it is done, one high-priority job of the same prompt length and 64 new tokens
    arrives: how long from its submission to its result (the priority that admission keeps)."""
    root = stage.root()
    with stage.client(root) as client:
        handles = [
            client.submit(
                prompt_of(100, 1000 + i),
                priority="low",
                max_new_tokens=new_tokens,
                ignore_eos=True,
                detach=True,
            )
            for i in range(jobs)
        ]
        cpu = time.process_time()
        with stage.worker(root, slots=slots, step=step, pages=pages) as worker:
            deadline = time.monotonic() + 1800
            while worker.stats.completed < jobs // 3 and time.monotonic() < deadline:
                time.sleep(0.05)
            sent = time.time()
            high = client.submit(
                prompt_of(100, 7), priority="high", max_new_tokens=64, ignore_eos=True, detach=True
            )
            while worker.stats.completed < jobs + 1 and time.monotonic() < deadline:
                time.sleep(0.05)
            cpu = time.process_time() - cpu
        records = [h.result(timeout=60) for h in [*handles, high]]
    tokens = sum(int(r["output_tokens"]) for r in records)
    started = min(r.started_at or 0.0 for r in records)
    finished = max(r.finished_at or 0.0 for r in records)
    urgent = records[-1]
    return {
        "tok_s": round(tokens / (finished - started), 1),
        "cpu_ms_per_job": round(1000 * cpu / (jobs + 1), 1),
        "high_s": round((urgent.finished_at or 0.0) - sent, 3),
        "high_run_s": round((urgent.finished_at or 0.0) - (urgent.started_at or 0.0), 3),
        "ok": float(all(r.ok for r in records)),
    }


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.knee")
    parser.add_argument("--reps", type=int, default=None, help="3 (1 when quick)")
    parser.add_argument("--jobs", type=int, default=None, help="200 (40 when quick)")
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--quick", action="store_true")
    parser.add_argument("--json", default=None, help="write the figures here, not to stdout")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    reps = args.reps if args.reps is not None else 1 if args.quick else 3
    jobs = args.jobs if args.jobs is not None else 40 if args.quick else 200
    figures: dict[str, Any] = {"jobs": jobs, "new_tokens": args.new_tokens, "reps": reps}
    with tempfile.TemporaryDirectory() as tmp:
        stage = Stage(Path(tmp))
        try:
            slots, pages, seconds = calibrate(stage, Path(tmp))
            knee_n = slots.count
            figures["calibration"] = {**slots.record(), "seconds": round(seconds, 2)}
            print("calibration", json.dumps(figures["calibration"]), flush=True)
            settings = {"knee": (knee_n, knee_n), **OLD}
            runs: list[dict[str, Any]] = []
            names = list(settings)
            for rep in range(reps):
                # Each repetition starts one setting later: a slow minute on a shared machine
                # does not always land on the same setting.
                order = names[rep % len(names) :] + names[: rep % len(names)]
                run: dict[str, Any] = {
                    name: backlog(stage, *settings[name], pages, jobs, args.new_tokens)
                    for name in order
                }
                best = max(run[name]["tok_s"] for name in OLD)
                run["knee_over_best_old"] = round(run["knee"]["tok_s"] / best, 3)
                runs.append(run)
                print("backlog", json.dumps(run), flush=True)
            figures["backlog"] = runs
            figures["medians"] = {
                name: statistics.median(r[name]["tok_s"] for r in runs) for name in settings
            }
            figures["knee_over_best_old_median"] = statistics.median(
                r["knee_over_best_old"] for r in runs
            )
            medians = figures["medians"]
            figures["knee_median_over_best_old_median"] = round(
                medians["knee"] / max(medians[name] for name in OLD), 3
            )
            figures["high_s_medians"] = {
                name: statistics.median(r[name]["high_s"] for r in runs) for name in settings
            }
            figures["arrivals"] = [arrivals(stage, knee_n, knee_n) for _ in range(reps)]
            print("arrivals", json.dumps(figures["arrivals"]), flush=True)
        finally:
            stage.close()
    text = json.dumps(figures, indent=2)
    if args.json:
        Path(args.json).write_text(text)
    else:
        print(text)


if __name__ == "__main__":
    main()
