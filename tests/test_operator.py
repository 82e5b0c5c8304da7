"""Operator conveniences: bulk submit from JSONL, worker config files, JSON logs, completion."""

from __future__ import annotations

import json
import subprocess
from pathlib import Path

from tests.conftest import ZKQ, _env, wait_for
from zkqueue import Client
from zkqueue.errors import ExitCode


def test_bulk_submit_writes_a_record_for_every_line(
    zkq, spawn_worker, tmp_path: Path, client: Client
) -> None:
    spawn_worker("--runner", "echo", "--max-concurrency", "4")
    lines = [
        json.dumps({"prompt": "first", "priority": "low"}),
        "not json at all",
        json.dumps({"prompt": "second", "max_new_tokens": 5, "priority": "high"}),
        "",
        json.dumps({"prompt": ""}),
        json.dumps({"prompt": "third", "queue": "default", "temperature": 0.5}),
    ]
    source = tmp_path / "prompts.jsonl"
    source.write_text("\n".join(lines) + "\n")
    out = zkq("submit", "--file", str(source), "--out", str(tmp_path / "out.jsonl"))
    assert out.returncode == ExitCode.USAGE, out.stderr
    assert "line 2:" in out.stderr and "line 5: prompt must not be empty" in out.stderr
    written = [json.loads(x) for x in (tmp_path / "out.jsonl").read_text().splitlines()]
    records = sorted(written, key=lambda r: r["line"])
    assert [r["line"] for r in records] == [1, 2, 3, 5, 6]
    assert [r.get("output") for r in records] == ["first", None, "second", None, "third"]
    assert [r["status"] for r in records] == [
        "succeeded",
        "invalid",
        "succeeded",
        "invalid",
        "succeeded",
    ]
    assert records[0]["priority"] == "low" and records[2]["priority"] == "high"


def test_bulk_results_are_written_as_the_jobs_end(
    hosts: str, root: str, start_worker, tmp_path: Path, client: Client
) -> None:
    """The high-priority line runs first, so its record comes first, whatever the input order;
    each record is on disk as soon as its job ends."""
    source = tmp_path / "p.jsonl"
    rows = [{"prompt": "later", "priority": "low"}, {"prompt": "sooner", "priority": "high"}]
    source.write_text("".join(json.dumps(r) + "\n" for r in rows))
    out = tmp_path / "out.jsonl"
    cmd = [*ZKQ, "--zk", hosts, "--root", root, "submit", "--file", str(source), "--out", str(out)]
    proc = subprocess.Popen(cmd, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.PIPE)
    try:
        wait_for(lambda: len(client.list()) == 2, timeout=30, message="both lines pending")
        start_worker(slots=1)
        assert proc.wait(60) == 0, proc.stderr.read() if proc.stderr else ""
    finally:
        if proc.poll() is None:
            proc.kill()
    records = [json.loads(x) for x in out.read_text().splitlines()]
    assert [(r["line"], r["output"]) for r in records] == [(2, "sooner"), (1, "later")]


def test_bulk_submit_detached_prints_ids(zkq, tmp_path: Path, client: Client) -> None:
    source = tmp_path / "p.jsonl"
    source.write_text("".join(json.dumps({"prompt": f"p{i}"}) + "\n" for i in range(40)))
    out = zkq("submit", "--detach", "--file", str(source))
    assert out.returncode == 0, out.stderr
    ids = [json.loads(x)["id"] for x in out.stdout.splitlines()]
    assert len(set(ids)) == 40
    assert [r["id"] for r in client.list()] == ids


def test_worker_config_file_and_precedence(
    hosts: str, root: str, tmp_path: Path, client: Client
) -> None:
    import os
    import subprocess
    import sys

    from tests.conftest import _env

    config = tmp_path / "worker.toml"
    config.write_text(
        'queue = "from-file"\nname = "file-worker"\n[worker]\nmax-concurrency = 3\n'
        "echo_delay = 0.1\n"
    )
    env = {
        **_env(),
        "ZKQ_WORKER_QUEUE": "from-env",
        "ZKQ_WORKER_MAX_CONCURRENCY": "9",
        "ZKQ_ZK": hosts,
        "ZKQ_ROOT": root,
    }
    cmd = [
        sys.executable,
        "-m",
        "zkqueue.cli",
        "--session-timeout",
        "3",
        "worker",
        "--config",
        str(config),
        "--max-concurrency",
        "2",
    ]
    proc = subprocess.Popen(cmd, env=env, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    try:
        wait_for(lambda: client.workers(), timeout=30, message="worker registered")
        [record] = client.workers()
        # file beats env (queue), flag beats file (slots), file sets what nothing else does
        assert (record["queue"], record["slots_max"], record["id"]) == (
            "from-file",
            2,
            "file-worker",
        )
    finally:
        proc.terminate()
        proc.wait(30)
    assert os.path.exists(config)


def test_bad_config_files_exit_7(zkq, tmp_path: Path) -> None:
    bad = tmp_path / "bad.toml"
    bad.write_text("max_concurrency = 'many'\n")
    out = zkq("worker", "--config", str(bad))
    assert out.returncode == ExitCode.CONFIG and "max_concurrency" in out.stderr
    bad.write_text("gpus = 3\n")
    out = zkq("worker", "--config", str(bad))
    assert out.returncode == ExitCode.CONFIG and "unknown setting 'gpus'" in out.stderr
    out = zkq("worker", "--config", str(tmp_path / "missing.toml"))
    assert out.returncode == ExitCode.CONFIG and "cannot read worker config" in out.stderr


def test_json_logs_carry_job_fields(zkq, spawn_worker, client: Client, tmp_path: Path) -> None:
    import subprocess
    import sys

    from tests.conftest import _env

    log = tmp_path / "json.log"
    with log.open("w") as f:
        proc = subprocess.Popen(
            [
                sys.executable,
                "-m",
                "zkqueue.cli",
                "--zk",
                client.settings.hosts,
                "--root",
                client.layout.root,
                "--log-format",
                "json",
                "--log-level",
                "INFO",
                "worker",
                "--runner",
                "echo",
                "--max-jobs",
                "1",
                "--name",
                "jw",
            ],
            stdout=f,
            stderr=subprocess.STDOUT,
            env=_env(),
        )
        job = client.submit("log me", priority="high")
        assert job.result(timeout=30).ok
        assert proc.wait(30) == 0
    entries = [json.loads(x) for x in log.read_text().splitlines() if x.startswith("{")]
    assert entries, log.read_text()
    job_lines = [e for e in entries if e.get("job") == job.id]
    assert job_lines, entries
    assert all(
        e["queue"] == "default" and e["priority"] == "high" and e["worker"] == "jw"
        for e in job_lines
    )


def test_completion_script(zkq) -> None:
    out = zkq("completion", "bash")
    assert out.returncode == 0 and "_ZKQ_COMPLETE" in out.stdout


def test_worker_serves_prometheus_metrics(spawn_worker, client: Client) -> None:
    import urllib.request

    from zkqueue.testing import free_port

    port = free_port()
    spawn_worker(
        "--runner",
        "echo",
        "--metrics-port",
        str(port),
        "--metrics-addr",
        "127.0.0.1",
        "--heartbeat-interval",
        "0.2",
    )
    wait_for(lambda: client.workers(), timeout=30, message="worker registered")
    assert client.submit("measure me", priority="high").result(timeout=30).ok

    def scrape() -> str:
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=5) as r:
            return str(r.read().decode())

    # The caller can read the result before the worker's thread has counted it: wait for both.
    counted = 'zkq_jobs_total{priority="high",queue="default",status="succeeded"} 1.0'
    text = wait_for(
        lambda: 'slots{state="max"} 1.0' in (t := scrape()) and counted in t and t,
        message="metrics updated",
    )
    assert 'zkq_run_seconds_count{priority="high",queue="default"} 1.0' in text
    assert "zkq_zookeeper_connected 1.0" in text
