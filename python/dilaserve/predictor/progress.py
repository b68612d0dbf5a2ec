"""The simulator's progress model: how many tokens a denoising step commits, recorded from
real decoding (`dilaserve predictor collect` traces), per step threshold and position in
the block, with the model's measured accuracy at each threshold.

The Rust core (`dilaserve._core.simulate`) draws from it; this module builds, rescales,
checks and stores it as JSON.
"""

from __future__ import annotations

import json
from collections.abc import Mapping, Sequence
from pathlib import Path

import numpy as np
import pyarrow as pa

from dilaserve import _core

#: Buckets of block progress a step's commit count is recorded by.
BUCKETS = 4


def progress_model(
    traces: pa.Table,
    accuracy: Mapping[float, float],
    *,
    model: str = "",
    buckets: int = BUCKETS,
) -> dict:
    """A progress model from collected decoding traces (one row per request state before a
    step) and the accuracy measured at each threshold (`dilaserve eval`)."""
    col = {
        name: traces.column(name).to_numpy()
        for name in ("run", "steps_done", "step_tau", "unmasked", "unmasked_in_block")
    }
    col["block_length"] = traces.column("block_length").to_numpy()
    col["total_committed"] = traces.column("total_committed").to_numpy()
    order = np.lexsort((col["steps_done"], col["run"]))
    col = {k: v[order] for k, v in col.items()}
    same_run = col["run"][1:] == col["run"][:-1]
    after = np.where(same_run, col["unmasked"][1:], col["total_committed"][:-1])
    after = np.append(after, col["total_committed"][-1])
    commits = after - col["unmasked"]
    blocks = np.unique(col["block_length"])
    if len(blocks) != 1:
        raise ValueError(f"traces mix block lengths {blocks.tolist()}; record one at a time")
    block = int(blocks[0])
    bucket = np.minimum(col["unmasked_in_block"] * buckets // block, buckets - 1)
    taus = sorted(float(t) for t in np.unique(col["step_tau"]))
    missing = [t for t in taus if t not in accuracy]
    if missing:
        raise ValueError(f"no accuracy given for thresholds {missing}")
    tables = []
    for tau in taus:
        at = (col["step_tau"] == tau) & (commits >= 1)
        # A bucket stays empty where a fast threshold jumps over it; the core then draws
        # from its nearest recorded neighbour.
        tables.append([[float(c) for c in commits[at & (bucket == b)]] for b in range(buckets)])
    return {
        "model": model,
        "block_length": block,
        "thresholds": taus,
        "commits": tables,
        "accuracy": [float(accuracy[t]) for t in taus],
    }


def progress_by_class(
    traces: pa.Table,
    accuracy: Mapping[float, float],
    *,
    column: str = "task",
    model: str = "",
    buckets: int = BUCKETS,
) -> dict[str, dict]:
    """One progress model per value of `column` (the prompt's task in `collect` traces):
    kinds of request decode at different speeds on one model, and the simulator can draw
    each request's steps from its own kind (`ClusterSetup.class_progress`)."""
    values = traces.column(column).to_numpy(zero_copy_only=False)
    return {
        str(name): progress_model(
            traces.filter(pa.array(values == name)), accuracy, model=model, buckets=buckets
        )
        for name in np.unique(values)
    }


def rescaled(progress: dict, rates: Sequence[tuple[float, float]]) -> dict:
    """Another model's published speeds on this model's recorded variability: at each
    recorded threshold, every step's count pooled into one bucket (the per-block shape of
    a small model does not carry over) and scaled so their mean matches `rates`
    (`(threshold, tokens per step)`, interpolated)."""
    points = sorted(rates)
    xs, ys = [p[0] for p in points], [p[1] for p in points]
    tables = []
    for tau, table in zip(progress["thresholds"], progress["commits"], strict=True):
        pooled = [c for bucket in table for c in bucket]
        factor = float(np.interp(tau, xs, ys)) / float(np.mean(pooled))
        tables.append([[max(1.0, c * factor) for c in pooled]])
    return {**progress, "commits": tables}


def mean_rates(progress: dict) -> list[tuple[float, float]]:
    """`(threshold, mean tokens per step)` of a progress model: the matching predictor
    table."""
    return [
        (tau, float(np.mean([c for bucket in table for c in bucket])))
        for tau, table in zip(progress["thresholds"], progress["commits"], strict=True)
    ]


def check(progress: dict) -> dict:
    """The model after the core's checks (raises `SimInputError` with the reason)."""
    return json.loads(_core.check_progress_json(json.dumps(progress)))


def save(progress: dict, path: str | Path) -> Path:
    path = Path(path)
    path.write_text(json.dumps(check(progress)))
    return path


def load(path: str | Path) -> dict:
    return check(json.loads(Path(path).read_text()))
