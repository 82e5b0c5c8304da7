"""The asyncio face of the producer API, for services that wait on many jobs at once.

``AsyncClient`` submits jobs and reads the registry; ``AsyncJob`` (zkqueue/producer/aiojob.py)
awaits a result or iterates a stream. Nothing here holds a thread per waiting job: kazoo's
``*_async`` calls and watches run on kazoo's own threads, and each completion is handed to the event
loop with ``call_soon_threadsafe``. Paths, specs, limits and result records are the blocking
client's (layout, spec, limits, result), so both faces speak exactly the same protocol.

    async with AsyncClient("zk1:2181") as client:
        job = await client.submit("Hello", priority="high", stream=True)
        async for piece in job.stream(timeout=60):
            print(piece, end="")
"""

from __future__ import annotations

import asyncio
import contextlib
import contextvars
import functools
import json
import time
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from typing import Any, TypeVar, Unpack

from kazoo.exceptions import NoNodeError
from kazoo.interfaces import IAsyncResult

from zkqueue import defaults
from zkqueue.errors import ZkqConnectionError
from zkqueue.plumbing.connection import (
    close,
    connect,
    mapped_errors,
    read_through_loss_async,
)
from zkqueue.producer.aiojob import AsyncJob
from zkqueue.producer.clientbase import ClientBase, ClientOptions
from zkqueue.producer.enqueue import Enqueuer
from zkqueue.protocol import counts, revision
from zkqueue.protocol.counts import tenant_waiting
from zkqueue.protocol.layout import (
    DEFAULT_TENANT,
    check_priority,
    check_queue,
    check_tenant,
    lane,
    new_job_id,
)
from zkqueue.protocol.limits import QueueSettings, check_counts
from zkqueue.protocol.spec import build_spec

#: Seconds a producer trusts its copy of a queue's settings (as the blocking client does).
_SETTINGS_CACHE = 5.0
T = TypeVar("T")

__all__ = ["AsyncClient", "AsyncJob"]


class Handoff:
    """Hands kazoo's completions and watch events (on kazoo's threads) to one event loop."""

    def __init__(self, loop: asyncio.AbstractEventLoop) -> None:
        self.loop = loop

    def call(self, func: Callable[..., Any], *args: Any) -> None:
        """Run ``func(*args)`` on the loop soon; a loop already closed drops it."""
        with contextlib.suppress(RuntimeError):
            self.loop.call_soon_threadsafe(func, *args)

    def future(self, call: IAsyncResult) -> asyncio.Future[Any]:
        """An asyncio future settled with the kazoo call's value or exception."""
        fut: asyncio.Future[Any] = self.loop.create_future()
        call.rawlink(lambda done: self.call(_settle, fut, done))
        return fut


def _settle(fut: asyncio.Future[Any], call: IAsyncResult) -> None:
    if fut.done():
        return  # the waiter gave up (timeout, cancellation)
    if call.successful():
        fut.set_result(call.value)
    else:
        fut.set_exception(call.exception)


class AsyncClient(ClientBase):
    """A connection to one zkq root for asyncio code. Use ``async with``, or ``await start()``
    and ``await close()``. Every ZooKeeper call is bounded by ``connect_timeout``: a session
    that cannot reach the ensemble fails with ZkqConnectionError instead of hanging."""

    NOT_STARTED = "client is not started, or closed: use it with 'async with'"
    _asynchronous = True

    def __init__(
        self,
        hosts: str = defaults.HOSTS,
        root: str = defaults.ROOT,
        *,
        blocking_threads: int = 16,
        **options: Unpack[ClientOptions],
    ) -> None:
        """``options`` as ``Client`` takes them (``zkqueue.producer.clientbase.ClientOptions``)."""
        super().__init__(hosts, root, **options)
        self._enqueue = Enqueuer(self, signal_limit=self.signal_spec_bytes)
        self._handoff: Handoff | None = None
        self._queue_settings: dict[str, tuple[float, QueueSettings]] = {}
        #: The few blocking calls (connecting, a queue's first use, creating an entry exactly
        #: once, backpressure counts) run on threads of this client's own, never on the event
        #: loop's default executor: an application that fills that one must not stall zkq.
        if blocking_threads < 1:
            raise ValueError("blocking_threads must be at least 1")
        self._blocking_threads = blocking_threads
        self._pool: ThreadPoolExecutor | None = None

    async def blocking(self, func: Callable[..., T], *args: Any) -> T:
        """Run a blocking call on this client's threads (with the caller's context vars)."""
        if self._pool is None:
            raise ZkqConnectionError(self.NOT_STARTED)
        call = functools.partial(contextvars.copy_context().run, func, *args)
        return await asyncio.get_running_loop().run_in_executor(self._pool, call)

    # -- lifecycle ---------------------------------------------------------------------------

    async def start(self) -> AsyncClient:
        """Connect (kazoo's handshake runs on a worker thread once) and bind to this loop."""
        self._handoff = Handoff(asyncio.get_running_loop())
        if self._pool is None:
            self._pool = ThreadPoolExecutor(self._blocking_threads, thread_name_prefix="zkq-aio")
        if self._zk is None:
            self._zk = await self.blocking(connect, self.settings)
        self._closed = False
        return self

    async def close(self) -> None:
        """Close the session: every attached job of this client is withdrawn with it."""
        http = self._closing_http()
        if http is not None:
            await http.close()
        try:
            if self._zk is not None and self._owns_zk:
                zk, self._zk = self._zk, None
                # On a thread of its own, not the pool: every pool thread may be waiting on a
                # call that only closing the session ends (the reply of a ZooKeeper that is
                # connected but does not answer).
                # Shielded: a caller that gives up on close() does not stop the session's close.
                closer = ThreadPoolExecutor(1, thread_name_prefix="zkq-aio-close")
                try:
                    loop = asyncio.get_running_loop()
                    await asyncio.shield(loop.run_in_executor(closer, close, zk))
                finally:
                    closer.shutdown(wait=False)  # the loop never waits on a thread
        finally:
            if self._pool is not None:  # later blocking calls fail: the client is closed
                pool, self._pool = self._pool, None
                pool.shutdown(wait=False)

    async def __aenter__(self) -> AsyncClient:
        return await self.start()

    async def __aexit__(self, *exc: object) -> None:
        await self.close()

    @property
    def handoff(self) -> Handoff:
        if self._handoff is None:
            raise ZkqConnectionError("client is not started: use it with 'async with'")
        return self._handoff

    @property
    def started(self) -> bool:
        return self._zk is not None

    @property
    def connected(self) -> bool:
        """Whether the session is connected now (kazoo reconnects by itself after a loss)."""
        return self._zk is not None and bool(self._zk.connected)

    # -- awaiting kazoo ----------------------------------------------------------------------

    async def wait(self, call: IAsyncResult, timeout: float | None = None) -> Any:
        """The value of one kazoo ``*_async`` call, or its exception; ZkqConnectionError if
        ZooKeeper does not answer within ``timeout`` (default: the connect timeout)."""
        limit = self.settings.connect_timeout if timeout is None else timeout
        try:
            async with asyncio.timeout(limit):
                return await self.handoff.future(call)
        except TimeoutError:
            raise ZkqConnectionError(
                f"ZooKeeper at {self.settings.hosts} did not answer within {limit:g}s"
            ) from None

    async def maybe(self, call: IAsyncResult) -> Any:
        """Like wait(), but None where the node does not exist."""
        try:
            return await self.wait(call)
        except NoNodeError:
            return None

    # -- producing ---------------------------------------------------------------------------

    async def submit(
        self,
        prompt: str = "",
        priority: str = defaults.PRIORITY,
        queue: str = defaults.QUEUE,
        max_new_tokens: int | None = None,
        detach: bool = False,
        tenant: str | None = None,
        **params: Any,
    ) -> AsyncJob:
        """Enqueue one job (a prompt, or ``messages=[...]`` for a chat) with the job parameters
        of ``Client.submit``. An attached request (detach=False) is withdrawn if this client
        goes away, if its ``result()``/``stream()`` times out, or if the task awaiting it is
        cancelled. ``tenant``: who the job is for (None: the default tenant)."""
        check_priority(priority)
        check_queue(queue)
        if tenant is not None:
            check_tenant(tenant)
        path = lane(priority, tenant)
        data = build_spec(prompt, max_new_tokens, params).to_bytes(self.max_spec_bytes)
        job_id = new_job_id()
        with mapped_errors(self.settings.hosts):
            # Checks that ride through a short outage, as the blocking client's do.
            await read_through_loss_async(
                self.zk, self.settings, lambda: self._before_submit(queue, tenant), self.CHECKING
            )
            name = await self._create_entry(queue, path, job_id, data, ephemeral=not detach)
        return AsyncJob(self, job_id, queue, priority, name, detach=detach, owned=True)

    async def _before_submit(self, queue: str, tenant: str | None) -> None:
        await self.ensure_queue(queue)
        await self.check_room(queue, tenant)

    async def ensure_queue(self, queue: str) -> None:
        """Check the root's protocol version and create the queue's directories, once per
        client (on a worker thread: the blocking client's code, so both speak one layout)."""
        if queue in self._ready:
            return
        await self.blocking(self._ensure_queue, queue)
        self._ready.add(queue)

    def _ensure_queue(self, queue: str) -> None:
        revision.ensure(self.zk, self.layout)
        revision.ensure_dirs(self.zk, self.layout, queue)

    async def waiting(self, queue: str) -> int:
        """Jobs of a queue not yet started: entries minus claims (child counts of the pending
        buckets and of claims/, never a listing of entries)."""
        with mapped_errors(self.settings.hosts):
            return await self.blocking(self._waiting, queue)

    def _waiting(self, queue: str) -> int:
        return counts.waiting(self.zk, self.layout, queue)

    async def check_room(self, queue: str, tenant: str | None = None) -> None:
        """Raise QueueFull when the queue holds its maximum of waiting jobs, or the tenant
        its own (``tenants`` in the queue's settings)."""
        settings = await self._settings(queue)
        limit = settings.max_pending
        if limit is not None:
            check_counts(queue, limit, await self.waiting(queue))
        cap = settings.tenant(tenant).max_pending
        if cap is not None:
            waiting = await self.blocking(tenant_waiting, self.zk, self.layout, queue, tenant)
            check_counts(queue, cap, waiting, tenant=tenant or DEFAULT_TENANT)

    async def _settings(self, queue: str) -> QueueSettings:
        cached = self._queue_settings.get(queue)
        if cached and time.monotonic() - cached[0] < _SETTINGS_CACHE:
            return cached[1]
        found = await self.maybe(self.zk.get_async(self.layout.queue(queue)))
        settings = QueueSettings.from_bytes(found[0]) if found else QueueSettings()
        self._queue_settings[queue] = (time.monotonic(), settings)
        return settings

    async def _create_entry(
        self, queue: str, priority: str, job_id: str, data: bytes, ephemeral: bool
    ) -> str | None:
        """Create the entry exactly once, in its priority's tail bucket, with the blocking
        client's enqueuer: its multi is sent from the loop where this client knows the tail
        (no thread in the way of a submit), and what may block (reading a tail, a stale one,
        a lost reply looked up before creating again, opening the next bucket) runs on a
        worker thread."""
        enqueue, one = self._enqueue, (job_id, queue, priority, data)
        sent = enqueue.send_known(one, ephemeral)
        if sent is None:
            return await self.blocking(enqueue.finish, [one], None, ephemeral)
        with contextlib.suppress(Exception):  # any failure: finish() reads it and acts
            await self.wait(sent[1])
        name = enqueue.quick(one, sent)
        if name is not None:
            return name
        return await self.blocking(enqueue.finish, [one], sent, ephemeral)

    def find_entry(self, queue: str, priority: str, job_id: str) -> str | None:
        """The entry name of a job (the enqueuer's lookup after a lost reply; blocking)."""
        return counts.find(self.zk, self.layout, queue, priority, job_id)

    # -- reading -----------------------------------------------------------------------------

    def job(self, job_id: str, queue: str, priority: str, entry: str | None = None) -> AsyncJob:
        """A handle on a job known by id, queue and priority (not owned: it never withdraws)."""
        return AsyncJob(self, job_id, check_queue(queue), check_priority(priority), entry)

    async def queue_names(self) -> list[str]:
        with mapped_errors(self.settings.hosts):
            names = await self.maybe(self.zk.get_children_async(self.layout.queues()))
        return sorted(names or [])

    async def workers(self) -> list[dict[str, Any]]:
        """Registered workers' records (see docs/PROTOCOL.md), read with pipelined gets; a
        registration that vanished meanwhile or is not JSON is left out."""
        with mapped_errors(self.settings.hosts):
            names = await self.maybe(self.zk.get_children_async(self.layout.workers()))
            calls = [self.zk.get_async(self.layout.worker(n)) for n in sorted(names or [])]
            found = [await self.maybe(c) for c in calls]
        records = []
        for item in found:
            with contextlib.suppress(ValueError, TypeError):
                if item is not None and isinstance(record := json.loads(item[0]), dict):
                    records.append(record)
        return records
