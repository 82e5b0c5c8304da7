"""Dispatch, the part in the library: the fair line of idle workers (each watches only its
predecessor) and the head's view of the pending entries (what it may claim next, in priority
order, and the watches that wake it). The worker's head turn, admission and preemption build on
these in ``workers/``.

May import: ``zkqueue.protocol``, ``zkqueue.plumbing``, ``zkqueue.errors``, ``zkqueue.defaults``.
"""
