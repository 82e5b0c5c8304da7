"""zkq's kazoo handler: its select keeps select(2)'s contract as kazoo's connection uses it."""

from __future__ import annotations

import socket
import time

import pytest

from zkqueue.handler import PollingHandler


@pytest.fixture
def pair():
    a, b = socket.socketpair()
    yield a, b
    a.close()
    b.close()


def test_select_reports_readable_writable_and_times_out(pair) -> None:
    a, b = pair
    handler = PollingHandler()
    start = time.monotonic()
    assert handler.select([a], [], [], 0.05) == ([], [], [])
    assert time.monotonic() - start >= 0.04  # it waited for the timeout
    assert handler.select([], [a], [], 0) == ([], [a], [])
    b.send(b"x")
    for _ in range(3):  # the same set again (a kept poll object), still ready
        assert handler.select([a, b], [], [], 1) == ([a], [], [])
    a.recv(1)
    assert handler.select([a, b], [], [], 0) == ([], [], [])


def test_a_peer_that_hung_up_wakes_the_reader(pair) -> None:
    a, b = pair
    handler = PollingHandler()
    assert handler.select([a], [], [], 0) == ([], [], [])
    b.close()
    assert handler.select([a], [], [], 1) == ([a], [], [])
    assert a.recv(1) == b""  # the read that tells kazoo to reconnect


def test_new_sockets_get_new_polls_and_the_cache_stays_bounded() -> None:
    handler = PollingHandler()
    for _ in range(10):
        a, b = socket.socketpair()
        b.send(b"y")
        assert handler.select([a], [], [], 1) == ([a], [], [])
        a.close()
        b.close()
    assert len(handler._polls) <= 4


def test_a_negative_timeout_is_refused(pair) -> None:
    with pytest.raises(ValueError):
        PollingHandler().select([pair[0]], [], [], -1)
