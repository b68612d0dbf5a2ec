"""The quality floor: the thresholds the scheduler may choose, given how much accuracy the
served model loses at each.

Lowering τ buys speed with accuracy, at a rate that depends on the model: Fast-dLLM's
LLaDA-8B loses 1.5 points from τ 0.9 to 0.7 on GSM8K, dilaserve-tiny loses 4.4. A floor
in accuracy points, read against the model's own measurements, means the same thing for
every model; a floor in τ would not.
"""

from __future__ import annotations

import json
import logging
from collections.abc import Mapping, Sequence
from pathlib import Path

log = logging.getLogger(__name__)

#: Where a checkpoint keeps its measured accuracy per threshold (the progress model,
#: `dilaserve.predictor.progress`).
ACCURACY_FILE = "progress.json"


def measured_accuracy(model_dir: str | Path) -> dict[float, float] | None:
    """Accuracy per threshold measured on the model, or None if the checkpoint has none."""
    path = Path(model_dir) / ACCURACY_FILE
    if not path.is_file():
        return None
    table = json.loads(path.read_text())
    return dict(zip(table["thresholds"], table["accuracy"], strict=True))


def allowed_thresholds(
    candidates: Sequence[float], accuracy: Mapping[float, float], max_drop: float
) -> tuple[float, ...]:
    """The candidates whose measured accuracy is at most `max_drop` (a fraction) below the
    top candidate's, ascending. The top candidate is always allowed."""
    if max_drop < 0:
        raise ValueError(f"max_accuracy_drop must not be negative, got {max_drop}")
    ordered = sorted(candidates)
    missing = [t for t in ordered if t not in accuracy]
    if missing:
        raise ValueError(f"no measured accuracy for thresholds {missing}")
    reference = accuracy[ordered[-1]]
    return tuple(t for t in ordered if reference - accuracy[t] <= max_drop + 1e-12)


def quality_floor(
    candidates: Sequence[float], model_dir: str | Path, max_drop: float | None
) -> tuple[float, ...]:
    """The thresholds to serve `model_dir` with: every candidate when there is no floor or
    the checkpoint has no measured accuracy, else those within `max_drop` of the top."""
    if max_drop is None:
        return tuple(sorted(candidates))
    accuracy = measured_accuracy(model_dir)
    if accuracy is None:
        log.warning(
            "%s has no %s: no quality floor (thresholds %s); record one with "
            "`dilaserve.predictor.progress`",
            model_dir,
            ACCURACY_FILE,
            sorted(candidates),
        )
        return tuple(sorted(candidates))
    allowed = allowed_thresholds(candidates, accuracy, max_drop)
    log.info(
        "quality floor: thresholds %s (at most %.1f accuracy points below τ %s)",
        allowed,
        100 * max_drop,
        allowed[-1],
    )
    return allowed


def default_slo_thresholds(
    candidates: Sequence[float], model_dir: str | Path, max_drop: float | None
) -> list[float] | None:
    """The thresholds a request whose SLO is only the server's default may run at: all
    of the quality floor's (None) where the model's accuracy is measured or no floor is
    set, else the top one alone. A client that never asked for a deadline never has its
    answer's quality traded, unmeasured, for one."""
    if max_drop is None or measured_accuracy(model_dir) is not None:
        return None
    return [max(candidates)]
