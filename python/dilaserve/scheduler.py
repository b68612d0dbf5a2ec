"""Typed Python API of DiLaServe's Rust step-level scheduler.

The scheduler is a library first: feed it events (arrivals, step reports, cancellations,
instance changes) and call `Scheduler.schedule(now)` to get, per idle instance, the next
batch of (request, threshold, step kind), every migration with its reason, and why each
ready request that was not dispatched is waiting. The round runs in Rust with the GIL
released; its decisions come back as numpy columns, with lists of records built on demand.

Instances may bound their resident requests (`kv_tokens`, `max_requests`) and their step
size (`max_batch_tokens`); placement never exceeds them. A request no instance has room for
reserves the instance that will fit it soonest, which then takes no other new request, so
a stream of small requests cannot starve a large one. If the instance that would complete a
request's step first is busy, the request waits for it (`queued_busy`).
"""

from __future__ import annotations

import dataclasses
import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from functools import cached_property
from typing import TYPE_CHECKING, Literal, NamedTuple

import numpy as np

from dilaserve import _core
from dilaserve._core import (
    AdmissionError,
    InvalidInstanceError,
    InvalidRequestError,
    LatencyProfile,
    LatencyProfileError,
    SchedulerConfigError,
    SchedulerError,
    StepReportError,
    UnknownInstanceError,
    UnknownRequestError,
)
from dilaserve.settings import Schema, settings_class, settings_values

if TYPE_CHECKING:
    from dilaserve.protocol import StepReport

__all__ = [
    "POLICY_SETTINGS",
    "PRESETS",
    "SCHEDULER_SETTINGS",
    "AdmissionError",
    "Batch",
    "BatchEntry",
    "Decisions",
    "FinishedOutput",
    "FinishedRequest",
    "InstanceInfo",
    "InvalidInstanceError",
    "InvalidRequestError",
    "LatencyProfile",
    "LatencyProfileError",
    "Migration",
    "Policy",
    "ReportOutcome",
    "RequestInfo",
    "Scheduler",
    "SchedulerConfig",
    "SchedulerConfigError",
    "SchedulerError",
    "StepReportError",
    "StepResult",
    "TokenState",
    "UnknownInstanceError",
    "UnknownRequestError",
    "Waiting",
]

StepKindName = Literal["recompute", "cache", "no_cache"]
Confidence = tuple[float, float, float, float, float]

STEP_KINDS: tuple[str, ...] = _core.STEP_KINDS
WAIT_REASONS: tuple[str, ...] = _core.WAIT_REASONS
#: Why a step got its threshold: `fixed` (the policy's), `fits` (the highest allowed whose
#: estimate meets the deadline), `capped` (load control's cap; a higher one would have met
#: it), `late` (none meets it: the lowest allowed), `pinned` (the request's own).
THRESHOLD_REASONS: tuple[str, ...] = _core.THRESHOLD_REASONS
MIGRATION_REASONS: tuple[str, ...] = _core.MIGRATION_REASONS
# Record layouts written by the core (rust/src/bindings/decisions.rs).
_BATCH = np.dtype(
    [
        ("instance", "<u8"),
        ("start", "<u8"),
        ("len", "<u8"),
        ("tokens", "<u8"),
        ("finish", "<f8"),
        ("release_start", "<u8"),
        ("release_len", "<u8"),
        ("predicted_s", "<f8"),
    ]
)
_ENTRY = np.dtype(
    [
        ("request", "<u8"),
        ("tau", "<f8"),
        ("kind", "u1"),
        ("new_here", "?"),
        ("tokens", "<u8"),
        ("block", "<u4"),
        ("unmasked_in_block", "<u4"),
        ("reason", "u1"),
        ("estimate_s", "<f8"),
        ("slo_left_s", "<f8"),
        ("cap_tau", "<f8"),
        ("ahead", "?"),
    ]
)
_WAITING = np.dtype([("request", "<u8"), ("reason", "u1")])


_SETTINGS = json.loads(_core.scheduler_settings_json())
#: The scheduler's settings as the core declares them: name, doc, kind and default of each
#: field (`dilaserve.settings`); the policy's fields are nested under `policy`.
SCHEDULER_SETTINGS: Schema = _SETTINGS["scheduler"]
POLICY_SETTINGS: Schema = next(f for f in SCHEDULER_SETTINGS if f["name"] == "policy")["fields"]
#: Every named policy (DESIGN §8's baselines and ablations): its doc, its settings, and
#: whether the simulator runs it on the baselines' fixed layout. One registry for the
#: server, the benchmarks and the simulator.
PRESETS: dict[str, dict] = {p["name"]: p for p in _SETTINGS["presets"]}


class _PolicyPresets:
    """The named policies as constructors, and the ablations as edits."""

    @classmethod
    def named(cls, name: str) -> Policy:
        """A policy of `PRESETS`, or `fixed-T`: threshold T with DiLaServe's instance choice
        (`SchedulerConfigError` for anything else)."""
        return cls(**json.loads(_core.policy_named_json(name)))  # type: ignore[return-value]

    @classmethod
    def dilaserve(cls) -> Policy:
        return cls.named("dilaserve")

    @classmethod
    def infaas_like(cls, tau: float = 0.9) -> Policy:
        """Fixed threshold, least-loaded dispatch, no migration, no load control."""
        return dataclasses.replace(cls.named("infaas"), fixed_tau=tau)

    @classmethod
    def llumnix_like(cls, tau: float = 0.9) -> Policy:
        """INFaaS-like plus step-level migration for load balance."""
        return dataclasses.replace(cls.named("llumnix"), fixed_tau=tau)

    def without_load_control(self) -> Policy:
        return dataclasses.replace(self, load_control=False)  # type: ignore[type-var]

    def window_load_control(self) -> Policy:
        """DESIGN §5's load control as written (the paper's policy)."""
        return dataclasses.replace(self, load_model="window")  # type: ignore[type-var]

    def without_admission(self) -> Policy:
        return dataclasses.replace(self, admission="off")  # type: ignore[type-var]

    def next_step_choice(self) -> Policy:
        """Instance choice by the next step alone (DESIGN §6 as written)."""
        return dataclasses.replace(self, lookahead_steps=0, migration_gain=0.0)  # type: ignore[type-var]

    def without_migration(self) -> Policy:
        return dataclasses.replace(self, migration=False)  # type: ignore[type-var]

    def one_shot(self) -> Policy:
        return dataclasses.replace(self, prediction="one_shot")  # type: ignore[type-var]


Policy = settings_class(
    "Policy",
    POLICY_SETTINGS,
    doc="How the scheduler decides (fields and defaults: the core's `Policy`). DiLaServe, "
    "the DESIGN §8 baselines and the ablations are all values of this class, so every "
    "comparison runs the same scheduler.",
    bases=(_PolicyPresets,),
    module=__name__,
)

#: Settings of the scheduler's predictor: Python-side choices, not the core's settings.
_PREDICTOR_FIELDS = [
    #: `(threshold, mean tokens per step)` points of the default predictor; None uses
    #: Fast-dLLM's GSM8K figures.
    ("predictor_rates", "tuple[tuple[float, float], ...] | None", dataclasses.field(default=None)),
    #: LightGBM model of remaining steps (`predictor.txt`, with `predictor_recompute.txt`
    #: beside it if present), evaluated natively instead of the mean-rate table.
    ("predictor_model", "str | None", dataclasses.field(default=None)),
    #: For experiments: a predictor object instead (`dilaserve.predictor.GbmPredictor` or
    #: `MeanRatePredictor`, run natively, or any object with the `PythonPredictor`
    #: method). At most one of `predictor_rates`, `predictor_model` and `predictor`.
    ("predictor", "object | None", dataclasses.field(default=None, compare=False)),
]

SchedulerConfig = settings_class(
    "SchedulerConfig",
    SCHEDULER_SETTINGS,
    doc="The scheduler's settings (fields and defaults: the core's `SchedulerConfig`), "
    "and which step predictor it uses.",
    nested={"policy": Policy},
    extra=_PREDICTOR_FIELDS,
    module=__name__,
)


def check_settings(config: SchedulerConfig) -> None:
    """Raises `SchedulerConfigError` for settings a scheduler would refuse, so that a bad
    value fails where it is given, not when an engine starts."""
    _core.check_scheduler_settings_json(json.dumps(settings_values(config, SCHEDULER_SETTINGS)))


class StepResult(NamedTuple):
    """A worker's report on one request of a finished step.

    `confidence` holds the min, q25, median, mean and q75 of the confidences of the current
    block's positions that were still masked when the step began. A step that completes its
    block reports them too, but they describe a finished block: the scheduler drops them,
    and the request has no confidence features until its next report (the next block's
    confidences are unknown before its first step). Statistics that are not all finite are
    dropped the same way, for that request only.
    """

    request: int
    #: Tokens the step unmasked (at least one).
    committed: int
    #: min, q25, median, mean, q75 of the block's still-masked positions (see above).
    confidence: Confidence | None = None
    #: The request ended early (EOS with everything before it unmasked).
    finished: bool = False


class BatchEntry(NamedTuple):
    request: int
    tau: float
    kind: StepKindName
    #: The instance does not hold the request's token state yet; the step command carries it.
    new_here: bool
    #: Tokens this step feeds the model: the whole sequence for a recompute or no-cache
    #: step, the block for a cache step.
    tokens: int
    #: Index of the output block this step works on.
    block: int
    #: Positions of that block already unmasked before this step.
    unmasked_in_block: int
    #: A step ahead (`SchedulerConfig.overlap`): it runs after the request's step in flight
    #: on the same instance; its kind (`kind` is the likely one), `block` and
    #: `unmasked_in_block` (as of before that step) are the worker's to resolve.
    ahead: bool = False


class Batch(NamedTuple):
    instance: int
    entries: list[BatchEntry]
    tokens: int
    predicted_finish: float
    #: Requests the instance drops before this step: they left it since its last batch
    #: (finished, cancelled, moved away, their step aborted).
    release: tuple[int, ...] = ()


class Migration(NamedTuple):
    request: int
    from_instance: int
    to_instance: int
    reason: str


class Waiting(NamedTuple):
    request: int
    #: One of `WAIT_REASONS`: no_instance, all_busy, no_room, home_busy, home_full,
    #: no_kv_room, queued_busy.
    reason: str


@dataclass(frozen=True)
class FinishedRequest:
    """A request that finished, with what happened to it (returned by `step_done`)."""

    id: int
    #: Steps it ran (aborted steps excluded).
    steps: int
    #: Of those, steps of kind recompute (0 without caching).
    recompute_steps: int
    #: Threshold of every step, in order.
    taus: list[float]
    #: Instances it was dispatched to, in order, consecutive repeats collapsed.
    instances: list[int]
    #: Times it moved to another instance between steps.
    migrations: int
    #: `now` of the round that first dispatched it.
    first_dispatch: float | None
    deadline: float
    arrival: float


class TokenState(NamedTuple):
    """A live request's token state as the scheduler keeps it (see `Scheduler.arrive`)."""

    output_ids: list[int]
    steps_done: int
    #: Steps run in the current block, and Dream grid steps passed in it.
    block_steps: int
    timestep: int
    #: Generated positions that hold a token so far (cut before a stop token).
    completion_tokens: int


class FinishedOutput(NamedTuple):
    """A request that finished in a step: how it was served and what it generated."""

    served: FinishedRequest
    #: Output ids cut before the first stop token.
    generated: list[int]
    #: Of those, positions that hold a token.
    completion_tokens: int


class ReportOutcome(NamedTuple):
    """What applying a step report changed that the caller must hear of; the per-request
    work of a step stays in the core."""

    finished: list[FinishedOutput]
    #: `(request, complete ids)` of requests whose blocks completed in this step: all the
    #: ids of their complete blocks, cut before a stop token (text that never changes).
    updates: list[tuple[int, list[int]]]
    #: `(τ, steps, tokens committed)` of the step's threshold-rule requests, per τ.
    rates: list[tuple[float, int, int]]


@dataclass(frozen=True)
class RequestInfo:
    id: int
    arrival: float
    deadline: float
    priority: int
    prompt_len: int
    #: Output positions padded to whole blocks.
    output_len: int
    block_length: int
    steps_done: int
    unmasked: int
    unmasked_in_block: int
    current_block: int
    instance: int | None
    next_kind: StepKindName
    in_flight: bool
    allowed: list[float]
    #: Highest threshold load control currently leaves the request.
    max_tau: float
    last_tau: float | None
    #: `(cache steps, recompute steps)` left, per candidate threshold.
    predictions: list[tuple[float, float]]
    #: Confidence features of the current block from the last report (see `StepResult`).
    confidence: Confidence | None


@dataclass(frozen=True)
class InstanceInfo:
    id: int
    tp: int
    gpus: list[int]
    node: int
    draining: bool
    #: Requests of the step in flight; empty when idle.
    batch: list[int]
    #: Requests of the step queued behind it (overlap); empty when none is.
    ahead: list[int]
    batch_tokens: int
    predicted_finish: float | None
    residents: int
    resident_tokens: int
    #: KV tokens they hold, a stored prompt block read by several counted once (what
    #: admission checks against `kv_tokens`).
    kv_used_tokens: int
    #: Measured / predicted step-time correction.
    factor: float
    steps_run: int
    #: Most sequence tokens resident at once; None: unbounded.
    kv_tokens: int | None
    #: Most requests resident at once; None: unbounded.
    max_requests: int | None
    #: Batch-token budget of one step (its own, or the scheduler's).
    max_batch_tokens: int
    #: Request the instance is reserved for: it takes no other new request meanwhile.
    reserved_for: int | None


class BatchCommand(NamedTuple):
    """One batch of a round as an engine sends it (`Scheduler.schedule_commands`)."""

    instance: int
    requests: list[int]
    taus: list[float]
    kinds: list[int]
    release: list[int]
    new_here: list[int]
    predicted_s: float


class Decisions:
    """One round's decisions. Columns are read-only numpy views of the core's packed records
    (entries grouped by batch, batches in instance announcement order); `batches`,
    `migrations` and `waiting` build record lists on first access."""

    def __init__(self, core: _core.Decisions) -> None:
        self._core = core
        batches = np.frombuffer(core.batches, dtype=_BATCH)
        entries = np.frombuffer(core.entries, dtype=_ENTRY)
        waiting = np.frombuffer(core.waiting, dtype=_WAITING)
        #: Instance id of each batch.
        self.batch_instances: np.ndarray = batches["instance"]
        #: Index of each batch's first entry in the entry columns.
        self.batch_starts: np.ndarray = batches["start"]
        self.batch_lens: np.ndarray = batches["len"]
        self.batch_tokens: np.ndarray = batches["tokens"]
        #: Predicted end time of each batch's step (after the step in flight, for a step
        #: ahead), and its predicted duration.
        self.batch_finish: np.ndarray = batches["finish"]
        self.batch_predicted_s: np.ndarray = batches["predicted_s"]
        #: Each batch's released requests: `releases[start : start + len]`.
        self.batch_release_starts: np.ndarray = batches["release_start"]
        self.batch_release_lens: np.ndarray = batches["release_len"]
        self.releases: np.ndarray = np.frombuffer(core.releases, dtype="<u8")
        self.entry_requests: np.ndarray = entries["request"]
        self.entry_taus: np.ndarray = entries["tau"]
        #: Step kind codes; `STEP_KINDS[code]` names them.
        self.entry_kinds: np.ndarray = entries["kind"]
        self.entry_new_here: np.ndarray = entries["new_here"]
        #: Steps ahead: they follow the request's step in flight (`BatchEntry.ahead`).
        self.entry_ahead: np.ndarray = entries["ahead"]
        #: Tokens each step feeds the model.
        self.entry_tokens: np.ndarray = entries["tokens"]
        #: Output block index of each step.
        self.entry_blocks: np.ndarray = entries["block"]
        #: Positions of that block already unmasked.
        self.entry_unmasked_in_block: np.ndarray = entries["unmasked_in_block"]
        #: Why each entry got its τ: codes into `THRESHOLD_REASONS`, the predicted seconds
        #: left at that τ on its instance, the seconds left to its deadline, and the
        #: highest τ load control allowed it (NaN where not applicable).
        self.entry_reasons: np.ndarray = entries["reason"]
        self.entry_estimates_s: np.ndarray = entries["estimate_s"]
        self.entry_slo_left_s: np.ndarray = entries["slo_left_s"]
        self.entry_cap_taus: np.ndarray = entries["cap_tau"]
        self.waiting_requests: np.ndarray = waiting["request"]
        #: Wait reason codes; `WAIT_REASONS[code]` names them.
        self.waiting_reasons: np.ndarray = waiting["reason"]

    @property
    def now(self) -> float:
        return self._core.now

    @property
    def elapsed_s(self) -> float:
        """Seconds the round took inside the Rust core."""
        return self._core.elapsed_s

    @property
    def overloaded(self) -> bool:
        """Load control found the cluster overloaded in this round."""
        return self._core.overloaded

    @cached_property
    def batches(self) -> list[Batch]:
        requests = self.entry_requests.tolist()
        taus = self.entry_taus.tolist()
        kinds = [STEP_KINDS[k] for k in self.entry_kinds.tolist()]
        new = self.entry_new_here.tolist()
        tokens_ = self.entry_tokens.tolist()
        blocks = self.entry_blocks.tolist()
        unmasked = self.entry_unmasked_in_block.tolist()
        ahead = self.entry_ahead.tolist()
        releases = self.releases.tolist()
        out = []
        for instance, start, length, tokens, finish, r_start, r_len in zip(
            self.batch_instances.tolist(),
            self.batch_starts.tolist(),
            self.batch_lens.tolist(),
            self.batch_tokens.tolist(),
            self.batch_finish.tolist(),
            self.batch_release_starts.tolist(),
            self.batch_release_lens.tolist(),
            strict=True,
        ):
            entries = [
                BatchEntry(
                    requests[i],
                    taus[i],
                    kinds[i],  # type: ignore[arg-type]
                    new[i],
                    tokens_[i],
                    blocks[i],
                    unmasked[i],
                    ahead[i],
                )
                for i in range(start, start + length)
            ]
            out.append(
                Batch(instance, entries, tokens, finish, tuple(releases[r_start : r_start + r_len]))
            )
        return out

    @cached_property
    def migrations(self) -> list[Migration]:
        return [Migration(*m) for m in self._core.migrations()]

    @cached_property
    def waiting(self) -> list[Waiting]:
        reasons = self.waiting_reasons.tolist()
        return [
            Waiting(r, WAIT_REASONS[c])
            for r, c in zip(self.waiting_requests.tolist(), reasons, strict=True)
        ]

    def batch_for(self, instance: int) -> Batch | None:
        """The batch of one instance, if it got one."""
        return next((b for b in self.batches if b.instance == instance), None)

    def __repr__(self) -> str:
        return repr(self._core)


class Scheduler:
    """DiLaServe's step-level scheduler: SLO-aware thresholds, adaptive load control,
    earliest-completion instance choice and migration between steps (DESIGN §4–§6).

    Not thread-safe: one engine loop owns it.
    """

    def __init__(self, profile: LatencyProfile, config: SchedulerConfig | None = None) -> None:
        self.config = c = config if config is not None else SchedulerConfig()
        rates = None if c.predictor_rates is None else [tuple(r) for r in c.predictor_rates]
        self._core = _core.Scheduler(
            profile,
            json.dumps(settings_values(c, SCHEDULER_SETTINGS)),
            predictor_rates=rates,
            predictor=getattr(c.predictor, "native", c.predictor),
            predictor_model=None if c.predictor_model is None else str(c.predictor_model),
        )

    @property
    def thresholds(self) -> list[float]:
        """Candidate thresholds, ascending."""
        return self._core.thresholds

    def set_predictor_rates(self, points: Sequence[tuple[float, float]]) -> None:
        """Predicts remaining steps from this mean-rate table from each live request's
        next refresh on (a table learned while serving)."""
        self._core.set_predictor_rates([tuple(p) for p in points])

    @property
    def active_requests(self) -> int:
        return self._core.active_requests

    @property
    def queued_requests(self) -> int:
        """Requests that arrived and were never dispatched."""
        return self._core.queued_requests

    @property
    def overloaded(self) -> bool:
        """Whether the last round's load control found that even every request at its
        lowest allowed threshold exceeds the cluster's capacity (False without load
        control)."""
        return self._core.overloaded

    def arrive(
        self,
        request_id: int,
        *,
        arrival: float,
        deadline: float,
        prompt_len: int,
        output_len: int,
        priority: int = 0,
        block_length: int | None = None,
        thresholds: Sequence[float] | None = None,
        explicit_deadline: bool = True,
        pinned_tau: float | None = None,
        mask_token: int | None = None,
        stop_tokens: Sequence[int] = (),
        fixed_schedule: bool = False,
        lead_tokens: Sequence[int] = (),
    ) -> None:
        """Admits a request; `deadline` is absolute, on the clock of `schedule(now)`.

        With `mask_token` (and `block_length`) the scheduler also keeps the request's token
        state: step reports are then applied with `apply_report`, which knows the request
        is done once every output position is unmasked or one of `stop_tokens` is committed
        with everything before it unmasked. `fixed_schedule`: the request ignores τ (its
        commits are left out of `ReportOutcome.rates`). `lead_tokens`: the prompt's tail
        that opens a block diffusion request's first output block (`RequestState.lead`),
        counted in `output_len` and never in its text.

        `thresholds` restricts the candidates it may run at; `pinned_tau` instead runs every
        step at exactly that value, a candidate or not (planned with the nearest
        candidate's predictions).

        While the cluster is overloaded (`overloaded`) and `SchedulerConfig.max_queued`
        requests already wait for their first step, raises `AdmissionError`. Deadline
        admission (`Policy.admission`) refuses only a request whose deadline the caller
        asked for (`explicit_deadline`); one with the server's default deadline that it
        would refuse is served best-effort. A request past its deadline still runs to
        completion unless cancelled.
        """
        self._core.arrive(
            request_id,
            arrival=arrival,
            deadline=deadline,
            prompt_len=prompt_len,
            output_len=output_len,
            priority=priority,
            block_length=block_length,
            thresholds=None if thresholds is None else list(thresholds),
            explicit_deadline=explicit_deadline,
            pinned_tau=pinned_tau,
            mask_token=mask_token,
            stop_tokens=list(stop_tokens),
            fixed_schedule=fixed_schedule,
            lead_tokens=list(lead_tokens),
        )

    def apply_report(self, instance: int, measured_s: float, report: StepReport) -> ReportOutcome:
        """Applies a worker's step report (its columns, one call into the core) to the
        token state of the requests that arrived with one and to the scheduler, as
        `step_done` does, all or nothing: a report that does not match the batch in flight
        or the token state (a position outside its block or already unmasked) raises
        `StepReportError` and changes nothing. Rows naming requests cancelled while the
        step ran are ignored."""
        finished, updates, rates = self._core.apply_report(
            instance,
            measured_s,
            report.requests,
            report.blocks,
            report.counts,
            report.positions,
            report.tokens,
            report.confidence,
            report.timesteps,
        )
        return ReportOutcome(
            [FinishedOutput(FinishedRequest(*f), ids, n) for f, ids, n in finished],
            updates,
            rates,
        )

    def token_state(self, request_id: int) -> TokenState:
        """The token state of a live request that arrived with a mask token."""
        return TokenState(*self._core.token_state(request_id))

    def step_done(
        self, instance: int, measured_s: float, results: Iterable[StepResult]
    ) -> list[FinishedRequest]:
        """Applies the report of an instance's finished step; returns the requests that
        finished, with their statistics.

        Every request of the batch needs a result, except ones cancelled meanwhile (results
        naming those are ignored, even if a new request reuses the id).
        """
        return [
            FinishedRequest(*f) for f in self._core.step_done(instance, measured_s, list(results))
        ]

    def abort_step(self, instance_id: int) -> list[int]:
        """The step in flight on an instance failed (send failed, worker died, out of
        memory). The instance becomes idle; the step's requests are ready again with no
        progress counted and hold no state there (with caching their next step recomputes;
        a move elsewhere is reported as a `step_aborted` migration). Returns their ids."""
        return self._core.abort_step(instance_id)

    def expect_prefix(self, request_id: int, instance_id: int, tokens: int) -> None:
        """Prefix sharing: instance `instance_id` is expected to hold the exact K/V of the
        request's first `tokens` prompt tokens (whole blocks), so its first step there feeds
        only what follows them and placement weighs that instance at the shorter step. Only
        before the request's first dispatch, under the exact block cache."""
        self._core.expect_prefix(request_id, instance_id, tokens)

    def read_prefix(self, instance_id: int, request_id: int, keys: Sequence[int]) -> None:
        """Prefix sharing: the request, in the step in flight on `instance_id`, reads the
        stored prompt blocks `keys` there (as its worker reported with that step,
        `StepReport.prefix_reads`): the instance's KV use counts each such block once however
        many residents read it. Ignored for a request not in that step. Names a block twice,
        or more blocks than its prompt holds: `StepReportError`."""
        self._core.read_prefix(instance_id, request_id, list(keys))

    def cancel(self, request_id: int) -> None:
        self._core.cancel(request_id)

    def add_instance(
        self,
        instance_id: int,
        *,
        tp: int,
        gpus: Sequence[int],
        node: int = 0,
        kv_tokens: int | None = None,
        max_requests: int | None = None,
        max_batch_tokens: int | None = None,
    ) -> None:
        """Announces an instance. `kv_tokens` bounds the sequence tokens (prompt + padded
        output) of its resident requests, a stored prompt block several of them read counted
        once (`read_prefix`), `max_requests` their number, `max_batch_tokens`
        the tokens of one step (None: the config's). None leaves a bound off."""
        self._core.add_instance(
            instance_id,
            tp=tp,
            gpus=list(gpus),
            node=node,
            kv_tokens=kv_tokens,
            max_requests=max_requests,
            max_batch_tokens=max_batch_tokens,
        )

    def drain_instance(self, instance_id: int) -> None:
        """Sends no new requests there; held requests leave at their next recompute step."""
        self._core.drain_instance(instance_id)

    def undrain_instance(self, instance_id: int) -> None:
        """Lets a draining instance take requests again."""
        self._core.undrain_instance(instance_id)

    def drained_instances(self) -> list[int]:
        """Draining instances that are idle and hold no request: safe to stop."""
        return self._core.drained_instances()

    def remove_instance(self, instance_id: int) -> None:
        """Forgets an instance; its requests lose their cache and are placed again."""
        self._core.remove_instance(instance_id)

    def schedule(self, now: float) -> Decisions:
        """Runs one round; dispatched requests are in flight until their `step_done`."""
        return Decisions(self._core.schedule(now))

    def schedule_commands(self, now: float) -> list[BatchCommand]:
        """Runs one round as `schedule` does, returning only what an engine sends: per
        batch, in the order of `Decisions.batches`, its instance, its entries' requests, τs
        and kind codes (`STEP_KINDS[code]`; `len(STEP_KINDS)` for a step ahead), the ids
        it releases, the ids new there, and the step's predicted seconds."""
        return [BatchCommand(*b) for b in self._core.schedule_commands(now)]

    def instance_ids(self) -> list[int]:
        return self._core.instance_ids()

    def served_so_far(self, request_id: int) -> FinishedRequest:
        """How a live request has been served so far, in `step_done`'s form."""
        return FinishedRequest(*self._core.served_so_far(request_id))

    def request(self, request_id: int) -> RequestInfo:
        return RequestInfo(**self._core.request(request_id))

    def instance(self, instance_id: int) -> InstanceInfo:
        return InstanceInfo(**self._core.instance(instance_id))
