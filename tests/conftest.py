"""Fixtures: a real ZooKeeper (Debian's package) per session, a fresh root per test, in-process and
subprocess workers, and bounded waits. The ZooKeeper log is printed when a test fails."""

from __future__ import annotations

import contextlib
import os
import signal
import socket
import subprocess
import sys
import threading
import time
import uuid
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import pytest
from kazoo.client import KazooClient
from kazoo.protocol.states import Callback

from workers.loop import Worker
from workers.options import WorkerOptions
from workers.runners.base import Runner
from workers.runners.echo import EchoRunner
from zkqueue import Client
from zkqueue.plumbing.connection import ConnectionSettings
from zkqueue.protocol.layout import Layout
from zkqueue.testing import ZkCluster

ZKQ = [sys.executable, "-m", "zkqueue.cli"]
#: The gateway tests' fixtures (gateway, served) live in their own module.
pytest_plugins = ["tests.gateway_fixtures"]


def wait_for(
    condition: Callable[[], Any],
    timeout: float = 10.0,
    interval: float = 0.02,
    message: str = "condition",
) -> Any:
    """Poll ``condition`` until it returns something truthy; fail after ``timeout`` seconds."""
    deadline = time.monotonic() + timeout
    while True:
        value = condition()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout}s waiting for {message}")
        time.sleep(interval)


def result_ids(client: Client, queue: str = "default") -> list[str]:
    """Ids of every stored result of a queue (its 256 result buckets, listed pipelined)."""
    from zkqueue.protocol.layout import RESULT_BUCKETS

    calls = [
        client.zk.get_children_async(client.layout.result_dir(queue, b)) for b in RESULT_BUCKETS
    ]
    out: list[str] = []
    for call in calls:
        try:
            out += call.get()
        except Exception:  # a bucket not created yet
            continue
    return sorted(out)


def flush_watches(zk: KazooClient) -> None:
    """Return once every watch notification the server sent this session so far has run."""
    zk.sync("/")
    done = threading.Event()
    zk.handler.dispatch_callback(Callback("watch", done.set, ()))
    assert done.wait(10), "kazoo callback thread is stuck"


@pytest.fixture(scope="session", autouse=True)
def calibration_cache(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Path]:
    """Model workers' knee cache (``workers.calibration``) in one session directory, never the
    user's: set through systemd's variable, so subprocess workers use it too."""
    path = tmp_path_factory.mktemp("zkq-cache")
    before = os.environ.get("CACHE_DIRECTORY")
    os.environ["CACHE_DIRECTORY"] = str(path)
    yield path
    if before is None:
        os.environ.pop("CACHE_DIRECTORY", None)
    else:
        os.environ["CACHE_DIRECTORY"] = before


@pytest.fixture(scope="session")
def zk_cluster() -> Iterator[ZkCluster]:
    cluster = ZkCluster(1).start()
    yield cluster
    cluster.stop()


@pytest.hookimpl(hookwrapper=True)
def pytest_runtest_makereport(item: pytest.Item, call: pytest.CallInfo[None]) -> Iterator[None]:
    outcome = yield
    report = outcome.get_result()
    cluster = getattr(item, "funcargs", {}).get("zk_cluster")
    if report.failed and cluster is not None:
        report.sections.append(("ZooKeeper log", cluster.logs()))


@pytest.fixture
def root() -> str:
    return f"/t-{uuid.uuid4().hex[:12]}"


@pytest.fixture
def hosts(zk_cluster: ZkCluster) -> str:
    return zk_cluster.hosts


@pytest.fixture
def layout(root: str) -> Layout:
    return Layout(root)


@pytest.fixture
def client(hosts: str, root: str) -> Iterator[Client]:
    with Client(hosts, root, session_timeout=4.0) as c:
        yield c


@pytest.fixture
def new_zk(hosts: str) -> Iterator[Callable[..., KazooClient]]:
    """Open extra sessions (each is what one process would have, with the client zkq's
    processes make); all closed at teardown."""
    opened: list[KazooClient] = []

    def make(timeout: float = 4.0) -> KazooClient:
        zk = ConnectionSettings(hosts=hosts, session_timeout=timeout).make_client()
        zk.start(timeout=10)
        opened.append(zk)
        return zk

    yield make
    for zk in opened:
        zk.stop()
        zk.close()


class Relay:
    """A TCP relay to ZooKeeper that can hold its traffic (a server that stops answering) or
    drop every connection and refuse new ones (a server that went away), then come back."""

    def __init__(self, target: str) -> None:
        host, port = target.split(",")[0].rsplit(":", 1)
        self.target = (host, int(port))
        self.flowing = threading.Event()
        self.flowing.set()
        self.conns: list[socket.socket] = []
        self.listener = self._listen(0)
        self.port = self.listener.getsockname()[1]

    def _listen(self, port: int) -> socket.socket:
        listener = socket.create_server(("127.0.0.1", port), reuse_port=False)
        threading.Thread(target=self._accept, args=(listener,), daemon=True).start()
        return listener

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                conn, _ = listener.accept()
            except OSError:
                return
            upstream = socket.create_connection(self.target)
            self.conns += [conn, upstream]
            for src, dst in ((conn, upstream), (upstream, conn)):
                threading.Thread(target=self._pump, args=(src, dst), daemon=True).start()

    def _pump(self, src: socket.socket, dst: socket.socket) -> None:
        try:
            while data := src.recv(65536):
                self.flowing.wait()
                dst.sendall(data)
        except OSError:
            pass
        for s in (src, dst):
            s.close()

    def cut(self) -> None:
        # shutdown() first: on Linux a close() alone wakes neither accept() nor recv().
        for sock in [self.listener, *self.conns]:
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            sock.close()
        self.conns = []

    def restore(self) -> None:
        self.listener = self._listen(self.port)


@pytest.fixture
def relay(hosts: str) -> Iterator[Relay]:
    r = Relay(hosts)
    yield r
    r.flowing.set()
    r.cut()


class WorkerThread:
    """An in-process worker with its own session, run on a thread."""

    def __init__(self, worker: Worker) -> None:
        self.worker = worker
        self.error: BaseException | None = None
        self.thread = threading.Thread(target=self._run, name=f"worker-{worker.id}", daemon=True)

    def _run(self) -> None:
        try:
            self.worker.run()
        except BaseException as exc:  # surfaced by the fixture
            self.error = exc

    def start(self) -> WorkerThread:
        self.thread.start()
        wait_for(lambda: self.worker.ready.is_set() or self.error, message="worker ready")
        if self.error:
            raise self.error
        return self

    def stop(self, drain: bool = False, timeout: float = 15.0) -> None:
        self.worker.stop(drain=drain)
        self.thread.join(timeout)


@pytest.fixture
def start_worker(
    new_zk: Callable[..., KazooClient], root: str
) -> Iterator[Callable[..., WorkerThread]]:
    started: list[WorkerThread] = []

    def start(runner: Runner | None = None, **kwargs: Any) -> WorkerThread:
        """A worker thread; ``kwargs`` are WorkerOptions fields (``slots`` is max_concurrency)
        and the Worker's ``admission``/``metrics``."""
        kwargs.setdefault("heartbeat_interval", 0.5)
        zk = new_zk(kwargs.pop("session_timeout", 4.0))
        if "slots" in kwargs:
            kwargs["max_concurrency"] = kwargs.pop("slots")
        parts = {k: kwargs.pop(k) for k in ("admission", "metrics", "on_heartbeat") if k in kwargs}
        opts = WorkerOptions(root=root, **kwargs)
        handle = WorkerThread(Worker(zk, runner or EchoRunner(), opts, **parts)).start()
        started.append(handle)
        return handle

    yield start
    for handle in started:
        if handle.thread.is_alive():
            handle.stop(drain=False)
    for handle in started:
        assert handle.error is None, f"worker {handle.worker.id} crashed: {handle.error!r}"


@pytest.fixture
def zkq(hosts: str, root: str) -> Callable[..., subprocess.CompletedProcess[str]]:
    """Run the zkq CLI as a subprocess against this test's root."""

    def run(
        *args: str, input: str | bytes | None = None, timeout: float = 60.0, zk: str | None = None
    ) -> subprocess.CompletedProcess[str]:
        """``input`` as bytes is fed as is (for bytes that are not UTF-8); output is text."""
        cmd = [*ZKQ, "--zk", zk or hosts, "--root", root, "--session-timeout", "4", *args]
        data = input.encode() if isinstance(input, str) else input
        done = subprocess.run(cmd, input=data, capture_output=True, timeout=timeout, env=_env())
        out, err = (b.decode("utf-8", "replace") for b in (done.stdout, done.stderr))
        return subprocess.CompletedProcess(cmd, done.returncode, out, err)

    return run


def _env() -> dict[str, str]:
    env = dict(os.environ)
    env["PYTHONPATH"] = str(Path(__file__).resolve().parents[1])
    return env


@pytest.fixture
def spawn_worker(
    hosts: str, root: str, tmp_path: Path
) -> Iterator[Callable[..., subprocess.Popen[str]]]:
    """Start ``zkq worker`` processes (killed at teardown); output goes to a log per process."""
    procs: list[subprocess.Popen[str]] = []

    def spawn(*args: str, env: dict[str, str] | None = None) -> subprocess.Popen[str]:
        log = open(tmp_path / f"worker-{len(procs)}.log", "w")  # noqa: SIM115
        cmd = [
            *ZKQ,
            "--zk",
            hosts,
            "--root",
            root,
            "--session-timeout",
            "3",
            "--log-level",
            "INFO",
            "worker",
            *args,
        ]
        proc = subprocess.Popen(
            cmd, stdout=log, stderr=subprocess.STDOUT, text=True, env={**_env(), **(env or {})}
        )
        procs.append(proc)
        return proc

    yield spawn
    for proc in procs:
        if proc.poll() is None:
            proc.send_signal(signal.SIGKILL)
            proc.wait(10)


def running_on(client: Client, job_id: str) -> str | None:
    """The worker running the job, or None while it is not running."""
    info = client.job(job_id).info()
    return info.get("worker") if info["state"] == "running" else None


def registered(client: Client, count: int) -> Callable[[], bool]:
    return lambda: len(client.workers()) >= count
