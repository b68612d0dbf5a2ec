"""Offline generation on one runner: the step loop without a scheduler."""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from dilaserve.protocol import RequestState, StepEntry
from dilaserve.worker.runner import StepRunner

# A threshold may be fixed or chosen per request and step from its current state.
Threshold = float | Callable[[RequestState], float]


@dataclass(frozen=True)
class Generation:
    output_ids: list[int]  # cut before the first EOS when stopping at EOS
    steps: int
    state: RequestState


def generate(
    runner: StepRunner,
    prompts: Sequence[Sequence[int]],
    *,
    gen_length: int,
    block_length: int | None = None,
    threshold: Threshold = 0.9,
    stop_at_eos: bool = False,
    **options: Any,
) -> list[Generation]:
    """Decodes `prompts` together in one batch until each is done; returns one per prompt.
    `options` are decoding options of `RequestState.new` (temperature, seed, alg, ...).
    The block length defaults to a block diffusion model's own, else 32."""
    config = runner.config
    block_length = block_length or config.block_size or 32
    states = [
        RequestState.new(
            i,
            list(p),
            gen_length,
            block_length=block_length,
            mask_token_id=config.mask_token_id,
            stop_token_ids=config.stop_token_ids if stop_at_eos else (),
            aligned=bool(config.block_size),
            **options,
        )
        for i, p in enumerate(prompts)
    ]
    for s in states:
        runner.add(s)
    try:
        active = [s.request_id for s in states]
        while active:
            batch = [
                StepEntry(rid, _threshold(threshold, runner, rid), runner.next_kind(rid))
                for rid in active
            ]
            result = runner.step(batch)
            active = [o.request_id for o in result.outputs if not o.done]
        finals = [runner.state(s.request_id) for s in states]
    finally:
        for s in states:
            if s.request_id in runner:
                runner.release(s.request_id)
    return [Generation(f.generated_ids(), f.steps_done, f) for f in finals]


def _threshold(threshold: Threshold, runner: StepRunner, request_id: int) -> float:
    return threshold(runner.state(request_id)) if callable(threshold) else threshold
