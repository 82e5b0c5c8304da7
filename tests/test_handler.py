"""zkq's kazoo handler: its select keeps select(2)'s contract as kazoo's connection uses it."""

from __future__ import annotations

import select
import socket
import threading
import time

import pytest

from zkqueue.plumbing.handler import PollingHandler


@pytest.fixture
def pair():
    sockets = list(socket.socketpair())
    yield sockets
    for s in sockets:
        s.close()


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


def _both(rlist, wlist, timeout=0):
    """What kazoo's own select and ours answer for the same question."""
    from kazoo.handlers.utils import selector_select

    return selector_select(rlist, wlist, [], timeout), PollingHandler().select(
        rlist, wlist, [], timeout
    )


@pytest.mark.parametrize("case", ["idle", "data", "urgent", "hangup", "reset", "both lists"])
def test_answers_as_kazoos_own_select(pair, case: str) -> None:
    a, b = pair[0], pair[1]
    if case == "data":
        b.send(b"x")
    elif case == "urgent":  # urgent data is select's exceptional set, not a read
        with socket.create_server(("127.0.0.1", 0)) as tcp:
            a = socket.create_connection(tcp.getsockname())
            b, _ = tcp.accept()
        pair.extend([a, b])  # closed by the fixture
        b.send(b"!", socket.MSG_OOB)
        assert select.select([], [], [a], 5)[2] == [a]  # it arrived
    elif case == "hangup":
        b.close()
    elif case == "reset":
        b.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, b"\1\0\0\0\0\0\0\0")
        b.close()
    rlist, wlist = ([a], [b]) if case == "both lists" else ([a], [])
    kazoos, ours = _both(rlist, wlist)
    assert ours == kazoos
    kazoos, ours = _both([], [a])  # as a writer too
    assert ours == kazoos


def test_blocks_without_a_timeout_until_ready(pair) -> None:
    a, b = pair
    handler = PollingHandler()
    timer = threading.Timer(0.05, lambda: b.send(b"z"))
    timer.start()
    assert handler.select([a], [], [], None) == ([a], [], [])
    timer.join()


def test_the_poll_object_is_kept_and_shared_by_no_two_threads(pair) -> None:
    a = pair[0]
    handler = PollingHandler()
    handler.select([a], [], [], 0)
    (kept,) = handler._polls.values()
    handler.select([a], [], [], 0)
    assert list(handler._polls.values()) == [kept]  # reused, not rebuilt
    errors: list[BaseException] = []

    def wait() -> None:
        try:
            handler.select([a], [], [], 0.2)  # two threads in the same set at once
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=wait) for _ in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    assert errors == []


def test_a_closed_socket_is_refused_as_kazoo_refuses_it() -> None:
    a, b = socket.socketpair()
    handler = PollingHandler()
    handler.select([a], [], [], 0)
    a.close()
    b.close()
    with pytest.raises(TypeError):
        handler.select([a], [], [], 0)
