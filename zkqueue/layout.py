"""The znode layout: every path zkq reads or writes is built here and nowhere else.

<root>/queues/<queue>/pending/<priority>/<id>-<seq>   a job waiting or running (spec JSON)
<root>/queues/<queue>/claims/<id>-<seq>               EPHEMERAL: the running worker's claim
<root>/queues/<queue>/line/w-<seq>                    EPHEMERAL_SEQUENTIAL: a worker with free slots
<root>/queues/<queue>/results/<id>                    result record (JSON)
<root>/queues/<queue>/dead/<entry>                    dead-lettered entry and reason (JSON)
<root>/workers/<worker-id>                            EPHEMERAL worker registration (JSON)
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from zkqueue import defaults
from zkqueue.errors import ConfigurationError, InvalidJob

_QUEUE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
_ROOT_PART_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
_ID_RE = re.compile(r"^[A-Za-z0-9_.]{1,64}$")
#: ZooKeeper formats the sequence as %010d: ten digits, or a sign and nine or ten digits.
_SEQ_RE = re.compile(r"^(\d{10}|-\d{9,10})$")
LINE_PREFIX = "w-"
#: ZooKeeper's sequence counter is a signed 32-bit int; after 2**31 - 1 it wraps to negative.
_SEQ_WRAP = 2**32


def check_queue(name: str) -> str:
    if not isinstance(name, str) or not _QUEUE_RE.match(name):
        raise InvalidJob(f"bad queue name {name!r}: use 1-64 letters, digits, '_', '.', '-'")
    return name


def check_worker_name(name: str) -> str:
    if not isinstance(name, str) or not _QUEUE_RE.match(name):
        raise InvalidJob(
            f"bad worker name {name!r}: use 1-64 letters, digits, '_', '.', '-' (no '/')"
        )
    return name


def check_root(root: str) -> str:
    """An absolute znode path of plain names, not ``/`` itself and not ZooKeeper's own
    ``/zookeeper`` tree."""
    parts = root.split("/")[1:] if isinstance(root, str) and root.startswith("/") else []
    if not parts or not all(_ROOT_PART_RE.match(p) for p in parts):
        raise ConfigurationError(
            f"root must be an absolute znode path like /zkq (names of letters, digits, "
            f"'_', '.', '-'), not {root!r}"
        )
    if parts[0] == "zookeeper":
        raise ConfigurationError(f"root {root!r} is inside ZooKeeper's reserved /zookeeper tree")
    return root


def check_priority(priority: str) -> str:
    if priority not in defaults.PRIORITIES:
        raise InvalidJob(
            f"unknown priority {priority!r}: use one of {', '.join(defaults.PRIORITIES)}"
        )
    return priority


def check_job_id(job_id: str) -> str:
    if not isinstance(job_id, str) or not _ID_RE.match(job_id):
        raise InvalidJob(f"bad job id {job_id!r}: use 1-64 letters, digits, '_' or '.'")
    return job_id


@dataclass(frozen=True, order=True)
class EntryName:
    """A pending entry's node name, ``<id>-<seq>``, where ZooKeeper appended ``<seq>``."""

    seq: int
    job_id: str

    @property
    def name(self) -> str:
        return f"{self.job_id}-{self.seq:010d}"

    @property
    def order(self) -> int:
        """FIFO position as a number; a wrapped (negative) counter sorts after the positive ones."""
        return self.seq % _SEQ_WRAP

    @classmethod
    def parse(cls, name: str) -> EntryName:
        job_id, sep, seq = name.partition("-")
        if not sep or not _ID_RE.match(job_id) or not _SEQ_RE.match(seq):
            raise InvalidJob(f"entry name {name!r} is not <id>-<10-digit sequence>")
        return cls(seq=int(seq), job_id=job_id)


def child(directory: str, name: str) -> str:
    """The path of ``name`` inside ``directory`` (for directories a Layout method returned)."""
    return f"{directory}/{name}"


def member_prefix(directory: str) -> str:
    """Sequential-create prefix of a line member (a worker's place, a janitor candidate)."""
    return f"{directory}/{LINE_PREFIX}"


def is_line_member(name: str) -> bool:
    """A node a line member created (``w-`` and ZooKeeper's sequence); any other name under a
    line directory was written by someone else and is ignored."""
    return name.startswith(LINE_PREFIX) and bool(_SEQ_RE.match(name[len(LINE_PREFIX) :]))


def line_order(name: str) -> int:
    """Position of a line node (``w-<seq>``) as a number."""
    return int(name[len(LINE_PREFIX) :]) % _SEQ_WRAP


class Layout:
    """Paths under one root. All methods are pure string builders."""

    def __init__(self, root: str = defaults.ROOT) -> None:
        self.root = check_root(root)

    def queues(self) -> str:
        return f"{self.root}/queues"

    def queue(self, queue: str) -> str:
        return f"{self.root}/queues/{queue}"

    def pending(self, queue: str, priority: str) -> str:
        return f"{self.root}/queues/{queue}/pending/{priority}"

    def entry(self, queue: str, priority: str, name: str) -> str:
        return f"{self.pending(queue, priority)}/{name}"

    def entry_prefix(self, queue: str, priority: str, job_id: str) -> str:
        """Path to pass to a sequential create; ZooKeeper appends the sequence number."""
        return f"{self.pending(queue, priority)}/{job_id}-"

    def claims(self, queue: str) -> str:
        return f"{self.root}/queues/{queue}/claims"

    def claim(self, queue: str, name: str) -> str:
        return f"{self.claims(queue)}/{name}"

    def line(self, queue: str) -> str:
        return f"{self.root}/queues/{queue}/line"

    def results(self, queue: str) -> str:
        return f"{self.root}/queues/{queue}/results"

    def result(self, queue: str, job_id: str) -> str:
        return f"{self.results(queue)}/{job_id}"

    def dead(self, queue: str) -> str:
        return f"{self.root}/queues/{queue}/dead"

    def dead_node(self, queue: str, name: str) -> str:
        return f"{self.dead(queue)}/{name}"

    def janitor(self) -> str:
        """Leader election of the janitor: one line, its head is the active janitor."""
        return f"{self.root}/janitor"

    def clock(self) -> str:
        """A node the janitor writes to read ZooKeeper's own clock (its mtime)."""
        return f"{self.root}/clock"

    def workers(self) -> str:
        return f"{self.root}/workers"

    def worker(self, worker_id: str) -> str:
        return f"{self.workers()}/{worker_id}"

    def queue_dirs(self, queue: str) -> list[str]:
        """Every persistent directory a queue needs, parents first."""
        pending = [self.pending(queue, p) for p in defaults.PRIORITIES]
        return [
            *pending,
            self.claims(queue),
            self.line(queue),
            self.results(queue),
            self.dead(queue),
        ]
