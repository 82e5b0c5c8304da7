"""Server-sent events for ``zkq serve``: an event-stream answer that notices a client hanging up
while no event is due, and waiting on work unless the client disconnects first (a disconnect
cancels the work, which withdraws its job)."""

from __future__ import annotations

import asyncio
import contextlib
import json
from collections.abc import AsyncIterator, Awaitable, Callable
from typing import Any, TypeVar

from starlette.responses import Response
from starlette.types import Receive, Scope, Send

T = TypeVar("T")


class ClientGone(Exception):
    """The HTTP client disconnected before its answer was ready."""


class EventStream(Response):
    """A ``text/event-stream`` answer that stops (and withdraws its job, via ``done``) as soon
    as the client disconnects, even while no event is due."""

    media_type = "text/event-stream"

    def __init__(
        self,
        events: AsyncIterator[bytes],
        headers: dict[str, str],
        done: Callable[[], None],
        gone: Callable[[], None],
    ) -> None:
        super().__init__(headers={**headers, "Cache-Control": "no-cache"})
        # The length is unknown: the server sends the body chunked.
        self.raw_headers = [(k, v) for k, v in self.raw_headers if k != b"content-length"]
        self.events = events
        self.done = done
        self.gone = gone

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        await send({"type": "http.response.start", "status": 200, "headers": self.raw_headers})
        try:
            await until_hangup(receive, self._pump(send))
            await send({"type": "http.response.body", "body": b"", "more_body": False})
        except ClientGone:
            self.gone()
        finally:
            self.done()

    async def _pump(self, send: Send) -> None:
        async for event in self.events:
            await send({"type": "http.response.body", "body": event, "more_body": True})


async def until_hangup(receive: Receive, work: Awaitable[T]) -> T:
    """Await ``work`` unless the client disconnects first: then cancel it (an AsyncJob's wait
    withdraws its job when cancelled) and raise ClientGone."""
    task = asyncio.ensure_future(work)
    hangup = asyncio.ensure_future(_hangup(receive))
    try:
        await asyncio.wait({task, hangup}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        hangup.cancel()
        if not task.done():
            task.cancel()
            with contextlib.suppress(asyncio.CancelledError, Exception):
                await task
    if task.cancelled():
        raise ClientGone()
    return task.result()


async def _hangup(receive: Receive) -> None:
    while (await receive())["type"] != "http.disconnect":
        pass


def sse(data: dict[str, Any]) -> bytes:
    return (
        b"data: " + json.dumps(data, ensure_ascii=False, separators=(",", ":")).encode() + b"\n\n"
    )
