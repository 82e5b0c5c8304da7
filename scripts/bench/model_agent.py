"""The model side of the batching scenario, imported only by the agent that runs it (it imports
torch): write and load the tiny model, and the two references without a queue: batched
``model.generate`` called directly, and the HF runner called directly."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from workers.runners.base import RunningJob
from workers.runners.hf import HFRunner
from workers.tinymodel import write_tiny_model
from zkqueue.spec import build_spec

_loaded: dict[str, tuple[Any, Any]] = {}


def ensure_model(model_dir: str) -> None:
    if not (Path(model_dir) / "config.json").exists():
        write_tiny_model(model_dir)


def load_runner(model_dir: str) -> HFRunner:
    ensure_model(model_dir)
    return HFRunner(model_dir, device="cpu", dtype="float32", max_batch=8)


def _model(model_dir: str) -> tuple[Any, Any]:
    if model_dir not in _loaded:
        tokenizer = AutoTokenizer.from_pretrained(model_dir, local_files_only=True)
        model = AutoModelForCausalLM.from_pretrained(
            model_dir, local_files_only=True, dtype=torch.float32
        ).eval()
        _loaded[model_dir] = (tokenizer, model)
    return _loaded[model_dir]


def direct_generate(
    model_dir: str, prompts: list[str], max_new_tokens: int, batch: int
) -> dict[str, Any]:
    """Greedy ``generate`` on left-padded batches of ``batch`` prompts, as the runner calls it,
    after one warm-up call. Returns the elapsed seconds and tokens generated."""
    tokenizer, model = _model(model_dir)
    eos = [int(tokenizer.eos_token_id)]
    pad = int(tokenizer.pad_token_id)

    def run(part: list[str]) -> int:
        rows = [tokenizer(p)["input_ids"] for p in part]
        width = max(len(r) for r in rows)
        ids = torch.full((len(rows), width), pad, dtype=torch.long)
        mask = torch.zeros((len(rows), width), dtype=torch.long)
        for i, row in enumerate(rows):
            ids[i, width - len(row) :] = torch.tensor(row)
            mask[i, width - len(row) :] = 1
        with torch.inference_mode():
            out = model.generate(
                input_ids=ids,
                attention_mask=mask,
                max_new_tokens=max_new_tokens,
                pad_token_id=pad,
                eos_token_id=eos,
                do_sample=False,
            )
        return int((out[:, width:] != pad).sum())

    run(prompts[:batch])
    start = time.perf_counter()
    tokens = sum(run(prompts[i : i + batch]) for i in range(0, len(prompts), batch))
    return {"elapsed": time.perf_counter() - start, "tokens": tokens, "jobs": len(prompts)}


def runner_direct(
    runner: HFRunner, prompts: list[str], max_new_tokens: int, batch: int
) -> dict[str, Any]:
    """HFRunner.run on batches of ``batch`` jobs, without ZooKeeper, after one warm-up batch."""

    def jobs(part: list[str], offset: int) -> list[RunningJob]:
        return [
            RunningJob(
                id=f"direct{offset + i}",
                spec=build_spec(p, max_new_tokens, {}),
                priority="normal",
                queue="direct",
                attempts=1,
            )
            for i, p in enumerate(part)
        ]

    runner.run(jobs(prompts[:batch], 0))
    start = time.perf_counter()
    tokens = 0
    for i in range(0, len(prompts), batch):
        outcomes = runner.run(jobs(prompts[i : i + batch], i))
        tokens += sum(int(o.extra.get("output_tokens", 0)) for o in outcomes)
    return {"elapsed": time.perf_counter() - start, "tokens": tokens, "jobs": len(prompts)}
