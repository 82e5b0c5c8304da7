"""The Redis baseline: a local redis-server and a reliable priority queue on it.

Queue: one list per priority (LPUSH by producers, so the right end is the oldest). A worker takes
with one Lua call that LMOVEs the oldest entry of the first non-empty priority into its own
processing list (the reliable-queue pattern: a crashed worker's job stays in its list), and when
nothing is there blocks on a wake list the producers push to (BLPOP wakes one client per push, so
there is no herd). Completing is one MULTI: SET the result, LREM the job from the processing list,
INCR a done counter the harness polls. No ordering across producers beyond Redis's own, and no
fencing: a worker presumed dead can still write its result.
"""

from __future__ import annotations

import contextlib
import json
import shutil
import socket
import subprocess
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any

import redis

PRIORITIES = ("high", "normal", "low")
_TAKE = """
for i = 1, 3 do
  local v = redis.call('LMOVE', KEYS[i], KEYS[4], 'RIGHT', 'LEFT')
  if v then return v end
end
return false
"""


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


class RedisServer:
    """redis-server on loopback with an append-only file fsynced on every write (``always``),
    so that an acknowledged job survives a crash as it does in ZooKeeper; ``durable(False)``
    turns persistence off for the in-memory figure."""

    def __init__(self, binary: str = "redis-server") -> None:
        self.binary = shutil.which(binary) or binary
        self.port = _free_port()
        self.dir = Path(tempfile.mkdtemp(prefix="zkq-bench-redis-"))
        self.process: subprocess.Popen[bytes] | None = None

    def start(self, timeout: float = 20.0) -> RedisServer:
        args = [
            self.binary,
            "--port", str(self.port),
            "--bind", "127.0.0.1",
            "--dir", str(self.dir),
            "--save", "",
            "--appendonly", "yes",
            "--appendfsync", "always",
            "--daemonize", "no",
        ]  # fmt: skip
        log = open(self.dir / "redis.log", "ab")  # noqa: SIM115 - the child owns it
        self.process = subprocess.Popen(args, stdout=log, stderr=subprocess.STDOUT)
        log.close()
        deadline = time.monotonic() + timeout
        client = redis.Redis(port=self.port)
        while time.monotonic() < deadline:
            with contextlib.suppress(redis.ConnectionError):
                if client.ping():
                    client.close()
                    return self
            time.sleep(0.05)
        raise TimeoutError(f"redis-server did not answer on port {self.port}")

    def durable(self, on: bool) -> None:
        client = redis.Redis(port=self.port)
        client.config_set("appendonly", "yes" if on else "no")
        client.close()

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process else None

    def stop(self) -> None:
        if self.process is not None and self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(10)
            except subprocess.TimeoutExpired:
                self.process.kill()
                self.process.wait()
        self.process = None
        shutil.rmtree(self.dir, ignore_errors=True)


class RedisQueue:
    """Producer and worker sides of the baseline queue, under a key prefix."""

    def __init__(self, port: int, prefix: str, worker: str = "producer") -> None:
        self.r = redis.Redis(port=port)
        self.prefix = prefix
        self.lists = [f"{prefix}:q:{p}" for p in PRIORITIES]
        self.processing = f"{prefix}:processing:{worker}"
        self.wake = f"{prefix}:wake"
        self.done_key = f"{prefix}:done"
        self._take = self.r.register_script(_TAKE)
        self.calls: Counter[str] = Counter()

    def put(self, job_id: str, prompt: str, priority: str = "normal") -> None:
        pipe = self.r.pipeline(transaction=False)
        pipe.lpush(self.lists[PRIORITIES.index(priority)], _job(job_id, prompt))
        pipe.lpush(self.wake, b"1")
        pipe.execute()
        self.calls["put"] += 1

    def put_many(self, jobs: list[tuple[str, str]], priority: str = "normal") -> None:
        """Prefill: one pipelined round trip per 1,000 jobs."""
        key = self.lists[PRIORITIES.index(priority)]
        for start in range(0, len(jobs), 1000):
            pipe = self.r.pipeline(transaction=False)
            for job_id, prompt in jobs[start : start + 1000]:
                pipe.lpush(key, _job(job_id, prompt))
            pipe.execute()

    def take(self, block: float) -> bytes | None:
        self.calls["take"] += 1
        job = self._take(keys=[*self.lists, self.processing])
        if job is None:
            self.calls["wait"] += 1
            self.r.blpop([self.wake], timeout=block)
        return job

    def complete(self, job: Any, job_id: str, output: str) -> None:
        pipe = self.r.pipeline(transaction=True)
        pipe.set(f"{self.prefix}:result:{job_id}", json.dumps({"status": "ok", "output": output}))
        pipe.lrem(self.processing, 1, job)
        pipe.incr(self.done_key)
        pipe.execute()
        self.calls["complete"] += 1

    def done(self) -> int:
        return int(self.r.get(self.done_key) or 0)

    def close(self) -> None:
        self.r.close()


def _job(job_id: str, prompt: str) -> bytes:
    return json.dumps({"id": job_id, "prompt": prompt}).encode()


def info_commands(port: int) -> dict[str, Any]:
    client = redis.Redis(port=port)
    try:
        return dict(client.info("commandstats"))
    finally:
        client.close()
