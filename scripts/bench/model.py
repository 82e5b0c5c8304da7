"""Scenario 6: the model worker on continuous batching (tiny model, CPU). The measurements are
``python -m scripts.bench.continuous``'s (suite ``batching``) and ``python -m scripts.bench.knee``'s
(suite ``knee``: admission at the engine's knee against the old admission), each run here as a
subprocess: they import torch, which must not be imported into the harness (the harness forks the
agent processes)."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import threading
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scripts.bench.core import Bench

#: The repository root, where ``python -m scripts.bench.continuous`` is found.
ROOT = Path(__file__).resolve().parents[2]
#: A full run (3 repetitions, 64 throughput prompts) takes a few minutes on two cores.
LIMIT_S = 1800


def run_batching(bench: Bench, log: Callable[[str], None]) -> dict[str, Any]:
    """The figures of ``scripts.bench.continuous`` (head-of-line, arrivals, throughput against
    the engine alone, greedy identity), one repetition and 16 throughput prompts when quick."""
    with tempfile.TemporaryDirectory(prefix="zkq-bench-cb-") as tmp:
        out = Path(tmp) / "figures.json"
        command = [
            sys.executable,
            "-m",
            "scripts.bench.continuous",
            "--reps",
            str(bench.config.reps),
            "--json",
            str(out),
            *(["--quick"] if bench.config.quick else []),
        ]
        log("  python " + " ".join(command[1:]))
        _run(command, log)
        figures: dict[str, Any] = json.loads(out.read_text())
    figures["reps"] = len(figures.get("throughput", []))
    figures["quick"] = bench.config.quick
    return figures


def run_knee(bench: Bench, log: Callable[[str], None]) -> dict[str, Any]:
    """The figures of ``scripts.bench.knee`` (calibration curve, low-priority backlog at the knee
    against the old settings, arrivals at the knee); 40 jobs, one repetition when quick."""
    with tempfile.TemporaryDirectory(prefix="zkq-bench-knee-") as tmp:
        out = Path(tmp) / "figures.json"
        command = [sys.executable, "-m", "scripts.bench.knee", "--reps", str(bench.config.reps)]
        command += ["--json", str(out), *(["--quick"] if bench.config.quick else [])]
        log("  python " + " ".join(command[1:]))
        _run(command, log)
        figures: dict[str, Any] = json.loads(out.read_text())
    figures["quick"] = bench.config.quick
    return figures


def _run(command: list[str], log: Callable[[str], None]) -> None:
    """Run ``command`` from the repository root, its output line by line into ``log``; kill it
    after ``LIMIT_S`` seconds."""
    tail: list[str] = []
    with subprocess.Popen(
        command, cwd=ROOT, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True
    ) as proc:
        timer = threading.Timer(LIMIT_S, proc.kill)
        timer.start()
        try:
            assert proc.stdout is not None
            for line in proc.stdout:
                tail = [*tail[-19:], line.rstrip()]
                log(f"  {tail[-1]}")
            code = proc.wait()
        finally:
            timer.cancel()
    if code != 0:
        raise RuntimeError(f"{command[2]} exited with {code}:\n" + "\n".join(tail))
