"""Admission in KV-cache pages: a job takes ceil((prompt + max_new_tokens) / page_tokens) pages
for its whole life; it is admitted while those fit beside the pages promised to running jobs."""

from __future__ import annotations

import threading

import pytest

from workers.admission import Admission, Verdict, high_width
from workers.calibration import Slots
from workers.options import WorkerOptions, high_width_for
from zkqueue.errors import ConfigurationError
from zkqueue.protocol.spec import JobSpec


def count(spec: JobSpec) -> int:
    """One token per character: easy page arithmetic."""
    return len(spec.prompt)


def make(pages: int = 10, page_tokens: int = 16) -> Admission:
    return Admission(
        pages,
        page_tokens,
        count_tokens=count,
        validate=lambda s: "too long" if len(s.prompt) > 500 else None,
    )


def test_a_job_takes_whole_pages_for_its_prompt_and_new_tokens() -> None:
    adm = make()
    assert adm.pages_for(JobSpec(prompt="x" * 10, max_new_tokens=6)) == 1
    assert adm.pages_for(JobSpec(prompt="x" * 10, max_new_tokens=7)) == 2
    assert adm.pages_for(JobSpec(prompt="x" * 32, max_new_tokens=32)) == 4


def test_a_job_that_fits_is_admitted_with_its_pages() -> None:
    d = make().judge(JobSpec(prompt="x" * 20, max_new_tokens=20))
    assert (d.verdict, d.pages) == (Verdict.ADMIT, 3)


def test_promised_pages_make_the_next_job_wait() -> None:
    adm = make(pages=4)
    spec = JobSpec(prompt="x" * 20, max_new_tokens=20)  # 3 pages
    adm.reserve(adm.judge(spec).pages)
    assert adm.promised == 3
    d = adm.judge(spec)
    assert d.verdict == Verdict.WAIT
    assert "1 free" in d.reason
    adm.release(3)
    assert adm.judge(spec).verdict == Verdict.ADMIT


def test_pages_picked_earlier_in_the_same_turn_count() -> None:
    adm = make(pages=4)
    spec = JobSpec(prompt="x" * 20, max_new_tokens=20)
    assert adm.judge(spec, extra=0).verdict == Verdict.ADMIT
    assert adm.judge(spec, extra=3).verdict == Verdict.WAIT


def test_bigger_than_the_whole_cache_is_never_here() -> None:
    d = make(pages=2).judge(JobSpec(prompt="x" * 40, max_new_tokens=10))
    assert (d.verdict, d.pages) == (Verdict.NEVER, 4)
    assert "whole cache is 2 pages" in d.reason


def test_validation_failure_is_a_rejection() -> None:
    d = make().judge(JobSpec(prompt="x" * 600))
    assert (d.verdict, d.reason) == (Verdict.REJECT, "too long")


def test_capacity_in_tokens_compares_workers_with_other_page_sizes() -> None:
    assert make(pages=10, page_tokens=16).capacity_tokens == 160
    assert Admission().capacity_tokens is None


def test_release_never_goes_below_zero() -> None:
    adm = make()
    adm.reserve(2)
    adm.release(5)
    assert adm.promised == 0


def test_the_ledger_is_thread_safe() -> None:
    adm = make(pages=1000)

    def churn() -> None:
        for _ in range(1000):
            adm.reserve(3)
            adm.release(3)
        adm.reserve(1)

    threads = [threading.Thread(target=churn) for _ in range(8)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert adm.promised == 8


def test_without_a_cache_everything_fits() -> None:
    d = Admission().judge(JobSpec(prompt="x"))
    assert (d.verdict, d.pages) == (Verdict.ADMIT, 0)


def test_the_high_width_is_the_widest_batch_within_half_again_of_a_lone_requests_speed() -> None:
    # Measured on the tiny model on the CPU (BENCHMARKS.md): ms per token 1.4, 1.8, 1.8, 3.0...
    curve = [(1, 706.0), (2, 1133.0), (4, 2188.0), (8, 2658.0), (16, 3206.0), (32, 3011.0)]
    assert high_width(curve) == 4
    # A GPU-like curve, where a wider batch costs a step little, stays wide.
    flat_steps = [(1, 100.0), (2, 200.0), (4, 400.0), (8, 790.0), (16, 1500.0), (32, 2500.0)]
    assert high_width(flat_steps) == 32
    # A size past the bound ends the width even if a wider one measured faster (noise).
    assert high_width([(1, 100.0), (2, 100.0), (4, 400.0)]) == 1
    assert high_width([]) is None


class _Runner:
    def __init__(self, curve: list[tuple[int, float]]) -> None:
        self.slots = Slots(16, "measured", tuple(curve))


def test_the_high_width_setting() -> None:
    curve = [(1, 706.0), (2, 1133.0), (4, 2188.0), (8, 2658.0), (16, 3206.0)]
    assert high_width_for(WorkerOptions(), _Runner(curve), 16) == 4
    assert high_width_for(WorkerOptions(), _Runner([]), 16) is None  # no curve: no limit
    assert high_width_for(WorkerOptions(), object(), 16) is None
    assert high_width_for(WorkerOptions(high_width="off"), _Runner(curve), 16) is None
    assert high_width_for(WorkerOptions(high_width=3), object(), 16) == 3
    assert high_width_for(WorkerOptions(high_width="3"), object(), 16) == 3
    assert high_width_for(WorkerOptions(high_width=16), object(), 16) is None  # as wide
    for bad in ("0", 0, "-2", "some", 2.5, True):
        with pytest.raises(ConfigurationError, match="high_width must be auto, off or"):
            WorkerOptions(high_width=bad)  # type: ignore[arg-type]
