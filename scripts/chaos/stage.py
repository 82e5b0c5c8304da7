"""A scenario's world: ZooKeeper (its own, or a shared one), a fresh root, an audit client and
``zkq worker`` subprocesses, all on loopback and all torn down when the stage closes; plus the
bounded waits every scenario uses.

Times: faults are stamped with ``time.time()`` and results with their znode's ``ctime``, the
server's clock, which on loopback is this host's clock. So "the first result after the restart"
is the first completion the server committed after it, not when a worker began to write it.
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterable, Mapping
from pathlib import Path
from typing import TypeVar

from kazoo.client import KazooClient
from kazoo.exceptions import ConnectionLoss, NoNodeError, OperationTimeoutError, SessionExpiredError

from scripts.chaos.audit import QUEUE, Audit, ChaosReport, audit
from zkqueue.errors import ZkqError
from zkqueue.plumbing.connection import read_through_loss
from zkqueue.producer.client import Client
from zkqueue.protocol import result as results
from zkqueue.protocol.layout import RESULT_BUCKETS, Layout, child
from zkqueue.testing import ZkCluster

_REPO = Path(__file__).resolve().parents[2]
_ZK_TROUBLE = (ConnectionLoss, SessionExpiredError, OperationTimeoutError, ZkqError)
#: Seconds between polls of a bounded wait.
_POLL = 0.05

T = TypeVar("T")


class ChaosError(RuntimeError):
    """A scenario could not set up its fault (a worker never registered, no leader...)."""


# -- bounded waits ---------------------------------------------------------------------------


def poll(condition: Callable[[], T | None], timeout: float, interval: float = _POLL) -> T | None:
    """Call ``condition`` until it returns something truthy (returned) or ``timeout`` passes
    (None). ZooKeeper being away while we poll counts as "not yet"."""
    deadline = time.monotonic() + timeout
    while True:
        try:
            value = condition()
        except _ZK_TROUBLE:
            value = None
        if value:
            return value
        if time.monotonic() > deadline:
            return None
        time.sleep(interval)


def need(condition: Callable[[], T | None], timeout: float, what: str) -> T:
    """Like poll, but a timeout is a setup failure of the scenario."""
    value = poll(condition, timeout)
    if not value:
        raise ChaosError(f"timed out after {timeout:g}s waiting for {what}")
    return value


def hold(seconds: float, check: Callable[[], bool], what: str) -> None:
    """Keep a fault in place for ``seconds`` (its defined duration), checking meanwhile that
    ``check`` stays true (for example: every worker process is still alive)."""
    deadline = time.monotonic() + seconds
    while (left := deadline - time.monotonic()) > 0:
        if not check():
            raise ChaosError(f"during the fault: {what}")
        time.sleep(min(left, 0.2))


# -- worker processes ------------------------------------------------------------------------


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = os.pathsep.join(filter(None, [str(_REPO), env.get("PYTHONPATH")]))
    return env


class WorkerProcess:
    """A ``zkq worker --runner echo`` subprocess with its own log file."""

    def __init__(
        self,
        name: str,
        hosts: str,
        root: str,
        log_dir: Path,
        *,
        delay: float,
        slots: int,
        session_timeout: float,
        extra: Iterable[str] = (),
    ) -> None:
        self.name = name
        self.log_path = log_dir / f"{name}.log"
        cmd = [
            *("--zk", hosts, "--root", root, "--session-timeout", f"{session_timeout:g}"),
            *("--log-level", "INFO", "worker", "--runner", "echo"),
            *("--echo-delay", f"{delay:g}", "--max-concurrency", str(slots), "--name", name),
            *extra,
        ]
        with open(self.log_path, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-m", "zkqueue.cli", *cmd],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=_env(),
                cwd=_REPO,
            )

    @property
    def pid(self) -> int:
        return self.proc.pid

    @property
    def alive(self) -> bool:
        return self.proc.poll() is None

    def send(self, sig: int) -> None:
        if self.alive:
            os.kill(self.proc.pid, sig)

    def kill(self) -> None:
        """kill -9: no drain, no goodbye; its session lingers until ZooKeeper expires it."""
        self.send(signal.SIGKILL)
        with contextlib.suppress(subprocess.TimeoutExpired):
            self.proc.wait(10)

    def terminate(self, timeout: float = 30.0) -> None:
        """SIGTERM (drain), then SIGKILL if it has not exited within ``timeout``."""
        self.send(signal.SIGCONT)
        self.send(signal.SIGTERM)
        try:
            self.proc.wait(timeout)
        except subprocess.TimeoutExpired:
            self.kill()

    def log_tail(self, lines: int = 40) -> str:
        try:
            text = self.log_path.read_text(errors="replace")
        except OSError:
            return "(no log)"
        return "\n".join(text.splitlines()[-lines:])

    def log_has(self, text: str) -> bool:
        try:
            return text in self.log_path.read_text(errors="replace")
        except OSError:
            return False


# -- a scenario's world ----------------------------------------------------------------------


class Stage:
    """One scenario's world: ZooKeeper (its own, or a shared one at ``hosts``), a fresh root, an
    audit client, and the worker processes it started. Closing it tears all of them down."""

    def __init__(
        self,
        name: str,
        *,
        hosts: str | None = None,
        servers: int = 1,
        session_timeout: float = 3.0,
    ) -> None:
        self.name = name
        self.session_timeout = session_timeout
        self.dir = Path(tempfile.mkdtemp(prefix=f"zkq-chaos-{name}-"))
        self.cluster: ZkCluster | None = None
        self._hosts = hosts
        self._servers = servers
        self.root = f"/chaos-{name}-{uuid.uuid4().hex[:8]}"
        self.layout = Layout(self.root)
        self.workers: list[WorkerProcess] = []
        self._client: Client | None = None
        self._cleanups: list[Callable[[], None]] = []

    @property
    def hosts(self) -> str:
        if self.cluster is not None:
            return self.cluster.hosts
        assert self._hosts is not None
        return self._hosts

    @property
    def client(self) -> Client:
        assert self._client is not None, "use the stage as a context manager"
        return self._client

    @property
    def zk(self) -> KazooClient:
        return self.client.zk

    def __enter__(self) -> Stage:
        try:
            if self._hosts is None:
                self.cluster = ZkCluster(self._servers, base=self.dir / "zk").start()
            self._client = Client(
                self.hosts, self.root, session_timeout=self.session_timeout
            ).start()
            self.client.ensure_queue(QUEUE)
        except BaseException:
            self.close()
            raise
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()

    def on_close(self, cleanup: Callable[[], None]) -> None:
        """Run ``cleanup`` at teardown (before the workers and servers go), last added first."""
        self._cleanups.append(cleanup)

    def close(self) -> None:
        for cleanup in reversed(self._cleanups):
            with contextlib.suppress(Exception):
                cleanup()
        for w in self.workers:
            w.kill()
        if self._client is not None:
            self._client.close()
        if self.cluster is not None:
            self.cluster.stop()
        shutil.rmtree(self.dir, ignore_errors=True)

    # -- workers ---------------------------------------------------------------------------

    def spawn(
        self, name: str, *, delay: float, slots: int = 1, extra: Iterable[str] = ()
    ) -> WorkerProcess:
        worker = WorkerProcess(
            name,
            self.hosts,
            self.root,
            self.dir,
            delay=delay,
            slots=slots,
            session_timeout=self.session_timeout,
            extra=extra,
        )
        self.workers.append(worker)
        return worker

    def _read(self, read: Callable[[], T], doing: str) -> T:
        """The stage's own reads ride through the outages it injects (zkq's client fails a
        request at once while disconnected): retried once reconnected, within connect_timeout."""
        return read_through_loss(self.zk, self.client.settings, read, doing)

    def registered(self) -> set[str]:
        return self._read(self._registered, "listing workers")

    def _registered(self) -> set[str]:
        try:
            return set(self.zk.get_children(self.layout.workers()))
        except NoNodeError:
            return set()

    def wait_registered(self, names: Iterable[str], timeout: float = 30.0) -> None:
        wanted = set(names)
        need(lambda: wanted <= self.registered(), timeout, f"workers {sorted(wanted)} registered")

    def all_alive(self, workers: Iterable[WorkerProcess]) -> bool:
        return all(w.alive for w in workers)

    def logs(self) -> str:
        return "\n".join(f"--- {w.name} ---\n{w.log_tail()}" for w in self.workers)

    # -- reading the queue -----------------------------------------------------------------

    def result_ids(self) -> set[str]:
        return self._read(self._result_ids, "listing results")

    def _result_ids(self) -> set[str]:
        calls = [
            self.zk.get_children_async(self.layout.result_dir(QUEUE, b)) for b in RESULT_BUCKETS
        ]
        return {n for c in calls for n in c.get()}

    def claims_by_worker(self) -> dict[str, set[str]]:
        """Job ids currently claimed, per worker name (from the claim nodes' data)."""
        return self._read(self._claims_by_worker, "listing claims")

    def _claims_by_worker(self) -> dict[str, set[str]]:
        path = self.layout.claims(QUEUE)
        calls = [(n, self.zk.get_async(child(path, n))) for n in self.zk.get_children(path)]
        out: dict[str, set[str]] = {}
        for name, call in calls:
            with contextlib.suppress(NoNodeError):
                worker = json.loads(call.get()[0]).get("worker")
                out.setdefault(str(worker), set()).add(name.split("-", 1)[0])
        return out

    def drained(self, ids: Iterable[str], timeout: float) -> bool:
        """Bounded wait until every job in ``ids`` has a result."""
        wanted = set(ids)
        return bool(poll(lambda: wanted <= self.result_ids(), timeout, 0.1))

    def audit(
        self,
        expected: Mapping[str, str],
        received: Mapping[str, results.Result] | None = None,
        withdrawn: Iterable[str] = (),
    ) -> Audit:
        return audit(self.zk, self.layout, expected, received or {}, set(withdrawn))

    def finish(self, report: ChaosReport, started: float) -> ChaosReport:
        report.wall_s = time.monotonic() - started
        if not report.ok:
            report.logs = self.logs()
        return report
