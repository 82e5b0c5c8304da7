"""Entries written by any client, however broken, never kill a worker: they are dead-lettered."""

from __future__ import annotations

import json

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from kazoo.protocol.serialization import SetData

from tests.conftest import wait_for
from tests.runners import RecordingRunner
from zkqueue import Client

GARBAGE = [
    ("badjson", b"{not json"),
    ("notutf8", b"\xff\xfe\x00garbage"),
    ("wrongtype", b'{"prompt": ["a list"]}'),
    ("unknown", b'{"prompt": "x", "gpu": "please"}'),
    ("hugenum", b'{"prompt": "x", "max_new_tokens": 1e400}'),
    ("empty", b""),
]


def _dead(client: Client) -> dict[str, dict]:
    path = client.layout.dead("default")
    return {n: json.loads(client.zk.get(f"{path}/{n}")[0]) for n in client.zk.get_children(path)}


def test_malformed_entries_are_dead_lettered_and_the_next_job_runs(
    client: Client, start_worker
) -> None:
    client.ensure_queue("default")
    pending = client.layout.bucket("default", "high", 0)
    for job_id, data in GARBAGE:
        client.zk.create(f"{pending}/{job_id}-", data, sequence=True)
    client.zk.create(f"{pending}/no_sequence_here", b'{"prompt": "x"}')
    good = client.submit("fine", priority="low", detach=True)
    runner = RecordingRunner()
    handle = start_worker(runner)
    assert good.result(timeout=10).ok
    assert runner.seen == ["fine"]
    dead = _dead(client)
    assert len(dead) == len(GARBAGE) + 1
    reasons = {d["entry"].rsplit("/", 1)[-1].split("-")[0]: d["reason"] for d in dead.values()}
    assert "not valid JSON" in reasons["badjson"]
    assert "not UTF-8" in reasons["notutf8"]
    assert "prompt must be a string" in reasons["wrongtype"]
    assert "unknown field" in reasons["unknown"]
    assert "is not <bucket>/<id>-<sequence>" in reasons["no_sequence_here"]
    for job_id, _ in GARBAGE:
        assert client.job(job_id).result(timeout=1).status == "dead"
    assert handle.worker.stats.dead_lettered == len(GARBAGE) + 1


def test_hand_written_entry_like_zkcli_runs(client: Client, start_worker) -> None:
    """What docs/PROTOCOL.md tells other-language producers to do."""
    client.ensure_queue("default")
    # The tail bucket is named by the priority node's data (a new queue: bucket 0).
    tail = client.zk.get(client.layout.pending("default", "normal"))[0].decode() or "0"
    pending = client.layout.bucket("default", "normal", int(tail))
    path = client.zk.create(f"{pending}/handmade1-", b'{"prompt": "from zkCli"}', sequence=True)
    start_worker()
    assert path.rsplit("/", 1)[1].startswith("handmade1-")
    record = client.job("handmade1").result(timeout=10)
    assert (record.status, record.output) == ("succeeded", "from zkCli")


@settings(
    max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture]
)
@given(data=st.binary(max_size=200))
def test_random_bytes_in_real_znodes_never_stop_the_worker(
    client: Client, start_worker, data: bytes
) -> None:
    if not hasattr(client, "_hyp_worker"):
        client._hyp_worker = start_worker()  # type: ignore[attr-defined]
    client.ensure_queue("default")
    pending = client.layout.bucket("default", "normal", 0)
    path = client.zk.create(f"{pending}/fuzz-", data, sequence=True)
    after = client.submit("still alive", detach=True)
    assert after.result(timeout=10).ok
    assert client.zk.exists(path) is None
    record = (
        client.job("fuzz").result(timeout=1)
        if client.zk.exists(client.layout.result("default", "fuzz"))
        else None
    )
    if record is not None:
        assert record.status in ("dead", "succeeded")
        client.zk.delete(client.layout.result("default", "fuzz"))


def test_nodes_written_without_data_never_stop_a_worker(client: Client, start_worker) -> None:
    """zkCli.sh's ``create`` with no value stores no data at all (kazoo reads None): a priority
    node, a tail bucket and an entry written that way read as empty. The producer still finds
    the tail, the entry is dead-lettered, and a raw entry beside a data-less tail still runs."""
    client.ensure_queue("default")
    layout = client.layout
    client.zk.set(layout.pending("default", "normal"), None)
    job = client.submit("after a data-less priority node", detach=True)
    bare = client.zk.create(layout.entry_prefix("default", "high", "nodata", 0), sequence=True)
    client.zk.set(bare, None)
    runner = RecordingRunner()
    handle = start_worker(runner)
    assert job.result(timeout=10).ok
    wait_for(lambda: "nodata" in str(_dead(client)), message="the data-less entry lettered")
    view = handle.worker.view
    wait_for(lambda: ("normal", 0) in view.armed, message="the idle head watching the tail")
    txn = client.zk.transaction()  # a raw producer's signal with no data, in its multi
    txn._add(SetData(layout.bucket("default", "normal", 0), None, -1))  # kazoo refuses None
    txn.create(
        layout.entry_prefix("default", "normal", "raw1", 0), b'{"prompt": "raw"}', sequence=True
    )
    assert not any(isinstance(r, Exception) for r in txn.commit())
    assert client.job("raw1", "default").result(timeout=10).output == "raw"
    assert runner.seen == ["after a data-less priority node", "raw"]
