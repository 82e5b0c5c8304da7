"""Every scenario by its short name, in the order ``python -m scripts.chaos`` runs them."""

from __future__ import annotations

from collections.abc import Callable

from scripts.chaos.audit import ChaosReport
from scripts.chaos.crashes import hung_worker, kill_workers, stop_worker
from scripts.chaos.garbage import garbage_entries
from scripts.chaos.outages import ensemble_failover, zookeeper_restart
from scripts.chaos.preempt import narrowed_preemption_storm, preemption_storm

SCENARIOS: dict[str, Callable[..., ChaosReport]] = {
    "kill-9": kill_workers,
    "sigstop": stop_worker,
    "zk-restart": zookeeper_restart,
    "ensemble": ensemble_failover,
    "hung": hung_worker,
    "garbage": garbage_entries,
    "preempt": preemption_storm,
    "preempt-narrow": narrowed_preemption_storm,
}
