"""The zkq command end to end, through subprocesses, with its documented exit codes."""

from __future__ import annotations

import json
import os
import subprocess
from pathlib import Path

import pytest

from tests.conftest import ZKQ, Relay, wait_for
from zkqueue import Client
from zkqueue.cli import batch
from zkqueue.errors import ExitCode, ZkqConnectionError
from zkqueue.protocol.spec import JobSpec


def test_submit_waits_and_prints_output(zkq, spawn_worker, client: Client) -> None:
    spawn_worker("--runner", "echo", "--max-concurrency", "2")
    out = zkq("submit", "--priority", "high", "hello world")
    assert (out.returncode, out.stdout) == (0, "hello world\n"), out.stderr
    out = zkq("submit", "--json", "-", input="from stdin")
    record = json.loads(out.stdout)
    assert out.returncode == 0
    assert (record["status"], record["output"], record["priority"]) == (
        "succeeded",
        "from stdin",
        "normal",
    )
    out = zkq("submit", input="piped\n\n")  # echo's line ending goes, the prompt's own stays
    assert (out.returncode, out.stdout) == (0, "piped\n\n"), out.stderr


def test_detached_job_lifecycle(zkq, spawn_worker, client: Client) -> None:
    out = zkq("submit", "--detach", "--json", "--priority", "low", "later")
    assert out.returncode == 0, out.stderr
    job_id = json.loads(out.stdout)["id"]
    status = json.loads(zkq("status", job_id, "--json").stdout)
    assert (status["state"], status["position"]) == ("pending", 1)
    assert zkq("status", job_id).stdout.startswith("pending (position 1)")
    rows = json.loads(zkq("ls", "--json").stdout)
    assert [r["id"] for r in rows] == [job_id]
    stats = json.loads(zkq("stats", "--json").stdout)
    assert stats["queues"]["default"]["depth"]["low"] == 1
    assert zkq("result", job_id).returncode == ExitCode.TIMEOUT

    spawn_worker("--runner", "echo", "--name", "w1")
    out = zkq("result", job_id, "--wait", "--timeout", "20", "--json")
    assert out.returncode == 0, out.stderr
    assert json.loads(out.stdout)["worker"] == "w1"
    assert zkq("result", job_id).stdout == "later\n"
    workers = json.loads(zkq("workers", "--json").stdout)
    assert [w["id"] for w in workers] == ["w1"]
    assert workers[0]["slots_max"] == 1 and workers[0]["queue"] == "default"


def test_cancel_from_the_command_line(zkq, client: Client) -> None:
    job_id = zkq("submit", "--detach", "x").stdout.strip()
    out = zkq("cancel", job_id)
    assert out.returncode == 0 and "cancelled" in out.stdout
    assert zkq("cancel", job_id).returncode == ExitCode.JOB_FAILED
    assert json.loads(zkq("status", job_id, "--json").stdout)["state"] == "cancelled"
    out = zkq("result", job_id)
    assert out.returncode == ExitCode.JOB_FAILED
    assert "cancelled" in out.stderr


def test_failed_job_exit_code(zkq, spawn_worker) -> None:
    spawn_worker("--runner", "echo")
    out = zkq("submit", "--max-runtime", "0.5", "x")
    assert out.returncode == 0
    spawn_worker("--runner", "echo", "--echo-delay", "5", "--queue", "slow")
    out = zkq("submit", "--queue", "slow", "--max-runtime", "0.2", "x")
    assert out.returncode == ExitCode.JOB_FAILED
    assert "timeout" in out.stderr


def test_usage_errors_exit_2_and_write_nothing(zkq, client: Client) -> None:
    for args in (
        ["submit", "--priority", "urgent", "x"],
        ["submit", ""],
        ["submit", "--max-new-tokens", "0", "x"],
        ["submit", "--max-new-tokens", "many"],
        ["submit", "--queue", "a/b", "x"],
        ["status", "bad id!"],
    ):
        out = zkq(*args)
        assert out.returncode == ExitCode.USAGE, (args, out.stdout, out.stderr)
        assert out.stderr.strip()
    assert client.zk.exists(client.layout.queues()) is None


def test_oversize_prompt_exit_2(zkq) -> None:
    out = zkq("submit", "-", input="x" * 70_000)
    assert out.returncode == ExitCode.USAGE
    assert "limit is 65536 bytes" in out.stderr


def test_unknown_job_exit_3(zkq) -> None:
    out = zkq("status", "0123456789abcdef")
    assert out.returncode == ExitCode.NOT_FOUND
    assert "no job 0123456789abcdef" in out.stderr


def test_caller_timeout_exit_4_withdraws(zkq, client: Client) -> None:
    out = zkq("submit", "--timeout", "0.5", "nobody home")
    assert out.returncode == ExitCode.TIMEOUT
    assert "no result after 0.5s" in out.stderr
    wait_for(lambda: client.list() == [], message="request withdrawn")


def test_unreachable_zookeeper_exit_6(zkq) -> None:
    out = zkq("--connect-timeout", "1", "stats", zk="127.0.0.1:1")
    assert out.returncode == ExitCode.UNAVAILABLE
    assert "cannot reach ZooKeeper at 127.0.0.1:1" in out.stderr


def test_environment_fallbacks(hosts: str, root: str, client: Client) -> None:
    import os
    import subprocess
    import sys

    env = {**os.environ, "ZKQ_ZK": hosts, "ZKQ_ROOT": root}
    out = subprocess.run(
        [sys.executable, "-m", "zkqueue.cli", "submit", "--detach", "via env"],
        capture_output=True,
        text=True,
        env=env,
        timeout=60,
    )
    assert out.returncode == 0, out.stderr
    assert client.job(out.stdout.strip()).status() == "pending"


def test_submit_sets_every_spec_field_and_takes_an_id(zkq, client: Client) -> None:
    """The generation fields a JSONL line can set are options too, and --job-id makes a
    submit idempotent: the second one returns the first job, and enqueues nothing."""
    args = ("--detach", "--job-id", "nightly.1", "--stop", "END", "--stop", "###")
    out = zkq("submit", *args, "--min-new-tokens", "2", "--ignore-eos", "report")
    assert (out.returncode, out.stdout.strip()) == (0, "nightly.1"), out.stderr
    job = client.job("nightly.1", "default")
    data, _ = client.zk.get(job.entry_path or "")
    spec = JobSpec.from_bytes(data)
    assert (spec.prompt, spec.stop, spec.min_new_tokens, spec.ignore_eos) == (
        "report",
        ("END", "###"),
        2,
        True,
    )
    again = zkq("submit", "--detach", "--job-id", "nightly.1", "report")
    assert (again.returncode, again.stdout.strip()) == (0, "nightly.1"), again.stderr
    assert [row["id"] for row in client.list()] == ["nightly.1"]
    plain = zkq("submit", "--detach", "plain")
    data, _ = client.zk.get(client.job(plain.stdout.strip(), "default").entry_path or "")
    assert (JobSpec.from_bytes(data).stop, JobSpec.from_bytes(data).ignore_eos) == (None, False)


def _run_zkq(*args: str, env: dict[str, str] | None = None) -> subprocess.CompletedProcess[str]:
    """The zkq CLI with exactly ``args`` (no connection options added before the command)."""
    full = {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), **(env or {})}
    return subprocess.run(
        [*ZKQ, *args], capture_output=True, text=True, env=full, timeout=60, check=False
    )


def test_connection_options_after_the_command_name(hosts: str, root: str, client: Client) -> None:
    """--zk, --root and the timeouts work after the command's name as before it, and a value
    after the name wins over one before it (and over ZKQ_ZK)."""
    out = _run_zkq("stats", "--json", "--zk", hosts, "--root", root, "--session-timeout", "4")
    assert out.returncode == 0, out.stderr
    assert "queues" in json.loads(out.stdout)
    # Before: unreachable; after: the real one. The after-value wins, and over the environment.
    out = _run_zkq(
        "--zk", "127.0.0.1:1", "stats", "--zk", hosts, "--root", root, env={"ZKQ_ZK": "x:1"}
    )
    assert out.returncode == 0, out.stderr
    out = _run_zkq(
        "--zk", hosts, "--root", root, "stats", "--zk", "127.0.0.1:1", "--connect-timeout", "1"
    )
    assert out.returncode == ExitCode.UNAVAILABLE
    assert "127.0.0.1:1" in out.stderr
    # A group's subcommand takes them too.
    out = _run_zkq("queue", "create", "after", "--zk", hosts, "--root", root)
    assert out.returncode == 0, out.stderr
    assert "after" in client.queue_names()
    # A bad root is the same configuration error on either side.
    out = _run_zkq("stats", "--root", "relative")
    assert out.returncode == ExitCode.CONFIG
    assert "root must be an absolute" in out.stderr


def test_worker_takes_connection_options_after_its_name(
    hosts: str, root: str, client: Client, tmp_path: Path
) -> None:
    """A plugin command (zkq worker) takes them after its name, where they also win over its
    config file: a burst worker runs the job."""
    job = client.submit("after the name", detach=True)
    config = tmp_path / "worker.toml"
    config.write_text('zk = "127.0.0.1:1"\nconnect_timeout = 1\n')
    out = _run_zkq(
        "worker",
        "--config",
        str(config),
        "--zk",
        hosts,
        "--root",
        root,
        "--runner",
        "echo",
        "--burst",
        "--no-janitor",
        "--quiet",
        env={"ZKQ_ZK": "127.0.0.1:1"},
    )
    assert out.returncode == 0, out.stderr
    assert client.job(job.id).result(timeout=10).output == "after the name"


def test_help_lists_connection_options_once_each() -> None:
    """zkq --help lists them (and says where they go); a command's help lists them after its
    own options."""
    top = _run_zkq("--help")
    assert top.returncode == 0
    assert top.stdout.count("--zk HOSTS") == 1 and "after the command name" in top.stdout
    stats = _run_zkq("stats", "--help")
    assert stats.returncode == 0
    lines = stats.stdout.splitlines()
    flags = [line.split()[0] for line in lines if line.startswith("  -")]
    assert flags.index("--json") < flags.index("--zk") < flags.index("-h,")
    for flag in ("--zk", "--root", "--session-timeout", "--connect-timeout", "--auth", "--tls-ca"):
        assert flags.count(flag) == 1, flag
    assert "ZKQ_ZK" in stats.stdout


def test_the_warning_after_a_submit_never_fails_it(relay: Relay, root: str, capsys) -> None:
    """ZooKeeper gone right after the submit: the "no worker" check that follows (a warning)
    is skipped, so the job's id is still printed; before a submit (--require-worker) the same
    check fails, naming the outage."""
    with Client(f"127.0.0.1:{relay.port}", root, connect_timeout=1.0) as client:
        client.submit("in", detach=True)
        relay.cut()
        wait_for(lambda: not client.zk.connected, message="the client to notice")
        batch.check_served(client, ["default"], require=False)
        assert "warning" not in capsys.readouterr().err
        with pytest.raises(ZkqConnectionError, match="did not come back within 1s"):
            batch.check_served(client, ["default"], require=True)
