"""The engine's end of the worker channel: one ZeroMQ ROUTER socket, msgpack frames.

Every worker process connects a DEALER socket whose identity is its worker id (unique per
process start), so a restarted instance is never confused with its dead predecessor.
Sends never block the engine loop: a frame to a worker that is gone fails at once
(`ROUTER_MANDATORY`), which the engine treats as a failed step.

The socket is driven directly (`SocketPump`), not through pyzmq's asyncio futures (a
future and its callbacks per frame were a third of the engine loop's time at 16
instances).

Workers on this machine connect over IPC (a socket file in a private directory); workers
on other machines over TCP, to a port the system picks on the host address the launcher
names (`tcp_host`), authenticated by CURVE keys made for this channel (`worker_keys`, which
the launcher hands to each worker; see `dilaserve.channel_keys`).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import tempfile
from collections.abc import Callable

import zmq
import zmq.asyncio
from zmq.auth.asyncio import AsyncioAuthenticator

from dilaserve.channel_keys import ChannelKeys, WorkerKeys
from dilaserve.protocol import (
    EngineMessage,
    ProtocolError,
    WorkerMessage,
    decode_worker_message,
    encode,
)

log = logging.getLogger(__name__)


class SendError(RuntimeError):
    """A frame could not be handed to the worker (it is not connected)."""


class WorkerChannel:
    def __init__(
        self, on_message: Callable[[int, WorkerMessage], None], tcp_host: str | None = None
    ) -> None:
        self._on_message = on_message
        self._context = zmq.asyncio.Context()
        self._socket = self._context.socket(zmq.ROUTER)
        self._socket.setsockopt(zmq.ROUTER_MANDATORY, 1)
        self._socket.setsockopt(zmq.LINGER, 0)
        self._dir: str | None = None
        self._auth: AsyncioAuthenticator | None = None
        #: What a worker needs to connect over TCP; None on IPC.
        self.worker_keys: WorkerKeys | None = None
        if tcp_host is None:
            self._dir = tempfile.mkdtemp(prefix="dilaserve-")
            self.endpoint = f"ipc://{self._dir}/engine.sock"
            self._socket.bind(self.endpoint)
        else:
            host = f"[{tcp_host}]" if ":" in tcp_host else tcp_host
            if ":" in tcp_host:
                self._socket.setsockopt(zmq.IPV6, 1)
            keys = ChannelKeys.generate()
            self._auth = AsyncioAuthenticator(self._context)
            self._auth.start()
            self._auth.configure_curve_callback("*", credentials_provider=_Admits(keys))
            keys.secure(self._socket)
            self.worker_keys = keys.workers
            try:
                port = self._socket.bind_to_random_port(f"tcp://{host}")
            except zmq.ZMQError:
                self._auth.stop()
                self._socket.close()
                self._context.term()
                raise
            self.endpoint = f"tcp://{host}:{port}"
        self._pump = SocketPump(self._socket, self._on_frames)

    def start(self) -> None:
        self._pump.start()

    def send(self, worker_id: int, message: EngineMessage) -> None:
        try:
            self._pump.send([str(worker_id).encode(), encode(message)])
        except zmq.ZMQError as exc:  # gone (ROUTER_MANDATORY), or 1000 frames behind
            raise SendError(f"worker {worker_id}: {exc}") from exc

    def _on_frames(self, frames: list[bytes]) -> None:
        try:
            identity, frame = frames
            worker_id = int(identity)
            message = decode_worker_message(frame)
        except (ValueError, ProtocolError) as exc:
            log.error("dropping a frame from %r: %s", frames[0], exc)
            return
        self._on_message(worker_id, message)

    async def close(self) -> None:
        self._pump.stop()
        self._socket.close()
        if self._auth is not None:
            self._auth.stop()
        self._context.term()
        if self._dir is not None:
            with contextlib.suppress(OSError):
                os.unlink(self.endpoint.removeprefix("ipc://"))
                os.rmdir(self._dir)


class _Admits:
    """The authenticator's check of a peer's CURVE key: only this channel's workers. The
    first refusal is a warning, later ones are counted (a peer retrying floods no log)."""

    def __init__(self, keys: ChannelKeys) -> None:
        self._keys = keys
        self.refused = 0

    def callback(self, domain: str, key: bytes) -> bool:
        if self._keys.admits(key):
            return True
        self.refused += 1
        level = logging.WARNING if self.refused == 1 else logging.DEBUG
        log.log(level, "refused a worker connection with an unknown key (%d so far)", self.refused)
        return False


class SocketPump:
    """Drives a ZeroMQ socket from the running asyncio loop without futures: sends are
    non-blocking calls, and a reader on the socket's descriptor hands every waiting
    message to `on_frames`. ZeroMQ signals that descriptor by edge, and a send may consume
    the edge of messages that arrived meanwhile, so after every send the pump checks for
    waiting messages itself."""

    def __init__(self, socket: zmq.Socket, on_frames: Callable[[list[bytes]], None]) -> None:
        self._socket = zmq.Socket.shadow(socket.underlying)
        self._on_frames = on_frames
        self._loop: asyncio.AbstractEventLoop | None = None
        self._drain_pending = False

    @property
    def started(self) -> bool:
        return self._loop is not None

    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._loop.add_reader(self._socket.FD, self._drain)
        self._drain()

    def stop(self) -> None:
        if self._loop is not None:
            self._loop.remove_reader(self._socket.FD)
            self._loop = None

    def send(self, frames: list[bytes]) -> None:
        """Raises `zmq.ZMQError` where the message cannot be queued now."""
        try:
            self._socket.send_multipart(frames, zmq.NOBLOCK)
        finally:
            self._check_waiting()

    def _check_waiting(self) -> None:
        """Schedules a drain if messages wait that the descriptor may no longer signal."""
        if (
            self._loop is not None
            and not self._drain_pending
            and self._socket.getsockopt(zmq.EVENTS) & zmq.POLLIN
        ):
            self._drain_pending = True
            self._loop.call_soon(self._drain)

    def _drain(self, most: int = 256) -> None:
        """Handles the messages waiting, up to `most` before letting the loop run others."""
        self._drain_pending = False
        for _ in range(most):
            if self._loop is None:
                return  # stopped meanwhile: the socket may be closed
            try:
                frames = self._socket.recv_multipart(zmq.NOBLOCK)
            except zmq.Again:
                return
            try:
                self._on_frames(frames)
            except Exception:  # one bad message must not leave the others unread
                log.exception("handling a message failed")
        self._check_waiting()
