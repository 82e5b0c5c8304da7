"""What the blocking and the asyncio producer share (``zkqueue.producer.client.Client``,
``zkqueue.producer.aio.AsyncClient``): one constructor, so both faces take the same options and
build the same state from them, and the session accessor. They differ only in how they wait."""

from __future__ import annotations

import threading
from typing import Any, TypedDict, Unpack

from kazoo.client import KazooClient

from zkqueue import defaults
from zkqueue.errors import ZkqConnectionError
from zkqueue.plumbing.connection import ConnectionSettings
from zkqueue.protocol.layout import Layout


class ClientOptions(TypedDict, total=False):
    """The options both clients take by keyword (defaults in ``zkqueue.defaults``)."""

    #: Seconds the session lives without the ensemble (attached jobs go with it).
    session_timeout: float
    #: Seconds a call waits for a connection before ZkqConnectionError.
    connect_timeout: float
    #: Bytes a job's spec may take at most.
    max_spec_bytes: int
    #: Specs up to this size ride in the arrival signal (0: none do).
    signal_spec_bytes: int
    #: ``user:password`` for ZooKeeper's digest scheme.
    auth: str | None
    #: TLS: the CA bundle, and a client certificate and key where the ensemble asks for one.
    tls_ca: str | None
    tls_cert: str | None
    tls_key: str | None
    #: A started session to share: never closed by this client.
    zk: KazooClient | None
    #: Read streaming jobs' output straight from their workers (``zkqueue.producer.direct``);
    #: False: from their claims in ZooKeeper, a few times a second.
    direct_streams: bool


class ClientBase:
    """A connection to one zkq root, not yet started: its settings, its layout, the largest
    spec it submits, its session (its own, made at start, or ``zk``, shared) and the queues it
    has made ready. Each face makes its enqueuer (``zkqueue.producer.enqueue``) with
    ``signal_spec_bytes``: the base does not import it, which keeps ``import zkqueue`` short."""

    #: How a face tells its user to start it.
    NOT_STARTED = "client is not started: use it as a context manager"
    #: What a submit is doing when ZooKeeper goes away during its reads (the error says so).
    CHECKING = "checking the queue before submitting (nothing was enqueued)"

    def __init__(
        self,
        hosts: str = defaults.HOSTS,
        root: str = defaults.ROOT,
        **options: Unpack[ClientOptions],
    ) -> None:
        self.settings = ConnectionSettings(
            hosts=hosts,
            session_timeout=options.get("session_timeout", defaults.SESSION_TIMEOUT),
            connect_timeout=options.get("connect_timeout", defaults.CONNECT_TIMEOUT),
            auth=options.get("auth"),
            tls_ca=options.get("tls_ca"),
            tls_cert=options.get("tls_cert"),
            tls_key=options.get("tls_key"),
        )
        self.layout = Layout(root)
        self.max_spec_bytes = options.get("max_spec_bytes", defaults.MAX_SPEC_BYTES)
        self._zk = options.get("zk")
        self._owns_zk = self._zk is None
        #: Queues whose directories this client has made sure of.
        self._ready: set[str] = set()
        #: Specs up to this size ride in the arrival signal (each face's enqueuer reads it).
        self.signal_spec_bytes = options.get("signal_spec_bytes", defaults.SIGNAL_SPEC_BYTES)
        self.direct_streams = options.get("direct_streams", True)
        #: The HTTP client that reads streams from workers, made on first use.
        self._http: Any = None
        self._http_made = threading.Lock()
        #: Closed: its streams make no HTTP client any more (nothing would close it).
        self._closed = False

    def stream_http(self) -> Any:
        """The HTTP client that reads jobs' streams from their workers (an httpx client for
        Client, an aiohttp session for AsyncClient: ``zkqueue.producer.direct.http_client``);
        None when this client reads streams from claims only (``direct_streams=False``, or
        without that library), or is not started (a closed client makes none: nothing would
        close it)."""
        with self._http_made:  # one per client, whichever thread asks first
            wanted = self._http is None and self._zk is not None and not self._closed
            if wanted and self.direct_streams:
                from zkqueue.producer.direct import http_client

                self._http = http_client(self.settings, asynchronous=self._asynchronous)
                self.direct_streams = self._http is not None
            return self._http

    def _closing_http(self) -> Any:
        """The HTTP client to close as this client closes (None if none was made); none is
        made after this, until the client starts again."""
        with self._http_made:
            self._closed = True
            http, self._http = self._http, None
            return http

    #: Whether this face reads streams on an event loop (AsyncClient) or on threads.
    _asynchronous = False

    @property
    def zk(self) -> KazooClient:
        if self._zk is None:
            raise ZkqConnectionError(self.NOT_STARTED)
        return self._zk

    def find_entry(self, queue: str, priority: str, job_id: str) -> str | None:
        """The entry of ``job_id`` in ``queue``'s ``priority`` (each face finds it its way)."""
        raise NotImplementedError
