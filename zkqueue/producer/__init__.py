"""The producer: the blocking ``Client`` and the asyncio ``AsyncClient`` (one constructor,
``clientbase``), job handles and finding a job by id, creating entries (one at a time and in
bulk), listing a queue, and the queue and dead-letter administration the clients offer.

May import: ``zkqueue.protocol``, ``zkqueue.plumbing``, ``zkqueue.errors``, ``zkqueue.defaults``.
"""
