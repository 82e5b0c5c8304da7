"""The producer API: submit jobs, find them, list the queue, read stats and the worker registry."""

from __future__ import annotations

import builtins
import contextlib
import functools
from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from contextlib import contextmanager
from typing import Any, Unpack

from kazoo.exceptions import NoNodeError

from zkqueue import defaults
from zkqueue.errors import InvalidJob, JobNotFound
from zkqueue.plumbing.connection import (
    close,
    connect,
    mapped_errors,
    read_through_loss,
)
from zkqueue.producer import listing
from zkqueue.producer.clientbase import ClientBase, ClientOptions
from zkqueue.producer.deadletters import dead_result, list_dead, purge, requeue
from zkqueue.producer.enqueue import Enqueuer
from zkqueue.producer.job import Job, claimed_entry, find_job, known_jobs
from zkqueue.producer.queues import delete_queue, queue_stats, queue_table, serving_workers
from zkqueue.protocol import counts, revision
from zkqueue.protocol.layout import (
    EntryName,
    check_job_id,
    check_new_job_id,
    check_priority,
    check_queue,
    check_tenant,
    is_generated_id,
    lane,
    lane_parts,
    new_job_id,
)
from zkqueue.protocol.limits import Limits, QueueSettings
from zkqueue.protocol.records import ClaimBody
from zkqueue.protocol.registry import read_records
from zkqueue.protocol.spec import build_spec, parse_submission


class Client(ClientBase):
    """A connection to one zkq root. Use as a context manager, or call start() and close().
    ``Client(hosts, root, **options)``: the options are
    ``zkqueue.producer.clientbase.ClientOptions``."""

    def __init__(
        self,
        hosts: str = defaults.HOSTS,
        root: str = defaults.ROOT,
        **options: Unpack[ClientOptions],
    ) -> None:
        super().__init__(hosts, root, **options)
        self._enqueue = Enqueuer(self, signal_limit=self.signal_spec_bytes)
        #: Whether this client has checked the root's protocol revision (once per client).
        self._protocol_checked = False
        self._limits: Limits | None = None

    # -- lifecycle ---------------------------------------------------------------------------

    def start(self) -> Client:
        if self._zk is None:
            self._zk = connect(self.settings)
        self._closed = False
        return self

    def close(self) -> None:
        http = self._closing_http()
        if http is not None:
            http.close()
        if self._zk is not None and self._owns_zk:
            close(self._zk)
            self._zk = None

    def __enter__(self) -> Client:
        return self.start()

    def __exit__(self, *exc: object) -> None:
        self.close()

    @property
    def limits(self) -> Limits:
        if self._limits is None:
            self._limits = Limits(self.zk, self.layout)
        return self._limits

    @contextmanager
    def mapped(self) -> Iterator[None]:
        with mapped_errors(self.settings.hosts):
            yield

    def check_protocol(self) -> None:
        """Refuse a root written by another layout version (once per client)."""
        if not self._protocol_checked:
            revision.ensure(self.zk, self.layout)
            self._protocol_checked = True

    def ensure_queue(self, queue: str) -> None:
        """Create the queue's directories once per client (idempotent; one read when the
        queue is complete: its last directory exists)."""
        if queue in self._ready:
            return
        self.check_protocol()
        revision.ensure_dirs(self.zk, self.layout, queue)
        self._ready.add(queue)

    # -- producing ---------------------------------------------------------------------------

    def submit(
        self,
        prompt: str,
        priority: str = defaults.PRIORITY,
        queue: str = defaults.QUEUE,
        max_new_tokens: int | None = None,
        detach: bool = False,
        keep_result: bool = False,
        tenant: str | None = None,
        **params: Any,
    ) -> Job:
        """Enqueue one job. An attached request (detach=False) is withdrawn if this client
        goes away, and its result is removed once read (unless ``keep_result``). A ``job_id=``
        that is already pending, running or finished in the queue is not enqueued again: the
        existing job is returned, with ``existing`` set. ``tenant``: who the job is for (fair
        share inside its priority, ``zkqueue.dispatch.share``; None: the default tenant)."""
        job_id: str | None = params.pop("job_id", None)
        check_priority(priority)
        check_queue(queue)
        if tenant is not None:
            check_tenant(tenant)
        data = build_spec(prompt, max_new_tokens, params).to_bytes(self.max_spec_bytes)
        if job_id is not None:
            check_new_job_id(job_id)
        with self.mapped():
            found = read_through_loss(
                self.zk,
                self.settings,
                lambda: self._before_submit(queue, job_id, tenant),
                self.CHECKING,
            )
            if found is not None:
                found.existing = True
                return found
            job_id = job_id or new_job_id()
            job = Job(self, job_id, queue, priority, detach=detach, owned=True, tenant=tenant)
            job.keep_result = keep_result
            if not detach:
                job.watch_early()  # its caller waits: in the create's round trip
            try:
                job.entry = self._enqueue.create(
                    queue, job.lane, job_id, data, ephemeral=not detach
                )
            except BaseException:
                job.unwatch()
                raise
        return job

    def _before_submit(self, queue: str, job_id: str | None, tenant: str | None) -> Job | None:
        """The reads before a create (all safe to repeat after a lost connection): the
        queue's directories, a chosen id already there, the queue's room."""
        self.ensure_queue(queue)
        if job_id is not None:
            found = self.find_job(queue, job_id)
            if found is not None:
                return found
        self.limits.check_room(queue, tenant=tenant)
        return None

    def submit_many(
        self,
        specs: Iterable[str | Mapping[str, Any]],
        *,
        priority: str = defaults.PRIORITY,
        queue: str = defaults.QUEUE,
        max_new_tokens: int | None = None,
        detach: bool = True,
        tenant: str | None = None,
    ) -> list[Job]:
        """Enqueue many jobs with pipelined creates, each a prompt or a mapping with ``prompt``
        and optional ``priority``, ``queue``, ``max_new_tokens``, ``job_id`` and job parameters,
        all validated first. A ``job_id`` already there (or given twice) is not enqueued again:
        its job comes back with ``existing`` set, so a batch can be submitted again safely.
        Every job belongs to ``tenant`` (None: the default tenant) unless its mapping names
        another (``"tenant"``)."""
        if tenant is not None:
            check_tenant(tenant)
        prepared = [
            self._prepare(i, s, priority, queue, max_new_tokens, tenant)
            for i, s in enumerate(specs)
        ]
        # The ids a submitter chose (zkq's own start with "_", which no submitter may use).
        chosen = {(q, jid) for jid, q, _, _ in prepared if not is_generated_id(jid)}
        firsts = {(p[1], p[0]): p for p in reversed(prepared)}  # an id given twice: once
        with self.mapped():
            known = read_through_loss(
                self.zk, self.settings, lambda: self._before_many(prepared, chosen), self.CHECKING
            )
            fresh = [p for p in prepared if firsts[p[1], p[0]] is p and (p[1], p[0]) not in known]
            read_through_loss(
                self.zk, self.settings, lambda: self._check_room_many(fresh), self.CHECKING
            )
            names = self._enqueue.create_many(fresh, ephemeral=not detach)
        made = {
            (q, jid): Job(self, jid, q, lane_parts(p)[0], name, detach=detach, owned=True)
            for (jid, q, p, _), name in zip(fresh, names, strict=True)
        }
        return [known.get((q, jid)) or made[q, jid] for jid, q, _, _ in prepared]

    def _before_many(
        self, prepared: list[tuple[str, str, str, bytes]], chosen: set[tuple[str, str]]
    ) -> dict[tuple[str, str], Job]:
        for q in {p[1] for p in prepared}:
            self.ensure_queue(q)
        return known_jobs(self, chosen)

    def _check_room_many(self, fresh: list[tuple[str, str, str, bytes]]) -> None:
        # Every lane's tail before any create: a tenant refused its new lane (the lane cap)
        # refuses the whole batch, not the chunks after those that went in.
        for q, path in sorted({(p[1], p[2]) for p in fresh}):
            self._enqueue.tail(q, path)
        for q in {p[1] for p in fresh}:
            adding = Counter[str | None](lane_parts(p[2])[1] for p in fresh if p[1] == q)
            self.limits.check_room_many(q, adding)

    def _prepare(
        self,
        index: int,
        spec: str | Mapping[str, Any],
        priority: str,
        queue: str,
        max_new_tokens: int | None,
        tenant: str | None = None,
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
        whose = sub.tenant if sub.tenant is not None else tenant
        return sub.job_id or new_job_id(), sub.queue, lane(sub.priority, whose), sub.data

    # -- reading -----------------------------------------------------------------------------

    def find_entry(self, queue: str, priority: str, job_id: str) -> str | None:
        """The entry name (``[@<tenant>/]<bucket>/<id>-<seq>``) of a job in one lane (a
        priority, or a tenant's lane of it): a running job's from its claim, else by listing
        the lane's buckets newest first."""
        running = claimed_entry(self, queue, job_id)
        if running is not None:
            prio, _, name = running.partition("/")
            with contextlib.suppress(InvalidJob):
                if lane(prio, EntryName.parse(name).tenant) == priority:
                    return name
        return counts.find(self.zk, self.layout, queue, priority, job_id)

    def find_job(self, queue: str, job_id: str) -> Job | None:
        """A job by id in one queue: its result, its claim (running) or its entry."""
        self.check_protocol()
        return find_job(self, queue, job_id)

    def job(self, job_id: str, queue: str | None = None) -> Job:
        """Find a job by id in one queue, or in every queue when ``queue`` is None."""
        check_job_id(job_id)
        with self.mapped():
            for q in [check_queue(queue)] if queue else self.queue_names():
                found = self.find_job(q, job_id)
                if found is not None:
                    return found
            dead = dead_result(self.dead(queue), job_id)
            if dead is not None:  # known only by its dead letter (its result is gone)
                return Job.ended(self, job_id, dead.queue, dead.priority, dead)
        raise JobNotFound(f"no job {job_id}" + (f" in queue {queue!r}" if queue else ""))

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

    def position(self, queue: str, entry: str) -> int | None:
        """About the 1-based place among the queue's unclaimed entries (1 = next)."""
        with self.mapped():
            return listing.position(self.zk, self.layout, queue, entry)

    def start_estimate(self, queue: str, position: int) -> float | None:
        """Seconds until the job at ``position`` (1 = next) may start, from the rate at which
        the queue's workers finished jobs over the last minute (their registrations' ``rate``);
        None when they finished none. An estimate: more urgent jobs arriving push it back."""
        rate = sum(float(w.get("rate") or 0.0) for w in self.workers() if w.get("queue") == queue)
        return round(position / rate, 1) if rate > 0 else None

    def list(self, queue: str = defaults.QUEUE, limit: int | None = None) -> list[dict[str, Any]]:
        """Pending and running jobs of a queue, at most ``limit`` (None: all), listing one
        bucket (~1,000 entries) at a time: priority by priority, and in each lane by lane (the
        default tenant's, then each tenant's by name; the head takes between them by fair
        share). A pending job's ``position`` is the one ``Job.info()`` gives."""
        check_queue(queue)
        with self.mapped():
            self.check_protocol()
            return listing.list_jobs(self.zk, self.layout, queue, limit)

    def stats(self) -> dict[str, Any]:
        """Depth per queue and priority (running jobs included), running jobs, waiting slots,
        results and dead letters, and live workers; each number is one stat read."""
        with self.mapped():
            self.check_protocol()
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

    def purge_dead(self, queue: str | None = None, older_than: float | None = None) -> int:
        """Delete dead letters of one queue or of all (those older than ``older_than`` s)."""
        with self.mapped():
            queues = [check_queue(queue)] if queue else self.queue_names()
            return sum(purge(self.zk, self.layout, q, older_than=older_than) for q in queues)

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
            read = functools.partial(read_records, self.zk, self.layout)
            return read_through_loss(self.zk, self.settings, read, "reading workers")

    def served_queues(self) -> set[str]:
        """Queues at least one registered worker serves."""
        return set(serving_workers(self.workers()))
