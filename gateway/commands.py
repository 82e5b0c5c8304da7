"""``zkq serve``: run the OpenAI-compatible gateway (added to ``zkq`` through the
``zkq.commands`` entry points; also ``python -m gateway``).

Connection options may be given here or to the ``zkq`` group (``zkq --zk H serve``); here they
win, then the group's, then the ``ZKQ_*`` environment, then the defaults
(``zkqueue.cli.common``, as for every command: ``zkq`` adds them to ``serve``, and
``python -m gateway`` adds them too). This module does not import zkq's command line at import
time: that would import ``zkq``'s plugins, this one among them, while it is being imported.
"""

from __future__ import annotations

import asyncio
import contextlib
import gc
import math
import os
import signal
import socket
import sys
import threading
from collections.abc import Callable, Iterator
from typing import Any

import click

from gateway.config import GatewayConfig, load
from zkqueue.errors import ConfigurationError, ZkqError
from zkqueue.plumbing.logs import configure as configure_logging
from zkqueue.producer.aio import AsyncClient


class _Seconds(click.ParamType):
    """A finite number of seconds, above 0 (``zero``: 0 allowed too)."""

    name = "SECONDS"

    def __init__(self, zero: bool = False) -> None:
        self.zero = zero

    def convert(self, value: Any, param: click.Parameter | None, ctx: click.Context | None) -> Any:
        try:
            seconds = float(value)
        except (TypeError, ValueError):
            self.fail(f"{value!r} is not a number of seconds", param, ctx)
        if not math.isfinite(seconds) or seconds < 0 or (seconds == 0 and not self.zero):
            self.fail(f"{value!r} is not a finite number of seconds above 0", param, ctx)
        return seconds


@click.command(context_settings={"help_option_names": ["-h", "--help"]})
@click.option(
    "--config",
    "config_path",
    envvar="ZKQ_SERVE_CONFIG",
    default=None,
    help="TOML file: model -> queue mapping, API keys, defaults (docs/GATEWAY.md).",
)
@click.option("--host", envvar="ZKQ_SERVE_HOST", default="127.0.0.1", show_default=True)
@click.option(
    "--port",
    envvar="ZKQ_SERVE_PORT",
    type=click.IntRange(1, 65535),
    default=8000,
    show_default=True,
)
@click.option(
    "--drain-timeout",
    type=_Seconds(zero=True),
    default=30.0,
    show_default=True,
    help="On SIGTERM, seconds open requests may still finish.",
)
@click.option(
    "--log-level",
    default=None,
    type=click.Choice(["DEBUG", "INFO", "WARNING", "ERROR"], case_sensitive=False),
)
@click.pass_context
def serve(
    ctx: click.Context,
    config_path: str | None,
    host: str,
    port: int,
    drain_timeout: float,
    log_level: str | None,
) -> None:
    """Serve OpenAI's completion API in front of zkq's queues.

    \b
    Examples:
      zkq serve --port 8000 --config /etc/zkq/serve.toml
      curl localhost:8000/v1/chat/completions -H 'X-Priority: high' \\
        -H 'Authorization: Bearer KEY' \\
        -d '{"model": "default", "messages": [{"role": "user", "content": "Hi"}]}'
      (KEY: one of the config's [[keys]]; without keys no header is needed)
    """
    if log_level is not None or ctx.parent is None:
        configure_logging(log_level or os.environ.get("ZKQ_LOG_LEVEL", "WARNING"))
    try:
        config = load(config_path)
        from zkqueue.cli.common import connection

        settings = connection(ctx)
        client = AsyncClient(hosts=settings.pop("zk"), **settings)
        with asyncio.Runner(loop_factory=_loop_factory()) as runner:
            job = run(
                client,
                config,
                host=host,
                port=port,
                drain_timeout=drain_timeout,
                started=lambda _: click.echo(
                    f"zkq serve: listening on {_where(host, port)}", err=True
                ),
                freeze=True,
            )
            runner.run(job)
    except ZkqError as exc:
        click.echo(f"zkq: {exc}", err=True)
        sys.exit(exc.exit_code)


def _freeze() -> None:
    """What start-up made (the imported libraries, the client, the app) lives as long as the
    server: out of the collector's full passes, each a pause of every request in flight (20-30
    ms on the gateway of the streaming benchmark without this, 4-13 with it)."""
    gc.collect()
    gc.freeze()


def _loop_factory() -> Callable[[], asyncio.AbstractEventLoop] | None:
    """uvloop's event loop where it is installed (the serve extra has it), else asyncio's."""
    try:
        import uvloop
    except ImportError:
        return None
    factory: Callable[[], asyncio.AbstractEventLoop] = uvloop.new_event_loop
    return factory


async def run(
    client: AsyncClient,
    config: GatewayConfig,
    *,
    host: str = "127.0.0.1",
    port: int = 8000,
    drain_timeout: float = 30.0,
    sock: socket.socket | None = None,
    started: Any = None,
    freeze: bool = False,
) -> None:
    """Connect, then serve until SIGTERM/SIGINT (or ``server.should_exit``). ``sock``: an
    already bound socket (tests); ``started(server)`` is called once it listens; ``freeze``
    (the ``zkq serve`` process, not a test's): what start-up made is kept out of the garbage
    collector's passes (``_freeze``)."""
    import uvicorn

    from gateway.app import create_app

    class Server(uvicorn.Server):
        """uvicorn's server, ending with exit code 0 after a SIGTERM drain (uvicorn raises the
        signal again once drained, which systemd and shells report as a kill)."""

        @contextlib.contextmanager
        def capture_signals(self) -> Iterator[None]:
            if threading.current_thread() is not threading.main_thread():
                yield
                return
            loop = asyncio.get_running_loop()
            for sig in (signal.SIGINT, signal.SIGTERM):
                loop.add_signal_handler(sig, self._stop)
            try:
                yield
            finally:
                for sig in (signal.SIGINT, signal.SIGTERM):
                    loop.remove_signal_handler(sig)

        def _stop(self) -> None:
            # A second signal stops at once, without waiting for open requests.
            self.force_exit = self.should_exit
            self.should_exit = True

    async with client:
        app = create_app(client, config, on_started=_freeze if freeze else None)
        server = Server(
            uvicorn.Config(
                app,
                host=host,
                port=port,
                lifespan="on",
                access_log=False,
                log_config=None,
                timeout_graceful_shutdown=math.ceil(drain_timeout),
            )
        )
        listening = [sock] if sock is not None else _listen(host, port)
        if started is not None:
            started(server)
        await server.serve(sockets=listening)


def _listen(host: str, port: int) -> list[socket.socket]:
    """The listening sockets, one per address ``host`` names (as uvicorn binds them: ``''`` is
    every interface, ``localhost`` may be 127.0.0.1 and ::1), bound here so that a port in use
    is a configuration error (exit 7, one line), as for ``zkq metrics``."""
    sockets: list[socket.socket] = []
    try:
        infos = socket.getaddrinfo(
            host or None, port, type=socket.SOCK_STREAM, flags=socket.AI_PASSIVE
        )
        for family, *_, address in dict.fromkeys(infos):  # the same address once
            sock = socket.create_server(address, family=family)
            # Accepted connections inherit it: a stream's chunk goes out at once, never held
            # for the client's delayed acknowledgement of the chunk before.
            sock.setsockopt(socket.IPPROTO_TCP, socket.TCP_NODELAY, 1)
            sockets.append(sock)
    except OSError as exc:
        for sock in sockets:
            sock.close()
        raise ConfigurationError(f"cannot listen on {host}:{port}: {exc.strerror or exc}") from None
    return sockets


def _where(host: str, port: int) -> str:
    return f"[{host}]:{port}" if ":" in host else f"{host or '*'}:{port}"
