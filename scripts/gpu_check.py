"""GPU check: a 7B-class random-weight model on a CUDA GPU behind a real zkq worker.

Builds a Llama model with a 7B-class shape (32 layers, 32 heads, 8 key-value heads, hidden 4096)
directly on the GPU, starts a local ZooKeeper and an in-process worker whose admission reads the
device's free memory, floods it with long requests, and prints for every batch the estimated and
the measured peak memory, then the out-of-memory count (must be 0) and tokens/s. It stops itself
after --minutes (default 7). On a machine without CUDA it exits with code 2 and says so.

    .venv/bin/python scripts/gpu_check.py [--jobs 48] [--slots 16] [--prompt-tokens 1024]
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch
from kazoo.client import KazooClient
from transformers import LlamaConfig, LlamaForCausalLM

from workers import kvcache
from workers.daemon import memory_admission
from workers.loop import Worker
from workers.runners.base import Outcome, RunningJob
from workers.runners.hf import HFRunner
from workers.tinymodel import build_tokenizer
from zkqueue import Client
from zkqueue.testing import ZkCluster

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


@dataclass
class BatchFigures:
    size: int
    estimated: int
    measured: int
    tokens: int
    seconds: float


class MeasuringRunner:
    """Wraps the model runner: peak device memory above the resident weights, per batch."""

    def __init__(self, inner: HFRunner, device: torch.device) -> None:
        self.inner = inner
        self.name = inner.name
        self.device = device
        self.batches: list[BatchFigures] = []
        self._lock = threading.Lock()

    def describe(self) -> dict[str, Any]:
        return self.inner.describe()

    def run(self, jobs: list[RunningJob]) -> list[Outcome]:
        with self._lock:  # one batch at a time, so the peak belongs to this batch
            prompts = [self.inner.count_tokens(j.spec.prompt) for j in jobs]
            estimated = kvcache.batch_need_bytes(
                self.inner.config,
                prompts,
                [j.spec.max_new_tokens for j in jobs],
                self.inner.dtype_bytes,
            )
            base = self._allocated()
            self._reset_peak()
            started = time.monotonic()
            outcomes = self.inner.run(jobs)
            tokens = sum(int(o.extra.get("output_tokens", 0)) for o in outcomes)
            measured = self._peak() - base
            self.batches.append(
                BatchFigures(len(jobs), estimated, measured, tokens, time.monotonic() - started)
            )
            return outcomes

    def close(self) -> None:
        self.inner.close()

    def _allocated(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.memory_allocated(self.device))
        return 0

    def _reset_peak(self) -> None:
        if self.device.type == "cuda":
            torch.cuda.reset_peak_memory_stats(self.device)

    def _peak(self) -> int:
        if self.device.type == "cuda":
            return int(torch.cuda.max_memory_allocated(self.device))
        return 0


def build_model(args: argparse.Namespace, device: torch.device) -> HFRunner:
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 7 // 2,
        num_hidden_layers=args.layers,
        num_attention_heads=args.hidden // 128,
        num_key_value_heads=max(1, args.hidden // 512),
        max_position_embeddings=args.prompt_tokens + args.max_new_tokens + 64,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    dtype = getattr(torch, args.dtype)
    started = time.monotonic()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(dtype)
    try:
        with device:
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    # Random weights would never emit eos, which is what a flood of long requests wants.
    model.generation_config.eos_token_id = None
    runner = HFRunner(
        "random-7b-class",
        device=str(device),
        dtype=args.dtype,
        max_batch=args.slots,
        loaded=(tokenizer, model),
    )
    print(
        f"gpu_check: built {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters "
        f"({kvcache.format_size(runner.weight_bytes)}) on {device} in "
        f"{time.monotonic() - started:.1f}s"
    )
    return runner


def long_prompt(runner: HFRunner, tokens: int, salt: int) -> str:
    words = ["queue", "worker", "memory", "slot", "batch", "token", "lease", "fence"]
    text = " ".join(words[(i * 7 + salt) % len(words)] for i in range(tokens))
    while runner.count_tokens(text) > tokens:
        text = text[: int(len(text) * 0.95)]
    return text


def run_check(args: argparse.Namespace, device: torch.device) -> int:
    runner = build_model(args, device)
    measuring = MeasuringRunner(runner, device)
    admission, probe = memory_admission(runner, args.budget, args.reserve)
    print(
        f"gpu_check: admission capacity {kvcache.format_size(admission.capacity or 0)}, "
        f"one job needs about "
        f"{kvcache.format_size(runner.need_bytes(_spec(runner, args)))} (estimate)"
    )
    deadline = time.monotonic() + args.minutes * 60
    with tempfile.TemporaryDirectory(prefix="zkq-gpu-") as tmp, ZkCluster(1, base=Path(tmp)) as zk:
        session = KazooClient(hosts=zk.hosts, timeout=30)
        session.start(timeout=30)
        worker = Worker(session, measuring, slots=args.slots, admission=admission, memory=probe)
        thread = threading.Thread(target=worker.run, daemon=True)
        thread.start()
        started = time.monotonic()
        with Client(zk.hosts) as client:
            specs = [
                {
                    "prompt": long_prompt(runner, args.prompt_tokens, i),
                    "max_new_tokens": args.max_new_tokens,
                }
                for i in range(args.jobs)
            ]
            jobs = client.submit_many(specs)
            records = []
            for job in jobs:
                remaining = max(1.0, deadline - time.monotonic())
                records.append(job.result(timeout=remaining))
        wall = time.monotonic() - started
        worker.stop(drain=False)
        thread.join(30)
        session.stop()
        session.close()
    return report(measuring.batches, records, worker.stats.out_of_memory, wall)


def _spec(runner: HFRunner, args: argparse.Namespace) -> Any:
    from zkqueue.spec import JobSpec

    return JobSpec(
        prompt=long_prompt(runner, args.prompt_tokens, 0), max_new_tokens=args.max_new_tokens
    )


def report(batches: list[BatchFigures], records: list[Any], ooms: int, wall: float) -> int:
    mib = 2**20
    print(
        f"\n{'batch':>5} {'jobs':>4} {'estimated MiB':>14} {'measured MiB':>13} "
        f"{'ratio':>6} {'tokens':>7} {'tok/s':>7}"
    )
    for n, b in enumerate(batches, 1):
        ratio = b.measured / b.estimated if b.estimated else 0.0
        print(
            f"{n:>5} {b.size:>4} {b.estimated / mib:14.0f} {b.measured / mib:13.0f} "
            f"{ratio:6.2f} {b.tokens:>7} {b.tokens / max(b.seconds, 1e-9):7.0f}"
        )
    ok = sum(1 for r in records if r.ok)
    tokens = sum(int(r.get("output_tokens", 0) or 0) for r in records)
    under = sum(1 for b in batches if b.measured > b.estimated)
    print(
        f"\ngpu_check: {ok}/{len(records)} jobs succeeded, out-of-memory batches: {ooms}, "
        f"batches above their estimate: {under}/{len(batches)}"
    )
    print(f"gpu_check: {tokens} tokens in {wall:.1f}s = {tokens / wall:.0f} tokens/s end to end")
    return 0 if ooms == 0 and ok == len(records) else 1


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=48)
    parser.add_argument("--slots", type=int, default=16)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument(
        "--budget",
        type=kvcache.parse_size,
        default=None,
        help="static budget instead of the device's free memory",
    )
    parser.add_argument("--reserve", type=kvcache.parse_size, default=2 * 2**30)
    parser.add_argument("--minutes", type=float, default=7.0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--allow-cpu",
        action="store_true",
        help="run a (small) configuration on the CPU: for testing this script",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    device = torch.device(args.device)
    if device.type == "cuda" and not torch.cuda.is_available():
        print(
            "gpu_check: no CUDA GPU here (torch.cuda.is_available() is False); run it on a "
            "machine with one",
            file=sys.stderr,
        )
        return 2
    if device.type == "cpu" and not args.allow_cpu:
        print(
            "gpu_check: this check is for a CUDA GPU; --allow-cpu runs it on the CPU",
            file=sys.stderr,
        )
        return 2
    return run_check(args, device)


if __name__ == "__main__":
    sys.exit(main())
