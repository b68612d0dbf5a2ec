"""The speed-quality sweep of a model on held-out task problems: τ × KV-cache mode.

For every (threshold, cache mode) the held-out problems are decoded block by block with
the step runner (the same code path as serving) and scored with the task checker. Reported
per cell: exact-answer accuracy, mean denoising steps per problem, mean tokens committed
per step (output positions unmasked when the request finished, over its steps) and
committed tokens per second of wall-clock decoding at the given batch size.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path

import torch
from transformers import PreTrainedTokenizerBase

from dilaserve.models import encode_prompt
from dilaserve.tiny.tasks import Problem, check, gen_length
from dilaserve.worker.generate import generate
from dilaserve.worker.runner import StepRunner

THRESHOLDS = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)
CACHE_MODES = ("none", "prefix", "dual")
#: A block diffusion model's: its exact cache, and no cache to compare it with.
BLOCK_CACHE_MODES = ("none", "block")
EVAL_SEED = 20_260_601  # held out: training draws its problems from TrainConfig.seed


@dataclass(frozen=True)
class Outcome:
    """One decoded problem."""

    problem: Problem
    text: str
    correct: bool
    steps: int
    committed: int  # output positions unmasked when decoding stopped


@dataclass(frozen=True)
class SweepRow:
    threshold: float
    cache: str
    accuracy: float
    mean_steps: float
    tokens_per_step: float
    tokens_per_s: float
    n: int

    def to_dict(self) -> dict[str, float | str | int]:
        return asdict(self)


def decode_problems(
    runner: StepRunner,
    tokenizer: PreTrainedTokenizerBase,
    problems: Sequence[Problem],
    *,
    threshold: float,
    block_length: int | None = None,
    batch_size: int = 64,
) -> tuple[list[Outcome], float]:
    """Decodes every problem (batched by output length); returns outcomes and seconds.
    `block_length` defaults to the model's (block diffusion) or 32."""
    mask_id = runner.config.mask_token_id
    block_length = block_length or runner.config.block_size or 32
    order = sorted(range(len(problems)), key=lambda i: gen_length(problems[i], block_length))
    outcomes: dict[int, Outcome] = {}
    seconds = 0.0
    start = 0
    while start < len(order):
        length = gen_length(problems[order[start]], block_length)
        group = [
            i
            for i in order[start : start + batch_size]
            if gen_length(problems[i], block_length) == length
        ]
        start += len(group)
        began = time.perf_counter()
        results = generate(
            runner,
            [encode_prompt(tokenizer, problems[i].prompt) for i in group],
            gen_length=length,
            block_length=block_length,
            threshold=threshold,
            stop_at_eos=True,
        )
        seconds += time.perf_counter() - began
        for i, result in zip(group, results, strict=True):
            text = tokenizer.decode(result.output_ids, skip_special_tokens=True)
            outcomes[i] = Outcome(
                problem=problems[i],
                text=text,
                correct=mask_id not in result.output_ids and check(problems[i], text),
                steps=result.steps,
                committed=result.state.num_committed,
            )
    return [outcomes[i] for i in range(len(problems))], seconds


def summarize(threshold: float, cache: str, outcomes: list[Outcome], seconds: float) -> SweepRow:
    n = len(outcomes)
    steps = sum(o.steps for o in outcomes)
    committed = sum(o.committed for o in outcomes)
    return SweepRow(
        threshold=threshold,
        cache=cache,
        accuracy=sum(o.correct for o in outcomes) / n,
        mean_steps=steps / n,
        tokens_per_step=committed / steps,
        tokens_per_s=committed / seconds if seconds > 0 else float("inf"),
        n=n,
    )


def sweep(
    model: torch.nn.Module,
    tokenizer: PreTrainedTokenizerBase,
    problems: Sequence[Problem],
    *,
    thresholds: Sequence[float] = THRESHOLDS,
    cache_modes: Sequence[str] | None = None,
    block_length: int | None = None,
    batch_size: int = 64,
    on_row: Callable[[SweepRow], None] | None = None,
) -> list[SweepRow]:
    """One row per (cache mode, threshold); `on_row` sees each row as soon as it is done.
    `cache_modes` defaults to those the model's family decodes with (`modes_of`)."""
    rows = []
    for cache in cache_modes or modes_of(model):
        runner = StepRunner(model, cache=cache, max_requests=batch_size)
        for tau in thresholds:
            outcomes, seconds = decode_problems(
                runner,
                tokenizer,
                problems,
                threshold=tau,
                block_length=block_length,
                batch_size=batch_size,
            )
            rows.append(summarize(tau, cache, outcomes, seconds))
            if on_row is not None:
                on_row(rows[-1])
    return rows


def modes_of(model: torch.nn.Module) -> tuple[str, ...]:
    """The cache modes a sweep of `model` compares: the approximate caches of a
    bidirectional model, or a block diffusion model's exact cache."""
    return BLOCK_CACHE_MODES if model.config.block_size else CACHE_MODES


def plot(rows: Sequence[SweepRow], path: str | Path) -> Path:
    """Accuracy and mean steps against τ, one line per cache mode, saved as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, (acc_ax, steps_ax) = plt.subplots(1, 2, figsize=(10, 4))
    for cache in dict.fromkeys(r.cache for r in rows):
        mine = sorted((r for r in rows if r.cache == cache), key=lambda r: r.threshold)
        taus = [r.threshold for r in mine]
        acc_ax.plot(taus, [100 * r.accuracy for r in mine], marker="o", label=cache)
        steps_ax.plot(taus, [r.mean_steps for r in mine], marker="o", label=cache)
    acc_ax.set(xlabel="threshold τ", ylabel="accuracy (%)", title="accuracy vs τ")
    steps_ax.set(xlabel="threshold τ", ylabel="mean steps per problem", title="steps vs τ")
    for ax in (acc_ax, steps_ax):
        ax.grid(alpha=0.3)
        ax.legend(title="KV cache")
    fig.tight_layout()
    path = Path(path)
    fig.savefig(path, dpi=120)
    plt.close(fig)
    return path
