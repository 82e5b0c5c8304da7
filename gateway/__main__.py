"""``python -m gateway [OPTIONS]``: the same as ``zkq serve [OPTIONS]``."""

from __future__ import annotations

from gateway.commands import serve
from zkqueue.cli.common import connection_options

# The same connection options ``zkq serve`` has (zkq's group adds them to its commands).
connection_options(serve)(prog_name="python -m gateway")
