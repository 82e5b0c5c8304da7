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
from typing import Any, TextIO

from kazoo.exceptions import NoNodeError
from rich.console import Console
from rich.live import Live

from zkqueue.operations.exporter import READ_TIMEOUT, read_cluster
from zkqueue.operations.topview import RATE_WINDOW, ResultRow, TopSnapshot, render
from zkqueue.plumbing.deadline import READ_ERRORS, Deadline
from zkqueue.producer.client import Client
from zkqueue.protocol.layout import parse_index_name
from zkqueue.protocol.result import Result

#: Results listed under "recent".
RECENT = 10
#: Result nodes stat-ed per refresh at most.
MAX_EXAMINED = 500
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
    lists = {q: newest_results(zk, layout, q, deadline) for q in queues}
    known = previous.seen if previous else {}
    fresh: list[tuple[str, str]] = []
    for queue, names in lists.items():
        snap.seen[queue] = names
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


def newest_results(zk: Any, layout: Any, queue: str, deadline: Deadline) -> set[str]:
    """Ids of the results written in the newest ticks of the expiry index (never a listing of
    every result): the last two ticks, about the last 20 seconds."""
    ticks = sorted(deadline.children(zk.get_children_async(layout.expiry(queue))))[-2:]
    calls = [zk.get_children_async(layout.expiry_bucket(queue, t)) for t in ticks]
    return {p[0] for call in calls for n in deadline.children(call) if (p := parse_index_name(n))}


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
        console.print(render(snapshot(client), hint=None, size=(console.width, 10_000)))
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
            size = (console.width, console.height) if console.is_terminal else None
            live.update(render(snap, baseline, note=note, size=size), refresh=True)
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
