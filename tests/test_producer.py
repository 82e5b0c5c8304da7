"""Producer edge: refusing bad input before writing, and retrying without enqueuing twice."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from dataclasses import replace
from typing import Any

import pytest
from kazoo.exceptions import ConnectionLoss, SessionExpiredError

from tests.conftest import Relay, wait_for
from zkqueue import Client, InvalidJob, SpecTooLarge, ZkqConnectionError
from zkqueue.errors import JobNotFound
from zkqueue.producer import bulk
from zkqueue.producer.enqueue import Enqueuer
from zkqueue.protocol import claims, counts


def _all_entries(client: Client) -> list[str]:
    return [e.name for _, e in counts.in_order(client.zk, client.layout, "default")]


def _patch_enqueue(monkeypatch: Any, mode: Callable[[int], str]) -> list[int]:
    """Make the n-th enqueue multi ``commit`` normally, ``lose`` its request, or ``commit+lose``
    (commit, then lose the reply). Returns the sizes of the multis sent."""
    real = claims.enqueue_async
    sent: list[int] = []

    def fake(zk: Any, checks: list[Any], tails: list[Any], entries: list[Any], eph: bool) -> Any:
        sent.append(len(entries))
        how = mode(len(sent))
        if how == "lose":
            return _lost_reply(zk)
        result = real(zk, checks, tails, entries, eph)
        if how == "commit+lose":
            result.get()
            return _lost_reply(zk)
        return result

    monkeypatch.setattr(claims, "enqueue_async", fake)
    return sent


def test_connection_loss_after_a_create_does_not_enqueue_twice(client: Client, monkeypatch) -> None:
    """The create reaches ZooKeeper but its answer is lost: the retry finds it by its id."""
    client.ensure_queue("default")
    sent = _patch_enqueue(monkeypatch, lambda n: "commit+lose" if n == 1 else "fail")
    job = client.submit("exactly once", detach=True)
    assert sent == [1]
    entries = _all_entries(client)
    assert entries == [job.entry]
    assert job.status() == "pending"


def test_connection_loss_before_the_create_creates_it(client: Client, monkeypatch) -> None:
    client.ensure_queue("default")
    sent = _patch_enqueue(monkeypatch, lambda n: "lose" if n == 1 else "commit")
    job = client.submit("once", detach=True)
    assert sent == [1, 1]
    assert _all_entries(client) == [job.entry]


@pytest.mark.parametrize("lost", [SessionExpiredError, ConnectionLoss])
def test_reads_before_the_create_are_repeated_after_a_lost_connection(
    client: Client, monkeypatch, lost: type[Exception]
) -> None:
    """Just after ZooKeeper came back, a session that expired while it was down fails the
    request sent meanwhile, and kazoo opens a new one: the submit reads again and goes on."""
    client.ensure_queue("default")
    real = client.limits.check_room_many  # check_room's too
    calls: list[str] = []

    def flaky(queue: str, adding: Mapping[str | None, int]) -> None:
        calls.append(queue)
        if len(calls) == 1:
            raise lost()
        real(queue, adding)

    monkeypatch.setattr(client.limits, "check_room_many", flaky)
    job = client.submit("after the outage", detach=True)
    many = client.submit_many(["a", "b"])
    assert len(calls) == 3
    assert sorted(_all_entries(client)) == sorted([job.entry, *(j.entry for j in many)])


@pytest.mark.parametrize(
    "kwargs, error, message",
    [
        ({"prompt": "x", "priority": "urgent"}, InvalidJob, "unknown priority 'urgent'"),
        ({"prompt": ""}, InvalidJob, "prompt must not be empty"),
        ({"prompt": "x", "max_new_tokens": -1}, InvalidJob, "max_new_tokens"),
        ({"prompt": "x", "max_new_tokens": "12"}, InvalidJob, "max_new_tokens must be an integer"),
        ({"prompt": "x", "temperature": float("nan")}, InvalidJob, "temperature"),
        ({"prompt": "x", "queue": "bad/name"}, InvalidJob, "bad queue name"),
        (
            {"prompt": "x", "colour": "red"},
            InvalidJob,
            "unknown job parameter",
        ),
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
    _patch_enqueue(monkeypatch, lambda n: "commit+lose")
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


def _lost_reply(zk: Any) -> Any:
    """A kazoo async result whose reply was lost with the connection."""
    result = zk.handler.async_result()
    result.set_exception(ConnectionLoss("answer lost"))
    return result


@pytest.mark.parametrize("committed", [True, False])
def test_submit_many_whose_multi_reply_was_lost_enqueues_each_job_once(
    client: Client, monkeypatch, committed: bool
) -> None:
    """submit_many sends its creates in multis of up to 100. When a multi's reply is lost it
    committed as a whole or not at all: each id is looked up before it is created again."""
    first = "commit+lose" if committed else "lose"
    sent = _patch_enqueue(monkeypatch, lambda n: first if n == 1 else "commit")
    jobs = client.submit_many([f"job {i}" for i in range(250)])
    # A lost multi that did not commit is sent again whole, after its ids were looked up (the
    # first multi goes alone: the client does not know yet how full the tail bucket is).
    assert sent == ([100, 100, 50] if committed else [100, 100, 100, 50])
    entries = _all_entries(client)
    assert sorted(entries) == sorted(j.entry for j in jobs) and len(set(entries)) == 250


def test_a_recovered_multi_that_filled_its_bucket_opens_the_next(
    client: Client, monkeypatch
) -> None:
    """A multi that committed but whose reply was lost, and that filled its tail bucket: the
    lookup that recovers its entries also opens the next bucket, as its reply would have, so
    the next job goes there and the full bucket takes no more."""
    client._enqueue = Enqueuer(client, bucket_size=3)
    client.ensure_queue("default")
    sent = _patch_enqueue(monkeypatch, lambda n: "commit+lose" if n == 1 else "commit")
    batch = client.submit_many(["a", "b", "c"])
    assert sent == [3]  # one multi, recovered by looking its ids up: nothing sent again
    assert [j.entry.split("/")[0] for j in batch] == ["0000000000"] * 3
    after = client.submit("d", detach=True)
    assert after.entry is not None and after.entry.split("/")[0] == "0000000001"
    assert sorted(_all_entries(client)) == sorted([*(j.entry for j in batch), after.entry])


def test_a_submit_that_filled_its_bucket_succeeds_though_opening_the_next_fails(
    client: Client, monkeypatch
) -> None:
    """The jobs are enqueued when the connection goes while the next bucket is opened: the
    submit says so, and the next entry, past the full bucket, opens it."""
    client._enqueue = Enqueuer(client, bucket_size=3)
    client.ensure_queue("default")
    real = claims.open_bucket
    opens: list[int] = []

    def failing_once(*args: Any) -> bool:
        opens.append(args[4])
        if len(opens) == 1:
            raise ConnectionLoss("the connection went while opening the next bucket")
        return real(*args)

    monkeypatch.setattr(claims, "open_bucket", failing_once)
    batch = client.submit_many(["a", "b", "c"])
    assert [j.entry.split("/")[0] for j in batch if j.entry] == ["0000000000"] * 3
    past = client.submit("d", detach=True)
    assert past.entry is not None and past.entry.split("/")[0] == "0000000000"
    assert opens == [0, 0]  # tried again by the entry past the full bucket
    after = client.submit("e", detach=True)
    assert after.entry is not None and after.entry.split("/")[0] == "0000000001"


def test_a_batch_cut_short_by_the_connection_says_which_jobs_were_enqueued(
    client: Client, monkeypatch
) -> None:
    """The first multi commits; the reply of the second never comes back: the error lists the
    first multi's jobs as enqueued, the ones sent since as unsure, and nothing as lost."""
    client.ensure_queue("default")
    real = Enqueuer._created
    replies: list[int] = []

    def second_lost(self: Enqueuer, chunk: Any, sent: Any, ephemeral: bool) -> Any:
        replies.append(len(chunk))
        if len(replies) == 2:
            sent[1].get()  # it commits; its reply is what goes
            raise ZkqConnectionError("ZooKeeper went away while enqueuing")
        return real(self, chunk, sent, ephemeral)

    monkeypatch.setattr(Enqueuer, "_created", second_lost)
    prompts = [f"job {i}" for i in range(250)]
    with pytest.raises(ZkqConnectionError) as caught:
        client.submit_many(prompts, detach=True)
    error = caught.value
    assert len(error.enqueued) == 100 and len(error.unsure) == 150  # multis of 100: one window
    assert error.job_id == error.unsure[0]
    assert "100 were enqueued, 150 may or may not have been" in str(error)
    assert "0 were not sent" in str(error)
    listed = {e.split("/")[1].rsplit("-", 1)[0] for e in _all_entries(client)}
    assert set(error.enqueued) <= listed and listed <= set(error.enqueued) | set(error.unsure)


def test_a_batch_cut_short_while_sending_counts_what_went_as_unsure(
    client: Client, monkeypatch
) -> None:
    """The second window's first multi goes; its second cannot be sent (kazoo's own error,
    raised as it is): the first is unsure, the last 50 were not sent."""
    client.ensure_queue("default")
    real = Enqueuer._send
    sends: list[int] = []

    def third_fails(self: Enqueuer, chunk: Any, *args: Any) -> Any:
        sends.append(len(chunk))
        if len(sends) == 3:
            raise ConnectionLoss()
        return real(self, chunk, *args)

    monkeypatch.setattr(Enqueuer, "_send", third_fails)
    with pytest.raises(ZkqConnectionError) as caught:
        client.submit_many([f"job {i}" for i in range(250)], detach=True)
    error = caught.value
    assert (len(error.enqueued), len(error.unsure)) == (100, 100)
    assert "lost ZooKeeper at" in str(error) and "ConnectionLoss" in str(error)
    assert "50 were not sent" in str(error)


def test_a_batch_with_chosen_ids_can_be_submitted_again(client: Client) -> None:
    """Lines that carry a job_id are looked up first: one already pending (or finished) is
    not enqueued again, nor one given twice in the batch, so a batch cut short by an error
    can simply be sent again."""
    first = client.submit_many([{"prompt": "a", "job_id": "batch.1"}, "generated"])
    assert [j.existing for j in first] == [False, False]
    again = client.submit_many(
        [
            {"prompt": "a", "job_id": "batch.1"},
            {"prompt": "b", "job_id": "batch.2"},
            {"prompt": "b", "job_id": "batch.2"},
        ]
    )
    assert [j.id for j in again] == ["batch.1", "batch.2", "batch.2"]
    assert [j.existing for j in again] == [True, False, False]
    ids = sorted(e for e in _all_entries(client))
    assert [i.split("/")[1].rsplit("-", 1)[0] for i in ids].count("batch.2") == 1
    assert len(ids) == 3  # batch.1, the generated one, batch.2
    with pytest.raises(InvalidJob, match="reserved for the ids zkq generates"):
        client.submit_many([{"prompt": "x", "job_id": "_mine"}])


def test_waiting_on_a_batch_rides_through_zookeeper_going_away(
    relay: Relay, root: str, start_worker, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Rounds made while ZooKeeper is away know of no job that ended; the wait goes on, and
    every line gets its result once ZooKeeper is back."""
    rounds: list[bool] = []
    real = bulk._ended

    def counted(*args: Any) -> Any:
        rounds.append(producer.zk.connected)
        return real(*args)

    monkeypatch.setattr(bulk, "_ended", counted)
    with Client(f"127.0.0.1:{relay.port}", root, session_timeout=10.0) as producer:
        lines = bulk.read_lines([b'{"prompt": "a"}', b'{"prompt": "b"}'], limit=65536)
        bulk.submit_lines(
            producer, lines, priority="normal", queue="default", max_new_tokens=None, detach=True
        )
        relay.cut()
        wait_for(lambda: not producer.zk.connected, message="the producer to notice")
        records: list[dict[str, Any]] = []
        failed: list[BaseException] = []

        def wait() -> None:
            try:
                records.extend(bulk.results(lines, timeout=60))
            except BaseException as exc:
                failed.append(exc)

        waiter = threading.Thread(target=wait, daemon=True)
        waiter.start()
        wait_for(lambda: False in rounds or failed, message="a round while ZooKeeper is away")
        relay.restore()
        start_worker()
        waiter.join(30)
        assert not failed and not waiter.is_alive()
        statuses = sorted((r["line"], r["status"]) for r in records)
        assert statuses == [(1, "succeeded"), (2, "succeeded")]


def test_waiting_on_a_batch_ends_for_an_entry_gone_without_a_result(client: Client) -> None:
    """A line whose job's entry goes without a result (an earlier run's attached request,
    withdrawn with its session) is reported, not waited for; two lines naming one job share
    its record."""
    lines = bulk.read_lines(
        [b'{"prompt": "a", "job_id": "w.1"}', b'{"prompt": "a", "job_id": "w.1"}'], limit=65536
    )
    bulk.submit_lines(
        client, lines, priority="normal", queue="default", max_new_tokens=None, detach=True
    )
    job = lines[0].job
    assert job is not None and lines[1].job is job
    client.zk.delete(job.entry_path or "")  # withdrawn: no result will come
    started = time.monotonic()
    records = list(bulk.results(lines, timeout=30))
    assert time.monotonic() - started < 5
    assert [(r["line"], r["id"], r["status"]) for r in records] == [
        (1, "w.1", "unfinished"),
        (2, "w.1", "unfinished"),
    ]
    assert "withdrawn" in records[0]["error"]
