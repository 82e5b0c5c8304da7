"""The protocol: the znode layout and its revision (with ``zkq migrate`` between revisions), the
records every client reads and writes (the job spec, claim bodies, results, dead letters, the
worker registration, a queue's settings), the job states, the arrival signal, the counts read
from node stats, and every state transition of an entry, each one ZooKeeper multi
(``claims``). A program in another language that follows docs/PROTOCOL.md writes what these
modules write.

May import: ``zkqueue.plumbing``, ``zkqueue.errors`` and ``zkqueue.defaults``. A worker's place in
a line is used here through a structural type (``claims.Line``), not by importing dispatch.
"""
