"""``zkq serve`` against real ZooKeeper and in-process workers, driven by the official ``openai``
client (unchanged), by httpx for what the client hides (disconnects, headers), and as a process."""

from __future__ import annotations

import threading
import time
from concurrent.futures import ThreadPoolExecutor
from typing import Any

import httpx
import openai
import pytest

from gateway.config import ApiKey, GatewayConfig
from tests.conftest import registered, wait_for
from tests.gateway_fixtures import CHAT, RENDERED, ChatEcho, GatewayThread, pending_names
from tests.runners import GateRunner
from workers.runners.echo import EchoRunner
from zkqueue import Client

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
    message = late.value.body["message"]  # type: ignore[index]
    assert message.count("withdrawn") == 1, message  # said once
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


def test_a_request_open_past_the_drain_timeout_is_answered_503(
    hosts: str, root: str, start_worker, client: Client
) -> None:
    """SIGTERM drains open requests for --drain-timeout; one still waiting then is answered
    in OpenAI's shape (503 shutting_down), not a bare 500, and its job is withdrawn."""
    gate = GateRunner()
    start_worker(gate)
    wait_for(registered(client, 1))
    gw = GatewayThread(hosts, root, GatewayConfig(), drain_timeout=1).start()
    client.submit("holds the worker", detach=True)
    wait_for(lambda: gate.started.is_set())
    answers: list[httpx.Response] = []
    asking = threading.Thread(
        target=lambda: answers.append(
            httpx.post(f"{gw.url}/v1/completions", json={"model": "default", "prompt": "x"})
        )
    )
    asking.start()
    wait_for(lambda: len(pending_names(client)) == 1, message="the request's job queued")
    gw.stop()
    asking.join(15)
    assert answers[0].status_code == 503, answers[0].text
    assert answers[0].json()["error"]["code"] == "shutting_down"
    wait_for(lambda: pending_names(client) == [], message="the job withdrawn")
    gate.gate.set()


def test_service_tier_and_priority_fields_choose_the_band(served, client: Client) -> None:
    """OpenAI's service_tier and vLLM's integer priority pick the job's priority, capped at the
    key's maximum; an answer to a request that named a tier names the tier it ran at."""
    keys = (
        ApiKey(key="sk-batch-000", name="batch", priority="low", max_priority="normal"),
        ApiKey(key="sk-open-0000", name="open", priority="normal", max_priority="high"),
    )
    gw = served(config=GatewayConfig(keys=keys))
    open_key, batch = gw.openai("sk-open-0000"), gw.openai("sk-batch-000")
    hello = [{"role": "user", "content": "x"}]

    def ask(api: openai.OpenAI, **fields: Any) -> tuple[str, Any]:
        chat = api.chat.completions.with_raw_response
        raw = chat.create(model="default", messages=hello, **fields)  # type: ignore[arg-type]
        return raw.headers["x-zkq-priority"], raw.parse()

    priority, answer = ask(open_key, service_tier="priority")
    assert (priority, answer.service_tier) == ("high", "priority")
    assert ask(open_key, service_tier="flex")[0] == "low"
    assert ask(open_key, service_tier="default")[1].service_tier == "default"
    assert ask(open_key, service_tier="auto")[0] == "normal"  # the key's default
    assert ask(batch, service_tier="auto")[0] == "low"
    assert ask(open_key, extra_body={"priority": -5})[0] == "high"
    assert ask(open_key, extra_body={"priority": 3})[0] == "low"
    assert ask(open_key, extra_body={"priority": 0}, service_tier="flex")[0] == "normal"
    capped, answer = ask(batch, service_tier="priority")  # the key's max: normal
    assert (capped, answer.service_tier) == ("normal", "default")
    assert ask(batch, extra_body={"priority": -1})[0] == "normal"
    headed = ask(open_key, service_tier="flex", extra_headers={"X-Priority": "high"})
    assert headed[0] == "high"  # the header wins
    assert ask(open_key)[1].service_tier is None  # not asked: not named
    text = open_key.completions.with_raw_response.create(
        model="default", prompt="x", extra_body={"service_tier": "flex"}
    )
    assert text.http_response.json()["service_tier"] == "flex"
    stream = open_key.chat.completions.create(
        model="default", messages=hello, service_tier="flex", stream=True
    )  # type: ignore[call-overload]
    assert {c.service_tier for c in stream} == {"flex"}
    for body in ({"service_tier": "scale"}, {"priority": "high"}):
        with pytest.raises(openai.BadRequestError):
            open_key.chat.completions.create(model="default", messages=hello, extra_body=body)
