"""Serving a Prometheus registry over HTTP (the worker's /metrics and ``zkq metrics``)."""

from __future__ import annotations

from wsgiref.simple_server import WSGIServer

from prometheus_client import CollectorRegistry, start_http_server

from zkqueue.errors import ConfigurationError


def serve_registry(registry: CollectorRegistry, port: int, addr: str) -> WSGIServer:
    """Serve ``registry`` on ``addr:port`` from a daemon thread (port 0: any free port, read it
    back from ``server.server_port``); stop it with ``server.shutdown()``. An address that
    cannot be bound (in use, not this host's, not an address) is a ConfigurationError."""
    try:
        server, _thread = start_http_server(port, addr, registry=registry)
    except OSError as exc:
        reason = exc.strerror or str(exc)
        raise ConfigurationError(f"cannot serve metrics on {addr}:{port}: {reason}") from None
    return server
