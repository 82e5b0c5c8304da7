"""Streaming: the worker publishes partial output at a bounded rate; callers iterate over it."""

from __future__ import annotations

import time
from collections.abc import Iterator
from pathlib import Path

import pytest
import torch

from workers.model import load
from workers.runners.echo import EchoRunner
from workers.runners.hf import HFRunner
from workers.tinymodel import write_tiny_model
from zkqueue import Client, JobTimeout
from zkqueue.defaults import STREAM_INTERVAL


def test_stream_yields_pieces_that_add_up_to_the_output(client: Client, start_worker) -> None:
    start_worker(EchoRunner(delay=2.0))
    prompt = " ".join(f"w{i}" for i in range(12))
    job = client.submit(prompt, stream=True)
    started = time.monotonic()
    pieces = list(job.stream(timeout=30))
    took = time.monotonic() - started
    assert "".join(pieces) == prompt == job.result().output
    assert len(pieces) >= 3, pieces  # it arrived in parts, not only at the end
    # Bounded rate: no more pieces than publish intervals (plus the final remainder).
    assert len(pieces) <= took / STREAM_INTERVAL + 2


def test_non_streaming_job_yields_its_output_once(client: Client, start_worker) -> None:
    start_worker(EchoRunner(delay=0.3))
    job = client.submit("all at once")
    assert list(job.stream(timeout=30)) == ["all at once"]


def test_stream_timeout_withdraws_the_request(client: Client) -> None:
    job = client.submit("nobody serves this", stream=True)
    with pytest.raises(JobTimeout):
        list(job.stream(timeout=0.3))
    assert client.list() == []


@pytest.fixture
def tiny(tmp_path_factory: pytest.TempPathFactory) -> Iterator[HFRunner]:
    path: Path = write_tiny_model(tmp_path_factory.mktemp("tiny"))
    tokenizer, model = load(path, torch.device("cpu"), torch.float32)
    runner = HFRunner(tokenizer, model, pages=64, page_tokens=16)
    yield runner
    runner.close()


def test_model_stream_matches_the_final_output(
    client: Client, start_worker, tiny: HFRunner
) -> None:
    start_worker(tiny)
    job = client.submit("Hello", max_new_tokens=200, stream=True)
    pieces = list(job.stream(timeout=120))
    record = job.result()
    assert record.ok
    assert "".join(pieces) == record.output


def test_cli_stream(zkq, spawn_worker) -> None:
    spawn_worker("--runner", "echo", "--echo-delay", "1")
    out = zkq("submit", "--stream", "one two three four")
    assert out.returncode == 0, out.stderr
    assert out.stdout == "one two three four\n"
