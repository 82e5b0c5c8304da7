"""A long-lived producer holds only the watches of jobs still in flight: every watch a finished
job set has fired or was never set (ZooKeeper's own count, ``wchc``, per session)."""

from __future__ import annotations

import asyncio
from typing import Any

import pytest

from workers.runners.echo import EchoRunner
from zkqueue import AsyncClient, Client
from zkqueue.errors import JobWithdrawn
from zkqueue.testing import ZkCluster, four_letter


def watches_of(cluster: ZkCluster, session: int) -> int:
    """Watches the server holds for one session (``wchc`` lists paths under each session)."""
    text = four_letter(cluster.servers[0].client_port, "wchc")
    held, current = 0, None
    for line in text.splitlines():
        if line.startswith("0x"):
            current = int(line, 16)
        elif line.strip() and current == session:
            held += 1
    return held


def test_attached_jobs_in_sequence_leave_no_watches_behind(
    zk_cluster: ZkCluster, client: Client, start_worker
) -> None:
    start_worker()
    for i in range(60):
        assert client.submit(f"job {i}").result(timeout=10).ok
    client.zk.sync("/")
    assert watches_of(zk_cluster, client.zk.client_id[0]) <= 2


def test_detached_results_read_once_leave_at_most_their_own_watch(
    zk_cluster: ZkCluster, client: Client, start_worker
) -> None:
    start_worker()
    jobs = client.submit_many([f"job {i}" for i in range(20)])
    for job in jobs:
        assert job.result(timeout=10).ok
    client.zk.sync("/")
    # A detached result is kept (retention): the watch that saw it appear has fired, and the
    # data watch of the final read is on a node that exists; none waits on a missing node.
    assert watches_of(zk_cluster, client.zk.client_id[0]) <= len(jobs)


def test_async_client_attached_jobs_leave_no_watches_behind(
    zk_cluster: ZkCluster, hosts: str, root: str, start_worker
) -> None:
    start_worker()

    async def run() -> int:
        async with AsyncClient(hosts, root) as client:
            for i in range(40):
                job = await client.submit(f"job {i}")
                assert (await job.result(timeout=10)).ok
            await asyncio.to_thread(client.zk.sync, "/")
            return watches_of(zk_cluster, client.zk.client_id[0])

    assert asyncio.run(run()) <= 2


def test_async_streams_leave_no_watches_behind(
    zk_cluster: ZkCluster, hosts: str, root: str, start_worker
) -> None:
    """A stream reads only what its watches say changed (the claim, then the result alone):
    every watch it set has fired or was taken back when the stream ends."""
    start_worker(EchoRunner(delay=0.2))

    async def run() -> int:
        async with AsyncClient(hosts, root) as client:
            for i in range(20):
                prompt = f"job {i} of the streams"
                job = await client.submit(prompt, stream=True)
                assert "".join([piece async for piece in job.stream(timeout=10)]) == prompt
                assert job.record is not None and job.record.output == prompt
            await asyncio.to_thread(client.zk.sync, "/")
            return watches_of(zk_cluster, client.zk.client_id[0])

    assert asyncio.run(run()) <= 2


def test_async_streams_that_end_unclaimed_or_withdrawn_leave_no_watches_behind(
    zk_cluster: ZkCluster, hosts: str, root: str
) -> None:
    """No worker: one stream's job is cancelled while pending (a result, and never a claim:
    the watch waiting for the claim is taken back), another's request is withdrawn (the
    stream raises JobWithdrawn, and takes its watches back)."""

    async def run() -> tuple[str, int]:
        async with AsyncClient(hosts, root) as client:
            session = client.zk.client_id[0]

            async def watched() -> None:  # the stream has read once and set its watches
                for _ in range(500):
                    if watches_of(zk_cluster, session) >= 3:
                        return
                    await asyncio.sleep(0.01)
                raise AssertionError("the stream set no watches")

            job = await client.submit("never claimed", stream=True)
            reading = asyncio.ensure_future(_joined(job.stream(timeout=30)))
            await watched()
            assert await client.job(job.id, job.queue, job.priority, job.entry).cancel()
            assert await reading == "" and job.record is not None
            status = job.record.status

            job = await client.submit("withdrawn", stream=True)
            reading = asyncio.ensure_future(_joined(job.stream(timeout=30)))
            await watched()
            await client.job(job.id, job.queue, job.priority, job.entry).withdraw()
            with pytest.raises(JobWithdrawn):
                await reading
            await asyncio.to_thread(client.zk.sync, "/")
            return status, watches_of(zk_cluster, session)

    status, left = asyncio.run(run())
    assert status == "cancelled" and left == 0


async def _joined(pieces: Any) -> str:
    return "".join([piece async for piece in pieces])
