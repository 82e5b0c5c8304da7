"""zkq's OpenAI-compatible HTTP gateway (``zkq serve``): an app built on the zkqueue library,
which never imports it. Needs the ``serve`` extra (starlette, uvicorn)."""
