"""The data plane: a streaming job's output goes from its worker to its reader directly; the claim
names the stream and its secret; readers without the secret are refused; a reader that cannot
reach the worker falls back to the claim; a worker killed mid-stream never truncates silently."""

from __future__ import annotations

import asyncio
import json
import logging
import pickle
import signal
import subprocess
import time

import httpx
import pytest

from tests.conftest import ZKQ, _env, running_on, wait_for
from workers.runners.echo import EchoRunner
from workers.streams import visible
from zkqueue import AsyncClient, Client
from zkqueue.errors import ExitCode, StreamInterrupted
from zkqueue.plumbing.connection import ConnectionSettings
from zkqueue.producer import direct
from zkqueue.protocol import streaming
from zkqueue.protocol.layout import Layout
from zkqueue.protocol.records import ClaimBody
from zkqueue.protocol.streaming import EventReader, StreamEvent

WORDS = " ".join(f"w{i}" for i in range(16))


def claim_of(client: Client, job_id: str) -> ClaimBody:
    data, _ = client.zk.get(Layout(client.layout.root).claim("default", job_id))
    return ClaimBody.from_bytes(data)


def test_the_claim_names_a_stream_and_the_tokens_never_go_through_zookeeper(
    client: Client, hosts: str, root: str, start_worker
) -> None:
    registry = start_worker(EchoRunner(delay=2.0)).worker.metrics.registry
    claims_seen: list[ClaimBody] = []
    readers: list[float | None] = []

    async def read() -> tuple[list[str], str]:
        async with AsyncClient(hosts, root) as aio:
            job = await aio.submit(WORDS, stream=True)
            pieces = []
            async for piece in job.stream(timeout=30):
                pieces.append(piece)
                if len(pieces) == 2:
                    claims_seen.append(await asyncio.to_thread(claim_of, client, job.id))
                    readers.append(registry.get_sample_value("zkq_stream_readers"))
            assert job.record is not None
            return pieces, job.record.output

    pieces, output = asyncio.run(read())
    assert readers == [1.0]  # the worker's gauge counted this reader
    assert registry.get_sample_value("zkq_stream_claim_writes_total") == 0
    assert "".join(pieces) == output == WORDS
    assert len(pieces) >= 6, pieces  # a piece per word (the echo runner's tick), not 4 a second
    claim = claims_seen[0]
    assert claim.stream is not None and claim.stream.startswith("http://")
    (worker,) = client.workers()
    assert claim.stream == f"{worker['streams']}/{claim.stream.rsplit('/', 1)[1]}"
    assert claim.secret and len(claim.secret) >= 24
    assert claim.partial is None  # a direct reader took it: nothing written into the claim


def test_a_reader_needs_the_secret_and_a_late_one_gets_the_text_so_far(
    client: Client, start_worker
) -> None:
    start_worker(EchoRunner(delay=3.0))
    job = client.submit(WORDS, stream=True)
    wait_for(lambda: running_on(client, job.id) is not None, message="job running")
    claim = claim_of(client, job.id)
    assert claim.stream is not None
    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": claim.secret or ""}):
        refused = httpx.get(claim.stream, headers=headers, timeout=5)
        assert refused.status_code == 403, headers
        assert claim.secret not in refused.text
    time.sleep(1.0)  # about four words generated before this reader comes
    reader, events = EventReader(), []
    auth = {"Authorization": f"Bearer {claim.secret}"}
    with httpx.stream("GET", claim.stream, headers=auth, timeout=10) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("text/event-stream")
        for line in answer.iter_lines():
            event = reader.feed(line)
            if event is not None:
                events.append(event)
                if event.kind != "message":
                    break
    first = events[0]
    assert first.offset == 0 and len(first.text.split()) >= 2, first  # the words so far, at once
    assert events[-1].kind == "end" and events[-1].status == "succeeded"
    text = ""
    for event in events[:-1]:
        assert event.offset == len(text)
        text += event.text
    assert text == job.result(timeout=30).output == WORDS
    resumed = httpx.get(claim.stream, headers=auth, params={"offset": 3}, timeout=5)
    assert resumed.status_code == 404  # ended: the result is in ZooKeeper now


@pytest.mark.parametrize("reader", ["Job", "AsyncJob"])
def test_a_reader_that_cannot_reach_the_worker_streams_from_the_claim(
    reader: str,
    client: Client,
    hosts: str,
    root: str,
    start_worker,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    # The claims name an address nothing listens on (a firewall between reader and worker).
    worker = start_worker(EchoRunner(delay=2.0), stream_advertise="127.0.0.1:1")
    caplog.set_level(logging.WARNING, logger="zkq.stream")
    monkeypatch.setattr(direct, "_warned", set())  # said once per process and address
    if reader == "Job":
        job = client.submit(WORDS, stream=True)
        pieces = list(job.stream(timeout=30))
        output = job.result().output
    else:

        async def stream_async() -> tuple[list[str], str]:
            async with AsyncClient(hosts, root) as aio:
                job = await aio.submit(WORDS, stream=True)
                pieces = [piece async for piece in job.stream(timeout=30)]
                return pieces, (await job.result()).output

        pieces, output = asyncio.run(stream_async())
    assert "".join(pieces) == output == WORDS
    assert len(pieces) >= 2, pieces  # the claim's partial output, then the rest
    said = [r.getMessage() for r in caplog.records if r.name == "zkq.stream"]
    assert any("127.0.0.1:1" in line and "claim" in line for line in said), said
    writes = worker.worker.metrics.registry.get_sample_value("zkq_stream_claim_writes_total")
    assert writes is not None and writes >= 1  # the fallback is visible to the operator


def test_a_worker_without_the_data_plane_streams_through_claims(
    client: Client, start_worker
) -> None:
    worker = start_worker(EchoRunner(delay=2.0), stream=False)
    assert worker.worker.streams is None
    job = client.submit(WORDS, stream=True)
    pieces = list(job.stream(timeout=30))
    assert "".join(pieces) == WORDS
    assert len(pieces) >= 3, pieces


def test_a_worker_killed_mid_stream_interrupts_the_stream_and_loses_no_job(
    client: Client, spawn_worker
) -> None:
    first = spawn_worker("--runner", "echo", "--echo-delay", "6", "--lease", "2")
    wait_for(lambda: len(client.workers()) >= 1, message="worker registered")
    job = client.submit(WORDS, stream=True, detach=True)
    got, started = [], time.monotonic()
    with pytest.raises(StreamInterrupted, match="stopped after"):
        for piece in job.stream(timeout=60):
            got.append(piece)
            if first.poll() is None:
                first.send_signal(signal.SIGKILL)
    assert got and WORDS.startswith("".join(got))  # what came was true, and it said it stopped
    assert time.monotonic() - started < 5  # at once, not after the lease or the session
    spawn_worker("--runner", "echo", "--echo-delay", "0.5")
    record = client.job(job.id).result(timeout=60)
    assert record.ok and record.output == WORDS and record.attempts == 2


def test_a_job_cancelled_mid_stream_ends_with_its_record_not_an_interruption(
    client: Client, start_worker
) -> None:
    start_worker(EchoRunner(delay=4.0))
    job = client.submit(WORDS, stream=True)
    got = []
    for piece in job.stream(timeout=30):  # no StreamInterrupted: the job ended, cancelled
        got.append(piece)
        if len(got) == 2:
            assert client.job(job.id).cancel()
    assert 2 <= len(got) < len(WORDS.split()) and WORDS.startswith("".join(got))
    assert job.result().status == "cancelled"


def test_zkq_submit_stream_cut_by_a_killed_worker_exits_11(
    client: Client, spawn_worker, hosts: str, root: str
) -> None:
    worker = spawn_worker("--runner", "echo", "--echo-delay", "6", "--lease", "2")
    wait_for(lambda: len(client.workers()) >= 1, message="worker registered")
    command = [*ZKQ, "--zk", hosts, "--root", root, "submit", "--stream", WORDS]
    with subprocess.Popen(
        command, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
    ) as proc:
        assert proc.stdout is not None and proc.stderr is not None
        first = proc.stdout.read(2)  # "w0": the stream has begun
        worker.send_signal(signal.SIGKILL)
        out = first + proc.stdout.read()
        err = proc.stderr.read()
        proc.wait(60)
    assert proc.returncode == ExitCode.STREAM_INTERRUPTED, err
    assert "stream of job" in err and "stopped after" in err and "Traceback" not in err, err
    assert "submit it again" in err and "result()" not in err, err  # withdrawn as zkq exits
    assert WORDS.startswith(out.strip())


def test_a_retry_streams_in_full_when_nothing_was_sent_yet(
    client: Client, spawn_worker, start_worker
) -> None:
    first = spawn_worker("--runner", "echo", "--echo-delay", "30", "--lease", "2")
    wait_for(lambda: len(client.workers()) >= 1, message="worker registered")
    job = client.submit("x" * 10, stream=True, detach=True)  # one word: no piece until the end
    wait_for(lambda: running_on(client, job.id) is not None, message="job running")
    first.send_signal(signal.SIGKILL)
    first.wait(10)
    start_worker(EchoRunner(delay=0.5))
    assert list(job.stream(timeout=60)) == ["x" * 10]


def test_a_gateway_stream_cut_by_a_killed_worker_ends_with_an_error_event(
    gateway, spawn_worker, client: Client
) -> None:
    worker = spawn_worker("--runner", "echo", "--echo-delay", "6", "--lease", "2")
    wait_for(lambda: len(client.workers()) >= 1, message="worker registered")
    served = gateway().url
    body = {"model": "default", "prompt": WORDS, "max_tokens": 100, "stream": True}
    events = []
    with httpx.stream("POST", f"{served}/v1/completions", json=body, timeout=30) as answer:
        for line in answer.iter_lines():
            if not line.startswith("data: "):
                continue
            events.append(line.removeprefix("data: "))
            chunk = json.loads(events[-1]) if events[-1] != "[DONE]" else None
            if chunk and chunk.get("choices") and worker.poll() is None:
                worker.send_signal(signal.SIGKILL)
    assert events[-1] == "[DONE]"
    error = json.loads(events[-2])
    assert error["error"]["code"] == "stream_interrupted", error
    assert error["error"]["message"].endswith("the request was withdrawn: send it again"), error
    texts = [json.loads(e)["choices"][0]["text"] for e in events[:-2] if "choices" in e]
    assert texts and WORDS.startswith("".join(texts))


@pytest.mark.parametrize(
    ("text", "stops", "shown"),
    [
        ("Hello wor", None, "Hello wor"),
        ("Hello wor", ("world",), "Hello "),  # "wor" may be the start of the stop
        ("Hello world and more", ("world",), "Hello "),
        ("Hello w", ("xyz", "wq"), "Hello "),
        ("Hello", ("lo!", "o"), "Hell"),
        ("abc", ("d",), "abc"),
    ],
)
def test_a_stream_shows_no_text_a_stop_string_may_cut(
    text: str, stops: tuple[str, ...] | None, shown: str
) -> None:
    assert visible(text, stops) == shown


def test_stream_interrupted_keeps_its_parts_through_pickle() -> None:
    # A process pool sends exceptions back pickled.
    again = pickle.loads(pickle.dumps(StreamInterrupted("job-1", 12, "the worker died")))
    assert (again.job_id, again.sent, again.why) == ("job-1", 12, "the worker died")
    assert str(again) == str(StreamInterrupted("job-1", 12, "the worker died"))


def test_an_async_tap_reads_long_lines_cut_anywhere() -> None:
    """AsyncTap splits a stream's lines itself: a piece longer than aiohttp's line buffer (a
    late reader's first piece is all the text so far), lines and characters cut across
    chunks, CRLF line ends; from a real HTTP server sending the events in 777-byte writes."""
    from aiohttp import web

    text = "Grüße, 日本 " * 200_000
    body = StreamEvent(streaming.PIECE, text, 0).to_bytes().replace(b"\n", b"\r\n")
    body += StreamEvent(streaming.END, status="succeeded").to_bytes()

    async def events(request: web.Request) -> web.StreamResponse:
        assert request.headers["Authorization"] == "Bearer the-secret"
        answer = web.StreamResponse(headers={"Content-Type": "text/event-stream"})
        await answer.prepare(request)
        for start in range(0, len(body), 777):
            await answer.write(body[start : start + 777])
        return answer

    async def run() -> direct.AsyncTap:
        app = web.Application()
        app.router.add_get(f"{streaming.PATH}/{{job}}", events)
        server = web.AppRunner(app)
        await server.setup()
        site = web.TCPSite(server, "127.0.0.1", 0)
        await site.start()
        port = site._server.sockets[0].getsockname()[1]  # type: ignore[union-attr]
        url = f"http://127.0.0.1:{port}{streaming.PATH}/job"
        claim = ClaimBody("w", 1, 0.0, 30.0, stream=url, secret="the-secret")
        http = direct.http_client(ConnectionSettings("127.0.0.1:1"), asynchronous=True)
        try:
            tap = direct.AsyncTap(http, claim, lambda: None)
            await asyncio.wait_for(tap._task, 30)
            return tap
        finally:
            await http.close()
            await server.cleanup()

    tap = asyncio.run(run())
    assert len(body) > 2**17
    assert (tap.state, tap.text) == (direct.TapState.ENDED, text)
