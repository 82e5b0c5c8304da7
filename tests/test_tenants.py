"""Tenants: fair share inside a priority (by weighted tokens, durable in ZooKeeper), strict priority
between bands, aging, per-tenant caps, and the protocol revision that brought tenants' lanes."""

from __future__ import annotations

import json

import httpx
import pytest

from gateway.config import ApiKey, GatewayConfig
from tests.conftest import wait_for
from tests.runners import HoldRunner, RecordingRunner
from workers.runners.echo import EchoRunner
from zkqueue import Client
from zkqueue.errors import ExitCode, InvalidJob, ProtocolMismatch, QueueFull
from zkqueue.operations.janitor import Janitor
from zkqueue.producer.enqueue import Enqueuer
from zkqueue.protocol import revision
from zkqueue.protocol.counters import (
    Counter,
    add_corrections,
    encode_counters,
    level,
    parse_corrections,
    parse_counters,
)
from zkqueue.protocol.layout import Layout
from zkqueue.protocol.limits import Limits
from zkqueue.protocol.migrate import migrate


def _tenants_of(seen: list[str]) -> list[str]:
    return [p.split(":")[0] for p in seen]


def test_a_tenants_job_lands_in_its_lane_and_runs(client: Client, start_worker) -> None:
    job = client.submit("hello", tenant="acme", detach=True)
    assert job.entry is not None and job.entry.startswith("@acme/0000000000/")
    assert job.tenant == "acme"
    assert client.job(job.id).info()["state"] == "pending"
    rows = client.list("default")
    assert [(r["id"], r["tenant"]) for r in rows] == [(job.id, "acme")]
    start_worker()
    assert job.result(timeout=10).status == "succeeded"


def test_ls_places_each_pending_job_as_status_does(client: Client) -> None:
    high = client.submit("urgent", priority="high", detach=True)
    mine = [client.submit(f"default:{i}", detach=True) for i in range(3)]
    theirs = [client.submit(f"B:{i}", tenant="B", detach=True) for i in range(2)]
    rows = {row["id"]: row for row in client.list()}
    # Workers take between lanes by fair share: B's first job is next after the high one,
    # not behind every job of the default tenant.
    for job, place in [(high, 1), *zip(mine, (2, 3, 4), strict=True), (theirs[0], 2)]:
        assert rows[job.id]["position"] == place == job.info()["position"], rows[job.id]
    assert rows[theirs[1].id]["position"] == 3


def test_running_jobs_in_other_lanes_move_no_ones_place(client: Client, start_worker) -> None:
    runner = HoldRunner()
    start_worker(runner, slots=2)
    client.submit("A-run", detach=True)
    client.submit("C-run", tenant="C", detach=True)
    wait_for(lambda: sorted(runner.running()) == ["A-run", "C-run"], message="both held")
    mine = [client.submit(f"default:{i}", detach=True) for i in range(3)]
    theirs = [client.submit(f"B:{i}", tenant="B", detach=True) for i in range(2)]
    low = client.submit("later", priority="low", detach=True)
    rows = {row["id"]: row for row in client.list()}
    expected = [*zip(mine, (1, 2, 3), strict=True), *zip(theirs, (1, 2), strict=True), (low, 6)]
    try:
        for job, place in expected:
            assert rows[job.id]["position"] == place == job.info()["position"], rows[job.id]
    finally:
        runner.release_all()


def test_a_batch_names_each_jobs_tenant(client: Client, layout) -> None:
    client.ensure_queue("default")
    Limits(client.zk, layout).set_tenant("default", "B", max_pending=1)
    Limits(client.zk, layout).set_tenant("default", "default", max_pending=1)
    specs = [{"prompt": "a", "tenant": "A"}, {"prompt": "b", "tenant": "B"}, "mine"]
    jobs = client.submit_many(specs, tenant="C")  # C: each line that names none
    assert [row["tenant"] for row in client.list()] == ["A", "B", "C"]  # lane by lane
    assert {j.info()["tenant"] for j in jobs} == {"A", "B", "C"}
    with pytest.raises(QueueFull, match="tenant 'B'"):  # B's cap counts B's jobs only
        client.submit_many([{"prompt": "b2", "tenant": "B"}, {"prompt": "a2", "tenant": "A"}])
    with pytest.raises(QueueFull, match="tenant 'default' of queue 'default' is full"):
        client.submit_many(["one too many", "two"])  # the default tenant's cap, named so
    with pytest.raises(InvalidJob, match=r"spec #1: bad tenant name"):
        client.submit_many(["ok", {"prompt": "x", "tenant": "no/slash"}])
    assert len(client.list()) == 3  # nothing of a refused batch went in


def test_inside_a_priority_tenants_take_turns(client: Client, start_worker) -> None:
    """A backlog of A's jobs, then a few of B's: B's are taken in turn with A's, not after
    all of A's; inside each tenant first come, first served."""
    client.submit_many([f"A:{i}" for i in range(30)], tenant="A")
    client.submit_many([f"B:{i}" for i in range(5)], tenant="B")
    runner = RecordingRunner()
    start_worker(runner, slots=1)
    wait_for(lambda: len(runner.seen) >= 35, 30)
    first = _tenants_of(runner.seen[:12])
    assert first.count("B") == 5, runner.seen[:12]
    assert [p for p in runner.seen if p.startswith("A")] == [f"A:{i}" for i in range(30)]
    assert [p for p in runner.seen if p.startswith("B")] == [f"B:{i}" for i in range(5)]


def test_a_lane_whose_first_bucket_emptied_still_offers_its_next_one(
    client: Client, layout, new_zk
) -> None:
    """The view itself: once the jobs of a lane's first bucket ran (their entries deleted), the
    refresh deletes the emptied bucket, and the lane's next bucket still gives candidates."""
    from zkqueue.dispatch.view import PendingView

    client._enqueue = Enqueuer(client, bucket_size=2)
    a = [client.submit(f"A:{i}", tenant="A", detach=True) for i in range(4)]  # 2 buckets
    view = PendingView(new_zk(), layout, "default", lambda part: None)
    view.refresh(2)
    assert [e.job_id for _, e in view.candidates(set())][:2] == [a[0].id, a[1].id]
    for job in a[:2]:  # ran on other workers
        client.zk.delete(f"{layout.pending('default', 'normal')}/{job.entry}")
    view.refresh(2)
    assert [e.job_id for _, e in view.candidates(set())] == [a[2].id, a[3].id]
    assert 0 not in view.buckets["normal/@A"]  # and the emptied bucket is gone
    assert not client.zk.exists(layout.bucket("default", "normal/@A", 0))


def test_weights_share_service_3_to_1(client: Client, start_worker, layout) -> None:
    client.ensure_queue("default")
    Limits(client.zk, layout).set_tenant("default", "gold", weight=3)
    client.submit_many([f"gold:{i}" for i in range(60)], tenant="gold")
    client.submit_many([f"tin:{i}" for i in range(60)], tenant="tin")
    runner = RecordingRunner()
    start_worker(runner, slots=1)
    wait_for(lambda: len(runner.seen) >= 40, 30)
    first = _tenants_of(runner.seen[:40])
    assert 28 <= first.count("gold") <= 32, first


def test_strict_priority_between_bands_stays(client: Client, start_worker) -> None:
    client.submit_many([f"A:{i}" for i in range(10)], tenant="A")
    client.submit("H:0", priority="high", detach=True, tenant="B")
    runner = RecordingRunner()
    start_worker(runner, slots=1)
    wait_for(lambda: len(runner.seen) >= 11, 30)
    assert runner.seen[0] == "H:0"


def test_the_counters_are_kept_in_zookeeper(client: Client, start_worker, layout) -> None:
    client.submit_many([f"A:{i}" for i in range(6)], tenant="A", max_new_tokens=10)
    client.submit_many([f"B:{i}" for i in range(6)], tenant="B", max_new_tokens=10)
    runner = RecordingRunner()
    start_worker(runner, slots=1)
    wait_for(lambda: len(runner.seen) >= 12, 30)
    counters = json.loads(client.zk.get(layout.service("default"))[0])
    stored = {tenant: counters[tenant]["service"] for tenant in ("A", "B")}
    # Each job is charged ceil(3 chars / 4) + 10 tokens while the other tenant waited.
    assert stored["A"] >= 4 * 11 and stored["B"] >= 4 * 11, stored
    # The echo runner counts 2 tokens a job: the workers write what the estimates overcharged.
    fixed = f"{layout.service('default')}/corrections"
    wait_for(lambda: client.zk.exists(fixed), 10, message="the corrections")
    assert json.loads(client.zk.get(fixed)[0])["A"] < 0


def test_a_tenant_that_was_idle_banks_no_credit(client: Client, start_worker, layout) -> None:
    """B's counter is far below A's (B idle, or new): it is lifted to A's level when it joins,
    so it takes turns with A instead of running all its jobs first."""
    zk = client.zk
    client.ensure_queue("default")
    counters = {"A": {"service": 10_000.0, "cost": 66.0}}  # B has none: it is new
    zk.set(layout.service("default"), json.dumps(counters).encode())
    client.submit_many([f"A:{i}" for i in range(20)], tenant="A")
    client.submit_many([f"B:{i}" for i in range(20)], tenant="B")
    runner = RecordingRunner()
    start_worker(runner, slots=1)
    wait_for(lambda: len(runner.seen) >= 20, 30)
    assert _tenants_of(runner.seen[:20]).count("A") >= 8, runner.seen[:20]


def test_aging_promotes_a_job_that_waited(client: Client, start_worker, layout) -> None:
    """A busy worker, high jobs always waiting: a low job that waited two promote_after
    periods is taken as a high one, ahead of the high jobs that came after it."""
    client.ensure_queue("default")
    Limits(client.zk, layout).set_promote_after("default", 0.5)
    client.submit_many(["H"] * 10, priority="high")
    start_worker(EchoRunner(delay=0.3), slots=2)
    low = client.submit("L:0", priority="low", detach=True)
    later = client.submit_many(["H"] * 20, priority="high")
    record = low.result(timeout=20)
    assert record.started_at is not None and record.submitted_at is not None
    assert record.started_at - record.submitted_at < 5.0
    after = [j.result(timeout=30) for j in later]
    assert sum(1 for r in after if (r.started_at or 0) > record.started_at) >= 10


def test_without_aging_a_low_job_waits_for_every_high_one(client: Client, start_worker) -> None:
    low = client.submit("L:0", priority="low", detach=True)
    client.submit_many([f"H:{i}" for i in range(5)], priority="high")
    runner = RecordingRunner()
    start_worker(runner, slots=1)
    low.result(timeout=20)
    assert runner.seen[-1] == "L:0"


def test_a_tenants_cap_refuses_more_waiting_jobs(client: Client, layout) -> None:
    client.ensure_queue("default")
    Limits(client.zk, layout).set_tenant("default", "small", max_pending=3)
    client.submit_many(["s"] * 3, tenant="small")
    with pytest.raises(QueueFull, match="tenant 'small'"):
        client.submit("one more", tenant="small", detach=True)
    client.submit("another tenant is not capped", tenant="big", detach=True)
    client.submit("nor is the default tenant", detach=True)


def test_the_cli_submits_for_a_tenant(zkq, client: Client) -> None:
    out = zkq("submit", "--tenant", "team-a", "--detach", "hello")
    assert out.returncode == 0, out.stderr
    assert client.job(out.stdout.strip()).tenant == "team-a"
    bad = zkq("submit", "--tenant", "no/slash", "--detach", "hello")
    assert bad.returncode == 2 and "bad tenant name" in bad.stderr


def test_a_version_2_root_is_refused_then_migrated(layout: Layout, client: Client) -> None:
    zk = client.zk
    client.submit("before", detach=True)
    zk.set(layout.protocol(), b"2")
    zk.delete(layout.service("default"))
    with pytest.raises(ProtocolMismatch, match="zkq migrate"):
        revision.ensure(zk, layout)
    migrate(zk, layout)
    revision.ensure(zk, layout)
    assert zk.exists(layout.service("default")) is not None
    assert len(client.list("default")) == 1


def test_the_gateway_submits_for_the_keys_tenant(served) -> None:
    fixed = ApiKey(key="sk-team-a-0", name="a", tenant="team-a")
    open_key = ApiKey(key="sk-broker-0", name="broker", tenant="broker", tenant_override=True)
    gw = served(EchoRunner(delay=0.0), GatewayConfig(keys=(fixed, open_key)))
    body = {"model": "default", "prompt": "hi", "max_tokens": 4}

    def tenant_of(secret: str, headers: dict[str, str] | None = None, **extra: str) -> str:
        auth = {"Authorization": f"Bearer {secret}", **(headers or {})}
        answer = httpx.post(f"{gw.url}/v1/completions", json={**body, **extra}, headers=auth)
        assert answer.status_code == 200, answer.text
        return answer.headers["x-zkq-tenant"]

    assert tenant_of("sk-team-a-0") == "team-a"
    assert tenant_of("sk-team-a-0", {"X-Zkq-Tenant": "other"}, user="u1") == "team-a"
    assert tenant_of("sk-broker-0") == "broker"
    assert tenant_of("sk-broker-0", {"X-Zkq-Tenant": "shop-1"}) == "shop-1"
    assert tenant_of("sk-broker-0", user="shop-2") == "shop-2"
    bad = httpx.post(
        f"{gw.url}/v1/completions",
        json=body,
        headers={"Authorization": "Bearer sk-broker-0", "X-Zkq-Tenant": "a/b"},
    )
    assert bad.status_code == 400 and "bad tenant name" in bad.json()["error"]["message"]


def test_stats_ls_and_status_show_tenants(client: Client, layout, zkq) -> None:
    client.ensure_queue("default")
    Limits(client.zk, layout).set_tenant("default", "A", weight=2, max_pending=50)
    client.submit_many(["a"] * 3, tenant="A")
    job = client.submit("b", priority="low", tenant="B", detach=True)
    tenants = client.stats()["queues"]["default"]["tenants"]
    assert tenants["A"]["depth"]["normal"] == 3 and tenants["A"]["weight"] == 2.0
    assert tenants["A"]["max_pending"] == 50
    assert tenants["B"]["depth"]["low"] == 1 and tenants["B"]["weight"] == 1.0
    assert client.job(job.id).info()["tenant"] == "B"
    listed = zkq("ls")
    assert listed.returncode == 0 and "tenant=A" in listed.stdout and "tenant=B" in listed.stdout
    shown = zkq("stats")
    assert "tenant A:" in shown.stdout and "weight=2" in shown.stdout


def test_waiting_by_tenant_in_the_exporter_and_top(client: Client) -> None:
    from zkqueue.operations.exporter import collect_once, read_cluster
    from zkqueue.operations.topview import _tenants_waiting

    client.submit_many(["a"] * 4, tenant="A")
    client.submit_many(["b"] * 2, tenant="B")
    text = collect_once(client)
    assert 'zkq_tenant_waiting{priority="normal",queue="default",tenant="A"} 4.0' in text
    assert 'zkq_tenant_waiting{priority="normal",queue="default",tenant="B"} 2.0' in text
    state = read_cluster(client)
    assert _tenants_waiting(state.queues[0]) == "A 4, B 2"


def test_wait_by_tenant_has_bounded_labels() -> None:
    from prometheus_client import generate_latest

    from workers.metrics import MAX_TENANT_LABELS, WorkerMetrics

    m = WorkerMetrics()
    for i in range(MAX_TENANT_LABELS + 5):
        m.job_finished("q", "normal", "succeeded", 0.1, 0.1, None, tenant=f"t{i:02d}")
    m.job_finished("q", "normal", "succeeded", 0.1, 0.1, None)  # the default tenant: none
    text = generate_latest(m.registry).decode()
    names = {
        line.split('tenant="')[1].split('"')[0]
        for line in text.splitlines()
        if line.startswith("zkq_tenant_wait_seconds_count")
    }
    assert len(names) == MAX_TENANT_LABELS + 1 and "other" in names


def test_a_tenant_whose_lane_ran_dry_is_seen_when_it_sends_more(
    client: Client, start_worker
) -> None:
    """A busy head watches nothing; B's lane empties, then B sends more while A's backlog
    runs: B's new jobs are taken in turn with A's, not after all of them."""
    client.submit_many([f"A:{i}" for i in range(150)], tenant="A")
    first = client.submit_many([f"B:{i}" for i in range(2)], tenant="B")
    runner = SlowRecorder(0.02)
    start_worker(runner, slots=1)
    for job in first:
        job.result(timeout=20)
    more = client.submit_many([f"B:{i}" for i in range(2, 7)], tenant="B")
    for job in more:
        job.result(timeout=20)
    seen = runner.seen
    between = seen[seen.index("B:2") : seen.index("B:6") + 1]
    assert len(between) <= 12, between  # 5 of B's and about as many of A's, in turn
    assert "A:149" not in seen[: seen.index("B:6")]


def test_among_many_dry_lanes_a_tenants_new_job_is_still_seen(client: Client, start_worker) -> None:
    """Forty tenants' lanes ran dry while A's backlog runs; a busy head lists only a few dry
    lanes a turn (the longest unlisted first), and still sees one of them send more long
    before A's backlog ends."""
    dry = [client.submit(f"t{i}:0", tenant=f"t{i}", detach=True) for i in range(40)]
    client.submit_many([f"A:{i}" for i in range(400)], tenant="A")
    runner = SlowRecorder(0.01)
    start_worker(runner, slots=1)
    for job in dry:
        job.result(timeout=30)
    late = client.submit("t17:1", tenant="t17", detach=True)
    late.result(timeout=30)
    seen = runner.seen
    assert "A:399" not in seen[: seen.index("t17:1")], "seen only after A's backlog"


class SlowRecorder(RecordingRunner):
    """Records the order, and takes ``delay`` seconds a job."""

    def __init__(self, delay: float) -> None:
        super().__init__()
        self.delay = delay


def test_queue_tenant_and_promote_after_from_the_cli(zkq, client: Client) -> None:
    made = zkq("queue", "create", "llama", "--promote-after", "120")
    assert made.returncode == 0 and "promote after 120s" in made.stdout, made.stderr
    assert "promote after 120s" in zkq("queues").stdout  # both listings say it too
    assert "promote_after=120s" in zkq("stats").stdout
    weighted = zkq("queue", "tenant", "llama", "team-a", "--weight", "3", "--max-pending", "5")
    assert weighted.returncode == 0 and "tenant team-a: weight 3, max pending 5" in weighted.stdout
    uncapped = zkq("queue", "tenant", "llama", "team-a", "--max-pending", "none")
    assert "tenant team-a: weight 3" in uncapped.stdout and "max pending 5" not in uncapped.stdout
    off = zkq("queue-limit", "llama", "--promote-after", "none")
    assert off.returncode == 0 and "promote after" not in off.stdout
    settings = client.limits.settings("llama")
    assert settings.promote_after is None and settings.tenant("team-a").weight == 3.0
    assert zkq("queue", "tenant", "nosuch", "t", "--weight", "2").returncode == 3
    assert zkq("queue", "tenant", "llama", "t", "--weight", "0").returncode == 2
    assert zkq("queue", "tenant", "llama", "t", "--remove", "--weight", "2").returncode == 2
    assert zkq("queue", "tenant", "llama", "no/slash", "--weight", "2").returncode == 2
    assert zkq("queue-limit", "llama", "--promote-after", "-1").returncode == 2


def test_zkq_migrate_moves_a_version_2_root(zkq, client: Client, layout) -> None:
    client.submit("before", detach=True)
    client.zk.set(layout.protocol(), b"2")
    refused = zkq("stats")
    assert refused.returncode == ExitCode.CONFIG and "zkq migrate" in refused.stderr
    moved = zkq("migrate")
    assert moved.returncode == 0 and "migrated" in moved.stdout, moved.stderr
    assert client.zk.get(layout.protocol())[0] == b"3"
    assert zkq("stats").returncode == 0


def test_bad_lanes_and_bad_counters_stop_nothing(client: Client, start_worker, layout) -> None:
    """An @default lane (no tenant may have it) is ignored, a queue without its counters node
    gets one, and counters holding numbers no float holds are read as zero."""
    zk = client.zk
    client.ensure_queue("default")
    zk.create(f"{layout.pending('default', 'normal')}/@default/0000000000", makepath=True)
    zk.delete(layout.service("default"))
    zk.create(
        f"{layout.service('default')}/corrections", b'{"A": 1' + b"0" * 400 + b"}", makepath=True
    )
    jobs = client.submit_many(["a"] * 4, tenant="A") + client.submit_many(["b"] * 4, tenant="B")
    jobs += client.submit_many(["d"] * 2)
    start_worker(slots=2)
    assert all(j.result(timeout=20).status == "succeeded" for j in jobs)
    assert zk.exists(layout.service("default")) is not None


def test_a_dead_letter_of_a_tenant_goes_back_to_its_lane(client: Client, layout) -> None:
    client.ensure_queue("default")
    bucket = f"{layout.pending('default', 'normal')}/@acme/0000000000"
    client.submit("seed", tenant="acme", detach=True)  # makes acme's lane
    zk = client.zk
    zk.create(f"{bucket}/bad name-", b'{"prompt": "x"}', sequence=True)
    letter = {
        "queue": "default",
        "priority": "normal",
        "entry": "@acme/0000000000/bad name-0000000001",
        "id": "rescued",
        "raw": '{"prompt": "x"}',
        "name": "normal.@acme.0000000000.x",
    }
    zk.create(layout.dead_node("default", letter["name"]), json.dumps(letter).encode())
    from zkqueue.producer.deadletters import requeue

    name = requeue(zk, layout, letter)
    assert name.startswith("@acme/"), name


def test_a_job_given_back_behind_its_lanes_frontier_runs_before_the_lanes_later_ones(
    client: Client, start_worker, layout
) -> None:
    """Claims that choose between tenants write each lane's claim frontier (the counters'
    ``next``), and heads hide the entries at or before it in buckets they did not list this
    turn. A low job preempted for a high one is pending again behind its lane's frontier: it
    still runs before the later jobs of its lane."""
    client.submit_many([f"A:{i}" for i in range(4)], tenant="A", priority="low")
    client.submit_many([f"B:{i}" for i in range(4)], tenant="B", priority="low")
    runner = HoldRunner()
    start_worker(runner, slots=2)
    wait_for(lambda: len(runner.running()) == 2, message="both slots busy")
    first = runner.running()
    counters = json.loads(client.zk.get(layout.service("default"))[0])
    fronts = {t: counters[t]["next"]["low"] for t in ("A", "B")}
    assert all(bucket == 0 and seq >= 0 for bucket, seq in fronts.values()), counters
    urgent = client.submit("urgent", priority="high", detach=True)
    wait_for(lambda: "urgent" in runner.running(), message="the high job running")
    (victim,) = set(first) - set(runner.running())
    runner.release_all()
    assert urgent.result(timeout=10).ok
    tenant = victim.split(":")[0]
    wait_for(lambda: len(runner.jobs) == 10, message="every job handed in (one twice)")
    handed = [j.spec.prompt for j in runner.jobs if j.spec.prompt.startswith(f"{tenant}:")]
    assert handed == [victim, *(f"{tenant}:{i}" for i in range(4))], handed


def test_a_job_left_for_a_bigger_worker_moves_the_give_back_signal_and_runs_there(
    client: Client, start_worker, layout
) -> None:
    """A head that leaves a tenant's entry for a bigger worker and claims a later one of the
    same lane moves the lane's frontier past an entry still pending: its claim sets the
    give-back signal, so heads that reuse their listings list the lane again. Once the bigger
    worker stands in the line behind it, the smaller head (a slot still free) steps to the
    back of the line, and the bigger one runs the entry."""
    from workers.admission import Admission

    def cache(pages: int) -> Admission:
        return Admission(pages, 16, count_tokens=lambda spec: len(spec.prompt or ""))

    holder = HoldRunner()
    start_worker(holder, slots=1, admission=cache(64), name="big")
    client.submit("hold", detach=True)
    wait_for(lambda: holder.running() == ["hold"], message="the big worker full")
    big = client.submit("A:big", tenant="A", max_new_tokens=200, detach=True)
    small = client.submit_many([f"A:{i}" for i in range(3)], tenant="A", max_new_tokens=16)
    small += client.submit_many([f"B:{i}" for i in range(3)], tenant="B", max_new_tokens=16)
    before = client.zk.exists(layout.claims("default")).version
    runner = RecordingRunner()
    start_worker(runner, slots=1, admission=cache(8), name="small")  # 128 tokens: not A:big
    assert all(j.result(timeout=20).ok for j in small)
    assert "A:big" not in runner.seen
    assert client.zk.exists(layout.claims("default")).version > before
    holder.release_all()
    assert big.result(timeout=20).worker == "big"


def test_a_reused_listing_never_hides_a_job_given_back_before_it(
    client: Client, new_zk, layout
) -> None:
    """A head reuses a bucket's listing while no job was given back since (the give-back
    signal), and hides there the entries at or before its lane's claim frontier. A listing that
    shows a job given back before it (pending at or before the frontier) is not reused: the
    frontier would hide that job again, and later jobs of its lane would pass it."""
    from zkqueue.dispatch.share import FairShare
    from zkqueue.dispatch.view import PendingView
    from zkqueue.protocol.layout import EntryName

    a = client.submit_many([f"A:{i}" for i in range(4)], tenant="A")
    b = client.submit_many([f"B:{i}" for i in range(4)], tenant="B")
    order = {j.id: EntryName.parse(j.entry or "").order for j in a + b}
    # Another head claimed A:0-A:2 and B:0-B:1, then gave A:0 back (A:1, A:2, B:0 and B:1 run).
    fronts = {"A": order[a[2].id], "B": order[b[1].id]}
    counters = {t: Counter(10.0, 5.0, {"normal": f}) for t, f in fronts.items()}
    client.zk.set(layout.service("default"), encode_counters(counters))
    for job in (a[1], a[2], b[0], b[1]):
        client.zk.create(layout.claim("default", job.id), b"{}", ephemeral=True)
    zk = new_zk()
    view = PendingView(zk, layout, "default", lambda part: None)
    share = view.share = FairShare(zk, layout, "default")

    def turn() -> list[str]:
        """A head's turn, as HeadTurn makes it: the counters read ahead (the last look chose
        between tenants), the refresh, the frontiers, the choice; the first two candidates."""
        share.backlogged = {"normal": frozenset({"A", "B"})}
        share.refetch()
        view.refresh(2)
        share.load()
        view.drop_behind_fronts()
        share.observe("normal", view.backlogged("normal", set()))
        return [e.job_id for _, e in list(view.candidates(set()))[:8]]

    first = turn()
    assert a[0].id in first and a[1].id not in first, first  # A:0 given back, A:1 running
    lane_a, lane_b = ("normal/@A", 0), ("normal/@B", 0)
    assert lane_a in view.listed and lane_b in view.listed
    assert not view._reusable(lane_a)  # its listing shows A:0 behind A's frontier
    assert view._reusable(lane_b)
    again = turn()  # B's bucket reused; A's listed again, A:0 still there
    assert a[0].id in again and again.index(a[0].id) < again.index(a[3].id), again


def test_the_counters_format_reads_what_it_writes_and_ignores_the_rest() -> None:
    written = {"A": Counter(12.5, 3.0, {"normal": (0, 7)}), "default": Counter(4.0, None, {})}
    back = parse_counters(encode_counters(written))
    assert back["A"] == Counter(12.5, 3.0, {"normal": (0, 7)})
    assert back["A"].lanes("A") == {"normal/@A": (0, 7)}
    assert back["default"].lanes("default") == {} and back["default"].service == 4.0
    bad = b'{"A": {"service": "x", "cost": -1, "next": {"normal": [1, -2], "low": "z"}}, "B": 7}'
    assert parse_counters(bad) == {"A": Counter(), "B": Counter()}
    assert parse_counters(b"[1]") == {} and parse_counters(b"\xff") == {}
    merged = add_corrections(b'{"A": 1.5, "B": "x"}', {"A": -0.5, "C": 2})
    assert parse_corrections(merged) == {"A": 1.0, "C": 2.0}
    assert level(Counter(1.0), -3.0) == 0.0 and level(None, None) == 0.0


def test_the_janitor_removes_a_tenants_lane_that_stayed_empty(
    client: Client, start_worker, layout
) -> None:
    """A lane per tenant name must not pile up (a gateway may take names from its callers):
    one left empty and unchanged for ``lane_idle`` goes, with the tenant's counters once it has
    no lane left (else with the lane's claim frontier); a lane with a waiting job stays; the
    tenant's next job makes its lane again."""
    client.submit_many([f"A:{i}" for i in range(3)], tenant="A")
    client.submit_many([f"B:{i}" for i in range(3)], tenant="B")
    runner = RecordingRunner()
    worker = start_worker(runner, slots=1)
    wait_for(lambda: len(runner.seen) == 6, message="every job run")
    worker.stop()
    client.submit("C:0", tenant="C", priority="low", detach=True)  # waits: no worker
    client.submit("A:low", tenant="A", priority="low", detach=True)  # A keeps a lane
    counters = json.loads(client.zk.get(layout.service("default"))[0])
    assert {"A", "B"} <= set(counters) and "normal" in counters["A"]["next"]
    quick = Janitor(client.zk, layout, lane_idle=1.0)
    assert quick.run_pass().lanes_removed == []  # empty since now: not yet
    removed = wait_for(lambda: quick.run_pass().lanes_removed, message="the empty lanes removed")
    assert sorted(removed) == ["default/normal/@A", "default/normal/@B"]
    assert client.zk.exists(layout.pending("default", "normal/@A")) is None
    assert client.zk.exists(layout.pending("default", "low/@C")) is not None  # a job waits
    counters = json.loads(client.zk.get(layout.service("default"))[0])
    # B has no lane left: its counters go; A keeps its counter, less its normal lane's frontier
    # (a lane made again starts its sequence over).
    assert "B" not in counters and "A" in counters, counters
    assert "normal" not in counters["A"].get("next", {}), counters
    again = client.submit("A:again", tenant="A", detach=True)
    start_worker(runner, slots=1)
    assert again.result(timeout=10).ok


def test_a_new_tenants_lane_is_refused_beyond_the_priority_s_most(client: Client) -> None:
    """Each lane costs every head turn a little: a producer refuses a new tenant's first job
    where the priority holds its most lanes (queue full, exit 5); known tenants still submit."""
    client._enqueue.max_lanes = 2
    client.submit("A:0", tenant="A", detach=True)
    client.submit("B:0", tenant="B", detach=True)
    with pytest.raises(QueueFull, match="holds 2 tenants' lanes in priority 'normal'") as raised:
        client.submit("C:0", tenant="C", detach=True)
    assert raised.value.exit_code == ExitCode.QUEUE_FULL
    assert client.submit("A:1", tenant="A", detach=True).status() == "pending"
    assert client.submit("C:0", tenant="C", priority="low", detach=True).status() == "pending"
