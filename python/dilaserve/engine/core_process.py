"""The engine core in its own process (`EngineClient` starts it): an `Engine` that sees
token ids only, its scheduler and workers, talking to its front end over one ZeroMQ PAIR
socket (`core_messages`).

Request events leave as they are decided, gathered into one `Outputs` frame per turn of
the loop (a step report's updates and finishes travel together). The core exits when told
(`Stop`), on SIGTERM, or when its front end's process is gone; it ignores SIGINT, which a
terminal sends the whole process group: the front end decides when to stop.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import pickle
import signal
import sys
from collections.abc import Callable

import zmq

from .config import EngineConfig, GenerationParams
from .core_messages import (
    Admitted,
    Cancel,
    Failure,
    Finish,
    FrontEndMessage,
    Outputs,
    Refused,
    Started,
    StartFailed,
    StatsQuery,
    StatsReply,
    StatusUpdate,
    Stop,
    Submit,
    encoder,
    front_end_decoder,
)
from .engine import Engine
from .errors import EngineError, UnknownRequestError
from .launcher import Launcher
from .requests import RequestStats, TrackedRequest
from .transport import SocketPump

log = logging.getLogger(__name__)

#: How often the core sends its status (what `/ready`, `/v1/cluster` and `/metrics` read)
#: and checks that its front end is alive.
STATUS_INTERVAL_S = 0.25


def main() -> None:
    """The core process's entry point: its arguments arrive pickled on standard input
    (`EngineClient.start`)."""
    run_core(*pickle.load(sys.stdin.buffer))


def run_core(
    config: EngineConfig,
    launcher: Callable[[], Launcher | None] | None,
    endpoint: str,
    log_level: int,
) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(CoreServer(config, launcher() if launcher else None, endpoint).run())


class ForwardedDelivery:
    """Gathers request events and sends them as one `Outputs` frame per loop turn."""

    def __init__(self, send: Callable[[object], None]) -> None:
        self._send = send
        self._outputs = Outputs([], [], [])
        self._pending = False

    def update(self, req: TrackedRequest, ids: list[int]) -> None:
        self._outputs.updates.append((req.id, ids))
        self._flush_soon()

    def finish(self, req: TrackedRequest, ids: list[int], reason: str, stats: RequestStats) -> None:
        self._outputs.finished.append(Finish(req.id, ids, reason, stats))
        self._flush_soon()

    def fail(self, req: TrackedRequest, error: BaseException) -> None:
        self._outputs.failed.append(Failure(req.id, type(error).__name__, str(error)))
        self._flush_soon()

    def _flush_soon(self) -> None:
        if not self._pending:
            self._pending = True
            asyncio.get_running_loop().call_soon(self.flush)

    def flush(self) -> None:
        outputs, self._outputs, self._pending = self._outputs, Outputs([], [], []), False
        if outputs.updates or outputs.finished or outputs.failed:
            self._send(outputs)


class CoreServer:
    def __init__(self, config: EngineConfig, launcher: Launcher | None, endpoint: str) -> None:
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PAIR)
        self._socket.setsockopt(zmq.LINGER, 1000)  # the last frames reach the front end
        self._socket.setsockopt(zmq.SNDHWM, 0)  # a busy front end delays frames, loses none
        self._socket.connect(endpoint)
        self._pump = SocketPump(self._socket, self._on_frames)
        self._delivery = ForwardedDelivery(self._send)
        self.engine = Engine(config, launcher, self._delivery)
        self._stop = asyncio.Event()
        self._parent = os.getppid()

    async def run(self) -> None:
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._stop.set)
        self._pump.start()
        try:
            await self.engine.start()
        except Exception as exc:
            log.exception("the engine core failed to start")
            self._send(StartFailed(f"{type(exc).__name__}: {exc}"))
            await self.engine.shutdown()
            self._close()
            return
        self._send(Started(self.engine.status()))
        watch = loop.create_task(self._report_status())
        try:
            await self._stop.wait()
        finally:
            watch.cancel()
            await self.engine.shutdown()
            self._delivery.flush()
            self._close()

    async def _report_status(self) -> None:
        while True:
            await asyncio.sleep(STATUS_INTERVAL_S)
            if os.getppid() != self._parent:
                log.error("the front end is gone; stopping")
                self._stop.set()
                return
            self._send(StatusUpdate(self.engine.status()))

    def _on_frames(self, frames: list[bytes]) -> None:
        try:
            message: FrontEndMessage = front_end_decoder.decode(frames[0])
        except ValueError as exc:
            log.error("dropping an undecodable frame from the front end: %s", exc)
            return
        if isinstance(message, Submit):
            self._submit(message)
        elif isinstance(message, Cancel):
            with contextlib.suppress(UnknownRequestError):
                self.engine.cancel(message.request_id)
        elif isinstance(message, StatsQuery):
            self._send(StatsReply(message.token, self.engine.stats_of(message.request_id)))
        elif isinstance(message, Stop):
            self._stop.set()

    def _submit(self, submit: Submit) -> None:
        params = [GenerationParams(**p) for p in submit.params]
        try:
            reqs = self.engine.add_requests(list(zip(submit.prompts, params, strict=True)))
        except EngineError as exc:
            index = getattr(exc, "index", None)
            self._send(Refused(submit.token, type(exc).__name__, str(exc), index))
            return
        self._send(Admitted(submit.token, [r.id for r in reqs]))

    def _send(self, message: object) -> None:
        """Sends `message` after the request events decided before it."""
        if not isinstance(message, Outputs):
            self._delivery.flush()
        self._pump.send([encoder.encode(message)])

    def _close(self) -> None:
        self._pump.stop()
        self._socket.close()
        self._context.term()
