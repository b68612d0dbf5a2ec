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
    front_end: int,
) -> None:
    """Serves `config`'s engine to the front end at `endpoint` (process `front_end`)."""
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    logging.basicConfig(level=log_level, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    asyncio.run(CoreServer(config, launcher, endpoint, front_end).run())


class ForwardedDelivery:
    """Gathers request events and sends them as one `Outputs` frame per loop turn. An
    update carries only the ids its blocks add (the front end keeps the rest), so a long
    output does not cross the socket again with every block."""

    def __init__(self, send: Callable[[object], None]) -> None:
        self._send = send
        self._outputs = Outputs([], [], [])
        self._pending = False
        #: Output ids already sent, per live request.
        self._sent: dict[int, int] = {}

    def update(self, req: TrackedRequest, ids: list[int]) -> None:
        sent = self._sent.get(req.id, 0)
        self._sent[req.id] = len(ids)
        self._outputs.updates.append((req.id, ids[sent:]))
        self._flush_soon()

    def finish(self, req: TrackedRequest, ids: list[int], reason: str, stats: RequestStats) -> None:
        self._sent.pop(req.id, None)
        self._outputs.finished.append(Finish(req.id, ids, reason, stats))
        self._flush_soon()

    def fail(self, req: TrackedRequest, error: BaseException) -> None:
        self._sent.pop(req.id, None)
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
    def __init__(
        self,
        config: EngineConfig,
        launcher: Callable[[], Launcher | None] | None,
        endpoint: str,
        front_end: int,
    ) -> None:
        self._config = config
        self._launcher = launcher
        self._front_end = front_end
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PAIR)
        self._socket.setsockopt(zmq.LINGER, 1000)  # the last frames reach the front end
        self._socket.setsockopt(zmq.SNDHWM, 0)  # a busy front end delays frames, loses none
        self._socket.connect(endpoint)
        self._pump = SocketPump(self._socket, self._on_frames)
        self._delivery = ForwardedDelivery(self._send)
        self._stop = asyncio.Event()
        self.engine: Engine | None = None
        #: `Started` was sent: status updates follow.
        self._serving = False

    async def run(self) -> None:
        """Starts the engine (a `Stop`, SIGTERM or the front end's end cancels that), serves
        until told to stop, then stops every worker."""
        loop = asyncio.get_running_loop()
        loop.add_signal_handler(signal.SIGTERM, self._stop.set)
        self._pump.start()
        watch = loop.create_task(self._watch_front_end())
        try:
            if await self._start():
                self._send(Started(self.engine.status()))  # type: ignore[union-attr]
                self._serving = True
                await self._stop.wait()
        finally:
            watch.cancel()
            if self.engine is not None:
                await self.engine.shutdown()
            self._delivery.flush()
            self._close()

    async def _start(self) -> bool:
        """Whether the engine started; if it failed, the front end is told why."""
        stopping = asyncio.ensure_future(self._stop.wait())
        try:
            self.engine = Engine(
                self._config, self._launcher() if self._launcher else None, self._delivery
            )
            starting = asyncio.ensure_future(self.engine.start())
            await asyncio.wait({starting, stopping}, return_when=asyncio.FIRST_COMPLETED)
            if not starting.done():
                starting.cancel()
                await asyncio.gather(starting, return_exceptions=True)
                return False
            starting.result()
            return True
        except Exception as exc:
            log.exception("the engine core failed to start")
            self._send(StartFailed(f"{type(exc).__name__}: {exc}"))
            return False
        finally:
            stopping.cancel()

    async def _watch_front_end(self) -> None:
        """Stops the core once its front end's process is gone; sends the status every
        `STATUS_INTERVAL_S` once the engine serves."""
        while True:
            await asyncio.sleep(STATUS_INTERVAL_S)
            if os.getppid() != self._front_end:
                log.error("the front end is gone; stopping")
                self._stop.set()
                return
            if self.engine is None or not self._serving:
                continue
            try:
                self._send(StatusUpdate(self.engine.status()))
            except Exception:
                log.exception("sending the status failed")

    def _on_frames(self, frames: list[bytes]) -> None:
        try:
            message: FrontEndMessage = front_end_decoder.decode(frames[0])
        except ValueError as exc:
            log.error("dropping an undecodable frame from the front end: %s", exc)
            return
        if isinstance(message, Stop):
            self._stop.set()
            return
        engine = self.engine
        try:
            if isinstance(message, Submit):
                self._submit(message)
            elif isinstance(message, Cancel) and engine is not None:
                with contextlib.suppress(UnknownRequestError):
                    engine.cancel(message.request_id)
            elif isinstance(message, StatsQuery):
                stats = None if engine is None else engine.stats_of(message.request_id)
                self._send(StatsReply(message.token, stats))
        except Exception as exc:  # answered, so that no caller waits for ever
            log.exception("handling %s failed", type(message).__name__)
            if isinstance(message, Submit):
                self._send(Refused(message.token, "EngineError", f"{type(exc).__name__}: {exc}"))
            elif isinstance(message, StatsQuery):
                self._send(StatsReply(message.token, None))

    def _submit(self, submit: Submit) -> None:
        assert self.engine is not None, "the front end submits once the core has started"
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
