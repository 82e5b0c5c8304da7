"""Operations: the elected janitor (leases, expiry of results, queue timeouts, dead letters),
the Prometheus exporter of cluster-wide figures and its HTTP server, and ``zkq top``'s reads
and drawing.

May import: ``zkqueue.producer``, ``zkqueue.dispatch``, ``zkqueue.protocol``,
``zkqueue.plumbing``, ``zkqueue.errors``, ``zkqueue.defaults``.
"""
