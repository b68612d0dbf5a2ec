"""The step predictor's features (DESIGN §3), computed from a request's state between steps.

The Rust core computes the same features from the scheduler's view of a request
(`rust/src/predictor/features.rs`) with the same float64 arithmetic, so a model trained on
these columns sees identical inputs when the scheduler evaluates it. A feature a state does
not have (confidence before a block's first report) is NaN, which LightGBM treats as
missing in training and prediction alike.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np

#: The 11 features of DESIGN §3, in the order the shipped models use.
FEATURE_NAMES: tuple[str, ...] = (
    "threshold",
    "output_length",
    "full_progress",
    "full_unmask_progress",
    "block_progress",
    "block_unmask_progress",
    "confidence_min",
    "confidence_q25",
    "confidence_median",
    "confidence_mean",
    "confidence_q75",
)

#: What is known at arrival: lengths and the threshold (the one-shot ablation).
ONE_SHOT_FEATURES: tuple[str, ...] = ("threshold", "prompt_length", "output_length")
#: DESIGN §3's features without the confidence statistics.
PROGRESS_FEATURES: tuple[str, ...] = FEATURE_NAMES[:6]
#: Blocks not yet finished, the current one included: under block diffusion a request's
#: remaining work is these blocks' steps.
BLOCK_FEATURES: tuple[str, ...] = ("remaining_blocks",)
#: Every feature a model may use; the Rust core knows the same names.
KNOWN_FEATURES: tuple[str, ...] = (*FEATURE_NAMES, "prompt_length", *BLOCK_FEATURES)

CONFIDENCE_COLUMNS: tuple[str, ...] = FEATURE_NAMES[6:]

#: State columns (one value per request state) the features are computed from.
STATE_COLUMNS: tuple[str, ...] = (
    "prompt_length",
    "output_length",
    "block_length",
    "steps_done",  # steps run so far
    "block_steps",  # steps run in the current block (0: the next step opens it)
    "unmasked",  # output positions unmasked so far
    "unmasked_in_block",  # of the current block
    *CONFIDENCE_COLUMNS,  # of the last report; NaN when unknown
)


def check_feature_names(names: Sequence[str]) -> None:
    unknown = [n for n in names if n not in KNOWN_FEATURES]
    if unknown or len(set(names)) != len(names) or not names:
        raise ValueError(
            f"feature names {list(names)} must be distinct and among {list(KNOWN_FEATURES)}"
        )


def feature_matrix(
    state: Mapping[str, np.ndarray],
    threshold: np.ndarray | float,
    names: Sequence[str] = FEATURE_NAMES,
) -> np.ndarray:
    """Float64 rows of `names` for request states given as columns (`STATE_COLUMNS`),
    each at `threshold` (one per row, or one for all)."""
    check_feature_names(names)
    output = np.asarray(state["output_length"], dtype=np.float64)
    n = output.shape[0]

    def col(name: str) -> np.ndarray:
        return np.asarray(state[name], dtype=np.float64)

    block = col("block_length") if any("block" in x for x in names) else None
    computed = {
        "threshold": lambda: np.broadcast_to(np.asarray(threshold, dtype=np.float64), (n,)),
        "prompt_length": lambda: col("prompt_length"),
        "output_length": lambda: output,
        "full_progress": lambda: col("steps_done") / output,
        "full_unmask_progress": lambda: col("unmasked") / output,
        "block_progress": lambda: col("block_steps") / block,
        "block_unmask_progress": lambda: col("unmasked_in_block") / block,
        # Positions of finished blocks: everything unmasked outside the current block.
        "remaining_blocks": lambda: (output - col("unmasked") + col("unmasked_in_block")) / block,
    }
    for c in CONFIDENCE_COLUMNS:
        computed[c] = lambda c=c: col(c)
    out = np.empty((n, len(names)), dtype=np.float64)
    for j, name in enumerate(names):
        out[:, j] = computed[name]()
    return out


def repeat_over_thresholds(
    state: Mapping[str, np.ndarray], thresholds: Sequence[float], names: Sequence[str]
) -> np.ndarray:
    """Rows of every state at every threshold, state-major: row `i * len(thresholds) + k`
    is state `i` at `thresholds[k]` (the layout the scheduler's batched predictions use)."""
    taus = np.asarray(thresholds, dtype=np.float64)
    n = len(np.asarray(state["output_length"]))
    repeated = {k: np.repeat(np.asarray(v), len(taus)) for k, v in state.items()}
    return feature_matrix(repeated, np.tile(taus, n), names)
