"""The result record (the JSON stored at results/<id> when a job ends, whatever the reason), and the
JSON codec every small record shares (``read_json`` refuses what is not a JSON object)."""

from __future__ import annotations

import copy
import enum
import json
import math
from dataclasses import dataclass, field
from typing import Any

from zkqueue import defaults
from zkqueue.errors import CorruptRecord, ResultTooLarge


def to_json(value: Any) -> bytes:
    """Compact JSON for small records."""
    return json.dumps(value, ensure_ascii=False, separators=(",", ":")).encode()


def read_json(data: bytes | None, what: str) -> dict[str, Any]:
    """A JSON object from a node written by any client, or CorruptRecord naming ``what``."""
    try:
        value = json.loads((data or b"").decode("utf-8"))
    except (UnicodeDecodeError, ValueError, RecursionError):
        raise CorruptRecord(f"{what} is not valid JSON") from None
    if not isinstance(value, dict):
        raise CorruptRecord(f"{what} is not a JSON object")
    return value


def json_number(value: Any) -> float | None:
    """A finite JSON number as a float: None for anything else, booleans and integers too
    large for a float included (a record written by any client may hold them)."""
    if isinstance(value, bool) or not isinstance(value, int | float):
        return None
    try:
        number = float(value)
    except OverflowError:
        return None
    return number if math.isfinite(number) else None


class Status(enum.StrEnum):
    """How a job ended; the value is the wire string in the result record."""

    SUCCEEDED = "succeeded"
    FAILED = "failed"
    CANCELLED = "cancelled"
    EXPIRED = "expired"
    TIMEOUT = "timeout"
    REJECTED = "rejected"
    DEAD = "dead"


SUCCEEDED = Status.SUCCEEDED
FAILED = Status.FAILED
CANCELLED = Status.CANCELLED
EXPIRED = Status.EXPIRED
TIMEOUT = Status.TIMEOUT
REJECTED = Status.REJECTED
DEAD = Status.DEAD
STATUSES = tuple(Status)


@dataclass
class Result:
    """How a job ended. Times are unix seconds; ``attempts`` counts claims of the job."""

    id: str
    queue: str
    priority: str
    status: str
    output: str = ""
    error: str | None = None
    worker: str | None = None
    attempts: int = 0
    submitted_at: float | None = None
    started_at: float | None = None
    finished_at: float | None = None
    #: Runner figures (prompt_tokens, output_tokens, ttft_s, total_s...), flattened into the JSON.
    extra: dict[str, Any] = field(default_factory=dict)

    def __getitem__(self, key: str) -> Any:
        """Read a field by name, so a result reads like the JSON record it is."""
        return copy.deepcopy(self._flat()[key])

    def get(self, key: str, default: Any = None) -> Any:
        return copy.deepcopy(self._flat().get(key, default))

    @property
    def ok(self) -> bool:
        return self.status == SUCCEEDED

    def to_dict(self) -> dict[str, Any]:
        """The JSON record as a dict of its own (changing it leaves the result as it is)."""
        return copy.deepcopy(self._flat())

    def _flat(self) -> dict[str, Any]:
        """The record without copying its values (vars, not asdict: this runs for every
        result a worker writes, and asdict deep-copies)."""
        record = dict(vars(self))
        extra = record.pop("extra")
        return {**extra, **record}

    def to_bytes(self, limit: int = defaults.MAX_RESULT_BYTES) -> bytes:
        data = json.dumps(self._flat(), ensure_ascii=False, separators=(",", ":")).encode()
        if len(data) > limit:
            raise ResultTooLarge(f"result record is {len(data)} bytes; the limit is {limit} bytes")
        return data

    def to_bytes_or_failure(self) -> bytes:
        """The record's JSON; one over the size limit becomes a failure that says so."""
        try:
            return self.to_bytes()
        except ResultTooLarge as exc:
            self.status, self.output, self.error = FAILED, "", str(exc)
            return self.to_bytes()

    @classmethod
    def from_bytes(cls, data: bytes | None, what: str = "result") -> Result:
        """Read a result written by any client; CorruptRecord (naming ``what``) when it is not
        JSON or lacks one of the required fields id, queue, priority and status."""
        raw = read_json(data, what)
        missing = [f for f in REQUIRED if not isinstance(raw.get(f), str)]
        if missing:
            raise CorruptRecord(f"{what} lacks required field(s): {', '.join(missing)}")
        known = {f: raw.pop(f) for f in list(raw) if f in cls.__dataclass_fields__ and f != "extra"}
        try:
            return cls(**known, extra=raw)
        except TypeError as exc:  # pragma: no cover - every field has a default but the four
            raise CorruptRecord(f"{what}: {exc}") from None


#: Fields every result record has (docs/PROTOCOL.md); the rest are optional.
REQUIRED = ("id", "queue", "priority", "status")
