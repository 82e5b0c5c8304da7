"""Continuous batching through the worker, against the engine alone: the model worker's figures.

    .venv/bin/python -m scripts.bench.continuous [--reps 3] [--quick] [--json FILE]

Everything runs in this process on the CPU with one torch thread, on the tiny test model: a local
ZooKeeper, one in-process worker (the real loop: line, head turn, claims, fenced completions)
with the HF runner, and producers. Four measurements, each repeated ``--reps`` times:

1. Head-of-line: 1 job of 300 new tokens and 7 of 4 are pending before an 8-slot worker starts;
   when is each short result written, against the long job's half-way point?
2. Arrivals: 80 greedy jobs, one every 50 ms, 3 short (4-16 new tokens) to 1 long (250-300) in a
   fixed shuffled order, at one 16-slot worker: the short jobs' p99 submit-to-result against
   the long jobs' median run time.
3. Throughput: 64 mixed prompts (7-240 prompt tokens, 12-127 new tokens, greedy) submitted before
   a 64-slot worker starts (its engine takes 16 requests a step, as a model worker on the CPU
   does), tokens/s from the first start to the last completion; and the same prompts through the
   library's continuous batching called directly with 8, 16 and 64 requests in flight (its best
   is the reference). Both with the same cache (512 pages of 32 tokens, 256 batch tokens), for a
   greedy-only engine and for one that also serves sampled jobs.
4. Greedy outputs through the worker against single-prompt ``generate``.

Lengths are exact: every job sets ``ignore_eos`` (the random-weight model would otherwise stop at
a random end-of-sequence), so the runs compare the same work.
"""

from __future__ import annotations

import argparse
import json
import random
import statistics
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import torch
from transformers import ContinuousBatchingConfig, GenerationConfig

from workers.admission import Admission
from workers.loop import Worker
from workers.model import load
from workers.options import WorkerOptions
from workers.runners.hf import HFRunner
from workers.tinymodel import write_tiny_model
from zkqueue import Client
from zkqueue.plumbing.connection import ConnectionSettings
from zkqueue.testing import ZkCluster

PAGES, PAGE_TOKENS, BATCH_TOKENS = 512, 32, 256
#: Requests in one engine step of a model worker on the CPU before admission at the knee
#: (workers.calibration): 16, whatever its slots. The figures here keep that step unless told.
OLD_STEP = 16
_WORDS = (
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
)


def prompt_of(tokens: int, seed: int) -> str:
    """A prompt of roughly ``tokens`` words (the tiny tokenizer gives about a token per word)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(max(1, tokens)))


def mixed(n: int = 64) -> list[tuple[str, int]]:
    rng = random.Random(64)
    return [(prompt_of(rng.randint(7, 240), i), rng.randint(12, 127)) for i in range(n)]


class Stage:
    """ZooKeeper, the tiny model loaded once, and fresh roots per measurement."""

    def __init__(self, workdir: Path) -> None:
        self.cluster = ZkCluster(1).start()
        model_dir = write_tiny_model(workdir / "tiny", seed=0)
        self.tokenizer, self.model = load(model_dir, torch.device("cpu"), torch.float32)
        self._roots = 0

    def close(self) -> None:
        self.cluster.stop()

    def root(self) -> str:
        self._roots += 1
        return f"/cb-{self._roots}"

    def runner(
        self, slots: int, sampling: bool, step: int | None = None, pages: int = PAGES
    ) -> HFRunner:
        """``step``: requests in one engine step (default: ``OLD_STEP`` at most)."""
        return HFRunner(
            self.tokenizer,
            self.model,
            pages=pages,
            page_tokens=PAGE_TOKENS,
            max_batch_tokens=BATCH_TOKENS,
            max_requests=step or min(slots, OLD_STEP),
            sampling=sampling,
        )

    @contextmanager
    def worker(
        self,
        root: str,
        slots: int,
        sampling: bool = True,
        step: int | None = None,
        pages: int = PAGES,
    ) -> Iterator[Worker]:
        runner = self.runner(slots, sampling, step, pages)
        admission = Admission(
            pages, PAGE_TOKENS, count_tokens=runner.count_tokens, validate=runner.validate
        )
        zk = ConnectionSettings(hosts=self.cluster.hosts, session_timeout=10).make_client()
        zk.start(10)
        worker = Worker(
            zk, runner, WorkerOptions(root=root, max_concurrency=slots), admission=admission
        )
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        worker.ready.wait(30)
        try:
            yield worker
        finally:
            worker.stop(drain=False)
            thread.join(30)
            runner.close()
            zk.stop()
            zk.close()

    def client(self, root: str) -> Client:
        return Client(self.cluster.hosts, root).start()


def head_of_line(stage: Stage) -> dict[str, Any]:
    root = stage.root()
    with stage.client(root) as client:
        long = client.submit(prompt_of(8, 1), max_new_tokens=300, ignore_eos=True, detach=True)
        short = [
            client.submit(prompt_of(8, 10 + i), max_new_tokens=4, ignore_eos=True, detach=True)
            for i in range(7)
        ]
        with stage.worker(root, slots=8):
            records = [j.result(timeout=300) for j in [long, *short]]
    first = records[0]
    assert first.started_at is not None and first.finished_at is not None
    half = first.started_at + (first.finished_at - first.started_at) / 2
    last_short = max(r.finished_at or 0.0 for r in records[1:])
    return {
        "long_run_s": round(first.finished_at - first.started_at, 3),
        "last_short_after_long_start_s": round(last_short - first.started_at, 3),
        "all_short_before_half": last_short < half,
        "ok": all(r.ok for r in records),
    }


def arrivals(stage: Stage, slots: int = 16, step: int | None = None) -> dict[str, Any]:
    """The arrivals trace at a worker of ``slots`` slots (engine step ``step``)."""
    rng = random.Random(80)
    kinds = ["short"] * 60 + ["long"] * 20
    rng.shuffle(kinds)
    root = stage.root()
    jobs: list[tuple[str, float, Any]] = []
    with stage.client(root) as client, stage.worker(root, slots=slots, step=step):
        start = time.monotonic()
        for i, kind in enumerate(kinds):
            time.sleep(max(0.0, start + i * 0.05 - time.monotonic()))
            new = rng.randint(4, 16) if kind == "short" else rng.randint(250, 300)
            job = client.submit(
                prompt_of(8, 100 + i), max_new_tokens=new, ignore_eos=True, detach=True
            )
            jobs.append((kind, time.time(), job))
        done = [(kind, sent, job.result(timeout=600)) for kind, sent, job in jobs]
    short = sorted((r.finished_at or 0.0) - sent for kind, sent, r in done if kind == "short")
    long_runs = [
        (r.finished_at or 0.0) - (r.started_at or 0.0) for kind, _, r in done if kind == "long"
    ]
    p99 = short[min(len(short) - 1, round(0.99 * (len(short) - 1)))]
    median_long = statistics.median(long_runs)
    return {
        "short_p50_s": round(statistics.median(short), 3),
        "short_p99_s": round(p99, 3),
        "long_run_median_s": round(median_long, 3),
        "ratio": round(p99 / median_long, 3),
        "ok": all(r.ok for _, _, r in done),
    }


def worker_throughput(stage: Stage, prompts: list[tuple[str, int]], sampling: bool) -> float:
    """The producer reads the results only once the worker has written them all (a producer is
    another process in production; here it must not compete with the worker for the GIL)."""
    root = stage.root()
    with stage.client(root) as client:
        jobs = [
            client.submit(p, max_new_tokens=n, ignore_eos=True, detach=True) for p, n in prompts
        ]
        with stage.worker(root, slots=len(prompts), sampling=sampling) as worker:
            deadline = time.monotonic() + 600
            while worker.stats.completed < len(jobs) and time.monotonic() < deadline:
                time.sleep(0.05)
            records = [j.result(timeout=60) for j in jobs]
    tokens = sum(int(r["output_tokens"]) for r in records)
    started = min(r.started_at or 0.0 for r in records)
    finished = max(r.finished_at or 0.0 for r in records)
    return tokens / (finished - started)


def direct_throughput(
    stage: Stage, prompts: list[tuple[str, int]], in_flight: int, sampling: bool
) -> float:
    """The library's continuous batching alone: ``in_flight`` requests at a time."""
    knobs = {"temperature": 0.5, "top_k": 50, "top_p": 0.9} if sampling else {}
    manager = stage.model.init_continuous_batching(
        generation_config=GenerationConfig(do_sample=sampling, **knobs),
        continuous_batching_config=ContinuousBatchingConfig(
            num_blocks=PAGES,
            page_size=PAGE_TOKENS,
            max_batch_tokens=BATCH_TOKENS,
            max_requests_per_batch=in_flight,
            per_request_processors=sampling,
            max_memory_percent=1.0,
        ),
    )
    per_request = {"temperature": 1.0, "top_k": 1, "top_p": 1.0} if sampling else {}
    encoded = [(stage.tokenizer(p)["input_ids"], n) for p, n in prompts]
    with torch.inference_mode():
        manager.warmup()
        manager.start()
    try:
        started = time.monotonic()
        sent, tokens, open_ = 0, 0, 0
        while sent < len(encoded) or open_:
            while open_ < in_flight and sent < len(encoded):
                ids, n = encoded[sent]
                manager.add_request(
                    ids, request_id=f"r{sent}", max_new_tokens=n, eos_token_id=-1, **per_request
                )
                sent, open_ = sent + 1, open_ + 1
            out = manager.get_result(timeout=60)
            if out is None:
                raise RuntimeError("the engine stopped answering")
            if out.is_finished():
                open_ -= 1
                tokens += len(out.generated_tokens)
        return tokens / (time.monotonic() - started)
    finally:
        manager.stop(block=True, timeout=30)


def throughput(stage: Stage, quick: bool) -> dict[str, Any]:
    prompts = mixed(16 if quick else 64)
    out: dict[str, Any] = {}
    for sampling in (False, True):
        direct = {k: direct_throughput(stage, prompts, k, sampling) for k in (8, 16, 64)}
        through = worker_throughput(stage, prompts, sampling)
        best = max(direct.values())
        out["sampling" if sampling else "greedy_only"] = {
            "direct_tok_s": {k: round(v, 1) for k, v in direct.items()},
            "worker_tok_s": round(through, 1),
            "ratio_to_best_direct": round(through / best, 3),
        }
    return out


def greedy_matches(stage: Stage) -> dict[str, Any]:
    root = stage.root()
    cases = [(prompt_of(n, 500 + n), m) for n, m in ((5, 9), (40, 17), (120, 33), (12, 5))]
    with stage.client(root) as client, stage.worker(root, slots=8):
        got = [
            j.result(timeout=120).output
            for j in [client.submit(p, max_new_tokens=m, detach=True) for p, m in cases]
        ]
    want = []
    for p, m in cases:
        enc = stage.tokenizer(p, return_tensors="pt")
        with torch.inference_mode():
            ids = stage.model.generate(**enc, max_new_tokens=m, do_sample=False)
        new = ids[0, enc["input_ids"].shape[1] :].tolist()
        eos = stage.tokenizer.eos_token_id
        new = new[: new.index(eos)] if eos in new else new
        want.append(stage.tokenizer.decode(new, skip_special_tokens=True))
    return {"identical": got == want, "jobs": len(cases)}


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m scripts.bench.continuous")
    parser.add_argument("--reps", type=int, default=None, help="3 (1 when quick)")
    parser.add_argument("--quick", action="store_true", help="one rep, 16 throughput prompts")
    parser.add_argument("--json", default=None, help="write the figures here, not to stdout")
    args = parser.parse_args(argv)
    torch.set_num_threads(1)
    reps = args.reps if args.reps is not None else 1 if args.quick else 3
    with tempfile.TemporaryDirectory() as tmp:
        stage = Stage(Path(tmp))
        try:
            figures: dict[str, Any] = {"greedy": greedy_matches(stage)}
            for name, run in (("head_of_line", head_of_line), ("arrivals", arrivals)):
                figures[name] = [run(stage) for _ in range(reps)]
                print(name, json.dumps(figures[name]), flush=True)
            figures["throughput"] = [throughput(stage, args.quick) for _ in range(reps)]
            print("throughput", json.dumps(figures["throughput"]), flush=True)
        finally:
            stage.close()
    if args.json:
        Path(args.json).write_text(json.dumps(figures, indent=2))
    else:
        print(json.dumps(figures, indent=2))


if __name__ == "__main__":
    main()
