"""The producer API: submit jobs, find them, list the queue, read stats and the worker registry."""

from __future__ import annotations

import builtins
import secrets
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager, suppress
from typing import Any

from kazoo.client import KazooClient
from kazoo.exceptions import NodeExistsError, NoNodeError

from zkqueue import defaults
from zkqueue.connection import ConnectionSettings, close, connect, mapped_errors
from zkqueue.deadletters import dead_result, list_dead, requeue
from zkqueue.enqueue import Enqueuer
from zkqueue.errors import CorruptRecord, InvalidJob, JobNotFound, ZkqConnectionError
from zkqueue.job import PENDING, RUNNING, Job
from zkqueue.layout import EntryName, Layout, check_job_id, check_priority, check_queue
from zkqueue.limits import Limits, QueueSettings
from zkqueue.queues import delete_queue, queue_stats, queue_table
from zkqueue.records import ClaimBody
from zkqueue.registry import read_records
from zkqueue.result import Result
from zkqueue.spec import build_spec, parse_submission


def new_job_id() -> str:
    """A unique job id; it also goes into the entry's name so a retried create can find it."""
    return secrets.token_hex(8)


class Client:
    """A connection to one zkq root. Use as a context manager, or call start() and close()."""

    def __init__(
        self,
        hosts: str = defaults.HOSTS,
        root: str = defaults.ROOT,
        *,
        session_timeout: float = defaults.SESSION_TIMEOUT,
        connect_timeout: float = defaults.CONNECT_TIMEOUT,
        max_spec_bytes: int = defaults.MAX_SPEC_BYTES,
        auth: str | None = None,
        tls_ca: str | None = None,
        tls_cert: str | None = None,
        tls_key: str | None = None,
        zk: KazooClient | None = None,
    ) -> None:
        self.settings = ConnectionSettings(
            hosts=hosts,
            session_timeout=session_timeout,
            connect_timeout=connect_timeout,
            auth=auth,
            tls_ca=tls_ca,
            tls_cert=tls_cert,
            tls_key=tls_key,
        )
        self.layout = Layout(root)
        self.max_spec_bytes = max_spec_bytes
        self._zk = zk
        self._owns_zk = zk is None
        self._ready: set[str] = set()
        self._limits: Limits | None = None
        self._enqueue = Enqueuer(self)

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> Client:
        if self._zk is None:
            self._zk = connect(self.settings)
        return self

    def close(self) -> None:
        if self._zk is not None and self._owns_zk:
            close(self._zk)
            self._zk = None

    def __enter__(self) -> Client:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def zk(self) -> KazooClient:
        if self._zk is None:
            raise ZkqConnectionError("client is not started: use it as a context manager")
        return self._zk

    @property
    def limits(self) -> Limits:
        if self._limits is None:
            self._limits = Limits(self.zk, self.layout)
        return self._limits

    @contextmanager
    def mapped(self) -> Iterator[None]:
        with mapped_errors(self.settings.hosts):
            yield

    def ensure_queue(self, queue: str) -> None:
        """Create the queue's directories once per client (idempotent)."""
        if queue in self._ready:
            return
        for path in self.layout.queue_dirs(queue):
            with suppress(NodeExistsError):
                self.zk.create(path, makepath=True)
        self._ready.add(queue)

    # -- producing ---------------------------------------------------------------------------

    def submit(
        self,
        prompt: str,
        priority: str = defaults.PRIORITY,
        queue: str = defaults.QUEUE,
        max_new_tokens: int | None = None,
        detach: bool = False,
        **params: Any,
    ) -> Job:
        """Enqueue one job. An attached request (detach=False) is withdrawn if this client
        goes away."""
        check_priority(priority)
        check_queue(queue)
        data = build_spec(prompt, max_new_tokens, params).to_bytes(self.max_spec_bytes)
        job_id = new_job_id()
        with self.mapped():
            self.ensure_queue(queue)
            self.limits.check_room(queue)
            name = self._enqueue.create(queue, priority, job_id, data, ephemeral=not detach)
        return Job(self, job_id, queue, priority, name, detach=detach, owned=True)

    def submit_many(
        self,
        specs: Iterable[str | Mapping[str, Any]],
        *,
        priority: str = defaults.PRIORITY,
        queue: str = defaults.QUEUE,
        max_new_tokens: int | None = None,
        detach: bool = True,
    ) -> list[Job]:
        """Enqueue many jobs with pipelined creates. Each spec is a prompt or a mapping with
        ``prompt`` and optional ``priority``, ``queue``, ``max_new_tokens`` and job parameters.
        Every spec is validated before anything is written."""
        prepared = [
            self._prepare(i, s, priority, queue, max_new_tokens) for i, s in enumerate(specs)
        ]
        with self.mapped():
            for q in {p[1] for p in prepared}:
                self.ensure_queue(q)
                self.limits.check_room(q, sum(1 for p in prepared if p[1] == q))
            names = self._enqueue.create_many(prepared, ephemeral=not detach)
        return [
            Job(self, jid, q, p, name, detach=detach, owned=True)
            for (jid, q, p, _), name in zip(prepared, names, strict=True)
        ]

    def _prepare(
        self,
        index: int,
        spec: str | Mapping[str, Any],
        priority: str,
        queue: str,
        max_new_tokens: int | None,
    ) -> tuple[str, str, str, bytes]:
        try:
            sub = parse_submission(
                spec,
                priority=priority,
                queue=queue,
                max_new_tokens=max_new_tokens,
                limit=self.max_spec_bytes,
            )
        except InvalidJob as exc:
            raise type(exc)(f"spec #{index}: {exc}") from None
        return new_job_id(), sub.queue, sub.priority, sub.data

    # -- reading -----------------------------------------------------------------------------

    def find_entry(self, queue: str, priority: str, job_id: str) -> str | None:
        """The entry name of a job in one priority, by scanning its children (O(depth))."""
        prefix = f"{job_id}-"
        try:
            children = self.zk.get_children(self.layout.pending(queue, priority))
        except NoNodeError:
            return None
        return next((c for c in children if c.startswith(prefix)), None)

    def job(self, job_id: str, queue: str | None = None) -> Job:
        """Find a job by id in one queue, or in every queue when ``queue`` is None."""
        check_job_id(job_id)
        with self.mapped():
            for q in [check_queue(queue)] if queue else self.queue_names():
                found = self._find_job(q, job_id)
                if found is not None:
                    return found
            dead = dead_result(self.dead(queue), job_id)
            if dead is not None:  # known only by its dead letter (its result is gone)
                return Job(self, job_id, dead.queue, dead.priority, result=dead)
        raise JobNotFound(f"no job {job_id}" + (f" in queue {queue!r}" if queue else ""))

    def _find_job(self, queue: str, job_id: str) -> Job | None:
        for priority in defaults.PRIORITIES:
            name = self.find_entry(queue, priority, job_id)
            if name is not None:
                return Job(self, job_id, queue, priority, name)
        try:
            data, _ = self.zk.get(self.layout.result(queue, job_id))
        except NoNodeError:
            return None
        record = Result.from_bytes(data, f"result of job {job_id} in queue {queue!r}")
        return Job(self, job_id, queue, record.priority)

    def queue_names(self) -> list[str]:
        with self.mapped():
            try:
                return sorted(self.zk.get_children(self.layout.queues()))
            except NoNodeError:
                return []

    def claim_of(self, queue: str, entry: str) -> ClaimBody | None:
        """The claim on a running entry (None while it is not running)."""
        with self.mapped():
            try:
                data, _ = self.zk.get(self.layout.claim(queue, entry))
            except NoNodeError:
                return None
        return ClaimBody.from_bytes(data, f"claim {queue}/{entry}")

    def _ordered_entries(self, queue: str) -> list[tuple[str, EntryName]]:
        """Every parseable entry of a queue in dispatch order, as (priority, name)."""
        calls = [
            (p, self.zk.get_children_async(self.layout.pending(queue, p)))
            for p in defaults.PRIORITIES
        ]
        out: list[tuple[str, EntryName]] = []
        for priority, call in calls:
            try:
                names = call.get()
            except NoNodeError:
                continue
            parsed = [_parse_or_none(n) for n in names]
            out.extend((priority, e) for e in sorted((e for e in parsed if e), key=_order))
        return out

    def _claimed(self, queue: str) -> set[str]:
        try:
            return set(self.zk.get_children(self.layout.claims(queue)))
        except NoNodeError:
            return set()

    def position(self, queue: str, entry: str) -> int | None:
        """1-based place among the queue's unclaimed entries in dispatch order."""
        with self.mapped():
            claimed = self._claimed(queue)
            waiting = [e.name for _, e in self._ordered_entries(queue) if e.name not in claimed]
        return waiting.index(entry) + 1 if entry in waiting else None

    def list(self, queue: str = defaults.QUEUE, limit: int | None = None) -> list[dict[str, Any]]:
        """Pending and running jobs of a queue in dispatch order."""
        check_queue(queue)
        with self.mapped():
            claimed = self._claimed(queue)
            entries = self._ordered_entries(queue)[:limit]
            stats = [self.zk.exists_async(self.layout.entry(queue, p, e.name)) for p, e in entries]
            claims = {
                e.name: self.zk.get_async(self.layout.claim(queue, e.name))
                for _, e in entries
                if e.name in claimed
            }
            rows, position = [], 0
            for (priority, entry), stat_call in zip(entries, stats, strict=True):
                stat = stat_call.get()
                if stat is None:
                    continue  # finished while we listed
                row = {
                    "id": entry.job_id,
                    "queue": queue,
                    "priority": priority,
                    "attempts": stat.version,
                    "submitted_at": stat.ctime / 1000,
                }
                if entry.name in claims:
                    row.update(state=RUNNING, worker=_claim_worker(claims[entry.name]))
                else:
                    position += 1
                    row.update(state=PENDING, position=position)
                rows.append(row)
            return rows

    def stats(self) -> dict[str, Any]:
        """Depth per queue and priority (running jobs included), running jobs, waiting slots,
        results and dead letters, and live workers; each number is one stat read."""
        with self.mapped():
            queues = {q: queue_stats(self.zk, self.layout, q) for q in self.queue_names()}
            workers = self.zk.exists(self.layout.workers())
            return {"queues": queues, "workers": workers.numChildren if workers else 0}

    def set_max_pending(self, queue: str, max_pending: int | None) -> None:
        """Limit a queue's waiting jobs (None: no limit); producers beyond it get QueueFull."""
        self.set_limits(queue, max_pending=max_pending)

    def set_limits(self, queue: str, **limits: int | None) -> QueueSettings:
        """Set ``max_pending`` and/or ``max_running`` (None removes one); returns them all."""
        check_queue(queue)
        with self.mapped():
            self.ensure_queue(queue)
            return self.limits.set(queue, **limits)

    def queues(self) -> builtins.list[dict[str, Any]]:
        """Every queue with the workers serving it, its limits and depth."""
        workers = self.workers()
        with self.mapped():
            return queue_table(self.zk, self.layout, self.queue_names(), workers)

    def delete_queue(self, queue: str, force: bool = False) -> dict[str, Any]:
        """Delete a queue (refused while jobs wait or run unless ``force``)."""
        check_queue(queue)
        with self.mapped():
            stats = delete_queue(self.zk, self.layout, queue, force=force)
        self._ready.discard(queue)
        return stats

    def dead(self, queue: str | None = None) -> builtins.list[dict[str, Any]]:
        """Dead letters (reason, raw entry data) of one queue or of all."""
        with self.mapped():
            return list_dead(
                self.zk, self.layout, [check_queue(queue)] if queue else self.queue_names()
            )

    def requeue(self, job_id: str | None = None, queue: str | None = None) -> builtins.list[Job]:
        """Enqueue dead-lettered jobs again (one by id, or all of them when ``job_id`` is None).
        Letters without a valid spec stay where they are (an error when asked for by id)."""
        letters = [x for x in self.dead(queue) if job_id is None or x.get("id") == job_id]
        if job_id is not None and not letters:
            raise JobNotFound(f"no dead letter for job {job_id}")
        jobs = []
        with self.mapped():
            for letter in letters:
                try:
                    name = requeue(self.zk, self.layout, letter)
                except InvalidJob:
                    if job_id is not None:
                        raise
                    continue
                jobs.append(Job(self, letter["id"], letter["queue"], letter["priority"], name))
        return jobs

    def workers(self) -> builtins.list[dict[str, Any]]:
        """Registered workers' records (see docs/PROTOCOL.md)."""
        with self.mapped():
            return read_records(self.zk, self.layout)

    def served_queues(self) -> set[str]:
        """Queues at least one registered worker serves."""
        served: set[str] = set()
        for record in self.workers():
            queues = record.get("queues") or [record.get("queue")]
            served.update(q for q in queues if isinstance(q, str))
        return served


def _order(entry: EntryName) -> int:
    return entry.order


def _parse_or_none(name: str) -> EntryName | None:
    try:
        return EntryName.parse(name)
    except InvalidJob:
        return None


def _claim_worker(call: Any) -> str | None:
    try:
        data, _ = call.get()
    except NoNodeError:
        return None
    try:
        return ClaimBody.from_bytes(data).worker
    except CorruptRecord:
        return "?"  # the listing shows the job as running; `zkq status` names the bad node
