"""The znode layout (protocol version 3): every path zkq reads or writes is built here and nowhere
else. Every parent that grows with traffic is split into bounded buckets (docs/PROTOCOL.md).

<root>/protocol                                           "3": the layout version
<root>/queues/<queue>/pending/<priority>                  data: the tail bucket's number
<root>/queues/<queue>/pending/<priority>/<bucket>/<id>-<seq>   a job waiting or running (spec)
                                                          of the default tenant
<root>/queues/<queue>/pending/<priority>/@<tenant>        data: the tenant's tail bucket
<root>/queues/<queue>/pending/<priority>/@<tenant>/<bucket>/<id>-<seq>   a job of <tenant>
<root>/queues/<queue>/service                             the tenants' service counters (tokens)
<root>/queues/<queue>/service/corrections                 what jobs really cost less the estimates
<root>/queues/<queue>/claims/<id>                         EPHEMERAL: the running worker's claim
<root>/queues/<queue>/line/w-<seq>                        EPHEMERAL_SEQUENTIAL: a worker with room
<root>/queues/<queue>/busy/<floor>/w-<seq>                EPHEMERAL_SEQUENTIAL: a full worker that
                                                          may preempt a job of priority <floor>
<root>/queues/<queue>/results/<hh>/<id>                   result record; hh from a hash of the id
<root>/queues/<queue>/expiry/<tick>/<id>-<bytes>          the expiry index of results, by time
<root>/queues/<queue>/dead/<letter>                       dead-lettered entry and reason (bounded)
<root>/workers/<worker-id>                                EPHEMERAL worker registration (JSON)

An entry's *name* is its path below its priority, ``<bucket>/<id>-<seq>`` (default tenant) or
``@<tenant>/<bucket>/<id>-<seq>``: ``entry()`` and ``claim()`` take it. A *lane* is the directory
of one tenant's buckets below ``pending/``: ``<priority>`` or ``<priority>/@<tenant>``; every
function that builds a bucket or tail path takes a lane where it says ``priority`` (a priority
is the default tenant's lane).
"""

from __future__ import annotations

import hashlib
import re
import secrets
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from typing import Any, Generic, TypeVar, overload

from zkqueue import defaults
from zkqueue.errors import ConfigurationError, InvalidJob

PROTOCOL_VERSION = 3
#: The tenant of jobs submitted without one (and of every job of protocol version 2's producers):
#: its lane is the priority's directory itself.
DEFAULT_TENANT = "default"
#: The first character of a tenant's lane below a priority (never the start of a bucket or id).
TENANT_MARK = "@"
_QUEUE_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
_ROOT_PART_RE = re.compile(r"^[A-Za-z0-9_][A-Za-z0-9_.-]{0,63}$")
_ID_RE = re.compile(r"^[A-Za-z0-9_.]{1,64}$")
#: ZooKeeper formats the sequence as %010d: ten digits, or a sign and nine or ten digits.
_SEQ_RE = re.compile(r"^(\d{10}|-\d{9,10})$")
_BUCKET_RE = re.compile(r"^\d{10}$")
LINE_PREFIX = "w-"
#: Priorities a running job may be preempted from (by a job of a higher one): all but the first.
PREEMPTIBLE = defaults.PRIORITIES[1:]
#: ZooKeeper's sequence counter is a signed 32-bit int; after 2**31 - 1 it wraps to negative.
_SEQ_WRAP = 2**32
#: Hash buckets of results/: 256, named by two hex digits.
RESULT_BUCKETS = tuple(f"{i:02x}" for i in range(256))


def check_queue(name: str) -> str:
    if not isinstance(name, str) or not _QUEUE_RE.match(name):
        raise InvalidJob(
            f"bad queue name {name!r}: use 1-64 letters, digits, '_', '.', '-', "
            "not starting with '.' or '-'"
        )
    return name


def check_tenant(name: str) -> str:
    if not isinstance(name, str) or not _QUEUE_RE.match(name):
        raise InvalidJob(
            f"bad tenant name {name!r}: use 1-64 letters, digits, '_', '.', '-', "
            "not starting with '.' or '-'"
        )
    return name


def lane(priority: str, tenant: str | None = None) -> str:
    """The path below ``pending/`` of a tenant's buckets in ``priority`` (the default tenant's
    are the priority's own)."""
    if not tenant or tenant == DEFAULT_TENANT:
        return priority
    return f"{priority}/{TENANT_MARK}{tenant}"


@lru_cache(maxsize=4096)
def lane_parts(path: str) -> tuple[str, str]:
    """(priority, tenant) of a lane."""
    priority, _, rest = path.partition("/")
    return priority, rest[len(TENANT_MARK) :] if rest else DEFAULT_TENANT


def lane_mark(path: str) -> str:
    """The tenant of a lane as ``EntryName.tenant`` keeps it: "" for the priority's own."""
    return path.partition("/")[2][len(TENANT_MARK) :]


def in_lane(path: str, name: str) -> str:
    """A name below a lane (``<bucket>[/<id>-<seq>]``) as a name below its priority."""
    lane_dir = path.partition("/")[2]
    return f"{lane_dir}/{name}" if lane_dir else name


def tenant_of_child(name: str) -> str | None:
    """The tenant whose lane a child of a priority's directory is, None for any other name
    (``@default`` included: the default tenant's lane is the priority itself)."""
    tenant = name[len(TENANT_MARK) :]
    if name.startswith(TENANT_MARK) and _QUEUE_RE.match(tenant) and tenant != DEFAULT_TENANT:
        return tenant
    return None


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


#: The first character of the ids zkq's producers generate (then 16 random hex digits). Such
#: an id is new by construction, so a worker does not look for an earlier result before
#: running it; ids a user chooses may not start with it (docs/PROTOCOL.md).
GENERATED_ID_PREFIX = "_"


def new_job_id() -> str:
    """A unique job id (``_`` and 16 random hex digits: workers skip the duplicate check for
    ids of this form); it also goes into the entry's name so a retried create can find it."""
    return GENERATED_ID_PREFIX + secrets.token_hex(8)


def is_generated_id(job_id: str) -> bool:
    return job_id.startswith(GENERATED_ID_PREFIX)


def check_new_job_id(job_id: str) -> str:
    """A job id a user chose for a new job: valid, and not of the generated kind."""
    if is_generated_id(check_job_id(job_id)):
        raise InvalidJob(
            f"bad job id {job_id!r}: ids starting with {GENERATED_ID_PREFIX!r} are reserved for "
            "the ids zkq generates"
        )
    return job_id


def bucket_name(bucket: int) -> str:
    return f"{bucket:010d}"


def parse_bucket(name: str) -> int | None:
    """A pending bucket's number, or None for a name that is not one."""
    return int(name) if _BUCKET_RE.match(name) else None


def result_bucket(job_id: str) -> str:
    """The results/ bucket of a job id: the first two hex digits of its SHA-1."""
    return hashlib.sha1(job_id.encode()).hexdigest()[:2]


def expiry_tick(finished_at: float) -> str:
    """The expiry-index bucket of a result that ended at ``finished_at`` (unix seconds)."""
    return f"{int(finished_at // defaults.EXPIRY_TICK):010d}"


_T = TypeVar("_T")


class _once(Generic[_T]):
    """``functools.cached_property`` without its lock: Python 3.11's takes one at every first
    read (3.12 dropped it), and a worker reads the order of every entry it lists. The values
    are pure, so two threads that compute one at once store the same."""

    def __init__(self, func: Callable[[Any], _T]) -> None:
        self.func = func
        self.name: str = func.__name__
        self.__doc__ = func.__doc__

    def __set_name__(self, owner: type, name: str) -> None:
        self.name = name

    @overload
    def __get__(self, instance: None, owner: type | None = None) -> _once[_T]: ...
    @overload
    def __get__(self, instance: object, owner: type | None = None) -> _T: ...
    def __get__(self, instance: object | None, owner: type | None = None) -> Any:
        if instance is None:
            return self
        value = instance.__dict__[self.name] = self.func(instance)
        return value


@dataclass(frozen=True, order=True)
class EntryName:
    """A pending entry's name below its priority, ``<bucket>/<id>-<seq>``, where ZooKeeper
    appended ``<seq>``. Ordered by (bucket, sequence)."""

    bucket: int
    seq: int
    job_id: str
    #: The tenant whose lane holds it ("": the default tenant's, the priority's own buckets).
    tenant: str = ""

    # Cached (the head walks its candidates' names and orders every turn); a frozen dataclass
    # still has an instance dict, which _once writes to directly.
    @_once
    def leaf(self) -> str:
        """The node's own name, ``<id>-<seq>``."""
        return f"{self.job_id}-{self.seq:010d}"

    @_once
    def name(self) -> str:
        lane = f"{TENANT_MARK}{self.tenant}/" if self.tenant else ""
        return f"{lane}{bucket_name(self.bucket)}/{self.leaf}"

    @property
    def tenant_name(self) -> str:
        """The tenant, by name (``DEFAULT_TENANT`` for the priority's own buckets)."""
        return self.tenant or DEFAULT_TENANT

    @_once
    def order(self) -> tuple[int, int]:
        """FIFO position: bucket, then the sequence (a wrapped, negative one sorts last)."""
        return self.bucket, self.seq % _SEQ_WRAP

    @classmethod
    def parse(cls, name: str) -> EntryName:
        """Parse ``[@<tenant>/]<bucket>/<id>-<seq>``."""
        tenant = ""
        if name.startswith(TENANT_MARK):
            first, _, name = name.partition("/")
            tenant = tenant_of_child(first) or ""
            if not tenant:
                raise InvalidJob(f"entry name {first!r} is not @<tenant>")
        bucket, sep, leaf = name.partition("/")
        number = parse_bucket(bucket)
        if not sep or number is None:
            raise InvalidJob(f"entry name {name!r} is not <bucket>/<id>-<sequence>")
        return cls.parse_leaf(leaf, number, tenant)

    @classmethod
    def parse_leaf(cls, leaf: str, bucket: int, tenant: str = "") -> EntryName:
        """Parse a node name ``<id>-<seq>`` found in ``bucket`` (of ``tenant``'s lane)."""
        job_id, sep, seq = leaf.partition("-")
        if not sep or not _ID_RE.match(job_id) or not _SEQ_RE.match(seq):
            raise InvalidJob(f"entry name {leaf!r} is not <id>-<10-digit sequence>")
        return cls(bucket=bucket, seq=int(seq), job_id=job_id, tenant=tenant)


def entry_job_id(name: str) -> str | None:
    """The job id in an entry name (bucketed or not), None when it has none."""
    leaf = name.rpartition("/")[2]
    job_id, sep, _ = leaf.partition("-")
    return job_id if sep and _ID_RE.match(job_id) else None


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


def index_name(job_id: str, size: int) -> str:
    """A result's node in the expiry index: its id and its record's size in bytes."""
    return f"{job_id}-{size}"


def parse_index_name(name: str) -> tuple[str, int] | None:
    job_id, sep, size = name.partition("-")
    if not sep or not _ID_RE.match(job_id) or not size.isdigit():
        return None
    return job_id, int(size)


class Layout:
    """Paths under one root. All methods are pure string builders."""

    def __init__(self, root: str = defaults.ROOT) -> None:
        self.root = check_root(root)

    def protocol(self) -> str:
        """The layout version marker (data: the version number as text)."""
        return f"{self.root}/protocol"

    def queues(self) -> str:
        return f"{self.root}/queues"

    def queue(self, queue: str) -> str:
        return f"{self.root}/queues/{queue}"

    def pending(self, queue: str, priority: str) -> str:
        """A lane's directory of buckets (a priority: the default tenant's); its data is the
        tail bucket's number."""
        return f"{self.root}/queues/{queue}/pending/{priority}"

    def bucket(self, queue: str, priority: str, bucket: int) -> str:
        return f"{self.pending(queue, priority)}/{bucket_name(bucket)}"

    def entry(self, queue: str, priority: str, name: str) -> str:
        """An entry by its name below the priority, ``<bucket>/<id>-<seq>``."""
        return f"{self.pending(queue, priority)}/{name}"

    def entry_prefix(self, queue: str, priority: str, job_id: str, bucket: int = 0) -> str:
        """Path to pass to a sequential create in ``bucket``; ZooKeeper appends the sequence."""
        return f"{self.bucket(queue, priority, bucket)}/{job_id}-"

    def service(self, queue: str) -> str:
        """The tenants' service counters, in its data (fair share: ``zkqueue.dispatch.share``);
        its child ``corrections`` holds the workers' corrections."""
        return f"{self.root}/queues/{queue}/service"

    def claims(self, queue: str) -> str:
        return f"{self.root}/queues/{queue}/claims"

    def claim(self, queue: str, name: str) -> str:
        """The claim of a running entry (by entry name or by job id): one per job id."""
        return f"{self.claims(queue)}/{entry_job_id(name) or name}"

    def line(self, queue: str) -> str:
        return f"{self.root}/queues/{queue}/line"

    def busy(self, queue: str) -> str:
        """The busy lines: workers with no free slot that run a job a more urgent one may
        preempt, one line per ``floor`` (the lowest priority such a worker could give back)."""
        return f"{self.root}/queues/{queue}/busy"

    def busy_line(self, queue: str, floor: str) -> str:
        return f"{self.busy(queue)}/{floor}"

    def results(self, queue: str) -> str:
        return f"{self.root}/queues/{queue}/results"

    def result_dir(self, queue: str, bucket: str) -> str:
        return f"{self.results(queue)}/{bucket}"

    def result(self, queue: str, job_id: str) -> str:
        return f"{self.results(queue)}/{result_bucket(job_id)}/{job_id}"

    def expiry(self, queue: str) -> str:
        """The expiry index: one bucket per EXPIRY_TICK seconds of finishing times."""
        return f"{self.root}/queues/{queue}/expiry"

    def expiry_bucket(self, queue: str, tick: str) -> str:
        return f"{self.expiry(queue)}/{tick}"

    def expiry_entry(self, queue: str, finished_at: float, job_id: str, size: int) -> str:
        return f"{self.expiry_bucket(queue, expiry_tick(finished_at))}/{index_name(job_id, size)}"

    def dead(self, queue: str) -> str:
        return f"{self.root}/queues/{queue}/dead"

    def dead_node(self, queue: str, name: str) -> str:
        return f"{self.dead(queue)}/{name}"

    @staticmethod
    def dead_name(priority: str, name: str) -> str:
        """A dead letter's node name for the entry ``name`` of ``priority``."""
        return f"{priority}.{name.replace('/', '.')}"

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
        """Every persistent directory a queue needs, parents first (the last one created is
        the last result bucket: its existence says the queue is complete)."""
        pending = [self.pending(queue, p) for p in defaults.PRIORITIES]
        first = [self.bucket(queue, p, 0) for p in defaults.PRIORITIES]
        return [
            f"{self.queue(queue)}/pending",
            *pending,
            *first,
            self.claims(queue),
            self.line(queue),
            self.busy(queue),
            *(self.busy_line(queue, p) for p in PREEMPTIBLE),
            self.expiry(queue),
            self.dead(queue),
            self.service(queue),
            self.results(queue),
            *(self.result_dir(queue, b) for b in RESULT_BUCKETS),
        ]
