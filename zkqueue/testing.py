"""Real ZooKeeper servers on loopback, for tests, demos and benchmarks: zkq's own and its users'.

Like ``kazoo.testing``, this is the harness the project's tests use, shipped so that code built
on zkq can test against the same thing: ``ZkCluster(1)`` is a standalone server, ``ZkCluster(3)``
an ensemble, each server with free ports, a throwaway data dir, a short tickTime and no admin
server; ``ZkServer`` is one of them, to stop, kill and start again for fault injection. Nothing
here is a fake: it runs Debian's ``zkServer.sh`` (or ``ZKQ_ZKSERVER_SH``). It needs only the
standard library and zkq's error types.

    with ZkCluster(1) as cluster:
        client = Client(cluster.hosts, "/test").start()
"""

from __future__ import annotations

import os
import shutil
import signal
import socket
import subprocess
import tempfile
import time
from dataclasses import dataclass, field
from pathlib import Path

from zkqueue.errors import ConfigurationError

__all__ = ["TestPki", "ZkCluster", "ZkServer", "four_letter", "free_port", "write_test_pki"]

ZK_SERVER_SH = os.environ.get("ZKQ_ZKSERVER_SH", "/usr/share/zookeeper/bin/zkServer.sh")
# Debian's zookeeper.jar manifest lacks netty-codec/netty-resolver, which its TLS (Netty) needs.
_CLASSPATH = ":".join(
    [
        "/etc/zookeeper/conf",
        "/usr/share/java/zookeeper.jar",
        "/usr/share/java/slf4j-simple.jar",
        "/usr/share/java/netty-codec.jar",
        "/usr/share/java/netty-resolver.jar",
    ]
)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def four_letter(port: int, word: str, timeout: float = 1.0) -> str:
    """Send a four-letter command (ruok, srvr, mntr...) and return the answer ('' on failure)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout) as s:
            s.sendall(word.encode())
            chunks = []
            while chunk := s.recv(65536):
                chunks.append(chunk)
            return b"".join(chunks).decode(errors="replace")
    except OSError:
        return ""


@dataclass(frozen=True)
class TestPki:
    """A throwaway CA with a server and a client certificate for 127.0.0.1 (PEM files)."""

    ca: Path
    server_pem: Path
    client_cert: Path
    client_key: Path


def write_test_pki(directory: str | Path) -> TestPki:
    """Make a CA and certificates with openssl, for TLS tests on loopback only."""
    d = Path(directory)
    d.mkdir(parents=True, exist_ok=True)
    ext = d / "san.cnf"
    ext.write_text("subjectAltName=IP:127.0.0.1,DNS:localhost\n")
    _openssl(
        "req",
        "-x509",
        "-newkey",
        "rsa:2048",
        "-nodes",
        "-keyout",
        d / "ca.key",
        "-out",
        d / "ca.pem",
        "-days",
        "2",
        "-subj",
        "/CN=zkq-test-ca",
    )
    for name in ("server", "client"):
        _openssl(
            "req",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-keyout",
            d / f"{name}.key",
            "-out",
            d / f"{name}.csr",
            "-subj",
            "/CN=127.0.0.1",
        )
        _openssl(
            "x509",
            "-req",
            "-in",
            d / f"{name}.csr",
            "-CA",
            d / "ca.pem",
            "-CAkey",
            d / "ca.key",
            "-CAcreateserial",
            "-out",
            d / f"{name}.crt",
            "-days",
            "2",
            "-extfile",
            ext,
        )
    (d / "server.pem").write_text((d / "server.key").read_text() + (d / "server.crt").read_text())
    return TestPki(d / "ca.pem", d / "server.pem", d / "client.crt", d / "client.key")


def _openssl(*args: str | Path) -> None:
    subprocess.run(["openssl", *map(str, args)], check=True, capture_output=True)


@dataclass
class ZkServer:
    """One server process. ``peers`` is the ensemble's server list (empty when standalone)."""

    myid: int
    base: Path
    client_port: int = field(default_factory=free_port)
    quorum_port: int = field(default_factory=free_port)
    election_port: int = field(default_factory=free_port)
    tick_ms: int = 200
    #: With a PKI, the server also listens for TLS clients (mutual TLS) on ``secure_port``.
    pki: TestPki | None = None
    secure_port: int = field(default_factory=free_port)
    peers: list[ZkServer] = field(default_factory=list, repr=False)
    process: subprocess.Popen[bytes] | None = field(default=None, repr=False)

    @property
    def dir(self) -> Path:
        return self.base / f"zk{self.myid}"

    @property
    def log_path(self) -> Path:
        return self.dir / "server.log"

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.client_port}"

    def _config(self) -> str:
        lines = [
            f"tickTime={self.tick_ms}",
            "initLimit=20",
            "syncLimit=10",
            f"dataDir={self.dir / 'data'}",
            f"clientPort={self.client_port}",
            "clientPortAddress=127.0.0.1",
            "admin.enableServer=false",
            "4lw.commands.whitelist=*",
            "maxClientCnxns=0",
            # Sessions from 2 to 60 s whatever the tick, so tests can pick short timeouts.
            "minSessionTimeout=1000",
            "maxSessionTimeout=60000",
        ]
        if self.pki is not None:
            lines += [
                f"secureClientPort={self.secure_port}",
                "secureClientPortAddress=127.0.0.1",
                "serverCnxnFactory=org.apache.zookeeper.server.NettyServerCnxnFactory",
                f"ssl.keyStore.location={self.pki.server_pem}",
                "ssl.keyStore.type=PEM",
                f"ssl.trustStore.location={self.pki.ca}",
                "ssl.trustStore.type=PEM",
                "ssl.clientAuth=need",
            ]
        if self.peers:
            lines.append("standaloneEnabled=false")
            lines += [
                f"server.{p.myid}=127.0.0.1:{p.quorum_port}:{p.election_port}" for p in self.peers
            ]
        return "\n".join(lines) + "\n"

    def start(self) -> None:
        if not Path(ZK_SERVER_SH).exists():
            raise ConfigurationError(
                f"{ZK_SERVER_SH} not found: install Debian's zookeeper package "
                "(scripts/setup.sh does) or set ZKQ_ZKSERVER_SH"
            )
        (self.dir / "data").mkdir(parents=True, exist_ok=True)
        (self.dir / "data" / "myid").write_text(f"{self.myid}\n")
        (self.dir / "zoo.cfg").write_text(self._config())
        env = {
            **os.environ,
            "ZOOCFGDIR": str(self.dir),
            "ZOO_LOG_DIR": str(self.dir),
            # ZKQ_ZK_HEAP: the server's heap (benchmarks that store 250,000 results use more).
            "SERVER_JVMFLAGS": (
                f"-Xmx{os.environ.get('ZKQ_ZK_HEAP', '256m')} -XX:+UseSerialGC -cp {_CLASSPATH}"
            ),
        }
        log = open(self.log_path, "ab")  # noqa: SIM115 - the child process owns it
        self.process = subprocess.Popen(
            [ZK_SERVER_SH, "start-foreground", str(self.dir / "zoo.cfg")],
            stdout=log,
            stderr=subprocess.STDOUT,
            env=env,
            start_new_session=True,
        )
        log.close()

    def serving(self) -> bool:
        """True when the server answers requests (in an ensemble: it has joined a quorum)."""
        return "Mode:" in four_letter(self.client_port, "srvr")

    def mode(self) -> str:
        for line in four_letter(self.client_port, "srvr").splitlines():
            if line.startswith("Mode:"):
                return line.split(":", 1)[1].strip()
        return ""

    def wait_serving(self, timeout: float = 60.0) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.serving():
                return
            if self.process is not None and self.process.poll() is not None:
                raise RuntimeError(f"ZooKeeper {self.myid} exited:\n{self.log_tail()}")
            time.sleep(0.1)
        raise TimeoutError(
            f"ZooKeeper {self.myid} not serving after {timeout}s:\n{self.log_tail()}"
        )

    def stop(self, sig: int = signal.SIGTERM) -> None:
        """Stop the server (SIGKILL for a crash); its data dir stays for a restart."""
        if self.process is None:
            return
        if self.process.poll() is None:
            os.killpg(self.process.pid, sig)
            try:
                self.process.wait(timeout=15)
            except subprocess.TimeoutExpired:
                os.killpg(self.process.pid, signal.SIGKILL)
                self.process.wait()
        self.process = None

    def kill(self) -> None:
        self.stop(signal.SIGKILL)

    def log_tail(self, lines: int = 60) -> str:
        try:
            return "\n".join(self.log_path.read_text(errors="replace").splitlines()[-lines:])
        except OSError:
            return "(no log)"


class ZkCluster:
    """A standalone server (size 1) or an ensemble (3 or 5) under one temp dir."""

    def __init__(
        self,
        size: int = 1,
        base: str | Path | None = None,
        tick_ms: int = 200,
        pki: TestPki | None = None,
    ) -> None:
        self._tmp = None if base else tempfile.mkdtemp(prefix="zkq-zk-")
        self.base = Path(base or self._tmp or ".")
        self.servers = [
            ZkServer(myid=i + 1, base=self.base, tick_ms=tick_ms, pki=pki) for i in range(size)
        ]
        if size > 1:
            for s in self.servers:
                s.peers = self.servers

    @property
    def hosts(self) -> str:
        return ",".join(s.address for s in self.servers)

    @property
    def secure_hosts(self) -> str:
        return ",".join(f"127.0.0.1:{s.secure_port}" for s in self.servers)

    def start(self, timeout: float = 90.0) -> ZkCluster:
        for s in self.servers:
            s.start()
        for s in self.servers:
            s.wait_serving(timeout)
        return self

    def leader(self) -> ZkServer | None:
        return next((s for s in self.servers if s.process and s.mode() == "leader"), None)

    def followers(self) -> list[ZkServer]:
        return [s for s in self.servers if s.process and s.mode() == "follower"]

    def stop(self) -> None:
        for s in self.servers:
            s.stop()
        if self._tmp:
            shutil.rmtree(self._tmp, ignore_errors=True)

    def logs(self) -> str:
        return "\n".join(
            f"--- zookeeper {s.myid} ({s.address}) ---\n{s.log_tail()}" for s in self.servers
        )

    def __enter__(self) -> ZkCluster:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.stop()
