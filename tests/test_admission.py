"""Admission rules, with a batch estimator that charges padding like the model runner does."""

from __future__ import annotations

from collections.abc import Sequence

from workers.admission import Admission, Verdict
from zkqueue.spec import JobSpec

PER_TOKEN = 10


def padded(specs: Sequence[JobSpec]) -> int:
    """Every row as long as the longest prompt, run for the largest max_new_tokens."""
    if not specs:
        return 0
    return (
        len(specs)
        * PER_TOKEN
        * (max(len(s.prompt) for s in specs) + max(s.max_new_tokens for s in specs))
    )


def make(free: int, capacity: int, keep_free: int = 0) -> Admission:
    return Admission(
        estimate=padded,
        free=lambda: free,
        capacity=capacity,
        keep_free=keep_free,
        validate=lambda s: "too long" if len(s.prompt) > 500 else None,
    )


def test_a_job_that_fits_is_admitted_with_its_need() -> None:
    d = make(free=10_000, capacity=10_000).judge(JobSpec(prompt="x" * 10, max_new_tokens=10))
    assert (d.verdict, d.need) == (Verdict.ADMIT, 200)


def test_a_job_that_fits_an_idle_worker_waits() -> None:
    d = make(free=150, capacity=10_000).judge(JobSpec(prompt="x" * 10, max_new_tokens=10))
    assert d.verdict == Verdict.WAIT


def test_keep_free_is_never_promised() -> None:
    spec = JobSpec(prompt="x" * 10, max_new_tokens=10)
    assert make(free=250, capacity=10_000, keep_free=0).judge(spec).verdict == Verdict.ADMIT
    assert make(free=250, capacity=10_000, keep_free=100).judge(spec).verdict == Verdict.WAIT


def test_bigger_than_capacity_is_never_here() -> None:
    d = make(free=10_000, capacity=100).judge(JobSpec(prompt="x" * 10, max_new_tokens=10))
    assert d.verdict == Verdict.NEVER
    assert "this worker holds at most" in d.reason


def test_validation_failure_is_a_rejection() -> None:
    d = make(free=10_000, capacity=10_000).judge(JobSpec(prompt="x" * 600))
    assert (d.verdict, d.reason) == (Verdict.REJECT, "too long")


def test_padding_is_charged_to_the_batch() -> None:
    """A short job next to a long one costs as much as the long one: the sum would under-count."""
    long = JobSpec(prompt="x" * 100, max_new_tokens=10)
    short = JobSpec(prompt="x", max_new_tokens=1)
    adm = make(free=2_000, capacity=10_000)
    assert adm.judge(long).need == 1_100
    second = adm.judge(short, [long])
    assert second.verdict == Verdict.WAIT  # 2 rows x 110 tokens x 10 = 2200 > 2000
    assert make(free=2_200, capacity=10_000).judge(short, [long]).need == 1_100


def test_without_an_estimator_everything_fits() -> None:
    assert Admission().judge(JobSpec(prompt="x")).verdict == Verdict.ADMIT
