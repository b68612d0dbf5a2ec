"""Connection limits in front of aiohttp's per-connection protocol: at most
`max_connections` open at once (the next gets a 503 and is closed), and a connection that
has not sent its first complete request head within `header_timeout_s` of opening is
closed, so idle and slowloris connections cannot pile up. After its first request a
connection is aiohttp's: idle keep-alive connections are closed by its keep-alive timeout.
"""

from __future__ import annotations

import asyncio
import json
import logging
from collections.abc import Callable
from dataclasses import dataclass

log = logging.getLogger(__name__)

_HEAD_END = b"\r\n\r\n"


def _busy_response() -> bytes:
    body = json.dumps(
        {
            "error": {
                "message": "too many open connections; retry later",
                "type": "server_error",
                "param": None,
                "code": "too_many_connections",
            }
        }
    ).encode()
    head = (
        "HTTP/1.1 503 Service Unavailable\r\nContent-Type: application/json\r\n"
        f"Content-Length: {len(body)}\r\nRetry-After: 1\r\nConnection: close\r\n\r\n"
    )
    return head.encode() + body


BUSY = _busy_response()


@dataclass
class ConnectionLimits:
    max_connections: int
    header_timeout_s: float
    open: int = 0
    refused: int = 0
    timed_out: int = 0

    def factory(self, inner: Callable[[], asyncio.Protocol]) -> Callable[[], asyncio.Protocol]:
        """A protocol factory for `loop.create_server` wrapping aiohttp's."""
        return lambda: _Guarded(inner, self)


class _Guarded(asyncio.Protocol):
    """Delegates to aiohttp's protocol once the connection is admitted; watches the bytes
    only until the first request head is complete."""

    def __init__(self, inner: Callable[[], asyncio.Protocol], limits: ConnectionLimits) -> None:
        self._make_inner = inner
        self._inner: asyncio.Protocol | None = None
        self._limits = limits
        self._timer: asyncio.TimerHandle | None = None
        # The head seen so far, from its first byte (parsers skip blank lines before a
        # request line, so leading CR/LF are no head at all); only its last 3 bytes kept.
        self._tail: bytes | None = None

    def connection_made(self, transport: asyncio.BaseTransport) -> None:
        limits = self._limits
        if limits.open >= limits.max_connections:
            limits.refused += 1
            transport.write(BUSY)  # type: ignore[attr-defined]
            transport.close()
            return
        limits.open += 1
        self._inner = self._make_inner()
        self._timer = asyncio.get_running_loop().call_later(
            limits.header_timeout_s, self._head_overdue, transport
        )
        self._inner.connection_made(transport)

    def _head_overdue(self, transport: asyncio.BaseTransport) -> None:
        self._timer = None
        self._limits.timed_out += 1
        log.info("closing a connection that sent no complete request head in time")
        transport.abort()  # type: ignore[attr-defined]

    def data_received(self, data: bytes) -> None:
        if self._timer is not None:
            self._watch_head(data)
        if self._inner is not None:
            self._inner.data_received(data)

    def _watch_head(self, data: bytes) -> None:
        if self._tail is None:
            data = data.lstrip(b"\r\n")
            if not data:
                return
            self._tail = b""
        seen = self._tail + data
        if _HEAD_END in seen:
            assert self._timer is not None
            self._timer.cancel()
            self._timer = None
        else:
            self._tail = seen[-3:]

    def eof_received(self) -> bool | None:
        return None if self._inner is None else self._inner.eof_received()

    def connection_lost(self, exc: Exception | None) -> None:
        if self._timer is not None:
            self._timer.cancel()
        if self._inner is not None:
            self._limits.open -= 1
            self._inner.connection_lost(exc)

    def pause_writing(self) -> None:
        if self._inner is not None:
            self._inner.pause_writing()

    def resume_writing(self) -> None:
        if self._inner is not None:
            self._inner.resume_writing()
