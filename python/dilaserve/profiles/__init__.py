"""Latency profiles shipped as data.

``llada8b_h100_simulated.json`` is not a measurement: it is a linear model of LLaDA-8B on an
H100 (a fixed 8 ms per step plus 27/28/32 µs per token for no-cache/recompute/cache steps at
TP-1), scaled by 1.0/0.75/0.45/0.33 at TP-1/2/4/8 so per-step latency falls ~25 % at TP2 and
~55 % at TP4 as reported for DLMs (DESIGN §2). It lets `dilaserve plan` run without a GPU;
measure a real one with `dilaserve profile`.
"""

from __future__ import annotations

from pathlib import Path

SIMULATED_LLADA8B: Path = Path(__file__).with_name("llada8b_h100_simulated.json")


def llada8b_progress() -> dict:
    """The embedded model's recorded progress rescaled to LLaDA-8B's tokens per step
    (Fast-dLLM's GSM8K figures, and one token per step at τ 1): what the simulator's and
    the emulated workers' steps commit by default."""
    from dilaserve.planner import FAST_DLLM_THRESHOLDS
    from dilaserve.predictor import progress as progress_model
    from dilaserve.tiny import default_model_dir

    tiny = progress_model.load(default_model_dir() / "progress.json")
    rates = [(t.threshold, t.tokens_per_step) for t in FAST_DLLM_THRESHOLDS] + [(1.0, 1.0)]
    return progress_model.rescaled(tiny, rates)
