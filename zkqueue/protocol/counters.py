"""The fair-share counters' format (docs/PROTOCOL.md, "Fair share"): the queue's ``service``
node and its child ``service/corrections``. The head of the line reads and writes the first
(``zkqueue.dispatch.share``), the workers add to the second, and ``zkq stats`` reads both
(``zkqueue.producer.queues``); this module is the one place that knows what they hold.

``service`` is a JSON object with an entry per tenant::

    {"<tenant>": {"service": V, "cost": C, "next": {"<priority>": [bucket, sequence]}}}

``V`` the tenant's counter in weighted tokens (absent or not a number: 0), ``C`` its recent
estimated cost per job (optional, above 0), ``next`` the claim frontier of its lane in each
priority (optional). ``service/corrections`` is ``{"<tenant>": D}``: what the tenant's jobs
really cost less their estimates, weighted. A tenant's level is ``V + D``, never below 0.
Anything else in either node is ignored: a bad value must never stop a worker.
"""

from __future__ import annotations

import json
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

from zkqueue.protocol.layout import lane, lane_parts
from zkqueue.protocol.result import json_number

#: The child of the counters node that holds the workers' corrections.
CORRECTIONS = "corrections"


@dataclass(frozen=True)
class Counter:
    """One tenant's entry in the counters."""

    #: Weighted tokens served (the corrections not included).
    service: float = 0.0
    #: Recent estimated cost per job in tokens (None: unknown).
    cost: float | None = None
    #: The claim frontier of the tenant's lane in each priority: (bucket, sequence mod 2^32)
    #: of the last entry claimed from it.
    next: Mapping[str, tuple[int, int]] = field(default_factory=dict)

    def lanes(self, tenant: str) -> dict[str, tuple[int, int]]:
        """The frontiers by lane path (``zkqueue.protocol.layout.lane``)."""
        return {lane(priority, tenant): order for priority, order in self.next.items()}


def parse_counters(data: bytes | None) -> dict[str, Counter]:
    """The counters node's data, by tenant (empty for no data or data that is no object)."""
    found = _object(data)
    return {tenant: _counter(raw) for tenant, raw in found.items()}


def encode_counters(counters: Mapping[str, Counter]) -> bytes:
    """The counters node's data, tenants in name order."""
    out: dict[str, dict[str, Any]] = {}
    for tenant, c in sorted(counters.items()):
        entry: dict[str, Any] = {"service": round(max(0.0, c.service), 3)}
        entry["cost"] = round(c.cost or 0.0, 1)
        if c.next:
            entry["next"] = {p: list(order) for p, order in sorted(c.next.items())}
        out[tenant] = entry
    return json.dumps(out, separators=(",", ":")).encode()


def frontiers_by_tenant(fronts: Mapping[str, tuple[int, int]]) -> dict[str, dict[str, Any]]:
    """Lane frontiers (by lane path) as each tenant's ``next`` (by priority)."""
    out: dict[str, dict[str, Any]] = {}
    for path, order in fronts.items():
        priority, tenant = lane_parts(path)
        out.setdefault(tenant, {})[priority] = order
    return out


def parse_corrections(data: bytes | None) -> dict[str, float]:
    """``service/corrections``: each tenant's correction (entries that are no number: none)."""
    return {t: n for t, v in _object(data).items() if (n := json_number(v)) is not None}


def encode_corrections(corrections: Mapping[str, float]) -> bytes:
    """``service/corrections``' data, tenants in name order."""
    return json.dumps({t: round(v, 3) for t, v in corrections.items()}, sort_keys=True).encode()


def add_corrections(data: bytes | None, delta: Mapping[str, float]) -> bytes:
    """``service/corrections`` with ``delta`` added (entries that are no number start at 0)."""
    merged = parse_corrections(data)
    for tenant, value in delta.items():
        merged[tenant] = merged.get(tenant, 0.0) + value
    return encode_corrections(merged)


def level(counter: Counter | None, correction: float | None) -> float:
    """A tenant's level: its counter plus its correction, never below 0."""
    return max(0.0, (counter.service if counter else 0.0) + (correction or 0.0))


def _object(data: bytes | None) -> dict[str, Any]:
    try:
        found = json.loads(data or b"{}")
    except (ValueError, UnicodeDecodeError):
        return {}
    return {str(k): v for k, v in found.items()} if isinstance(found, dict) else {}


def _counter(raw: Any) -> Counter:
    if not isinstance(raw, dict):
        return Counter()
    value, cost = json_number(raw.get("service")), json_number(raw.get("cost"))
    fronts = {}
    found = raw.get("next")
    for priority, order in found.items() if isinstance(found, dict) else ():
        if (
            isinstance(order, list)
            and len(order) == 2
            and all(isinstance(n, int) and not isinstance(n, bool) and n >= 0 for n in order)
        ):
            fronts[str(priority)] = (order[0], order[1])
    return Counter(
        value if value is not None and value >= 0 else 0.0,
        cost if cost is not None and cost > 0 else None,
        fronts,
    )
