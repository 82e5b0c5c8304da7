"""The asyncio producer API against a real ZooKeeper and in-process echo workers."""

from __future__ import annotations

import asyncio
import contextlib
import json
import threading
import time
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

import pytest

from tests.conftest import Relay, registered, wait_for
from tests.runners import GateRunner
from workers.runners.echo import EchoRunner
from zkqueue import AsyncClient, Client, JobTimeout, QueueFull, ZkqConnectionError
from zkqueue.producer import aio as aio_module
from zkqueue.protocol import counts
from zkqueue.protocol.result import CANCELLED

T = TypeVar("T")


def run(hosts: str, root: str, body: Callable[[AsyncClient], Awaitable[T]]) -> T:
    """Run ``body`` with a started AsyncClient on a fresh event loop."""

    async def main() -> T:
        async with AsyncClient(hosts, root, session_timeout=4.0) as client:
            return await body(client)

    return asyncio.run(main())


def test_submit_and_await_the_result(hosts: str, root: str, client: Client, start_worker) -> None:
    start_worker(EchoRunner())

    async def body(aio: AsyncClient) -> Any:
        job = await aio.submit("hello there", priority="high", max_new_tokens=8)
        return job, await job.result(timeout=30)

    job, record = run(hosts, root, body)
    assert record.ok and record.output == "hello there" and record.priority == "high"
    # An attached result is removed once its caller has read it.
    wait_for(lambda: not client.zk.exists(client.layout.result("default", job.id)))


def test_stream_yields_pieces_that_add_up_to_the_output(
    hosts: str, root: str, start_worker
) -> None:
    start_worker(EchoRunner(delay=2.0))
    prompt = " ".join(f"w{i}" for i in range(12))

    async def body(aio: AsyncClient) -> tuple[list[str], str]:
        job = await aio.submit(prompt, stream=True)
        pieces = [p async for p in job.stream(timeout=30)]
        return pieces, (await job.result()).output

    pieces, output = run(hosts, root, body)
    assert "".join(pieces) == prompt == output
    assert len(pieces) >= 3, pieces  # it arrived in parts, not only at the end


def test_timeout_withdraws_the_attached_request(hosts: str, root: str, client: Client) -> None:
    async def body(aio: AsyncClient) -> None:
        job = await aio.submit("nobody serves this")
        with pytest.raises(JobTimeout):
            await job.result(timeout=0.3)
        stream_job = await aio.submit("nor this", stream=True)
        with pytest.raises(JobTimeout):
            [p async for p in stream_job.stream(timeout=0.3)]

    run(hosts, root, body)
    assert client.list() == []


def test_cancelling_the_waiting_task_withdraws_the_job_at_once(
    hosts: str, root: str, client: Client
) -> None:
    async def body(aio: AsyncClient) -> float:
        job = await aio.submit("the caller goes away", stream=True)
        task = asyncio.ensure_future(job.result(timeout=60))
        await asyncio.sleep(0.1)  # let it start waiting
        assert client.list(), "the job is pending"
        task.cancel()
        started = time.monotonic()
        with pytest.raises(asyncio.CancelledError):
            await task
        while client.list():
            await asyncio.sleep(0.01)
        return time.monotonic() - started

    assert run(hosts, root, body) < 1.0


def test_chat_messages_and_parameters_travel_in_the_spec(
    hosts: str, root: str, client: Client
) -> None:
    messages = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi"}]

    async def body(aio: AsyncClient) -> str:
        job = await aio.submit(
            messages=messages, max_new_tokens=5, temperature=0.5, seed=3, stop=["\n"], detach=True
        )
        assert job.entry_path is not None
        data, _ = client.zk.get(job.entry_path)
        return data.decode()

    spec = json.loads(run(hosts, root, body))
    assert spec["messages"] == messages and "prompt" not in spec
    assert (spec["max_new_tokens"], spec["temperature"], spec["seed"]) == (5, 0.5, 3)
    assert spec["stop"] == ["\n"]


def test_cancel_records_a_cancelled_result(
    hosts: str, root: str, client: Client, start_worker
) -> None:
    gate = GateRunner()
    start_worker(gate)

    async def body(aio: AsyncClient) -> Any:
        job = await aio.submit("held", detach=True)
        while not gate.started.is_set():
            await asyncio.sleep(0.01)
        assert await job.cancel()
        assert not await job.cancel()  # already ended
        return await job.result(timeout=10)

    assert run(hosts, root, body).status == CANCELLED


def test_workers_and_queue_limit(hosts: str, root: str, client: Client, start_worker) -> None:
    start_worker(EchoRunner(), queue="llama")
    wait_for(registered(client, 1))
    client.set_max_pending("full", 1)

    async def body(aio: AsyncClient) -> list[dict[str, Any]]:
        await aio.submit("one", queue="full", detach=True)
        assert await aio.waiting("full") == 1
        with pytest.raises(QueueFull):
            await aio.submit("two", queue="full", detach=True)
        assert "full" in await aio.queue_names()
        return await aio.workers()

    records = run(hosts, root, body)
    assert [r["queue"] for r in records] == ["llama"]


def test_waiting_on_many_jobs_holds_no_thread_per_job(hosts: str, root: str, start_worker) -> None:
    async def body(aio: AsyncClient) -> tuple[int, int, list[str]]:
        jobs = [await aio.submit(f"job {i}") for i in range(200)]
        # kazoo's threads and the pool threads that connected and enqueued (a fixed few)
        base = threading.active_count()
        waits = asyncio.ensure_future(asyncio.gather(*(j.result(timeout=60) for j in jobs)))
        await asyncio.sleep(0.3)
        during = threading.active_count()
        await asyncio.to_thread(start_worker, EchoRunner(), slots=16)
        done = await waits
        return during - base, len(done), [r.status for r in done]

    added, count, statuses = run(hosts, root, body)
    assert count == 200 and set(statuses) == {"succeeded"}
    assert added <= 0, added


def test_a_busy_default_executor_does_not_stall_the_client(hosts: str, root: str) -> None:
    """The application fills the loop's default executor: zkq's blocking calls (connect, a
    queue's first use, the create) run on the client's own threads and still go through."""
    from concurrent.futures import ThreadPoolExecutor

    async def main() -> str:
        loop = asyncio.get_running_loop()
        loop.set_default_executor(ThreadPoolExecutor(1))
        gate = threading.Event()
        busy = loop.run_in_executor(None, gate.wait)

        async def use() -> str:
            async with AsyncClient(hosts, root, session_timeout=4.0) as aio:
                return (await aio.submit("x", detach=True)).id

        try:
            return await asyncio.wait_for(use(), 15)
        finally:
            gate.set()
            await busy

    assert asyncio.run(main()).startswith("_")


def test_a_closed_client_refuses_work_and_keeps_no_threads(hosts: str, root: str) -> None:
    from zkqueue.errors import ZkqConnectionError

    async def main() -> None:
        aio = await AsyncClient(hosts, root, session_timeout=4.0).start()
        await aio.submit("x", detach=True)
        closing = asyncio.ensure_future(aio.close())
        await asyncio.sleep(0)  # close() is under way (its session close on a thread of its own)
        closing.cancel()  # ... and its caller gives up: the pool still goes
        with contextlib.suppress(asyncio.CancelledError):
            await closing
        assert aio._pool is None
        with pytest.raises(ZkqConnectionError, match="not started, or closed"):
            await aio.submit("y", detach=True, queue="another")

    asyncio.run(main())
    wait_for(
        lambda: not any(t.name.startswith("zkq-aio") for t in threading.enumerate()),
        message="the client's threads ended",
    )


def test_close_does_not_wait_for_a_busy_pool(hosts: str, root: str) -> None:
    """Every one of the client's threads is busy (as submits sent while ZooKeeper is away wait
    for it to come back): closing the session does not queue behind them, and ends what waits
    on it."""

    async def main() -> None:
        aio = await AsyncClient(hosts, root, session_timeout=4.0, blocking_threads=1).start()
        taken, gate = threading.Event(), threading.Event()

        def hold() -> None:
            taken.set()
            gate.wait()

        busy = asyncio.ensure_future(aio.blocking(hold))
        assert await asyncio.to_thread(taken.wait, 15), "the pool's thread was not taken"
        try:
            await asyncio.wait_for(aio.close(), 15)
        finally:
            gate.set()
            await busy

    asyncio.run(main())


def test_a_submit_while_zookeeper_is_away_fails_naming_the_job(
    relay: Relay, root: str, monkeypatch: pytest.MonkeyPatch
) -> None:
    """A submit while ZooKeeper is away waits for it at most ``connect_timeout``: in its checks
    it fails saying nothing was enqueued; past them (they passed just before ZooKeeper went)
    the create is not sent, and it fails with the job's id to look up. Back within the session,
    nothing of either arrives."""

    async def main() -> None:
        hosts = f"127.0.0.1:{relay.port}"
        async with AsyncClient(hosts, root, session_timeout=8.0, connect_timeout=1.0) as aio:
            await aio.submit("before", detach=True)  # the queue and its tail are known
            relay.cut()
            deadline = time.monotonic() + 15
            while aio.zk.connected and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not aio.zk.connected, "the client did not notice ZooKeeper going away"
            with pytest.raises(ZkqConnectionError, match="nothing was enqueued") as checking:
                await asyncio.wait_for(aio.submit("while away", detach=True), 15)
            assert checking.value.job_id is None

            async def checked(*_args: object) -> None:
                return None

            monkeypatch.setattr(aio_module, "read_through_loss_async", checked)
            with pytest.raises(ZkqConnectionError) as caught:
                await asyncio.wait_for(aio.submit("while away", detach=True), 15)
            job_id = caught.value.job_id
            assert job_id is not None and f"zkq status {job_id}" in str(caught.value)
            relay.restore()
            while not aio.zk.connected and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            # A sync answered comes after anything this session had queued before it.
            await aio.wait(aio.zk.sync_async("/"))
            assert await aio.waiting("default") == 1  # "before" alone

    asyncio.run(main())


def test_a_submit_rides_through_a_short_outage(relay: Relay, root: str, client: Client) -> None:
    """Within ``connect_timeout`` a submit made while ZooKeeper is away (its queue not yet
    set up by this client: reads first) waits for it and goes through once it is back."""

    async def main() -> None:
        hosts = f"127.0.0.1:{relay.port}"
        async with AsyncClient(hosts, root, session_timeout=10.0, connect_timeout=20.0) as aio:
            relay.cut()
            deadline = time.monotonic() + 15
            while aio.zk.connected and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not aio.zk.connected, "the client did not notice ZooKeeper going away"
            submit = asyncio.ensure_future(aio.submit("during the outage", detach=True))
            await asyncio.sleep(0.3)
            assert not submit.done(), "the submit did not wait for ZooKeeper"
            relay.restore()
            job = await asyncio.wait_for(submit, 15)
            assert counts.find(client.zk, client.layout, "default", "normal", job.id)

    asyncio.run(main())


def test_a_request_abandoned_while_zookeeper_is_away_is_withdrawn_once_it_is_back(
    relay: Relay, root: str, client: Client
) -> None:
    """The session outlives a short outage, and the attached entry with it: the withdrawal
    made meanwhile is sent when ZooKeeper is back, so no worker runs the job for nobody."""

    async def main() -> None:
        hosts = f"127.0.0.1:{relay.port}"
        async with AsyncClient(hosts, root, session_timeout=10.0) as aio:
            job = await aio.submit("nobody waits for me")  # attached; no worker runs it
            assert counts.waiting(client.zk, client.layout, "default") == 1
            relay.cut()
            deadline = time.monotonic() + 15
            while aio.zk.connected and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            assert not aio.zk.connected, "the client did not notice ZooKeeper going away"
            job.abandon()
            relay.restore()
            while not aio.zk.connected and time.monotonic() < deadline:
                await asyncio.sleep(0.05)
            await aio.wait(aio.zk.sync_async("/"))
            wait_for(
                lambda: counts.waiting(client.zk, client.layout, "default") == 0,
                message="the entry withdrawn",
            )

    asyncio.run(main())


def test_blocking_threads_must_be_positive() -> None:
    with pytest.raises(ValueError, match="at least 1"):
        AsyncClient(blocking_threads=0)
