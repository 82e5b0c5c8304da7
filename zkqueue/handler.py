"""kazoo's threading handler with a cheaper ``select``.

kazoo's connection thread calls ``handler.select`` at least twice a request (to send it, to read
its reply), and kazoo's own builds, registers and closes an epoll object on every call: about a
third of that thread's CPU. This one keeps a ``poll`` object per set of file descriptors (the
socket and kazoo's wake-up pipe: one set per connection), so a call is one system call.
"""

from __future__ import annotations

import math
import select
import threading
from typing import Any

from kazoo.handlers.threading import SequentialThreadingHandler
from kazoo.handlers.utils import fileobj_to_fd

_READ = select.POLLIN | select.POLLPRI
_WRITE = select.POLLOUT
#: Errors and hang-ups wake the reader: its read fails and kazoo reconnects.
_BROKEN = select.POLLERR | select.POLLHUP | select.POLLNVAL
#: Poll objects kept at most (a reconnect brings a new socket: a new set).
_KEPT = 4


class PollingHandler(SequentialThreadingHandler):
    name = "zkq_polling_threading"

    def __init__(self) -> None:
        super().__init__()
        self._polls: dict[tuple[tuple[int, int], ...], Any] = {}
        self._lock = threading.Lock()

    def select(
        self, rlist: list[Any], wlist: list[Any], xlist: list[Any], timeout: float | None = None
    ) -> tuple[list[Any], list[Any], list[Any]]:
        """select(2)'s contract, as kazoo's connection uses it (no exceptional set)."""
        if timeout is not None and timeout < 0:
            raise ValueError("timeout must be non-negative")
        masks: dict[int, int] = {}
        objects: dict[int, list[Any]] = {}
        for fileobjs, mask in ((rlist, _READ), (wlist, _WRITE)):
            for fileobj in fileobjs:
                fd = fileobj_to_fd(fileobj)
                masks[fd] = masks.get(fd, 0) | mask
                objects.setdefault(fd, []).append(fileobj)
        key = tuple(sorted(masks.items()))
        with self._lock:
            poll = self._polls.pop(key, None)
        if poll is None:
            poll = select.poll()
            for fd, mask in masks.items():
                poll.register(fd, mask)
        try:
            ready = poll.poll(None if timeout is None else math.ceil(timeout * 1000))
        finally:
            with self._lock:
                if len(self._polls) >= _KEPT:
                    self._polls.clear()
                self._polls[key] = poll
        readable: list[Any] = []
        writable: list[Any] = []
        for fd, events in ready:
            if events & (_READ | _BROKEN) and masks[fd] & _READ:
                readable.extend(objects[fd])
            elif events & (_WRITE | _BROKEN):
                writable.extend(objects[fd])
        return readable, writable, []
