"""The protocol's small records and their one (de)serializer each: what a worker's claim node
holds, what a dead letter holds, and the worker's view of a claimed job.

The job spec (``zkqueue.protocol.spec``), the result (``zkqueue.protocol.result``) and the worker
registration (``zkqueue.protocol.registry``) have modules of their own. Readers treat records
written by other clients as data, not trust: a record that is not JSON, or lacks a required field,
raises ``CorruptRecord`` naming the node, never a bare KeyError or ValueError.
"""

from __future__ import annotations

import base64
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from kazoo.exceptions import NoNodeError
from kazoo.protocol.states import ZnodeStat

from zkqueue.errors import CorruptRecord
from zkqueue.protocol.result import read_json, to_json
from zkqueue.protocol.spec import JobSpec

if TYPE_CHECKING:  # a type only: loading the records does not load the layout
    from zkqueue.protocol.layout import EntryName

#: Bytes of an entry's data a dead letter keeps at most.
_RAW_LIMIT = 16 * 1024


@dataclass
class ClaimBody:
    """The data of claims/<entry>: who runs the job, its fencing token, its lease, and for a
    job that streams, where its tokens are served (``stream``, the URL of the worker's stream
    of this attempt, and ``secret``, the bearer token that stream asks for: only readers of
    the claim learn it) and its output so far when no direct reader takes it (``partial``).
    The claim node's mtime is the lease's last renewal."""

    worker: str
    token: int
    claimed_at: float
    #: Seconds the claim stays valid without a renewal.
    lease: float
    #: The claimed entry, ``<priority>/<bucket>/<id>-<seq>`` (the janitor reclaims through it).
    entry: str | None = None
    partial: str | None = None
    stream: str | None = None
    secret: str | None = None

    def to_bytes(self) -> bytes:
        record = {k: v for k, v in vars(self).items() if v is not None}
        return to_json(record)

    @classmethod
    def from_call(cls, call: Any) -> ClaimBody | None:
        """The claim a pipelined read found (None: not running, or a claim zkq cannot read)."""
        try:
            return cls.from_bytes(call.get()[0])
        except (NoNodeError, CorruptRecord):
            return None

    @classmethod
    def from_bytes(cls, data: bytes | None, what: str = "claim") -> ClaimBody:
        raw = read_json(data, what)
        try:
            return cls(
                worker=str(raw["worker"]),
                token=int(raw["token"]),
                claimed_at=float(raw.get("claimed_at") or 0.0),
                lease=float(raw["lease"]),
                entry=raw.get("entry") if isinstance(raw.get("entry"), str) else None,
                partial=_text(raw, "partial"),
                stream=_text(raw, "stream"),
                secret=_text(raw, "secret"),
            )
        except (KeyError, TypeError, ValueError) as exc:
            raise CorruptRecord(f"{what} lacks a valid field: {exc}") from None


def _text(raw: dict[str, Any], name: str) -> str | None:
    value = raw.get(name)
    return value if isinstance(value, str) else None


@dataclass
class DeadLetter:
    """The data of dead/<entry>: an entry a worker could not run, with the reason. ``raw`` is
    the entry's data when it is UTF-8, ``raw_base64`` otherwise (both capped)."""

    queue: str
    priority: str
    #: The entry's node name (also the letter's).
    entry: str
    reason: str
    id: str | None = None
    worker: str | None = None
    dead_at: float | None = None
    raw: str | None = None
    raw_base64: str | None = None

    @staticmethod
    def duplicate(job_id: str) -> str:
        """The reason of an entry whose id already has a result (lettered without a result)."""
        return f"duplicate: job id {job_id} already has a result"

    @classmethod
    def of_entry(cls, data: bytes | None, **fields: Any) -> DeadLetter:
        data = (data or b"")[:_RAW_LIMIT]
        try:
            return cls(**fields, raw=data.decode("utf-8"))
        except UnicodeDecodeError:
            return cls(**fields, raw_base64=base64.b64encode(data).decode())

    def to_dict(self) -> dict[str, Any]:
        return {k: v for k, v in vars(self).items() if v is not None or k == "id"}

    def to_bytes(self) -> bytes:
        return to_json(self.to_dict())

    @classmethod
    def from_bytes(cls, data: bytes | None, what: str = "dead letter") -> DeadLetter:
        raw = read_json(data, what)
        known = {k: raw[k] for k in cls.__dataclass_fields__ if k in raw}
        try:
            return cls(**known)
        except TypeError as exc:
            raise CorruptRecord(f"{what} lacks a required field: {exc}") from None


@dataclass
class Candidate:
    """A pending entry read by the head and judged admissible."""

    priority: str
    entry: EntryName
    data: bytes
    stat: ZnodeStat
    spec: JobSpec
    #: KV-cache pages admission promised the job (0 when the worker has no cache).
    pages: int = 0


@dataclass
class Claim:
    """A job this worker holds. ``token`` is the entry version the claim set."""

    queue: str
    priority: str
    entry: EntryName
    spec: JobSpec
    token: int
    submitted_at: float
    claimed_at: float
    #: The claim node's data (renewals write it again).
    body: ClaimBody = field(default_factory=lambda: ClaimBody("", 0, 0.0, 0.0))

    @property
    def id(self) -> str:
        return self.entry.job_id
