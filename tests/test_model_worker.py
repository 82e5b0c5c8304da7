"""The model worker end to end: a real tiny transformers model on the CPU behind the queue, served
by continuous batching, admitted by KV-cache pages."""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.conftest import wait_for
from tests.runners import generate_directly
from workers.admission import Admission
from workers.model import build_model_runner, load
from workers.options import WorkerOptions
from workers.runners.base import Outcome, RunningJob
from workers.runners.echo import EchoRunner
from workers.runners.hf import HFRunner
from workers.tinymodel import write_tiny_model
from zkqueue import Client
from zkqueue.errors import ConfigurationError, ExitCode
from zkqueue.protocol.spec import JobSpec

PROMPTS = ["Hello", "The head of the line claims", "A", "GPU memory is the limit, " * 3]
PAGE = 16


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def loaded(tiny_dir: Path) -> tuple[Any, Any]:
    return load(tiny_dir, torch.device("cpu"), torch.float32)


@pytest.fixture
def model_worker(
    loaded: tuple[Any, Any], start_worker
) -> Iterator[Callable[..., tuple[Any, HFRunner]]]:
    """Start a worker on a fresh runner over the loaded tiny model, with a cache of ``pages``
    pages of 16 tokens (always explicit) and admission in those pages."""
    runners: list[HFRunner] = []

    def start(pages: int = 256, slots: int = 8, **kwargs: Any) -> tuple[Any, HFRunner]:
        tokenizer, model = loaded
        runner = HFRunner(tokenizer, model, pages=pages, page_tokens=PAGE, max_requests=slots)
        runners.append(runner)
        admission = Admission(
            pages,
            PAGE,
            count_tokens=runner.count_tokens,
            validate=runner.validate,
            pages_in_use=runner.pages_in_use,
        )
        return start_worker(runner, slots=slots, admission=admission, **kwargs), runner

    yield start
    for runner in runners:
        runner.close()


def direct(loaded: tuple[Any, Any], prompt: str, max_new_tokens: int) -> str:
    tokenizer, model = loaded
    return generate_directly(model, tokenizer, prompt, max_new_tokens)


def test_queue_output_equals_direct_generate(client: Client, model_worker, loaded) -> None:
    model_worker(slots=1)
    for prompt in PROMPTS[:2]:
        record = client.submit(prompt, max_new_tokens=12).result(timeout=60)
        assert record.ok, record.error
        assert record.output == direct(loaded, prompt, 12)
        assert record["prompt_tokens"] > 0 and 0 < record["output_tokens"] <= 12
        assert record["ttft_s"] is not None and record["total_s"] >= record["ttft_s"]
        assert record["finish_reason"] in ("stop", "length")


def test_jobs_batched_together_equal_each_run_alone(client: Client, model_worker, loaded) -> None:
    lengths = [5, 9, 3, 12]
    jobs = [
        client.submit(p, max_new_tokens=n, detach=True)
        for p, n in zip(PROMPTS, lengths, strict=True)
    ]
    handle, _ = model_worker(slots=8)
    outputs = [j.result(timeout=60).output for j in jobs]
    assert outputs == [direct(loaded, p, n) for p, n in zip(PROMPTS, lengths, strict=True)]
    assert handle.worker.stats.claimed == 4


def test_a_short_job_ends_while_a_long_one_runs(client: Client, model_worker) -> None:
    """Continuous batching: the short job joins the running batch and its result is written as
    soon as it ends, long before the long job's."""
    long = client.submit("Hello", max_new_tokens=300, ignore_eos=True, detach=True)
    short = client.submit("Hi", max_new_tokens=4, ignore_eos=True, detach=True)
    model_worker(slots=8)
    first, second = long.result(timeout=120), short.result(timeout=120)
    assert first.ok and second.ok and second["output_tokens"] == 4
    assert second.finished_at is not None and first.finished_at is not None
    assert second.finished_at < first.finished_at


def test_pages_admit_what_fits_and_reject_what_never_fits(client: Client, model_worker) -> None:
    """A cache of 4 pages of 16 tokens: a job of ~40 positions takes 3 pages, so two never run
    at once; a job of 400 positions can never fit any worker of the queue: rejected."""
    handle, runner = model_worker(pages=4, slots=4)
    wait_for(lambda: client.workers() and client.workers()[0]["memory"], message="registered")
    cache = client.workers()[0]["memory"]
    assert (cache["pages_total"], cache["page_tokens"], cache["capacity_tokens"]) == (4, 16, 64)

    too_big = client.submit("Hello", max_new_tokens=400, detach=True).result(timeout=30)
    assert too_big.status == "rejected"
    assert "KV-cache pages" in (too_big.error or "") and "holds 64 tokens" in (too_big.error or "")

    seen: list[int] = []
    real = runner.submit

    def spy(job: RunningJob) -> None:
        seen.append(handle.worker.admission.promised)
        real(job)

    runner.submit = spy  # type: ignore[method-assign]
    jobs = [
        client.submit("Hello", max_new_tokens=36, ignore_eos=True, detach=True) for _ in range(3)
    ]
    assert all(j.result(timeout=60).ok for j in jobs)
    assert seen == [3, 3, 3]  # each job alone: its own 3 pages, never 6
    wait_for(lambda: handle.worker.admission.promised == 0, message="pages given back")
    assert handle.worker.stats.rejected == 1


def test_prompt_longer_than_the_context_is_rejected(client: Client, model_worker) -> None:
    model_worker()
    record = client.submit("word " * 600, max_new_tokens=8).result(timeout=30)
    assert record.status == "rejected"
    assert "context" in (record.error or "")


class EngineFailsOnce(EchoRunner):
    """Reports its first job as given back by a failed engine (as the HF runner does when its
    generation loop dies), then echoes."""

    def __init__(self) -> None:
        super().__init__()
        self.failed: list[str] = []

    def run_one(self, job: RunningJob) -> Outcome:
        if not self.failed:
            self.failed.append(job.id)
            return Outcome("failed", error="engine loop died (simulated)", release=True)
        return super().run_one(job)


def test_a_dead_engine_gives_its_jobs_back_to_the_queue(client: Client, start_worker) -> None:
    runner = EngineFailsOnce()
    handle = start_worker(runner, slots=2)
    record = client.submit("try again").result(timeout=30)
    assert record.ok and record.attempts == 2 and runner.failed == [record.id]
    assert handle.worker.stats.out_of_memory == 1
    assert handle.thread.is_alive()


def test_cancel_stops_generation_and_frees_its_pages(client: Client, model_worker) -> None:
    handle, _ = model_worker(slots=1)
    job = client.submit("Hello", max_new_tokens=400, ignore_eos=True, detach=True)
    wait_for(lambda: handle.worker.busy == 1, timeout=30, message="generating")
    assert handle.worker.admission.promised > 0
    assert job.cancel()
    wait_for(lambda: handle.worker.busy == 0, timeout=30, message="generation stopped")
    assert handle.worker.admission.promised == 0
    assert client.job(job.id).result(timeout=1).status == "cancelled"
    assert handle.worker.stats.completed == 0


def test_max_runtime_gives_timeout_with_partial_output(client: Client, model_worker) -> None:
    model_worker(slots=1)
    spec = {"max_new_tokens": 400, "ignore_eos": True, "max_runtime": 0.2}
    record = client.submit("Hello", **spec).result(timeout=60)
    assert record.status == "timeout"
    assert "max_runtime" in (record.error or "")
    assert record["output_tokens"] < 400


def test_model_that_fails_to_load_exits_7_before_registering(zkq, client: Client, tmp_path):
    out = zkq("worker", "--model", str(tmp_path / "missing"))
    assert out.returncode == ExitCode.CONFIG
    assert str(tmp_path / "missing") in out.stderr
    assert client.workers() == []


def test_tiny_model_command_and_model_worker_cli(zkq, spawn_worker, client: Client, tmp_path):
    out = zkq("tiny-model", str(tmp_path / "m"))
    assert out.returncode == 0, out.stderr
    spawn_worker(
        "--model",
        str(tmp_path / "m"),
        "--device",
        "cpu",
        "--vram-budget",
        "64MiB",
        "--no-calibrate",
    )
    wait_for(lambda: client.workers(), timeout=60, message="model worker registered")
    info = client.workers()[0]
    assert info["runner_info"]["dtype"] == "float32"
    assert info["runner_info"]["weight_bytes"] > 0
    assert info["memory"]["pages_total"] > 0 and info["memory"]["page_tokens"] > 0
    # No --max-concurrency, no calibration: the CPU's rule (16), within what the cache admits.
    assert info["slots_max"] == min(info["memory"]["pages_total"], 16) > 1
    assert info["runner_info"]["admission"] == {"slots": info["slots_max"], "source": "rule"}
    out = zkq("submit", "--json", "--max-new-tokens", "4", "Hello")
    assert out.returncode == 0, out.stderr
    assert '"status": "succeeded"' in out.stdout
    assert "kv pages" in zkq("workers").stdout


# -- building a model worker's runner -----------------------------------------------------------


def test_build_model_runner_sizes_the_cache_from_the_budget(tiny_dir: Path) -> None:
    opts = WorkerOptions(
        model=str(tiny_dir), device="cpu", dtype="float32", vram_budget=64 * 2**20, calibrate=False
    )
    runner, admission = build_model_runner(opts)
    try:
        assert admission.pages_total == runner.cache_pages > 0
        assert admission.page_tokens == runner.page_tokens
        spec = JobSpec(prompt="Hello", max_new_tokens=40)
        assert admission.judge(spec).pages == math.ceil((2 + 40) / runner.page_tokens)
        page = runner.describe()["cache"]["bytes_per_page"]
        assert runner.cache_pages * page < 64 * 2**20 - runner.weight_bytes
    finally:
        runner.close()


def test_build_model_runner_refuses_a_budget_without_room(tiny_dir: Path) -> None:
    opts = WorkerOptions(model=str(tiny_dir), device="cpu", dtype="float32", vram_budget=2**20)
    with pytest.raises(ConfigurationError, match="no KV-cache page fits"):
        build_model_runner(opts)


def test_a_cache_sized_from_plenty_of_memory_stops_at_what_jobs_can_use(tiny_dir: Path) -> None:
    """On a CPU host without a budget the free RAM is the limit: the cache must still stop at
    what every slot at the full context could hold (the engine refused a cache of 5 GiB)."""
    opts = WorkerOptions(model=str(tiny_dir), device="cpu", max_concurrency=2)
    runner, admission = build_model_runner(opts)
    try:
        per_job = math.ceil(runner.context_length / runner.page_tokens)
        assert admission.pages_total is not None
        assert per_job <= admission.pages_total <= 2 * per_job + 3
    finally:
        runner.close()
