"""The worker's stream server: each streaming job's output goes to its readers over a direct
connection, as it is generated (the data plane; ``zkqueue.protocol.streaming`` is the wire
format).

The server is uvicorn running a small Starlette app on a thread of its own, with its own event
loop; it holds one ``Feed`` per streaming job the worker runs. Runners report output on their
own threads (``RunningJob.add_tokens``/``add_text``); the job's ``on_output`` hook then wakes
the feed's readers on the server's loop, which send what is new. No thread per reader, no
polling: a thousand readers are a thousand coroutines asleep on an event.

What a reader is sent is always a prefix of the job's final output: the text of a job with stop
strings stops before the first one found, and holds back a tail that may be the start of one.
When the job ends, the feed sends the rest of the final output and ``end``; when the attempt
stops without a result (preempted, released, fenced, the lease or the session lost, cancelled),
``error`` with the reason. A job no reader takes (a reader that cannot reach this worker, or
none yet after ``FALLBACK_AFTER``) has its output written into its claim too, as before the data
plane existed (``RunnerBridge.publish``).

The server listens on ``bind`` (all interfaces, a free port, by default) and claims name it by
the address readers should use: ``advertise``, else the address this host reaches ZooKeeper
from (where the gateway can most likely reach it too). With a certificate and key it serves
HTTPS; readers verify it against the ZooKeeper CA.
"""

from __future__ import annotations

import asyncio
import contextlib
import hmac
import logging
import re
import socket
import threading
import time
from collections.abc import AsyncIterator
from typing import TYPE_CHECKING, Any

from workers.runners.base import Outcome, RunningJob
from zkqueue.errors import ConfigurationError
from zkqueue.protocol import streaming
from zkqueue.protocol.result import Status
from zkqueue.protocol.streaming import StreamEvent

if TYPE_CHECKING:
    from starlette.requests import Request
    from starlette.responses import Response

log = logging.getLogger("zkq.streams")

#: A job with no direct reader this long after its claim also writes its output to its claim.
FALLBACK_AFTER = 1.0
#: How long a request for a job not (yet) held waits for it: a reader that saw the claim can be
#: a moment ahead of the worker that made it. At most _MAX_WAITING requests wait at once.
_OPEN_WAIT = 2.0
_MAX_WAITING = 1024
_START_TIMEOUT = 10.0


def visible(text: str, stops: tuple[str, ...] | None) -> str:
    """The part of ``text`` a reader may see now: all of it, except text from the first stop
    string on, and a tail that may be the start of a stop string (it may yet be cut)."""
    if not stops:
        return text
    found = [i for stop in stops if (i := text.find(stop)) >= 0]
    if found:
        return text[: min(found)]
    hold = 0
    for stop in stops:
        for size in range(min(len(stop) - 1, len(text)), hold, -1):
            if text.endswith(stop[:size]):
                hold = size
                break
    return text[: len(text) - hold]


class Feed:
    """One streaming job's output, for its readers."""

    def __init__(self, job: RunningJob, secret: str, loop: asyncio.AbstractEventLoop) -> None:
        self.job = job
        self.secret = secret
        self.opened = time.monotonic()
        #: One event per connected reader (on the server's loop).
        self.readers: set[asyncio.Event] = set()
        #: How the attempt ended (None: still running).
        self.ended: StreamEvent | None = None
        #: The final output of a job that ended with a result.
        self.final: str | None = None
        self._loop = loop
        self._size = (0, 0)
        self._text = ""

    def text(self) -> str:
        """What readers may see now; decoded once per growth of the output, not per reader."""
        if self.final is not None:
            return self.final
        job = self.job
        size = (len(job.partial_ids), len(job.partial))
        if size != self._size:
            self._size, self._text = size, visible(job.partial_text(), job.spec.stop)
        return self._text

    def wake(self) -> None:
        """From any thread: tell the readers there is more (nothing to do without readers)."""
        if self.readers:
            with contextlib.suppress(RuntimeError):  # the server's loop has closed
                self._loop.call_soon_threadsafe(self._notify)

    def _notify(self) -> None:
        for event in self.readers:
            event.set()

    def end(self, event: StreamEvent, final: str | None) -> None:
        """From any thread: the attempt ended (once)."""
        if self.ended is None:
            self.final, self.ended = final, event
            self.job.on_output = None
            with contextlib.suppress(RuntimeError):
                self._loop.call_soon_threadsafe(self._notify)


class StreamServer:
    """Serves the streams of the jobs a worker runs (see the module docstring)."""

    def __init__(
        self,
        bind: str = "0.0.0.0:0",
        advertise: str | None = None,
        zk_hosts: list[tuple[str, int]] | None = None,
        tls: tuple[str, str] | None = None,
        readers: Any = None,
    ) -> None:
        self.bind_host, self.bind_port = split_address(bind, "the stream address")
        #: A gauge of connected readers (``zkq_stream_readers``), or None.
        self.readers = readers
        self.advertise = advertise
        self.zk_hosts = zk_hosts or []
        self.tls = tls
        #: The URL claims name (``<base>/<job id>``), once started.
        self.base: str | None = None
        self.feeds: dict[str, Feed] = {}
        self._loop: asyncio.AbstractEventLoop | None = None
        #: Readers that came for a job a moment before its feed opened (on the server's loop).
        self._waiting: dict[str, asyncio.Event] = {}
        self._server: Any = None
        self._thread: threading.Thread | None = None

    # -- the worker's side -----------------------------------------------------------------

    def start(self) -> str:
        """Listen and serve on a thread of its own; returns the base URL claims name."""
        import uvicorn

        sock = _listen(self.bind_host, self.bind_port)
        port = sock.getsockname()[1]
        config = uvicorn.Config(
            self._app(),
            log_level="warning",
            access_log=False,
            lifespan="off",
            ws="none",
            timeout_graceful_shutdown=1,
            ssl_certfile=self.tls[0] if self.tls else None,
            ssl_keyfile=self.tls[1] if self.tls else None,
        )
        self._server = server = uvicorn.Server(config)

        async def serve() -> None:
            self._loop = asyncio.get_running_loop()
            await server.serve(sockets=[sock])

        self._thread = threading.Thread(target=asyncio.run, args=(serve(),), daemon=True)
        self._thread.name = "zkq-streams"
        self._thread.start()
        deadline = time.monotonic() + _START_TIMEOUT
        while not server.started and self._thread.is_alive() and time.monotonic() < deadline:
            time.sleep(0.01)
        if not server.started:
            raise ConfigurationError(f"the stream server did not start on {self.bind_host}:{port}")
        host = self.advertise or self._reachable_host()
        if host.count(":") >= 2 and not host.startswith("["):
            host = f"[{host}]"  # a bare IPv6 address
        if not re.search(r":\d+$", host.rsplit("]", 1)[-1]):
            host = f"{host}:{port}"
        scheme = "https" if self.tls else "http"
        self.base = f"{scheme}://{host}{streaming.PATH}"
        log.info("serving job streams at %s", self.base)
        return self.base

    def open(self, job: RunningJob) -> None:
        """A streaming job was claimed (its claim names our stream and its secret)."""
        claim = job.claim
        loop = self._loop
        if claim is None or not claim.body.secret or loop is None:
            return
        feed = Feed(job, claim.body.secret, loop)
        job.on_output = feed.wake
        self.feeds[job.id] = feed
        with contextlib.suppress(RuntimeError):  # a reader may be waiting for it already
            loop.call_soon_threadsafe(self._announce, job.id)

    def end(self, job: RunningJob, outcome: Outcome | None = None) -> None:
        """The job ended (``outcome``) or stopped without a result here (None, or a released
        outcome): tell its readers and forget it."""
        feed = self.feeds.get(job.id)
        if feed is None or feed.job is not job:
            return
        del self.feeds[job.id]
        if outcome is not None and not outcome.release and job.cancel_reason is None:
            final = outcome.output if outcome.status == Status.SUCCEEDED else None
            feed.end(StreamEvent(streaming.END, status=outcome.status), final)
        else:
            reason = str(job.cancel_reason or "released")
            feed.end(StreamEvent(streaming.ERROR, reason=reason), None)

    def served(self, job: RunningJob) -> bool:
        """Whether the job's output goes to its readers directly (a reader is connected, or
        its claim is younger than FALLBACK_AFTER): then its claim need not carry it."""
        feed = self.feeds.get(job.id)
        if feed is None or feed.job is not job:
            return False
        return bool(feed.readers) or time.monotonic() - feed.opened < FALLBACK_AFTER

    def close(self) -> None:
        """End every stream (the worker stops) and stop serving."""
        for feed in list(self.feeds.values()):
            self.end(feed.job)
        server, thread = self._server, self._thread
        if server is not None:
            server.should_exit = True
        if thread is not None:
            thread.join(5.0)

    # -- the readers' side -------------------------------------------------------------------

    def _app(self) -> Any:
        from starlette.applications import Starlette
        from starlette.routing import Route

        return Starlette(routes=[Route(f"{streaming.PATH}/{{job_id}}", self._stream)])

    async def _stream(self, request: Request) -> Response:
        from starlette.responses import JSONResponse, StreamingResponse

        feed = await self._find(request.path_params["job_id"])
        if feed is None:
            return JSONResponse({"error": "this job does not run here"}, status_code=404)
        scheme, _, secret = request.headers.get("authorization", "").partition(" ")
        if scheme.lower() != "bearer" or not hmac.compare_digest(
            secret.strip().encode(), feed.secret.encode()
        ):
            return JSONResponse({"error": "a missing or wrong secret"}, status_code=403)
        try:
            offset = max(0, int(request.query_params.get("offset", "0")))
        except ValueError:
            return JSONResponse({"error": "offset must be an integer"}, status_code=400)
        headers = {"Cache-Control": "no-cache", "X-Accel-Buffering": "no"}
        events = self._events(feed, offset)
        return StreamingResponse(events, media_type="text/event-stream", headers=headers)

    async def _find(self, job_id: str) -> Feed | None:
        """The job's feed; a job not held yet is waited for a moment (``open`` announces it),
        at most ``_MAX_WAITING`` such requests at once."""
        feed = self.feeds.get(job_id)
        if feed is not None or len(self._waiting) >= _MAX_WAITING:
            return feed
        announced = self._waiting.setdefault(job_id, asyncio.Event())
        with contextlib.suppress(TimeoutError):
            async with asyncio.timeout(_OPEN_WAIT):
                await announced.wait()
        if self._waiting.get(job_id) is announced and not announced.is_set():
            del self._waiting[job_id]
        return self.feeds.get(job_id)

    def _announce(self, job_id: str) -> None:
        announced = self._waiting.pop(job_id, None)
        if announced is not None:
            announced.set()

    async def _events(self, feed: Feed, offset: int) -> AsyncIterator[bytes]:
        """The pieces from ``offset`` as they come, then how the attempt ended. ``shown`` is
        what this reader was sent: a piece is only ever its continuation."""
        wake = asyncio.Event()
        feed.readers.add(wake)
        if self.readers is not None:
            self.readers.inc()
        shown: str | None = None
        try:
            while True:
                wake.clear()
                ended, text = feed.ended, feed.text()
                if shown is None:
                    shown = text[:offset]
                if len(text) > len(shown) and text.startswith(shown):
                    yield StreamEvent(streaming.PIECE, text[len(shown) :], len(shown)).to_bytes()
                    shown = text
                if ended is not None:
                    # A final output that does not continue what was sent (it should) is not
                    # patched here: the reader compares the result with what it got.
                    yield ended.to_bytes()
                    return
                try:
                    async with asyncio.timeout(streaming.HEARTBEAT):
                        await wake.wait()
                except TimeoutError:
                    yield b": ping\n\n"
        finally:
            feed.readers.discard(wake)
            if self.readers is not None:
                self.readers.dec()

    def _reachable_host(self) -> str:
        """The address this host reaches ZooKeeper from (no packet is sent), else the bound
        address, else the host name."""
        if self.bind_host not in ("", "0.0.0.0", "::"):
            return self.bind_host
        for host, port in self.zk_hosts:
            with contextlib.suppress(OSError):
                family, kind, proto, _, address = socket.getaddrinfo(
                    host, port, type=socket.SOCK_DGRAM
                )[0]
                with socket.socket(family, kind, proto) as probe:
                    probe.connect(address)
                    return str(probe.getsockname()[0])
        return socket.gethostname()


def split_address(address: str, what: str) -> tuple[str, int]:
    """``HOST:PORT``, ``:PORT``, ``[IPv6]:PORT`` into (host, port); port 0: any free port."""
    host, sep, port = address.rpartition(":")
    if not sep or not port.isdigit() or int(port) > 65535:
        raise ConfigurationError(
            f"{what} must be HOST:PORT (port 0: any free port), not {address!r}"
        )
    host = host.strip("[]") or "0.0.0.0"
    return host, int(port)


def _listen(host: str, port: int) -> socket.socket:
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    try:  # as the gateway binds (gateway.commands): SO_REUSEADDR, the error a config error
        sock = socket.create_server((host, port), family=family, backlog=1024)
    except OSError as exc:
        raise ConfigurationError(f"cannot serve job streams on {host}:{port}: {exc}") from None
    # Accepted connections inherit it: a piece is sent at once, never held for the reader's
    # delayed acknowledgement of the one before (a 40 ms wait on a kept-alive connection).
    sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
    return sock
