"""The engine's copy of each request's token state, and what callers receive.

After every step the engine applies the worker's report to its own copy of the token
state, so a worker can be lost without losing a request: the copy is what a migration or
a restart sends to the next instance. Where a request lives and how it was served (its
steps, τ, instances, migrations) is the scheduler's record (`FinishedRequest`), not kept
here a second time. Text is streamed a block at a time, once every position of the block is
committed, so text already sent never changes.
"""

from __future__ import annotations

import asyncio
from dataclasses import dataclass, field

from dilaserve.protocol import RequestState, StepOutput
from dilaserve.scheduler import FinishedRequest


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
class TrackedRequest:
    """Everything the engine knows of one live request."""

    state: RequestState
    arrival: float
    slo_s: float
    outputs: asyncio.Queue[RequestOutput | BaseException] = field(default_factory=asyncio.Queue)
    failed_steps: int = 0
    sent_blocks: int = 0
    sent_text: str = ""

    @property
    def id(self) -> int:
        return self.state.request_id

    @property
    def deadline(self) -> float:
        return self.arrival + self.slo_s

    def apply(self, output: StepOutput) -> None:
        self.state.apply(output)

    def new_blocks(self) -> bool:
        return self.state.complete_blocks > self.sent_blocks

    def update(self, ids: list[int], text: str) -> RequestOutput:
        """The update carrying `ids` and their decoded `text`, and what is new in it."""
        self.sent_blocks = self.state.complete_blocks
        delta = text[len(self.sent_text) :] if text.startswith(self.sent_text) else ""
        self.sent_text = self.sent_text + delta
        return RequestOutput(self.id, self.sent_text, delta, ids)

    def complete_ids(self) -> list[int]:
        """Output ids of the complete blocks, cut before EOS."""
        state = self.state
        ids = state.output_ids[: state.complete_blocks * state.block_length]
        stop = state.stop_position
        return ids[:stop] if stop is not None and stop < len(ids) else ids

    def stats(self, served: FinishedRequest, now: float) -> RequestStats:
        """How the request has been served so far (final once it finished), from the
        scheduler's record of it."""
        latency = now - self.arrival
        mask = self.state.mask_token_id
        first = served.first_dispatch
        return RequestStats(
            prompt_tokens=self.state.prompt_length,
            completion_tokens=sum(t != mask for t in self.state.generated_ids()),
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

    def finish(self, text: str, served: FinishedRequest, now: float) -> RequestOutput:
        """The last update; `text` decodes `state.generated_ids()`."""
        update = self.update(self.state.generated_ids(), text)
        reason = "stop" if self.state.stop_position is not None else "length"
        stats = self.stats(served, now)
        return RequestOutput(
            self.id, update.text, update.delta, update.token_ids, True, reason, stats
        )
