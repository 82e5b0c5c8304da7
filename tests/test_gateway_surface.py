"""``zkq serve``: models, health, metrics and error shapes, the process, a real tiny model."""

from __future__ import annotations

import json
import logging
import re
import signal
import socket
import subprocess
import sys
from pathlib import Path

import httpx
import openai
import pytest

from gateway.config import GatewayConfig
from tests.conftest import _env, registered, wait_for
from tests.gateway_fixtures import CHAT, ChatEcho
from zkqueue import Client

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
    inf = {"X-Zkq-Timeout": "inf"}  # as long as allowed: the configured cap, not a 400
    assert gw.openai().completions.create(model="tiny-chat", prompt="x", extra_headers=inf)
    assert "zkq_queue_depth" in text or "zkq_workers" in text  # the cluster's gauges
    for response in (
        httpx.post(f"{gw.url}/v1/completions", content=b"{not json"),
        httpx.post(f"{gw.url}/v1/chat/completions", json={"model": "tiny-chat"}),
        httpx.get(f"{gw.url}/v1/nothing-here"),
    ):
        assert response.status_code in (400, 404)
        assert set(response.json()["error"]) == {"message", "type", "param", "code"}
    for name in ("a1", "b2", "c3"):  # any path a client makes up is one label, not one each
        assert httpx.get(f"{gw.url}/v1/models/{name}").status_code == 404
    text = httpx.get(f"{gw.url}/metrics").text
    assert 'zkq_gateway_requests_total{code="404",endpoint="/v1/models/{model}"} 3.0' in text
    # The model list (once) and one model (once) answered above count too.
    assert 'zkq_gateway_requests_total{code="200",endpoint="/v1/models"} 1.0' in text
    assert 'zkq_gateway_requests_total{code="200",endpoint="/v1/models/{model}"} 1.0' in text
    assert "a1" not in text and "/v1/nothing-here" not in text


def test_metrics_and_the_info_line_time_each_job(served, caplog) -> None:
    gw = served()
    caplog.set_level(logging.INFO, logger="zkq.gateway")
    stream = gw.openai().completions.create(model="default", prompt="a b c", stream=True)
    assert "".join(chunk.choices[0].text for chunk in stream if chunk.choices) == "a b c"
    gw.openai().completions.create(model="default", prompt="not streamed")

    def ended() -> list[logging.LogRecord]:
        return [r for r in caplog.records if r.name == "zkq.gateway" and "job" in vars(r)]

    wait_for(lambda: len(ended()) == 2, message="a line for each job")  # written after the body
    text = httpx.get(f"{gw.url}/metrics").text
    # Only a stream has a first text; both jobs waited in the queue.
    assert 'zkq_gateway_first_text_seconds_count{endpoint="completions"} 1.0' in text
    assert 'zkq_gateway_queue_seconds_count{endpoint="completions"} 2.0' in text
    # The echo runner stamps no first token; the stream's line has its first text sent. Steps
    # may come out before the arrival: ZooKeeper stamps the submission in whole milliseconds.
    whole, streamed = sorted((r.getMessage() for r in ended()), key=lambda m: "first text" in m)
    ms = r"[+-][0-9]+\.[0-9] ms"
    said = rf"completions succeeded: submitted {ms}, claimed {ms}, "
    ended_at = rf"ended {ms} from the request"
    assert re.fullmatch(said + rf"first text sent {ms}, " + ended_at, streamed), streamed
    assert re.fullmatch(said + ended_at, whole), whole


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
        assert f"zkq serve: listening on 127.0.0.1:{port}" in proc.stdout.read().decode()
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
    spawn_worker(
        "--model", str(model), "--device", "cpu", "--vram-budget", "64MiB", "--no-calibrate"
    )
    wait_for(registered(client, 1), timeout=120, message="model worker registered")
    gw = gateway()
    api = gw.openai()
    (listed,) = httpx.get(f"{gw.url}/v1/models").json()["data"]
    assert listed["runners"] == ["tiny"]  # the model's name, not the server's path to it
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


def test_chat_history_as_sdks_resend_it() -> None:
    """An earlier answer resent as the SDK dumps it (name, tool_calls: null...) is accepted;
    a message that really asks for tools is refused, naming the field."""
    from openai.types.chat import ChatCompletionMessage

    from gateway import openai_format as fmt
    from gateway.errors import ApiError

    answer = ChatCompletionMessage(role="assistant", content="Hello").model_dump()
    history = [
        {"role": "system", "content": "Be brief.", "name": "setup"},
        {"role": "user", "content": "Hi", "name": "alice"},
        answer,  # as the SDK dumps an earlier answer: its optional fields null
        {"role": "user", "content": "Again"},
    ]
    request = fmt.parse(fmt.CHAT, {"model": "m", "messages": history}, 64)
    assert request.messages is not None
    assert [m["role"] for m in request.messages] == ["system", "user", "assistant", "user"]
    assert all(set(m) == {"role", "content"} for m in request.messages)
    calls = [{"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]
    for bad, param in (
        ({"role": "assistant", "content": "x", "tool_calls": calls}, "messages[0].tool_calls"),
        ({"role": "user", "content": "x", "name": 5}, "messages[0].name"),
        ({"role": "user", "content": "x", "weight": 1}, "messages[0].weight"),
    ):
        with pytest.raises(ApiError) as caught:
            fmt.parse(fmt.CHAT, {"model": "m", "messages": [bad]}, 64)
        assert (caught.value.status, caught.value.body()["error"]["param"]) == (400, param)
