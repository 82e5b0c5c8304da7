"""Digest authentication with per-node ACLs, and TLS to ZooKeeper, against real servers."""

from __future__ import annotations

import asyncio
import logging
import os
import subprocess
import sys
from collections.abc import Callable, Iterator
from pathlib import Path

import pytest
from kazoo.client import KazooClient
from kazoo.exceptions import NoAuthError
from kazoo.security import make_digest_acl

from tests.conftest import WorkerThread, _env
from workers.loop import Worker
from workers.options import WorkerOptions
from workers.runners.echo import EchoRunner
from zkqueue import AsyncClient, Client
from zkqueue.errors import AccessDenied, ConfigurationError, ExitCode
from zkqueue.plumbing.connection import ConnectionSettings, connect
from zkqueue.producer import direct
from zkqueue.testing import ZkCluster, write_test_pki

SECRET = "s3cret-Pa55"
AUTH = f"alice:{SECRET}"


@pytest.fixture
def secured(hosts: str, root: str) -> Iterator[Client]:
    with Client(hosts, root, auth=AUTH) as c:
        yield c


@pytest.fixture
def worker_with(root: str) -> Iterator[Callable[[ConnectionSettings], WorkerThread]]:
    started: list[tuple[WorkerThread, KazooClient]] = []

    def start(settings: ConnectionSettings) -> WorkerThread:
        zk = connect(settings)
        handle = WorkerThread(
            Worker(zk, EchoRunner(), WorkerOptions(root=root, heartbeat_interval=0.5))
        )
        started.append((handle.start(), zk))
        return handle

    yield start
    for handle, zk in started:
        handle.stop()
        zk.stop()
        zk.close()


def test_authenticated_queue_works_end_to_end(secured: Client, hosts: str, worker_with) -> None:
    worker_with(ConnectionSettings(hosts, auth=AUTH))
    record = secured.submit("behind the ACL").result(timeout=10)
    assert record.ok and record.output == "behind the ACL"
    assert SECRET not in str(record.to_dict())


def test_nodes_carry_the_identity_acl(secured: Client) -> None:
    job = secured.submit("x", detach=True)
    acl, _ = secured.zk.get_acls(job.entry_path or "")
    assert acl == [make_digest_acl("alice", SECRET, all=True)]
    acl, _ = secured.zk.get_acls(secured.layout.root)
    assert acl == [make_digest_acl("alice", SECRET, all=True)]


def test_a_client_without_credentials_can_do_nothing(secured: Client, new_zk) -> None:
    job = secured.submit("private", detach=True)
    plain = new_zk()
    lay = secured.layout
    entry = job.entry_path or ""
    attempts: list[Callable[[], object]] = [
        lambda: plain.get_children(lay.root),
        lambda: plain.get_children(lay.pending("default", "normal")),
        lambda: plain.get(entry),
        lambda: plain.set(entry, b'{"prompt": "hijacked"}'),
        lambda: plain.delete(entry),
        lambda: plain.create(lay.entry_prefix("default", "normal", "evil"), b"{}", sequence=True),
        lambda: plain.create(f"{lay.root}/extra", b""),
    ]
    for attempt in attempts:
        with pytest.raises(NoAuthError):
            attempt()
    assert secured.job(job.id).status() == "pending"


def test_wrong_password_is_denied_with_exit_8(secured: Client, hosts: str, root: str, zkq) -> None:
    job = secured.submit("x", detach=True)
    with Client(hosts, root, auth="alice:wrong") as intruder, pytest.raises(AccessDenied):
        intruder.job(job.id)
    out = zkq("--auth", "alice:wrong", "status", job.id)
    assert out.returncode == ExitCode.DENIED
    assert "denied access" in out.stderr and "wrong" not in out.stderr
    env_ok = subprocess.run(
        [sys.executable, "-m", "zkqueue.cli", "--zk", hosts, "--root", root, "status", job.id],
        capture_output=True,
        text=True,
        timeout=60,
        env={**_env(), "ZKQ_AUTH": AUTH},
    )
    assert env_ok.returncode == 0 and env_ok.stdout.startswith("pending")


def test_bad_auth_strings_are_configuration_errors() -> None:
    for bad in ("nocolon", ":pw", "user:"):
        with pytest.raises(ConfigurationError, match="USER:PASSWORD"):
            ConnectionSettings("127.0.0.1:2181", auth=bad)


def test_secrets_never_reach_logs_or_listings(
    secured: Client, hosts: str, root: str, tmp_path: Path
) -> None:
    log = tmp_path / "worker.log"
    cmd = [
        sys.executable,
        "-m",
        "zkqueue.cli",
        "--zk",
        hosts,
        "--root",
        root,
        "--auth",
        AUTH,
        "--log-level",
        "DEBUG",
        "worker",
        "--runner",
        "echo",
        "--max-jobs",
        "1",
    ]
    with log.open("w") as out:
        proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=_env())
        try:
            assert secured.submit("one job").result(timeout=30).ok
            assert proc.wait(30) == 0
        finally:
            proc.kill()
    text = log.read_text()
    assert "one job" in text or "claimed" in text
    assert SECRET not in text
    assert SECRET not in repr(secured.settings)
    assert all(SECRET not in str(w) for w in secured.workers())


@pytest.fixture(scope="module")
def tls_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ZkCluster]:
    pki = write_test_pki(tmp_path_factory.mktemp("pki"))
    cluster = ZkCluster(1, pki=pki).start()
    yield cluster
    cluster.stop()


def test_tls_end_to_end(tls_cluster: ZkCluster, root: str, worker_with) -> None:
    pki = tls_cluster.servers[0].pki
    assert pki is not None
    tls = {"tls_ca": str(pki.ca), "tls_cert": str(pki.client_cert), "tls_key": str(pki.client_key)}
    worker_with(ConnectionSettings(tls_cluster.secure_hosts, **tls))
    with Client(tls_cluster.secure_hosts, root, **tls) as client:
        assert client.submit("over TLS").result(timeout=15).output == "over TLS"
    out = subprocess.run(
        [
            sys.executable,
            "-m",
            "zkqueue.cli",
            "--zk",
            tls_cluster.secure_hosts,
            "--root",
            root,
            "--connect-timeout",
            "3",
            "--tls-ca",
            tls["tls_ca"],
            "--tls-cert",
            tls["tls_cert"],
            "--tls-key",
            tls["tls_key"],
            "stats",
            "--json",
        ],
        capture_output=True,
        text=True,
        timeout=60,
        env=_env(),
    )
    assert out.returncode == 0, out.stderr


def test_streams_are_https_where_the_ensemble_uses_tls(
    tls_cluster: ZkCluster, root: str, caplog: pytest.LogCaptureFixture
) -> None:
    pki = tls_cluster.servers[0].pki
    assert pki is not None
    tls = {"tls_ca": str(pki.ca), "tls_cert": str(pki.client_cert), "tls_key": str(pki.client_key)}
    zk = connect(ConnectionSettings(tls_cluster.secure_hosts, **tls))
    # As the daemon does: the worker serves streams with its ZooKeeper client certificate.
    opts = WorkerOptions(
        root=root, heartbeat_interval=0.5, stream_tls=(tls["tls_cert"], tls["tls_key"])
    )
    handle = WorkerThread(Worker(zk, EchoRunner(delay=1.5), opts)).start()
    try:
        assert (handle.worker.claims.streams or "").startswith("https://127.0.0.1:")
        words = " ".join(f"w{i}" for i in range(8))
        with Client(tls_cluster.secure_hosts, root, **tls) as client:
            job = client.submit(words, stream=True)
            pieces = list(job.stream(timeout=30))
            assert "".join(pieces) == words == job.result().output
            # Word by word over HTTPS: a reader that fell back to the claim would have said so,
            # and would get its first piece only after the worker's 1 s grace.
            assert len(pieces) >= 5, pieces

        async def stream_async() -> list[str]:  # AsyncJob reads with another HTTP library
            async with AsyncClient(tls_cluster.secure_hosts, root, **tls) as aio:
                job = await aio.submit(words, stream=True)
                return [piece async for piece in job.stream(timeout=30)]

        pieces = asyncio.run(stream_async())
        assert "".join(pieces) == words and len(pieces) >= 5, pieces
        assert not [r for r in caplog.records if r.name == "zkq.stream"]
    finally:
        handle.stop()
        zk.stop()
        zk.close()


def test_a_stream_certificate_another_ca_signed_is_refused(
    tls_cluster: ZkCluster,
    root: str,
    tmp_path: Path,
    caplog: pytest.LogCaptureFixture,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """A worker serving its stream with a certificate the ZooKeeper CA did not sign (an
    impostor on the path, say): neither reader takes its stream; both stream from the claim
    instead, and say why."""
    pki = tls_cluster.servers[0].pki
    assert pki is not None
    other = write_test_pki(tmp_path / "other-ca")
    tls = {"tls_ca": str(pki.ca), "tls_cert": str(pki.client_cert), "tls_key": str(pki.client_key)}
    zk = connect(ConnectionSettings(tls_cluster.secure_hosts, **tls))
    opts = WorkerOptions(
        root=root,
        heartbeat_interval=0.5,
        stream_tls=(str(other.client_cert), str(other.client_key)),
    )
    handle = WorkerThread(Worker(zk, EchoRunner(delay=1.5), opts)).start()
    caplog.set_level(logging.WARNING, logger="zkq.stream")
    words = " ".join(f"w{i}" for i in range(8))
    try:
        said = []
        for reader in ("Job", "AsyncJob"):
            monkeypatch.setattr(direct, "_warned", set())  # said once per process and address
            if reader == "Job":
                with Client(tls_cluster.secure_hosts, root, **tls) as client:
                    pieces = list(client.submit(words, stream=True).stream(timeout=30))
            else:

                async def stream_async() -> list[str]:
                    async with AsyncClient(tls_cluster.secure_hosts, root, **tls) as aio:
                        job = await aio.submit(words, stream=True)
                        return [piece async for piece in job.stream(timeout=30)]

                pieces = asyncio.run(stream_async())
            assert "".join(pieces) == words
            said.append([r.getMessage() for r in caplog.records if r.name == "zkq.stream"])
            caplog.clear()
        for lines in said:
            assert any("certificate" in line.lower() and "claim" in line for line in lines), said
    finally:
        handle.stop()
        zk.stop()
        zk.close()


def test_tls_port_refuses_clients_without_a_certificate(tls_cluster: ZkCluster) -> None:
    pki = tls_cluster.servers[0].pki
    assert pki is not None
    with pytest.raises(Exception, match="cannot reach ZooKeeper"):
        connect(ConnectionSettings(tls_cluster.secure_hosts, connect_timeout=2, tls_ca=str(pki.ca)))


def test_missing_tls_files_are_named() -> None:
    with pytest.raises(ConfigurationError, match="no such file"):
        ConnectionSettings("127.0.0.1:2181", tls_ca=os.path.join("/nonexistent", "ca.pem"))
