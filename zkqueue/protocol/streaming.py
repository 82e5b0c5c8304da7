"""The data plane's wire format: how a worker serves a job's output as it is generated, and how
a reader takes it.

ZooKeeper carries the claim, the lease and the one authoritative result; tokens do not go
through it (every write there is replicated and fsynced). A worker that serves streams names, in
the claim of each streaming job (``ClaimBody``), the URL of that attempt's stream (``stream``)
and a secret made for that claim alone (``secret``): only those who may read the job's znodes
learn it, so ZooKeeper's ACLs still decide who sees a job. A reader sends::

    GET <stream>?offset=N
    Authorization: Bearer <secret>

and gets ``200``, ``Content-Type: text/event-stream``, with these events::

    data: {"offset": 0, "text": "Hello"}     a piece of the output: its text and where it starts
    event: end
    data: {"status": "succeeded"}            the attempt ended; the result is (about to be) in
                                             ZooKeeper, and it is the authoritative text
    event: error
    data: {"reason": "preempted"}            the attempt stopped without a result from this
                                             worker (preempted, released, fenced, lease, lost,
                                             cancelled); the job may run again elsewhere

The first piece holds the output so far from ``offset`` (default 0): a reader that connects late,
or again, misses nothing. Offsets count Unicode code points of the output. The pieces are always
a prefix of the job's final output (a worker holds back text that may turn out to be the start
of a stop string). Other answers: ``403`` (a missing or wrong secret), ``404`` (the job does not
run there: it ended, or another attempt took it; read ZooKeeper). A connection that closes
without ``end`` or ``error`` means the worker went away.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

#: Where a worker's stream server serves streams: ``<base>/<job id>``.
PATH = "/v1/streams"
#: A worker sends a comment line (``: ping``) after this many seconds without an event, so that
#: readers and proxies can tell a quiet stream (a long prefill) from a cut one.
HEARTBEAT = 15.0
#: The events besides pieces.
END = "end"
ERROR = "error"
PIECE = "message"  # what server-sent events call an event without an ``event:`` line


@dataclass
class StreamEvent:
    """One event of a stream: a piece (``text`` at ``offset``), ``end`` or ``error``."""

    kind: str
    text: str = ""
    offset: int = 0
    #: ``end``: the job's status as the worker's runner reported it.
    status: str | None = None
    #: ``error``: why the attempt stopped.
    reason: str | None = None

    def to_bytes(self) -> bytes:
        if self.kind == PIECE:
            data = json.dumps({"offset": self.offset, "text": self.text}, ensure_ascii=False)
            return f"data: {data}\n\n".encode()
        body = {"status": self.status} if self.kind == END else {"reason": self.reason}
        return f"event: {self.kind}\ndata: {json.dumps(body)}\n\n".encode()


class EventReader:
    """Turns a stream's lines into events (``feed`` one line at a time, without its newline).
    What it cannot read (a comment, an unknown event, bad JSON) it skips."""

    def __init__(self) -> None:
        self._kind = PIECE
        self._data: list[str] = []

    def feed(self, line: str) -> StreamEvent | None:
        if line:
            field, _, value = line.partition(":")
            value = value[1:] if value.startswith(" ") else value
            if field == "event":
                self._kind = value
            elif field == "data":
                self._data.append(value)
            return None
        kind, data = self._kind, "\n".join(self._data)
        self._kind, self._data = PIECE, []
        try:
            body = json.loads(data) if data else None
        except ValueError:
            return None
        if not isinstance(body, dict):
            return None
        if kind == PIECE and isinstance(body.get("text"), str):
            offset = body.get("offset")
            return StreamEvent(PIECE, body["text"], offset if isinstance(offset, int) else 0)
        if kind == END:
            return StreamEvent(END, status=str(body.get("status")))
        if kind == ERROR:
            return StreamEvent(ERROR, reason=str(body.get("reason")))
        return None
