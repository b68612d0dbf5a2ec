"""`EngineClient`: the front end of an engine core that runs in its own process, as vLLM
v1 splits its API process from its engine core. The front end tokenizes and checks
prompts, decodes token ids to text and keeps what each request has sent; the core
(`core_process`) schedules and drives the workers on token ids alone. The two meet on a
ZeroMQ PAIR socket over IPC (`core_messages`).

So the HTTP server's parsing, tokenization and text never take the core's loop, and the
core's steps never wait for them. The client offers what a front end calls of `Engine`
(`submit`, `outputs`, `cancel`, `request_stats`, `status`, `encode`, `tokenizer`); an
embedding program that wants one process uses `Engine` itself.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import os
import pickle
import sys
import tempfile
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass, field

import zmq

from dilaserve.models import text_decoder
from dilaserve.tiny import model_path

from . import errors
from .admission import PromptEncoder
from .config import EngineConfig, GenerationParams
from .core_messages import (
    Admitted,
    Cancel,
    CoreMessage,
    Outputs,
    Refused,
    Started,
    StartFailed,
    StatsQuery,
    StatsReply,
    StatusUpdate,
    Stop,
    Submit,
    core_decoder,
    encoder,
)
from .launcher import Launcher
from .requests import RequestOutput, RequestStats, TextStream, read_outputs
from .status import EngineStatus
from .transport import SocketPump

log = logging.getLogger(__name__)

#: How long the core may take to stop its workers and exit once told to.
STOP_TIMEOUT_S = 60.0

_ERRORS = {
    cls.__name__: cls
    for cls in (
        errors.BadRequestError,
        errors.OverloadedError,
        errors.EngineStoppedError,
        errors.RequestCancelledError,
        errors.RequestFailedError,
        errors.UnknownRequestError,
        errors.LaunchError,
    )
}


def _error(name: str, message: str, index: int | None = None) -> errors.EngineError:
    if name == "BadRequestError":
        return errors.BadRequestError(message, index)
    return _ERRORS.get(name, errors.EngineError)(message)


@dataclass
class ClientRequest:
    """A request the core admitted, as its front end keeps it."""

    id: int
    outputs: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    #: The output ids of its complete blocks so far (each update sends what it adds).
    ids: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.text = TextStream(self.id)


class EngineClient:
    """Starts an engine core process for `config` and fronts it. Use as
    `async with EngineClient(config) as engine:`. `launcher` makes the core's launcher in
    the core process (it must pickle: a module-level function or a `functools.partial`)."""

    def __init__(
        self,
        config: EngineConfig | None = None,
        launcher: Callable[[], Launcher | None] | None = None,
    ) -> None:
        self.config = config or EngineConfig()
        self._launcher = launcher
        self.model_dir = model_path(self.config.model)
        self._requests: dict[int, ClientRequest] = {}
        self._replies: dict[int, asyncio.Future] = {}
        self._tokens = itertools.count(1)
        self._status: EngineStatus | None = None
        self._started: asyncio.Future[None] | None = None
        self._exited: asyncio.Future[None] | None = None
        self._process: asyncio.subprocess.Process | None = None
        self._running = False

    async def __aenter__(self) -> EngineClient:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    # -- life cycle ------------------------------------------------------------------------

    async def start(self) -> None:
        """Starts the core process; returns once every instance serves. A core that fails
        to start raises `EngineStoppedError` with its reason."""
        loop = asyncio.get_running_loop()
        self.prompts = PromptEncoder(self.model_dir)
        self.tokenizer = self.prompts.tokenizer
        self._decode = text_decoder(self.tokenizer)
        self._dir = tempfile.mkdtemp(prefix="dilaserve-core-")
        endpoint = f"ipc://{self._dir}/core.sock"
        level = logging.getLogger().getEffectiveLevel()
        # Pickled first: a launcher that cannot be is refused before a process exists.
        arguments = pickle.dumps((self.config, self._launcher, endpoint, level, os.getpid()))
        self._context = zmq.Context()
        self._socket = self._context.socket(zmq.PAIR)
        for option in (zmq.SNDHWM, zmq.RCVHWM, zmq.LINGER):
            self._socket.setsockopt(option, 0)
        self._socket.bind(endpoint)
        self._pump = SocketPump(self._socket, self._on_frames)
        self._pump.start()
        self._started, self._exited = loop.create_future(), loop.create_future()
        # A fresh interpreter, not multiprocessing's spawn, which would run the caller's
        # main module again; the arguments arrive pickled on its standard input.
        self._process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-c",
            "from dilaserve.engine.core_process import main; main()",
            stdin=asyncio.subprocess.PIPE,
        )
        self._watch = loop.create_task(self._watch_core())
        try:
            assert self._process.stdin is not None
            self._process.stdin.write(arguments)
            self._process.stdin.close()
            await self._started
        except BaseException:
            await self._stop_core()
            raise
        self._running = not self._exited.done()

    @property
    def exited(self) -> asyncio.Future[None]:
        """Done once the core process has ended (after `shutdown`, or on its own)."""
        assert self._exited is not None, "the engine has not started"
        return self._exited

    async def shutdown(self) -> None:
        """Stops the core and its workers; requests still running fail with
        `EngineStoppedError`."""
        if self._process is None:
            return
        self._running = False
        await self._stop_core()

    async def _stop_core(self) -> None:
        """Asks the core to stop (SIGTERM where it cannot be told yet), kills it if it has
        not exited in time, and closes this end."""
        assert self._process is not None and self._exited is not None
        try:
            if not self._exited.done():
                try:
                    self._pump.send([encoder.encode(Stop())])
                except zmq.ZMQError:  # not connected yet: its SIGTERM handler stops it
                    self._process.terminate()
                try:
                    await asyncio.wait_for(asyncio.shield(self._exited), STOP_TIMEOUT_S)
                except TimeoutError:
                    log.error("the engine core did not stop in %.0f s; killing it", STOP_TIMEOUT_S)
        finally:
            if self._process.returncode is None:
                self._process.kill()
            self._pump.stop()
            self._socket.close()
            self._context.term()
            with contextlib.suppress(OSError):
                os.unlink(f"{self._dir}/core.sock")
            with contextlib.suppress(OSError):
                os.rmdir(self._dir)
            self._process = None

    async def _watch_core(self) -> None:
        """Once the core process ends, everything waiting on it fails, and the status says
        no instance serves."""
        assert self._process is not None and self._exited is not None
        code = await self._process.wait()
        try:
            if self._running:
                log.error("the engine core exited (code %s)", code)
            self._running = False
            self._drain_after_exit()
            self._pump.stop()
            if self._status is not None:
                self._status = dataclasses.replace(self._status, instances=(), active_requests=0)
            stopped = errors.EngineStoppedError(f"the engine core exited (code {code})")
            if self._started is not None and not self._started.done():
                self._started.set_exception(stopped)
            for future in self._replies.values():
                if not future.done():
                    future.set_exception(stopped)
            self._replies.clear()
            for req in self._requests.values():
                req.outputs.put_nowait(stopped)
            self._requests.clear()
        finally:
            self._exited.set_result(None)

    def _drain_after_exit(self) -> None:
        """Takes the frames the core sent before it exited (ZeroMQ's I/O thread may still
        be moving the last ones: it waits until none has come for a tenth of a second)."""
        while self._socket.poll(100, zmq.POLLIN):
            self._on_frames(self._socket.recv_multipart())

    # -- requests --------------------------------------------------------------------------

    def encode(self, prompt: str) -> list[int]:
        """A prompt's checked token ids (`BadRequestError`); safe in a worker thread."""
        return self.prompts.prompt_ids(prompt)

    async def submit(
        self, requests: Sequence[tuple[str | Sequence[int], GenerationParams]]
    ) -> list[ClientRequest]:
        """Admits requests as one (all or none, as `Engine.add_requests`); raises the
        core's `BadRequestError` (with the refused one's `index`) or `OverloadedError`.
        Text is tokenized here; ids and options are checked once, by the core."""
        if not self._running:
            raise errors.EngineStoppedError("the engine is not running")
        prompts = []
        for index, (prompt, _) in enumerate(requests):
            try:
                prompts.append(self.encode(prompt) if isinstance(prompt, str) else list(prompt))
            except errors.BadRequestError as exc:
                raise errors.BadRequestError(str(exc), index) from exc
        fields = [dataclasses.asdict(params) for _, params in requests]
        reply = self._ask(lambda token: Submit(token, prompts, fields))
        try:
            return await reply
        except asyncio.CancelledError:
            # The caller left while the core admitted them: nobody reads them, so they stop
            # (an admission still on its way is cancelled when it arrives, `_on_admitted`).
            if reply.done() and not reply.cancelled() and reply.exception() is None:
                for req in reply.result():
                    self.cancel(req.id)
            raise

    def outputs(self, req: ClientRequest) -> AsyncIterator[RequestOutput]:
        """The updates of an admitted request; leaving the iteration early cancels it."""
        return read_outputs(req.outputs, lambda: self.cancel(req.id))

    def cancel(self, request_id: int) -> None:
        """Stops a request and frees its capacity; a no-op for one already ended."""
        req = self._requests.pop(request_id, None)
        if req is None:
            return
        req.outputs.put_nowait(errors.RequestCancelledError(f"request {request_id} was cancelled"))
        with contextlib.suppress(zmq.ZMQError):
            self._pump.send([encoder.encode(Cancel(request_id))])

    async def request_stats(self, request_id: int) -> RequestStats | None:
        """How a live request has been served so far; None once it has ended."""
        if not self._running:
            return None
        return await self._ask(lambda token: StatsQuery(token, request_id))

    def status(self) -> EngineStatus:
        """The core's latest status (sent every `core_process.STATUS_INTERVAL_S`)."""
        assert self._status is not None, "the engine has not started"
        return self._status

    def _ask(self, message: Callable[[int], object]) -> asyncio.Future:
        """Sends `message(token)`; the future gets the core's answer to that token."""
        token = next(self._tokens)
        reply = self._replies[token] = asyncio.get_running_loop().create_future()
        try:
            self._pump.send([encoder.encode(message(token))])
        except zmq.ZMQError as exc:  # the core is gone, its exit not yet seen
            del self._replies[token]
            reply.set_exception(errors.EngineStoppedError(f"the engine core is gone: {exc}"))
        return reply

    # -- core messages ---------------------------------------------------------------------

    def _on_frames(self, frames: list[bytes]) -> None:
        try:
            message: CoreMessage = core_decoder.decode(frames[0])
        except ValueError as exc:
            log.error("dropping an undecodable frame from the engine core: %s", exc)
            return
        if isinstance(message, Outputs):
            self._on_outputs(message)
        elif isinstance(message, StatusUpdate):
            self._status = message.status
        elif isinstance(message, Admitted):
            self._on_admitted(message)
        elif isinstance(message, Refused):
            error = _error(message.error, message.message, message.index)
            self._reply(message.token, error=error)
        elif isinstance(message, StatsReply):
            self._reply(message.token, message.stats)
        elif isinstance(message, Started | StartFailed):
            started = self._started
            if isinstance(message, Started):
                self._status = message.status
            if started is None or started.done():
                return
            if isinstance(message, Started):
                started.set_result(None)
            else:
                started.set_exception(errors.EngineStoppedError(message.message))

    def _on_admitted(self, admitted: Admitted) -> None:
        future = self._replies.pop(admitted.token, None)
        if future is None or future.done():  # the caller gave up waiting: they stop
            for rid in admitted.request_ids:
                with contextlib.suppress(zmq.ZMQError):
                    self._pump.send([encoder.encode(Cancel(rid))])
            return
        reqs = [ClientRequest(rid) for rid in admitted.request_ids]
        self._requests.update((r.id, r) for r in reqs)
        future.set_result(reqs)

    def _reply(self, token: int, value: object = None, error: BaseException | None = None):
        future = self._replies.pop(token, None)
        if future is None or future.done():
            return
        if error is not None:
            future.set_exception(error)
        else:
            future.set_result(value)

    def _on_outputs(self, outputs: Outputs) -> None:
        decode, requests = self._decode, self._requests
        for rid, added in outputs.updates:
            req = requests.get(rid)
            if req is not None:
                req.ids += added
                ids = list(req.ids)
                req.outputs.put_nowait(req.text.update(ids, decode(ids)))
        for end in outputs.finished:
            req = requests.pop(end.request_id, None)
            if req is not None:
                text = decode(end.token_ids)
                req.outputs.put_nowait(req.text.final(end.token_ids, text, end.reason, end.stats))
        for failure in outputs.failed:
            req = requests.pop(failure.request_id, None)
            if req is not None:
                req.outputs.put_nowait(_error(failure.error, failure.message))
