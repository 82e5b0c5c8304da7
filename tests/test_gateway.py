"""``zkq serve`` against real ZooKeeper and in-process workers, driven by the official ``openai``
client (unchanged), by httpx for what the client hides (disconnects, headers), and as a process."""

from __future__ import annotations

import asyncio
import dataclasses
import json
import signal
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Iterator
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import httpx
import openai
import pytest

from gateway.commands import run as run_gateway
from gateway.config import ApiKey, GatewayConfig
from tests.conftest import _env, registered, wait_for
from tests.runners import GateRunner
from workers.runners.base import Outcome, RunningJob
from workers.runners.echo import EchoRunner
from zkqueue import AsyncClient, Client

CHAT = [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "Hi there"}]
RENDERED = "system: Be brief.\nuser: Hi there\nassistant:"


class ChatEcho(EchoRunner):
    """Echo that answers a chat with its plain rendering and counts words as tokens, like a
    model runner reporting prompt_tokens and output_tokens."""

    def run(self, jobs: list[RunningJob]) -> list[Outcome]:
        for job in jobs:
            if job.spec.messages is not None:
                job.spec = dataclasses.replace(job.spec, prompt=job.spec.text, messages=None)
        outcomes = super().run(jobs)
        for job, outcome in zip(jobs, outcomes, strict=True):
            outcome.extra["prompt_tokens"] = len(job.spec.prompt.split())
        return outcomes


class GatewayThread:
    """``zkq serve`` in this process, on its own thread and event loop, on a free port."""

    def __init__(self, hosts: str, root: str, config: GatewayConfig) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server: Any = None
        client = AsyncClient(hosts, root, session_timeout=4.0)
        job = run_gateway(client, config, sock=self.sock, started=self._started)
        self.thread = threading.Thread(target=asyncio.run, args=(job,), daemon=True)

    def _started(self, server: Any) -> None:
        self.server = server

    def start(self) -> GatewayThread:
        self.thread.start()
        wait_for(lambda: self.server is not None and self.server.started, message="gateway up")
        return self

    def stop(self) -> None:
        self.server.should_exit = True
        self.thread.join(15)

    def openai(self, key: str = "none") -> openai.OpenAI:
        return openai.OpenAI(base_url=f"{self.url}/v1", api_key=key, max_retries=0, timeout=30)


@pytest.fixture
def gateway(hosts: str, root: str) -> Iterator[Callable[..., GatewayThread]]:
    started: list[GatewayThread] = []

    def start(config: GatewayConfig | None = None) -> GatewayThread:
        handle = GatewayThread(hosts, root, config or GatewayConfig()).start()
        started.append(handle)
        return handle

    yield start
    for handle in started:
        handle.stop()


@pytest.fixture
def served(
    gateway: Callable[..., GatewayThread], start_worker, client: Client
) -> Callable[..., GatewayThread]:
    """A gateway with one worker (ChatEcho unless given) registered on queue ``default``."""

    def start(runner: Any = None, config: GatewayConfig | None = None, **kw: Any) -> Any:
        start_worker(runner or ChatEcho(), **kw)
        wait_for(registered(client, 1))
        return gateway(config)

    return start


def pending_names(client: Client) -> list[str]:
    return [row["id"] for row in client.list() if row["state"] == "pending"]


# -- the openai client ---------------------------------------------------------------------------


def test_completion_with_usage_finish_reason_and_job_id(served) -> None:
    api = served().openai()
    raw = api.completions.with_raw_response.create(
        model="default", prompt="hello big world", max_tokens=16
    )
    answer = raw.parse()
    assert answer.object == "text_completion" and answer.model == "default"
    assert answer.choices[0].text == "hello big world"
    assert answer.choices[0].finish_reason == "stop"
    assert (answer.usage.prompt_tokens, answer.usage.completion_tokens) == (3, 3)
    assert answer.usage.total_tokens == 6
    assert answer.id == f"cmpl-{raw.headers['x-zkq-job']}"
    short = api.completions.create(model="default", prompt="one two three", max_tokens=2)
    assert short.choices[0].finish_reason == "length"


def test_chat_completion_renders_the_messages(served) -> None:
    api = served().openai()
    answer = api.chat.completions.create(model="default", messages=CHAT, temperature=0.0, seed=1)
    assert answer.object == "chat.completion"
    assert answer.choices[0].message.role == "assistant"
    assert answer.choices[0].message.content == RENDERED
    assert answer.choices[0].finish_reason == "stop"
    assert answer.usage.prompt_tokens == answer.usage.completion_tokens == len(RENDERED.split())


def test_streaming_chat_and_completion(served) -> None:
    api = served(ChatEcho(delay=1.5)).openai()
    chunks = list(
        api.chat.completions.create(
            model="default",
            messages=CHAT,
            stream=True,
            stream_options={"include_usage": True},
        )
    )
    assert chunks[0].choices[0].delta.role == "assistant"
    pieces = [
        c.choices[0].delta.content for c in chunks if c.choices and c.choices[0].delta.content
    ]
    assert "".join(pieces) == RENDERED and len(pieces) >= 2, pieces
    assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "stop"
    assert chunks[-1].choices == [] and chunks[-1].usage.completion_tokens == 7
    text = api.completions.create(model="default", prompt="a b c d e f", stream=True)
    parts = [c.choices[0].text for c in text]
    assert "".join(parts) == "a b c d e f" and len([p for p in parts if p]) >= 2


def test_errors_surface_as_the_clients_exceptions(served, client: Client) -> None:
    gate = GateRunner()
    api = served(gate).openai()
    cases: list[tuple[type[Exception], dict[str, Any]]] = [
        (openai.BadRequestError, {"n": 2}),
        (openai.BadRequestError, {"logprobs": 3}),
        (openai.BadRequestError, {"extra_body": {"best_of": 4}}),
        (openai.BadRequestError, {"extra_body": {"frobnicate": True}}),
        (openai.BadRequestError, {"temperature": -1}),
        (openai.BadRequestError, {"extra_headers": {"X-Priority": "urgent"}}),
    ]
    for error, extra in cases:
        with pytest.raises(error) as caught:
            api.completions.create(model="default", prompt="x", **extra)
        assert caught.value.body["type"] == "invalid_request_error", caught.value.body
    with pytest.raises(openai.BadRequestError, match="tools"):
        api.chat.completions.create(
            model="default",
            messages=CHAT,
            tools=[{"type": "function", "function": {"name": "f", "parameters": {}}}],
        )
    with pytest.raises(openai.NotFoundError) as missing:
        api.completions.create(model="no-such-model", prompt="x")
    assert missing.value.code == "model_not_found"
    # 429: the queue's backpressure limit, with Retry-After.
    client.set_max_pending("default", 1)
    client.submit("holds the worker", detach=True)
    wait_for(lambda: gate.started.is_set())
    client.submit("waits", detach=True)
    with pytest.raises(openai.RateLimitError) as full:
        api.completions.create(model="default", prompt="one too many")
    assert full.value.response.headers["retry-after"] == "1"
    gate.gate.set()


def test_api_keys_priorities_and_limits(served, client: Client) -> None:
    keys = (
        ApiKey(key="sk-batch-000", name="batch", priority="low", max_priority="normal"),
        ApiKey(
            key="sk-interactive", name="ui", priority="high", max_priority="high", max_in_flight=1
        ),
    )
    gate = GateRunner()
    gw = served(gate, GatewayConfig(keys=keys))
    with pytest.raises(openai.AuthenticationError):
        gw.openai("sk-wrong").completions.create(model="default", prompt="x")
    bare = httpx.get(f"{gw.url}/v1/models")  # no key at all
    assert bare.status_code == 401 and bare.json()["error"]["code"] == "invalid_api_key"
    batch = gw.openai("sk-batch-000")
    with pytest.raises(openai.PermissionDeniedError):
        batch.completions.create(model="default", prompt="x", extra_headers={"X-Priority": "high"})
    client.submit("holds the worker", detach=True)
    wait_for(lambda: gate.started.is_set())
    with ThreadPoolExecutor(2) as pool:
        low = pool.submit(batch.completions.with_raw_response.create, model="default", prompt="b")
        wait_for(lambda: len(pending_names(client)) == 1)
        ui = gw.openai("sk-interactive")
        first = pool.submit(ui.completions.with_raw_response.create, model="default", prompt="u")
        wait_for(lambda: len(pending_names(client)) == 2)
        with pytest.raises(openai.RateLimitError, match="open requests"):
            ui.completions.create(model="default", prompt="over its in-flight limit")
        gate.gate.set()
        assert low.result(30).headers["x-zkq-priority"] == "low"
        assert first.result(30).headers["x-zkq-priority"] == "high"


def test_high_priority_sent_after_normal_finishes_first(served, client: Client) -> None:
    gate = GateRunner()
    gw = served(gate)
    client.submit("holds the worker", detach=True)
    wait_for(lambda: gate.started.is_set())
    api = gw.openai()

    def ask(prompt: str, priority: str) -> str:
        headers = {"X-Priority": priority}
        answer = api.completions.create(model="default", prompt=prompt, extra_headers=headers)
        return answer.choices[0].text

    with ThreadPoolExecutor(6) as pool:
        normal = [pool.submit(ask, f"normal {i}", "normal") for i in range(3)]
        wait_for(lambda: len(pending_names(client)) == 3, message="normal requests queued")
        high = [pool.submit(ask, f"high {i}", "high") for i in range(3)]
        wait_for(lambda: len(pending_names(client)) == 6, message="high requests queued")
        gate.gate.set()
        answers = [f.result(30) for f in normal + high]
    assert answers == [f"normal {i}" for i in range(3)] + [f"high {i}" for i in range(3)]
    order = [job.spec.prompt for job in gate.running[1:]]
    assert {p.split()[0] for p in order[:3]} == {"high"}, order


def test_no_worker_is_503_and_caller_timeout_is_504(gateway, start_worker, client: Client) -> None:
    gw = gateway(GatewayConfig(models={"mapped": "elsewhere"}))
    api = gw.openai()
    for model in ("mapped", "default"):
        client.ensure_queue("default")  # the queue exists; nobody serves it
        with pytest.raises(openai.InternalServerError) as none:
            api.completions.create(model=model, prompt="x")
        assert none.value.status_code == 503 and none.value.code == "no_worker"
    gate = GateRunner()
    start_worker(gate)
    wait_for(registered(client, 1))
    client.submit("holds the worker", detach=True)
    wait_for(lambda: gate.started.is_set())
    started = time.monotonic()
    with pytest.raises(openai.APIStatusError) as late:
        api.completions.create(
            model="default", prompt="too slow", extra_headers={"X-Zkq-Timeout": "0.5"}
        )
    assert late.value.status_code == 504 and time.monotonic() - started < 5
    assert pending_names(client) == []  # withdrawn
    gate.gate.set()


# -- disconnects ---------------------------------------------------------------------------------


def test_disconnect_mid_stream_withdraws_the_job_within_a_second(served, client: Client) -> None:
    echo = EchoRunner(delay=60.0)
    gw = served(echo)
    body = {"model": "default", "prompt": " ".join(["word"] * 500), "stream": True}
    with (
        httpx.Client(timeout=30) as http,
        http.stream("POST", f"{gw.url}/v1/completions", json=body) as response,
    ):
        assert response.status_code == 200
        job_id = response.headers["x-zkq-job"]
        lines = response.iter_lines()
        while '"text":"word' not in next(lines):
            pass  # the job runs and streams
        assert client.list()[0]["state"] == "running"
        closed = time.monotonic()
        response.close()
    wait_for(lambda: client.list() == [], timeout=5)
    assert time.monotonic() - closed < 1.0
    assert client.zk.exists(client.layout.result("default", job_id)) is None


def test_disconnect_while_waiting_withdraws_the_job(served, client: Client) -> None:
    gate = GateRunner()
    gw = served(gate)
    client.submit("holds the worker", detach=True)
    wait_for(lambda: gate.started.is_set())
    with pytest.raises(httpx.ReadTimeout):
        httpx.post(
            f"{gw.url}/v1/completions", json={"model": "default", "prompt": "x"}, timeout=0.5
        )
    gone = time.monotonic()
    wait_for(lambda: pending_names(client) == [], timeout=5)
    assert time.monotonic() - gone < 1.0
    gate.gate.set()


# -- the rest of the surface ---------------------------------------------------------------------


def test_models_health_metrics_and_error_shapes(served) -> None:
    gw = served(config=GatewayConfig(models={"tiny-chat": "default", "gone": "nobody"}))
    models = gw.openai().models.list()
    assert [m.id for m in models.data] == ["tiny-chat"]
    assert models.data[0].owned_by == "zkq"
    assert gw.openai().models.retrieve("tiny-chat").id == "tiny-chat"
    assert httpx.get(f"{gw.url}/health").json() == {"status": "ok", "zookeeper": True}
    gw.openai().completions.create(model="tiny-chat", prompt="count me")
    text = httpx.get(f"{gw.url}/metrics").text
    assert 'zkq_gateway_requests_total{code="200",endpoint="/v1/completions"} 1.0' in text
    assert "zkq_queue_depth" in text or "zkq_workers" in text  # the cluster's gauges
    for response in (
        httpx.post(f"{gw.url}/v1/completions", content=b"{not json"),
        httpx.post(f"{gw.url}/v1/chat/completions", json={"model": "tiny-chat"}),
        httpx.get(f"{gw.url}/v1/nothing-here"),
    ):
        assert response.status_code in (400, 404)
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}


def test_python_m_gateway_serves_and_stops_on_sigterm(
    hosts: str, root: str, tmp_path: Path, start_worker, client: Client
) -> None:
    start_worker(ChatEcho())
    config = tmp_path / "serve.toml"
    config.write_text('[gateway]\nmax_tokens = 8\n[models]\n"echo" = "default"\n')
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    cmd = [
        sys.executable,
        "-m",
        "gateway",
        "--zk",
        hosts,
        "--root",
        root,
        "--port",
        str(port),
        "--config",
        str(config),
    ]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT)
    try:
        url = f"http://127.0.0.1:{port}"
        wait_for(lambda: _get(f"{url}/health") == 200, timeout=30, message="serve up")
        api = openai.OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0)
        answer = api.completions.create(model="echo", prompt="over HTTP")
        assert answer.choices[0].text == "over HTTP"
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(20) == 0
    finally:
        if proc.poll() is None:
            proc.kill()
    bad = subprocess.run(
        [*cmd[:3], "--zk", "127.0.0.1:1", "--connect-timeout", "1", "--port", str(port)],
        env=_env(),
        capture_output=True,
        text=True,
        timeout=30,
    )
    assert bad.returncode == 6, bad.stderr
    assert "Traceback" not in bad.stderr


def _get(url: str) -> int:
    try:
        return httpx.get(url, timeout=1).status_code
    except httpx.HTTPError:
        return 0


@pytest.mark.slow
def test_tiny_model_worker_answers_in_openai_shape(
    spawn_worker, gateway, client: Client, tmp_path: Path
) -> None:
    from workers.tinymodel import write_tiny_model

    model = write_tiny_model(tmp_path / "tiny", seed=0)
    spawn_worker("--model", str(model), "--device", "cpu", "--vram-budget", "64MiB")
    wait_for(registered(client, 1), timeout=120, message="model worker registered")
    api = gateway().openai()
    answer = api.chat.completions.create(model="default", messages=CHAT, max_tokens=5)
    assert answer.object == "chat.completion"
    assert answer.choices[0].message.role == "assistant"
    assert isinstance(answer.choices[0].message.content, str)
    assert answer.choices[0].finish_reason in ("stop", "length")
    assert answer.usage.total_tokens == answer.usage.prompt_tokens + answer.usage.completion_tokens
    stream = api.completions.create(model="default", prompt="Hello", max_tokens=5, stream=True)
    assert [c.object for c in stream][-1] == "text_completion"
    assert json.loads(json.dumps(answer.model_dump()))["id"].startswith("chatcmpl-")


def test_zkq_errors_map_to_one_status_each() -> None:
    from gateway.errors import from_zkq
    from zkqueue.errors import (
        AccessDenied,
        InvalidJob,
        JobTimeout,
        JobWithdrawn,
        QueueFull,
        ZkqConnectionError,
        ZkqError,
    )

    cases = {
        InvalidJob: 400,
        QueueFull: 429,
        ZkqConnectionError: 503,
        AccessDenied: 503,
        JobWithdrawn: 503,
        JobTimeout: 504,
        ZkqError: 500,
    }
    for error, status in cases.items():
        answer = from_zkq(error("why"), retry_after=3)
        assert answer.status == status, error
        assert set(answer.body()["error"]) == {"message", "type", "param", "code"}
    assert from_zkq(QueueFull("full"), retry_after=3).headers == {"Retry-After": "3"}
