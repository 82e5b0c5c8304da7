"""The HuggingFace runner on transformers' continuous batching, against the real tiny model on the
CPU in float32. A small harness starts the runner and collects each job's one outcome."""

from __future__ import annotations

import gc
import itertools
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from tests.runners import generate_directly
from workers.model import load
from workers.runners.base import CancelReason, Outcome, RunningJob
from workers.runners.hf import HFRunner
from workers.tinymodel import CONTEXT_LENGTH, write_tiny_model
from zkqueue.protocol.spec import JobSpec, render_plain

CPU = torch.device("cpu")
PROMPTS = [
    "Hello",
    "The worker admits a job only when a slot is free and",
    "A",
    "Numbers 1 2 3 and symbols ( ) [ ] { } appear too, " * 3,
    "def run(jobs):",
    "ZooKeeper keeps the shared state",
    "Greedy decoding picks",
    "Pack my box with five dozen liquor jugs.",
]
_ids = itertools.count()


class Harness:
    """Starts a runner and gathers the outcome of every job it reports (exactly once each)."""

    def __init__(self, runner: HFRunner) -> None:
        self.runner = runner
        self.outcomes: dict[str, Outcome] = {}
        self.reported: list[str] = []
        self._cond = threading.Condition()
        runner.start(self._done)

    def _done(self, job: RunningJob, outcome: Outcome) -> None:
        with self._cond:
            self.reported.append(job.id)
            self.outcomes[job.id] = outcome
            self._cond.notify_all()

    def submit(self, prompt: str = "Hello", **spec: Any) -> RunningJob:
        running = job(prompt, **spec)
        self.runner.submit(running)
        return running

    def wait(self, *jobs: RunningJob, timeout: float = 60.0) -> list[Outcome]:
        deadline = time.monotonic() + timeout
        with self._cond:
            while not all(j.id in self.outcomes for j in jobs):
                left = deadline - time.monotonic()
                assert left > 0, "no outcome in time"
                self._cond.wait(left)
        assert len(self.reported) == len(set(self.reported)), "a job was reported twice"
        return [self.outcomes[j.id] for j in jobs]

    def run(self, prompt: str = "Hello", **spec: Any) -> Outcome:
        return self.wait(self.submit(prompt, **spec))[0]


def job(prompt: str = "Hello", **spec: Any) -> RunningJob:
    return RunningJob(
        id=f"job-{next(_ids)}",
        spec=JobSpec(prompt=prompt, **spec),
        priority="normal",
        queue="default",
        attempts=1,
    )


def poll(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.002)


def make_runner(tiny_dir: Path, **kwargs: Any) -> HFRunner:
    tokenizer, model = load(tiny_dir, CPU, torch.float32)
    options = {"pages": 256, "page_tokens": 16, "max_batch_tokens": 128, **kwargs}
    return HFRunner(tokenizer, model, name=str(tiny_dir), **options)


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def harness(tiny_dir: Path) -> Iterator[Harness]:
    runner = make_runner(tiny_dir)
    yield Harness(runner)
    runner.close()


@pytest.fixture(scope="module")
def direct(tiny_dir: Path) -> tuple[Any, Any]:
    """The model and tokenizer loaded independently of the runner: (model, tokenizer)."""
    tokenizer, model = load(tiny_dir, CPU, torch.float32)
    return model, tokenizer


# -- what the worker reads ----------------------------------------------------------------------


def test_describe(harness: Harness, tiny_dir: Path) -> None:
    runner = harness.runner
    info = runner.describe()
    params = sum(p.numel() * 4 for p in runner._model.parameters())
    assert (info["model"], info["device"], info["dtype"]) == (str(tiny_dir), "cpu", "float32")
    assert params <= info["weight_bytes"] < params * 1.01
    assert info["context_length"] == runner.context_length == CONTEXT_LENGTH
    # 2 layers x 2 KV heads x head_dim 16 x K and V x 4 bytes x 16 positions.
    cache = {"pages_total": 256, "page_tokens": 16, "bytes_per_page": 8192, "max_batch_tokens": 128}
    assert info["cache"] == cache
    assert (runner.cache_pages, runner.page_tokens) == (256, 16)


def test_the_engine_allocates_what_was_sized(harness: Harness) -> None:
    engine = harness.runner._engine
    assert engine is not None
    allocated = engine.allocated_bytes()
    assert allocated is not None
    wanted = 256 * 8192
    assert wanted <= allocated <= wanted + 3 * 8192  # trash sectors and rounding
    in_use = harness.runner.pages_in_use()
    assert in_use is not None and 0 <= in_use <= 256


def test_count_tokens_matches_the_tokenizer(harness: Harness, direct: tuple[Any, Any]) -> None:
    _, tokenizer = direct
    for prompt in PROMPTS:
        assert harness.runner.count_tokens(JobSpec(prompt=prompt)) == len(
            tokenizer(prompt)["input_ids"]
        )


def test_validate_refuses_a_prompt_over_the_context(harness: Harness) -> None:
    runner = harness.runner
    assert runner.validate(JobSpec(prompt="Hello", max_new_tokens=10)) is None
    long = JobSpec(prompt="Hello " * 300, max_new_tokens=400)
    problem = runner.validate(long)
    assert problem is not None and "exceeds the model context of 512 tokens" in problem
    outcome = harness.run(long.prompt, max_new_tokens=400)
    assert (outcome.status, outcome.error) == ("failed", problem)


# -- generation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("max_new_tokens", [1, 12, 40])
def test_greedy_alone_matches_generate(
    harness: Harness, direct: tuple[Any, Any], max_new_tokens: int
) -> None:
    for prompt in PROMPTS[:5]:
        outcome = harness.run(prompt, max_new_tokens=max_new_tokens)
        assert outcome.status == "succeeded", outcome.error
        assert outcome.output == generate_directly(*direct, prompt, max_new_tokens)
        extra = outcome.extra
        assert (extra["output_tokens"], extra["finish_reason"]) == (max_new_tokens, "length")
        assert extra["prompt_tokens"] == harness.runner.count_tokens(JobSpec(prompt=prompt))
        assert 0 < extra["ttft_s"] <= extra["total_s"]


def test_eight_mixed_jobs_together_match_generate(
    harness: Harness, direct: tuple[Any, Any]
) -> None:
    sizes = [5, 40, 1, 23, 8, 31, 2, 17]
    jobs = [harness.submit(p, max_new_tokens=n) for p, n in zip(PROMPTS, sizes, strict=True)]
    for running, outcome in zip(jobs, harness.wait(*jobs), strict=True):
        spec = running.spec
        assert outcome.status == "succeeded", outcome.error
        assert outcome.output == generate_directly(*direct, spec.prompt, spec.max_new_tokens)


def test_streaming_jobs_get_partial_ids_and_progress(harness: Harness) -> None:
    streaming = harness.submit("Hello", max_new_tokens=30, stream=True)
    quiet = harness.submit("Hello", max_new_tokens=30)
    assert streaming.decode is not None
    poll(lambda: 0 < len(streaming.partial_ids) < 30 or streaming.id in harness.outcomes)
    first, second = harness.wait(streaming, quiet)
    assert streaming.partial_text() == first.output == second.output
    assert streaming.progress == len(streaming.partial_ids) == 30
    assert quiet.progress == 30 and quiet.partial_ids == []


def test_cancel_stops_mid_generation_with_the_partial_output(harness: Harness) -> None:
    running = harness.submit("Hello", max_new_tokens=400, ignore_eos=True)
    poll(lambda: running.progress >= 5)
    at_cancel = running.progress
    running.cancel(CancelReason.CANCELLED)
    [outcome] = harness.wait(running)
    tokens = outcome.extra["output_tokens"]
    assert outcome.status == "cancelled"
    assert at_cancel <= tokens <= at_cancel + 3, "the job ran on after its cancellation"
    assert outcome.output and "cancelled after" in (outcome.error or "")
    # The engine is free again: a job submitted now runs.
    assert harness.run("A", max_new_tokens=3).status == "succeeded"


def test_a_job_cancelled_before_submit_ends_at_once(harness: Harness) -> None:
    running = job("Hello", max_new_tokens=50)
    running.cancel(CancelReason.LEASE)
    harness.runner.submit(running)
    [outcome] = harness.wait(running)
    assert outcome.status == "cancelled" and "lease" in (outcome.error or "")


def test_max_runtime_ends_with_timeout_and_the_partial_output(harness: Harness) -> None:
    outcome = harness.run("Hello", max_new_tokens=400, ignore_eos=True, max_runtime=0.3)
    assert outcome.status == "timeout"
    assert "max_runtime of 0.3 s" in (outcome.error or "")
    assert 0 < outcome.extra["output_tokens"] < 400
    assert outcome.output


def test_stop_strings_cut_the_output(harness: Harness, direct: tuple[Any, Any]) -> None:
    full = generate_directly(*direct, "Hello", 40)
    stop = full[12:16]
    expected = full[: full.find(stop)]
    outcome = harness.run("Hello", max_new_tokens=40, stop=[stop, "never appears"])
    assert outcome.status == "succeeded", outcome.error
    assert (outcome.output, outcome.extra["finish_reason"]) == (expected, "stop")
    assert outcome.extra["output_tokens"] < 40


def test_chat_messages_without_a_template_use_the_plain_rendering(
    harness: Harness, direct: tuple[Any, Any]
) -> None:
    messages = ({"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"})
    running = RunningJob(
        id=f"job-{next(_ids)}",
        spec=JobSpec(prompt="", messages=messages, max_new_tokens=10),
        priority="normal",
        queue="default",
        attempts=1,
    )
    harness.runner.submit(running)
    [outcome] = harness.wait(running)
    assert outcome.output == generate_directly(*direct, render_plain(messages), 10)


def test_chat_messages_use_the_tokenizer_template(tiny_dir: Path) -> None:
    runner = make_runner(tiny_dir, pages=4)
    tokenizer = runner.codec.tokenizer
    tokenizer.chat_template = (
        "{% for m in messages %}<s>{{ m['role'] }}: {{ m['content'] }}\n{% endfor %}"
        "{% if add_generation_prompt %}assistant:{% endif %}"
    )
    messages = ({"role": "user", "content": "Hi there"},)
    spec = JobSpec(prompt="", messages=messages)
    # The template writes the bos itself: the tokenizer adds no special token around it.
    rendered = tokenizer("<s>user: Hi there\nassistant:", add_special_tokens=False)["input_ids"]
    assert rendered[0] == tokenizer.bos_token_id
    assert runner.codec.encode(spec) == rendered
    assert runner.count_tokens(spec) == len(rendered)


# -- what the engine cannot serve alone ---------------------------------------------------------


def test_seeded_sampling_is_reproducible_beside_other_jobs(harness: Harness) -> None:
    seeded = {"max_new_tokens": 20, "temperature": 0.9, "seed": 7}
    others = [harness.submit(p, max_new_tokens=30, temperature=1.0) for p in PROMPTS[:4]]
    first = harness.run("Hello", **seeded)
    second = harness.run("Hello", **seeded)
    other_seed = harness.run("Hello", **{**seeded, "seed": 8})
    harness.wait(*others)
    assert first.status == "succeeded", first.error
    assert first.output == second.output
    assert first.output != other_seed.output
    assert all(o.status == "succeeded" for o in harness.wait(*others))


def test_unseeded_sampling_runs_on_the_engine(harness: Harness) -> None:
    # Unseeded, the draw may reach the model's eos early: ignore_eos makes the count exact.
    spec = {"temperature": 0.8, "top_p": 0.9, "ignore_eos": True}
    outcome = harness.run("Hello", max_new_tokens=20, **spec)
    assert outcome.status == "succeeded", outcome.error
    assert outcome.extra["output_tokens"] == 20


@pytest.fixture(scope="module")
def eos_harness(tiny_dir: Path, direct: tuple[Any, Any]) -> Iterator[tuple[Harness, int]]:
    """A runner whose model also ends sequences at the 6th token it generates for "Hello" (the
    tiny model never generates its real eos)."""
    model, tokenizer = direct
    enc = tokenizer("Hello", return_tensors="pt")
    out = model.generate(**enc, max_new_tokens=6, do_sample=False, pad_token_id=0)
    fake_eos = int(out[0, -1])
    own_tokenizer, own_model = load(tiny_dir, CPU, torch.float32)
    own_model.generation_config.eos_token_id = [tokenizer.eos_token_id, fake_eos]
    runner = HFRunner(own_tokenizer, own_model, pages=64, page_tokens=16, max_batch_tokens=128)
    yield Harness(runner), fake_eos
    runner.close()


def _generate_with(model: Any, tokenizer: Any, eos: list[int], **kwargs: Any) -> str:
    enc = tokenizer("Hello", return_tensors="pt")
    out = model.generate(**enc, do_sample=False, pad_token_id=0, eos_token_id=eos, **kwargs)
    new = out[0, enc["input_ids"].shape[1] :].tolist()
    for i, token in enumerate(new):
        if token in eos:
            new = new[:i]
            break
    return str(tokenizer.decode(new, skip_special_tokens=True))


def test_eos_ends_the_job_with_finish_reason_stop(eos_harness: tuple[Harness, int]) -> None:
    harness, _ = eos_harness
    outcome = harness.run("Hello", max_new_tokens=30)
    assert (outcome.extra["output_tokens"], outcome.extra["finish_reason"]) == (5, "stop")


def test_ignore_eos_generates_max_new_tokens(eos_harness: tuple[Harness, int]) -> None:
    harness, _ = eos_harness
    outcome = harness.run("Hello", max_new_tokens=30, ignore_eos=True)
    assert (outcome.extra["output_tokens"], outcome.extra["finish_reason"]) == (30, "length")


def test_min_new_tokens_matches_generate(
    eos_harness: tuple[Harness, int], direct: tuple[Any, Any]
) -> None:
    harness, fake_eos = eos_harness
    model, tokenizer = direct
    outcome = harness.run("Hello", max_new_tokens=30, min_new_tokens=12)
    assert outcome.status == "succeeded", outcome.error
    assert outcome.extra["output_tokens"] >= 12
    eos = [tokenizer.eos_token_id, fake_eos]
    expected = _generate_with(model, tokenizer, eos, max_new_tokens=30, min_new_tokens=12)
    assert outcome.output == expected


# -- the engine's loop dying --------------------------------------------------------------------


def test_a_request_larger_than_the_cache_kills_the_loop_and_a_new_engine_serves(
    tiny_dir: Path, direct: tuple[Any, Any]
) -> None:
    """Admission keeps such a job out; here it goes to the runner directly."""
    runner = make_runner(tiny_dir, pages=4)  # 64 positions
    harness = Harness(runner)
    try:
        [outcome] = harness.wait(harness.submit("Hello " * 150, max_new_tokens=10))
        assert (outcome.status, outcome.release) == ("failed", True)
        assert "No requests can be scheduled" in (outcome.error or "")
        outcome = harness.run("Hello", max_new_tokens=12)
        assert outcome.status == "succeeded", outcome.error
        assert outcome.output == generate_directly(*direct, "Hello", 12)
    finally:
        runner.close()


@pytest.mark.parametrize("frozen", [True, False])
def test_a_new_engine_is_frozen_where_start_up_was(tiny_dir: Path, frozen: bool) -> None:
    """The worker daemon freezes what start-up made (gc.freeze); an engine that dies is
    unfrozen with the rest (so that it can be freed) and the next one frozen in turn. A runner
    in a process that froze nothing freezes nothing."""
    runner = make_runner(tiny_dir, pages=4)
    harness = Harness(runner)
    try:
        if frozen:
            gc.freeze()
        [outcome] = harness.wait(harness.submit("Hello " * 150, max_new_tokens=10))
        assert (outcome.status, outcome.release) == ("failed", True)
        assert harness.run("Hello", max_new_tokens=4).status == "succeeded"
        assert (gc.get_freeze_count() > 0) is frozen
    finally:
        gc.unfreeze()
        runner.close()


def test_a_failing_step_releases_every_job_in_flight(
    tiny_dir: Path, direct: tuple[Any, Any], monkeypatch: pytest.MonkeyPatch
) -> None:
    runner = make_runner(tiny_dir)
    harness = Harness(runner)
    model = runner._model
    real_forward = model.forward
    fail = threading.Event()

    def forward(*args: Any, **kwargs: Any) -> Any:
        if fail.is_set():
            fail.clear()
            raise torch.cuda.OutOfMemoryError("CUDA out of memory (simulated)")
        return real_forward(*args, **kwargs)

    monkeypatch.setattr(model, "forward", forward)
    try:
        jobs = [harness.submit(p, max_new_tokens=400, ignore_eos=True) for p in PROMPTS[:3]]
        poll(lambda: all(j.progress >= 3 for j in jobs))
        fail.set()
        for outcome in harness.wait(*jobs):
            assert (outcome.status, outcome.release) == ("failed", True)
            assert "out of memory" in (outcome.error or "")
        outcome = harness.run("Hello", max_new_tokens=12)
        assert outcome.status == "succeeded", outcome.error
        assert outcome.output == generate_directly(*direct, "Hello", 12)
    finally:
        runner.close()
