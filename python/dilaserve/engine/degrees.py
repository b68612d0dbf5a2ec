"""Which tensor-parallel degrees the served model allows, checked once at start-up and at
every launch, and which of them the planner may choose.

A degree must divide the model's query heads, KV heads, MLP width and padded vocabulary
(Dream-7B: 28 query heads and 4 KV heads, so TP 8 is impossible). The engine reads only
`config.json` for this — it never loads weights — so a wrong `--instances` fails before
any worker starts or any profile is measured.
"""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path

from dilaserve._core import LatencyProfile
from dilaserve.models import ModelConfig, allowed_degrees, check_degree, read_config
from dilaserve.models.checkpoint import CONFIG_FILE

from .config import EngineConfig


@dataclass(frozen=True)
class ModelDegrees:
    """The TP degrees (of the scheduler's candidates 1, 2, 4, 8) one model can run at."""

    config: ModelConfig
    source: Path
    allowed: tuple[int, ...]

    @classmethod
    def of(cls, model_dir: str | Path) -> ModelDegrees:
        _, config = read_config(model_dir)
        return cls(config, Path(model_dir) / CONFIG_FILE, allowed_degrees(config))

    def check(self, degrees: Iterable[int]) -> None:
        """Raises `UnsupportedDegreeError` (naming the config file and what does not
        divide) for the first degree the model cannot be split into."""
        for degree in degrees:
            check_degree(self.config, degree, self.source)

    def for_planner(self, config: EngineConfig, profile: LatencyProfile) -> tuple[int, ...]:
        """The degrees the planner may choose: `config.planner_degrees` when given (each
        checked), else every allowed degree the profile has tables for and the node's
        slots can hold."""
        if config.planner_degrees is not None:
            self.check(config.planner_degrees)
            return tuple(sorted(set(config.planner_degrees)))
        measured = set(profile.degrees())
        return tuple(d for d in self.allowed if d in measured and d <= config.slots) or (1,)
