"""Test machinery for workers in front of an inference server: a real OpenAI-compatible server,
``transformers serve --continuous-batching`` (the transformers package's ``serving`` extra), on a
free loopback port, serving a local model offline. The tests and the benchmarks start it, kill
it and restart it on the same port; nothing here is a stand-in for the server.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import httpx

from zkqueue.testing import free_port

#: The server's KV cache: blocks of BLOCK_TOKENS positions (16k tokens in all).
CACHE_BLOCKS = 512
BLOCK_TOKENS = 32


class InferenceServer:
    """One ``transformers serve`` process on ``port``, its log in ``log_path``."""

    def __init__(
        self,
        model_dir: str | Path,
        log_path: str | Path,
        *,
        port: int | None = None,
        extra_args: tuple[str, ...] = (),
        device: str = "cpu",
    ) -> None:
        self.model_dir = str(model_dir)
        self.log_path = Path(log_path)
        self.port = port or free_port()
        self.extra_args = extra_args
        #: Where the server runs its model (its ``--device``: cpu, cuda, cuda:N).
        self.device = device
        self.proc: subprocess.Popen[bytes] | None = None

    @property
    def url(self) -> str:
        """The OpenAI base URL."""
        return f"http://127.0.0.1:{self.port}/v1"

    @property
    def root(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def start(self, timeout: float = 180.0, warm: bool = True) -> InferenceServer:
        """Start it and wait until it answers its health check (and, with ``warm``, one short
        completion: the first one pays for the engine's set-up)."""
        command = [
            _transformers_cli(),
            "serve",
            self.model_dir,
            "--continuous-batching",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--device",
            self.device,
            "--log-level",
            "info",
            # Left to itself the server sizes its KV cache from the host's memory (about 14 GiB
            # on a 24 GiB host), so two of them are one too many: a fixed cache of 16k tokens.
            "--cb-num-blocks",
            str(CACHE_BLOCKS),
            "--cb-block-size",
            str(BLOCK_TOKENS),
            *self.extra_args,
        ]
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_NO_ADVISORY_WARNINGS": "1"}
        env.setdefault("OMP_NUM_THREADS", "1")
        log = open(self.log_path, "ab")  # noqa: SIM115 (the process holds it)
        self.proc = subprocess.Popen(
            command, stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True
        )
        log.close()
        self.wait_healthy(timeout)
        if warm:
            self.complete("warm up", max_tokens=2)
        return self

    def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.proc is not None and self.proc.poll() is not None:
                raise RuntimeError(f"transformers serve exited:\n{self.log_tail()}")
            try:
                if httpx.get(self.root + "/health", timeout=1.0).status_code == 200:
                    return
            except httpx.TransportError:
                pass
            time.sleep(0.2)
        raise TimeoutError(f"transformers serve not healthy in {timeout:g}s:\n{self.log_tail()}")

    def complete(self, prompt: str, max_tokens: int = 16, **fields: object) -> dict[str, object]:
        """One greedy completion sent straight to the server (not through zkq)."""
        body = {"model": self.model_dir, "prompt": prompt, "max_tokens": max_tokens}
        body.update({"temperature": 0.0, **fields})
        reply = httpx.post(self.url + "/completions", json=body, timeout=120.0)
        reply.raise_for_status()
        answer: dict[str, object] = reply.json()
        return answer

    def kill(self) -> None:
        """SIGKILL, as a crash would end it."""
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGKILL)
            self.proc.wait(10)

    def stop(self) -> None:
        if self.proc is not None and self.proc.poll() is None:
            os.killpg(self.proc.pid, signal.SIGTERM)
            try:
                self.proc.wait(10)
            except subprocess.TimeoutExpired:
                self.kill()

    def log_tail(self, lines: int = 40) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


def _transformers_cli() -> str:
    """The ``transformers`` command of this interpreter's environment."""
    beside = Path(sys.executable).with_name("transformers")
    if beside.exists():
        return str(beside)
    found = shutil.which("transformers")
    if found is None:
        raise RuntimeError("the transformers command is not installed (pip install transformers)")
    return found
