"""Producer edge: refusing bad input before writing, and retrying without enqueuing twice."""

from __future__ import annotations

from dataclasses import replace
from typing import Any

import pytest
from kazoo.exceptions import ConnectionLoss

from zkqueue import Client, InvalidJob, SpecTooLarge, ZkqConnectionError
from zkqueue.errors import JobNotFound


def _all_entries(client: Client) -> list[str]:
    out = []
    for p in ("high", "normal", "low"):
        path = client.layout.pending("default", p)
        if client.zk.exists(path):
            out += client.zk.get_children(path)
    return out


def test_connection_loss_after_a_create_does_not_enqueue_twice(client: Client, monkeypatch) -> None:
    """The create reaches ZooKeeper but its answer is lost: the retry finds it by its token."""
    client.ensure_queue("default")
    real_create = client.zk.create
    calls: list[str] = []

    def create_then_lose(path: str, *args: Any, **kwargs: Any) -> str:
        calls.append(path)
        real_create(path, *args, **kwargs)
        if len(calls) == 1:
            raise ConnectionLoss("answer lost")
        raise AssertionError("a second create must not happen")

    monkeypatch.setattr(client.zk, "create", create_then_lose)
    job = client.submit("exactly once", detach=True)
    assert len(calls) == 1
    entries = _all_entries(client)
    assert entries == [job.entry]
    assert job.status() == "pending"


def test_connection_loss_before_the_create_creates_it(client: Client, monkeypatch) -> None:
    client.ensure_queue("default")
    real_create = client.zk.create
    calls: list[str] = []

    def lose_then_create(path: str, *args: Any, **kwargs: Any) -> str:
        calls.append(path)
        if len(calls) == 1:
            raise ConnectionLoss("request lost")
        return str(real_create(path, *args, **kwargs))

    monkeypatch.setattr(client.zk, "create", lose_then_create)
    job = client.submit("once", detach=True)
    assert len(calls) == 2
    assert _all_entries(client) == [job.entry]


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"prompt": "x", "priority": "urgent"}, InvalidJob, "unknown priority 'urgent'"),
        ({"prompt": ""}, InvalidJob, "prompt must not be empty"),
        ({"prompt": "x", "max_new_tokens": -1}, InvalidJob, "max_new_tokens"),
        ({"prompt": "x", "max_new_tokens": "12"}, InvalidJob, "max_new_tokens must be an integer"),
        ({"prompt": "x", "temperature": float("nan")}, InvalidJob, "temperature"),
        ({"prompt": "x", "queue": "bad/name"}, InvalidJob, "bad queue name"),
        ({"prompt": "x", "colour": "red"}, InvalidJob, "unknown job parameter"),
        ({"prompt": "x" * 70000}, SpecTooLarge, "limit is 65536 bytes"),
    ],
)
def test_bad_input_is_refused_and_nothing_is_written(
    client: Client, kwargs: dict[str, Any], error: type[Exception], message: str
) -> None:
    with pytest.raises(error, match=message):
        client.submit(**kwargs, detach=True)
    assert client.zk.exists(client.layout.queues()) is None


def test_submit_many_validates_everything_first(client: Client) -> None:
    with pytest.raises(InvalidJob, match="spec #2: prompt must not be empty"):
        client.submit_many(["a", "b", ""])
    assert client.zk.exists(client.layout.queues()) is None


def test_unknown_job_id(client: Client) -> None:
    with pytest.raises(JobNotFound):
        client.job("0123456789abcdef")
    with pytest.raises(InvalidJob):
        client.job("../etc")


def test_unreachable_zookeeper_is_a_clear_error() -> None:
    with pytest.raises(ZkqConnectionError, match=r"cannot reach ZooKeeper at 127\.0\.0\.1:1"):
        Client("127.0.0.1:1", connect_timeout=0.5).start()


def test_a_lost_enqueue_names_the_job_to_look_up(client: Client, monkeypatch) -> None:
    """If ZooKeeper does not come back in time, the error carries the id the create used."""
    client.ensure_queue("default")
    real_create = client.zk.create

    def create_then_lose(path: str, *args: Any, **kwargs: Any) -> str:
        real_create(path, *args, **kwargs)
        raise ConnectionLoss("answer lost")

    monkeypatch.setattr(client.zk, "create", create_then_lose)
    monkeypatch.setattr(client, "find_entry", _always_lose)
    monkeypatch.setattr(client, "settings", replace(client.settings, connect_timeout=0.2))
    with pytest.raises(ZkqConnectionError) as caught:
        client.submit("maybe", detach=True)
    job_id = caught.value.job_id
    assert job_id is not None and f"zkq status {job_id}" in str(caught.value)
    monkeypatch.undo()
    assert client.job(job_id).status() == "pending"


def _always_lose(*_args: Any) -> str | None:
    raise ConnectionLoss("still away")


class _LostReply:
    """An async result whose reply was lost with the connection."""

    def get(self) -> Any:
        raise ConnectionLoss("answer lost")


@pytest.mark.parametrize("committed", [True, False])
def test_submit_many_whose_multi_reply_was_lost_enqueues_each_job_once(
    client: Client, monkeypatch, committed: bool
) -> None:
    """submit_many sends its creates in multis of up to 100. When a multi's reply is lost it
    committed as a whole or not at all: each id is looked up before it is created again."""
    from zkqueue import claims

    real = claims.enqueue_async
    sent: list[int] = []

    def lose_first(zk: Any, entries: list[Any], ephemeral: bool) -> Any:
        sent.append(len(entries))
        if len(sent) == 1:
            if committed:
                real(zk, entries, ephemeral).get()
            return _LostReply()
        return real(zk, entries, ephemeral)

    monkeypatch.setattr(claims, "enqueue_async", lose_first)
    jobs = client.submit_many([f"job {i}" for i in range(250)])
    assert sent == [100, 100, 50]
    entries = _all_entries(client)
    assert sorted(entries) == sorted(j.entry for j in jobs) and len(set(entries)) == 250
