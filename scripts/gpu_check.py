"""GPU check: a 7B-class random-weight model on a CUDA GPU, its KV cache sized from the device's
free memory, flooded with long requests through one HF runner (no ZooKeeper needed).

Builds a Llama model with a 7B-class shape (32 layers, 32 heads, 8 key-value heads, hidden 4096)
directly on the GPU, sizes the engine's paged cache (``workers.kvcache.size_cache``) from the
memory probe, admits jobs by KV pages exactly as a worker does (``workers.admission``), and prints
the estimated against the allocated cache bytes, the estimated against the measured peak above
the weights, the out-of-memory count (must be 0) and tokens/s. It stops itself after --minutes.
On a machine without CUDA it exits with code 2; ``--allow-cpu`` runs a small configuration on the
CPU to test the script itself.

    .venv/bin/python scripts/gpu_check.py [--jobs 64] [--slots 32] [--prompt-tokens 1024]
    .venv/bin/python scripts/gpu_check.py --upstream vllm   # the openai runner before vLLM
    .venv/bin/python scripts/gpu_check.py --allow-cpu --device cpu --layers 2 --hidden 256 \\
        --jobs 16 --slots 8 --prompt-tokens 200 --max-new-tokens 32
"""

from __future__ import annotations

import argparse
import os
import sys
import threading
import time
from pathlib import Path
from typing import Any

import torch
from transformers import LlamaConfig, LlamaForCausalLM

from workers import kvcache
from workers.admission import Admission, Verdict
from workers.memory import make_probe
from workers.model import weight_bytes
from workers.runners.base import Outcome, RunningJob
from workers.runners.hf import HFRunner
from workers.tinymodel import build_tokenizer
from zkqueue.protocol.spec import JobSpec

os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))  # run as a script: scripts.*
MIB = 2**20


def build_model(args: argparse.Namespace, device: torch.device) -> tuple[Any, Any]:
    tokenizer = build_tokenizer()
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=args.hidden,
        intermediate_size=args.hidden * 7 // 2,
        num_hidden_layers=args.layers,
        num_attention_heads=max(1, args.hidden // 128),
        num_key_value_heads=max(1, args.hidden // 512),
        max_position_embeddings=args.prompt_tokens + args.max_new_tokens + 64,
        pad_token_id=tokenizer.pad_token_id,
        bos_token_id=tokenizer.bos_token_id,
        eos_token_id=tokenizer.eos_token_id,
    )
    started = time.monotonic()
    previous = torch.get_default_dtype()
    torch.set_default_dtype(getattr(torch, args.dtype))
    try:
        with device:
            model = LlamaForCausalLM(config).eval()
    finally:
        torch.set_default_dtype(previous)
    print(
        f"gpu_check: built {sum(p.numel() for p in model.parameters()) / 1e9:.2f}B parameters "
        f"({kvcache.format_size(weight_bytes(model))}) on {device} in "
        f"{time.monotonic() - started:.1f}s"
    )
    return tokenizer, model


def size(args: argparse.Namespace, model: Any, device: torch.device) -> kvcache.CachePlan:
    weights = weight_bytes(model)
    budget = args.budget
    if budget is None and device.type == "cpu":
        budget = weights + 256 * MIB  # never size a CPU cache from the whole host's memory
    probe = make_probe(str(device), budget, weights)
    try:
        snapshot = probe.snapshot()
    finally:
        probe.close()
    plan = kvcache.size_cache(
        model.config,
        torch.tensor([], dtype=model.dtype).element_size(),
        free_bytes=snapshot.free,
        reserve_bytes=args.reserve,
        page_tokens=args.page_tokens,
        max_batch_tokens=args.batch_tokens,
        flash="flash" in str(model.config._attn_implementation),
    )
    print(
        f"gpu_check: {snapshot.source} probe: {snapshot.free / MIB:.0f} MiB free after the "
        f"weights; reserve {args.reserve / MIB:.0f} MiB; cache {plan.pages} pages of "
        f"{plan.page_tokens} tokens ({plan.cache_bytes / MIB:.0f} MiB) + step peak "
        f"{plan.activation_bytes / MIB:.0f} MiB (estimates)"
    )
    return plan


class Flood:
    """Submits jobs while their pages fit (as a worker's admission does) and gathers outcomes."""

    def __init__(self, runner: HFRunner, admission: Admission, slots: int) -> None:
        self.runner, self.admission, self.slots = runner, admission, slots
        self.outcomes: list[Outcome] = []
        self._pages: dict[str, int] = {}
        self._cond = threading.Condition()

    def done(self, job: RunningJob, outcome: Outcome) -> None:
        with self._cond:
            self.admission.release(self._pages.pop(job.id, 0))
            self.outcomes.append(outcome)
            self._cond.notify_all()

    def run(self, specs: list[JobSpec], deadline: float) -> None:
        pending = list(enumerate(specs))
        with self._cond:
            while len(self.outcomes) < len(specs) and time.monotonic() < deadline:
                while pending and len(self._pages) < self.slots:
                    decision = self.admission.judge(pending[0][1])
                    if decision.verdict != Verdict.ADMIT:
                        if decision.verdict in (Verdict.NEVER, Verdict.REJECT):
                            raise SystemExit(f"gpu_check: a job can never run: {decision.reason}")
                        break
                    index, spec = pending.pop(0)
                    self.admission.reserve(decision.pages)
                    self._pages[f"job-{index}"] = decision.pages
                    job = RunningJob(f"job-{index}", spec, "normal", "default", 1)
                    self.runner.submit(job)
                self._cond.wait(1.0)


def long_prompt(runner: HFRunner, tokens: int, salt: int) -> str:
    words = ["queue", "worker", "memory", "slot", "batch", "token", "lease", "fence"]
    text = " ".join(words[(i * 7 + salt) % len(words)] for i in range(tokens))
    while runner.count_tokens(JobSpec(prompt=text)) > tokens:
        text = text[: int(len(text) * 0.95)]
    return text


def run_check(args: argparse.Namespace, device: torch.device) -> int:
    tokenizer, model = build_model(args, device)
    plan = size(args, model, device)
    if plan.pages < 1:
        print("gpu_check: no KV-cache page fits this budget", file=sys.stderr)
        return 1
    runner = HFRunner(
        tokenizer,
        model,
        name="random-7b-class",
        pages=plan.pages,
        page_tokens=plan.page_tokens,
        max_batch_tokens=args.batch_tokens,
        max_requests=args.slots,
    )
    admission = Admission(
        plan.pages, plan.page_tokens, count_tokens=runner.count_tokens, validate=runner.validate
    )
    flood = Flood(runner, admission, args.slots)
    base = _allocated(device)
    _reset_peak(device)
    runner.start(flood.done)
    engine = runner._engine
    allocated = None if engine is None else engine.allocated_bytes()
    specs = [
        JobSpec(
            prompt=long_prompt(runner, args.prompt_tokens, i),
            max_new_tokens=args.max_new_tokens,
            ignore_eos=True,  # random weights: every job generates all its tokens
        )
        for i in range(args.jobs)
    ]
    started = time.monotonic()
    try:
        flood.run(specs, started + args.minutes * 60)
    finally:
        wall = time.monotonic() - started
        runner.close()
    peak = _peak(device)
    if peak is not None:
        peak -= base
    return report(args, plan, allocated, peak, flood.outcomes, wall)


def report(
    args: argparse.Namespace,
    plan: kvcache.CachePlan,
    allocated: int | None,
    peak: int | None,
    outcomes: list[Outcome],
    wall: float,
) -> int:
    cache = f"{allocated / MIB:.0f} MiB" if allocated is not None else "unknown"
    print(f"gpu_check: cache estimated {plan.cache_bytes / MIB:.0f} MiB, allocated {cache}")
    estimated_peak = plan.cache_bytes + plan.activation_bytes
    measured = f"{peak / MIB:.0f} MiB" if peak is not None else "n/a on the CPU"
    print(
        f"gpu_check: peak above the weights estimated {estimated_peak / MIB:.0f} MiB, "
        f"measured {measured}"
    )
    ok = sum(1 for o in outcomes if o.status == "succeeded")
    ooms = sum(1 for o in outcomes if "out of memory" in (o.error or "").lower() or o.release)
    tokens = sum(int(o.extra.get("output_tokens", 0) or 0) for o in outcomes)
    print(f"gpu_check: {ok}/{args.jobs} jobs succeeded, out-of-memory: {ooms}")
    print(f"gpu_check: {tokens} tokens in {wall:.1f}s = {tokens / max(wall, 1e-9):.0f} tokens/s")
    fits = peak is None or peak <= estimated_peak
    return 0 if ooms == 0 and ok == args.jobs and fits else 1


def _allocated(device: torch.device) -> int:
    return int(torch.cuda.memory_allocated(device)) if device.type == "cuda" else 0


def _reset_peak(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.reset_peak_memory_stats(device)


def _peak(device: torch.device) -> int | None:
    return int(torch.cuda.max_memory_allocated(device)) if device.type == "cuda" else None


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--jobs", type=int, default=64)
    parser.add_argument("--slots", type=int, default=32)
    parser.add_argument("--prompt-tokens", type=int, default=1024)
    parser.add_argument("--max-new-tokens", type=int, default=256)
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--hidden", type=int, default=4096)
    parser.add_argument("--page-tokens", type=int, default=32)
    parser.add_argument("--batch-tokens", type=int, default=2048)
    parser.add_argument("--dtype", choices=["bfloat16", "float16", "float32"], default="bfloat16")
    parser.add_argument(
        "--budget",
        type=kvcache.parse_size,
        default=None,
        help="static budget (weights included) instead of the device's free memory",
    )
    parser.add_argument("--reserve", type=kvcache.parse_size, default=2 * 2**30)
    parser.add_argument("--minutes", type=float, default=7.0)
    parser.add_argument("--device", default="cuda")
    parser.add_argument(
        "--upstream",
        choices=["vllm"],
        default=None,
        help="check the openai runner in front of this server instead (scripts/gpu_upstream.py)",
    )
    parser.add_argument(
        "--allow-cpu",
        action="store_true",
        help="run a (small) configuration on the CPU: for testing this script",
    )
    return parser.parse_args(argv)


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    if args.upstream is not None:
        from scripts.gpu_upstream import main as upstream_check

        return upstream_check()
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
