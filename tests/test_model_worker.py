"""The model worker end to end: a real tiny transformers model on the CPU behind the queue."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.conftest import wait_for
from tests.runners import generate_directly
from workers.daemon import memory_admission
from workers.runners.base import Outcome, OutOfMemory, RunningJob
from workers.runners.echo import EchoRunner
from workers.runners.hf import HFRunner
from workers.tinymodel import write_tiny_model
from zkqueue import Client
from zkqueue.errors import ExitCode
from zkqueue.spec import JobSpec

PROMPTS = ["Hello", "The head of the line claims", "A", "GPU memory is the limit, " * 3]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def runner(tiny_dir: Path) -> Iterator[HFRunner]:
    hf = HFRunner(tiny_dir, device="cpu", dtype="float32", max_batch=8)
    yield hf
    hf.close()


def direct_greedy(tiny_dir: Path, prompt: str, max_new_tokens: int) -> str:
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True).eval()
    tok = AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)
    return generate_directly(model, tok, prompt, max_new_tokens)


class BatchLog:
    """Wraps a runner and records the size of every batch it was handed."""

    def __init__(self, inner: Any) -> None:
        self.inner = inner
        self.name = inner.name
        self.sizes: list[int] = []

    def describe(self) -> dict[str, Any]:
        return dict(self.inner.describe())

    def run(self, jobs: list[RunningJob]) -> list[Outcome]:
        self.sizes.append(len(jobs))
        return list(self.inner.run(jobs))

    def close(self) -> None:
        pass


def test_queue_output_equals_direct_generate(client: Client, start_worker, runner, tiny_dir):
    start_worker(runner, slots=1)
    for prompt in PROMPTS[:2]:
        record = client.submit(prompt, max_new_tokens=12).result(timeout=60)
        assert record.ok, record.error
        assert record.output == direct_greedy(tiny_dir, prompt, 12)
        assert record["prompt_tokens"] > 0 and 0 < record["output_tokens"] <= 12
        assert record["ttft_s"] is not None and record["total_s"] >= record["ttft_s"]


def test_batched_through_the_queue_equals_one_by_one(client: Client, start_worker, runner):
    lengths = [5, 9, 3, 12]
    alone = [
        client.submit(p, max_new_tokens=n, detach=True)
        for p, n in zip(PROMPTS, lengths, strict=True)
    ]
    solo = start_worker(BatchLog(runner), slots=1)
    alone_out = [j.result(timeout=60).output for j in alone]
    solo.stop()
    together = [
        client.submit(p, max_new_tokens=n, detach=True)
        for p, n in zip(PROMPTS, lengths, strict=True)
    ]
    log = BatchLog(runner)
    start_worker(log, slots=8)
    assert [j.result(timeout=60).output for j in together] == alone_out
    assert log.sizes == [4]


def test_static_budget_admits_one_at_a_time_and_rejects_what_never_fits(
    client: Client, start_worker, runner
):
    small = JobSpec(prompt="Hello", max_new_tokens=16)
    need = runner.need_bytes(small)
    admission, probe = memory_admission(runner, runner.weight_bytes + need + need // 2, 0)
    log = BatchLog(runner)
    handle = start_worker(log, slots=4, admission=admission, memory=probe)
    wait_for(lambda: client.workers() and client.workers()[0]["memory"], message="registered")
    memory = client.workers()[0]["memory"]
    assert memory["capacity"] == need + need // 2 and memory["source"] == "static"

    too_big = client.submit("Hello", max_new_tokens=400, detach=True)
    record = too_big.result(timeout=30)
    assert record.status == "rejected"
    assert "the largest worker of queue 'default' can hold" in (record.error or "")
    assert f"({need + need // 2} bytes)" in (record.error or "")

    jobs = [client.submit("Hello", max_new_tokens=16, detach=True) for _ in range(3)]
    assert all(j.result(timeout=60).ok for j in jobs)
    assert log.sizes == [1, 1, 1]  # each fits alone, never two at once
    assert handle.worker.stats.rejected == 1


def test_prompt_longer_than_the_context_is_rejected(client: Client, start_worker, runner):
    admission, probe = memory_admission(runner, None, 0)
    start_worker(runner, admission=admission, memory=probe)
    record = client.submit("word " * 600, max_new_tokens=8).result(timeout=30)
    assert record.status == "rejected"
    assert "context" in (record.error or "")


class FlakyMemoryRunner(EchoRunner):
    """Runs out of memory on any batch larger than one job."""

    def __init__(self) -> None:
        super().__init__()
        self.sizes: list[int] = []

    def run(self, jobs: list[RunningJob]) -> list[Outcome]:
        self.sizes.append(len(jobs))
        if len(jobs) > 1:
            raise OutOfMemory("CUDA out of memory (simulated)", [None] * len(jobs), len(jobs))
        return super().run(jobs)


def test_out_of_memory_fails_only_the_batch_and_retries_smaller(client: Client, start_worker):
    jobs = [client.submit(f"j{i}", detach=True) for i in range(4)]
    flaky = FlakyMemoryRunner()
    handle = start_worker(flaky, slots=4, max_attempts=5)
    records = [j.result(timeout=30) for j in jobs]
    assert [r.status for r in records] == ["succeeded"] * 4
    assert [r.output for r in records] == ["j0", "j1", "j2", "j3"]
    assert flaky.sizes[:2] == [4, 2]
    assert handle.worker.stats.out_of_memory >= 2
    assert handle.thread.is_alive()


def test_cancel_stops_generation(client: Client, start_worker, runner):
    handle = start_worker(runner, slots=1)
    job = client.submit("Hello", max_new_tokens=400, detach=True)
    wait_for(lambda: handle.worker.busy == 1, timeout=30, message="generating")
    assert job.cancel()
    wait_for(lambda: handle.worker.busy == 0, timeout=30, message="generation stopped")
    assert client.job(job.id).result(timeout=1).status == "cancelled"
    assert handle.worker.stats.completed == 0


def test_max_runtime_gives_timeout_with_partial_output(client: Client, start_worker, runner):
    start_worker(runner, slots=1)
    record = client.submit("Hello", max_new_tokens=400, max_runtime=0.05).result(timeout=60)
    assert record.status == "timeout"
    assert "max_runtime" in (record.error or "") or "0.05" in (record.error or "")
    assert record["output_tokens"] < 400


def test_model_that_fails_to_load_exits_7_before_registering(zkq, client: Client, tmp_path):
    out = zkq("worker", "--model", str(tmp_path / "missing"))
    assert out.returncode == ExitCode.CONFIG
    assert str(tmp_path / "missing") in out.stderr
    assert client.workers() == []


def test_tiny_model_command_and_model_worker_cli(zkq, spawn_worker, client: Client, tmp_path):
    out = zkq("tiny-model", str(tmp_path / "m"))
    assert out.returncode == 0, out.stderr
    spawn_worker("--model", str(tmp_path / "m"), "--device", "cpu", "--vram-budget", "64MiB")
    wait_for(lambda: client.workers(), timeout=60, message="model worker registered")
    info = client.workers()[0]
    assert info["runner_info"]["dtype"] == "float32"
    assert info["runner_info"]["weight_bytes"] > 0
    assert info["memory"]["total"] == 64 * 2**20
    out = zkq("submit", "--json", "--max-new-tokens", "4", "Hello")
    assert out.returncode == 0, out.stderr
    assert '"status": "succeeded"' in out.stdout
    text = zkq("workers").stdout
    assert "mem free" in text


def test_generation_runs_off_the_zookeeper_threads(client: Client, start_worker, runner):
    threads: list[str] = []

    class Spy(BatchLog):
        def run(self, jobs: list[RunningJob]) -> list[Outcome]:
            threads.append(threading.current_thread().name)
            return super().run(jobs)

    start_worker(Spy(runner))
    assert client.submit("Hello", max_new_tokens=2).result(timeout=60).ok
    assert threads and all(t.startswith("zkq-run") for t in threads)
