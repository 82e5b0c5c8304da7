"""Admission: may this worker take this job now (its KV-cache pages fit beside the pages promised
to the jobs it runs), later (it fits the idle cache), or never (it is larger than the whole cache)?

The engine's cache is sized once when the worker starts (``workers.kvcache.size_cache``): a fixed
number of pages of ``page_tokens`` positions each. A job needs
``ceil((prompt_tokens + max_new_tokens) / page_tokens)`` pages for its whole life, so a worker that
only admits jobs whose pages fit beside the promised ones never runs out of cache. Slot counting
is the worker's; without a cache (echo runner) every job fits.
"""

from __future__ import annotations

import enum
import math
import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

from zkqueue.protocol.spec import JobSpec


class Verdict(enum.Enum):
    ADMIT = "admit"
    #: Fits the idle cache: leave it pending until pages free up.
    WAIT = "wait"
    #: Needs more pages than this worker's whole cache: leave it for a bigger worker.
    NEVER = "never"
    #: Can never run on this queue's model (prompt + max_new_tokens over its context): end it.
    REJECT = "reject"


@dataclass(frozen=True)
class Decision:
    verdict: Verdict
    #: Pages the job needs (0 without a cache).
    pages: int = 0
    reason: str = ""


class Admission:
    """Judges jobs against a cache of ``pages_total`` pages and keeps the ledger of promises."""

    def __init__(
        self,
        pages_total: int | None = None,
        page_tokens: int = 1,
        count_tokens: Callable[[JobSpec], int] | None = None,
        validate: Callable[[JobSpec], str | None] | None = None,
        pages_in_use: Callable[[], int | None] | None = None,
    ) -> None:
        self.pages_total = pages_total
        self._in_use = pages_in_use
        self.page_tokens = page_tokens
        self._count = count_tokens
        self._validate = validate
        self._lock = threading.Lock()
        self._promised = 0

    @property
    def promised(self) -> int:
        """Pages promised to the jobs this worker holds."""
        return self._promised

    @property
    def capacity_tokens(self) -> int | None:
        """Positions the whole cache holds (comparable across workers with other page sizes)."""
        return None if self.pages_total is None else self.pages_total * self.page_tokens

    def in_use(self) -> int | None:
        """Pages the engine's cache holds now, where the engine can tell."""
        return None if self._in_use is None else self._in_use()

    def pages_for(self, spec: JobSpec) -> int:
        """Pages ``spec`` takes at its longest: its prompt plus every token it may generate."""
        if self._count is None:
            return 0
        return math.ceil((self._count(spec) + spec.max_new_tokens) / self.page_tokens)

    def judge(self, spec: JobSpec, extra: int = 0) -> Decision:
        """Judge ``spec`` as one more job beside the promised pages and ``extra`` pages picked
        earlier in the same turn but not yet reserved."""
        if self._validate is not None:
            problem = self._validate(spec)
            if problem:
                return Decision(Verdict.REJECT, 0, problem)
        if self.pages_total is None:
            return Decision(Verdict.ADMIT)
        pages = self.pages_for(spec)
        if pages > self.pages_total:
            return Decision(
                Verdict.NEVER,
                pages,
                f"needs {pages} KV-cache pages of {self.page_tokens} tokens; this worker's "
                f"whole cache is {self.pages_total} pages",
            )
        free = self.pages_total - self._promised - extra
        if pages > free:
            return Decision(Verdict.WAIT, pages, f"needs {pages} pages; {free} free")
        return Decision(Verdict.ADMIT, pages)

    def reserve(self, pages: int) -> None:
        with self._lock:
            self._promised += pages

    def release(self, pages: int) -> None:
        with self._lock:
            self._promised = max(0, self._promised - pages)


#: While a high-priority job runs, a worker holds lower-priority jobs only up to a narrower
#: batch (``high_width``): the largest size at which one request's time per generated token is
#: at most this many times the shortest measured. The knee trades each request's
#: speed for the batch's throughput; an urgent job should not pay for that trade. 1.5 keeps the
#: urgent job's steps within half again of a lone request's (on the tiny model on the CPU: 1 to 4
#: requests, against a knee of 16 to 32); on a GPU, where a wider batch costs a step little,
#: the width follows the curve and stays wide.
HIGH_SLOWDOWN = 1.5


def high_width(curve: Sequence[tuple[int, float]], slowdown: float = HIGH_SLOWDOWN) -> int | None:
    """The narrowed batch for ``curve`` (calibration points ``(requests in flight, tokens/s)``,
    smallest first): the largest size up to which every size measured keeps one request's time
    per token (``size / tokens/s``) within ``slowdown`` of the shortest such time measured.
    None for an empty curve."""
    per_token = [(n, n / tok_s if tok_s > 0 else math.inf) for n, tok_s in curve]
    if not per_token:
        return None
    bound = slowdown * min(t for _, t in per_token)
    width = per_token[0][0]
    for n, t in per_token[1:]:
        if t > bound:
            break
        width = n
    return width
