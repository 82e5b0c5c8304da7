"""``zkq top``: a live terminal view of the queues, the workers and the latest results.

Three parts, so each can be tested alone: ``snapshot`` reads ZooKeeper (bounded: pipelined reads
under one deadline, at most ``max_examined`` result nodes stat-ed per refresh), ``render`` turns
snapshots into a rich renderable and reads nothing, and ``run_top`` refreshes a rich Live display
until ``q`` or Ctrl-C (or prints one frame with ``once``).

Finding the newest results needs each result node's mtime, and result names (job ids) carry no
order. So a refresh stats only the result nodes it has not seen before: the first frame examines
up to ``max_examined`` of them (on a root holding more, "recent" is the newest of those), later
frames examine what arrived since. Ages and "seconds since heartbeat" use this host's clock.
"""

from __future__ import annotations

import contextlib
import os
import select
import sys
import termios
import time
import tty
from collections import deque
from dataclasses import dataclass, field
from typing import Any, TextIO

from kazoo.exceptions import NoNodeError
from rich.console import Console, Group, RenderableType
from rich.live import Live
from rich.table import Table
from rich.text import Text

from zkqueue import defaults
from zkqueue.client import Client
from zkqueue.exporter import READ_ERRORS, READ_TIMEOUT, ClusterState, Deadline, read_cluster
from zkqueue.result import Result

#: Results listed under "recent".
RECENT = 10
#: Result nodes stat-ed per refresh at most.
MAX_EXAMINED = 500
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


# -- reading -------------------------------------------------------------------------------------


def snapshot(
    client: Client,
    previous: TopSnapshot | None = None,
    *,
    recent: int = RECENT,
    max_examined: int = MAX_EXAMINED,
    timeout: float = READ_TIMEOUT,
) -> TopSnapshot:
    """Read the queues, the workers and the newest results. Never raises for ZooKeeper trouble:
    ``errors`` says what was not read. Pass the previous snapshot so that only new result nodes
    are examined."""
    cluster = read_cluster(client, timeout)
    snap = TopSnapshot(client.settings.hosts, client.layout.root or "/", cluster, [])
    if cluster.errors and not cluster.queues:
        return snap
    try:
        _read_recent(client, snap, previous, recent, max_examined, Deadline(timeout))
    except READ_ERRORS as exc:
        cluster.errors.append(f"results: {exc!r}")
    return snap


def _read_recent(
    client: Client,
    snap: TopSnapshot,
    previous: TopSnapshot | None,
    limit: int,
    cap: int,
    deadline: Deadline,
) -> None:
    """Fill ``snap.recent``: list each results directory, stat the names not seen before
    (at most ``cap``), and read the records of the ``limit`` newest not already known."""
    zk, layout = client.zk, client.layout
    queues = [q.name for q in snap.cluster.queues]
    lists = {q: zk.get_children_async(layout.results(q)) for q in queues}
    known = previous.seen if previous else {}
    fresh: list[tuple[str, str]] = []
    for queue, call in lists.items():
        snap.seen[queue] = set(deadline.children(call))
        fresh.extend((queue, n) for n in snap.seen[queue] - known.get(queue, set()))
    fresh = fresh[:cap]
    snap.examined = len(fresh)
    stats = [zk.exists_async(layout.result(q, n)) for q, n in fresh]
    mtimes = {
        key: stat.mtime / 1000
        for key, call in zip(fresh, stats, strict=True)
        if (stat := deadline.get(call)) is not None
    }
    kept = [r for r in (previous.recent if previous else []) if r.id in snap.seen.get(r.queue, ())]
    candidates = {(r.queue, r.id): r.finished for r in kept} | mtimes
    newest = sorted(candidates, key=lambda k: candidates[k], reverse=True)[:limit]
    rows = {(r.queue, r.id): r for r in kept}
    snap.recent = _read_rows(client, newest, rows, candidates, deadline)


def _read_rows(
    client: Client,
    keys: list[tuple[str, str]],
    known: dict[tuple[str, str], ResultRow],
    finished: dict[tuple[str, str], float],
    deadline: Deadline,
) -> list[ResultRow]:
    """Rows for ``keys``, newest first, reading the records not already known."""
    zk, layout = client.zk, client.layout
    calls = {k: zk.get_async(layout.result(*k)) for k in keys if k not in known}
    rows = []
    for key in keys:
        if key in known:
            rows.append(known[key])
            continue
        try:
            data, _ = deadline.get(calls[key])
            record = Result.from_bytes(data)
        except NoNodeError:
            continue  # read and removed by its caller meanwhile
        except (ValueError, TypeError):
            continue  # not a result record: nothing to show
        rows.append(_row(record, key[0], finished[key]))
    return rows


def _row(record: Result, queue: str, finished: float) -> ResultRow:
    run = None
    if record.started_at is not None and record.finished_at is not None:
        run = max(0.0, record.finished_at - record.started_at)
    return ResultRow(record.id, queue, record.priority, record.status, record.worker, run, finished)


# -- figures -------------------------------------------------------------------------------------


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
) -> RenderableType:
    """The whole frame: a header, the queues, the workers and the recent results. Pure: it reads
    only the snapshots (``previous`` for throughput) and this host's clock."""
    now = time.time()
    return Group(
        _header(snap, note, hint),
        _queues_table(snap, throughput(snap, previous), now),
        _workers_table(snap, now),
        _results_table(snap, now),
    )


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


def _queues_table(snap: TopSnapshot, rates: dict[str, float | None], now: float) -> Table:
    table = Table(title="queues", title_justify="left", expand=False)
    table.add_column("queue")
    for priority in defaults.PRIORITIES:
        table.add_column(priority, justify="right")
    for name in ("waiting", "running", "idle", "dead", "oldest waiting", "jobs/s"):
        table.add_column(name, justify="right")
    for q in snap.cluster.queues:
        ages = {p: q.oldest_age(p, now) for p in defaults.PRIORITIES}
        oldest = max(((a, p) for p, a in ages.items() if a is not None), default=None)
        rate = rates.get(q.name)
        table.add_row(
            q.name,
            *(str(q.depth[p]) for p in defaults.PRIORITIES),
            str(q.total_waiting),
            str(q.running),
            str(q.idle_workers),
            Text(str(q.dead), style="red" if q.dead else ""),
            f"{format_age(oldest[0])} ({oldest[1]})" if oldest else "-",
            "-" if rate is None else f"{rate:.2f}",
        )
    return table


def _workers_table(snap: TopSnapshot, now: float) -> Table:
    table = Table(title="workers", title_justify="left")
    for name in ("worker", "queue", "model", "device", "state", "slots", "kv cache"):
        table.add_column(name)
    table.add_column("running")
    table.add_column("heartbeat", justify="right")
    workers = sorted(snap.cluster.workers, key=lambda w: (str(w.get("queue")), str(w.get("id"))))
    for w in workers[:MAX_WORKER_ROWS]:
        info = w.get("runner_info") or {}
        beat = now - float(w.get("updated_at") or now)
        table.add_row(
            str(w.get("id")),
            str(w.get("queue")),
            str(info.get("model") or w.get("runner") or "-"),
            str(info.get("device") or "-"),
            Text(str(w.get("state")), style="yellow" if w.get("state") == "draining" else ""),
            f"{w.get('slots_busy', 0)}/{w.get('slots_max', 0)}",
            memory_bar(w.get("memory")),
            _job_ids(w.get("running") or []),
            Text(f"{format_age(beat)} ago", style="red" if beat > 10 else ""),
        )
    if len(workers) > MAX_WORKER_ROWS:
        table.caption = f"{len(workers) - MAX_WORKER_ROWS} more worker(s) not shown"
    return table


def _results_table(snap: TopSnapshot, now: float) -> Table:
    table = Table(title="recent results", title_justify="left")
    for name in ("finished", "id", "queue", "priority", "status", "worker", "run time"):
        table.add_column(name)
    for r in snap.recent:
        table.add_row(
            f"{format_age(now - r.finished)} ago",
            r.id,
            r.queue,
            r.priority,
            Text(r.status, style=_STATUS_STYLE.get(r.status, "yellow")),
            r.worker or "-",
            "-" if r.run_s is None else format_age(r.run_s),
        )
    return table


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


def run_top(
    client: Client,
    interval: float = 2.0,
    console: Console | None = None,
    once: bool = False,
    keys: TextIO | None = None,
) -> None:
    """Show the cluster, refreshed every ``interval`` seconds, until ``q`` or Ctrl-C. With
    ``once``, print one frame and return (for pipes and scripts). Keys are read from ``keys``
    (stdin by default) when it is a terminal."""
    console = console or _default_console()
    if once:
        console.print(render(snapshot(client), hint=None))
        return
    with contextlib.suppress(KeyboardInterrupt), _Keys(keys or sys.stdin) as reader:
        _live(client, interval, console, reader)


def _default_console() -> Console:
    """The terminal's console; piped output (``--once > file``) gets 160 columns, not 80,
    unless COLUMNS says otherwise."""
    wide = not sys.stdout.isatty() and "COLUMNS" not in os.environ
    return Console(width=160 if wide else None)


def _live(client: Client, interval: float, console: Console, reader: _Keys) -> None:
    history: deque[TopSnapshot] = deque()
    shown: TopSnapshot | None = None
    with Live(console=console, screen=console.is_terminal, auto_refresh=False) as live:
        while True:
            snap = snapshot(client, shown)
            note = None
            if not snap.read_ok and shown is not None:
                reason = snap.errors[0] if snap.errors else "no answer"
                snap, note = shown, f"ZooKeeper unreachable ({reason}): showing the last frame"
            shown = snap
            history.append(snap)
            while history[0].monotonic < snap.monotonic - RATE_WINDOW:
                history.popleft()
            baseline = history[0] if history[0] is not snap else None
            live.update(render(snap, baseline, note=note), refresh=True)
            if reader.quit_within(interval):
                return


class _Keys:
    """Single keypresses from a terminal (cbreak mode: no Enter needed, Ctrl-C still raises
    KeyboardInterrupt); the terminal's mode is restored on exit. Not a terminal: no keys."""

    def __init__(self, stream: TextIO) -> None:
        self.fd = stream.fileno() if _is_tty(stream) else None
        self._saved: list[Any] | None = None

    def __enter__(self) -> _Keys:
        if self.fd is not None:
            self._saved = termios.tcgetattr(self.fd)
            tty.setcbreak(self.fd)
        return self

    def __exit__(self, *exc: object) -> None:
        if self.fd is not None and self._saved is not None:
            termios.tcsetattr(self.fd, termios.TCSADRAIN, self._saved)

    def quit_within(self, timeout: float) -> bool:
        """Wait up to ``timeout`` seconds; True if ``q`` was pressed, False on timeout or
        another key (any key refreshes at once)."""
        if self.fd is None:
            time.sleep(timeout)
            return False
        ready, _, _ = select.select([self.fd], [], [], timeout)
        if not ready:
            return False
        return any(c in "qQ" for c in os.read(self.fd, 32).decode(errors="ignore"))


def _is_tty(stream: TextIO) -> bool:
    try:
        return stream.isatty()
    except (AttributeError, ValueError):
        return False
