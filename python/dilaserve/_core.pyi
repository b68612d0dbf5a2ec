"""Type stub of the Rust extension `dilaserve._core`. Use the documented wrappers
(`dilaserve.scheduler`) rather than these classes directly."""

from os import PathLike

import numpy as np

STEP_KINDS: tuple[str, ...]
WAIT_REASONS: tuple[str, ...]
THRESHOLD_REASONS: tuple[str, ...]
MIGRATION_REASONS: tuple[str, ...]
#: A finished request: id, steps, recompute steps, taus, instances, migrations,
#: first dispatch, deadline, arrival.
_FinishedTuple = tuple[int, int, int, list[float], list[int], int, float | None, float, float]

class LatencyProfileError(ValueError):
    """A latency profile is malformed or lacks a requested TP degree or step kind."""

class SchedulerError(ValueError):
    """The scheduler rejected an event or configuration; its state is unchanged."""

class SchedulerConfigError(SchedulerError): ...
class InvalidRequestError(SchedulerError): ...
class UnknownRequestError(SchedulerError): ...
class AdmissionError(SchedulerError): ...
class InvalidInstanceError(SchedulerError): ...
class UnknownInstanceError(SchedulerError): ...
class StepReportError(SchedulerError): ...

class PlannerInputError(ValueError):
    """Planner inputs are invalid (no GPUs, no classes, a degree larger than every node...)."""

class PlannerSolveError(RuntimeError):
    """The MILP solver failed."""

class LatencyProfile:
    """Measured per-step latency by TP degree, step kind and batch tokens."""

    @staticmethod
    def from_json(text: str) -> LatencyProfile: ...
    @staticmethod
    def load(path: str | PathLike[str]) -> LatencyProfile: ...
    @staticmethod
    def from_tables(
        tables: list[tuple[int, str, list[tuple[int, float]]]]
        | list[tuple[int, str, list[tuple[int, float]], int | None]],
    ) -> LatencyProfile: ...
    def to_json(self) -> str: ...
    def latency(self, tp: int, kind: str, tokens: float) -> float:
        """Seconds of one step at the shortest measured cached context."""
    def step_time(self, tp: int, kind: str, batch_tokens: float, context_tokens: float) -> float:
        """Seconds of one step over `batch_tokens` fed tokens whose requests hold
        `context_tokens` cached tokens each (cache steps depend on it)."""
    def contexts(self, tp: int, kind: str) -> list[int]: ...
    def points(self, tp: int, kind: str, context: int | None = None) -> list[tuple[int, float]]: ...
    def degrees(self) -> list[int]: ...
    @property
    def model(self) -> str: ...
    @property
    def device(self) -> str: ...
    @property
    def dtype(self) -> str: ...
    @property
    def block_length(self) -> int: ...

class Decisions:
    """Decisions of one round as packed little-endian records.

    batches: (instance u64, start u64, len u64, tokens u64, predicted_finish f64,
    release_start u64, release_len u64) each; entries: (request u64, tau f64, kind u8,
    new_here u8, tokens u64, block u32, unmasked_in_block u32, ...); releases: u64 ids;
    waiting: (request u64, reason u8).
    """

    now: float
    elapsed_s: float
    overloaded: bool
    batches: bytes
    entries: bytes
    releases: bytes
    waiting: bytes
    def migrations(self) -> list[tuple[int, int, int, str]]: ...

class Scheduler:
    def __init__(
        self,
        profile: LatencyProfile,
        config_json: str,
        *,
        predictor_rates: list[tuple[float, float]] | None = None,
        predictor: object | None = None,
        predictor_model: str | None = None,
    ) -> None: ...
    @property
    def thresholds(self) -> list[float]: ...
    def set_predictor_rates(self, points: list[tuple[float, float]]) -> None: ...
    @property
    def active_requests(self) -> int: ...
    @property
    def queued_requests(self) -> int: ...
    @property
    def overloaded(self) -> bool: ...
    def arrive(
        self,
        id: int,
        *,
        arrival: float,
        deadline: float,
        prompt_len: int,
        output_len: int,
        priority: int = 0,
        block_length: int | None = None,
        thresholds: list[float] | None = None,
        explicit_deadline: bool = True,
        pinned_tau: float | None = None,
        mask_token: int | None = None,
        stop_tokens: list[int] = ...,
        fixed_schedule: bool = False,
    ) -> None: ...
    def step_done(
        self,
        instance: int,
        measured_s: float,
        results: list[tuple[int, int, tuple[float, float, float, float, float] | None, bool]],
    ) -> list[_FinishedTuple]: ...
    def apply_report(
        self,
        instance: int,
        measured_s: float,
        requests: list[int],
        blocks: list[int],
        counts: list[int],
        positions: list[int],
        tokens: list[int],
        confidence: list[float],
        timesteps: list[int],
    ) -> tuple[
        list[tuple[_FinishedTuple, list[int], int]],
        list[tuple[int, list[int]]],
        list[tuple[float, int, int]],
    ]: ...
    def token_state(self, id: int) -> tuple[list[int], int, int, int, int]: ...
    def abort_step(self, instance: int) -> list[int]: ...
    def expect_prefix(self, id: int, instance: int, tokens: int) -> None: ...
    def cancel(self, id: int) -> None: ...
    def add_instance(
        self,
        id: int,
        *,
        tp: int,
        gpus: list[int],
        node: int = 0,
        kv_tokens: int | None = None,
        max_requests: int | None = None,
        max_batch_tokens: int | None = None,
    ) -> None: ...
    def drain_instance(self, id: int) -> None: ...
    def undrain_instance(self, id: int) -> None: ...
    def drained_instances(self) -> list[int]: ...
    def remove_instance(self, id: int) -> None: ...
    def schedule(self, now: float) -> Decisions: ...
    def schedule_commands(
        self, now: float
    ) -> list[tuple[int, list[int], list[float], list[int], list[int], list[int], float]]: ...
    def instance_ids(self) -> list[int]: ...
    def served_so_far(self, id: int) -> _FinishedTuple: ...
    def request(self, id: int) -> dict[str, object]: ...
    def instance(self, id: int) -> dict[str, object]: ...

def plan_json(inputs_json: str, profile: LatencyProfile) -> str:
    """Both planner stages and the adoption rule; JSON in, JSON out (GIL released)."""

def plan_capacity_json(inputs_json: str, profile: LatencyProfile) -> str:
    """Stage 1 only; JSON in, JSON out (GIL released)."""

def plan_transition_json(inputs_json: str) -> str:
    """Stage 2 alone to given instance counts; JSON in, JSON out (GIL released)."""

def classes_from_arrivals(
    arrivals_raw: list[tuple[float, int, int]],
    start: float,
    end: float,
    prompt_bins: int,
    output_bins: int,
    rate_margin: float,
) -> list[tuple[float, float, float]]:
    """`(prompt tokens, output tokens, rate)` classes of the arrivals in `[start, end)`."""

def mean_isolated_latency(
    profile: LatencyProfile,
    arrivals_raw: list[tuple[float, int, int]],
    tokens_per_step: float,
    caching: bool,
    block_length: int,
) -> float:
    """Mean seconds a request takes alone on TP-1 at `tokens_per_step` tokens per step."""

def planner_solvers() -> list[str]:
    """Names of the MILP backends compiled in."""

PREDICTOR_FEATURES: list[str]

class PredictorModelError(ValueError):
    """A LightGBM model is malformed, uses what native inference does not evaluate, or has
    features the step predictor does not know."""

class PredictorError(ValueError):
    """A step predictor failed or returned a NaN, infinite or negative prediction."""

class RequestViews:
    columns: list[str]
    def __init__(self, data: bytes) -> None: ...
    def __len__(self) -> int: ...
    def packed(self) -> bytes: ...
    def ids(self) -> list[int]: ...

class Forest:
    @staticmethod
    def load(path: str) -> Forest: ...
    @staticmethod
    def from_text(text: str) -> Forest: ...
    @property
    def feature_names(self) -> list[str]: ...
    @property
    def num_trees(self) -> int: ...
    @property
    def objective(self) -> str: ...
    def predict(self, rows: bytes) -> bytes: ...

class GbmPredictor:
    @staticmethod
    def load(path: str) -> GbmPredictor: ...
    @staticmethod
    def from_forests(total: Forest, recompute: Forest | None = None) -> GbmPredictor: ...
    @property
    def has_recompute_model(self) -> bool: ...
    @property
    def feature_names(self) -> list[str]: ...
    def predict(self, views: RequestViews, thresholds: list[float]) -> tuple[bytes, bytes]: ...

class MeanRatePredictor:
    def __init__(self, points: list[tuple[float, float]] | None = None) -> None: ...
    def rate(self, tau: float) -> float: ...
    def predict(self, views: RequestViews, thresholds: list[float]) -> tuple[bytes, bytes]: ...

class SimInputError(ValueError): ...

def check_progress_json(text: str) -> str: ...
def simulate(
    scheduler: Scheduler,
    instances: list[tuple[int, int, list[int], int]],
    arrival: list[float],
    prompt_len: list[int],
    output_len: list[int],
    slo_s: list[float],
    progress_json: str,
    *,
    progress_class: list[int] | None = None,
    seed: int = 0,
    round_quantum_s: float = 0.0,
    step_overhead_s: float = 0.0,
    replan_json: str | None = None,
) -> tuple[dict[str, np.ndarray], dict[str, float]]: ...

class HeldTokens:
    """A worker's token state of its resident requests (`held_tokens::HeldTokens`). The
    accessors raise `KeyError` for an id not held; `add`, `pack` and `commit` raise
    `ValueError` for what does not fit (ids not held among them)."""

    def __init__(self, exact: bool = False) -> None: ...
    def add(
        self,
        id: int,
        prompt: list[int],
        output: list[int],
        block_length: int,
        mask: int,
        stops: list[int],
        fixed_schedule: bool,
        counters: tuple[int, int, int],
        lead: int = 0,
    ) -> None: ...
    def seed_exact(self, id: int, length: int) -> None:
        """Under the exact cache: the request's first `length` positions (whole prompt
        blocks) already hold final K/V here."""

    def remove(self, id: int) -> tuple[list[int], tuple[int, int, int]]: ...
    def __contains__(self, id: int) -> bool: ...
    def output(self, id: int) -> list[int]: ...
    def counters(self, id: int) -> tuple[int, int, int, int]: ...
    def done(self, id: int) -> bool: ...
    def cache_valid(self, id: int) -> bool: ...
    def pack(
        self,
        ids: list[int],
        kinds: list[int],
        suffix: bool,
        shift: int,
        bases: list[int] | None = None,
    ) -> tuple[bytearray, list[int], list[int], int]:
        """A step's packed model call: an int64 buffer (fed ids, positions, pool slots with
        `bases`, logit index, candidate flags), fed tokens and sequence length per row,
        the logit width."""

    def commit(
        self, ids: list[int], kinds: list[int], host: np.ndarray
    ) -> tuple[list[int], list[int], list[int], list[int], list[float], list[bool], list[int]]:
        """Applies a step's read-back (`[rows, 3 * width + 1]` float64) to every row, or to
        none (`ValueError`): the report's blocks, counts, positions, tokens, confidence
        statistics, done flags and grid steps."""

def scheduler_settings_json() -> str:
    """The scheduler settings' schema and the named policies (JSON)."""

def policy_named_json(name: str) -> str: ...
def check_scheduler_settings_json(config_json: str) -> None: ...

class Replanner:
    """Periodic replanning shared with the simulator (`planner::Replanner`)."""

    def __init__(self, options_json: str) -> None: ...
    def set_options_json(self, options_json: str) -> None: ...
    def record(self, time: float, prompt_tokens: int, output_tokens: int) -> None: ...
    def planned_batch(self, degree: int) -> int | None: ...
    @property
    def next_plan(self) -> float: ...
    def inputs_json(
        self,
        now: float,
        running: list[tuple[int, int, int, list[int]]],
        node_gpus: list[int],
        default_batch: int,
        profile: LatencyProfile,
        *,
        min_improvement: float | None = None,
    ) -> str | None: ...
    def adopt_json(self, plan_json: str) -> None: ...
    @staticmethod
    def handover(others_serving: bool, launch_follows: bool) -> bool: ...

class ProgressSampler:
    """Step commit counts drawn from a progress model (the simulator's draws)."""

    def __init__(self, progress_json: str, seed: int) -> None: ...
    def sample(self, steps: list[tuple[float, int, int]]) -> list[int]: ...
