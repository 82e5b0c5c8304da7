"""Expiring results through the expiry index, with work bounded per pass.

Every result is written with a node ``expiry/<tick>/<id>-<bytes>`` in the same multi, where the
tick is its finishing time divided by EXPIRY_TICK seconds. The janitor lists the ticks (one name
per ten seconds of retention), and drains whole ticks oldest first: those past the retention, and
more while the queue holds more results than its bound (count, or estimated bytes). A pass deletes
at most ``page`` results, ``in_flight`` at a time, so its cost never grows with the number of
results stored. Stored results are counted from the child counts of the 256 result buckets."""

from __future__ import annotations

import logging
from dataclasses import dataclass

from kazoo.client import KazooClient
from kazoo.exceptions import BadVersionError, NoNodeError, NotEmptyError

from zkqueue import defaults
from zkqueue.errors import ConfigurationError
from zkqueue.protocol import counts
from zkqueue.protocol.layout import Layout, child, parse_index_name

log = logging.getLogger("zkq.janitor")
#: Share of a bound at which the janitor warns.
_WARN_AT = 0.9


@dataclass
class ExpiryLimits:
    """Per-queue bounds and the janitor's budget per pass (defaults in ``zkqueue.defaults``)."""

    max_results: int = defaults.MAX_RESULTS
    max_bytes: int = defaults.MAX_RESULT_STORE_BYTES
    max_dead: int = defaults.MAX_DEAD
    page: int = defaults.JANITOR_PAGE
    in_flight: int = defaults.JANITOR_IN_FLIGHT

    def __post_init__(self) -> None:
        for name in ("max_results", "max_bytes", "max_dead", "page", "in_flight"):
            if getattr(self, name) < 1:
                raise ConfigurationError(f"{name} must be at least 1, not {getattr(self, name)}")


class Expiry:
    """The expiry of one queue's results and dead letters (the janitor's thread only)."""

    def __init__(self, zk: KazooClient, layout: Layout, queue: str, limits: ExpiryLimits) -> None:
        self.zk = zk
        self.layout = layout
        self.queue = queue
        self.limits = limits
        #: Per tick listed once: (results indexed, bytes of their records), for the estimate.
        self._sizes: dict[str, tuple[int, int]] = {}

    def run(self, now: float, ttl: float) -> tuple[int, int, int]:
        """One pass: returns (results removed, results stored after, estimated bytes after)."""
        try:
            ticks = sorted(self.zk.get_children(self.layout.expiry(self.queue)))
        except NoNodeError:
            return 0, 0, 0
        stored = counts.results(self.zk, self.layout, self.queue)
        self._sample(ticks)
        cutoff = int((now - ttl) // defaults.EXPIRY_TICK)
        budget, removed = self.limits.page, 0
        for tick in ticks:
            expired = tick.isdigit() and int(tick) < cutoff
            excess = self._excess(stored - removed)
            if budget <= 0 or (not expired and excess <= 0):
                break
            gone, used, emptied = self._drain(tick, budget if expired else min(budget, excess))
            removed, budget = removed + gone, budget - used
            if not emptied:
                break
        left = stored - removed
        self._warn(left)
        return removed, left, self._bytes(left)

    def _excess(self, stored: int) -> int:
        """Results beyond the bound: by count, or by estimated bytes over the mean size."""
        over = stored - self.limits.max_results
        size = self._bytes(stored)
        if size > self.limits.max_bytes and stored:
            over = max(over, -(-(size - self.limits.max_bytes) * stored // size))
        return over

    def _bytes(self, stored: int) -> int:
        """Estimated bytes of ``stored`` records: their count times the mean record size of the
        ticks sampled so far."""
        count = sum(c for c, _ in self._sizes.values())
        size = sum(b for _, b in self._sizes.values())
        return stored * size // count if count else 0

    def _warn(self, stored: int) -> None:
        limits = self.limits
        if (
            stored > _WARN_AT * limits.max_results
            or self._bytes(stored) > _WARN_AT * limits.max_bytes
        ):
            log.warning(
                "queue %s holds %d results (~%d bytes): near its bound of %d results / %d bytes; "
                "the oldest are expired first",
                self.queue,
                stored,
                self._bytes(stored),
                limits.max_results,
                limits.max_bytes,
            )

    def _sample(self, ticks: list[str]) -> None:
        """List one not yet sampled tick (newest closed first) for the bytes estimate."""
        self._sizes = {t: v for t, v in self._sizes.items() if t in set(ticks)}
        for tick in reversed(ticks[:-1]):
            if tick not in self._sizes:
                self._names(tick)
                return

    def _names(self, tick: str) -> list[str]:
        try:
            names = self.zk.get_children(self.layout.expiry_bucket(self.queue, tick))
        except NoNodeError:
            names = []
        parsed = [p for n in names if (p := parse_index_name(n)) is not None]
        self._sizes[tick] = (len(parsed), sum(size for _, size in parsed))
        return names

    def _drain(self, tick: str, budget: int) -> tuple[int, int, bool]:
        """Delete up to ``budget`` results of one tick with their index nodes, then the tick if
        it is empty. Returns (results deleted, index nodes handled, tick emptied)."""
        bucket = self.layout.expiry_bucket(self.queue, tick)
        names = self._names(tick)
        page = names[:budget]
        gone = 0
        step = self.limits.in_flight
        for start in range(0, len(page), step):
            chunk = page[start : start + step]
            ids = [(n, p[0] if (p := parse_index_name(n)) else None) for n in chunk]
            stats = [
                (
                    n,
                    j,
                    self.zk.exists_async(child(bucket, n)),
                    self.zk.exists_async(self.layout.result(self.queue, j)) if j else None,
                )
                for n, j in ids
            ]
            results, index = [], []
            for name, job_id, idx_call, res_call in stats:
                idx = idx_call.get()
                res = res_call.get() if res_call is not None else None
                # The result and its index node were created by one multi (one zxid); a result
                # with another zxid was written later under the same id (requeued): not ours.
                if idx is not None and res is not None and job_id and res.czxid == idx.czxid:
                    path = self.layout.result(self.queue, job_id)
                    results.append(self.zk.delete_async(path, res.version))
                index.append(self.zk.delete_async(child(bucket, name)))
            gone += sum(_done(call) for call in results)
            for call in index:
                _done(call)
        emptied = len(page) == len(names)
        if emptied:
            try:
                self.zk.delete(bucket)
                self._sizes.pop(tick, None)
            except (NoNodeError, NotEmptyError):
                pass
        return gone, len(page), emptied

    def trim_dead(self) -> int:
        """Remove the oldest dead letters beyond the bound (at most a page a pass)."""
        path = self.layout.dead(self.queue)
        stat = self.zk.exists(path)
        extra = (stat.numChildren if stat else 0) - self.limits.max_dead
        if extra <= 0:
            return 0
        from zkqueue.producer.deadletters import purge

        return purge(self.zk, self.layout, self.queue, limit=min(extra, self.limits.page))


def _done(call: object) -> bool:
    try:
        call.get()  # type: ignore[attr-defined]
    except (NoNodeError, BadVersionError):
        return False
    return True
