"""Admission in KV-cache pages: a job takes ceil((prompt + max_new_tokens) / page_tokens) pages
for its whole life; it is admitted while those fit beside the pages promised to running jobs."""

from __future__ import annotations

import threading

from workers.admission import Admission, Verdict
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
