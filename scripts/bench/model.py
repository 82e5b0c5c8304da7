"""Scenario 6: batching with the tiny model on CPU. 64 jobs pre-filled, one worker with 8 slots
against one with 1 slot, and two references without a queue in the same process: batched
``model.generate`` called directly, and the HF runner called directly, on the same prompts."""

from __future__ import annotations

import tempfile
from collections.abc import Callable
from pathlib import Path
from typing import Any

from scripts.bench.core import QUEUE, AgentHandle, Bench, median

_WORDS = [
    "queue",
    "worker",
    "priority",
    "job",
    "model",
    "token",
    "batch",
    "memory",
    "cache",
    "result",
    "line",
    "head",
    "claim",
    "fence",
    "zookeeper",
    "session",
    "watch",
    "entry",
    "slot",
    "device",
    "prompt",
    "output",
    "greedy",
    "sample",
    "order",
]


def prompts(n: int) -> list[str]:
    """n distinct short prompts of 6 to 13 words (deterministic)."""
    out = []
    for i in range(n):
        words = [_WORDS[(i * 7 + k * 3) % len(_WORDS)] for k in range(6 + i % 8)]
        out.append(f"Job {i}: " + " ".join(words))
    return out


def run_batching(bench: Bench, log: Callable[[str], None]) -> dict[str, Any]:
    """The figures with torch on one intra-op thread (two cores shared with ZooKeeper and the
    harness); in full mode one more repetition with torch's default thread count, for context."""
    out = _batching(bench, log, "model", torch_threads=1, reps=bench.config.reps)
    if not bench.config.quick:
        log("  again with torch's default thread count:")
        out["torch_default_threads"] = _batching(
            bench, log, "model-default", torch_threads=None, reps=1
        )
    return out


def _batching(
    bench: Bench, log: Callable[[str], None], name: str, torch_threads: int | None, reps: int
) -> dict[str, Any]:
    cfg = bench.config
    model_dir = str(Path(tempfile.gettempdir()) / "zkq-bench-tiny-model")
    agent = bench.special(name)
    texts = prompts(cfg.batch_jobs)
    loaded = agent.call(
        "hf_load",
        timeout=300,
        model_dir=model_dir,
        prompts=texts,
        max_new_tokens=cfg.max_new_tokens,
        batches=list(cfg.batch_slots),
        torch_threads=torch_threads,
    )
    log(
        f"  tiny model loaded in {loaded['load_s']:.1f} s, warmed in {loaded['warm_s']:.1f} s, "
        f"torch threads {loaded['torch_threads']}"
    )
    runs: dict[str, list[float]] = {f"worker_{s}_slots": [] for s in cfg.batch_slots}
    runs["direct_generate"], runs["direct_runner"] = [], []
    timers: dict[str, list[dict[str, Any]]] = {f"worker_{s}_slots": [] for s in cfg.batch_slots}
    for _ in range(reps):
        for slots in cfg.batch_slots:
            elapsed, timed = _worker_run(bench, agent, model_dir, texts, slots)
            runs[f"worker_{slots}_slots"].append(elapsed)
            timers[f"worker_{slots}_slots"].append(timed)
        for kind, command in (
            ("direct_generate", "hf_direct"),
            ("direct_runner", "hf_runner_direct"),
        ):
            done = agent.call(
                command,
                timeout=600,
                model_dir=model_dir,
                prompts=texts,
                max_new_tokens=cfg.max_new_tokens,
                batch=max(cfg.batch_slots),
            )
            runs[kind].append(done["elapsed"])
        log("  " + ", ".join(f"{k} {v[-1]:.2f} s" for k, v in runs.items()))
    bench.drop_special(name)
    summary = _summary(runs, cfg.batch_jobs, cfg.batch_slots, cfg.max_new_tokens)
    summary["torch_threads"] = loaded["torch_threads"]
    summary["worker_timers"] = timers
    summary["queue_own_s"] = _queue_own(runs, timers, max(cfg.batch_slots))
    summary["queue_own_vs_generate"] = summary["queue_own_s"] / median(runs["direct_generate"])
    return summary


def _queue_own(
    runs: dict[str, list[float]], timers: dict[str, list[dict[str, Any]]], slots: int
) -> float:
    """Median over repetitions of (wall time - time inside the runner) of the widest worker:
    the queue's own share, whatever the runner's speed on that repetition."""
    key = f"worker_{slots}_slots"
    return median(
        elapsed - t.get("execute", {}).get("total_s", 0.0)
        for elapsed, t in zip(runs[key], timers[key], strict=True)
    )


def _worker_run(
    bench: Bench, agent: AgentHandle, model_dir: str, texts: list[str], slots: int
) -> tuple[float, dict[str, Any]]:
    """Seconds from go to the last result for a worker with ``slots`` slots, jobs pre-filled,
    and the worker's timers (time in the runner, in claim turns, in completions)."""
    root = bench.fresh_root(f"batch{slots}")
    client = bench.client(root)
    client.ensure_queue(QUEUE)
    agent.call("zkq_start", root=root, queue=QUEUE, slots=slots, model_dir=model_dir)
    max_new = bench.config.max_new_tokens
    client.submit_many(
        [{"prompt": t, "max_new_tokens": max_new} for t in texts], queue=QUEUE, detach=True
    )
    results = client.layout.expiry(QUEUE)
    agent.call("go")
    elapsed = agent.call("wait_completed", timeout=330, n=len(texts), limit=300)
    if elapsed is None:
        raise RuntimeError(f"the {slots}-slot worker did not finish {len(texts)} jobs in 300 s")
    stopped = agent.call("stop", timeout=120)
    failed = [
        r
        for r in (client.job(j, QUEUE).result(timeout=5) for j in _ids(bench, results))
        if not r.ok
    ]
    if failed:
        raise RuntimeError(f"{len(failed)} model jobs failed, e.g. {failed[0].error}")
    return elapsed, stopped.get("timers", {})


def _ids(bench: Bench, expiry: str) -> list[str]:
    """A few finished job ids, from the expiry index (index names are ``<id>-<bytes>``)."""
    ids = [n.split("-")[0] for t in bench.zk.get_children(expiry)
           for n in bench.zk.get_children(f"{expiry}/{t}")]  # fmt: skip
    return ids[:4]


def _summary(
    runs: dict[str, list[float]], jobs: int, slots: tuple[int, ...], max_new: int
) -> dict[str, Any]:
    rates = {k: jobs / median(v) for k, v in runs.items()}
    wide, narrow = f"worker_{max(slots)}_slots", f"worker_{min(slots)}_slots"
    return {
        "jobs": jobs,
        "max_new_tokens": max_new,
        "seconds": runs,
        "jobs_per_s": rates,
        "speedup": rates[wide] / rates[narrow],
        "overhead_vs_generate": rates["direct_generate"] / rates[wide] - 1,
        "overhead_vs_runner": rates["direct_runner"] / rates[wide] - 1,
    }
