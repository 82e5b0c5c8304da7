"""The arrival signal: what a producer writes into the tail bucket's data when it enqueues.

Every enqueue multi sets the tail bucket's data (a waiting head watches it). When the multi
creates exactly one entry in that bucket and its spec is small, the data is that entry, as
``<job id>\\n<spec bytes>``; otherwise it is empty. A head woken by an arrival reads the bucket's
data just before listing it, in the same round trip: if the listing's ``pzxid`` (the last change
to the bucket's children) equals the data's ``mzxid``, the newest entry in the listing is the
one the data describes, created in that very multi. If it appeared since the head's own last
listing of the bucket, while it stayed head, no other head claimed it (its version is still 0),
and the head claims it without reading it (a generated id only: others need a read anyway):
one round trip less from submit to result on an idle queue. Should the guess be wrong, the
claim's versioned setData fails and nothing is lost. Any other data is ignored.
"""

from __future__ import annotations

from collections.abc import Container

from kazoo.protocol.states import ZnodeStat

from zkqueue import defaults
from zkqueue.protocol.layout import EntryName

_SEP = b"\n"


def encode(job_id: str, spec: bytes, limit: int = defaults.SIGNAL_SPEC_BYTES) -> bytes:
    """The signal for a multi that creates one entry, ``spec``, for ``job_id`` in the bucket
    (empty when the spec is over ``limit`` bytes)."""
    if len(spec) > limit:
        return b""
    return job_id.encode() + _SEP + spec


def decode(data: bytes | None) -> tuple[str, bytes] | None:
    """(job id, spec bytes) a signal carries, or None (empty, or not a signal of this form)."""
    job_id, sep, spec = (data or b"").partition(_SEP)
    if not sep or not job_id or not spec:
        return None
    try:
        return job_id.decode(), spec
    except UnicodeDecodeError:
        return None


def carried(
    newest: EntryName, seen: Container[str], pzxid: int, data: bytes | None, stat: ZnodeStat
) -> tuple[bytes, ZnodeStat] | None:
    """The spec and stat of ``newest`` (the last entry of a bucket listed with ``pzxid``,
    just after its data was read: ``data``, ``stat``) if the signal carries it: nothing
    changed the bucket's children since the signal was set, the entry is not one of the
    ``seen`` leaves, and it has the signal's id."""
    found = decode(data) if stat.mzxid == pzxid and newest.leaf not in seen else None
    if found is None or found[0] != newest.job_id:
        return None
    return found[1], entry_stat(stat, len(found[1]))


def entry_stat(bucket: ZnodeStat, size: int) -> ZnodeStat:
    """The stat of the entry created in the multi that set ``bucket``'s data (same zxid and
    time); never claimed (version 0), no children. Its session is not known (0)."""
    return ZnodeStat(
        czxid=bucket.mzxid,
        mzxid=bucket.mzxid,
        ctime=bucket.mtime,
        mtime=bucket.mtime,
        version=0,
        cversion=0,
        aversion=0,
        ephemeralOwner=0,
        dataLength=size,
        numChildren=0,
        pzxid=bucket.mzxid,
    )
