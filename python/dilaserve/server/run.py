"""Running the server: start the engine, listen, and on SIGINT/SIGTERM stop taking
requests, stop the workers, exit."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import socket
from collections.abc import AsyncIterator

from aiohttp import web

from dilaserve.engine import Engine, EngineClient, EngineStoppedError

from .app import Server, ServerSettings
from .connections import ConnectionLimits

log = logging.getLogger(__name__)


async def serve(
    engine: Engine | EngineClient,
    settings: ServerSettings,
    sock: socket.socket,
    started: asyncio.Event | None = None,
    stop: asyncio.Event | None = None,
) -> None:
    """Starts `engine`, serves it on the bound socket `sock` until `stop` is set or the
    process gets SIGINT/SIGTERM, then stops the engine. A core process that ends on its
    own stops the server too, raising `EngineStoppedError`."""
    stop = stop or asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGINT, signal.SIGTERM):
        with contextlib.suppress(NotImplementedError, RuntimeError, ValueError):
            loop.add_signal_handler(sig, stop.set)  # only possible on the main thread
    async with engine:
        runner = web.AppRunner(
            Server(engine, settings).app(),
            handler_cancellation=True,
            keepalive_timeout=settings.keepalive_timeout_s,
        )
        await runner.setup()
        limits = ConnectionLimits(settings.max_connections, settings.read_timeout_s)
        await LimitedSite(runner, sock, limits).start()
        host, port = sock.getsockname()[:2]
        log.info("serving %s on http://%s:%d", settings.model_name, host, port)
        if started is not None:
            started.set()
        try:
            await _until_stopped(engine, stop)
        finally:
            log.info("shutting down")
            await runner.cleanup()


async def _until_stopped(engine: Engine | EngineClient, stop: asyncio.Event) -> None:
    """Returns when `stop` is set; raises `EngineStoppedError` if a core process ends
    first (a server without its engine must not look alive to a load balancer)."""
    if not isinstance(engine, EngineClient):
        await stop.wait()
        return
    stopping = asyncio.ensure_future(stop.wait())
    try:
        await asyncio.wait({stopping, engine.exited}, return_when=asyncio.FIRST_COMPLETED)
    finally:
        stopping.cancel()
    if not stop.is_set():
        raise EngineStoppedError("the engine core exited; the server stops")


@contextlib.asynccontextmanager
async def serving(engine: Engine | EngineClient, settings: ServerSettings) -> AsyncIterator[str]:
    """Starts `engine` and serves it on a free loopback port for the block; yields the
    base URL, and stops both when the block ends."""
    sock = bind("127.0.0.1", 0)
    started, stop = asyncio.Event(), asyncio.Event()
    task = asyncio.ensure_future(serve(engine, settings, sock, started=started, stop=stop))
    waiting = asyncio.ensure_future(started.wait())
    await asyncio.wait({task, waiting}, return_when=asyncio.FIRST_COMPLETED)
    if task.done():  # the engine failed to start
        waiting.cancel()
        await task
    try:
        yield f"http://127.0.0.1:{sock.getsockname()[1]}"
    finally:
        stop.set()
        await task


class LimitedSite(web.SockSite):
    """aiohttp's site on a bound socket, each connection behind `ConnectionLimits`."""

    def __init__(self, runner: web.AppRunner, sock: socket.socket, limits: ConnectionLimits):
        super().__init__(runner, sock)
        self.limits = limits

    async def start(self) -> None:
        await web.BaseSite.start(self)  # registers the site with its runner
        server = self._runner.server
        assert server is not None
        self._server = await asyncio.get_running_loop().create_server(
            self.limits.factory(server), sock=self._sock
        )


def bind(host: str, port: int) -> socket.socket:
    """A listening socket (port 0 picks a free one)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    sock = socket.socket(family, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind((host, port))
    sock.listen(1024)
    return sock
