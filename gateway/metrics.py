"""``GET /metrics``: the gateway's own counters, plus the cluster-wide gauges of ``zkq metrics``.

The cluster collector (zkqueue/operations/exporter.py) reads ZooKeeper with blocking calls, so a
scrape runs it on a pool thread; requests never do. Metric names are listed in docs/GATEWAY.md.
"""

from __future__ import annotations

import asyncio
import logging
import time
from dataclasses import dataclass

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest

from zkqueue.operations.exporter import cluster_registry
from zkqueue.plumbing.logs import job_context
from zkqueue.producer.client import Client
from zkqueue.protocol.result import Result

log = logging.getLogger("zkq.gateway")

#: The paths counted as themselves; any other is one label (a client may ask for any path, and
#: a label per path would let it grow the metrics without bound).
_PATHS = frozenset({"/v1/chat/completions", "/v1/completions", "/v1/models"})

#: Latency buckets, seconds: from an echo job to a long generation.
_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60, 120, 300, 600)


@dataclass
class Timing:
    """When a completion request came, and when its first text went out (a stream's; unix
    seconds, this host's clock), by endpoint (``chat`` or ``completions``)."""

    endpoint: str
    arrived: float
    first_sent: float | None = None


class GatewayMetrics:
    """Requests by endpoint and HTTP status, open requests, time in the queue, to the first
    text of a stream and to the last byte."""

    def __init__(self, cluster: Client | None = None) -> None:
        self.registry = CollectorRegistry()
        self.requests = Counter(
            "zkq_gateway_requests",
            "HTTP requests answered, by endpoint and status (a stream counts its start).",
            ["endpoint", "code"],
            registry=self.registry,
        )
        self.stream_errors = Counter(
            "zkq_gateway_stream_errors",
            "Streams that ended with an error event, by error code.",
            ["code"],
            registry=self.registry,
        )
        self.open = Gauge(
            "zkq_gateway_open_requests",
            "Completion requests waiting for or streaming their job.",
            registry=self.registry,
        )
        self.withdrawn = Counter(
            "zkq_gateway_withdrawn",
            "Jobs withdrawn because their HTTP client went away.",
            registry=self.registry,
        )
        self.seconds = Histogram(
            "zkq_gateway_request_seconds",
            "Seconds from a completion request to its last byte, by endpoint.",
            ["endpoint"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.first_text_seconds = Histogram(
            "zkq_gateway_first_text_seconds",
            "Seconds from a streamed completion request to its first text sent, by endpoint.",
            ["endpoint"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self.queued = Histogram(
            "zkq_gateway_queue_seconds",
            "Seconds a completion's job waited from its submission to its claim (to the claim "
            "of the attempt that ended it; the claim stamped by the worker's clock, the "
            "submission by ZooKeeper's), by endpoint.",
            ["endpoint"],
            buckets=_BUCKETS,
            registry=self.registry,
        )
        self._cluster = cluster_registry(cluster) if cluster is not None else None

    def first_text(self, timing: Timing) -> None:
        """A stream sends its first text now."""
        timing.first_sent = time.time()
        self.first_text_seconds.labels(timing.endpoint).observe(timing.first_sent - timing.arrived)

    def job_ended(self, job_id: str, record: Result, timing: Timing) -> None:
        """A completion's job ended with ``record``: observe its time in the queue and, at info
        level, log its steps from the request's arrival. Each step is stamped by the clock of
        what took it: the submission by ZooKeeper's (the entry's creation, whole milliseconds:
        it may come out a fraction of a millisecond before the arrival), the claim, the first
        token (where the runner reports it) and the end by the worker's, the first text sent (a
        stream's) by this host's."""
        if record.submitted_at is not None and record.started_at is not None:
            wait = max(0.0, record.started_at - record.submitted_at)
            self.queued.labels(timing.endpoint).observe(wait)
        if not log.isEnabledFor(logging.INFO):
            return
        steps = {
            "submitted": record.submitted_at,
            "claimed": record.started_at,
            "first token": record.extra.get("first_token_at"),
            "first text sent": timing.first_sent,
            "ended": record.finished_at,
        }
        said = ", ".join(
            f"{step} {1000 * (at - timing.arrived):+.1f} ms"
            for step, at in steps.items()
            if isinstance(at, (int, float))
        )
        context = job_context(job_id, record.queue, record.priority, record.worker or "")
        log.info("%s %s: %s from the request", timing.endpoint, record.status, said, extra=context)

    async def render(self) -> bytes:
        """The text exposition: the gateway's metrics, then the cluster's (read on a thread)."""
        own = generate_latest(self.registry)
        if self._cluster is None:
            return own
        return own + await asyncio.to_thread(generate_latest, self._cluster)


def endpoint_label(path: str) -> str:
    """The ``endpoint`` label of a request path: the route it matched, never the raw path."""
    if path in _PATHS:
        return path
    return "/v1/models/{model}" if path.startswith("/v1/models/") else "other"
