"""Training data for the step predictor: real decoding traces, one row per request state.

A prompt set is decoded by the step runner (the serving code path) under every candidate
threshold, and again with the threshold switched mid-request as the scheduler does: a run
starts at `tau_before` and switches to `tau` after `switch_step` steps. Before every step
the request's state is recorded (`features.STATE_COLUMNS`: lengths, progress, and the
confidence statistics of the last report, dropped after a step that completed its block
exactly as the scheduler drops them); when the run ends each row gets its labels, the
true remaining steps and remaining recompute (full-sequence) steps. A row is `labeled`
when every step after it runs at `tau`, so its labels are the truth for that threshold;
the earlier rows of a switched run are kept for evaluating refresh intervals. Every one
of DESIGN §3's 11 features is a column too (`features.FEATURE_NAMES`, at the run's `tau`).

The table is written as Parquet (`save`), one file per collection.
"""

from __future__ import annotations

import json
import math
import random
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from transformers import PreTrainedTokenizerBase

from dilaserve.models import encode_prompt
from dilaserve.predictor.features import (
    CONFIDENCE_COLUMNS,
    FEATURE_NAMES,
    STATE_COLUMNS,
    feature_matrix,
)
from dilaserve.protocol import RequestState, StepEntry, StepKind, whole_blocks
from dilaserve.worker.runner import StepRunner

#: Candidate thresholds decoded by default (DESIGN §9's sweep).
THRESHOLDS: tuple[float, ...] = (0.5, 0.6, 0.7, 0.8, 0.9, 1.0)


@dataclass(frozen=True)
class Prompt:
    """A prompt to decode and how many output positions to offer it."""

    text: str
    max_tokens: int
    task: str = ""


@dataclass(frozen=True)
class Run:
    """One decoding of one prompt under a threshold schedule."""

    run: int
    prompt: int
    tau: float  # threshold from `switch_step` on: the one the labels are for
    tau_before: float  # threshold of the first `switch_step` steps
    switch_step: int  # 0: the whole request runs at `tau`

    def threshold_at(self, steps_done: int) -> float:
        return self.tau if steps_done >= self.switch_step else self.tau_before


@dataclass(frozen=True)
class CollectConfig:
    thresholds: tuple[float, ...] = THRESHOLDS
    #: Runs per prompt whose threshold switches mid-request (on top of one run per threshold).
    switched_runs: int = 6
    #: A switch happens after 1..max_switch_step steps.
    max_switch_step: int = 4
    block_length: int = 32
    batch_size: int = 64
    cache: str = "dual"
    stop_at_eos: bool = True
    seed: int = 0

    def __post_init__(self) -> None:
        if not self.thresholds or any(not 0.0 < t <= 1.0 for t in self.thresholds):
            raise ValueError(f"thresholds must lie in (0, 1], got {self.thresholds}")
        if self.switched_runs < 0 or self.max_switch_step < 1:
            raise ValueError("switched_runs must be >= 0 and max_switch_step >= 1")
        if self.block_length <= 0 or self.batch_size <= 0:
            raise ValueError("block_length and batch_size must be positive")
        if self.switched_runs and len(self.thresholds) < 2:
            raise ValueError("switched runs need at least two thresholds")


def plan_runs(num_prompts: int, config: CollectConfig) -> list[Run]:
    """One run per prompt and threshold, plus `switched_runs` runs per prompt whose
    threshold changes after a random number of steps."""
    rng = random.Random(config.seed)
    runs: list[Run] = []
    for p in range(num_prompts):
        for tau in config.thresholds:
            runs.append(Run(len(runs), p, tau, tau, 0))
        for _ in range(config.switched_runs):
            tau_before, tau = rng.sample(list(config.thresholds), 2)
            step = rng.randint(1, config.max_switch_step)
            runs.append(Run(len(runs), p, tau, tau_before, step))
    return runs


@dataclass
class _Trace:
    """What one run went through: the state before each step and the step's kind."""

    run: Run
    rows: list[dict[str, float | int]] = field(default_factory=list)
    kinds: list[StepKind] = field(default_factory=list)
    opened: list[bool] = field(default_factory=list)  # the step opened its block
    confidence: tuple[float, ...] | None = None  # of the last report, if still valid
    committed: int = 0  # output positions unmasked when the run ended


def unmasked(state: RequestState) -> int:
    """Output positions not masked, as the scheduler counts them: a block diffusion
    request's lead (its prompt's tail in the first block) included."""
    return state.num_committed + state.lead


def _state_row(state: RequestState, confidence: tuple[float, ...] | None) -> dict:
    block = state.current_block
    start = block * state.block_length
    in_block = state.output_ids[start : start + state.block_length]
    conf = confidence if confidence is not None else (math.nan,) * len(CONFIDENCE_COLUMNS)
    return {
        "prompt_length": state.prompt_length,
        "output_length": state.output_length,
        "block_length": state.block_length,
        "steps_done": state.steps_done,
        "block_steps": state.block_steps,
        "unmasked": unmasked(state),
        "unmasked_in_block": sum(1 for t in in_block if t != state.mask_token_id),
        **dict(zip(CONFIDENCE_COLUMNS, conf, strict=True)),
    }


def decode_runs(
    runner: StepRunner,
    prompt_ids: Sequence[Sequence[int]],
    gen_lengths: Sequence[int],
    runs: Sequence[Run],
    config: CollectConfig,
    on_batch: Callable[[int], None] | None = None,
) -> list[_Trace]:
    """Decodes every run (batched by output length) and records its trace."""
    order = sorted(range(len(runs)), key=lambda i: gen_lengths[runs[i].prompt])
    traces: list[_Trace] = [_Trace(r) for r in runs]
    model = runner.config
    start = 0
    while start < len(order):
        length = gen_lengths[runs[order[start]].prompt]
        group = [
            i
            for i in order[start : start + config.batch_size]
            if gen_lengths[runs[i].prompt] == length
        ]
        start += len(group)
        for i in group:
            runner.add(
                RequestState.new(
                    i,
                    list(prompt_ids[runs[i].prompt]),
                    length,
                    block_length=config.block_length,
                    mask_token_id=model.mask_token_id,
                    stop_token_ids=model.stop_token_ids if config.stop_at_eos else (),
                    aligned=bool(model.block_size),
                )
            )
        active = list(group)
        try:
            while active:
                entries = []
                for i in active:
                    state = runner.state(i)
                    trace = traces[i]
                    trace.rows.append(_state_row(state, trace.confidence))
                    trace.opened.append(state.block_steps == 0)
                    kind = runner.next_kind(i)
                    trace.kinds.append(kind)
                    entries.append(StepEntry(i, trace.run.threshold_at(state.steps_done), kind))
                report = runner.step(entries)
                active = []
                for out in report.outputs:
                    trace = traces[out.request_id]
                    block_done = runner.state(out.request_id).block_steps == 0
                    stats = tuple(float(x) for x in out.confidence_stats)
                    valid = not block_done and all(math.isfinite(x) for x in stats)
                    trace.confidence = stats if valid else None
                    if out.done:
                        trace.committed = unmasked(runner.state(out.request_id))
                    else:
                        active.append(out.request_id)
        finally:
            for i in group:
                if i in runner:
                    runner.release(i)
        if on_batch is not None:
            on_batch(len(group))
    return traces


def _label(trace: _Trace) -> list[dict]:
    """Rows of one finished run with their labels."""
    n = len(trace.rows)
    # A block's full step: its recompute, or the step opening it (no cache; the exact
    # cache's two-block step, which the scheduler prices as a block's full step).
    full = [
        k is StepKind.RECOMPUTE or opened
        for k, opened in zip(trace.kinds, trace.opened, strict=True)
    ]
    after = [0] * (n + 1)
    for t in range(n - 1, -1, -1):
        after[t] = after[t + 1] + int(full[t])
    run = trace.run
    rows = []
    for t, row in enumerate(trace.rows):
        rows.append(
            {
                "run": run.run,
                "prompt": run.prompt,
                "tau": run.tau,
                "tau_before": run.tau_before,
                "switch_step": run.switch_step,
                "step_tau": run.threshold_at(t),
                "kind": str(trace.kinds[t]),
                "next_full": full[t],
                **row,
                "total_steps": n,
                "total_committed": trace.committed,
                "remaining_steps": n - t,
                "remaining_recompute": after[t],
                "labeled": t >= run.switch_step,
            }
        )
    return rows


def with_features(table: pa.Table) -> pa.Table:
    """Adds the columns of DESIGN §3's features not already among the state columns, each
    row at its run's `tau`, so every one of `FEATURE_NAMES` is a column."""
    columns = {name: table.column(name).to_numpy() for name in STATE_COLUMNS}
    missing = [n for n in FEATURE_NAMES if n not in table.column_names]
    values = feature_matrix(columns, table.column("tau").to_numpy(), missing)
    for j, name in enumerate(missing):
        table = table.append_column(name, pa.array(values[:, j]))
    return table


def to_table(
    traces: Sequence[_Trace], prompts: Sequence[Prompt], config: CollectConfig
) -> pa.Table:
    rows = [row for trace in traces for row in _label(trace)]
    for row in rows:
        row["task"] = prompts[row["prompt"]].task
    table = with_features(pa.Table.from_pylist(rows))
    meta = {"collect_config": json.dumps(config.__dict__ | {"thresholds": list(config.thresholds)})}
    return table.replace_schema_metadata(meta)


def collect(
    runner: StepRunner,
    tokenizer: PreTrainedTokenizerBase,
    prompts: Sequence[Prompt],
    config: CollectConfig = CollectConfig(),
    on_batch: Callable[[int], None] | None = None,
) -> pa.Table:
    """Decodes `prompts` under `config`'s threshold schedules; one row per request state."""
    if runner.cache_mode.value != config.cache:
        raise ValueError(f"runner cache mode {runner.cache_mode} is not {config.cache}")
    ids = [encode_prompt(tokenizer, p.text) for p in prompts]
    lengths = [whole_blocks(p.max_tokens, config.block_length) for p in prompts]
    runs = plan_runs(len(prompts), config)
    traces = decode_runs(runner, ids, lengths, runs, config, on_batch)
    return to_table(traces, prompts, config)


def tiny_prompts(n: int, seed: int) -> list[Prompt]:
    """Prompts of the dilaserve-tiny task suite, offered their answer bound plus EOS."""
    from dilaserve.tiny.tasks import make_problems

    return [Prompt(p.prompt, p.max_tokens + 1, p.task) for p in make_problems(n, seed)]


def load_prompts(path: str | Path) -> list[Prompt]:
    """A JSON-lines prompt file: `{"prompt": str, "max_tokens": int, "task": str?}` per line."""
    prompts = []
    for number, line in enumerate(Path(path).read_text().splitlines(), 1):
        if not line.strip():
            continue
        try:
            item = json.loads(line)
            prompts.append(
                Prompt(str(item["prompt"]), int(item["max_tokens"]), item.get("task", ""))
            )
        except (ValueError, KeyError, TypeError) as e:
            raise ValueError(f"{path}:{number}: expected a prompt object, {e}") from None
        if prompts[-1].max_tokens <= 0:
            raise ValueError(f"{path}:{number}: max_tokens must be positive")
    if not prompts:
        raise ValueError(f"{path} holds no prompts")
    return prompts


def save(table: pa.Table, path: str | Path) -> Path:
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(table, path)
    return path


def recorded_config(table: pa.Table) -> dict:
    """The `CollectConfig` a collected table was recorded under (empty if it says none)."""
    meta = table.schema.metadata or {}
    raw = meta.get(b"collect_config")
    return json.loads(raw) if raw else {}


def load(path: str | Path) -> pa.Table:
    return pq.read_table(path)
