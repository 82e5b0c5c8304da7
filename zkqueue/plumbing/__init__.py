"""The ZooKeeper plumbing: connecting (settings, TLS, digest auth, errors mapped at the boundary),
zkq's kazoo handler, removing watches, per-call deadlines, byte sizes and job-scoped log lines.
Nothing here knows what a queue or a job is.

May import: the standard library, kazoo, ``zkqueue.errors`` and ``zkqueue.defaults``.
"""
