"""A worker's own claim nodes outside the transitions: renewing leases (and streaming output),
sweeping what a lost reply left behind, dropping a claim on an entry that is gone."""

from __future__ import annotations

import contextlib
from collections.abc import Sequence

from kazoo.client import KazooClient
from kazoo.exceptions import NoNodeError
from kazoo.protocol.states import ZnodeStat

from zkqueue.errors import CorruptRecord
from zkqueue.layout import Layout, child
from zkqueue.line import Line
from zkqueue.nodes import own_untracked
from zkqueue.records import Claim
from zkqueue.result import Result


class ClaimNodes:
    """Plain writes on one worker's claims (``zkqueue.claims.Claims`` adds the multis)."""

    zk: KazooClient
    layout: Layout
    queue: str
    worker_id: str

    def renew(self, claims: list[Claim]) -> list[Claim]:
        """Renew the leases (a write bumps the claim's server-side mtime, which the janitor
        reads). Returns the claims that are gone: reclaimed, or lost with the session."""
        calls = [
            (c, self.zk.set_async(self.layout.claim(self.queue, c.id), c.body.to_bytes()))
            for c in claims
        ]
        lost = []
        for claim, call in calls:
            try:
                call.get()
            except NoNodeError:
                lost.append(claim)
        return lost

    def set_partial(self, claim: Claim, text: str) -> None:
        """Put a streaming job's output so far into its claim's data (written by the next
        renew(), so every write also renews the lease)."""
        claim.body.partial = text

    def sweep(self, lines: Sequence[Line], held: set[str]) -> list[str]:
        """Delete this session's claims on job ids not in ``held`` and its places in the
        ``lines`` other than each one's ``node``: a claim or join that committed while its
        reply was lost with the connection. Left alone, a place nobody holds heads its line
        and stalls it, and a claim nobody runs holds its job until the lease runs out. Returns
        what went."""
        claims = self.layout.claims(self.queue)
        stray = [child(claims, n) for n in own_untracked(self.zk, claims, held)]
        for line in lines:
            places = own_untracked(self.zk, line.directory, {line.node} if line.node else set())
            stray += [child(line.directory, n) for n in places]
        for path in stray:
            with contextlib.suppress(NoNodeError):
                self.zk.delete(path)
        return stray

    def drop(self, claim: Claim) -> None:
        """Remove our claim on an entry that is gone (cancelled or withdrawn), if still ours."""
        path = self.layout.claim(self.queue, claim.id)
        try:
            stat = self.zk.exists(path)
            if stat is not None and stat.ephemeralOwner == self.zk.client_id[0]:
                self.zk.delete(path, version=stat.version)
        except NoNodeError:
            pass

    def failed_completion(
        self, claim: Claim, finished_at: float
    ) -> tuple[str, tuple[bytes, ZnodeStat] | None]:
        """Why a completion of ``claim`` failed, in one round trip:
        - ``ours``: it committed, the reply was lost, and the retry found the result it wrote
          (this worker's, with this claim's token and ``finished_at``);
        - ``gone``: the entry was cancelled or withdrawn while the claim stayed ours;
        - ``duplicate``: the claim and the entry (at its token) are ours, but the id already
          has another result: a producer reused it. The entry's data and stat come with it;
        - ``lost``: the claim went (reclaimed, or lost with the session)."""
        entry = self.zk.get_async(self.layout.entry(self.queue, claim.priority, claim.entry.name))
        mine = self.zk.exists_async(self.layout.claim(self.queue, claim.id))
        result = self.zk.get_async(self.layout.result(self.queue, claim.id))
        try:
            record = Result.from_bytes(result.get()[0], f"result of job {claim.id}")
        except (NoNodeError, CorruptRecord):
            record = None
        mark = (self.worker_id, claim.token, finished_at)
        if record is not None and (record.worker, record.attempts, record.finished_at) == mark:
            return "ours", None
        stat = mine.get()
        held = stat is not None and stat.ephemeralOwner == self.zk.client_id[0]
        try:
            data, entry_stat = entry.get()
        except NoNodeError:
            return ("gone" if held else "lost"), None
        if held and record is not None and entry_stat.version == claim.token:
            return "duplicate", (data, entry_stat)
        return "lost", None
