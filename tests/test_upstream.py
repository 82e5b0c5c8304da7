"""The openai runner against a real OpenAI-compatible server: ``transformers serve
--continuous-batching`` on the tiny model (CPU), started here on a free port. Outputs, priority
with the engine saturated, the server killed and restarted, a cancel mid-stream, a request the
server refuses, and the concurrency gate."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest

from scripts.bench.core import pid_cpu
from tests.conftest import wait_for
from workers.daemon import build_runner
from workers.options import WorkerOptions
from workers.runners.base import CancelReason, RunningJob
from workers.runners.gate import GateState
from workers.runners.upstream import UpstreamRunner, UpstreamSettings
from workers.testing import InferenceServer
from workers.tinymodel import write_tiny_model
from zkqueue import Client
from zkqueue.errors import ConfigurationError
from zkqueue.protocol.registry import read_records
from zkqueue.protocol.spec import JobSpec

#: Longer than any head turn takes here, even on a loaded host.
TURN_S = 0.5

PROMPTS = [
    "The quick brown fox",
    "A priority queue hands the most urgent job",
    "Z",
    "ZooKeeper keeps the shared state: pending entries, claims, results " * 3,
    "Each worker watches only its predecessor in the line",
    "GPU memory is the limit",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def server(tiny_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Iterator[InferenceServer]:
    """One server for the tests that leave it running."""
    log = tmp_path_factory.mktemp("serve") / "serve.log"
    srv = InferenceServer(tiny_dir, log).start()
    yield srv
    srv.stop()


@pytest.fixture
def upstream_worker(
    start_worker: Callable[..., Any],
) -> Callable[..., tuple[Any, UpstreamRunner]]:
    """A worker thread whose runner is the openai runner in front of ``url``."""

    def start(url: str, **kwargs: Any) -> tuple[Any, UpstreamRunner]:
        slots = kwargs.pop("slots", None)
        opts = WorkerOptions(runner="openai", upstream=url, max_concurrency=slots)
        runner, admission = build_runner(opts)
        assert isinstance(runner, UpstreamRunner)
        handle = start_worker(runner, admission=admission, slots=slots, **kwargs)
        return handle, runner

    return start


def engine_of(client: Client, worker_id: str) -> dict[str, Any]:
    records = {r["id"]: r for r in read_records(client.zk, client.layout)}
    return dict(records.get(worker_id, {}).get("engine") or {})


def test_greedy_outputs_equal_the_servers_own(
    server: InferenceServer, upstream_worker: Callable[..., Any], client: Client
) -> None:
    upstream_worker(server.url, slots=4)
    jobs = [client.submit(p, max_new_tokens=12 + 5 * i) for i, p in enumerate(PROMPTS)]
    for i, (prompt, job) in enumerate(zip(PROMPTS, jobs, strict=True)):
        result = job.result(timeout=60)
        direct = server.complete(prompt, max_tokens=12 + 5 * i)
        choice = direct["choices"][0]  # type: ignore[index]
        assert result.status == "succeeded", result.error
        assert result.output == choice["text"]
        assert result.extra["finish_reason"] == choice["finish_reason"]
        usage = direct["usage"]
        assert result.extra["prompt_tokens"] == usage["prompt_tokens"]  # type: ignore[index]
        assert result.extra["output_tokens"] == usage["completion_tokens"]  # type: ignore[index]
        assert result.extra["ttft_s"] is not None and result.extra["ttft_s"] > 0


def test_stop_strings_and_streaming_partials(
    server: InferenceServer, upstream_worker: Callable[..., Any], client: Client
) -> None:
    upstream_worker(server.url, slots=2)
    full = server.complete(PROMPTS[0], max_tokens=24)["choices"][0]["text"]  # type: ignore[index]
    stop = full[8:11]
    job = client.submit(PROMPTS[0], max_new_tokens=24, stop=[stop])
    result = job.result(timeout=60)
    assert result.status == "succeeded", result.error
    assert result.output == full[: full.index(stop)]
    assert result.extra["finish_reason"] == "stop"


def test_a_request_the_server_refuses_fails_with_its_message(
    server: InferenceServer, upstream_worker: Callable[..., Any], client: Client
) -> None:
    """transformers serve refuses vLLM's min_tokens: a 4xx fails the job, with the server's
    words; the engine stays up and the next job runs."""
    handle, _ = upstream_worker(server.url, slots=2)
    refused = client.submit("Hello", max_new_tokens=8, min_new_tokens=4).result(timeout=60)
    assert refused.status == "failed"
    assert "refused the job (422)" in (refused.error or "")
    assert "min_tokens" in (refused.error or "")
    assert refused.attempts == 1
    assert client.submit("Hello", max_new_tokens=4).result(timeout=60).status == "succeeded"
    assert engine_of(client, handle.worker.id).get("gate") == "open"


def test_the_concurrency_gate_alone_behind_a_server_without_metrics(
    server: InferenceServer,
    upstream_worker: Callable[..., Any],
    client: Client,
    zkq: Callable[..., Any],
) -> None:
    handle, runner = upstream_worker(server.url, slots=2)
    assert runner.metrics is False  # transformers serve has no /metrics
    wait_for(lambda: engine_of(client, handle.worker.id).get("gate") == "open")
    shown = zkq("workers").stdout
    assert "openai running slots 0/2" in shown
    assert "engine=openai gate=open" in shown
    most = [0]
    stop = threading.Event()

    def sample() -> None:
        while not stop.is_set():
            most[0] = max(most[0], len(handle.worker.held))
            time.sleep(0.002)

    sampler = threading.Thread(target=sample, daemon=True)
    sampler.start()
    jobs = [client.submit(p, max_new_tokens=40) for p in PROMPTS]
    try:
        assert all(job.result(timeout=60).status == "succeeded" for job in jobs)
    finally:
        stop.set()
        sampler.join()
    assert most[0] == 2


def test_high_jobs_start_before_every_low_job_not_yet_started(
    server: InferenceServer, upstream_worker: Callable[..., Any], client: Client
) -> None:
    """40 low jobs queued behind a full engine (4 slots), then 5 high ones."""
    upstream_worker(server.url, slots=4, preempt=False)
    lows = client.submit_many(["A low job " * 4] * 40, priority="low", max_new_tokens=48)
    wait_for(lambda: sum(j.status() == "running" for j in lows) == 4, timeout=60)
    highs = client.submit_many(["An urgent job"] * 5, priority="high", max_new_tokens=48)
    submitted = time.time()
    high_results = [j.result(timeout=120) for j in highs]
    low_results = [j.result(timeout=180) for j in lows]
    assert all(r.status == "succeeded" for r in high_results + low_results)
    last_high_start = max(r.started_at or 0 for r in high_results)
    # A claim is decided from the view its turn read first and stamped just before its multi:
    # a turn that read its view before the highs existed may stamp a low job just after they
    # were sent. Lows stamped TURN_S later were decided after the highs were there to see.
    later_lows = [r for r in low_results if (r.started_at or 0) > submitted + TURN_S]
    assert later_lows, "every low job had started before the high ones came"
    overtaken = [r for r in later_lows if (r.started_at or 0) < last_high_start]
    starts = sorted((r.started_at or 0, r.priority) for r in high_results + later_lows)
    assert not overtaken, f"highs sent at {submitted:.3f}; starts: {starts}"


def test_a_preempted_jobs_request_is_closed_and_the_job_given_back(
    server: InferenceServer, upstream_worker: Callable[..., Any], client: Client
) -> None:
    """A full worker (2 slots of long low jobs) takes a high job: its newest low job's request
    is closed (the server then runs two requests, not three) and the job is pending again; it
    ends succeeded later, once, its preemption counted and not as an attempt."""
    handle, _ = upstream_worker(server.url, slots=2)
    lows = [
        client.submit(f"A long low job {i}", priority="low", max_new_tokens=300) for i in (0, 1)
    ]
    wait_for(lambda: len(handle.worker.held) == 2 and _progressed(handle, 2), timeout=60)
    high = client.submit("An urgent job", priority="high", max_new_tokens=8)
    assert high.result(timeout=60).ok
    results = [job.result(timeout=120) for job in lows]
    assert [r.status for r in results] == ["succeeded", "succeeded"]
    assert sorted(r.get("preemptions") or 0 for r in results) == [0, 1]
    assert all(r.attempts == 1 for r in results)
    assert handle.worker.stats.preempted == 1


def _progressed(handle: Any, count: int) -> bool:
    return sum(job.progress > 2 for job in list(handle.worker.held.values())) >= count


def test_a_cancel_mid_stream_closes_the_upstream_request_within_a_second(
    server: InferenceServer, upstream_worker: Callable[..., Any], client: Client
) -> None:
    """The server stops generating: its CPU use falls to idle within a second of the cancel."""
    handle, _ = upstream_worker(server.url, slots=2)
    job = client.submit("Keep talking " * 4, max_new_tokens=2000)

    def streamed() -> int:
        running = [j for j in list(handle.worker.held.values()) if j.id == job.id]
        return running[0].progress if running else 0

    wait_for(lambda: streamed() > 10, timeout=60, message="the stream started")
    busy = _cpu_rate(server, 0.3)
    assert busy > 0.3, f"the server was not generating ({busy:.0%} CPU)"
    job.cancel()
    cancelled = time.monotonic()
    wait_for(lambda: _cpu_rate(server, 0.2) < 0.15, timeout=3, message="the server idle")
    assert time.monotonic() - cancelled < 1.0 + 0.2
    assert job.result(timeout=10).status == "cancelled"


def _cpu_rate(server: InferenceServer, window: float) -> float:
    assert server.proc is not None
    before, start = pid_cpu(server.proc.pid), time.monotonic()
    time.sleep(window)
    return (pid_cpu(server.proc.pid) - before) / (time.monotonic() - start)


def test_the_server_killed_and_restarted_loses_no_job(
    tiny_dir: Path, tmp_path: Path, upstream_worker: Callable[..., Any], client: Client
) -> None:
    """SIGKILL with 16 jobs in flight, a restart 5 s later on the same port: every job ends
    succeeded exactly once, and the worker showed the engine down in between."""
    srv = InferenceServer(tiny_dir, tmp_path / "serve.log").start()
    try:
        handle, runner = upstream_worker(srv.url, slots=16)
        jobs = client.submit_many(["Keep going " * 3] * 16, max_new_tokens=400)
        wait_for(lambda: len(handle.worker.held) == 16, timeout=60, message="16 in flight")
        wait_for(lambda: all(j.progress > 2 for j in handle.worker.held.values()), timeout=60)
        in_flight = {j.id for j in list(handle.worker.held.values())}
        srv.kill()
        wait_for(lambda: engine_of(client, handle.worker.id).get("gate") == "down", timeout=10)
        assert runner.gate.state == GateState.DOWN
        time.sleep(5)
        srv.start()
        results = [j.result(timeout=240) for j in jobs]
        downs = runner.gate.downs  # before the server's stop below takes it down again
    finally:
        srv.stop()
    assert [r.status for r in results] == ["succeeded"] * 16
    assert len(in_flight) >= 12  # the random model rarely ends a job early
    assert all(r.attempts == (2 if r.id in in_flight else 1) for r in results)
    assert len({r.id for r in results}) == 16
    assert client.stats()["queues"]["default"]["dead"] == 0
    assert downs == 1


def test_a_worker_started_before_its_server_waits_for_it(
    tiny_dir: Path, tmp_path: Path, upstream_worker: Callable[..., Any], client: Client
) -> None:
    srv = InferenceServer(tiny_dir, tmp_path / "serve.log")
    handle, _ = upstream_worker(srv.url, slots=2)
    job = client.submit("Hello", max_new_tokens=4)
    wait_for(lambda: engine_of(client, handle.worker.id).get("gate") == "down", timeout=10)
    assert job.status() == "pending"
    try:
        srv.start()
        assert job.result(timeout=60).status == "succeeded"
    finally:
        srv.stop()


def test_a_model_the_server_does_not_serve_is_a_configuration_error(
    server: InferenceServer,
) -> None:
    opts = WorkerOptions(runner="openai", upstream=server.url, upstream_model="no-such-model")
    with pytest.raises(ConfigurationError, match="does not serve 'no-such-model'"):
        build_runner(opts)
    with pytest.raises(ConfigurationError, match="needs --upstream"):
        build_runner(WorkerOptions(runner="openai"))


def test_the_worker_command_says_what_is_wrong(
    server: InferenceServer, zkq: Callable[..., Any]
) -> None:
    missing = zkq("worker", "--runner", "openai")
    assert missing.returncode == 7
    assert "the openai runner needs --upstream URL" in missing.stderr
    wrong = zkq("worker", "--upstream", server.url, "--upstream-model", "nope")
    assert wrong.returncode == 7
    assert "does not serve 'nope'" in wrong.stderr
    assert "Traceback" not in wrong.stderr
    bad = zkq("worker", "--upstream", "localhost:8000")
    assert bad.returncode == 7
    assert "must be an http(s) URL" in bad.stderr


def test_a_job_cancelled_as_it_is_handed_in_still_ends_once() -> None:
    """The cancel reaches the runner's loop before the job's task took its first step (a
    preemption right after a claim): the task never runs, and the job still ends, once."""
    runner = UpstreamRunner(UpstreamSettings("http://127.0.0.1:9/v1", model="m"))
    ended: list[tuple[str, str]] = []
    runner.start(lambda job, outcome: ended.append((job.id, outcome.status)))
    try:
        for i in range(20):
            job = RunningJob(id=f"j{i}", spec=JobSpec("x"), priority="low", queue="q", attempts=1)
            runner.submit(job)
            job.cancel(CancelReason.PREEMPTED)
        wait_for(lambda: len(ended) == 20, timeout=5, message="every job ended")
    finally:
        runner.close()
    assert sorted(ended) == sorted((f"j{i}", "cancelled") for i in range(20))
