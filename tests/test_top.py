"""``zkq top``: the snapshot read from a real ZooKeeper, the rendered frame, throughput between
two snapshots, and the live loop quitting on ``q`` from a pseudo-terminal."""

from __future__ import annotations

import dataclasses
import io
import os
import threading
from collections.abc import Iterator
from typing import Any, TextIO

import pytest
from rich.console import Console

from tests.conftest import wait_for
from workers.admission import Admission
from workers.runners.echo import EchoRunner
from zkqueue import Client
from zkqueue.operations.exporter import ClusterState, QueueState
from zkqueue.operations.top import run_top, snapshot
from zkqueue.operations.topview import TopSnapshot, memory_bar, render, throughput


def text_of(renderable: Any) -> str:
    console = Console(record=True, width=160, file=io.StringIO())
    console.print(renderable)
    return console.export_text()


@pytest.fixture
def populated(client: Client, start_worker) -> dict[str, Any]:
    """A queue served by a worker (five finished jobs, one running) and a backlog nobody serves."""
    cache = Admission(pages_total=8, page_tokens=16, count_tokens=lambda spec: 16)
    cache.reserve(3)  # as if jobs in flight held 3 of the 8 pages
    handle = start_worker(EchoRunner(delay=0), queue="default", slots=2, admission=cache)
    done = client.submit_many([f"job {i}" for i in range(5)], queue="default")
    wait_for(lambda: all(j.status() == "succeeded" for j in done), message="five results")
    backlog = client.submit_many(["a", "b", "c"], queue="backlog", priority="high")
    client.submit_many(["d"], queue="backlog", priority="low")
    return {"worker": handle.worker.id, "done": done, "backlog": backlog}


def test_snapshot_reads_queues_workers_and_recent_results(
    client: Client, populated: dict[str, Any]
) -> None:
    snap = snapshot(client)
    assert snap.errors == []
    queues = {q.name: q for q in snap.cluster.queues}
    assert set(queues) == {"backlog", "default"}
    assert queues["backlog"].depth == {"high": 3, "normal": 0, "low": 1}
    assert queues["backlog"].total_waiting == 4
    assert set(queues["backlog"].oldest) == {"high", "low"}
    assert queues["default"].total_depth == 0
    assert queues["default"].results == 5
    assert [w["id"] for w in snap.cluster.workers] == [populated["worker"]]
    assert sorted(r.id for r in snap.recent) == sorted(j.id for j in populated["done"])
    assert [r.finished for r in snap.recent] == sorted(
        (r.finished for r in snap.recent), reverse=True
    )
    assert {(r.status, r.worker, r.queue) for r in snap.recent} == {
        ("succeeded", populated["worker"], "default")
    }
    assert all(r.run_s is not None and r.run_s >= 0 for r in snap.recent)
    assert snap.examined == 5


def test_a_refresh_examines_only_new_results(client: Client, populated: dict[str, Any]) -> None:
    first = snapshot(client, recent=3)
    again = snapshot(client, first, recent=3)
    assert again.examined == 0
    assert again.recent == first.recent
    newer = client.submit_many(["one more"], queue="default")
    wait_for(lambda: newer[0].status() == "succeeded", message="one more result")
    third = snapshot(client, again, recent=3)
    assert third.examined == 1
    assert third.recent[0].id == newer[0].id
    assert third.recent[1:] == again.recent[:2]


def test_render_shows_queues_workers_memory_and_results(
    client: Client, populated: dict[str, Any]
) -> None:
    text = text_of(render(snapshot(client)))
    for expected in ("queues", "backlog", "default", "workers", "recent results"):
        assert expected in text
    backlog_row = next(line for line in text.splitlines() if "backlog" in line)
    cells = [cell.strip() for cell in backlog_row.split("│")]
    assert cells[1:6] == ["backlog", "3", "0", "1", "4"]  # depth high, normal, low; waiting
    worker_row = next(line for line in text.splitlines() if populated["worker"] in line)
    assert "echo" in worker_row and "running" in worker_row and "0/2" in worker_row
    assert "████░░░░░░░░ 3/8 pages" in worker_row
    for job in populated["done"]:
        assert job.id in text
    assert "succeeded" in text


def test_run_top_once_prints_one_frame(client: Client, populated: dict[str, Any]) -> None:
    out = io.StringIO()
    run_top(client, once=True, console=Console(file=out, width=160))
    assert "backlog" in out.getvalue() and populated["worker"] in out.getvalue()
    assert "jobs/s" not in out.getvalue()  # one frame has no rate: no column of dashes


def test_memory_bar() -> None:
    assert memory_bar(None).plain == "-"
    assert memory_bar({"pages_total": 8, "pages_promised": 6}, width=8).plain == (
        "██████░░ 6/8 pages"
    )
    assert memory_bar({"pages_total": 4, "pages_promised": 0}, width=4).plain == "░░░░ 0/4 pages"


def fake(workers: list[dict[str, Any]], at: float, queues: tuple[str, ...] = ("a", "b")) -> Any:
    zero = {"high": 0, "normal": 0, "low": 0}
    states = [QueueState(q, dict(zero), dict(zero), 0, 0, 0, 0) for q in queues]
    return TopSnapshot("zk", "/zkq", ClusterState(states, workers), [], monotonic=at)


def test_throughput_is_the_increase_of_completed_counters_per_second() -> None:
    before = fake(
        [
            {"id": "w1", "queue": "a", "completed": 10},
            {"id": "w2", "queue": "a", "completed": 5},
            {"id": "w3", "queue": "b"},  # a worker from before the counters existed
        ],
        at=100.0,
    )
    after = fake(
        [
            {"id": "w1", "queue": "a", "completed": 30},
            {"id": "w2", "queue": "a", "completed": 9},
            {"id": "w3", "queue": "b"},
            {"id": "w4", "queue": "b", "completed": 50},  # new: its history is not this window's
        ],
        at=104.0,
    )
    assert throughput(after, before) == {"a": 6.0, "b": 0.0}
    assert throughput(after, None) == {"a": None, "b": None}
    assert "6.00" in text_of(render(after, before))


def test_throughput_from_real_snapshots(client: Client, populated: dict[str, Any]) -> None:
    first = snapshot(client)
    second = snapshot(client, first)
    rates = throughput(second, first)
    assert set(rates) == {"backlog", "default"}
    assert all(r is not None and r >= 0 for r in rates.values())
    later = dataclasses.replace(second, monotonic=first.monotonic)
    assert throughput(later, first) == {"backlog": None, "default": None}


@pytest.fixture
def terminal() -> Iterator[tuple[int, TextIO]]:
    """A pseudo-terminal: (the keyboard's end, the program's stdin)."""
    keyboard, program = os.openpty()
    stdin = os.fdopen(program, "r")
    yield keyboard, stdin
    stdin.close()
    os.close(keyboard)


def test_live_view_quits_on_q(client: Client, populated: dict[str, Any], terminal) -> None:
    keyboard, stdin = terminal
    out = io.StringIO()
    console = Console(file=out, width=160, force_terminal=True)
    view = threading.Thread(
        target=run_top, args=(client, 0.05, console), kwargs={"keys": stdin}, daemon=True
    )
    view.start()
    wait_for(lambda: out.getvalue().count("backlog") >= 2, message="two refreshes")
    os.write(keyboard, b"x")  # another key only refreshes
    os.write(keyboard, b"q")
    view.join(10)
    assert not view.is_alive()
    assert populated["worker"] in out.getvalue()


def test_a_busy_frame_fits_80_by_24() -> None:
    """Many queues, workers and results on a 80x24 terminal: columns drop by rank, then rows,
    and what remains says how many rows are not shown."""
    from zkqueue.operations.topview import ResultRow

    now = __import__("time").time()
    queues = [
        QueueState(
            name=f"queue-number-{i}",
            depth={"high": 5, "normal": 120, "low": 3000},
            waiting={"high": 5, "normal": 100, "low": 3000},
            running=20,
            idle_workers=1,
            dead=2,
            results=7,
            max_running=20,
            oldest={"low": now - 400},
        )
        for i in range(6)
    ]
    workers = [
        {
            "id": f"gpu-host-{i:02d}-12345-abcd",
            "queue": "queue-number-1",
            "runner": "hf",
            "runner_info": {"model": "/srv/models/llama-3-8b-instruct", "device": "cuda:0"},
            "state": "running",
            "slots_busy": 8,
            "slots_max": 8,
            "memory": {"pages_total": 96, "pages_promised": 40},
            "running": ["8f3a2c1d9e4b7a60", "8f3a2c1d9e4b7a61", "8f3a2c1d9e4b7a62"],
            "updated_at": now - 1,
        }
        for i in range(12)
    ]
    recent = [
        ResultRow(f"{i:016x}", "queue-number-1", "normal", "succeeded", "gpu-host-01", 2.5, now)
        for i in range(10)
    ]
    snap = TopSnapshot("zk1:2181,zk2:2181,zk3:2181", "/zkq", ClusterState(queues, workers), recent)
    console = Console(record=True, width=80, height=24, file=io.StringIO())
    console.print(render(snap, size=(80, 24)))
    lines = console.export_text().rstrip("\n").splitlines()
    assert len(lines) <= 24, "\n".join(lines)
    assert max(len(line) for line in lines) <= 80, "\n".join(lines)
    text = "\n".join(lines)
    for kept in ("queue-number-0", "waiting", "running", "20/20", "worker", "slots"):
        assert kept in text, text
    assert "more not shown" in text
