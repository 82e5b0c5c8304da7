"""How ``zkq top`` draws a snapshot (``zkqueue.operations.top`` reads them): the queues, workers and
recent results tables, throughput between frames, the KV-cache bar. Reads nothing from ZooKeeper."""

from __future__ import annotations

import time
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from rich.console import Group, RenderableType
from rich.table import Table
from rich.text import Text

from zkqueue import defaults
from zkqueue.protocol.layout import DEFAULT_TENANT

if TYPE_CHECKING:
    from zkqueue.operations.exporter import ClusterState, QueueState

#: Worker rows shown at most.
MAX_WORKER_ROWS = 100
#: Throughput compares with a frame about this many seconds old: worker counters move only at
#: heartbeats (2 s), so comparing with the frame just before would swing between 0 and double.
RATE_WINDOW = 10.0
_BAR = 12
_STATUS_STYLE = {"succeeded": "green", "failed": "red", "dead": "red", "rejected": "red"}


@dataclass(frozen=True)
class ResultRow:
    """One finished job, as listed under "recent"."""

    id: str
    queue: str
    priority: str
    status: str
    worker: str | None
    run_s: float | None
    #: The result node's mtime, unix seconds (ZooKeeper's clock).
    finished: float


@dataclass
class TopSnapshot:
    """What one refresh read."""

    hosts: str
    root: str
    cluster: ClusterState
    recent: list[ResultRow]
    #: Result names known per queue, so the next refresh only examines new ones.
    seen: dict[str, set[str]] = field(default_factory=dict)
    #: Result nodes examined by this refresh.
    examined: int = 0
    taken_at: float = field(default_factory=time.time)
    monotonic: float = field(default_factory=time.monotonic)

    @property
    def errors(self) -> list[str]:
        return self.cluster.errors

    @property
    def read_ok(self) -> bool:
        """Whether anything at all was read (False while ZooKeeper is unreachable)."""
        return not self.errors or bool(self.cluster.queues)


def throughput(snap: TopSnapshot, previous: TopSnapshot | None) -> dict[str, float | None]:
    """Jobs finished per second per queue between two snapshots: the increase of the workers'
    ``completed`` counters (workers present in both) over the seconds between them. None when
    there is no earlier snapshot."""
    elapsed = snap.monotonic - previous.monotonic if previous else 0.0
    queues = [q.name for q in snap.cluster.queues]
    if previous is None or elapsed <= 0:
        return dict.fromkeys(queues)
    before = {w.get("id"): _completed(w) for w in previous.cluster.workers}
    done = dict.fromkeys(queues, 0)
    for worker in snap.cluster.workers:
        if worker.get("id") in before:
            queue = str(worker.get("queue"))
            done[queue] = done.get(queue, 0) + max(0, _completed(worker) - before[worker["id"]])
    return {q: n / elapsed for q, n in done.items()}


def _completed(worker: dict[str, Any]) -> int:
    return int(worker.get("completed", 0) or 0)


# -- rendering -----------------------------------------------------------------------------------


def render(
    snap: TopSnapshot,
    previous: TopSnapshot | None = None,
    *,
    note: str | None = None,
    hint: str | None = "q quits",
    size: tuple[int, int] | None = None,
) -> RenderableType:
    """The whole frame: a header, the queues, the workers and the recent results. Pure: it reads
    only the snapshots (``previous`` for throughput) and this host's clock. With ``size``
    (columns, lines) the frame fits it: the least useful columns drop first, then rows."""
    now = time.time()
    width, height = size or (10_000, 10_000)
    header = _header(snap, note, hint)
    header.no_wrap, header.overflow = True, "ellipsis"
    tables = [
        _queues_table(snap, throughput(snap, previous), now),
        _workers_table(snap, now),
        _results_table(snap, now),
    ]
    spare = height - len(header.plain.splitlines()) - len(tables) * _TABLE_LINES
    shown = _share([len(rows) for _, _, rows in tables], spare)
    return Group(
        header,
        *(
            _fit(title, columns, rows[:n], width, len(rows) - n)
            for (title, columns, rows), n in zip(tables, shown, strict=True)
        ),
    )


def _share(counts: list[int], lines: int) -> list[int]:
    """Rows shown per table within ``lines``: one at a time to each table in turn, then a line
    for the "N more" caption of each table cut short (taken from the longest)."""
    shown = [0] * len(counts)
    while lines > 0 and any(s < c for s, c in zip(shown, counts, strict=True)):
        for i, count in enumerate(counts):
            if lines > 0 and shown[i] < count:
                shown[i], lines = shown[i] + 1, lines - 1
    for i, count in enumerate(counts):
        if shown[i] < count:
            if lines > 0:
                lines -= 1
            else:
                longest = max(range(len(shown)), key=lambda j: shown[j])
                shown[longest] = max(shown[longest] - 1, 0)
    return shown


#: Lines a table takes besides its rows: title, borders, header and its rule.
_TABLE_LINES = 5
#: A column: name, rank (the highest rank drops first when the frame is too narrow), justify.
Column = tuple[str, int, str]
Row = list[Any]


def _fit(title: str, columns: list[Column], rows: list[Row], width: int, hidden: int) -> Table:
    """A table of the columns that fit ``width``, dropping the highest-ranked first."""
    keep = list(range(len(columns)))

    def need(indexes: list[int]) -> int:
        return 1 + sum(3 + _width(columns[i][0], [r[i] for r in rows]) for i in indexes)

    while len(keep) > 1 and need(keep) > width:
        keep.remove(max(keep, key=lambda i: (columns[i][1], i)))
    table = Table(title=title, title_justify="left")
    for i in keep:
        table.add_column(columns[i][0], justify=columns[i][2], no_wrap=True)  # type: ignore[arg-type]
    for row in rows:
        table.add_row(*(row[i] for i in keep))
    if hidden:
        table.caption = f"{hidden} more not shown"
    return table


def _width(name: str, cells: list[Any]) -> int:
    return max([len(name), *(len(c.plain if isinstance(c, Text) else str(c)) for c in cells)])


def _header(snap: TopSnapshot, note: str | None, hint: str | None) -> Text:
    clock = time.strftime("%H:%M:%S", time.localtime(snap.taken_at))
    text = Text.assemble(
        ("zkq top", "bold"),
        f"  {snap.hosts} {snap.root}  {clock}  ",
        f"{len(snap.cluster.queues)} queue(s), {len(snap.cluster.workers)} worker(s)  ",
        (hint or "", "dim"),
    )
    for line in ([note] if note else []) + snap.errors[:3]:
        text.append(f"\n{line}", style="bold red")
    return text


def _queues_table(
    snap: TopSnapshot, rates: dict[str, float | None], now: float
) -> tuple[str, list[Column], list[Row]]:
    columns: list[Column] = [("queue", 0, "left")]
    columns += [(p, 4, "right") for p in defaults.PRIORITIES]
    columns += [
        ("waiting", 0, "right"),
        ("running", 0, "right"),
        ("idle", 3, "right"),
        ("dead", 2, "right"),
        ("oldest waiting", 1, "right"),
    ]
    # A rate needs two frames: a single one (--once, the first frame) shows no such column.
    rated = any(rates.get(q.name) is not None for q in snap.cluster.queues)
    columns += [("jobs/s", 1, "right")] if rated else []
    tenanted = any(_tenants_waiting(q) for q in snap.cluster.queues)
    columns += [("waiting by tenant", 2, "left")] if tenanted else []
    rows = []
    for q in snap.cluster.queues:
        ages = {p: q.oldest_age(p, now) for p in defaults.PRIORITIES}
        oldest = max(((a, p) for p, a in ages.items() if a is not None), default=None)
        rate = rates.get(q.name)
        cap = f"/{q.max_running}" if q.max_running else ""
        rows.append(
            [
                q.name,
                *(str(q.depth[p]) for p in defaults.PRIORITIES),
                str(q.total_waiting),
                f"{q.running}{cap}",
                str(q.idle_workers),
                Text(str(q.dead), style="red" if q.dead else ""),
                f"{format_age(oldest[0])} ({oldest[1]})" if oldest else "-",
                *(["-" if rate is None else f"{rate:.2f}"] if rated else []),
                *([_tenants_waiting(q) or "-"] if tenanted else []),
            ]
        )
    return "queues (running/cap)", columns, rows


def _tenants_waiting(q: QueueState) -> str:
    """The tenants with jobs waiting, most first (three at most, then how many more); empty
    while only the default tenant has any."""
    waiting: dict[str, int] = {}
    for (_, tenant), n in q.tenants.items():
        waiting[tenant] = waiting.get(tenant, 0) + n
    shown = sorted(((n, t) for t, n in waiting.items() if n), reverse=True)
    if not shown or {t for _, t in shown} == {DEFAULT_TENANT}:
        return ""
    text = ", ".join(f"{t} {n}" for n, t in shown[:3])
    return text + (f", +{len(shown) - 3}" if len(shown) > 3 else "")


def _workers_table(snap: TopSnapshot, now: float) -> tuple[str, list[Column], list[Row]]:
    columns: list[Column] = [
        ("worker", 0, "left"),
        ("queue", 1, "left"),
        ("model", 3, "left"),
        ("device", 4, "left"),
        ("state", 1, "left"),
        ("slots", 0, "left"),
        ("kv cache", 5, "left"),
        ("running", 2, "left"),
        ("changed", 2, "right"),
    ]
    workers = sorted(snap.cluster.workers, key=lambda w: (str(w.get("queue")), str(w.get("id"))))
    rows = []
    for w in workers[:MAX_WORKER_ROWS]:
        info = w.get("runner_info") or {}
        beat = now - float(w.get("updated_at") or now)
        rows.append(
            [
                str(w.get("id")),
                str(w.get("queue")),
                str(info.get("model") or w.get("runner") or "-"),
                str(info.get("device") or "-"),
                _worker_state(w),
                f"{w.get('slots_busy', 0)}/{w.get('slots_max', 0)}",
                memory_bar(w.get("memory")),
                _job_ids(w.get("running") or []),
                f"{format_age(beat)} ago",
            ]
        )
    return "workers", columns, rows


def _worker_state(w: dict[str, Any]) -> Text:
    """The worker's state; for one in front of an inference server, its gate too (an engine
    that is down shows red, a busy one yellow)."""
    state = str(w.get("state"))
    gate = (w.get("engine") or {}).get("gate")
    if gate is not None and gate != "open":
        return Text(f"{state}, engine {gate}", style="red" if gate == "down" else "yellow")
    return Text(state, style="yellow" if state == "draining" else "")


def _results_table(snap: TopSnapshot, now: float) -> tuple[str, list[Column], list[Row]]:
    columns: list[Column] = [
        ("finished", 1, "left"),
        ("id", 0, "left"),
        ("queue", 2, "left"),
        ("priority", 4, "left"),
        ("status", 0, "left"),
        ("worker", 3, "left"),
        ("run time", 2, "left"),
    ]
    rows = [
        [
            f"{format_age(now - r.finished)} ago",
            r.id,
            r.queue,
            r.priority,
            Text(r.status, style=_STATUS_STYLE.get(r.status, "yellow")),
            r.worker or "-",
            "-" if r.run_s is None else format_age(r.run_s),
        ]
        for r in snap.recent
    ]
    return "recent results", columns, rows


def memory_bar(cache: dict[str, Any] | None, width: int = _BAR) -> Text:
    """The KV-cache pages promised to jobs in flight as a bar with figures:
    ``████░░░░ 48/96 pages``; ``-`` when the worker has no cache (echo)."""
    if not cache or not cache.get("pages_total"):
        return Text("-")
    total = int(cache["pages_total"])
    used = min(total, max(0, int(cache.get("pages_promised") or 0)))
    filled = round(width * used / total)
    share = used / total
    style = "red" if share > 0.9 else "yellow" if share > 0.7 else "green"
    return Text.assemble(
        ("█" * filled, style), ("░" * (width - filled), "dim"), f" {used}/{total} pages"
    )


def _job_ids(ids: list[str], shown: int = 3) -> str:
    text = ",".join(ids[:shown]) or "-"
    return f"{text} +{len(ids) - shown}" if len(ids) > shown else text


def format_age(seconds: float) -> str:
    """A duration for people: ``0.4s``, ``42s``, ``3m05s``, ``2h10m``."""
    seconds = max(0.0, seconds)
    if seconds < 10:
        return f"{seconds:.1f}s"
    if seconds < 60:
        return f"{seconds:.0f}s"
    if seconds < 3600:
        return f"{int(seconds // 60)}m{int(seconds % 60):02d}s"
    return f"{int(seconds // 3600)}h{int(seconds % 3600 // 60):02d}m"


# -- the live view -------------------------------------------------------------------------------
