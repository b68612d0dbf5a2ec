"""Running the server: start the engine, listen, and on SIGINT/SIGTERM stop taking
requests, stop the workers, exit."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket

from aiohttp import web

from dilaserve.engine import Engine

from .app import Server, ServerSettings

log = logging.getLogger(__name__)


async def serve(
    engine: Engine,
    settings: ServerSettings,
    sock: socket.socket,
    started: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Starts `engine`, serves it on the bound socket `sock` until `stop` is set or the
    process gets SIGINT/SIGTERM, then stops the engine."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)  # only possible on the main thread
    async with engine:
        runner = web.AppRunner(Server(engine, settings).app(), handler_cancellation=True)
        await runner.setup()
        await web.SockSite(runner, sock).start()
        host, port = sock.getsockname()[:2]
        log.info("serving %s on http://%s:%d", settings.model_name, host, port)
        if started is not None:
            started.set()
        try:
            await stop.wait()
        finally:
            log.info("shutting down")
            await runner.cleanup()


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0 picks a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    return sock
