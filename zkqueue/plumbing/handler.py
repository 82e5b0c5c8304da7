"""kazoo's threading handler with a cheaper ``select``.

kazoo's connection thread calls ``handler.select`` at least twice a request (to send it, to read
its reply), and kazoo's own builds, registers and closes an epoll object on every call: about a
third of that thread's CPU. This one keeps a ``poll`` object per set of sockets asked about (a
connection asks about three: its socket to read, to write, and with kazoo's wake-up pipe), so a
call is one system call. Where ``select.poll`` does not exist (Windows) it is kazoo's handler.
"""

from __future__ import annotations

import math
import select
import threading
from typing import Any

from kazoo.handlers.threading import SequentialThreadingHandler
from kazoo.handlers.utils import fileobj_to_fd

_POLL = hasattr(select, "poll")
#: select(2)'s readers wait for POLLIN only (POLLPRI, urgent data, is its exceptional set).
_READ = getattr(select, "POLLIN", 1)
_WRITE = getattr(select, "POLLOUT", 4)
#: Errors and hang-ups wake readers and writers alike: their call fails and kazoo reconnects.
_BROKEN = sum(getattr(select, n, 0) for n in ("POLLERR", "POLLHUP", "POLLNVAL"))
#: Poll objects a thread keeps at most: one handler serves one connection (three sets at a
#: time); a reconnect brings new sockets, and the old sets go at the next overflow.
_KEPT = 4


class PollingHandler(SequentialThreadingHandler):
    name = "zkq_polling_threading"

    def __init__(self) -> None:
        super().__init__()
        # A poll object refuses concurrent use, so each thread keeps its own (kazoo's
        # connection thread is the one that asks, thousands of times a second): no lock.
        self._local = threading.local()

    @property
    def _polls(self) -> dict[tuple[tuple[Any, ...], tuple[Any, ...]], _Poll]:
        """This thread's poll objects, by the (readers, writers) asked for."""
        try:
            polls: dict[tuple[tuple[Any, ...], tuple[Any, ...]], _Poll] = self._local.polls
        except AttributeError:
            polls = self._local.polls = {}
        return polls

    def select(
        self, rlist: list[Any], wlist: list[Any], xlist: list[Any], timeout: float | None = None
    ) -> tuple[list[Any], list[Any], list[Any]]:
        """select(2)'s contract, as kazoo's connection uses it (no exceptional set)."""
        if not _POLL or xlist:
            return super().select(rlist, wlist, xlist, timeout)
        if timeout is not None and timeout < 0:
            raise ValueError("timeout must be non-negative")
        # Keyed by the socket objects themselves (kept alive here, so never confused with new
        # ones that reuse a descriptor number).
        polls = self._polls
        key = (tuple(rlist), tuple(wlist))
        entry = polls.get(key)
        if entry is None or not entry.current():
            entry = _Poll(rlist, wlist)  # raises, as kazoo's does, for a closed socket
            if len(polls) >= _KEPT:
                polls.clear()
            polls[key] = entry
        ready = entry.poll.poll(None if timeout is None else math.ceil(timeout * 1000))
        readable: list[Any] = []
        writable: list[Any] = []
        for fd, events in ready:
            if events & (_READ | _BROKEN) and fd in entry.readers:
                readable.extend(entry.readers[fd])
            elif events & (_WRITE | _BROKEN) and fd in entry.writers:
                writable.extend(entry.writers[fd])
        return readable, writable, []


class _Poll:
    """A poll object registered for some readers and writers, and who each descriptor is."""

    def __init__(self, rlist: list[Any], wlist: list[Any]) -> None:
        self.readers: dict[int, list[Any]] = {}
        self.writers: dict[int, list[Any]] = {}
        #: (the socket's fileno method, the descriptor registered) for each socket object.
        self._filenos: list[tuple[Any, int]] = []
        masks: dict[int, int] = {}
        for fileobjs, mask, into in ((rlist, _READ, self.readers), (wlist, _WRITE, self.writers)):
            for fileobj in fileobjs:
                fd = fileobj_to_fd(fileobj)
                masks[fd] = masks.get(fd, 0) | mask
                into.setdefault(fd, []).append(fileobj)
                if not isinstance(fileobj, int):
                    self._filenos.append((fileobj.fileno, fd))
        self.poll = select.poll()
        for fd, mask in masks.items():
            self.poll.register(fd, mask)

    def current(self) -> bool:
        """Whether every socket still has the descriptor it was registered with (not closed)."""
        for fileno, fd in self._filenos:  # noqa: SIM110 (a loop, not all(): asked at every read)
            if fileno() != fd:
                return False
        return True
