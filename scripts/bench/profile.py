"""pyinstrument profiles of the worker's hot path (pre-filled echo jobs) and of the producers
(submit_many, one-at-a-time submit), written as text next to results.json."""

from __future__ import annotations

from collections.abc import Callable
from pathlib import Path
from typing import Any

from scripts.bench.core import QUEUE, Bench, call_all, wait_until

Log = Callable[[str], None]
_REPO = Path(__file__).resolve().parents[2]


def run_profile(bench: Bench, log: Log) -> dict[str, Any]:
    """pyinstrument on the worker loop thread (1 and 4 processes, pre-filled echo jobs), on
    submit_many and on one-at-a-time submits. Text reports go next to results.json."""
    files = {}
    n = bench.config.dispatch_jobs
    shapes = ((1, 1), (4, 4)) if bench.config.quick else ((1, 1), (4, 1), (4, 4))
    for procs, slots in shapes:
        name = f"profile-worker-{procs}x{slots}.txt"
        text, cpu = _profile_workers(bench, procs, slots, n)
        (bench.out / name).write_text(_relative(cpu + "\n\n" + text))
        files[f"worker_{procs}x{slots}"] = name
    files["submit_many"] = _profile_submit_many(bench, bench.config.bulk_jobs)
    produced = bench.special("producer").call(
        "produce_zkq", root=bench.fresh_root("profsubmit"), queue=QUEUE, n=300, profile=True
    )
    (bench.out / "profile-submit.txt").write_text(_relative(produced["profile"]))
    files["submit"] = "profile-submit.txt"
    log(f"  wrote {', '.join(files.values())}")
    return {"files": files}


def _profile_workers(bench: Bench, procs: int, slots: int, n: int) -> tuple[str, str]:
    root = bench.fresh_root(f"prof{procs}x{slots}")
    client = bench.client(root)
    client.ensure_queue(QUEUE)
    agents = bench.agents(procs)
    call_all(agents, "zkq_start", root=root, queue=QUEUE, slots=slots, profile=True)
    client.submit_many([f"profiled job {i}" for i in range(n)], queue=QUEUE, detach=True)
    before = call_all(agents, "stats")
    call_all(agents, "go")
    results = client.layout.expiry(QUEUE)
    wait_until(lambda: bench.indexed(results) >= n, max(30.0, n / 10))
    stopped = call_all(agents, "stop")
    roles: dict[str, float] = {}
    for a, b in zip(stopped, before, strict=True):
        for role, seconds in a["cpu"].items():
            roles[role] = roles.get(role, 0.0) + seconds - b["cpu"].get(role, 0.0)
    cpu = "CPU ms per job by thread, all worker processes: " + ", ".join(
        f"{k} {v / n * 1e3:.2f}" for k, v in sorted(roles.items())
    )
    return stopped[0].get("profile") or "(no profile)", cpu


def _profile_submit_many(bench: Bench, n: int) -> str:
    from pyinstrument import Profiler

    root = bench.fresh_root("profbulk")
    client = bench.client(root)
    client.ensure_queue(QUEUE)
    profiler = Profiler(interval=0.0005, async_mode="disabled")
    profiler.start()
    client.submit_many([f"bulk job {i}" for i in range(n)], queue=QUEUE, detach=True)
    profiler.stop()
    name = "profile-submit-many.txt"
    (bench.out / name).write_text(_relative(profiler.output_text(show_all=False)))
    return name


def _relative(text: str) -> str:
    """Profiles name source files by absolute path: keep them relative to the repository."""
    return text.replace(f"{_REPO}/", "")
