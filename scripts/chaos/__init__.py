"""Fault injection: scenarios that break real ZooKeeper servers and real worker processes while
jobs flow, then audit the queue. The promise under test: every job ends with exactly one result
record (or is withdrawn by design), whatever crashes, hangs, failovers or garbage came first.

Each scenario starts what it needs (ZooKeeper from Debian's package unless it is given one,
``zkq worker`` subprocesses, producers), injects one kind of fault, waits (bounded) for the queue
to drain, and returns a ChaosReport. Everything listens on loopback and everything it started is
torn down in ``finally``. tests/test_chaos.py runs small sizes; ``python -m scripts.chaos`` runs
larger ones and writes RELIABILITY.md.

    stage.py       the scenario's world (ZooKeeper, worker processes) and bounded waits
    load.py        producers and attached requests, helpers the scenarios share
    inprocess.py   an in-process worker with a hung runner, the janitor
    audit.py       the report and the audit of the queue afterwards
    crashes.py     kill -9, SIGSTOP, a hung runner
    outages.py     ZooKeeper restarted, ensemble failover
    garbage.py     malformed entries
    scenarios.py   every scenario by its short name
    __main__.py    the command line: runs them and writes RELIABILITY.md
"""
