"""Prometheus metrics: a worker's own (workers/metrics.py) and the cluster's, read from a real
ZooKeeper on each scrape (zkqueue/operations/exporter.py), including scrapes while ZooKeeper is
away."""

from __future__ import annotations

import socket
import time
import urllib.request

from prometheus_client import CollectorRegistry, generate_latest
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.utils import floatToGoString

from tests.conftest import Relay, wait_for
from workers.metrics import WorkerMetrics
from workers.runners.echo import EchoRunner
from zkqueue import Client
from zkqueue.operations.exporter import (
    ClusterCollector,
    collect_once,
    read_cluster,
    serve_cluster_metrics,
)
from zkqueue.operations.janitor import PassReport
from zkqueue.producer.enqueue import Enqueuer


def samples(text: str) -> dict[tuple[str, frozenset[tuple[str, str]]], float]:
    """Every sample of an exposition, keyed by (name, labels)."""
    return {
        (s.name, frozenset(s.labels.items())): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }


def value(text: str, name: str, **labels: str) -> float | None:
    return samples(text).get((name, frozenset(labels.items())))


def exposition(metrics: WorkerMetrics) -> str:
    return generate_latest(metrics.registry).decode()


# -- a worker's metrics --------------------------------------------------------------------------


def test_job_finished_counts_and_observes() -> None:
    m = WorkerMetrics()
    m.job_finished("default", "high", "succeeded", wait_s=0.3, run_s=1.5, tokens=12)
    m.job_finished("default", "high", "failed", wait_s=0.2, run_s=0.1, tokens=None)
    m.job_finished("default", "low", "expired", wait_s=None, run_s=None, tokens=None)
    text = exposition(m)
    jobs = "zkq_jobs_total"
    assert value(text, jobs, queue="default", priority="high", status="succeeded") == 1
    assert value(text, jobs, queue="default", priority="high", status="failed") == 1
    assert value(text, jobs, queue="default", priority="low", status="expired") == 1
    # Known statuses start at zero, so rate() sees the first one of a kind.
    assert value(text, jobs, queue="default", priority="normal", status="dead") == 0
    assert value(text, "zkq_queue_wait_seconds_count", queue="default", priority="high") == 2
    assert value(text, "zkq_queue_wait_seconds_count", queue="default", priority="low") is None
    wait_le = {"queue": "default", "priority": "high", "le": "0.25"}
    assert value(text, "zkq_queue_wait_seconds_bucket", **wait_le) == 1
    assert value(text, "zkq_run_seconds_sum", queue="default", priority="high") == 1.6
    assert value(text, "zkq_tokens_generated_total", queue="default") == 12


def test_gauges_and_counters_follow_the_calls() -> None:
    m = WorkerMetrics()
    m.batch("default", 5)
    m.cache(total=96, promised=40)
    m.job_pages("default", 3)
    m.slots(busy=2, max=4)
    m.lease_renewed(3)
    m.lease_renewed(0)
    m.claim_lost("lease")
    m.connection("SUSPENDED")
    text = exposition(m)
    assert value(text, "zkq_batch_size_bucket", queue="default", le="4.0") == 0
    assert value(text, "zkq_batch_size_bucket", queue="default", le="6.0") == 1
    assert value(text, "zkq_kv_cache_pages", kind="total") == 96
    assert value(text, "zkq_kv_cache_pages", kind="promised") == 40
    need_le = {"queue": "default", "le": floatToGoString(4)}
    assert value(text, "zkq_job_kv_pages_bucket", **need_le) == 1
    assert value(text, "zkq_job_kv_pages_bucket", queue="default", le=floatToGoString(2)) == 0
    assert value(text, "zkq_slots", state="busy") == 2
    assert value(text, "zkq_slots", state="max") == 4
    assert value(text, "zkq_lease_renewals_total") == 3
    assert value(text, "zkq_claims_lost_total", reason="lease") == 1
    assert value(text, "zkq_zookeeper_connected") == 0
    assert value(text, "zkq_zookeeper_state", state="SUSPENDED") == 1
    assert value(text, "zkq_zookeeper_state", state="CONNECTED") == 0
    m.connection("CONNECTED")
    text = exposition(m)
    assert value(text, "zkq_zookeeper_connected") == 1
    assert value(text, "zkq_zookeeper_state", state="SUSPENDED") == 0


def test_workers_in_one_process_keep_their_own_registries() -> None:
    first, second = WorkerMetrics(), WorkerMetrics()
    first.lease_renewed(2)
    assert value(exposition(first), "zkq_lease_renewals_total") == 2
    assert value(exposition(second), "zkq_lease_renewals_total") == 0


def test_serve_answers_http() -> None:
    m = WorkerMetrics()
    m.slots(busy=1, max=2)
    server = m.serve(0, "127.0.0.1")
    try:
        text = fetch(server.server_port)
    finally:
        server.shutdown()
        server.server_close()
    for name in ("zkq_jobs_total", "zkq_slots", "zkq_zookeeper_state", "zkq_run_seconds"):
        assert name in text
    assert value(text, "zkq_slots", state="max") == 2


def fetch(port: int) -> str:
    with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as answer:
        body: bytes = answer.read()
    return body.decode()


# -- the cluster's metrics -----------------------------------------------------------------------


def entry_ctime(client: Client, queue: str, priority: str, job_id: str) -> float:
    name = client.find_entry(queue, priority, job_id)
    assert name is not None
    stat = client.zk.exists(client.layout.entry(queue, priority, name))
    return float(stat.ctime) / 1000


def test_cluster_metrics_describe_a_populated_root(client: Client, start_worker) -> None:
    # A queue nobody serves: everything waits.
    sizes = {"high": 2, "normal": 3, "low": 1}
    backlog = {
        p: client.submit_many(["x"] * n, priority=p, queue="backlog") for p, n in sizes.items()
    }
    # A queue with one worker, two slots, slow jobs and one malformed entry.
    handle = start_worker(EchoRunner(delay=30), queue="gpu", slots=2)
    text = collect_once(client)
    assert value(text, "zkq_queue_idle_workers", queue="gpu") == 1
    pending = client.layout.bucket("gpu", "normal", 0)
    client.zk.create(f"{pending}/broken-", b"not json", sequence=True)
    gpu = client.submit_many(["a", "b", "c"], queue="gpu")
    wait_for(
        lambda: (
            client.stats()["queues"]["gpu"]["running"] == 2
            and client.stats()["queues"]["gpu"]["dead"] == 1
        ),
        message="two running, one dead letter",
    )
    before = time.time()
    text = collect_once(client)
    after = time.time()

    for priority, n in sizes.items():
        assert value(text, "zkq_queue_depth", queue="backlog", priority=priority) == n
    assert value(text, "zkq_queue_waiting", queue="backlog") == 6
    assert value(text, "zkq_queue_running", queue="backlog") == 0
    assert value(text, "zkq_workers", queue="backlog") == 0
    age = value(text, "zkq_queue_oldest_pending_seconds", queue="backlog", priority="high")
    first = entry_ctime(client, "backlog", "high", backlog["high"][0].id)
    assert age is not None and before - first - 0.01 <= age <= after - first + 0.01

    assert value(text, "zkq_queue_depth", queue="gpu", priority="normal") == 3
    assert value(text, "zkq_queue_depth", queue="gpu", priority="high") == 0
    assert value(text, "zkq_queue_waiting", queue="gpu") == 1
    assert value(text, "zkq_queue_running", queue="gpu") == 2
    assert value(text, "zkq_queue_dead", queue="gpu") == 1
    assert value(text, "zkq_queue_idle_workers", queue="gpu") == 0
    assert value(text, "zkq_workers", queue="gpu") == 1
    # Nothing waits at high: age 0 rather than a missing series.
    assert value(text, "zkq_queue_oldest_pending_seconds", queue="gpu", priority="high") == 0
    assert value(text, "zkq_exporter_zookeeper_up") == 1
    assert value(text, "zkq_exporter_scrape_errors_total") == 0

    # The oldest *unclaimed* entry: the worker holds the first two jobs, the third waits.
    state = read_cluster(client)
    gpu_state = next(q for q in state.queues if q.name == "gpu")
    assert gpu_state.oldest["normal"] == entry_ctime(client, "gpu", "normal", gpu[2].id)
    assert [w["id"] for w in state.workers] == [handle.worker.id]


def test_cluster_metrics_over_http(client: Client) -> None:
    client.submit_many(["x"], queue="web", priority="low")
    server = serve_cluster_metrics(client, 0, "127.0.0.1")
    try:
        text = fetch(server.server_port)
    finally:
        server.shutdown()
        server.server_close()
    assert value(text, "zkq_queue_depth", queue="web", priority="low") == 1


def test_scrape_against_an_unreachable_zookeeper_counts_an_error() -> None:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]  # closed again: nothing listens there
    hosts = f"127.0.0.1:{port}"
    nowhere = Client(hosts).settings.make_client()
    nowhere.start_async()
    try:
        collector = ClusterCollector(Client(hosts, zk=nowhere))
        list(collector.collect())
        families = {m.name: m for m in collector.collect()}
    finally:
        nowhere.stop()
        nowhere.close()
    assert collector.errors == 2
    assert families["zkq_exporter_scrape_errors"].samples[0].value == 2
    assert families["zkq_exporter_zookeeper_up"].samples[0].value == 0
    assert families["zkq_queue_depth"].samples == []


def test_scrapes_survive_zookeeper_going_away_and_coming_back(relay: Relay, root: str) -> None:
    with Client(f"127.0.0.1:{relay.port}", root, session_timeout=4.0) as client:
        client.submit_many(["x", "y"], queue="q")
        collector = ClusterCollector(client, timeout=0.5)
        families = {m.name: m for m in collector.collect()}
        assert families["zkq_exporter_zookeeper_up"].samples[0].value == 1

        relay.flowing.clear()  # the server stops answering: the scrape must not hang
        started = time.monotonic()
        families = {m.name: m for m in collector.collect()}
        assert time.monotonic() - started < 3
        assert collector.errors == 1
        assert families["zkq_exporter_zookeeper_up"].samples[0].value == 0
        relay.flowing.set()

        relay.cut()  # the server goes away
        wait_for(lambda: not client.zk.connected, message="the client to notice")
        families = {m.name: m for m in collector.collect()}
        assert collector.errors == 2
        assert families["zkq_exporter_scrape_errors"].samples[0].value == 2

        relay.restore()

        def whole() -> str | None:
            # A scrape reads within 0.5 s: on a loaded host one right after the reconnect can
            # still leave a queue out (an error it counts). Wait for a whole one.
            text = generate(collector)
            up = value(text, "zkq_exporter_zookeeper_up") == 1
            return text if up and value(text, "zkq_queue_waiting", queue="q") == 2 else None

        text = wait_for(whole, message="a whole scrape again, the queue's figures in it")
        assert collector.errors >= 2
        assert value(text, "zkq_exporter_scrape_errors_total") == collector.errors


def generate(collector: ClusterCollector) -> str:
    registry = CollectorRegistry()
    registry.register(collector)
    return generate_latest(registry).decode()


def test_the_elected_janitor_sets_the_stored_results_gauges() -> None:
    registry = CollectorRegistry()
    metrics = WorkerMetrics(registry)
    metrics.janitor_pass(PassReport(results_stored={"llama": 7}, results_bytes={"llama": 2048}))
    assert registry.get_sample_value("zkq_results_stored", {"queue": "llama"}) == 7
    assert registry.get_sample_value("zkq_results_stored_bytes", {"queue": "llama"}) == 2048


def test_waiting_counts_claims_outside_the_first_bucket(client: Client) -> None:
    """A claim on an entry past the first bucket (the first ones were left for a bigger worker)
    is running, not waiting."""
    client._enqueue = Enqueuer(client, bucket_size=2)
    jobs = [client.submit(text, detach=True) for text in "abc"]
    assert jobs[2].entry.startswith("0000000001/")  # buckets 0 (a, b) and 1 (c)
    client.zk.create(client.layout.claim("default", jobs[2].id), b"{}", ephemeral=True)
    (queue,) = read_cluster(client).queues
    assert (queue.total_depth, queue.running, queue.total_waiting) == (3, 1, 2)


def test_the_oldest_waiting_job_is_found_past_a_bucket_of_running_jobs(client: Client) -> None:
    """Long jobs hold every entry of the first bucket: the age comes from the next one."""
    client._enqueue = Enqueuer(client, bucket_size=2)
    jobs = [client.submit(text, detach=True) for text in "abc"]  # buckets 0 (a, b) and 1 (c)
    for job in jobs[:2]:
        client.zk.create(client.layout.claim("default", job.id), b"{}", ephemeral=True)
    (queue,) = read_cluster(client).queues
    assert queue.total_waiting == 1
    assert set(queue.oldest) == {"normal"}
    assert queue.oldest_age("normal", time.time()) is not None
