"""One record of every worker setting: ``zkq worker`` maps its flags (and the TOML file) onto these
fields, the daemon reads the runner's part, and the loop (``workers.loop.Worker``) the rest."""

from __future__ import annotations

import os
import secrets
import socket
from dataclasses import dataclass

from workers.admission import high_width
from zkqueue import defaults
from zkqueue.errors import ConfigurationError
from zkqueue.protocol.layout import check_queue, check_root, check_worker_name

#: The most jobs a model worker holds when --max-concurrency is not given.
MODEL_SLOTS = 256


@dataclass
class WorkerOptions:
    """Everything a worker takes. Defaults live in ``zkqueue.defaults``."""

    queue: str = defaults.QUEUE
    root: str = defaults.ROOT
    #: Jobs this worker holds at once. None: one for the echo runner; for a model worker, its
    #: engine's throughput knee (``workers.calibration``), never more than its KV cache admits
    #: (every job takes a page at least) or ``MODEL_SLOTS``. Memory admission may allow fewer.
    max_concurrency: int | None = None
    #: Measure the knee at start (or read it from the cache); False: ``RULE_SLOTS`` per device.
    calibrate: bool = True
    #: Measure again even when the cache holds a result.
    recalibrate: bool = False
    #: Directory of the calibration cache (None: $CACHE_DIRECTORY, $XDG_CACHE_HOME/zkq, ...).
    calibration_cache: str | None = None
    name: str | None = None
    #: Exit after claiming this many jobs.
    max_jobs: int | None = None
    #: Exit when the queue is empty.
    burst: bool = False
    drain_timeout: float = defaults.DRAIN_TIMEOUT
    heartbeat_interval: float = defaults.HEARTBEAT_INTERVAL
    #: Seconds a running job's claim lives without progress.
    lease: float = defaults.LEASE
    max_attempts: int = defaults.MAX_ATTEMPTS
    #: Give a running job of a lower priority back when a more urgent one waits and no slot is
    #: free (workers.preemption); off: an urgent job waits for a slot to free up.
    preempt: bool = defaults.PREEMPT
    #: Seconds after its preemption during which a job is not preempted again.
    preempt_protect: float = defaults.PREEMPT_PROTECT
    #: Preemptions this worker makes in any minute at most.
    preempt_per_minute: int = defaults.PREEMPT_PER_MINUTE
    #: Jobs this worker holds at most while it runs a high-priority job: lower-priority jobs
    #: that end are not replaced beyond it, so the urgent job's engine steps stay short
    #: (``workers.admission.high_width``). "auto": from the calibration's curve (no limit
    #: without one); "off": no limit; or a number.
    high_width: int | str = "auto"

    #: Serve streaming jobs' output to their readers directly (``workers.streams``); off: it
    #: goes through the jobs' claims in ZooKeeper, a few times a second.
    stream: bool = True
    #: Where the stream server listens, ``HOST:PORT`` (port 0: any free port).
    stream_bind: str = "0.0.0.0:0"
    #: The address readers connect to, ``HOST`` or ``HOST:PORT`` (None: the address this host
    #: reaches ZooKeeper from, and the bound port).
    stream_advertise: str | None = None
    #: (certificate, key) to serve streams over TLS (the daemon passes ZooKeeper's client pair).
    stream_tls: tuple[str, str] | None = None

    # -- the runner ---------------------------------------------------------------------------
    runner: str = "echo"
    echo_delay: float = defaults.ECHO_DELAY
    model: str | None = None
    device: str = "auto"
    dtype: str = "auto"
    #: Behave as if the device had this many bytes, weights included (CPU hosts, tests).
    vram_budget: int | None = None
    #: Bytes always kept free on the device.
    vram_reserve: int = 0
    #: Default max_runtime for jobs that set none (seconds).
    max_runtime: float | None = None
    slow_after: float = 30.0
    #: A greedy-only engine: faster decoding steps (no per-step sampling work), but sampled jobs
    #: then run one at a time outside the batch. Off: greedy and sampled jobs share the batch.
    greedy_only: bool = False
    #: The openai runner: the inference server's OpenAI base URL (``http://host:port/v1``).
    upstream: str | None = None
    #: The model to ask the server for (None: its only model).
    upstream_model: str | None = None
    upstream_api_key: str | None = None
    #: Send each job's priority as vLLM's per-request ``priority`` field.
    upstream_priority: bool = False
    #: Claim while the server's waiting queue holds at most this many requests...
    upstream_max_waiting: int = defaults.UPSTREAM_MAX_WAITING
    #: ... and its KV-cache use is below this fraction (where it publishes them).
    upstream_max_kv_use: float = defaults.UPSTREAM_MAX_KV_USE
    #: Seconds without a byte from the server before a request counts as the server's failure.
    upstream_timeout: float = defaults.UPSTREAM_TIMEOUT

    # -- what the daemon adds -----------------------------------------------------------------
    #: Take part in the janitor's election (one active janitor per cluster).
    janitor: bool = True
    janitor_interval: float = defaults.JANITOR_INTERVAL
    result_ttl: float = defaults.RESULT_TTL
    #: Per-queue bounds on stored results (count, bytes of records) the janitor keeps.
    max_results: int = defaults.MAX_RESULTS
    max_result_bytes: int = defaults.MAX_RESULT_STORE_BYTES
    #: Serve Prometheus metrics on this port (none: no HTTP server).
    metrics_port: int | None = None
    metrics_addr: str = "0.0.0.0"

    def __post_init__(self) -> None:
        """Validate at the edge (flags, TOML, library callers): names, then numbers."""
        check_queue(self.queue)
        check_root(self.root)
        if self.name is not None:
            check_worker_name(self.name)
        for field, low in _AT_LEAST_ONE.items():
            value = getattr(self, field)
            if value is not None and value < low:
                raise ConfigurationError(f"{field} must be at least {low}, not {value}")
        for field in _POSITIVE:
            value = getattr(self, field)
            if value is not None and not value > 0:
                raise ConfigurationError(f"{field} must be more than 0, not {value}")
        if self.stream:
            from workers.streams import split_address

            split_address(self.stream_bind, "--stream-bind")
        _check_high_width(self.high_width)
        if self.drain_timeout < 0:
            raise ConfigurationError(f"drain_timeout must not be negative: {self.drain_timeout}")


_AT_LEAST_ONE = {
    "max_concurrency": 1,
    "max_jobs": 1,
    "max_attempts": 1,
    "preempt_per_minute": 1,
    "max_results": 1,
    "max_result_bytes": 1,
}
_POSITIVE = (
    "heartbeat_interval",
    "lease",
    "janitor_interval",
    "result_ttl",
    "max_runtime",
    "preempt_protect",
    "upstream_timeout",
)


def _check_high_width(value: int | str) -> None:
    if value in ("auto", "off"):
        return
    try:
        number = int(value)
    except (TypeError, ValueError):
        number = 0
    if isinstance(value, bool) or number < 1 or str(number) != str(value).strip():
        raise ConfigurationError(
            f"high_width must be auto, off or a number of jobs (at least 1), not {value!r}"
        )


def high_width_for(opts: WorkerOptions, runner: object, slots: int) -> int | None:
    """The jobs a worker holds at most while it runs a high-priority job (None: no limit, or
    one at least as wide as its slots): the setting, or with "auto" the width its runner's
    calibration curve gives (``runner.slots.curve``; none without a curve)."""
    setting = opts.high_width
    if setting == "off":
        return None
    if setting == "auto":
        chosen = getattr(runner, "slots", None)
        curve = getattr(chosen, "curve", ())
        width = high_width(curve) if curve else None
    else:
        width = int(setting)
    return None if width is None or width >= slots else max(1, width)


def default_worker_id() -> str:
    return f"{socket.gethostname()}-{os.getpid()}-{secrets.token_hex(2)}"


def slots_for(opts: WorkerOptions, pages_total: int | None, runner: object = None) -> int:
    """The worker's slots: --max-concurrency, else what the runner chose (a model runner's
    ``slots``, the engine's knee: workers.calibration), else one for a worker without a cache,
    else what the cache admits (a page per job at least), at most MODEL_SLOTS."""
    if opts.max_concurrency is not None:
        return opts.max_concurrency
    chosen = getattr(runner, "slots", None)
    if chosen is not None:
        return int(chosen.count)
    if pages_total is None:
        return defaults.WORKER_SLOTS
    return max(1, min(pages_total, MODEL_SLOTS))
