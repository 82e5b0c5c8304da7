"""The upstream runner: each job is one streamed request to an OpenAI-compatible inference server
(vLLM, SGLang, TGI, llama.cpp's server, ``transformers serve``) that runs beside the worker.

The server batches and schedules; zkq holds the backlog in priority order and releases work to
the server only while it has room (``workers.runners.gate``). A job's life:

* ``submit`` starts one request on the runner's event loop (a thread of its own, one
  ``httpx.AsyncClient`` with a connection per job in flight): ``/v1/completions`` for a prompt,
  ``/v1/chat/completions`` for ``messages`` (the server renders its chat template). The job's
  fields map onto the request: ``max_tokens``, ``temperature`` (0 for a greedy job), ``top_p``,
  ``seed``, ``stop``, and ``min_tokens``/``ignore_eos`` only when the job sets them (vLLM and
  SGLang take them; a server that does not refuses the job with a 4xx, which fails it). With
  ``send_priority`` the job's priority goes along as vLLM's ``priority`` field
  (``PRIORITY_VALUES``: lower runs first, as vLLM's ``--scheduling-policy priority`` orders).
* The answer streams back as server-sent events: every chunk extends the job's partial output
  (what streaming callers see) and its progress (what keeps its lease alive). The outcome carries
  the server's ``usage`` (prompt_tokens, output_tokens), its ``finish_reason``, the time to first
  token (``ttft_s``, from the request's start; ``first_token_at``, unix seconds) and ``total_s``.
* A cancel, a withdrawal, a lost lease, a preemption or ``max_runtime`` closes the request's
  connection at once, which vLLM, SGLang and ``transformers serve`` take as an abort.
* Faults are ordinary events. A request the server fails for its own sake (connection refused or
  reset, a stream cut short, a 5xx, a 408 or 429, an error event mid-stream, no byte for
  ``timeout`` seconds) gives the job back to the queue (``release``: not counted against the
  job, though its attempt is), and a 5xx or a broken connection marks the engine down until its
  health check passes. A 4xx (a prompt too long, a parameter the server refuses) fails the job
  with the server's own message. A job that keeps killing its engine ends in the dead letter
  after ``max_attempts``, as any job does.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import threading
import time
from dataclasses import dataclass
from typing import Any

import httpx

from workers.calibration import Slots
from workers.runners.base import Done, Outcome, RunningJob
from workers.runners.gate import Gate, parse_metrics
from zkqueue import defaults
from zkqueue.errors import ConfigurationError
from zkqueue.protocol.result import Status
from zkqueue.protocol.spec import JobSpec

log = logging.getLogger("zkq.upstream")

#: The ``priority`` value sent per job with ``send_priority`` (vLLM: lower runs first; requests
#: sent without one count as 0, so a normal job ranks with other traffic).
PRIORITY_VALUES = {"high": -1, "normal": 0, "low": 1}
#: Slots when ``--max-concurrency`` is not given: behind a server that publishes its waiting
#: queue the gate decides and slots are a ceiling; behind one that does not, slots are the only
#: gate, at the CPU rule of the in-process engine (``workers.calibration.RULE_SLOTS``).
SLOTS_WITH_METRICS = 256
SLOTS_WITHOUT_METRICS = 16
#: Seconds between readings of the server's metrics, and between health checks while it is down.
POLL_S = 0.25
#: Seconds between health checks of a server that publishes no metrics, while it is up.
IDLE_CHECK_S = 1.0


@dataclass(frozen=True)
class UpstreamSettings:
    """Where the server is and how to talk to it (``zkq worker --runner openai``)."""

    #: The server's OpenAI base URL, ending in ``/v1`` (health and metrics are read at its root).
    url: str
    #: The model to ask for (None: the server's only model, from ``/v1/models``).
    model: str | None = None
    api_key: str | None = None
    #: Send each job's priority as vLLM's ``priority`` field (``PRIORITY_VALUES``).
    send_priority: bool = False
    max_waiting: int = defaults.UPSTREAM_MAX_WAITING
    max_kv_use: float = defaults.UPSTREAM_MAX_KV_USE
    #: Seconds without a byte from the server before a request counts as failed by the server.
    timeout: float = defaults.UPSTREAM_TIMEOUT
    #: Seconds a connection may take to open.
    connect_timeout: float = 5.0

    def __post_init__(self) -> None:
        if not self.url.startswith(("http://", "https://")):
            raise ConfigurationError(f"--upstream must be an http(s) URL, not {self.url!r}")
        if self.max_waiting < 0:
            raise ConfigurationError("--upstream-max-waiting must not be negative")
        if not 0 < self.max_kv_use <= 1:
            raise ConfigurationError("--upstream-max-kv-use must be in (0, 1]")

    @property
    def base(self) -> str:
        return self.url.rstrip("/")

    @property
    def root(self) -> str:
        """The server's root, where ``/health`` and ``/metrics`` are."""
        return self.base.removesuffix("/v1")


class EngineFault(Exception):
    """The server failed a request for its own sake: the job goes back to the queue."""

    def __init__(self, message: str, down: bool = True) -> None:
        super().__init__(message)
        #: Whether the engine is taken as down until its health check passes.
        self.down = down


class JobRefused(Exception):
    """The server refused the job itself (a 4xx): it fails with the server's message."""


def request_for(
    spec: JobSpec, model: str, priority: str | None = None
) -> tuple[str, dict[str, Any]]:
    """The path and the JSON body of one job's streamed request (``priority``: send it)."""
    body: dict[str, Any] = {"model": model, "stream": True, "max_tokens": spec.max_new_tokens}
    if spec.messages is not None:
        path = "/chat/completions"
        body["messages"] = [dict(m) for m in spec.messages]
    else:
        path = "/completions"
        body["prompt"] = spec.prompt
    body["stream_options"] = {"include_usage": True}
    if spec.temperature == 0 or (spec.temperature is None and spec.top_p is None):
        body["temperature"] = 0.0
    else:
        body["temperature"] = 1.0 if spec.temperature is None else spec.temperature
        if spec.top_p is not None:
            body["top_p"] = spec.top_p
    if spec.seed is not None:
        body["seed"] = spec.seed
    if spec.stop:
        body["stop"] = list(spec.stop)
    if spec.min_new_tokens:
        body["min_tokens"] = spec.min_new_tokens
    if spec.ignore_eos:
        body["ignore_eos"] = True
    if priority is not None:
        body["priority"] = PRIORITY_VALUES[priority]
    return path, body


class _Answer:
    """What one streamed answer has said so far."""

    def __init__(self, job: RunningJob, started: float) -> None:
        self.job = job
        self.started = started
        self.stop = job.spec.stop or ()
        #: Whether the runner cut the output at a stop string (the request is then closed).
        self.cut = False
        self.text: list[str] = []
        self.finish_reason: str | None = None
        self.usage: dict[str, Any] = {}
        self.ttft_s: float | None = None
        self.first_token_at: float | None = None

    def add(self, event: Any) -> None:
        if not isinstance(event, dict):
            raise EngineFault(f"the server sent an event that is not an object: {event!r}"[:300])
        if event.get("error"):
            raise EngineFault(f"the server sent an error mid-stream: {event['error']}", down=False)
        if isinstance(event.get("usage"), dict):
            self.usage = event["usage"]
        for choice in event.get("choices") or ():
            if not isinstance(choice, dict):
                raise EngineFault(f"the server sent a choice that is not an object: {choice!r}")
            piece = choice.get("text")
            if piece is None:
                piece = (choice.get("delta") or {}).get("content")
            if piece:
                if self.ttft_s is None:
                    self.ttft_s = time.monotonic() - self.started
                    self.first_token_at = time.time()
                self.text.append(piece)
                if self.stop and self._stopped(len(piece)):
                    return
                if self.job.spec.stream:  # what its caller sees while it runs
                    self.job.add_text("".join(self.text))
            self.job.progress += 1
            if choice.get("finish_reason"):
                self.finish_reason = choice["finish_reason"]

    def _stopped(self, added: int) -> bool:
        """Cut the output before a stop string that the last piece completed. Servers that
        honour ``stop`` never send one (``transformers serve`` does not under continuous
        batching), so the runner applies the job's stop strings itself, as zkq promises."""
        text = "".join(self.text)
        start = max(0, len(text) - added - max(len(s) for s in self.stop) + 1)
        found = [i for s in self.stop if (i := text.find(s, start)) >= 0]
        if not found:
            return False
        self.text = [text[: min(found)]]
        if self.job.spec.stream:
            self.job.add_text(self.text[0])
        self.finish_reason = "stop"
        self.cut = True
        return True

    def outcome(self) -> Outcome:
        extra: dict[str, Any] = {
            "finish_reason": self.finish_reason,
            "ttft_s": None if self.ttft_s is None else round(self.ttft_s, 4),
            "first_token_at": self.first_token_at,
            "total_s": round(time.monotonic() - self.started, 4),
        }
        if "prompt_tokens" in self.usage:
            extra["prompt_tokens"] = self.usage["prompt_tokens"]
        if "completion_tokens" in self.usage:
            extra["output_tokens"] = self.usage["completion_tokens"]
        return Outcome(Status.SUCCEEDED, output="".join(self.text), extra=extra)


class UpstreamRunner:
    """Runs jobs on an OpenAI-compatible server (see the module docstring)."""

    name = "openai"

    def __init__(
        self,
        settings: UpstreamSettings,
        *,
        slots: Slots | None = None,
        default_max_runtime: float | None = None,
    ) -> None:
        self.settings = settings
        self.default_max_runtime = default_max_runtime
        self.gate = Gate(settings.max_waiting, settings.max_kv_use)
        self.model = settings.model
        #: Whether the server publishes metrics the gate reads (None: not asked yet).
        self.metrics: bool | None = None
        self.owned_by: str | None = None
        self.slots = slots
        self._done: Done | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._thread: threading.Thread | None = None
        self._client: httpx.AsyncClient | None = None
        self._tasks: dict[str, asyncio.Task[Outcome]] = {}
        self._closing = False

    # -- set-up ---------------------------------------------------------------------------------

    def probe(self) -> None:
        """Ask the server at start what it serves and whether it publishes metrics, so that a
        wrong model name fails the worker before it registers. A server not up yet is not an
        error (a worker may start before its engine): the gate stays down until it answers."""
        headers = self._headers()
        timeout = self.settings.connect_timeout
        try:
            with httpx.Client(timeout=timeout, headers=headers) as http:
                models = http.get(self.settings.base + "/models")
                self._check_models(models)
                metrics = http.get(self.settings.root + "/metrics")
        except (httpx.HTTPError, EngineFault, ValueError) as exc:
            log.warning("the server at %s is not ready yet (%s)", self.settings.url, exc)
            if self.slots is None:
                detail = "upstream server, not reachable at start"
                self.slots = Slots(SLOTS_WITHOUT_METRICS, "rule", detail=detail)
            return
        self._take_metrics(metrics)
        self.gate.healthy()
        if self.slots is None:
            count = SLOTS_WITH_METRICS if self.metrics else SLOTS_WITHOUT_METRICS
            how = "behind its metrics gate" if self.metrics else "no metrics: slots alone"
            self.slots = Slots(count, "rule", detail=f"upstream server, {how}")

    def _check_models(self, answer: httpx.Response) -> None:
        if answer.status_code in (401, 403):
            raise ConfigurationError(
                f"the server at {self.settings.url} refused the API key ({answer.status_code})"
            )
        if answer.status_code != 200:
            raise EngineFault(f"/models answered {answer.status_code}")
        listing = answer.json()
        data = listing.get("data") if isinstance(listing, dict) else None
        served = [m for m in data or [] if isinstance(m, dict)]
        names = [str(m.get("id")) for m in served]
        if self.model is None:
            if len(names) != 1:
                raise ConfigurationError(
                    f"the server at {self.settings.url} serves {len(names)} models "
                    f"({', '.join(names) or 'none'}): choose one with --upstream-model"
                )
            self.model = names[0]
        elif self.model not in names:
            raise ConfigurationError(
                f"the server at {self.settings.url} does not serve {self.model!r} "
                f"(it serves: {', '.join(names) or 'none'})"
            )
        for m in served:
            if m.get("id") == self.model and m.get("owned_by"):
                self.owned_by = str(m["owned_by"])

    def _take_metrics(self, answer: httpx.Response, asked_at: float | None = None) -> None:
        """Feed a reading to the gate. Until the server has shown figures, an answer decides
        whether it publishes metrics at all; after that, an answer without figures (a 503 from
        a proxy, a page cut short) shuts the gate until a reading succeeds."""
        figures = parse_metrics(answer.text) if answer.status_code == 200 else None
        if not self.metrics:
            self.metrics = figures is not None
        elif figures is None:
            self.gate.stale()
            return
        self.gate.reading(figures, asked_at)

    def _headers(self) -> dict[str, str]:
        key = self.settings.api_key
        return {"Authorization": f"Bearer {key}"} if key else {}

    # -- the runner interface -------------------------------------------------------------------

    def describe(self) -> dict[str, Any]:
        out: dict[str, Any] = {
            "runner": self.name,
            "upstream": self.settings.url,
            "model": self.model,
            "metrics": self.metrics,
            "send_priority": self.settings.send_priority,
        }
        if self.owned_by:
            out["owned_by"] = self.owned_by
        if self.slots is not None:
            out.update(self.slots.record())
        return out

    def start(self, done: Done) -> None:
        self._done = done
        ready = threading.Event()
        self._thread = threading.Thread(
            target=self._serve, args=(ready,), name="zkq-upstream", daemon=True
        )
        self._thread.start()
        ready.wait()

    def submit(self, job: RunningJob) -> None:
        loop = self._loop
        assert loop is not None, "start() the runner first"

        def cancel(j: RunningJob) -> None:
            loop.call_soon_threadsafe(self._cancel, j.id)

        job.on_cancel = cancel
        loop.call_soon_threadsafe(self._spawn, job)

    def close(self) -> None:
        loop, self._closing = self._loop, True
        if loop is None or self._thread is None:
            return
        with contextlib.suppress(RuntimeError, TimeoutError):  # stopped already, or stuck
            asyncio.run_coroutine_threadsafe(self._shutdown(), loop).result(timeout=5)
        self._thread.join(timeout=5)

    # -- the event loop -------------------------------------------------------------------------

    def _serve(self, ready: threading.Event) -> None:
        loop = asyncio.new_event_loop()
        self._loop = loop
        asyncio.set_event_loop(loop)
        timeout = httpx.Timeout(self.settings.timeout, connect=self.settings.connect_timeout)
        limits = httpx.Limits(max_connections=None, max_keepalive_connections=64)
        self._client = httpx.AsyncClient(timeout=timeout, limits=limits, headers=self._headers())
        monitor = loop.create_task(self._monitor())
        ready.set()
        try:
            loop.run_forever()
        finally:
            monitor.cancel()
            loop.run_until_complete(asyncio.gather(monitor, return_exceptions=True))
            loop.close()

    async def _shutdown(self) -> None:
        for task in list(self._tasks.values()):
            task.cancel()
        await asyncio.gather(*self._tasks.values(), return_exceptions=True)
        if self._client is not None:
            await self._client.aclose()
        asyncio.get_running_loop().call_soon(asyncio.get_running_loop().stop)

    def _spawn(self, job: RunningJob) -> None:
        task = asyncio.get_running_loop().create_task(self._run(job))
        self._tasks[job.id] = task
        task.add_done_callback(lambda t: self._ended(job, t))

    def _ended(self, job: RunningJob, task: asyncio.Task[Outcome]) -> None:
        """Report the job's outcome: exactly once, whatever ended its task. A task cancelled
        before its first step never ran ``_run``'s body, so its outcome is made here."""
        self._tasks.pop(job.id, None)
        if task.cancelled():
            reason = f"stopped: {job.cancel_reason}"
            outcome = Outcome(Status.CANCELLED, error=reason)
        elif (exc := task.exception()) is not None:
            log.error("upstream runner failed job %s: %r", job.id, exc)
            outcome = Outcome(Status.FAILED, error=f"runner error: {exc!r}")
        else:
            outcome = task.result()
        assert self._done is not None
        self._done(job, outcome)

    def _cancel(self, job_id: str) -> None:
        task = self._tasks.get(job_id)
        if task is not None:
            task.cancel()

    async def _run(self, job: RunningJob) -> Outcome:
        started = time.monotonic()
        answer = _Answer(job, started)
        limit = job.spec.max_runtime or self.default_max_runtime
        try:
            if job.cancelled.is_set():
                raise asyncio.CancelledError
            async with asyncio.timeout(limit):
                await self._stream(job, answer)
            outcome = answer.outcome()
        except TimeoutError:
            error = f"exceeded max_runtime of {limit:g}s"
            outcome = Outcome(Status.TIMEOUT, output="".join(answer.text), error=error)
        except asyncio.CancelledError:
            outcome = Outcome(
                Status.CANCELLED, output="".join(answer.text), error=f"stopped: {job.cancel_reason}"
            )
        except JobRefused as refused:
            outcome = Outcome(Status.FAILED, error=str(refused))
        except EngineFault as fault:
            outcome = Outcome(Status.FAILED, error=str(fault), release=True)
            if fault.down and self.gate.down(str(fault)):
                log.warning("engine down: %s; no claims until its health check passes", fault)
        except Exception as exc:  # a runner bug must fail its job, never kill the worker
            log.exception("upstream runner failed job %s", job.id)
            outcome = Outcome(Status.FAILED, error=f"runner error: {exc!r}")
        return outcome

    async def _stream(self, job: RunningJob, answer: _Answer) -> None:
        assert self._client is not None and self.model is not None
        priority = job.priority if self.settings.send_priority else None
        path, body = request_for(job.spec, self.model, priority)
        try:
            async with self._client.stream("POST", self.settings.base + path, json=body) as reply:
                if reply.status_code != 200:
                    await reply.aread()
                    _refused(reply)
                async for line in reply.aiter_lines():
                    if not line.startswith("data:"):
                        continue  # blank separators, comments, event names
                    data = line[5:].strip()
                    if data == "[DONE]":
                        break
                    answer.add(json.loads(data))
                    if answer.cut:
                        break  # leaving closes the request: the server stops generating
        except httpx.TransportError as exc:
            raise EngineFault(f"the server's connection failed: {_describe(exc)}") from exc
        except httpx.HTTPError as exc:  # an answer that cannot be decoded
            raise EngineFault(f"the server's answer failed: {_describe(exc)}", False) from exc
        except json.JSONDecodeError as exc:
            raise EngineFault(f"the server sent an event that is not JSON: {exc}", False) from exc
        if answer.finish_reason is None:
            raise EngineFault("the server's stream ended before the answer did", down=False)

    async def _monitor(self) -> None:
        """Read the server's metrics while it is up; check its health while it is down."""
        while not self._closing:
            try:
                if not self.gate.up:
                    await self._check_health()
                    await asyncio.sleep(POLL_S)
                elif self.metrics is False:
                    await asyncio.sleep(IDLE_CHECK_S)
                    await self._check_health()
                else:
                    await self._read_metrics()
                    await asyncio.sleep(POLL_S)
            except asyncio.CancelledError:
                raise
            except Exception:  # the monitor must outlive any one bad answer
                log.exception("reading the server's state failed")
                await asyncio.sleep(POLL_S)

    async def _read_metrics(self) -> bool:
        """One reading of the server's metrics; returns whether the server answered."""
        assert self._client is not None
        asked_at = time.monotonic()
        try:
            reply = await self._client.get(self.settings.root + "/metrics")
        except httpx.TransportError as exc:
            self._went_down(f"reading /metrics failed: {_describe(exc)}")
            return False
        self._take_metrics(reply, asked_at)
        return True

    async def _check_health(self) -> None:
        """``/health`` (or ``/v1/models`` where there is none) answers 200; while the engine
        is down, also ``/v1/models`` with our key lists our model (a key refused or a model
        unloaded took it down as surely as a crash)."""
        assert self._client is not None
        down = not self.gate.up
        try:
            reply = await self._client.get(self.settings.root + "/health")
            if reply.status_code == 404:
                reply = await self._client.get(self.settings.base + "/models")
            if reply.status_code == 200 and (down or self.model is None):
                await self._check_serving()
        except httpx.HTTPError as exc:
            self._went_down(f"the health check failed: {_describe(exc)}")
            return
        except (ConfigurationError, EngineFault, ValueError) as exc:
            self._went_down(str(exc))
            return
        if reply.status_code != 200:
            self._went_down(f"the health check answered {reply.status_code}")
            return
        if self.metrics is None and not await self._read_metrics():
            return
        if down:
            log.info("engine up: the server at %s answers its health check", self.settings.url)
        self.gate.healthy()

    async def _check_serving(self) -> None:
        """``/v1/models``, with our key, lists our model (and names it, for a server that was
        down when the worker started)."""
        assert self._client is not None
        try:
            self._check_models(await self._client.get(self.settings.base + "/models"))
        except ConfigurationError as exc:
            log.error("%s", exc)
            raise

    def _went_down(self, reason: str) -> None:
        if self.gate.down(reason):
            log.warning("engine down: %s; no claims until its health check passes", reason)


def _refused(reply: httpx.Response) -> None:
    """Raise for a non-200 answer: the server's fault (released) or the job's (failed)."""
    status = reply.status_code
    message = _server_message(reply)
    if status >= 500:
        raise EngineFault(f"the server answered {status}: {message}")
    if status in (408, 429):
        raise EngineFault(f"the server answered {status}: {message}", down=False)
    if status in (401, 403, 404):  # the key or the model, not this job: down until it serves
        raise EngineFault(f"the server answered {status}: {message}")
    raise JobRefused(f"the server refused the job ({status}): {message}")


def _server_message(reply: httpx.Response) -> str:
    """The error text of an OpenAI-style error answer, or its first 500 characters."""
    with contextlib.suppress(ValueError):
        body = reply.json()
        if isinstance(body, dict):
            error = body.get("error", body.get("detail", body.get("message")))
            if isinstance(error, dict):
                error = error.get("message", error)
            if error is not None:
                return str(error)[:500]
    return reply.text[:500] or reply.reason_phrase


def _describe(exc: Exception) -> str:
    return f"{type(exc).__name__}: {exc}" if str(exc) else type(exc).__name__
