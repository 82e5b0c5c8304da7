"""Crashes: a worker killed mid-job loses its claim with its session; the job runs again."""

from __future__ import annotations

import signal

import pytest

from tests.conftest import result_ids, running_on, wait_for
from zkqueue import Client

pytestmark = pytest.mark.slow


def test_kill_9_mid_job_reruns_elsewhere_with_one_result(client: Client, spawn_worker) -> None:
    doomed = spawn_worker("--runner", "echo", "--echo-delay", "60", "--name", "doomed")
    wait_for(lambda: client.workers(), message="first worker registered")
    job = client.submit("survive me", detach=True)
    wait_for(lambda: running_on(client, job.id) == "doomed", message="job running on doomed")

    spawn_worker("--runner", "echo", "--name", "rescuer")
    doomed.send_signal(signal.SIGKILL)
    doomed.wait(10)

    record = job.result(timeout=30)
    assert (record.status, record.worker, record.output) == ("succeeded", "rescuer", "survive me")
    assert record.attempts >= 2
    assert result_ids(client) == [job.id]
    assert client.list() == []


def test_poison_job_is_dead_lettered_after_max_attempts(client: Client, spawn_worker) -> None:
    job = client.submit("poison", detach=True)
    for attempt in range(1, 3):
        victim = spawn_worker("--runner", "echo", "--echo-delay", "60", "--max-attempts", "2")
        wait_for(
            lambda a=attempt: (
                client.job(job.id).info().get("attempts") == a and running_on(client, job.id)
            ),
            timeout=20,
            message=f"attempt {attempt}",
        )
        victim.send_signal(signal.SIGKILL)
        victim.wait(10)
    spawn_worker("--runner", "echo", "--max-attempts", "2")
    record = job.result(timeout=30)
    assert record.status == "dead"
    assert "max_attempts=2" in (record.error or "")
    [letter] = client.zk.get_children(client.layout.dead("default"))
    assert letter.startswith(f"normal.0000000000.{job.id}-")
