"""Model pools: which queue a model name means, and whether a live worker serves it.

The registry (``<root>/workers``) and the queue names are read at most once per ``TTL`` seconds
by any number of concurrent requests (one read in flight, shared). A model that looks unserved is
read again before the gateway answers 503, so a worker that just started is never refused.
"""

from __future__ import annotations

import asyncio
import time
from dataclasses import dataclass, field
from pathlib import PurePath
from typing import Any

from gateway.config import GatewayConfig
from gateway.errors import NOT_FOUND, UNAVAILABLE, ApiError
from zkqueue.errors import InvalidJob
from zkqueue.producer.aio import AsyncClient
from zkqueue.protocol.layout import check_queue

#: Seconds a read of the registry is trusted.
TTL = 1.0
#: Worker states that take no new jobs.
_LEAVING = ("draining", "stopped")


@dataclass
class Snapshot:
    """Live workers per queue, and every queue that exists, as read at ``read_at``."""

    workers: dict[str, list[dict[str, Any]]] = field(default_factory=dict)
    queues: set[str] = field(default_factory=set)
    read_at: float = 0.0


class Pools:
    """Resolves ``model`` to a queue and checks it is served."""

    def __init__(self, client: AsyncClient, config: GatewayConfig) -> None:
        self.client = client
        self.config = config
        self._snapshot = Snapshot()
        self._reading: asyncio.Future[Snapshot] | None = None

    async def snapshot(self, fresh: bool = False) -> Snapshot:
        if not fresh and time.monotonic() - self._snapshot.read_at < TTL:
            return self._snapshot
        if self._reading is None or self._reading.done():
            self._reading = asyncio.ensure_future(self._read())
        return await asyncio.shield(self._reading)

    async def _read(self) -> Snapshot:
        records, queues = await asyncio.gather(self.client.workers(), self.client.queue_names())
        live: dict[str, list[dict[str, Any]]] = {}
        for record in records:
            if record.get("state") not in _LEAVING and isinstance(record.get("queue"), str):
                live.setdefault(record["queue"], []).append(record)
        self._snapshot = Snapshot(live, set(queues), time.monotonic())
        return self._snapshot

    async def queue_for(self, model: str) -> str:
        """The model's queue; 404 for a model nobody knows, 503 for one no worker serves."""
        queue = self.config.queue_for(model)
        try:
            check_queue(queue)
        except InvalidJob:
            raise _unknown(model) from None
        snap = await self.snapshot()
        if queue not in snap.workers:
            snap = await self.snapshot(fresh=True)
        if queue in snap.workers:
            return queue
        if model in self.config.models or queue in snap.queues:
            raise ApiError(
                503,
                f"no worker serves model {model!r} (queue {queue!r}) right now",
                UNAVAILABLE,
                "no_worker",
            )
        raise _unknown(model)

    async def models(self) -> list[dict[str, Any]]:
        """The models registered workers serve: each config name mapped onto a served queue,
        and each served queue that no config name maps onto, by its own name."""
        snap = await self.snapshot()
        named = {q for q in self.config.models.values()}
        ids = [(m, q) for m, q in self.config.models.items() if q in snap.workers]
        ids += [(q, q) for q in sorted(snap.workers) if q not in named]
        return [_model(m, q, snap.workers[q]) for m, q in ids]


def _model(model: str, queue: str, workers: list[dict[str, Any]]) -> dict[str, Any]:
    info = [w.get("runner_info") or {} for w in workers]
    # A worker reports the model's directory: API clients see its name, never a server path.
    served = sorted({PurePath(str(i["model"])).name for i in info if i.get("model")})
    return {
        "id": model,
        "object": "model",
        "created": int(min(float(w.get("started_at") or 0) for w in workers)),
        "owned_by": "zkq",
        "queue": queue,
        "workers": len(workers),
        "runners": served or sorted({str(w.get("runner")) for w in workers}),
    }


def _unknown(model: str) -> ApiError:
    return ApiError(
        404, f"the model {model!r} does not exist", NOT_FOUND, "model_not_found", "model"
    )
