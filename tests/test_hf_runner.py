"""The HuggingFace runner against the real tiny model on the CPU in float32."""

from __future__ import annotations

import logging
import threading
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from tests.runners import generate_directly
from workers.runners.base import Outcome, RunningJob
from workers.runners.hf import BatchOutOfMemory, HFRunner
from workers.tinymodel import CONTEXT_LENGTH, write_tiny_model
from zkqueue.errors import ConfigurationError
from zkqueue.spec import JobSpec

PROMPTS = [
    "Hello",
    "The worker admits a job only when a slot is free and",
    "A",
    "Numbers 1 2 3 and symbols ( ) [ ] { } appear too, " * 3,
    "def run(jobs):",
]


@pytest.fixture(scope="module")
def tiny_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return write_tiny_model(tmp_path_factory.mktemp("tiny"), seed=0)


@pytest.fixture(scope="module")
def runner(tiny_dir: Path) -> Iterator[HFRunner]:
    hf = HFRunner(tiny_dir, device="cpu", dtype="float32")
    yield hf
    hf.close()


@pytest.fixture(scope="module")
def direct(tiny_dir: Path) -> tuple[Any, Any]:
    """The model and tokenizer loaded independently of the runner."""
    model = AutoModelForCausalLM.from_pretrained(tiny_dir, local_files_only=True).eval()
    return model, AutoTokenizer.from_pretrained(tiny_dir, local_files_only=True)


def job(prompt: str = "Hello", job_id: str = "job", **spec: Any) -> RunningJob:
    return RunningJob(
        id=job_id,
        spec=JobSpec(prompt=prompt, **spec),
        priority="normal",
        queue="default",
        attempts=1,
    )


def wait_for(condition: Callable[[], bool], timeout: float = 30.0) -> None:
    deadline = time.monotonic() + timeout
    while not condition():
        assert time.monotonic() < deadline, "condition not met in time"
        time.sleep(0.001)


def count_generate_calls(monkeypatch: pytest.MonkeyPatch, runner: HFRunner) -> list[int]:
    """Record the batch size of every ``generate`` call the runner makes."""
    calls: list[int] = []
    real = runner._model.generate

    def counting(*args: Any, **kwargs: Any) -> Any:
        calls.append(int(kwargs["input_ids"].shape[0]))
        return real(*args, **kwargs)

    monkeypatch.setattr(runner._model, "generate", counting)
    return calls


# -- describing the model -----------------------------------------------------------------------


def test_describe(runner: HFRunner, tiny_dir: Path) -> None:
    info = runner.describe()
    params = sum(p.numel() * 4 for p in runner._model.parameters())
    assert info["model"] == str(tiny_dir) == runner.name
    assert (info["device"], info["dtype"], info["dtype_bytes"]) == ("cpu", "float32", 4)
    assert params <= info["weight_bytes"] < params * 1.01
    assert info["max_batch"] == 8
    assert info["context_length"] == runner.context_length == CONTEXT_LENGTH
    assert runner.config.num_key_value_heads == 2


def test_count_tokens_matches_the_tokenizer(runner: HFRunner, direct: tuple[Any, Any]) -> None:
    _, tokenizer = direct
    for prompt in PROMPTS:
        assert runner.count_tokens(prompt) == len(tokenizer(prompt)["input_ids"])


def test_need_bytes_grows_with_the_job(runner: HFRunner) -> None:
    small = runner.need_bytes(JobSpec(prompt="Hi", max_new_tokens=4))
    big = runner.need_bytes(JobSpec(prompt="Hi " * 50, max_new_tokens=400))
    assert 0 < small < big


# -- generation ---------------------------------------------------------------------------------


@pytest.mark.parametrize("max_new_tokens", [1, 12, 40])
def test_single_greedy_job_matches_generate(
    runner: HFRunner, direct: tuple[Any, Any], max_new_tokens: int
) -> None:
    for prompt in PROMPTS:
        [outcome] = runner.run([job(prompt, max_new_tokens=max_new_tokens)])
        assert outcome.status == "succeeded", outcome.error
        assert outcome.output == generate_directly(*direct, prompt, max_new_tokens)
        assert outcome.extra["output_tokens"] == max_new_tokens


def test_batch_equals_each_job_alone_in_one_generate_call(
    runner: HFRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    limits = [5, 30, 17, 40, 1]
    pairs = zip(PROMPTS, limits, strict=True)
    jobs = [job(p, f"j{i}", max_new_tokens=n) for i, (p, n) in enumerate(pairs)]
    alone = [
        runner.run([job(j.spec.prompt, max_new_tokens=j.spec.max_new_tokens)])[0] for j in jobs
    ]
    calls = count_generate_calls(monkeypatch, runner)
    batched = runner.run(jobs)
    assert calls == [len(jobs)]
    for j, b, a in zip(jobs, batched, alone, strict=True):
        assert b.status == "succeeded"
        assert b.output == a.output
        assert b.extra["output_tokens"] == j.spec.max_new_tokens == j.progress
        assert b.extra["prompt_tokens"] == runner.count_tokens(j.spec.prompt)
        assert 0 < b.extra["ttft_s"] <= b.extra["total_s"]


def test_max_batch_splits_the_batch(runner: HFRunner, monkeypatch: pytest.MonkeyPatch) -> None:
    jobs = [job(p, max_new_tokens=6) for p in PROMPTS]
    expected = [o.output for o in runner.run(jobs)]
    monkeypatch.setattr(runner, "max_batch", 2)
    calls = count_generate_calls(monkeypatch, runner)
    assert [o.output for o in runner.run(jobs)] == expected
    assert calls == [2, 2, 1]


def test_eos_ends_a_row_early_while_others_continue(tiny_dir: Path) -> None:
    """Make eos win where the token greedy decoding picks third would (its lm_head row copied,
    scaled up by 1%); then that row stops at eos early and still matches ``generate``."""
    hf = HFRunner(tiny_dir, device="cpu", dtype="float32")
    tokenizer = hf._tokenizer
    enc = tokenizer(PROMPTS[1], return_tensors="pt")
    out = hf._model.generate(
        **enc, max_new_tokens=3, do_sample=False, pad_token_id=tokenizer.pad_token_id
    )
    third = int(out[0, -1])
    with torch.no_grad():
        head = hf._model.lm_head.weight
        head[tokenizer.eos_token_id] = head[third] * 1.01
    expected = generate_directly(hf._model, tokenizer, PROMPTS[1], 50)
    outcomes = hf.run([job(PROMPTS[1], max_new_tokens=50), job(PROMPTS[0], max_new_tokens=50)])
    assert outcomes[0].status == "succeeded"
    assert outcomes[0].output == expected
    assert outcomes[0].extra["output_tokens"] == 2
    assert outcomes[0].output == hf.run([job(PROMPTS[1], max_new_tokens=50)])[0].output
    assert outcomes[1].output == hf.run([job(PROMPTS[0], max_new_tokens=50)])[0].output
    hf.close()


def test_seeded_sampling_is_reproducible_and_leaves_greedy_alone(runner: HFRunner) -> None:
    greedy = runner.run([job(PROMPTS[1], max_new_tokens=20)])[0].output
    sampled = job(PROMPTS[1], max_new_tokens=20, temperature=1.5, seed=7)
    first = runner.run([sampled, job(PROMPTS[1], max_new_tokens=20)])
    again = runner.run([job(PROMPTS[1], max_new_tokens=20, temperature=1.5, seed=7)])
    other = runner.run([job(PROMPTS[1], max_new_tokens=20, temperature=1.5, seed=8)])
    assert first[0].status == "succeeded"
    assert first[0].output == again[0].output
    assert first[0].output != other[0].output
    assert first[1].output == greedy


def test_sampling_jobs_run_apart_from_greedy_ones(
    runner: HFRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    jobs = [
        job(PROMPTS[0], max_new_tokens=4),
        job(PROMPTS[1], max_new_tokens=4, top_p=0.9),
        job(PROMPTS[2], max_new_tokens=4),
        job(PROMPTS[3], max_new_tokens=4, top_p=0.9),
        job(PROMPTS[4], max_new_tokens=4, temperature=0.8, seed=1),
        job(PROMPTS[4], max_new_tokens=4, seed=1),
    ]  # a seed alone: greedy
    calls = count_generate_calls(monkeypatch, runner)
    outcomes = runner.run(jobs)
    assert [o.status for o in outcomes] == ["succeeded"] * 6
    assert calls == [3, 2, 1]


# -- stopping early -----------------------------------------------------------------------------


def test_cancel_from_another_thread_stops_the_row(runner: HFRunner) -> None:
    victim = job(PROMPTS[0], "victim", max_new_tokens=CONTEXT_LENGTH - 8)
    bystander = job(PROMPTS[2], "bystander", max_new_tokens=30)
    outcomes: list[Outcome] = []
    worker = threading.Thread(target=lambda: outcomes.extend(runner.run([victim, bystander])))
    worker.start()
    wait_for(lambda: victim.progress > 0)
    victim.cancel("cancelled")
    seen = victim.progress
    worker.join(timeout=60)
    assert not worker.is_alive()
    cancelled, done = outcomes
    assert cancelled.status == "cancelled"
    assert "cancelled" in (cancelled.error or "")
    assert 0 < cancelled.extra["output_tokens"] <= seen + 1 < victim.spec.max_new_tokens
    assert done.status == "succeeded"
    assert done.output == runner.run([job(PROMPTS[2], max_new_tokens=30)])[0].output


def test_job_cancelled_before_the_run_is_not_generated(runner: HFRunner) -> None:
    early = job(PROMPTS[0], max_new_tokens=10)
    early.cancel("withdrawn")
    [outcome, other] = runner.run([early, job(PROMPTS[1], max_new_tokens=3)])
    assert outcome.status == "cancelled"
    assert "withdrawn" in (outcome.error or "")
    assert outcome.extra["output_tokens"] == 0
    assert other.status == "succeeded"


def test_max_runtime_times_out_with_partial_output(runner: HFRunner) -> None:
    slow = job(PROMPTS[0], max_new_tokens=CONTEXT_LENGTH - 8, max_runtime=0.001)
    quick = job(PROMPTS[1], max_new_tokens=5)
    timed_out, fine = runner.run([slow, quick])
    assert timed_out.status == "timeout"
    assert "max_runtime of 0.001 s" in (timed_out.error or "")
    assert 1 <= timed_out.extra["output_tokens"] < slow.spec.max_new_tokens
    assert timed_out.output
    assert fine.status == "succeeded"
    assert fine.extra["output_tokens"] == 5


def test_default_max_runtime_applies(tiny_dir: Path) -> None:
    hf = HFRunner(tiny_dir, device="cpu", dtype="float32", default_max_runtime=0.001)
    [outcome] = hf.run([job(PROMPTS[0], max_new_tokens=CONTEXT_LENGTH - 8)])
    assert outcome.status == "timeout"
    hf.close()


def test_slow_jobs_are_logged(
    runner: HFRunner, monkeypatch: pytest.MonkeyPatch, caplog: pytest.LogCaptureFixture
) -> None:
    monkeypatch.setattr(runner, "slow_after", 0.0)
    with caplog.at_level(logging.WARNING, logger="zkq.runner"):
        runner.run([job(PROMPTS[1], "slowpoke", max_new_tokens=3)])
    [record] = [r for r in caplog.records if "slowpoke" in r.getMessage()]
    assert f"prompt {runner.count_tokens(PROMPTS[1])} tokens" in record.getMessage()


# -- bad jobs and bad batches -------------------------------------------------------------------


def test_prompt_too_long_fails_alone(runner: HFRunner) -> None:
    long_prompt = "queue " * 600
    too_long = job(long_prompt, "long", max_new_tokens=8)
    n = runner.count_tokens(long_prompt)
    just_over = job("Hello " * 100, "over", max_new_tokens=CONTEXT_LENGTH)
    fine = job(PROMPTS[1], max_new_tokens=8)
    outcomes = runner.run([too_long, fine, just_over])
    assert [o.status for o in outcomes] == ["failed", "succeeded", "failed"]
    assert f"prompt is {n} tokens" in (outcomes[0].error or "")
    assert f"context of {CONTEXT_LENGTH} tokens" in (outcomes[0].error or "")
    assert "max_new_tokens=512" in (outcomes[2].error or "")
    assert outcomes[1].output == runner.run([job(PROMPTS[1], max_new_tokens=8)])[0].output
    assert runner.validate(too_long.spec) == outcomes[0].error
    assert runner.validate(fine.spec) is None


def test_out_of_memory_becomes_batch_out_of_memory(
    runner: HFRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    real = runner._model.generate

    def oom_when_sampling(*args: Any, **kwargs: Any) -> Any:
        if kwargs.get("do_sample"):
            raise torch.cuda.OutOfMemoryError("CUDA out of memory. Tried to allocate 2 GiB")
        return real(*args, **kwargs)

    monkeypatch.setattr(runner._model, "generate", oom_when_sampling)
    jobs = [job(PROMPTS[0], max_new_tokens=3), job(PROMPTS[1], max_new_tokens=3, temperature=0.7)]
    with pytest.raises(BatchOutOfMemory, match="out of device memory") as info:
        runner.run(jobs)
    finished, lost = info.value.outcomes
    assert finished is not None and finished.status == "succeeded"
    assert lost is None
    assert info.value.batch_size == 1


def test_other_generate_errors_fail_the_jobs(
    runner: HFRunner, monkeypatch: pytest.MonkeyPatch
) -> None:
    def broken(*args: Any, **kwargs: Any) -> Any:
        raise RuntimeError("kernel exploded")

    monkeypatch.setattr(runner._model, "generate", broken)
    outcomes = runner.run([job(PROMPTS[0]), job(PROMPTS[1])])
    assert [o.status for o in outcomes] == ["failed", "failed"]
    assert "kernel exploded" in (outcomes[0].error or "")


def test_missing_directory_is_a_configuration_error(tmp_path: Path) -> None:
    missing = tmp_path / "nowhere"
    with pytest.raises(ConfigurationError, match=str(missing)):
        HFRunner(missing, device="cpu")


def test_directory_without_a_model_is_a_configuration_error(tmp_path: Path) -> None:
    with pytest.raises(ConfigurationError, match=r"no config\.json"):
        HFRunner(tmp_path, device="cpu")
    (tmp_path / "config.json").write_text('{"model_type": "llama"}')
    with pytest.raises(ConfigurationError, match=str(tmp_path)):
        HFRunner(tmp_path, device="cpu")


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"dtype": "float8"}, "unknown dtype"),
        ({"max_batch": 0}, "max_batch"),
        ({"device": "nonsense"}, "bad device"),
    ],
)
def test_bad_settings_are_configuration_errors(
    tiny_dir: Path, kwargs: dict[str, Any], message: str
) -> None:
    with pytest.raises(ConfigurationError, match=message):
        HFRunner(tiny_dir, **kwargs)


@pytest.mark.skipif(torch.cuda.is_available(), reason="a GPU is present")
def test_cuda_without_a_gpu_is_a_configuration_error(tiny_dir: Path) -> None:
    with pytest.raises(ConfigurationError, match="no CUDA"):
        HFRunner(tiny_dir, device="cuda")
