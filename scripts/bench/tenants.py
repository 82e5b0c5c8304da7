"""Tenants: fair share inside a priority, weights, tokens, no banked credit, durability across a
SIGKILL of the head, strict priority between bands, and aging.

    .venv/bin/python -m scripts.bench.tenants [SCENARIO ...] [--idle 60] [--json FILE]

Scenarios (all by default): ``fairness``, ``weights``, ``durable``, ``tokens``, ``credit``,
``aging``. Each starts its own ZooKeeper root and ``zkq worker`` processes (echo runner, or the
tiny model for ``tokens``), submits detached jobs with ``zkq``'s Python client, and measures from
the result records (``started_at``, ``finished_at``, ``tenant``, ``output_tokens``), which
workers write as each job ends.

- fairness: 4 workers x 4 slots (echo, 50 ms a job). Tenant A queues 2,000 normal jobs; tenant B
  40, a second later. Reported: how many of A's jobs finished between B's submission and B's last
  finish (target: at most 60).
- weights: tenants gold (weight 3) and tin (1) queue 800 jobs each (4 x 4, echo 50 ms); the
  first 800 jobs claimed are counted per tenant (target: gold/tin between 2.7 and 3.3). A high
  job of a third tenant is submitted mid-run: no normal job not yet started when it was submitted
  may start before it.
- durable: weights again, and once a third of the jobs ended the worker whose line node is
  first (the head) is killed with SIGKILL; the ratio over the whole run (target as above).
- tokens: the tiny model (one worker, 8 slots). Tenant A's jobs ask for 64 tokens, B's for 8
  (``ignore_eos``: exactly that many); both queued deep. Tokens of the jobs started while both
  still waited, A:B (target: 0.8 to 1.25).
- credit: 4 x 4 (echo 500 ms a job). A and B both queue; B's run out; A is served alone for
  ``--idle`` seconds (60); then B queues 200 jobs. A's share of the jobs started from then until
  B's last start (target: at least 40%).
- aging: one worker x 4 slots (echo 500 ms), ``promote_after`` 5 s, a producer keeping 20 high
  jobs waiting; a low job is submitted into that: seconds from its submission to its start
  (target: at most 15).
- cost (``--old DIR``: a checkout of the tree before tenants, e.g. ``git worktree add DIR
  4425c19``): dispatch throughput of 2,000 pre-filled echo jobs (no work) on 4 x 4 and 16 x 4
  worker processes: the old tree, this one, and this one with the jobs spread over 16 tenants,
  in rounds (``--pairs``, 3), each of the three first in turn. The workers start behind a line
  member the bench holds and dispatch together once it leaves; the run's root is deleted after
  it; one unkept run warms ZooKeeper up first. Jobs a second from the first claim to the last
  finish, from the result records, and the CPU a job cost the workers and ZooKeeper from the
  line's opening to the last result; medians, and new / old (targets: one tenant at least
  0.95x, 16 tenants at least 0.8x).
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import signal
import statistics
import subprocess
import sys
import tempfile
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

from kazoo.exceptions import KazooException, NoNodeError

from scripts.bench.core import (
    ZKQ_CLI,
    child_env,
    pid_cpu,
    report,
    stop_processes,
    wait_until,
)
from zkqueue import Client
from zkqueue.protocol.layout import member_prefix
from zkqueue.protocol.limits import Limits
from zkqueue.testing import ZkCluster

QUEUE = "bench"
SCENARIOS = ("fairness", "weights", "durable", "tokens", "credit", "aging", "cost")


class Stage:
    """One scenario's root, client and worker processes."""

    def __init__(self, cluster: ZkCluster, name: str, folder: Path) -> None:
        self.hosts = cluster.hosts
        self.root = f"/bench-tenants-{name}-{int(time.time() * 1000)}"
        self.client = Client(self.hosts, self.root).start()
        self.client.ensure_queue(QUEUE)
        self.folder = folder
        self.workers: list[subprocess.Popen[bytes]] = []

    def spawn(self, count: int, *args: str) -> None:
        for _ in range(count):
            log = open(self.folder / f"worker-{len(self.workers)}.log", "wb")  # noqa: SIM115
            cmd = [*ZKQ_CLI, "--zk", self.hosts, "--root", self.root, "--session-timeout", "3"]
            cmd += ["--log-level", os.environ.get("ZKQ_BENCH_LOG", "WARNING")]
            cmd += ["worker", "--queue", QUEUE, *args]
            self.workers.append(
                subprocess.Popen(cmd, stdout=log, stderr=subprocess.STDOUT, env=child_env())
            )
        if not wait_until(lambda: len(self.client.workers()) >= len(self.workers), 120, 0.2):
            raise SystemExit("the workers did not register")

    def records(self, ids: list[str]) -> dict[str, dict[str, Any]]:
        """The result records there are of ``ids`` (pipelined reads)."""
        zk, layout = self.client.zk, self.client.layout
        found = {}
        for start in range(0, len(ids), 1000):
            calls = [(i, zk.get_async(layout.result(QUEUE, i))) for i in ids[start : start + 1000]]
            for job_id, call in calls:
                try:
                    found[job_id] = json.loads(call.get()[0])
                except Exception:  # no result yet
                    continue
        return found

    def finished(self, ids: list[str]) -> int:
        return len(self.records(ids))

    def close(self) -> None:
        stop_processes(self.workers, 15)
        self.client.close()


@contextmanager
def staged(cluster: ZkCluster, name: str) -> Iterator[Stage]:
    with tempfile.TemporaryDirectory(prefix=f"zkq-tenants-{name}-") as tmp:
        stage = Stage(cluster, name, Path(tmp))
        try:
            yield stage
        finally:
            stage.close()


def _echo(slots: int, delay: float) -> tuple[str, ...]:
    return ("--runner", "echo", "--echo-delay", str(delay), "--max-concurrency", str(slots))


def _submit(stage: Stage, tenant: str, n: int, **params: Any) -> list[str]:
    """``n`` detached jobs of ``tenant``; ``params``: job parameters (max_new_tokens...)."""
    specs = [{"prompt": f"{tenant}:{i}", **params} for i in range(n)]
    jobs = stage.client.submit_many(specs, queue=QUEUE, tenant=tenant)
    return [j.id for j in jobs]


def fairness(cluster: ZkCluster) -> dict[str, Any]:
    with staged(cluster, "fair") as stage:
        stage.spawn(4, *_echo(4, 0.05))
        a = _submit(stage, "A", 2000)
        time.sleep(1.0)
        b_at = time.time()
        b = _submit(stage, "B", 40)
        if not wait_until(lambda: stage.finished(b) >= 40, 300, 0.2):
            raise SystemExit("B's jobs did not finish")
        b_records = stage.records(b)
        b_last = max(r["finished_at"] for r in b_records.values())
        a_records = stage.records(a)
        between = sum(1 for r in a_records.values() if b_at < r["finished_at"] <= b_last)
        return {
            "a_jobs_finished_while_b_ran": between,
            "b_seconds": round(b_last - b_at, 2),
            "a_finished_before_b": sum(1 for r in a_records.values() if r["finished_at"] <= b_at),
            "target": "<= 60",
            "met": between <= 60,
        }


def _weighted(cluster: ZkCluster, kill_head: bool) -> dict[str, Any]:
    with staged(cluster, "durable" if kill_head else "weights") as stage:
        Limits(stage.client.zk, stage.client.layout).set_tenant(QUEUE, "gold", weight=3)
        gold = _submit(stage, "gold", 800)
        tin = _submit(stage, "tin", 800)
        stage.spawn(4, *_echo(4, 0.05))
        everyone = gold + tin
        highs: dict[str, tuple[str, float]] = {}
        killed = None
        deadline = time.monotonic() + 600
        while time.monotonic() < deadline:
            done = stage.finished(everyone)
            for label, at, tenant in (("new_tenant", 300, "ops"), ("default_tenant", 600, None)):
                if label not in highs and done >= at:
                    sent = time.time()
                    job = stage.client.submit(
                        "urgent", priority="high", queue=QUEUE, tenant=tenant, detach=True
                    )
                    highs[label] = (job.id, sent)
            if kill_head and killed is None and done >= 1600 // 3:
                killed = _kill_head(stage)
            if done >= 1000:
                break
            time.sleep(0.2)
        records = stage.records(everyone)
        claimed = sorted(records.values(), key=lambda r: r["started_at"])[:800]
        g = sum(1 for r in claimed if r.get("tenant") == "gold")
        t = sum(1 for r in claimed if r.get("tenant") == "tin")
        ratio = g / t if t else float("inf")
        out: dict[str, Any] = {
            "first_800_claimed": {"gold": g, "tin": t},
            "ratio": round(ratio, 3),
            "target": "2.7 to 3.3",
            "met": 2.7 <= ratio <= 3.3,
        }
        if kill_head:
            _drain(stage, everyone)
            out["killed"] = killed
            out["not_finished"] = len(everyone) - stage.finished(everyone)
        for label, (high_id, _) in highs.items():
            wait_until(lambda i=high_id: stage.finished([i]), 60, 0.1)
            high = stage.records([high_id]).get(high_id)
            if high is None:
                continue
            submitted = high["submitted_at"]  # the entry's ctime: when a head could see it
            overtaken = [
                r
                for r in stage.records(everyone).values()
                if submitted < r["started_at"] < high["started_at"]
                and r["submitted_at"] < submitted
            ]
            out[f"high_job_{label}"] = {
                "start_after_submit_s": round(high["started_at"] - submitted, 3),
                "normal_jobs_started_before_it": len(overtaken),
                "met": not overtaken,
            }
        return out


def _drain(stage: Stage, ids: list[str]) -> bool:
    """Every job of ``ids`` ended (the killed worker's jobs run again elsewhere)."""
    return wait_until(lambda: stage.finished(ids) >= len(ids), 180, 0.5)


def _kill_head(stage: Stage) -> dict[str, Any] | None:
    """SIGKILL the worker whose node is first in the queue's line (the head)."""
    zk, layout = stage.client.zk, stage.client.layout
    names = sorted(zk.get_children(layout.line(QUEUE)), key=lambda n: int(n.rsplit("-", 1)[1]))
    if not names:
        return None
    worker = zk.get(f"{layout.line(QUEUE)}/{names[0]}")[0].decode()
    record = json.loads(zk.get(layout.worker(worker))[0])
    os.kill(int(record["pid"]), signal.SIGKILL)
    return {"worker": worker, "pid": record["pid"], "at": time.time()}


def tokens(cluster: ZkCluster) -> dict[str, Any]:
    with tempfile.TemporaryDirectory(prefix="zkq-tiny-") as tmp:
        model = str(Path(tmp) / "tiny")
        subprocess.run(
            [*ZKQ_CLI, "tiny-model", model], env=child_env(), capture_output=True, check=True
        )
        with staged(cluster, "tokens") as stage:
            a = _submit(stage, "A", 60, max_new_tokens=64, ignore_eos=True)
            b = _submit(stage, "B", 480, max_new_tokens=8, ignore_eos=True)
            stage.spawn(1, "--model", model, "--max-concurrency", "8")
            if not wait_until(lambda: stage.finished(a + b) >= len(a + b), 900, 0.5):
                raise SystemExit("the model jobs did not finish")
            records = stage.records(a + b)
            last = {
                t: max(r["started_at"] for r in records.values() if r.get("tenant") == t)
                for t in ("A", "B")
            }
            until = min(last.values())  # from then on only one tenant waited
            served = {"A": 0, "B": 0}
            for r in records.values():
                if r["started_at"] < until:
                    served[r["tenant"]] += int(r.get("output_tokens") or 0) + int(
                        r.get("prompt_tokens") or 0
                    )
            ratio = served["A"] / served["B"] if served["B"] else float("inf")
            return {
                "tokens_while_both_waited": served,
                "ratio": round(ratio, 3),
                "target": "0.8 to 1.25",
                "met": 0.8 <= ratio <= 1.25,
            }


def credit(cluster: ZkCluster, idle: float) -> dict[str, Any]:
    with staged(cluster, "credit") as stage:
        rate = 16 / 0.5  # jobs a second the fleet below finishes
        a = _submit(stage, "A", int(rate * (idle + 60)))
        b0 = _submit(stage, "B", 100)
        stage.spawn(4, *_echo(4, 0.5))
        wait_until(lambda: stage.finished(b0) >= len(b0), 300, 0.5)
        time.sleep(idle)  # A alone
        b_at = time.time()
        b = _submit(stage, "B", 200)
        wait_until(lambda: stage.finished(b) >= len(b), 300, 0.5)
        records = stage.records(a + b)
        b_last = max(r["started_at"] for i, r in records.items() if i in set(b))
        window = [r for r in records.values() if b_at <= r["started_at"] <= b_last]
        share = sum(1 for r in window if r.get("tenant") == "A") / max(1, len(window))
        return {
            "idle_s": idle,
            "claims_while_both_waited": len(window),
            "a_share": round(share, 3),
            "target": ">= 0.40",
            "met": share >= 0.40,
        }


def aging(cluster: ZkCluster) -> dict[str, Any]:
    with staged(cluster, "aging") as stage:
        Limits(stage.client.zk, stage.client.layout).set_promote_after(QUEUE, 5.0)
        stage.spawn(1, *_echo(4, 0.5))
        stop = threading.Event()

        def keep_high() -> None:
            while not stop.is_set():
                waiting = stage.client.stats()["queues"][QUEUE]["waiting"]
                if waiting < 20:
                    stage.client.submit_many(["h"] * (20 - waiting), queue=QUEUE, priority="high")
                time.sleep(0.1)

        feeder = threading.Thread(target=keep_high, daemon=True)
        feeder.start()
        time.sleep(3)
        low = stage.client.submit("low", priority="low", queue=QUEUE, detach=True)
        try:
            wait_until(lambda: stage.finished([low.id]), 60, 0.1)
        finally:
            stop.set()
            feeder.join(5)
        record = stage.records([low.id]).get(low.id)
        wait = None if record is None else record["started_at"] - record["submitted_at"]
        return {
            "low_start_after_submit_s": None if wait is None else round(wait, 2),
            "target": "<= 15",
            "met": wait is not None and wait <= 15,
        }


def dispatch_run(
    hosts: str, procs: int, slots: int, jobs: int, tenants: int, server: int
) -> tuple[float, float, float]:
    """One dispatch run of whichever tree is on PYTHONPATH (run as a subprocess: ``--run``):
    jobs a second from the first claim to the last finish, and the CPU milliseconds a job
    cost the workers and ZooKeeper (process ``server``) from the line's opening to the end."""
    root = f"/bench-cost-{procs}x{slots}-{tenants}-{int(time.time() * 1000)}"
    client = Client(hosts, root).start()
    client.ensure_queue(QUEUE)
    for t in range(tenants):
        share = [f"job {i}" for i in range(t, jobs, tenants)]
        extra = {"tenant": f"t{t}"} if tenants > 1 else {}
        client.submit_many(share, queue=QUEUE, **extra)
    ids = [name for name in _entry_ids(client)]
    # The workers start behind a member of the line that the bench holds (the line's protocol:
    # each member waits for its predecessor), so none claims while the others still start (a
    # process's start costs more CPU than hundreds of these jobs): all dispatch together once
    # it leaves.
    line = client.layout.line(QUEUE)
    client.zk.ensure_path(line)
    gate = client.zk.create(member_prefix(line), b"bench", ephemeral=True, sequence=True)
    with tempfile.TemporaryDirectory(prefix="zkq-cost-") as tmp:
        stage = Stage.__new__(Stage)
        stage.hosts, stage.root, stage.client = hosts, root, client
        stage.folder, stage.workers = Path(tmp), []
        stage.spawn(procs, *_echo(slots, 0.0))
        if not wait_until(lambda: len(client.zk.get_children(line)) > procs, 60, 0.1):
            raise SystemExit("the workers did not join the line")
        cpu = [pid_cpu(w.pid) for w in stage.workers] + [pid_cpu(server)]
        client.zk.delete(gate)
        # Counted from the expiry index (a few reads): reading every record each poll would
        # load ZooKeeper as much as the dispatch itself.
        if not wait_until(lambda: _indexed(client) >= len(ids), 600, 0.05):
            raise SystemExit("the dispatch run did not finish")
        used = [pid_cpu(w.pid) for w in stage.workers] + [pid_cpu(server)]
        spent = [b - a for a, b in zip(cpu, used, strict=True)]
        records = stage.records(ids).values()
        stop_processes(stage.workers, 15)
        stage.workers = []
        # The next run starts on a ZooKeeper as empty as this one did: the runs' results would
        # otherwise pile up in its heap and slow each run more than the one before.
        with contextlib.suppress(KazooException):
            client.zk.delete(root, recursive=True)
        stage.close()
    first = min(r["started_at"] for r in records)
    last = max(r["finished_at"] for r in records)
    per_job = 1000 / len(ids)
    return len(ids) / (last - first), sum(spent[:-1]) * per_job, spent[-1] * per_job


def _indexed(client: Client) -> int:
    """Results written under the bench queue's expiry index (its tick buckets' child counts: a
    few reads). ``scripts.bench.core`` has the same count, but ``--run`` imports the tree under
    test, whose ``core`` may predate it."""
    expiry = client.layout.expiry(QUEUE)
    try:
        ticks = client.zk.get_children(expiry)
    except NoNodeError:
        return 0
    calls = [client.zk.exists_async(f"{expiry}/{t}") for t in ticks]
    return sum(s.numChildren for c in calls if (s := c.get()) is not None)


def _entry_ids(client: Client) -> list[str]:
    """The ids of every pending job of the bench queue (listed once, before any worker)."""
    return [row["id"] for row in client.list(QUEUE)]


def cost(cluster: ZkCluster, old: str, pairs: int, jobs: int) -> dict[str, Any]:
    here = str(Path(__file__).resolve().parents[2])
    rows: dict[str, list[float]] = {}
    cpu: dict[str, list[tuple[float, float]]] = {}
    process = cluster.servers[0].process
    server = process.pid if process is not None else 0

    def run(tree: str, procs: int, slots: int, tenants: int) -> subprocess.CompletedProcess[str]:
        """``dispatch_run`` of ``tree``, as a subprocess with it on PYTHONPATH."""
        cmd = [sys.executable, str(Path(here) / "scripts/bench/tenants.py"), "--run"]
        cmd += [cluster.hosts, str(procs), str(slots), str(jobs), str(tenants), str(server)]
        env = {**os.environ, "PYTHONPATH": tree}
        return subprocess.run(cmd, env=env, cwd=tree, capture_output=True, text=True)

    # A run first whose figures are not kept: ZooKeeper's JVM compiles its hot paths in the
    # first thousands of requests, which would slow whichever tree runs first.
    run(here, 4, 4, 1)
    trees = [("old", old, 1), ("new", here, 1), ("new-16-tenants", here, 16)]
    for pair in range(pairs):
        for procs, slots in ((4, 4), (16, 4)):
            # Each goes first, second and third in turn: no tree always runs after the others.
            for label, tree, tenants in trees[pair % 3 :] + trees[: pair % 3]:
                done = run(tree, procs, slots, tenants)
                if done.returncode != 0:
                    raise SystemExit(f"{procs}x{slots} {label} failed:\n{done.stderr[-3000:]}")
                rate, workers, zk = map(float, done.stdout.strip().splitlines()[-1].split())
                key = f"{procs}x{slots} {label}"
                rows.setdefault(key, []).append(rate)
                cpu.setdefault(key, []).append((workers, zk))
                print(
                    f"  {key}: {rate:.0f} jobs/s; CPU a job: workers {workers:.2f} ms, "
                    f"ZooKeeper {zk:.2f} ms",
                    flush=True,
                )
    medians = {k: statistics.median(v) for k, v in rows.items()}
    out: dict[str, Any] = {"rates": rows, "medians": {k: round(v, 1) for k, v in medians.items()}}
    out["cpu_ms_per_job"] = {
        k: {
            "workers": round(statistics.median(w for w, _ in v), 2),
            "zookeeper": round(statistics.median(z for _, z in v), 2),
        }
        for k, v in cpu.items()
    }
    for shape in ("4x4", "16x4"):
        old_rate = medians[f"{shape} old"]
        out[f"{shape} new/old"] = round(medians[f"{shape} new"] / old_rate, 3)
        out[f"{shape} 16 tenants/old"] = round(medians[f"{shape} new-16-tenants"] / old_rate, 3)
    out["met"] = all(out[f"{s} new/old"] >= 0.95 for s in ("4x4", "16x4")) and all(
        out[f"{s} 16 tenants/old"] >= 0.8 for s in ("4x4", "16x4")
    )
    return out


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--run":
        hosts, procs, slots, jobs, tenants, server = sys.argv[2:8]
        run = dispatch_run(hosts, int(procs), int(slots), int(jobs), int(tenants), int(server))
        print(*run)
        return
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("scenarios", nargs="*", help=f"any of {', '.join(SCENARIOS)} (all)")
    parser.add_argument("--idle", type=float, default=60.0, help="credit: seconds B is idle")
    parser.add_argument("--json", default=None, help="write the run here")
    parser.add_argument("--old", default=None, help="cost: a checkout of the tree before tenants")
    parser.add_argument("--pairs", type=int, default=3, help="cost: old/new pairs")
    parser.add_argument("--jobs", type=int, default=2000, help="cost: jobs per run")
    args = parser.parse_args()
    chosen = args.scenarios or [s for s in SCENARIOS if s != "cost" or args.old]
    unknown = set(chosen) - set(SCENARIOS)
    if unknown:
        parser.error(f"unknown scenario(s): {', '.join(sorted(unknown))}")
    out: dict[str, Any] = {"started": time.strftime("%Y-%m-%d %H:%M:%S")}
    with ZkCluster(1) as cluster:
        for name in chosen:
            started = time.monotonic()
            if name == "fairness":
                out[name] = fairness(cluster)
            elif name == "weights":
                out[name] = _weighted(cluster, kill_head=False)
            elif name == "durable":
                out[name] = _weighted(cluster, kill_head=True)
            elif name == "tokens":
                out[name] = tokens(cluster)
            elif name == "credit":
                out[name] = credit(cluster, args.idle)
            elif name == "aging":
                out[name] = aging(cluster)
            elif name == "cost":
                if not args.old:
                    parser.error("cost needs --old DIR (a checkout of the tree before tenants)")
                out[name] = cost(cluster, args.old, args.pairs, args.jobs)
            out[name]["seconds"] = round(time.monotonic() - started, 1)
            print(f"{name}: {json.dumps(out[name])}", flush=True)
    summary = [f"{n}: {'met' if out[n].get('met') else 'NOT met'}" for n in chosen]
    report(out, summary, args.json)


if __name__ == "__main__":
    main()
