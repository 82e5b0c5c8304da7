"""The ASGI app of ``zkq serve``: OpenAI's completion endpoints in front of zkq's queues.

Each completion request becomes one attached job (ephemeral: withdrawn if this process goes
away). A request waits on the event loop, never on a thread of its own; a client that hangs up
(detected by listening for ``http.disconnect`` while the job runs) withdraws its job at once.
Everything the app keeps is a cache, so any number of replicas can serve side by side.
"""

from __future__ import annotations

import asyncio
import contextlib
import json
import logging
import math
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from dataclasses import replace
from typing import Any, TypeVar

from starlette.applications import Starlette
from starlette.exceptions import HTTPException
from starlette.requests import Request
from starlette.responses import JSONResponse, Response
from starlette.routing import Route

from gateway import openai_format as fmt
from gateway.config import ApiKey, GatewayConfig
from gateway.errors import (
    AUTH,
    NOT_FOUND,
    PERMISSION,
    RATE_LIMIT,
    ApiError,
    from_result,
    from_zkq,
    invalid,
)
from gateway.metrics import GatewayMetrics, Timing, endpoint_label
from gateway.pools import Pools
from gateway.ratelimits import RateLimits
from gateway.sse import ClientGone, EventStream, until_hangup
from gateway.sse import sse as _sse
from zkqueue import defaults
from zkqueue.errors import InvalidJob, ZkqConnectionError, ZkqError
from zkqueue.producer.aio import AsyncClient, AsyncJob
from zkqueue.producer.client import Client
from zkqueue.protocol.layout import DEFAULT_TENANT, check_tenant
from zkqueue.protocol.spec import estimate_tokens

log = logging.getLogger("zkq.gateway")
_SHUTDOWN = "the gateway is shutting down and its drain timeout passed first; the job was withdrawn"
T = TypeVar("T")

#: A request body may be at most this many bytes (a job spec is at most 64 KiB anyway).
MAX_BODY = 1024 * 1024


class Gateway:
    """The endpoints, over one AsyncClient (one ZooKeeper session per process)."""

    def __init__(self, client: AsyncClient, config: GatewayConfig, metrics: bool = True) -> None:
        self.client = client
        self.config = config
        self.pools = Pools(client, config)
        cluster = Client(client.settings.hosts, client.layout.root or "/", zk=client.zk)
        self.metrics = GatewayMetrics(cluster if metrics else None)
        self._in_flight: dict[str, int] = {}
        #: Per-key request and token rate limits (this process's buckets).
        self.limits = RateLimits()

    # -- endpoints ---------------------------------------------------------------------------

    async def chat(self, request: Request) -> Response:
        return await self._complete(request, fmt.CHAT)

    async def completions(self, request: Request) -> Response:
        return await self._complete(request, fmt.TEXT)

    async def models(self, request: Request) -> Response:
        self._authorize(request)
        body = {"object": "list", "data": await self.pools.models()}
        self._answered(request, 200)
        return JSONResponse(body)

    async def model(self, request: Request) -> Response:
        self._authorize(request)
        name = request.path_params["model"]
        found = [m for m in await self.pools.models() if m["id"] == name]
        if not found:
            raise ApiError(404, f"the model {name!r} does not exist", NOT_FOUND, "model_not_found")
        self._answered(request, 200)
        return JSONResponse(found[0])

    async def health(self, request: Request) -> Response:
        up = self.client.connected
        body = {"status": "ok" if up else "unavailable", "zookeeper": up}
        return JSONResponse(body, status_code=200 if up else 503)

    async def prometheus(self, request: Request) -> Response:
        return Response(await self.metrics.render(), media_type="text/plain; version=0.0.4")

    def _answered(self, request: Request, status: int) -> None:
        """Count an answer by endpoint and status (errors are counted where they are made into
        answers: ``_answer``)."""
        self.metrics.requests.labels(endpoint_label(request.url.path), str(status)).inc()

    # -- a completion ------------------------------------------------------------------------

    async def _complete(self, request: Request, kind: str) -> Response:
        endpoint = "chat" if kind == fmt.CHAT else "completions"
        started, timing = time.monotonic(), Timing(endpoint, time.time())
        key = self._authorize(request)
        request.state.key = key  # its rate limits go on every answer, errors too (_answer)
        job_request = fmt.parse(kind, await _json(request), self.config.max_tokens)
        priority = self._priority(request, key, job_request.asked_priority)
        if job_request.names_tier:  # the answer names the tier the job ran at
            job_request = replace(job_request, tier=fmt.TIER_OF[priority])
        timeout = self._timeout(request)
        queue = await self.pools.queue_for(job_request.model)
        release = self._hold(key)
        grant = None
        try:
            # Rate limits last: a request refused for any other reason takes nothing.
            cost = estimate_tokens(job_request.text, job_request.max_tokens)
            grant = self.limits.admit(key, cost)
            tenant = self._tenant(request, key, job_request.user)
            job = await self._submit(job_request, queue, priority, key, tenant)
        except BaseException:
            release()
            self.limits.refund(grant)
            raise
        headers = {"X-Zkq-Job": job.id, "X-Zkq-Queue": queue, "X-Zkq-Priority": priority}
        headers["X-Zkq-Tenant"] = tenant or DEFAULT_TENANT
        headers.update(self.limits.headers(key))
        self.metrics.open.inc()

        def done() -> None:
            release()
            self.limits.settle(grant, None if job.record is None else fmt.used_tokens(job.record))
            self.metrics.open.dec()
            self.metrics.seconds.labels(endpoint).observe(time.monotonic() - started)
            if job.record is None:  # the caller went away, or an error: nobody reads it now
                job.abandon()
            else:
                self.metrics.job_ended(job.id, job.record, timing)

        if job_request.stream:
            self._answered(request, 200)
            events = self._events(job_request, job, timeout, timing)
            return EventStream(events, headers, done, self.metrics.withdrawn.inc)
        try:
            record = await until_hangup(request.receive, job.result(timeout))
        except ClientGone:
            self.metrics.withdrawn.inc()
            self._answered(request, 499)
            return Response(status_code=499)  # nobody reads it; the name of nginx's code
        except ZkqError as exc:
            raise from_zkq(exc, self.config.retry_after) from None
        except asyncio.CancelledError:
            # Only the server cancels a request: its drain timeout passed on shutdown. Answer
            # that (the job is withdrawn in done()) rather than let it be a bare 500.
            task = asyncio.current_task()
            if task is not None:
                task.uncancel()  # handled: later awaits of this answer are not cancelled
            raise ApiError(503, _SHUTDOWN, "server_error", "shutting_down") from None
        finally:
            done()
        if not record.ok:
            raise from_result(record)
        body = fmt.completion(job_request, job.id, record, int(time.time()))
        self._answered(request, 200)
        return JSONResponse(body, headers=headers)

    async def _submit(
        self,
        request: fmt.JobRequest,
        queue: str,
        priority: str,
        key: ApiKey | None,
        tenant: str | None = None,
    ) -> AsyncJob:
        try:
            if not self.client.connected:
                raise ZkqConnectionError(
                    f"not connected to ZooKeeper at {self.client.settings.hosts}"
                )
            if key is not None and key.max_pending is not None:
                waiting = await self.client.waiting(queue)
                if waiting >= key.max_pending:
                    raise self._rate_limited(
                        f"queue {queue!r} has {waiting} jobs waiting; key {key.name!r} may "
                        f"submit while fewer than {key.max_pending} wait",
                    )
            return await self.client.submit(
                request.prompt, priority=priority, queue=queue, tenant=tenant, **request.job_args()
            )
        except ZkqError as exc:
            raise from_zkq(exc, self.config.retry_after) from None

    async def _events(
        self, request: fmt.JobRequest, job: AsyncJob, timeout: float, timing: Timing
    ) -> AsyncIterator[bytes]:
        """Server-sent events: the pieces, a last chunk with finish_reason, usage if asked,
        then ``[DONE]``; a job that fails mid-way sends an error event instead. The first
        piece's time goes into ``timing`` (and the metrics, whatever the stream's end)."""
        created = int(time.time())
        if request.kind == fmt.CHAT:
            yield _sse(fmt.chunk(request, job.id, created, "", first=True))
        try:
            async for piece in job.stream(timeout):
                if timing.first_sent is None:
                    self.metrics.first_text(timing)
                yield _sse(fmt.chunk(request, job.id, created, piece))
        except ZkqError as exc:
            yield self._stream_error(from_zkq(exc, self.config.retry_after))
            return
        record = job.record
        assert record is not None  # stream() returns only once the job ended
        if not record.ok:
            yield self._stream_error(from_result(record))
            return
        reason = fmt.finish_reason(record, request.max_tokens)
        yield _sse(fmt.chunk(request, job.id, created, finish=reason))
        if request.include_usage:
            yield _sse(fmt.usage_chunk(request, job.id, created, record))
        yield b"data: [DONE]\n\n"

    def _stream_error(self, error: ApiError) -> bytes:
        self.metrics.stream_errors.labels(error.code or error.type).inc()
        return _sse(error.body()) + b"data: [DONE]\n\n"

    # -- who asks, how urgently, how long ----------------------------------------------------

    def _authorize(self, request: Request) -> ApiKey | None:
        """The caller's key; with keys configured, a request without a valid one is a 401."""
        if not self.config.keys:
            return None
        scheme, _, secret = request.headers.get("authorization", "").partition(" ")
        key = self.config.key(secret.strip()) if scheme.lower() == "bearer" else None
        if key is None:
            raise ApiError(401, "invalid or missing API key", AUTH, "invalid_api_key")
        return key

    def _priority(self, request: Request, key: ApiKey | None, in_body: str | None = None) -> str:
        """X-Priority (refused above the key's maximum), else the body's ``priority`` or
        ``service_tier`` (capped at the key's maximum), else the key's default."""
        asked = request.headers.get("x-priority")
        if asked is None and in_body is not None:
            if key is not None and not key.allows(in_body):
                return key.max_priority
            return in_body
        if asked is None:
            return key.priority if key is not None else defaults.PRIORITY
        priority = asked.strip().lower()
        if priority not in defaults.PRIORITIES:
            choices = "|".join(defaults.PRIORITIES)
            raise invalid(f"X-Priority must be {choices}, not {asked!r}", "X-Priority")
        if key is not None and not key.allows(priority):
            message = f"key {key.name!r} may not submit above priority {key.max_priority!r}"
            raise ApiError(403, message, PERMISSION, "priority_not_allowed")
        return priority

    def _tenant(self, request: Request, key: ApiKey | None, user: str | None) -> str | None:
        """The tenant of the request's job: the key's, or where the key allows it the one
        X-Zkq-Tenant names, else OpenAI's ``user`` field. Without keys configured only the
        header names one (``user`` is often an end user's id: a lane each would be too many)."""
        own = key.tenant if key is not None else None
        if key is not None and not key.tenant_override:
            return own
        asked = request.headers.get("x-zkq-tenant")
        if asked is None and key is None:
            return None
        name, field = (asked, "X-Zkq-Tenant") if asked is not None else (user, "user")
        if name is None:
            return own
        try:
            return check_tenant(name.strip())
        except InvalidJob as exc:
            raise invalid(str(exc), field) from None

    def _timeout(self, request: Request) -> float:
        """Seconds to wait for the job: X-Zkq-Timeout, at most the configured timeout."""
        asked = request.headers.get("x-zkq-timeout")
        if asked is None:
            return self.config.timeout
        try:
            value = float(asked)
        except ValueError:
            value = math.nan
        if math.isnan(value) or value <= 0:  # inf is "as long as allowed": the cap below
            raise invalid("X-Zkq-Timeout must be a positive number of seconds", "X-Zkq-Timeout")
        return min(value, self.config.timeout)

    def _hold(self, key: ApiKey | None) -> Callable[[], None]:
        """Count an open request of the key (429 beyond its max_in_flight); returns release."""
        if key is None or key.max_in_flight is None:
            return lambda: None
        held = self._in_flight.get(key.name, 0)
        if held >= key.max_in_flight:
            raise self._rate_limited(
                f"key {key.name!r} has {held} open requests on this gateway (its limit)"
            )
        self._in_flight[key.name] = held + 1
        released = False

        def release() -> None:
            nonlocal released
            if not released:
                released = True
                self._in_flight[key.name] -= 1

        return release

    def _rate_limited(self, message: str) -> ApiError:
        headers = {"Retry-After": str(self.config.retry_after)}
        return ApiError(429, message, RATE_LIMIT, "rate_limited", headers=headers)


async def _json(request: Request) -> Any:
    if int(request.headers.get("content-length") or 0) > MAX_BODY:
        raise ApiError(413, f"the request body is over {MAX_BODY} bytes", "invalid_request_error")
    body = b""
    async for part in request.stream():
        body += part
        if len(body) > MAX_BODY:
            raise ApiError(
                413, f"the request body is over {MAX_BODY} bytes", "invalid_request_error"
            )
    try:
        return json.loads(body)
    except ValueError as exc:
        raise invalid(f"the request body is not JSON: {exc}") from None


# -- the app ---------------------------------------------------------------------------------


def create_app(
    client: AsyncClient,
    config: GatewayConfig,
    metrics: bool = True,
    on_started: Callable[[], None] | None = None,
) -> Starlette:
    """The Starlette app. ``client`` must be started by the caller (see ``lifespan``), or pass
    it unstarted to have the app start and close it with the server. ``on_started`` is called
    once the app is ready to serve (the server's start-up done)."""

    @contextlib.asynccontextmanager
    async def lifespan(app: Starlette) -> AsyncIterator[None]:
        owned = not client.started
        if owned:
            await client.start()
        try:
            app.state.gateway = Gateway(client, config, metrics)
            client.stream_http()  # before the first stream, which would wait for it
            if on_started is not None:
                on_started()
            yield
        finally:
            if owned:
                await client.close()

    def endpoint(name: str) -> Callable[[Request], Awaitable[Response]]:
        async def call(request: Request) -> Response:
            handler: Callable[[Request], Awaitable[Response]] = getattr(
                request.app.state.gateway, name
            )
            return await handler(request)

        return call

    routes = [
        Route("/v1/chat/completions", endpoint("chat"), methods=["POST"]),
        Route("/v1/completions", endpoint("completions"), methods=["POST"]),
        Route("/v1/models", endpoint("models"), methods=["GET"]),
        Route("/v1/models/{model:path}", endpoint("model"), methods=["GET"]),
        Route("/health", endpoint("health"), methods=["GET"]),
        Route("/metrics", endpoint("prometheus"), methods=["GET"]),
    ]
    handlers = {
        ApiError: _api_error,
        ZkqError: _zkq_error,
        HTTPException: _http_error,
        Exception: _unexpected,
    }
    return Starlette(routes=routes, lifespan=lifespan, exception_handlers=handlers)


def _answer(error: ApiError, request: Request) -> Response:
    gateway = getattr(request.app.state, "gateway", None)
    if gateway is not None and request.url.path.startswith("/v1/"):
        gateway.metrics.requests.labels(endpoint_label(request.url.path), str(error.status)).inc()
    # A key with rate limits hears them on every answer, errors too.
    key = getattr(request.state, "key", None)
    limits = gateway.limits.headers(key) if gateway is not None else {}
    headers = {**limits, **error.headers}
    return JSONResponse(error.body(), status_code=error.status, headers=headers)


async def _api_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, ApiError)
    return _answer(exc, request)


async def _zkq_error(request: Request, exc: Exception) -> Response:
    """A library error no endpoint turned into an answer (ZooKeeper away while reading the
    registry...): the same mapping as everywhere, gateway.errors.from_zkq."""
    assert isinstance(exc, ZkqError)
    gateway = getattr(request.app.state, "gateway", None)
    retry_after = gateway.config.retry_after if gateway is not None else 1
    return _answer(from_zkq(exc, retry_after), request)


async def _http_error(request: Request, exc: Exception) -> Response:
    assert isinstance(exc, HTTPException)
    kind = NOT_FOUND if exc.status_code == 404 else "invalid_request_error"
    return _answer(ApiError(exc.status_code, str(exc.detail), kind), request)


async def _unexpected(request: Request, exc: Exception) -> Response:
    """A bug: log the traceback here, answer a plain OpenAI-shaped 500 (never the traceback)."""
    log.error("unexpected error on %s %s", request.method, request.url.path, exc_info=exc)
    error = ApiError(500, f"internal error ({type(exc).__name__})", "server_error", "internal")
    return _answer(error, request)
