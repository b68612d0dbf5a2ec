"""What the engine keeps of each live request, and what callers receive.

The authoritative token state of a request is the core's (`Scheduler.token_state`): every
step report is applied to it in one call, so a worker can be lost without losing a
request, and that state is what a migration or a restart sends to the next instance. Where
a request lives and how it was served (its steps, τ, instances, migrations) is the core's
record too (`FinishedRequest`). The engine keeps the request as admitted (prompt and
decoding options) and its output queue; whoever decodes (the engine in process, or the
front end of a core process) keeps the text sent so far (`TextStream`). Text is streamed a
block at a time, once every position of the block is committed, so text already sent
never changes.
"""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Callable
from dataclasses import dataclass, field, replace

from dilaserve.protocol import RequestState
from dilaserve.scheduler import FinishedOutput, FinishedRequest, TokenState


@dataclass(frozen=True)
class RequestStats:
    """How a finished request was served."""

    prompt_tokens: int
    completion_tokens: int
    steps: int
    recompute_steps: int
    #: τ of every step, in order (the values the workers ran).
    taus: tuple[float, ...]
    #: Instances visited, in order.
    instances: tuple[int, ...]
    migrations: int
    queue_s: float
    latency_s: float
    slo_s: float
    slo_met: bool

    @property
    def mean_tau(self) -> float:
        return sum(self.taus) / len(self.taus) if self.taus else float("nan")

    @property
    def min_tau(self) -> float:
        return min(self.taus) if self.taus else float("nan")


@dataclass(frozen=True)
class RequestOutput:
    """One update of a request: new complete blocks, or the end."""

    request_id: int
    #: All text of the complete blocks so far (cut at EOS).
    text: str
    #: Text new in this update.
    delta: str
    token_ids: list[int]
    finished: bool = False
    #: "stop" (EOS) or "length" (every output position used), once finished.
    finish_reason: str | None = None
    stats: RequestStats | None = None


@dataclass
class TextStream:
    """A request's text as sent so far: each update appends to it, so text already sent
    never changes. Kept where the text is decoded (the engine, or the front end of a core
    in another process)."""

    request_id: int
    sent_text: str = ""

    def update(self, ids: list[int], text: str) -> RequestOutput:
        """The update carrying `ids` and their decoded `text`, and what is new in it."""
        delta = text[len(self.sent_text) :] if text.startswith(self.sent_text) else ""
        self.sent_text = self.sent_text + delta
        return RequestOutput(self.request_id, self.sent_text, delta, ids)

    def final(self, ids: list[int], text: str, reason: str, stats: RequestStats) -> RequestOutput:
        """The last update: every generated id, its text, why it ended and its stats."""
        update = self.update(ids, text)
        return RequestOutput(self.request_id, update.text, update.delta, ids, True, reason, stats)


@dataclass
class TrackedRequest:
    """Everything the engine knows of one live request."""

    #: The request as admitted: prompt and decoding options. Its progress is the core's.
    state: RequestState
    arrival: float
    slo_s: float
    outputs: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    failed_steps: int = 0
    #: Its prompt's block keys, where the engine tracks prefix stores (`PrefixIndex.keys`).
    block_keys: list[int] = field(default_factory=list)

    def __post_init__(self) -> None:
        self.text = TextStream(self.id)

    @property
    def id(self) -> int:
        return self.state.request_id

    @property
    def deadline(self) -> float:
        return self.arrival + self.slo_s

    def resumable(self, tokens: TokenState) -> RequestState:
        """The token state an instance that does not hold the request needs."""
        return replace(
            self.state,
            output_ids=tokens.output_ids,
            steps_done=tokens.steps_done,
            block_steps=tokens.block_steps,
            timestep=tokens.timestep,
        )

    def stats(self, served: FinishedRequest, completion_tokens: int, now: float) -> RequestStats:
        """How the request has been served so far (final once it finished), from the
        core's record of it."""
        latency = now - self.arrival
        first = served.first_dispatch
        return RequestStats(
            prompt_tokens=self.state.prompt_length,
            completion_tokens=completion_tokens,
            steps=served.steps,
            recompute_steps=served.recompute_steps,
            taus=tuple(served.taus),
            instances=tuple(served.instances),
            migrations=served.migrations,
            queue_s=(first if first is not None else now) - self.arrival,
            latency_s=latency,
            slo_s=self.slo_s,
            slo_met=latency <= self.slo_s,
        )

    def ending(self, finished: FinishedOutput, now: float) -> tuple[str, RequestStats]:
        """Why the request ended ("stop": a stop token before every output position was
        used, else "length") and its final statistics."""
        stopped = len(finished.generated) < self.state.output_length
        stats = self.stats(finished.served, finished.completion_tokens, now)
        return ("stop" if stopped else "length"), stats


async def read_outputs(
    queue: asyncio.Queue[RequestOutput | BaseException], cancel: Callable[[], None]
) -> AsyncIterator[RequestOutput]:
    """A request's updates from its queue until the last; the error that ended it is
    raised. Leaving the iteration early calls `cancel`."""
    finished = False
    try:
        while True:
            item = await queue.get()
            if isinstance(item, BaseException):
                finished = True
                raise item
            finished = item.finished
            yield item
            if finished:
                return
    finally:
        if not finished:
            cancel()
