"""A handle on one job for asyncio code: await its result, iterate its stream, cancel it.

The waits follow the blocking Job's reads (zkqueue/producer/job.py) with watches turned into one
asyncio event per job: a watch fires on kazoo's thread, the event is set on the loop, the waiter
reads again. While a streaming job runs, what the watches that fired say decides what is read
(watches are hints: a quiet ``_RECHECK_SECONDS``, or anything else, reads everything again):

* its claim made or changed: the claim, watched again, in one read (where everything is five);
  with a change of its entry's data too (a claim bumps the entry's version), the entry as well,
  watched again, in the same round trip;
* its result made: the result alone, its watch spent (one read). A claim watch still set is
  taken back in the same flush: a job that ended without a claim (cancelled or expired while
  pending, refused) never makes the claim it waits for.

A read that finds one of them gone reads everything. A wait that ends with the request withdrawn
takes its watches back too.
"""

from __future__ import annotations

import asyncio
import contextlib
import time
from collections.abc import AsyncIterator, Callable
from typing import TYPE_CHECKING, Any, Protocol

from kazoo.exceptions import NoNodeError
from kazoo.protocol.states import EventType, WatchedEvent

from zkqueue.errors import CorruptRecord, JobWithdrawn, ZkqConnectionError
from zkqueue.plumbing.connection import TRANSIENT, mapped_errors, send_when_connected
from zkqueue.plumbing.watches import remove_data_watch
from zkqueue.producer.direct import AsyncTap, StreamReading
from zkqueue.protocol import claims
from zkqueue.protocol.jobpaths import JobPaths
from zkqueue.protocol.records import ClaimBody
from zkqueue.protocol.result import Result

if TYPE_CHECKING:
    from kazoo.client import KazooClient
    from kazoo.interfaces import IAsyncResult

    from zkqueue.plumbing.connection import ConnectionSettings
    from zkqueue.protocol.layout import Layout


class LoopClient(Protocol):
    """What an AsyncJob needs of its client (``zkqueue.producer.aio.AsyncClient`` is one)."""

    layout: Layout
    settings: ConnectionSettings

    @property
    def zk(self) -> KazooClient: ...

    @property
    def handoff(self) -> Any: ...

    async def wait(self, call: IAsyncResult, timeout: float | None = None) -> Any: ...

    async def blocking(self, func: Callable[..., Any], *args: Any) -> Any: ...

    async def maybe(self, call: IAsyncResult) -> Any: ...

    def stream_http(self) -> Any: ...


#: Seconds between reads without a watch firing, and while ZooKeeper is unreachable.
_RECHECK_SECONDS = 2.0
_RECONNECT_POLL = 0.25
#: What a read raises while ZooKeeper is away (kazoo reconnects by itself): wait and read again.
_AWAY = (*TRANSIENT, ZkqConnectionError)


class AsyncJob(JobPaths):
    """A job by id. ``owned`` marks the submitter's handle: only it withdraws an attached
    request (on timeout, or when the task waiting on it is cancelled) and removes an attached
    result once read."""

    client: LoopClient

    def _start(self) -> None:
        self.record: Result | None = None
        self._wake = asyncio.Event()
        #: The paths whose watches fired since the last read, with the last event of each.
        self._fired: dict[str, str] = {}

    # -- waiting -----------------------------------------------------------------------------

    async def result(self, timeout: float | None = None) -> Result:
        """Wait for the result record. On timeout raise JobTimeout; the submitter's attached
        request is withdrawn then, and also when the awaiting task is cancelled."""
        deadline = None if timeout is None else time.monotonic() + timeout
        fired: dict[str, str] | None = None  # None: read everything
        with self._withdrawn_if_abandoned():
            while self.record is None:
                self._wake.clear()
                try:
                    found, recheck = await self._read_waiting(fired), _RECHECK_SECONDS
                except _AWAY:
                    found, recheck = None, _RECONNECT_POLL  # ZooKeeper is away: wait for it
                if found is not None:
                    return self._accept(found)
                woke = await self._pause(deadline, recheck, timeout)
                fired, self._fired = (self._fired if woke else None), {}
        return self.record

    async def _read_waiting(self, fired: dict[str, str] | None) -> Result | None:
        """The record if the job ended. After watches fired (``fired``): a result made is read
        alone; a change of the entry's data alone (a claim, a give-back) reads the entry,
        watched again; anything else, or a read that finds a node gone, reads everything."""
        if fired is not None:
            if fired.get(self.result_path) == EventType.CREATED:
                record = await self._read_result()
                if record is not None:
                    return record
            elif self._entry_changed_alone(fired) and await self._entry_still_there():
                return None
        looked = await self._look(with_claim=False)
        return None if looked is None else looked[0]

    def _entry_changed_alone(self, fired: dict[str, str]) -> bool:
        return self.entry_path is not None and fired == {self.entry_path: EventType.CHANGED}

    async def _entry_still_there(self) -> bool:
        """Whether the entry is still there, read with its watch set again."""
        assert self.entry_path is not None
        return bool(await self.client.maybe(self.client.zk.get_async(self.entry_path, self._watch)))

    async def stream(self, timeout: float | None = None) -> AsyncIterator[str]:
        """Yield the output in pieces as the worker generates it (jobs submitted with
        ``stream=True``; others yield their whole output at the end), then stop; the record is
        then ``job.record`` (and ``await job.result()``). The pieces come straight from the
        worker where it serves streams (``zkqueue.producer.direct``), else from the job's
        claim. StreamInterrupted if the attempt that produced them stops part-way (the job goes
        on). On timeout raise JobTimeout, withdrawing the submitter's attached request, as
        cancelling the iterating task does."""
        deadline = None if timeout is None else time.monotonic() + timeout
        reading = StreamReading(self.id, self.client, AsyncTap, self._wake.set)
        full, fired = True, dict[str, str]()
        with self._withdrawn_if_abandoned():
            try:
                while self.record is None:
                    self._wake.clear()
                    body: ClaimBody | None = None
                    found, recheck = None, _RECHECK_SECONDS
                    if full or fired:
                        try:
                            found, body = await self._read_stream(full, fired)
                        except _AWAY:
                            recheck = _RECONNECT_POLL
                    if found is not None:
                        rest = reading.ended(self._accept(found))
                        if rest:
                            yield rest
                        return
                    piece = reading.advance(body)
                    if piece is None:  # read ZooKeeper once more before going on
                        full = True
                        continue
                    if piece:
                        yield piece
                    woke = await self._pause(deadline, recheck, timeout)
                    fired, self._fired = self._fired, {}
                    full = not woke  # a quiet interval: read everything (watches are hints)
            finally:
                reading.close()

    async def _read_stream(
        self, full: bool, fired: dict[str, str]
    ) -> tuple[Result | None, ClaimBody | None]:
        """(the record if the job ended, the claim or None if there is none). What is read
        follows the watches that fired (see the module docstring); a quiet interval or a read
        that finds a node gone reads everything."""
        if not full:
            if fired.get(self.result_path) == EventType.CREATED:
                record = await self._read_result()
                if record is not None:
                    if self.claim_path is not None and self.claim_path not in fired:
                        remove_data_watch(self.client.zk, self.claim_path, self._watch)
                    return record, None
            elif self._claim_moved(fired):
                body = await self._read_claim(entry_too=self.entry_path in fired)
                if body is not None:
                    return None, body
        looked = await self._look(with_claim=True)
        return (None, None) if looked is None else looked

    def _claim_moved(self, fired: dict[str, str]) -> bool:
        """Whether the watches that fired say only that the job's claim was made or changed:
        the claim's, with or without a data change of the entry (never its deletion)."""
        others = fired.keys() - {self.claim_path, self.entry_path}
        entry = fired.get(self.entry_path or "", EventType.CHANGED)
        return not others and entry == EventType.CHANGED and self.claim_path in fired

    async def _pause(self, deadline: float | None, recheck: float, timeout: float | None) -> bool:
        """Wait for a watch or the recheck interval; True if a watch fired. Past the deadline
        withdraw the submitter's attached request and raise JobTimeout."""
        remaining = None if deadline is None else deadline - time.monotonic()
        if remaining is not None and remaining <= 0:
            self.abandon()
            raise self.timed_out(timeout)
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(recheck if remaining is None else min(remaining, recheck)):
                await self._wake.wait()
                return True
        return False

    async def _look(self, with_claim: bool) -> tuple[Result | None, ClaimBody | None] | None:
        """One pipelined read (watched): None while the job is unfinished and, with
        ``with_claim``, not running; else (record or None, the claim or None)."""
        zk, client, watch = self.client.zk, self.client, self._watch
        # Entry before result: complete() deletes the one and creates the other in a single
        # transaction, so "no entry, then no result" means nothing will come. The entry is
        # watched with a get, which sets no watch on an entry already gone (an exists watch
        # would outlive the job: one leaked watch per job in a long-lived client).
        calls = [] if self.entry_path is None else [zk.get_async(self.entry_path, watch=watch)]
        calls += [zk.exists_async(self.result_path, watch=watch), zk.get_async(self.result_path)]
        claim = self.claim_path if with_claim else None
        if claim is not None:
            calls += [zk.exists_async(claim, watch=watch), zk.get_async(claim)]
        done = [await _settled(client.wait(c)) for c in calls]
        for value in done:
            if isinstance(value, BaseException) and not isinstance(value, NoNodeError):
                raise value
        entry_alive = self.entry_path is None or not isinstance(done[0], NoNodeError)
        at = 2 if self.entry_path is not None else 1
        got = done[at]
        if not isinstance(got, BaseException):
            if done[at - 1] is not None:  # the watch went onto the existing result: take it back
                remove_data_watch(zk, self.result_path, watch)
            if claim is not None:  # and the one on the claim (gone with the job)
                remove_data_watch(zk, claim, watch)
            return self._parse(got[0]), None
        if not entry_alive:
            raise JobWithdrawn(f"job {self.id} was withdrawn before it produced a result")
        if claim is None or isinstance(done[-1], BaseException):
            return None
        return None, _claim(done[-1][0])

    async def _read_claim(self, entry_too: bool = False) -> ClaimBody | None:
        """The claim (watched again), or None if it is gone (or unreadable). ``entry_too``:
        the entry's watch fired on a change of its data; it is read, watched again, in the
        same round trip, and None unless it is still there."""
        if self.claim_path is None:
            return None
        zk = self.client.zk
        calls = [zk.get_async(self.claim_path, self._watch)]
        if entry_too and self.entry_path is not None:
            calls.append(zk.get_async(self.entry_path, self._watch))
        try:
            data, _ = (await asyncio.gather(*(self.client.wait(c) for c in calls)))[0]
        except NoNodeError:
            return None
        return _claim(data)

    async def _read_result(self) -> Result | None:
        """The result, read without a watch (its watch fired when it was made), or None if it
        is already gone (consumed by another handle, or expired)."""
        try:
            data, _ = await self.client.wait(self.client.zk.get_async(self.result_path))
        except NoNodeError:
            return None
        return self._parse(data)

    def _watch(self, event: WatchedEvent) -> None:
        """Runs on kazoo's thread; one bound method per job, so kazoo keeps one watcher."""
        self.client.handoff.call(self._fire, event.path, event.type)

    def _fire(self, path: str, kind: str) -> None:
        self._fired[path] = kind
        self._wake.set()

    def _accept(self, record: Result) -> Result:
        if self.owned and not self.detach:  # read once; nobody else waits for it
            client = self.client
            claims.consume(client.zk, client.layout, self.queue, record, self._result_size)
        self.record = record
        return record

    @contextlib.contextmanager
    def _withdrawn_if_abandoned(self) -> Any:
        """Map connection errors; take the watches back when the request was withdrawn (they
        wait on nodes that will never come); withdraw the attached request if the waiting task
        is cancelled (its caller has gone: no GPU time for an answer nobody reads)."""
        try:
            with mapped_errors(self.client.settings.hosts):
                yield
        except JobWithdrawn:
            with contextlib.suppress(ZkqConnectionError):  # a closed client: its session is gone
                self._drop_watches(self._watch)
            raise
        except asyncio.CancelledError:
            self.abandon()
            raise

    # -- ending ------------------------------------------------------------------------------

    def abandon(self) -> None:
        """Withdraw the submitter's attached, unfinished request without waiting: the delete
        is sent at once, or when ZooKeeper is back if it is away (the session, and the entry
        with it, may outlive the outage) (safe in ``finally`` and on cancellation). Other
        handles: no-op."""
        if self.record is None:
            with contextlib.suppress(ZkqConnectionError):  # a closed client: its session is gone
                self._drop_watches(self._watch)
        if self.owned and not self.detach and self.record is None and self.entry_path:
            # A closed client's session took its attached entries with it.
            with contextlib.suppress(ZkqConnectionError):
                zk, path = self.client.zk, self.entry_path
                send_when_connected(zk, lambda: zk.delete_async(path))

    async def withdraw(self) -> None:
        """Delete the entry without a result: the caller no longer wants the answer."""
        if self.entry_path is None:
            return
        with mapped_errors(self.client.settings.hosts), contextlib.suppress(NoNodeError):
            await self.client.wait(self.client.zk.delete_async(self.entry_path))

    async def cancel(self) -> bool:
        """Cancel a pending or running job and record status cancelled. False if it had ended."""
        if self.entry_path is None:
            return False
        zk, layout = self.client.zk, self.client.layout
        assert self.entry is not None
        with mapped_errors(self.client.settings.hosts):
            claim_call = zk.get_async(layout.claim(self.queue, self.entry))
            found = await self.client.maybe(zk.get_async(self.entry_path))
            if found is None:
                return False
            await _settled(self.client.wait(claim_call))
            running = ClaimBody.from_call(claim_call)
            # On a pool thread: the multi may first create its expiry tick (a blocking call).
            call = await self.client.blocking(
                claims.cancel_async,
                zk,
                layout,
                self.queue,
                self.priority,
                self.entry,
                found[1],
                running,
            )
            return not claims.transaction_failed(await self.client.wait(call))


async def _settled(waiting: Any) -> Any:
    """The awaited value, or the exception it raised (kazoo errors only; others propagate)."""
    try:
        return await waiting
    except (NoNodeError, *TRANSIENT, ZkqConnectionError) as exc:
        return exc


def _claim(data: bytes) -> ClaimBody | None:
    try:
        return ClaimBody.from_bytes(data)
    except CorruptRecord:
        return None
