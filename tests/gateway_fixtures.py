"""Fixtures for the gateway tests: ``zkq serve`` in-process on a free port (``gateway``), with an
echo worker that renders chats (``served``)."""

from __future__ import annotations

import asyncio
import dataclasses
import socket
import threading
from collections.abc import Callable, Iterator
from typing import Any

import openai
import pytest

from gateway.commands import run as run_gateway
from gateway.config import GatewayConfig
from tests.conftest import registered, wait_for
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

    def __init__(
        self, hosts: str, root: str, config: GatewayConfig, drain_timeout: float = 30.0
    ) -> None:
        self.sock = socket.socket()
        self.sock.bind(("127.0.0.1", 0))
        self.url = f"http://127.0.0.1:{self.sock.getsockname()[1]}"
        self.server: Any = None
        client = AsyncClient(hosts, root, session_timeout=4.0)
        job = run_gateway(
            client, config, sock=self.sock, started=self._started, drain_timeout=drain_timeout
        )
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
