"""Per-key rate limits at the gateway: requests and tokens a minute, token buckets per process,
429 with Retry-After and OpenAI's x-ratelimit-* headers on every answer; the official openai
client's own retry gets through after a 429."""

from __future__ import annotations

import threading
import time

import httpx
import pytest

from gateway.config import ApiKey, GatewayConfig, parse
from gateway.ratelimits import duration
from tests.conftest import wait_for
from workers.runners.echo import EchoRunner
from zkqueue import Client

KEY = "sk-limited-0"


def test_a_token_limit_answers_429_with_retry_after_and_the_client_retry_succeeds(
    served, client: Client
) -> None:
    # 1,200 tokens a minute refill 20 a second; each request below asks for 610 (3 for its
    # prompt, 607 for max_tokens): one fits, a second fits about a second later.
    key = ApiKey(key=KEY, name="limited", tokens_per_minute=1200)
    gw = served(EchoRunner(delay=3.0), GatewayConfig(keys=(key,)))
    body = {"model": "default", "prompt": "hello there", "max_tokens": 607}
    auth = {"Authorization": f"Bearer {KEY}"}
    first: list[httpx.Response] = []
    held = threading.Thread(
        target=lambda: first.append(
            httpx.post(f"{gw.url}/v1/completions", json=body, headers=auth, timeout=30)
        )
    )
    held.start()
    wait_for(lambda: client.list(), message="the first request's job")  # it took its share
    refused = httpx.post(f"{gw.url}/v1/completions", json=body, headers=auth, timeout=30)
    assert refused.status_code == 429, refused.text
    assert refused.json()["error"]["code"] == "tokens"
    assert 1 <= int(refused.headers["retry-after"]) <= 2
    assert refused.headers["x-ratelimit-limit-tokens"] == "1200"
    assert int(refused.headers["x-ratelimit-remaining-tokens"]) < 610
    assert refused.headers["x-ratelimit-reset-tokens"].endswith("s")
    assert "x-ratelimit-limit-requests" not in refused.headers  # no request limit configured

    started = time.monotonic()
    answer = (
        gw.openai(KEY)
        .with_options(max_retries=2)
        .completions.create(model="default", prompt="hello there", max_tokens=607)
    )
    assert answer.choices[0].text == "hello there"
    assert time.monotonic() - started >= 0.5  # it waited as told, then got through
    held.join(30)
    assert first[0].status_code == 200
    assert first[0].headers["x-ratelimit-limit-tokens"] == "1200"  # on every answer


def test_a_request_limit_counts_requests_and_says_so_on_every_answer(served) -> None:
    key = ApiKey(key=KEY, name="limited", requests_per_minute=2)
    gw = served(EchoRunner(delay=0.0), GatewayConfig(keys=(key,)))
    auth = {"Authorization": f"Bearer {KEY}"}
    body = {"model": "default", "prompt": "hi", "max_tokens": 4}
    answers = [
        httpx.post(f"{gw.url}/v1/completions", json=body, headers=auth, timeout=30)
        for _ in range(3)
    ]
    assert [a.status_code for a in answers] == [200, 200, 429]
    assert [a.headers["x-ratelimit-remaining-requests"] for a in answers] == ["1", "0", "0"]
    assert all(a.headers["x-ratelimit-limit-requests"] == "2" for a in answers)
    assert 25 <= int(answers[2].headers["retry-after"]) <= 31  # one request a 30 s
    assert answers[2].json()["error"]["code"] == "requests"
    bad = httpx.post(f"{gw.url}/v1/completions", json={"model": "default"}, headers=auth)
    assert bad.status_code == 400  # refused for its body (no prompt), still told the limits
    assert bad.headers["x-ratelimit-limit-requests"] == "2"


def test_a_request_larger_than_a_minute_of_tokens_is_refused_for_good(served) -> None:
    key = ApiKey(key=KEY, name="limited", tokens_per_minute=100)
    gw = served(EchoRunner(delay=0.0), GatewayConfig(keys=(key,)))
    answer = httpx.post(
        f"{gw.url}/v1/completions",
        json={"model": "default", "prompt": "hi", "max_tokens": 500},
        headers={"Authorization": f"Bearer {KEY}"},
    )
    assert answer.status_code == 429
    assert "retry-after" not in answer.headers  # waiting would not help
    assert "more than key 'limited' may use in a minute (100)" in answer.json()["error"]["message"]


def test_rate_limits_in_the_config_file() -> None:
    config = parse({"keys": [{"key": KEY, "requests_per_minute": 60, "tokens_per_minute": 90000}]})
    assert config.keys[0].requests_per_minute == 60
    assert config.keys[0].tokens_per_minute == 90000
    with pytest.raises(ValueError, match="same name"):
        parse({"keys": [{"key": KEY, "name": "key-2"}, {"key": KEY + "x"}]})
    for bad in (0, -1, 1.5, "many"):
        with pytest.raises(ValueError, match="tokens_per_minute must be a positive integer"):
            parse({"keys": [{"key": KEY, "tokens_per_minute": bad}]})


@pytest.mark.parametrize(
    ("seconds", "text"),
    [
        (0.02, "20ms"),
        (0.0, "0ms"),
        (1.5, "1.5s"),
        (360, "6m0s"),
        (61, "1m1s"),
        (119.9996, "2m0s"),
        (60.00001, "1m0s"),
        (1.25, "1.25s"),
    ],
)
def test_reset_durations_read_as_openai_writes_them(seconds: float, text: str) -> None:
    assert duration(seconds) == text
