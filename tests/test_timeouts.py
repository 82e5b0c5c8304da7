"""``--timeout`` bounds every wait of ``zkq submit``: connecting, reconnecting, reading state and
waiting for the result. With ``--timeout 8`` the command returns within 9 seconds, exit 6
(unreachable) or 4 (timeout), whether ZooKeeper is unreachable from the start or goes away in
the middle of the wait."""

from __future__ import annotations

import subprocess
import time

from kazoo.client import KazooClient

from tests.conftest import ZKQ, _env, wait_for
from zkqueue.errors import ExitCode
from zkqueue.testing import ZkCluster, free_port

LIMIT = 9.0


def _submit(hosts: str, root: str) -> subprocess.Popen[str]:
    cmd = [*ZKQ, "--zk", hosts, "--root", root, "submit", "--timeout", "8", "hello"]
    return subprocess.Popen(
        cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=_env()
    )


def _finish(proc: subprocess.Popen[str], started: float) -> tuple[int, str, float]:
    proc.wait(30)
    elapsed = time.monotonic() - started
    assert proc.stderr is not None
    return proc.returncode, proc.stderr.read(), elapsed


def test_unreachable_from_the_start() -> None:
    started = time.monotonic()
    code, err, elapsed = _finish(_submit(f"127.0.0.1:{free_port()}", "/zkq"), started)
    assert code in (ExitCode.UNAVAILABLE, ExitCode.TIMEOUT), err
    assert elapsed < LIMIT, f"returned after {elapsed:.1f}s"
    assert "cannot reach ZooKeeper" in err and "Traceback" not in err
    print(f"unreachable from the start: exit {code} after {elapsed:.2f}s")


def test_connection_cut_in_the_middle_of_the_wait() -> None:
    with ZkCluster(1) as cluster:
        started = time.monotonic()
        proc = _submit(cluster.hosts, "/zkq")
        watcher = KazooClient(hosts=cluster.hosts)
        watcher.start(timeout=10)
        pending = "/zkq/queues/default/pending/normal"
        wait_for(lambda: watcher.exists(pending) and watcher.get_children(pending), timeout=8)
        watcher.stop()
        watcher.close()
        cluster.stop()  # no worker: the submit is waiting for its result now
        cut = time.monotonic() - started
        code, err, elapsed = _finish(proc, started)
    assert code in (ExitCode.UNAVAILABLE, ExitCode.TIMEOUT), err
    assert elapsed < LIMIT, f"returned after {elapsed:.1f}s (ZooKeeper stopped at {cut:.1f}s)"
    assert "Traceback" not in err
    print(f"cut at {cut:.2f}s: exit {code} after {elapsed:.2f}s")
