"""The interpreter's thread switching in zkq's long-lived processes (a worker, ``zkq serve``).

Each runs several threads in one interpreter, and only one of them holds the GIL at a time: in a
worker, transformers' generation loop (in Python between torch's operations, most of each step
on a small model), the loop that claims jobs, kazoo's connection thread, the stream server and
the engine's output collector; in the gateway, the event loop and kazoo's threads. A thread that
wants the GIL while another runs Python waits for the holder to let go, at most the switch
interval: Python's default is 5 ms. A job's way from its entry to its first token crosses
threads a dozen times (a ZooKeeper reply read on kazoo's thread, handed to the claiming loop,
handed to the engine, its output to the collector, to the stream server...), so while the engine
is busy with the jobs claimed a moment earlier, a burst's later jobs paid up to that 5 ms at
each crossing: their claims came tens of milliseconds after the first ones.

``prompt_handoffs`` lowers the interval to ``SWITCH_INTERVAL``. A busy thread then gives the
GIL up more often, but only when another thread asks for it; the threads that ask hold it for
microseconds (they read a reply, set an event) and go back to waiting. The streaming benchmark
(``scripts.bench.streaming``) measured the change: see BENCHMARKS.md.
"""

from __future__ import annotations

import sys

#: Seconds a thread that wants the GIL waits at most for the one running Python to let go.
SWITCH_INTERVAL = 0.0005


def prompt_handoffs() -> None:
    """Lower the interpreter's switch interval to ``SWITCH_INTERVAL`` (never raise it: a
    process that set a shorter one keeps it). For the process's entry point, not a library."""
    if sys.getswitchinterval() > SWITCH_INTERVAL:
        sys.setswitchinterval(SWITCH_INTERVAL)
