"""The harness side: run configuration, the shared ZooKeeper (and Redis), the agent processes and
small helpers (bounded waits, CPU of the servers, statistics)."""

from __future__ import annotations

import contextlib
import itertools
import json
import multiprocessing
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from kazoo.exceptions import NoNodeError

from scripts.bench import wire
from scripts.bench.agents import agent_main
from zkqueue import Client
from zkqueue.plumbing.connection import ConnectionSettings
from zkqueue.testing import ZkCluster

if TYPE_CHECKING:
    from scripts.bench.redis_baseline import RedisServer
    from workers.testing import InferenceServer

QUEUE = "bench"
#: The prompt of a job whose content does not matter (echo work).
PROMPT = "benchmark job number 0"


@dataclass
class Config:
    """What one run measures; ``quick`` shrinks counts and repetitions to stay under 2 minutes."""

    quick: bool
    reps: int
    dispatch_jobs: int
    lq_jobs: int
    redis_jobs: int
    latency_samples: int
    herd_jobs: int
    depth_claims: int
    depth_enqueues: int
    bulk_jobs: int
    procs: tuple[int, ...] = (1, 4, 16)
    slots: tuple[int, ...] = (1, 4)
    modes: tuple[str, ...] = ("prefill", "stream")
    herd_sizes: tuple[int, ...] = (1, 8, 32)
    depths: tuple[int, ...] = (100, 20000)
    scenarios: tuple[str, ...] = ()

    @classmethod
    def make(cls, quick: bool, scenarios: tuple[str, ...]) -> Config:
        if quick:
            return cls(
                quick=True,
                reps=1,
                dispatch_jobs=150,
                lq_jobs=150,
                redis_jobs=150,
                latency_samples=60,
                herd_jobs=8,
                depth_claims=40,
                depth_enqueues=40,
                bulk_jobs=5000,
                depths=(100, 5000),
                modes=("prefill", "stream"),
                scenarios=scenarios,
            )
        return cls(
            quick=False,
            reps=3,
            dispatch_jobs=600,
            lq_jobs=600,
            redis_jobs=600,
            latency_samples=300,
            herd_jobs=20,
            depth_claims=100,
            depth_enqueues=100,
            bulk_jobs=10000,
            scenarios=scenarios,
        )


class AgentError(RuntimeError):
    pass


class AgentHandle:
    """One agent process and its pipe."""

    def __init__(self, ctx: Any, hosts: str, name: str) -> None:
        self.name = name
        self.conn, child = ctx.Pipe()
        self.process = ctx.Process(target=agent_main, args=(child, hosts), name=name, daemon=True)
        self.process.start()
        child.close()
        self.busy = False

    def send(self, command: str, **kwargs: Any) -> None:
        self.conn.send((command, kwargs))
        self.busy = True

    def ready(self) -> bool:
        return self.conn.poll(0)

    def recv(self, timeout: float = 120.0) -> Any:
        if not self.conn.poll(timeout):
            raise AgentError(f"{self.name}: no answer within {timeout:g}s")
        status, value = self.conn.recv()
        self.busy = False
        if status != "ok":
            raise AgentError(f"{self.name} failed:\n{value}")
        return value

    def call(self, command: str, timeout: float = 120.0, **kwargs: Any) -> Any:
        self.send(command, **kwargs)
        return self.recv(timeout)

    def close(self) -> None:
        try:
            if self.busy:
                self.recv(30)
            self.call("exit", timeout=30)
        except (AgentError, OSError, EOFError):
            pass
        self.process.join(10)
        if self.process.is_alive():
            self.process.terminate()
            self.process.join(5)


def call_all(
    agents: Iterable[AgentHandle], command: str, timeout: float = 120.0, **kwargs: Any
) -> list[Any]:
    """Send to every agent, then collect the answers (they run in parallel)."""
    agents = list(agents)
    for agent in agents:
        agent.send(command, **kwargs)
    return [agent.recv(timeout) for agent in agents]


class Bench:
    """Everything shared by the scenarios of one run."""

    def __init__(self, config: Config, out: Path) -> None:
        self.config = config
        self.out = out
        self.cluster = ZkCluster(1).start()
        self.hosts = self.cluster.hosts
        wire.install()
        # The harness's own client is a zkq client (the latency suite's caller): zkq's handler.
        self.zk = ConnectionSettings(hosts=self.hosts, session_timeout=10.0).make_client()
        self.zk.start(timeout=30)
        self.ctx = multiprocessing.get_context("forkserver")
        self.ctx.set_forkserver_preload(["scripts.bench.agents"])
        self._pool: list[AgentHandle] = []
        self._special: dict[str, AgentHandle] = {}
        self._roots = itertools.count()
        self.redis: RedisServer | None = None

    # -- agents --------------------------------------------------------------------------------

    def agents(self, n: int) -> list[AgentHandle]:
        """The first ``n`` pooled agents, starting more as needed."""
        while len(self._pool) < n:
            self._pool.append(AgentHandle(self.ctx, self.hosts, f"agent-{len(self._pool)}"))
        return self._pool[:n]

    def special(self, name: str) -> AgentHandle:
        """A named agent outside the pool (the producer)."""
        if name not in self._special:
            self._special[name] = AgentHandle(self.ctx, self.hosts, name)
        return self._special[name]

    # -- ZooKeeper helpers -------------------------------------------------------------------

    def fresh_root(self, tag: str) -> str:
        return f"/bench/{tag}-{next(self._roots)}"

    def client(self, root: str) -> Client:
        return Client(root=root, zk=self.zk)

    def child_count(self, path: str) -> int:
        stat = self.zk.exists(path)
        return stat.numChildren if stat is not None else 0

    def indexed(self, expiry: str) -> int:
        """Results written under a queue's expiry index (its tick buckets' child counts: a few
        reads, whatever the number of results)."""
        try:
            ticks = self.zk.get_children(expiry)
        except NoNodeError:
            return 0
        calls = [self.zk.exists_async(f"{expiry}/{t}") for t in ticks]
        return sum(s.numChildren for c in calls if (s := c.get()) is not None)

    def server_cpu(self) -> float:
        process = self.cluster.servers[0].process
        return pid_cpu(process.pid) if process is not None else 0.0

    def redis_server(self) -> RedisServer:
        if self.redis is None:
            from scripts.bench.redis_baseline import RedisServer  # the bench extra's redis

            self.redis = RedisServer().start()
        return self.redis

    def close(self) -> None:
        for agent in [*self._pool, *self._special.values()]:
            agent.close()
        self.zk.stop()
        self.zk.close()
        if self.redis is not None:
            self.redis.stop()
        self.cluster.stop()


def pid_cpu(pid: int | None) -> float:
    """CPU seconds (user + system) a process has used, all its threads included."""
    if pid is None:
        return 0.0
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
    except OSError:
        return 0.0
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def stop_processes(procs: Iterable[subprocess.Popen[Any]], timeout: float) -> None:
    """SIGTERM every process (they stop together), then wait for each; kill one that is still
    there after ``timeout`` seconds."""
    procs = list(procs)
    for proc in procs:
        proc.send_signal(signal.SIGTERM)
    for proc in procs:
        try:
            proc.wait(timeout)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


def pin(pid: int, cpus: set[int]) -> None:
    """Keep a process, every thread it has and every thread it starts, on ``cpus``."""
    for task in os.listdir(f"/proc/{pid}/task"):
        with contextlib.suppress(OSError):  # a thread that ended meanwhile
            os.sched_setaffinity(int(task), cpus)


class CpuMeter:
    """CPU seconds of named processes (the server, the worker, ZooKeeper...), read from /proc."""

    def __init__(self, pids: dict[str, int]) -> None:
        self.pids = pids

    def __call__(self) -> dict[str, float]:
        return {name: pid_cpu(pid) for name, pid in self.pids.items()}

    def since(self, before: dict[str, float], digits: int | None = 2) -> dict[str, float]:
        """Seconds each spent since ``before`` (a reading), rounded to ``digits`` (None: not)."""
        now = self()
        spent = {name: now[name] - before[name] for name in now}
        return spent if digits is None else {k: round(v, digits) for k, v in spent.items()}


#: This checkout (child processes import it), the zkq command, and their environment.
ROOT = Path(__file__).resolve().parents[2]
ZKQ_CLI = [sys.executable, "-m", "zkqueue.cli"]


def child_env(**extra: str) -> dict[str, str]:
    return {**os.environ, "PYTHONPATH": str(ROOT), **extra}


def wait_up(url: str, timeout: float = 60) -> None:
    """Until ``url``/health answers 200 (a gateway or a server); SystemExit after ``timeout``."""
    import httpx

    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        try:
            if httpx.get(f"{url}/health", timeout=1).status_code == 200:
                return
        except httpx.HTTPError:
            pass
        time.sleep(0.1)
    raise SystemExit(f"{url} did not come up in {timeout:g}s")


def report(out: dict[str, Any], summary: list[str], path: str | None) -> None:
    """Print a run's summary lines; with ``path``, write the run (summary included) as JSON."""
    for line in summary:
        print(line)
    if path:
        out["summary"] = summary
        Path(path).write_text(json.dumps(out, indent=2))


@contextlib.contextmanager
def tiny_model_served(
    prefix: str, device: str = "cpu"
) -> Iterator[tuple[Path, InferenceServer, ZkCluster]]:
    """A temporary folder holding the tiny model (``zkq tiny-model``, in ``<folder>/tiny``),
    ``transformers serve --continuous-batching`` on it (on ``device``) and a standalone
    ZooKeeper, for the benchmarks that set zkq beside that server; both stopped and the folder
    removed after."""
    from workers.testing import InferenceServer

    with tempfile.TemporaryDirectory(prefix=prefix) as tmp:
        folder = Path(tmp)
        model = str(folder / "tiny")
        subprocess.run(
            [*ZKQ_CLI, "tiny-model", model], env=child_env(), capture_output=True, check=True
        )
        server = InferenceServer(model, folder / "serve.log", device=device).start()
        try:
            cluster = ZkCluster(1).start()
            try:
                yield folder, server, cluster
            finally:
                cluster.stop()
        finally:
            server.stop()


def wait_until(condition: Callable[[], Any], timeout: float, interval: float = 0.01) -> bool:
    """Poll ``condition`` until truthy; False after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        if condition():
            return True
        if time.monotonic() > deadline:
            return False
        time.sleep(interval)


def median(values: Iterable[float]) -> float:
    data = [v for v in values if v is not None]
    return statistics.median(data) if data else float("nan")


def percentile(values: list[float], q: float) -> float:
    """The q-th percentile (0-100), nearest rank."""
    if not values:
        return float("nan")
    ordered = sorted(values)
    rank = max(0, min(len(ordered) - 1, round(q / 100 * len(ordered) + 0.5) - 1))
    return ordered[rank]
