"""Where a request's outputs go once the core has decided them: its updates (newly complete
blocks), its end, or the error that ended it.

In process, they are decoded to text and queued on the request (`Engine.outputs` reads
them). An engine core in its own process forwards the token ids to its front end instead
(`core_process.ForwardedDelivery`), which decodes them there: the core never touches text.
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Protocol

from .requests import RequestStats, TrackedRequest


class Delivery(Protocol):
    def update(self, req: TrackedRequest, ids: list[int]) -> None:
        """`ids`: every output id of the request's complete blocks."""

    def finish(self, req: TrackedRequest, ids: list[int], reason: str, stats: RequestStats) -> None:
        """`ids`: every generated id (cut at the stop token)."""

    def fail(self, req: TrackedRequest, error: BaseException) -> None: ...


class QueuedDelivery:
    """Decodes each output and queues it on its request."""

    def __init__(self, decode: Callable[[list[int]], str]) -> None:
        self._decode = decode

    def update(self, req: TrackedRequest, ids: list[int]) -> None:
        req.outputs.put_nowait(req.text.update(ids, self._decode(ids)))

    def finish(self, req: TrackedRequest, ids: list[int], reason: str, stats: RequestStats) -> None:
        req.outputs.put_nowait(req.text.final(ids, self._decode(ids), reason, stats))

    def fail(self, req: TrackedRequest, error: BaseException) -> None:
        req.outputs.put_nowait(error)
