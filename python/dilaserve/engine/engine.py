"""The serving engine: one asyncio loop that owns the Rust scheduler and drives workers.

Every decision is the scheduler's (DESIGN §10): which requests step where, at which τ and
of which kind, which requests an instance takes in (`new_here`) and drops (`release`), and
each request's statistics. The engine executes them. Arrivals, cancellations, step
reports, worker start-ups and exits are handled as they come, each leaving the scheduler
consistent; then one scheduling round (under a millisecond, run inline) decides the next
batch of every idle instance, and each batch goes out as one `StepCommand` that also
carries the token state of requests new to that instance and the ids that left it.

The step path handles no per-request object: a batch leaves as the columns the scheduler
hands out for it (`Scheduler.schedule_commands`), and a report's columns are applied to the
authoritative token state and to the scheduler in one call into the core
(`Scheduler.apply_report`).
Per request, the engine acts only on events: a finished request, newly complete blocks.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import itertools
import logging
import time
from collections.abc import AsyncIterator, Sequence

from dilaserve.models import text_decoder
from dilaserve.predictor.serving import predictor_for
from dilaserve.protocol import (
    CacheMode,
    PrefixUse,
    RequestState,
    Shutdown,
    StepCommand,
    StepKind,
    StepReport,
    WorkerLeaving,
    WorkerMessage,
    WorkerReady,
)
from dilaserve.scheduler import (
    STEP_KINDS,
    AdmissionError,
    BatchCommand,
    Scheduler,
    SchedulerError,
    StepReportError,
)
from dilaserve.tiny import model_path

from .admission import RequestBuilder, threshold_options
from .config import EngineConfig, GenerationParams
from .degrees import ModelDegrees
from .delivery import Delivery, QueuedDelivery
from .emulation import EmulatedLauncher, emulated_config
from .errors import (
    BadRequestError,
    EngineError,
    EngineStoppedError,
    OverloadedError,
    RequestCancelledError,
    RequestFailedError,
    UnknownRequestError,
)
from .instances import InflightStep, InstanceRecord, StepTimes
from .launcher import Launcher, LocalLauncher, WorkerHandle, WorkerSpec
from .prefix_index import PrefixIndex
from .profiles import load_or_measure_profile
from .quality import default_slo_thresholds, quality_floor
from .rates import MIN_STEPS, OnlineRates
from .reconfigure import Reconfigurer
from .requests import RequestOutput, RequestStats, TrackedRequest, read_outputs
from .status import EngineStatus, InstanceStatus, PlanStatus
from .transport import SendError, WorkerChannel

log = logging.getLogger(__name__)

#: `StepKind` of each of the core's step kind codes, indexed by code; then `AUTO`, the
#: kind of a step ahead (the worker resolves it).
_KIND_OF_CODE = (*(StepKind(k) for k in STEP_KINDS), StepKind.AUTO)

#: How long a worker may take to load its model and report ready.
READY_TIMEOUT_S = 300.0


class Engine:
    """Serves one model on a set of instances. Use as `async with Engine(config) as e:`.

    Not thread-safe: every method runs on the loop that started the engine (use
    `dilaserve.engine.LLM` from synchronous code).
    """

    def __init__(
        self,
        config: EngineConfig | None = None,
        launcher: Launcher | None = None,
        delivery: Delivery | None = None,
    ):
        self.config = config or EngineConfig()
        self._given_delivery = delivery
        if launcher is None and self.config.emulate:
            launcher = EmulatedLauncher(self.config.profile, self.config.progress)
        self.launcher = launcher or LocalLauncher()
        self.model_dir = model_path(self.config.model)
        self.instances: dict[int, InstanceRecord] = {}
        self._requests: dict[int, TrackedRequest] = {}
        self._workers: dict[int, InstanceRecord] = {}
        self._next_request_id = 1
        self._worker_ids = itertools.count(1)
        self._instance_ids = itertools.count(0)
        self._step_numbers = itertools.count(1)
        self._wake = asyncio.Event()
        self._tasks: list[asyncio.Task[None]] = []
        self._running = False
        self._t0 = time.monotonic()
        self.restarts = 0
        self.step_times = StepTimes()
        self.prefix_cache = PrefixUse()
        self._rounds = 0
        #: Launches a reconfiguration still has to make: while any are pending, requests
        #: wait for them instead of failing when no instance is left.
        self.launches_pending = 0
        self.prefixes: PrefixIndex | None = None

    # -- life cycle ------------------------------------------------------------------------

    async def __aenter__(self) -> Engine:
        await self.start()
        return self

    async def __aexit__(self, *exc: object) -> None:
        await self.shutdown()

    async def start(self) -> None:
        """Loads the tokenizer and latency profile, starts every instance, waits until all
        are ready."""
        if self.config.emulate:
            self.config = emulated_config(self.config)
        served = predictor_for(self.model_dir, self.config.predictor_rates)
        c = self.config = dataclasses.replace(
            self.config,
            predictor_rates=served.rates,
            thresholds=quality_floor(
                self.config.thresholds, self.model_dir, self.config.max_accuracy_drop
            ),
        )
        self.degrees = ModelDegrees.of(self.model_dir)
        self.degrees.check(c.instances)
        if self.degrees.config.block_size:  # the blocks a block diffusion model decodes
            c = self.config = dataclasses.replace(c, block_length=self.degrees.config.block_size)
        self.profile = await load_or_measure_profile(c, self.model_dir)
        self.planner_degrees = self.degrees.for_planner(c, self.profile)
        self.builder = RequestBuilder(c, self.model_dir, self.profile)
        self.tokenizer = self.builder.tokenizer
        self.delivery = self._given_delivery or QueuedDelivery(text_decoder(self.tokenizer))
        self._learns_predictor = served.model is None
        self.rates = None if served.rates is not None else self._assume_rates()
        self.default_slo_thresholds = default_slo_thresholds(
            c.thresholds, self.model_dir, c.max_accuracy_drop
        )
        self.scheduler = Scheduler(
            self.profile,
            c.scheduler_config(
                predictor_rates=None if served.model else c.predictor_rates,
                predictor_model=None if served.model is None else str(served.model),
            ),
        )
        #: Under the exact block cache with prefix sharing: which prompt blocks each
        #: instance is expected to hold, so placement counts a stored system prompt.
        self.prefixes = (
            PrefixIndex(c.block_length) if c.cache is CacheMode.BLOCK and c.prefix_caching else None
        )
        self.reconfigurer = Reconfigurer(self)
        await self.launcher.start(self.reconfigurer.on_nodes_changed)
        self._channel = WorkerChannel(self._on_message, self.launcher.endpoint_host)
        self._channel.start()
        self._running = True
        loop = asyncio.get_running_loop()
        self._tasks.append(loop.create_task(self._loop()))
        if c.replan_interval_s:
            self._tasks.append(loop.create_task(self._replan_every()))
        placements = self.reconfigurer.initial_placement(c.instances)
        await asyncio.gather(*(self.launch_instance(*p) for p in placements))

    async def shutdown(self) -> None:
        """Stops every worker; requests still running fail with `EngineStoppedError`."""
        if not self._running:
            return
        self._running = False
        for req in list(self._requests.values()):
            self._fail(req, EngineStoppedError("the engine is shutting down"))
        for inst in list(self.instances.values()):
            inst.stopping = True
            if inst.handle is not None:
                self._send(inst, Shutdown())
        waits = [inst.stopped for inst in self.instances.values()]
        if waits:
            done, pending = await asyncio.wait(waits, timeout=10.0)
            for inst in list(self.instances.values()):
                if inst.handle is not None and not inst.stopped.done():
                    inst.handle.kill()
            if pending:
                await asyncio.wait(pending, timeout=5.0)
        for task in self._tasks:
            task.cancel()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        await self._channel.close()
        await self.launcher.close()

    def now(self) -> float:
        """Seconds on the scheduler's clock."""
        return time.monotonic() - self._t0

    def _assume_rates(self) -> OnlineRates:
        rates = OnlineRates(
            [(o.threshold, o.tokens_per_step) for o in threshold_options(self.config)]
        )
        log.warning(
            "tokens per step per threshold are assumed (Fast-dLLM's GSM8K figures for "
            "LLaDA-8B: %s) until measured on %s: each threshold's own rate replaces them once "
            "it has run %d steps; default SLOs and predictions follow",
            ", ".join(f"τ {t}: {r:.2f}" for t, r in rates.table),
            self.model_dir,
            MIN_STEPS,
        )
        return rates

    def tokens_per_step(self) -> dict:
        """The served model's tokens per step per threshold, and whether they are given
        (`measured` on the checkpoint, or configured), `assumed`, or `learned` here."""
        if self.rates is None:
            return {"source": "measured", "table": self.config.predictor_rates}
        source = "learned" if self.rates.measured else "assumed"
        return {"source": source, "measured": self.rates.measured, "table": self.rates.table}

    def _learn_rates(self, tau: float, steps: int, committed: int) -> None:
        """Counts `steps` threshold-rule steps at `tau` towards the served model's rates;
        adopts a revised table."""
        if self.rates is None or not self.rates.record(tau, steps, committed):
            return
        table = self.rates.table
        log.info(
            "tokens per step learned from served requests: %s (measured: %s)",
            ", ".join(f"τ {t}: {r:.2f}" for t, r in table),
            self.rates.measured,
        )
        self.config = dataclasses.replace(self.config, predictor_rates=table)
        self.builder.config = self.config
        self.reconfigurer.settings_changed()
        if self._learns_predictor:
            self.scheduler.set_predictor_rates(table)

    # -- requests --------------------------------------------------------------------------

    def add_request(
        self, prompt: str | Sequence[int], params: GenerationParams | None = None
    ) -> TrackedRequest:
        """Admits a request; raises `BadRequestError` or `OverloadedError` at once."""
        return self.add_requests([(prompt, params or GenerationParams())])[0]

    def add_requests(
        self, requests: Sequence[tuple[str | Sequence[int], GenerationParams]]
    ) -> list[TrackedRequest]:
        """Admits several requests as one (a list of prompts, `n` samples): each is its own
        request to the scheduler, all are checked before any is admitted, and if one is
        refused none stays. A bad one raises `BadRequestError` with its `index`."""
        if not self._running:
            raise EngineStoppedError("the engine is not running")
        built = []
        for index, (prompt, params) in enumerate(requests):
            try:
                state, slo = self.builder.build(self._next_request_id + index, prompt, params)
            except BadRequestError as exc:
                raise BadRequestError(str(exc), index) from exc
            built.append((state, slo, params))
        self._next_request_id += len(built)
        admitted: list[TrackedRequest] = []
        try:
            for index, (state, slo, params) in enumerate(built):
                admitted.append(self._admit(index, state, slo, params))
        except EngineError:
            for req in admitted:
                self._fail(req, RequestCancelledError(f"request {req.id}: a sibling was refused"))
            raise
        self._wake.set()
        return admitted

    def _admit(
        self, index: int, state: RequestState, slo: float, params: GenerationParams
    ) -> TrackedRequest:
        now = self.now()
        pinned = params.threshold
        thresholds = None
        if pinned is None and params.slo_s is None:
            thresholds = self.default_slo_thresholds
        try:
            self.scheduler.arrive(
                state.request_id,
                arrival=now,
                deadline=now + slo,
                prompt_len=state.prompt_length,
                output_len=state.output_length,
                priority=params.priority,
                block_length=state.block_length,
                thresholds=thresholds,
                explicit_deadline=params.slo_s is not None,
                pinned_tau=pinned,
                mask_token=state.mask_token_id,
                stop_tokens=state.stop_token_ids,
                fixed_schedule=state.steps_per_block is not None and not state.threshold_floor,
                lead_tokens=state.output_ids[: state.lead],
            )
        except AdmissionError as exc:
            raise OverloadedError(str(exc)) from exc
        except SchedulerError as exc:
            raise BadRequestError(str(exc), index) from exc
        keys, hit = [], None
        if self.prefixes is not None:
            keys = self.prefixes.keys(state.prompt_ids)
            hit = self.prefixes.longest(keys)
        if hit is not None:
            try:  # a hint: a request it cannot take is placed as without it
                self.scheduler.expect_prefix(state.request_id, *hit)
            except SchedulerError as exc:
                log.warning("request %d: stored prefix not expected: %s", state.request_id, exc)
        req = TrackedRequest(state=state, arrival=now, slo_s=slo, block_keys=keys)
        self._requests[req.id] = req
        self.reconfigurer.record(now, state.prompt_length, state.output_length)
        return req

    async def submit(
        self, requests: Sequence[tuple[str | Sequence[int], GenerationParams]]
    ) -> list[TrackedRequest]:
        """`add_requests` as a front end calls it (a core in another process answers
        asynchronously)."""
        return self.add_requests(requests)

    def encode(self, prompt: str) -> list[int]:
        """A prompt's token ids, checked against the model (`BadRequestError`). Safe to run
        in a worker thread, so that long prompts never hold up the engine's loop."""
        return self.builder.prompts.prompt_ids(prompt)

    async def generate(
        self, prompt: str | Sequence[int], params: GenerationParams | None = None
    ) -> AsyncIterator[RequestOutput]:
        """Yields an update each time blocks are complete, the last with `finished` and
        the request's statistics. Leaving the iteration early cancels the request."""
        req = self.add_request(prompt, params)
        async with contextlib.aclosing(self.outputs(req)) as outputs:
            async for output in outputs:
                yield output

    def outputs(self, req: TrackedRequest) -> AsyncIterator[RequestOutput]:
        """The updates of an admitted request (see `generate`); leaving the iteration early
        cancels it."""
        return read_outputs(req.outputs, lambda: self.cancel(req.id))

    async def complete(
        self, prompt: str | Sequence[int], params: GenerationParams | None = None
    ) -> RequestOutput:
        """The final output of one request."""
        outputs = [out async for out in self.generate(prompt, params)]
        return outputs[-1]

    def cancel(self, request_id: int) -> None:
        """Stops a request and frees its capacity; a no-op for one already ended."""
        req = self._requests.get(request_id)
        if req is None and not 0 < request_id < self._next_request_id:
            raise UnknownRequestError(f"no request {request_id} was ever issued")
        if req is not None:
            self._fail(req, RequestCancelledError(f"request {request_id} was cancelled"))
            self._wake.set()

    def stats_of(self, request_id: int) -> RequestStats | None:
        """How a live request has been served so far; None once it has ended."""
        req = self._requests.get(request_id)
        if req is None:
            return None
        tokens = self.scheduler.token_state(request_id)
        return req.stats(
            self.scheduler.served_so_far(request_id), tokens.completion_tokens, self.now()
        )

    async def request_stats(self, request_id: int) -> RequestStats | None:
        """`stats_of` as a front end calls it."""
        return self.stats_of(request_id)

    def instance_of(self, request_id: int) -> int | None:
        """The instance holding a live request's state (None: none does)."""
        return self.scheduler.request(request_id).instance

    @property
    def active_requests(self) -> int:
        return len(self._requests)

    def status(self) -> EngineStatus:
        """A snapshot of the instances, the load, the last plan and the step times."""
        instances = []
        for inst in sorted(self.instances.values(), key=lambda i: i.id):
            state = "stopping" if inst.stopping else "serving" if inst.registered else "starting"
            entry = InstanceStatus(
                inst.id, inst.tp, inst.gpus, inst.node, state, inst.restarts, inst.registered
            )
            if inst.registered:
                info = self.scheduler.instance(inst.id)
                entry = dataclasses.replace(
                    entry,
                    batch_tokens=info.batch_tokens,
                    residents=info.residents,
                    resident_tokens=info.resident_tokens,
                    kv_used_tokens=info.kv_used_tokens,
                    steps_run=info.steps_run,
                )
            instances.append(entry)
        plan = self.reconfigurer.last_plan
        return EngineStatus(
            instances=tuple(instances),
            active_requests=self.active_requests,
            overloaded=self.scheduler.overloaded,
            plan=None
            if plan is None
            else PlanStatus(
                plan.adopted, plan.reason, {d.degree: d.instances for d in plan.capacity.degrees}
            ),
            planner_runs=self.reconfigurer.runs,
            planner_solve_seconds=self.reconfigurer.solve_seconds,
            worker_restarts=self.restarts,
            step_times=dataclasses.asdict(self.step_times),
            tokens_per_step=self.tokens_per_step(),
            prefix_cache=dataclasses.asdict(self.prefix_cache),
            taken_s=self.now(),
        )

    def _fail(self, req: TrackedRequest, error: BaseException) -> None:
        """Ends a live request with `error`, freeing its capacity everywhere."""
        self._requests.pop(req.id, None)
        with contextlib.suppress(SchedulerError):  # not known there: refused at arrival
            self.scheduler.cancel(req.id)
        self.delivery.fail(req, error)

    def spawn(self, coroutine) -> asyncio.Task[None]:
        """Runs `coroutine` on the engine's loop until it ends or the engine stops."""
        task = asyncio.get_running_loop().create_task(coroutine)
        self._tasks.append(task)
        return task

    # -- instances -------------------------------------------------------------------------

    async def scale_to(self, targets: dict[int, int]) -> None:
        """Reconfigures to `targets` instances per TP degree while serving."""
        await self.reconfigurer.scale_to(targets)

    async def _replan_every(self) -> None:
        """Replans whenever the replanner says a plan is due."""
        while True:
            await asyncio.sleep(max(0.0, self.reconfigurer.next_plan - self.now()))
            try:
                await self.reconfigurer.replan()
            except Exception:
                log.exception("periodic replan failed")
                await asyncio.sleep(self.config.replan_interval_s or 0.0)

    async def launch_instance(self, tp: int, gpus: tuple[int, ...], node: int = 0) -> int:
        """Starts an instance of `tp` ranks on devices `gpus` and returns its id once it
        serves; a degree the model cannot be split into raises `UnsupportedDegreeError`."""
        self.degrees.check((tp,))
        if len(gpus) != tp:
            raise ValueError(f"a TP-{tp} instance needs {tp} devices, got {gpus}")
        inst = InstanceRecord(next(self._instance_ids), tp, gpus, node)
        self.instances[inst.id] = inst
        await self._start_worker(inst)
        await asyncio.wait_for(asyncio.shield(inst.started), READY_TIMEOUT_S)
        if inst.id not in self.instances:
            raise EngineStoppedError(f"instance {inst.id} failed to start")
        return inst.id

    async def stop_instance(self, instance_id: int, *, handover: bool = False) -> None:
        """Drains an instance (its requests migrate away at their next recompute step),
        then stops its worker; returns once it has exited. With `handover` (the last
        instance of a reconfiguration that launches others next) it does not wait for
        somewhere to migrate to: its requests wait, holding only the engine's copy of their
        state, and resume on the next instance with a recompute step."""
        inst = self.instances[instance_id]
        inst.stopping = True
        if handover and inst.handle is not None and not inst.shutdown_sent:
            self._forget(inst)
            inst.shutdown_sent = True
            self._send(inst, Shutdown())
        elif inst.registered:
            self.scheduler.drain_instance(instance_id)
        elif inst.handle is not None:
            inst.handle.kill()
        self._wake.set()
        await asyncio.shield(inst.stopped)

    async def _start_worker(self, inst: InstanceRecord) -> None:
        c = self.config
        if inst.started.done():
            inst.started = asyncio.get_running_loop().create_future()
        worker_id = next(self._worker_ids)
        spec = WorkerSpec(
            instance=inst.id,
            worker_id=worker_id,
            endpoint=self._channel.endpoint,
            model=self.model_dir,
            cache=c.cache,
            max_requests=c.max_requests_per_instance,
            kv_cache_memory=c.kv_cache_memory,
            prefix_caching=c.prefix_caching,
            tp=inst.tp,
            dtype=c.dtype,
            device=c.device if c.device == "cpu" else f"{c.device}:{inst.gpus[0]}",
            threads=c.worker_threads,
            devices=tuple(c.device if c.device == "cpu" else f"{c.device}:{g}" for g in inst.gpus),
            node=inst.node,
            keys=self._channel.worker_keys,
        )
        try:
            handle = await self.launcher.launch(spec)
        except Exception:
            log.exception("instance %d: launch failed; giving it up", inst.id)
            self._retire(inst)
            raise
        inst.handle = handle
        self._workers[worker_id] = inst
        self._tasks.append(asyncio.get_running_loop().create_task(self._watch(inst, handle)))

    async def _watch(self, inst: InstanceRecord, handle: WorkerHandle) -> None:
        code = await handle.wait()
        self._on_exit(inst, handle, code)

    def _on_exit(self, inst: InstanceRecord, handle: WorkerHandle, code: int) -> None:
        self._workers.pop(handle.spec.worker_id, None)
        if inst.handle is not handle:
            return
        inst.handle = None
        self._forget(inst)
        if inst.stopping or not self._running:
            log.info("instance %d stopped (exit code %d)", inst.id, code)
            self._retire(inst)
            return
        log.error("instance %d: worker died (exit code %d); restarting", inst.id, code)
        inst.restarts += 1
        self.restarts += 1
        if inst.restarts > self.config.max_restarts:
            log.error("instance %d: restarted %d times; giving it up", inst.id, inst.restarts - 1)
            self._retire(inst)
        else:
            self._tasks.append(asyncio.get_running_loop().create_task(self._start_worker(inst)))
        self._wake.set()

    def lose_instance(self, instance_id: int) -> None:
        """The instance's placement is gone (its node left the cluster): its requests
        resume elsewhere now, and it is stopped, not restarted."""
        inst = self.instances.get(instance_id)
        if inst is None:
            return
        inst.stopping = True
        self._forget(inst)
        if inst.handle is None:
            self._retire(inst)
        else:
            inst.handle.kill()
        self._wake.set()

    def _forget(self, inst: InstanceRecord) -> None:
        """The instance's worker is gone: its requests resume elsewhere from the engine's
        copy of their token state (the scheduler places them again)."""
        if inst.registered:
            self.scheduler.remove_instance(inst.id)
            inst.registered = False
        if self.prefixes is not None:
            self.prefixes.remove_instance(inst.id)
        inst.inflight = inst.ahead = None

    def _retire(self, inst: InstanceRecord) -> None:
        self.instances.pop(inst.id, None)
        for future in (inst.started, inst.stopped):
            if not future.done():
                future.set_result(None)
        self.fail_if_unserved()

    def fail_if_unserved(self) -> None:
        """Fails every request that no instance left can hold, once none is about to be
        launched or is still starting: all of them when no instance is left, else those
        longer than every KV cache (they were admitted while a larger instance ran, and
        would otherwise wait forever)."""
        if not self._running or self.launches_pending:
            return
        if not self.instances:
            for req in list(self._requests.values()):
                self._fail(req, EngineStoppedError("no instance is left to serve requests"))
            return
        readies = [i.ready for i in self.instances.values()]
        if any(r is None or r.kv_tokens is None for r in readies):
            return  # one still starting may hold anything; one without a cache does
        largest = max(r.kv_tokens for r in readies)  # type: ignore[union-attr,type-var]
        for req in list(self._requests.values()):
            if req.state.seq_length > largest:
                self._fail(
                    req,
                    EngineStoppedError(
                        f"request {req.id} needs {req.state.seq_length} tokens of KV cache "
                        f"and no instance left holds more than {largest}"
                    ),
                )

    # -- worker messages -------------------------------------------------------------------

    def _on_message(self, worker_id: int, message: WorkerMessage) -> None:
        inst = self._workers.get(worker_id)
        if inst is None or inst.handle is None or inst.handle.spec.worker_id != worker_id:
            log.warning("message from unknown worker %d ignored", worker_id)
            return
        if isinstance(message, StepReport):
            self._on_report(inst, message)
        elif isinstance(message, WorkerReady):
            self._on_ready(inst, message)
        elif isinstance(message, WorkerLeaving):
            log.info("instance %d asked to stop; draining it", inst.id)
            inst.stopping = True
            if inst.registered:
                self.scheduler.drain_instance(inst.id)
        self._wake.set()

    def _on_ready(self, inst: InstanceRecord, ready: WorkerReady) -> None:
        inst.ready = ready
        self.scheduler.add_instance(
            inst.id,
            tp=inst.tp,
            gpus=list(inst.gpus),
            node=inst.node,
            kv_tokens=ready.kv_tokens,
            max_requests=ready.max_requests,
        )
        inst.registered = True
        if self.prefixes is not None and ready.kv_tokens is not None:
            self.prefixes.add_instance(inst.id, ready.kv_tokens)
        if inst.stopping:
            self.scheduler.drain_instance(inst.id)
        if not inst.started.done():
            inst.started.set_result(None)
        log.info("instance %d ready (pid %d, %s)", inst.id, ready.pid, ready.device)

    def _on_report(self, inst: InstanceRecord, report: StepReport) -> None:
        step = inst.inflight
        if step is None or report.step != step.number:
            return  # a reply to a command whose step was aborted meanwhile
        now = self.now()
        inst.inflight, inst.ahead = inst.ahead, None
        if inst.inflight is None:
            inst.reported_at = (now, self._rounds + 1)
        else:  # the step ahead runs from now: no gap before it
            inst.inflight.sent_at = max(inst.inflight.sent_at, now)
        measured = now - step.sent_at
        self.prefix_cache.queried_tokens += report.prefix_queried_tokens
        self.prefix_cache.hit_tokens += report.prefix_hit_tokens
        if report.failure is not None:
            log.error("instance %d: step %d failed: %s", inst.id, step.number, report.failure)
            self._abort(inst)
            return
        for error in report.errors:
            req = self._requests.get(error.request_id)
            if req is not None:
                self._fail(req, RequestFailedError(error.message))
        for rid, keys in report.prefix_reads.items():
            try:
                self.scheduler.read_prefix(inst.id, rid, keys)
            except StepReportError as exc:  # it stays charged its whole sequence
                log.warning("instance %d: request %d: prefix reads ignored: %s", inst.id, rid, exc)
        try:
            outcome = self.scheduler.apply_report(inst.id, measured, report)
        except StepReportError as exc:
            log.error("instance %d: step %d: bad report: %s", inst.id, step.number, exc)
            self._abort(inst)
            return
        times = self.step_times
        times.steps += 1
        times.worker_s += report.seconds
        times.round_trip_s += measured
        times.predicted_s += step.predicted_s
        for tau, steps, committed in outcome.rates:
            self._learn_rates(tau, steps, committed)
        for rid, ids in outcome.updates:
            self.delivery.update(self._requests[rid], ids)
        for finished in outcome.finished:
            req = self._requests.pop(finished.served.id)
            self.delivery.finish(req, finished.generated, *req.ending(finished, now))

    def _abort(self, inst: InstanceRecord) -> None:
        """The step in flight on `inst` did not happen, nor the one sent ahead of it: their
        requests run again (from the engine's copy), a request whose steps keep failing
        fails alone."""
        inst.inflight = inst.ahead = None
        for rid in self.scheduler.abort_step(inst.id):
            req = self._requests.get(rid)
            if req is None:
                continue
            req.failed_steps += 1
            if req.failed_steps >= self.config.max_step_retries:
                self._fail(req, RequestFailedError(f"request {rid}: its step failed repeatedly"))

    # -- the loop --------------------------------------------------------------------------

    async def _loop(self) -> None:
        while True:
            await self._wake.wait()
            self._wake.clear()
            try:
                self._round()
            except Exception:
                log.exception("scheduling round failed")

    def _round(self) -> None:
        self._rounds += 1
        started = 0
        for batch in self.scheduler.schedule_commands(self.now()):
            started += self._dispatch(self.instances[batch.instance], batch)
        if started and self.config.overlap:
            self._wake.set()  # the next round sends those instances their step ahead
        for instance_id in self.scheduler.drained_instances():
            inst = self.instances.get(instance_id)
            if inst is not None and inst.stopping and not inst.shutdown_sent:
                self._forget(inst)
                inst.shutdown_sent = True
                self._send(inst, Shutdown())

    def _dispatch(self, inst: InstanceRecord, batch: BatchCommand) -> bool:
        """Sends the scheduler's batch as it decided it: its releases, the token state of
        requests new there, and each entry's τ and step kind (`AUTO` for a step ahead).
        With overlap the instance may be running a step: the command queues behind it on
        the worker. Returns whether the instance was idle."""
        command = StepCommand(
            next(self._step_numbers),
            batch.requests,
            batch.taus,
            [_KIND_OF_CODE[k] for k in batch.kinds],
            [self._requests[r].resumable(self.scheduler.token_state(r)) for r in batch.new_here],
            batch.release,
        )
        if self.prefixes is not None:
            for rid in batch.new_here:
                self.prefixes.record(inst.id, self._requests[rid].block_keys)
        sent = self.now()
        step = InflightStep(command.step, sent, batch.predicted_s)
        if inst.inflight is None:
            inst.inflight = step
            if inst.reported_at is not None and inst.reported_at[1] == self._rounds:
                self.step_times.dispatch_gap_s += sent - inst.reported_at[0]
            inst.reported_at = None
        else:
            inst.ahead = step
            self.step_times.steps_ahead += 1
        if not self._send(inst, command):
            self._unreachable(inst)
            return False
        return inst.ahead is None

    def _unreachable(self, inst: InstanceRecord) -> None:
        """A command could not be handed to the worker: it is gone, or cut off. Its requests
        resume elsewhere from the core's token state (no failed step is counted against
        them: nothing ran), and the worker is killed, so that the instance restarts once its
        exit is seen instead of being sent commands in vain until then."""
        self._forget(inst)
        if inst.handle is not None:
            inst.handle.kill()

    def _send(self, inst: InstanceRecord, message: StepCommand | Shutdown) -> bool:
        if inst.handle is None:
            return False
        try:
            self._channel.send(inst.handle.spec.worker_id, message)
        except SendError as exc:
            log.error("instance %d: %s", inst.id, exc)
            return False
        return True
