"""Per-key request and token rate limits, as OpenAI's API has them: a token bucket per key and
per limit, in each gateway process (the limits are per process: behind N replicas a key gets up
to N times its limits; ``max_pending``, read from ZooKeeper, is the fleet-wide bound).

A bucket holds up to a minute's allowance and refills continuously (``requests_per_minute`` / 60
a second). A request takes one from the requests bucket and, from the tokens bucket, its
estimate: the prompt's characters / 4 (OpenAI's rule of thumb; the gateway has no tokenizer)
plus ``max_tokens`` (``zkqueue.protocol.spec.estimate_tokens``, the estimate fair share
charges). When the job ends the estimate is corrected by its usage (prompt and completion
tokens), so a short answer gives back what it did not use. A request the buckets cannot cover
now is answered 429 with ``Retry-After`` (when it could be covered); every answer to a key with
limits carries OpenAI's headers: ``x-ratelimit-limit-requests``,
``x-ratelimit-remaining-requests``, ``x-ratelimit-reset-requests`` (until the bucket is full
again, as ``1s``, ``6m0s``, ``20ms``) and the same three for tokens.
"""

from __future__ import annotations

import math
import time
from dataclasses import dataclass, field

from gateway.config import ApiKey
from gateway.errors import RATE_LIMIT, ApiError


class Bucket:
    """Up to ``per_minute`` units, refilled at ``per_minute / 60`` a second."""

    def __init__(self, per_minute: int) -> None:
        self.limit = per_minute
        self.rate = per_minute / 60.0
        self.level = float(per_minute)
        self.stamp = time.monotonic()

    def _refill(self) -> None:
        now = time.monotonic()
        self.level = min(self.limit, self.level + (now - self.stamp) * self.rate)
        self.stamp = now

    def wait(self, amount: float) -> float:
        """Seconds until ``amount`` can be taken (0: now)."""
        self._refill()
        return max(0.0, (amount - self.level) / self.rate)

    def take(self, amount: float) -> None:
        self._refill()
        self.level -= amount

    def give(self, amount: float) -> None:
        """Put back ``amount`` (never above the limit); a negative amount takes more."""
        self._refill()
        self.level = min(self.limit, self.level + amount)

    def headers(self, kind: str) -> dict[str, str]:
        self._refill()
        until_full = (self.limit - self.level) / self.rate
        return {
            f"x-ratelimit-limit-{kind}": str(self.limit),
            f"x-ratelimit-remaining-{kind}": str(max(0, math.floor(self.level))),
            f"x-ratelimit-reset-{kind}": duration(until_full),
        }


@dataclass
class Grant:
    """What one admitted request took (to correct once its usage is known)."""

    key: str
    tokens: float = 0.0
    settled: bool = field(default=False)


class RateLimits:
    """The buckets of every key with limits, in this process."""

    def __init__(self) -> None:
        self._requests: dict[str, Bucket] = {}
        self._tokens: dict[str, Bucket] = {}

    def _buckets(self, key: ApiKey) -> tuple[Bucket | None, Bucket | None]:
        requests = tokens = None
        if key.requests_per_minute is not None:
            requests = self._requests.setdefault(key.name, Bucket(key.requests_per_minute))
        if key.tokens_per_minute is not None:
            tokens = self._tokens.setdefault(key.name, Bucket(key.tokens_per_minute))
        return requests, tokens

    def admit(self, key: ApiKey | None, estimate: int) -> Grant | None:
        """Take one request and ``estimate`` tokens from the key's buckets, or raise a 429
        that says when to come back (None: the key has no limits). The answer adds the key's
        ``headers`` (every answer does)."""
        if key is None or (key.requests_per_minute is None and key.tokens_per_minute is None):
            return None
        requests, tokens = self._buckets(key)
        if tokens is not None and estimate > tokens.limit:
            raise ApiError(
                429,
                f"this request may use {estimate} tokens (prompt and max_tokens), more than key "
                f"{key.name!r} may use in a minute ({tokens.limit}); ask for fewer max_tokens",
                RATE_LIMIT,
                "tokens",
            )
        waits = {
            "requests": requests.wait(1) if requests is not None else 0.0,
            "tokens": tokens.wait(estimate) if tokens is not None else 0.0,
        }
        kind, wait = max(waits.items(), key=lambda item: item[1])
        if wait > 0:
            bucket = requests if kind == "requests" else tokens
            limit = bucket.limit if bucket is not None else 0
            headers = {"Retry-After": str(max(1, math.ceil(wait)))}
            raise ApiError(
                429,
                f"rate limit reached for key {key.name!r}: {limit} {kind} a minute on this "
                f"gateway; try again in {duration(wait)}",
                RATE_LIMIT,
                kind,
                headers=headers,
            )
        if requests is not None:
            requests.take(1)
        if tokens is not None:
            tokens.take(estimate)
        return Grant(key.name, float(estimate))

    def settle(self, grant: Grant | None, used: int | None) -> None:
        """The request ended having used ``used`` tokens (None: unknown, the estimate
        stands): give back what the estimate took beyond it, or take what it missed."""
        if grant is None or grant.settled:
            return
        grant.settled = True
        bucket = self._tokens.get(grant.key)
        if bucket is not None and used is not None:
            bucket.give(grant.tokens - used)  # negative: an answer longer than estimated

    def refund(self, grant: Grant | None) -> None:
        """The request was refused after it was admitted (its queue full, no worker...): it
        takes nothing, neither its request nor its tokens."""
        if grant is None or grant.settled:
            return
        grant.settled = True
        requests, tokens = self._requests.get(grant.key), self._tokens.get(grant.key)
        if requests is not None:
            requests.give(1)
        if tokens is not None:
            tokens.give(grant.tokens)

    def headers(self, key: ApiKey | None) -> dict[str, str]:
        """OpenAI's ``x-ratelimit-*`` headers of the key's limits ({} for a key without)."""
        if key is None:
            return {}
        requests, tokens = self._buckets(key)
        out: dict[str, str] = {}
        if requests is not None:
            out.update(requests.headers("requests"))
        if tokens is not None:
            out.update(tokens.headers("tokens"))
        return out


def duration(seconds: float) -> str:
    """A duration as OpenAI writes it in ``x-ratelimit-reset-*``: ``20ms``, ``1.5s``, ``6m0s``
    (to the millisecond)."""
    millis = max(0, round(seconds * 1000))
    if millis < 1000:
        return f"{millis}ms"
    minutes, rest = divmod(millis, 60_000)
    text = f"{rest // 1000}.{rest % 1000:03d}".rstrip("0").rstrip(".") + "s"
    return f"{minutes}m{text}" if minutes else text
