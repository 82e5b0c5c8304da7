"""Reading a job's stream straight from the worker that runs it (the data plane; the wire format
is ``zkqueue.protocol.streaming``), for ``AsyncJob.stream`` and ``Job.stream``.

A streaming job's claim names its stream and a secret. The job handle, which already watches
the claim, hands each claim it reads to its ``StreamReading``, which starts a ``Tap`` for each
attempt: the tap connects, takes the pieces as the worker sends them, and wakes the handle, which
hands the new text to its caller. ZooKeeper still decides the end: the result record, read as
before, is the authoritative text, and the reading's ``Transcript`` checks that everything
handed out is a prefix of it.

Where the worker cannot be reached (a firewall, a worker without a stream server, a client
without the HTTP library it reads with), the handle falls back to the output the worker writes
into the claim a few times a second, and says so once in the log. An attempt that stops
part-way (the worker died, or gave the job back) after text was handed out ends the stream with
``StreamInterrupted``: the rest of that text will not come, and a retry's text may differ. Before
any text was handed out the handle waits for the next attempt instead.

The library needs an HTTP client only for this (every extra of zkq brings both): ``AsyncJob``
reads with ``aiohttp``, ``Job`` (a thread per stream) with ``httpx``. The asynchronous readers
serve the gateway, which holds many streams at once: a stream of 50 events costs an aiohttp
reader about a quarter of the CPU it costs an httpx one (whose connection pool polls every
kept-alive socket at each request), and each stream's connection is opened while the job's first
token is on its way.
"""

from __future__ import annotations

import asyncio
import contextlib
import enum
import functools
import importlib
import logging
import ssl
import threading
from collections.abc import Callable
from typing import Any

from zkqueue.errors import StreamInterrupted
from zkqueue.protocol import streaming
from zkqueue.protocol.records import ClaimBody
from zkqueue.protocol.result import Result
from zkqueue.protocol.streaming import EventReader, StreamEvent

log = logging.getLogger("zkq.stream")

#: Seconds to connect to a worker's stream before falling back to the claim.
CONNECT_TIMEOUT = 2.0
#: Seconds without a byte (a worker sends a comment every ``streaming.HEARTBEAT`` seconds at
#: least) before a connection counts as cut.
READ_TIMEOUT = 3 * streaming.HEARTBEAT
#: Connections again, resuming from the text so far, after one was cut part-way.
RESUMES = 1
#: Stream URLs (their scheme://host:port) we already said we cannot reach: said once each.
_warned: set[str] = set()


class TapState(enum.Enum):
    CONNECTING = "connecting"
    LIVE = "live"
    #: The attempt ended with a result (read it from ZooKeeper).
    ENDED = "ended"
    #: The attempt stopped part-way (an error event, or the connection closed early).
    BROKEN = "broken"
    #: The stream could not be read (unreachable, refused, not there): use the claim.
    FALLBACK = "fallback"


class Transcript:
    """What a stream's caller has been handed, across the job's attempts."""

    def __init__(self, job_id: str) -> None:
        self.job_id = job_id
        self.sent = ""
        #: The fencing token of the attempt whose text was handed out.
        self.attempt: int | None = None

    def claim(self, token: int) -> bool:
        """A claim with ``token`` was read; True if it starts another attempt. Raises
        StreamInterrupted when text of an earlier attempt was handed out."""
        if token == self.attempt:
            return False
        if self.sent:
            self.interrupted("its claim was replaced by another attempt")
        self.attempt = token
        return True

    def take(self, text: str) -> str:
        """The part of the attempt's text so far that was not handed out yet."""
        if len(text) > len(self.sent) and text.startswith(self.sent):
            piece, self.sent = text[len(self.sent) :], text
            return piece
        return ""

    def final(self, record: Result) -> str:
        """The rest of the authoritative output. A job that did not succeed (cancelled,
        failed, timed out) ends its stream with its record, whatever was streamed; one that
        did raises StreamInterrupted if the text handed out is not its output's start."""
        if not record.ok:
            return ""
        if not record.output.startswith(self.sent):
            self.interrupted("its result differs from the text streamed (a retry's answer)")
        return self.take(record.output)

    def interrupted(self, why: str) -> None:
        raise StreamInterrupted(self.job_id, len(self.sent), why)


class Tap:
    """One attempt's stream, read as it comes (``text``, ``state``); ``wake`` is called after
    every change, from the reading task or thread. Subclasses read over asyncio or a thread."""

    def __init__(self, claim: ClaimBody, wake: Callable[[], None]) -> None:
        assert claim.stream is not None and claim.secret is not None
        self.token = claim.token
        self.url = claim.stream
        self.headers = {"Authorization": f"Bearer {claim.secret}", "Accept": "text/event-stream"}
        self.text = ""
        self.state = TapState.CONNECTING
        self.why = ""
        self._wake = wake

    @property
    def serving(self) -> bool:
        """Whether this tap carries the attempt's text (else the claim does)."""
        return self.state in (TapState.CONNECTING, TapState.LIVE, TapState.ENDED)

    def _params(self) -> dict[str, int] | None:
        """A second connection resumes where the first stopped."""
        return {"offset": len(self.text)} if self.text else None

    def _opened(self, status: int) -> bool:
        if status == 200:
            self.state = TapState.LIVE
            return True
        if status == 404 and self.state == TapState.LIVE:
            # Resuming, the job no longer runs there: it ended or moved; ZooKeeper will say.
            self._fall_back("the job no longer runs there", warn=False)
            return False
        why = {403: "the worker refused the secret", 404: "the job does not run there"}
        self._fall_back(why.get(status, f"the worker answered {status}"), warn=status != 404)
        return False

    def _handle(self, event: StreamEvent) -> bool:
        """Take one event; True when the stream is over."""
        if event.kind == streaming.PIECE:
            if event.offset <= len(self.text):
                self.text = self.text[: event.offset] + event.text
            self._wake()
            return False
        if event.kind == streaming.END:
            self.state = TapState.ENDED
        else:
            self.state, self.why = TapState.BROKEN, f"the attempt was {event.reason}"
        self._wake()
        return True

    def _closed_early(self, why: str) -> None:
        """The stream stopped without its end: the attempt broke if it had begun, else the
        worker is out of reach (the claim carries the text instead)."""
        if self.state == TapState.LIVE:
            self.state, self.why = TapState.BROKEN, why
        else:
            self._fall_back(why, warn=True)
        self._wake()

    def _fall_back(self, why: str, warn: bool) -> None:
        self.state, self.why = TapState.FALLBACK, why
        where = self.url.rsplit(streaming.PATH, 1)[0]
        if warn and where not in _warned:
            _warned.add(where)
            log.warning(
                "cannot stream from the worker at %s (%s): streaming from the job's claim in "
                "ZooKeeper instead, a few times a second",
                where,
                why,
            )
        self._wake()


class AsyncTap(Tap):
    """A tap read by a task on the caller's event loop, with an ``aiohttp.ClientSession``."""

    def __init__(self, http: Any, claim: ClaimBody, wake: Callable[[], None]) -> None:
        super().__init__(claim, wake)
        self._task = asyncio.ensure_future(self._read(http))

    async def _read(self, http: Any) -> None:
        why = ""
        for _ in range(1 + RESUMES):
            try:
                if await self._read_once(http) or self.state != TapState.LIVE:
                    return
                why = "the worker closed the stream before its end"
            except Exception as exc:  # aiohttp's errors, and any surprise: never a lost traceback
                why = _describe(exc)
                if self.state != TapState.LIVE:
                    break
        self._closed_early(why)

    async def _read_once(self, http: Any) -> bool:
        """One connection; True once the stream is over (ended, stopped, or fallen back)."""
        params = self._params()
        async with http.get(self.url, headers=self.headers, params=params) as answer:
            if not self._opened(answer.status):
                return True
            reader, over = EventReader(), False
            # Lines split here, not by the library's line reader, which refuses a line longer
            # than its buffer (a late reader's first piece is all the text so far).
            pending, scanned = bytearray(), 0
            async for chunk in answer.content.iter_any():
                pending += chunk
                start = 0
                while (end := pending.find(b"\n", scanned)) >= 0:
                    line = bytes(pending[start:end]).rstrip(b"\r").decode()
                    start = scanned = end + 1
                    event = None if over else reader.feed(line)
                    over = over or (event is not None and self._handle(event))
                if start:
                    del pending[:start]
                scanned = len(pending)
            # Read to the answer's end (it ends right after its last event): the connection
            # then goes back to the pool for the next stream from this worker.
        return over

    def close(self) -> None:
        self._task.cancel()


class ThreadTap(Tap):
    """A tap read by a thread of its own (for the blocking ``Job``)."""

    def __init__(self, http: Any, claim: ClaimBody, wake: Callable[[], None]) -> None:
        super().__init__(claim, wake)
        self._closing = threading.Event()
        self._response: Any = None
        self._thread = threading.Thread(target=self._read, args=(http,), daemon=True)
        self._thread.name = "zkq-stream-tap"
        self._thread.start()

    def _read(self, http: Any) -> None:
        why = ""
        for _ in range(1 + RESUMES):
            try:
                if self._read_once(http) or self.state != TapState.LIVE:
                    return
                why = "the worker closed the stream before its end"
            except Exception as exc:  # also what closing the response under a read raises
                why = _describe(exc)
                if self._closing.is_set() or self.state != TapState.LIVE:
                    break
        if not self._closing.is_set():
            self._closed_early(why)

    def _read_once(self, http: Any) -> bool:
        params = self._params()
        with http.stream("GET", self.url, headers=self.headers, params=params) as answer:
            self._response = answer
            if self._closing.is_set() or not self._opened(answer.status_code):
                return True
            reader, over = EventReader(), False
            for line in answer.iter_lines():
                if self._closing.is_set():
                    return True
                event = None if over else reader.feed(line)
                over = over or (event is not None and self._handle(event))
        return over

    def close(self) -> None:
        self._closing.set()
        response = self._response
        if response is not None:
            with contextlib.suppress(Exception):  # closing under a read ends that read
                response.close()


@functools.cache
def http_library(name: str = "httpx") -> Any:
    """An HTTP library (``httpx`` or ``aiohttp``), imported on first use (``import zkqueue``
    stays light), or None without it: the library alone streams through claims only."""
    try:
        return importlib.import_module(name)
    except ImportError:
        return None


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__


def http_client(settings: Any, asynchronous: bool) -> Any:
    """A client for reading streams: an ``aiohttp.ClientSession`` (``asynchronous``, made on
    the running loop) or an ``httpx.Client``; None without that library. No limit on open
    streams, a short connect timeout, a read timeout of ``READ_TIMEOUT`` between bytes (a
    worker sends a comment every ``streaming.HEARTBEAT`` seconds), no proxies from the
    environment, and for HTTPS the ZooKeeper CA of ``settings`` (``ConnectionSettings``)."""
    verify = tls_context(settings.tls_ca, settings.tls_cert, settings.tls_key)
    if asynchronous:
        aiohttp = http_library("aiohttp")
        if aiohttp is None:
            return None
        return aiohttp.ClientSession(
            connector=aiohttp.TCPConnector(limit=0, ssl=verify),
            timeout=aiohttp.ClientTimeout(  # connect: the name's lookup too
                total=None,
                connect=CONNECT_TIMEOUT,
                sock_connect=CONNECT_TIMEOUT,
                sock_read=READ_TIMEOUT,
            ),
            trust_env=False,
        )
    httpx = http_library()
    if httpx is None:
        return None
    return httpx.Client(
        timeout=httpx.Timeout(None, connect=CONNECT_TIMEOUT, read=READ_TIMEOUT),
        limits=httpx.Limits(max_connections=None, max_keepalive_connections=64),
        verify=verify,
        trust_env=False,
    )


def tls_context(
    tls_ca: str | None, tls_cert: str | None, tls_key: str | None
) -> ssl.SSLContext | bool:
    """The TLS a stream reader verifies workers with: the ZooKeeper CA (and the client's own
    certificate, where it has one), else the library's default (True: the system's
    certificates for aiohttp, certifi's for httpx)."""
    if not tls_ca:
        return True
    context = ssl.create_default_context(cafile=tls_ca)
    if tls_cert and tls_key:
        context.load_cert_chain(tls_cert, tls_key)
    return context


def tappable(claim: ClaimBody | None) -> bool:
    """Whether a claim names a stream this process can read."""
    return claim is not None and bool(claim.stream and claim.secret)


class StreamReading:
    """One job handle's reading of a job's stream, across its attempts: which source carries
    the text (a tap on the worker's stream, else the claim's ``partial``), and what was handed
    out. ``Job.stream`` and ``AsyncJob.stream`` drive it; they differ only in how they wait.

    ``client`` gives the HTTP client (``stream_http()``); ``tap`` is the tap class that reads
    with it (``AsyncTap`` or ``ThreadTap``), and ``wake`` what a tap calls after each change."""

    def __init__(
        self, job_id: str, client: Any, tap: type[AsyncTap | ThreadTap], wake: Callable[[], None]
    ) -> None:
        self.transcript = Transcript(job_id)
        self._client, self._tap_class, self._wake = client, tap, wake
        # Made now, while the job waits for its claim: the first in a process (importing the
        # HTTP library, loading the CA bundle) takes about a tenth of a second, which would
        # otherwise delay the first text of the first stream.
        client.stream_http()
        self._tap: AsyncTap | ThreadTap | None = None
        #: Why the attempt that streamed text stopped, once its end is being checked.
        self._broken: str | None = None

    def ended(self, record: Result) -> str:
        """The rest of the text, now the job ended with ``record`` (see ``Transcript.final``)."""
        return self.transcript.final(record)

    def advance(self, claim: ClaimBody | None) -> str | None:
        """The text not handed out yet, given the claim read just now (None: not read, or
        none there). None instead when ZooKeeper must be read once more first: the attempt
        that streamed text stopped, and a cancel or a failure has its result already. A
        second call without a result raises StreamInterrupted."""
        if self._broken is not None:  # and no result: the rest of that text is lost
            self.transcript.interrupted(self._broken)
        if claim is not None and self.transcript.claim(claim.token):
            self.close()
            http = self._client.stream_http() if tappable(claim) else None
            self._tap = None if http is None else self._tap_class(http, claim, self._wake)
        tap = self._tap
        if tap is not None and tap.state == TapState.BROKEN:
            self._tap = None
            if self.transcript.sent:
                self._broken = tap.why
                return None
        text = self._tap.text if self._tap is not None and self._tap.serving else None
        if text is None and claim is not None:
            text = claim.partial
        return self.transcript.take(text or "")

    def close(self) -> None:
        if self._tap is not None:
            self._tap.close()
            self._tap = None
