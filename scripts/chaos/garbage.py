"""Hostile input: entries any client could write under ``pending/`` (bad JSON, not UTF-8, wrong
types, oversize, bad names, a child node, a reused job id), interleaved with good jobs."""

from __future__ import annotations

import json
import time

from scripts.chaos.audit import QUEUE, Audit, ChaosReport
from scripts.chaos.load import spawn_fleet
from scripts.chaos.stage import Stage, WorkerProcess, poll
from zkqueue import defaults
from zkqueue.protocol import result as results
from zkqueue.protocol.layout import Layout, bucket_name, child

# -- (f) garbage entries ---------------------------------------------------------------------

#: Entries any client could write, each under a valid name ``<kind><n>-<seq>``: each must be
#: dead-lettered with the reason and end with a ``dead`` result for its id.
BAD_DATA: tuple[tuple[str, bytes], ...] = (
    ("badjson", b"{not json"),
    ("notutf8", b"\xff\xfe\x00garbage"),
    ("empty", b""),
    ("nullspec", b"null"),
    ("notobject", b"[1, 2, 3]"),
    ("wrongtype", b'{"prompt": ["a list"]}'),
    ("noprompt", b'{"max_new_tokens": 4}'),
    ("blank", b'{"prompt": "   "}'),
    ("textnumber", b'{"prompt": "x", "max_new_tokens": "ten"}'),
    ("boolnumber", b'{"prompt": "x", "max_new_tokens": true}'),
    ("hugenumber", b'{"prompt": "x", "max_new_tokens": 1e400}'),
    ("nan", b'{"prompt": "x", "temperature": NaN}'),
    ("unknown", b'{"prompt": "x", "gpu": "please"}'),
    ("version", b'{"v": 2, "prompt": "x"}'),
    ("deep", b"[" * 50_000),
    ("oversize", b'{"prompt": "' + b"x" * 70_000 + b'"}'),
)
#: Entry names that are not ``<id>-<sequence>`` (prefix, sequential): dead-lettered with the
#: reason; no result, since there is no id to key it by.
BAD_NAMES: tuple[tuple[str, bool], ...] = (
    ("no_sequence_here{n}", False),
    ("bad-name{n}-", True),
    ("\u00fcn\u00efcode{n}-", True),
    ("-", True),
    ("x" * 70 + "{n}-", True),
)


def garbage_entries(
    jobs: int = 20,
    workers: int = 2,
    *,
    delay: float = 0.05,
    slots: int = 2,
    session_timeout: float = 3.0,
    hosts: str | None = None,
) -> ChaosReport:
    """Malformed entries (bad JSON, not UTF-8, wrong types, oversize, bad names) interleaved
    with good jobs at every priority while workers run, then an entry that reuses the id of a
    finished job. The workers must live, letter each bad entry once with its reason, and run
    every good job; the reused id must not get a second result."""
    started = time.monotonic()
    report = ChaosReport(
        "garbage",
        f"{len(BAD_DATA)} kinds of malformed spec, {len(BAD_NAMES)} kinds of bad name, an "
        "entry with a child node and a reused job id, interleaved with good jobs",
        recovery="n/a: nothing stops; each entry is handled as it comes",
    )
    with Stage("garbage", hosts=hosts, session_timeout=session_timeout) as st:
        fleet = spawn_fleet(st, "w", workers, delay=delay, slots=slots)
        expected, letters = _interleave(st, jobs)
        good = [i for i, s in expected.items() if s == results.SUCCEEDED]
        st.drained(good, jobs * delay + 30)
        reused = _reuse_id(st, good[0])
        letters.append(reused)
        poll(lambda: set(letters) <= _dead_names(st), 30)
        a = st.audit(expected)
        a.fill(report)
        report.workers = workers
        report.details.update(good_jobs=len(good), garbage_entries=len(letters))
        _garbage_checks(report, a, st, fleet, letters, good[0])
        return st.finish(report, started)


def _interleave(st: Stage, jobs: int) -> tuple[dict[str, str], list[str]]:
    """Write good jobs and garbage alternately, at rotating priorities; returns the expected
    status per job id and the names of the garbage entries."""
    expected: dict[str, str] = {}
    letters: list[str] = []
    kinds = len(BAD_DATA) + len(BAD_NAMES)
    for n in range(max(jobs, kinds)):
        priority = defaults.PRIORITIES[n % 3]
        if n < jobs:
            expected[st.client.submit(f"good {n}", priority=priority, detach=True).id] = "succeeded"
        name, job_id = _write_garbage(st, n % kinds, n, priority)
        letters.append(name)
        if job_id is not None:
            expected[job_id] = results.DEAD
    name = _write_nested(st, jobs)
    letters.append(Layout.dead_name("low", f"{bucket_name(0)}/{name}"))
    expected[name.split("-", 1)[0]] = results.DEAD
    return expected, letters


def _write_garbage(st: Stage, kind: int, n: int, priority: str) -> tuple[str, str | None]:
    """Create one bad entry; returns its node name and its job id (None for a bad name)."""
    if kind < len(BAD_DATA):
        label, data = BAD_DATA[kind]
        path = st.zk.create(
            st.layout.entry_prefix(QUEUE, priority, f"{label}{n}"), data, sequence=True
        )
        return Layout.dead_name(
            priority, f"{bucket_name(0)}/{path.rsplit('/', 1)[1]}"
        ), f"{label}{n}"
    pattern, sequential = BAD_NAMES[kind - len(BAD_DATA)]
    path = st.layout.entry(QUEUE, priority, pattern.format(n=n))
    path = st.zk.create(path, b'{"prompt": "x"}', sequence=sequential)
    return Layout.dead_name(priority, path.rsplit("/", 1)[1]), None


def _write_nested(st: Stage, n: int) -> str:
    """A valid spec with a node hung under it (created in one multi, so no worker can take
    the entry before its child exists). Its completion could never delete it."""
    name = f"haschild{n}-{9_000_000_000 + n:010d}"
    path = st.layout.entry(QUEUE, "low", f"{bucket_name(0)}/{name}")
    txn = st.zk.transaction()
    txn.create(path, b'{"prompt": "x"}')
    txn.create(child(path, "kid"), b"")
    txn.commit()
    return name


def _reuse_id(st: Stage, job_id: str) -> str:
    """A hand-made entry reusing the id of a job that already has its result."""
    prefix = st.layout.entry_prefix(QUEUE, "normal", job_id)
    path = st.zk.create(prefix, b'{"prompt": "second answer?"}', sequence=True)
    return Layout.dead_name("normal", f"{bucket_name(0)}/{path.rsplit('/', 1)[1]}")


def _dead_names(st: Stage) -> set[str]:
    return set(st.zk.get_children(st.layout.dead(QUEUE)))


def _garbage_checks(
    report: ChaosReport,
    a: Audit,
    st: Stage,
    fleet: list[WorkerProcess],
    letters: list[str],
    reused: str,
) -> None:
    path = st.layout.dead(QUEUE)
    names, stat = st.zk.get_children(path, include_data=True)
    bodies = [json.loads(st.zk.get(st.layout.dead_node(QUEUE, n))[0]) for n in names]
    report.details["dead_letters"] = len(names)
    report.checks["every worker alive, no traceback in its log"] = st.all_alive(fleet) and not any(
        w.log_has("Traceback") for w in fleet
    )
    report.checks["each bad entry dead-lettered exactly once"] = sorted(names) == sorted(
        letters
    ) and stat.cversion == len(names)
    report.checks["each letter says why"] = all(b.get("reason") for b in bodies)
    report.checks["the reused id kept its first result"] = (
        a.records.get(reused, {}).get("output") == "good 0"
    )
