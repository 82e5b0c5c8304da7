"""zkq demo: a local ZooKeeper, a model worker, jobs at three priorities, results and timings.

The worker runs a small random-weight transformers model that the demo writes first (`zkq
tiny-model`), so its outputs are gibberish; point `--model` at any local model directory for real
text. `--echo` uses the echo runner instead.

Everything runs on this machine and is cleaned up at the end. Run it with scripts/demo.sh.
"""

from __future__ import annotations

import argparse
import os
import shutil
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from zkqueue import Client, Result
from zkqueue.testing import ZkCluster

ROOT = "/zkq-demo"
os.environ.setdefault("HF_HUB_DISABLE_PROGRESS_BARS", "1")


def start_worker(hosts: str, args: list[str], log: Path) -> subprocess.Popen[bytes]:
    cmd = [
        sys.executable,
        "-m",
        "zkqueue.cli",
        "--zk",
        hosts,
        "--root",
        ROOT,
        "--log-level",
        "INFO",
        "worker",
        *args,
    ]
    return subprocess.Popen(cmd, stdout=log.open("wb"), stderr=subprocess.STDOUT)


def wait_registered(client: Client, timeout: float = 120.0) -> None:
    deadline = time.monotonic() + timeout
    while not client.workers():
        if time.monotonic() > deadline:
            raise SystemExit("demo: the worker did not register in time")
        time.sleep(0.2)


def print_table(records: list[Result], random_model: bool) -> None:
    """One line per job in the order the worker started them."""
    print("\n(wait counts from submission, before the worker had loaded its model)")
    if random_model:
        print(
            "(the tiny model has random weights, so its words are noise: what to read here is\n"
            " the order - high before normal before low, first come first served inside each -\n"
            " the waits and run times, and that every job ended with a result)"
        )
    print(
        f"{'order':>5}  {'priority':<8} {'status':<10} {'wait s':>7} {'run s':>6} "
        f"{'tokens':>6}  output"
    )
    for n, r in enumerate(records, 1):
        wait = (r.started_at or 0) - (r.submitted_at or 0)
        run = (r.finished_at or 0) - (r.started_at or 0)
        tokens = r.get("output_tokens", "-")
        print(
            f"{n:>5}  {r.priority:<8} {r.status:<10} {wait:7.2f} {run:6.2f} {tokens:>6}  "
            f"{printable(r.output)[:40]}"
        )


def printable(text: str) -> str:
    """The output as one readable line: control and unprintable characters shown as dots."""
    return "".join(c if c.isprintable() else "·" for c in text)


def worker_command(opts: argparse.Namespace, work: Path) -> list[str]:
    if opts.echo:
        return ["--runner", "echo", "--echo-delay", "0.2", "--max-concurrency", "1"]
    model = opts.model
    if model is None:
        from workers.tinymodel import write_tiny_model

        model = str(write_tiny_model(work / "tiny-model"))
        print(f"demo: wrote a tiny random-weight model to {model}")
    # One slot, so the dispatch order is plain to see; production workers batch (--max-concurrency).
    return ["--model", model, "--max-concurrency", "1"]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--jobs-per-priority", type=int, default=3)
    parser.add_argument("--model", default=None, help="local model directory (default: tiny)")
    parser.add_argument("--echo", action="store_true", help="use the echo runner")
    parser.add_argument("--max-new-tokens", type=int, default=24)
    opts = parser.parse_args()
    work = Path(tempfile.mkdtemp(prefix="zkq-demo-"))
    print(f"demo: starting a local ZooKeeper (data in {work})")
    with ZkCluster(1, base=work) as cluster, Client(cluster.hosts, ROOT) as client:
        print(f"demo: ZooKeeper serving at {cluster.hosts}")
        # Submit before the worker starts, so the dispatch order is visible.
        plan = [
            (prio, f"{prio} request #{i}")
            for i in range(opts.jobs_per_priority)
            for prio in ("low", "normal", "high")
        ]
        jobs = [
            client.submit(prompt, priority=prio, detach=True, max_new_tokens=opts.max_new_tokens)
            for prio, prompt in plan
        ]
        print(f"demo: submitted {len(jobs)} jobs (low, normal, high interleaved)")
        worker_args = worker_command(opts, work)
        worker = start_worker(cluster.hosts, worker_args, work / "worker.log")
        try:
            wait_registered(client)
            info = client.workers()[0]
            print(f"demo: worker {info['id']} registered: {info['runner_info']}")
            records = sorted((j.result(timeout=300) for j in jobs), key=lambda r: r.started_at)
            print_table(records, random_model=not opts.echo and opts.model is None)
            cli = subprocess.run(
                [
                    sys.executable,
                    "-m",
                    "zkqueue.cli",
                    "--zk",
                    cluster.hosts,
                    "--root",
                    ROOT,
                    "submit",
                    "--priority",
                    "high",
                    "--max-new-tokens",
                    "12",
                    "an attached request from the CLI",
                ],
                capture_output=True,
                text=True,
                timeout=120,
            )
            print(
                f"\ndemo: zkq submit --priority high ... -> {cli.stdout.strip()!r} "
                f"(exit {cli.returncode})"
            )
            print(f"demo: stats {client.stats()['queues']}")
        finally:
            worker.terminate()
            worker.wait(60)
    shutil.rmtree(work, ignore_errors=True)
    print("demo: stopped the worker and ZooKeeper; done")


if __name__ == "__main__":
    main()
