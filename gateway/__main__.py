"""``python -m gateway [OPTIONS]``: the same as ``zkq serve [OPTIONS]``."""

from __future__ import annotations

from gateway.commands import serve

serve(prog_name="python -m gateway")
