"""The messages between an engine core in its own process and its front end (ZeroMQ PAIR
socket, msgpack by `msgspec`). The core sees token ids only: the front end tokenizes,
decodes, cuts stop strings and counts usage.

Front end to core: `Submit` (requests as token ids), `Cancel`, `StatsQuery`, `Stop`.
Core to front end: `Started` or `StartFailed` once, the answer to each submit (`Admitted`
or `Refused`) and stats query (`StatsReply`), `Outputs` (every request event of a moment
in one frame) and a periodic `StatusUpdate`.
"""

from __future__ import annotations

from typing import Any

import msgspec

from .requests import RequestStats
from .status import EngineStatus


class Submit(msgspec.Struct, tag=True):
    """Requests admitted together (all or none); `params` are `GenerationParams` fields."""

    token: int
    prompts: list[list[int]]
    params: list[dict[str, Any]]


class Cancel(msgspec.Struct, tag=True):
    request_id: int


class StatsQuery(msgspec.Struct, tag=True):
    token: int
    request_id: int


class Stop(msgspec.Struct, tag=True):
    """Stop every worker and exit."""


class Started(msgspec.Struct, tag=True):
    status: EngineStatus


class StartFailed(msgspec.Struct, tag=True):
    message: str


class Admitted(msgspec.Struct, tag=True):
    token: int
    request_ids: list[int]


class Refused(msgspec.Struct, tag=True):
    """`error`: the `EngineError` subclass's name; `index`: the refused request's."""

    token: int
    error: str
    message: str
    index: int | None = None


class Finish(msgspec.Struct, array_like=True):
    """`token_ids`: every generated id, cut at the stop token."""

    request_id: int
    token_ids: list[int]
    reason: str
    stats: RequestStats


class Failure(msgspec.Struct, array_like=True):
    request_id: int
    error: str
    message: str


class Outputs(msgspec.Struct, tag=True):
    #: (request id, the output ids its newly complete blocks add).
    updates: list[tuple[int, list[int]]]
    finished: list[Finish]
    failed: list[Failure]


class StatsReply(msgspec.Struct, tag=True):
    token: int
    stats: RequestStats | None


class StatusUpdate(msgspec.Struct, tag=True):
    status: EngineStatus


FrontEndMessage = Submit | Cancel | StatsQuery | Stop
CoreMessage = Started | StartFailed | Admitted | Refused | Outputs | StatsReply | StatusUpdate

encoder = msgspec.msgpack.Encoder()
front_end_decoder = msgspec.msgpack.Decoder(FrontEndMessage)
core_decoder = msgspec.msgpack.Decoder(CoreMessage)
