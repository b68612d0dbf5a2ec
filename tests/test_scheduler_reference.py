"""The Rust scheduler against the independent pure-Python implementation in
tests/sched_reference.py: random event traces under every policy, instance capacity and
admission bound must produce identical decisions and finished-request records, round after
round."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field

import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sched_profiles import make_profile
from sched_reference import ReferenceScheduler, assert_same

from dilaserve.scheduler import (
    AdmissionError,
    InvalidRequestError,
    Policy,
    Scheduler,
    SchedulerConfig,
    StepResult,
)

# Optional (KV tokens, request slots, batch budget) of a new instance.
capacity = st.tuples(
    st.none() | st.sampled_from([400, 900, 3000]),
    st.none() | st.integers(1, 5),
    st.none() | st.sampled_from([300, 800, 1500]),
)

# The reference implements DESIGN §5 as written: window load control, everyone admitted.
# The forecast load control and deadline admission are checked by the core's own tests.
# Instance choice keeps its lookahead (the `paper` preset's is 0), which mixed degrees use.
_PAPER = Policy.dilaserve().window_load_control().without_admission()
POLICIES = [
    _PAPER,
    _PAPER.without_load_control(),
    _PAPER.without_migration(),
    _PAPER.one_shot(),
    dataclasses.replace(
        _PAPER, load_order="priority", predict_every=3, instance_choice="least_loaded"
    ),
    Policy.infaas_like(0.9),
    Policy.llumnix_like(0.7),
]

arrive = st.tuples(
    st.just("arrive"),
    st.integers(0, 600),  # prompt
    st.integers(1, 200),  # output
    st.floats(0.0, 5.0),  # SLO
    st.integers(0, 2),  # priority
    st.integers(0, 31),  # threshold subset
    st.floats(-0.5, 0.0),  # arrival offset: some arrive out of order
)
finish = st.tuples(st.just("finish"), st.integers(0, 99), st.integers(1, 40), st.booleans())
ops = st.one_of(
    arrive,
    finish,
    st.tuples(st.just("schedule")),
    st.tuples(st.just("cancel"), st.integers(0, 999)),
    st.tuples(st.just("reuse"), st.integers(0, 999)),
    st.tuples(st.just("add"), st.sampled_from([1, 2, 4]), capacity),
    st.tuples(st.just("drain"), st.integers(0, 99)),
    st.tuples(st.just("undrain"), st.integers(0, 99)),
    st.tuples(st.just("remove"), st.integers(0, 99)),
    st.tuples(st.just("abort"), st.integers(0, 99)),
)
NO_LIMITS = (None, None, None)


@dataclass
class Lockstep:
    """Feeds identical events to both implementations and compares every round."""

    rust: Scheduler
    ref: ReferenceScheduler
    caching: bool
    max_tokens: int
    now: float = 0.0
    next_id: int = 0
    next_instance: int = 0
    live: list[int] = field(default_factory=list)
    cancelled: list[int] = field(default_factory=list)
    #: Per running batch: its instance and (request, unmasked in block, generation) each.
    running: list[tuple[int, list[tuple[int, int, int]]]] = field(default_factory=list)
    #: Arrivals per id, so a report can tell a reused id from its cancelled namesake.
    generation: dict[int, int] = field(default_factory=dict)
    rounds: int = 0
    dispatched: int = 0
    migrations: int = 0
    waits: set[str] = field(default_factory=set)
    rejected: int = 0

    def both(self, method: str, *args, **kwargs) -> None:
        """Rust first: the reference does no input checks, so it only sees accepted events."""
        getattr(self.rust, method)(*args, **kwargs)
        getattr(self.ref, method)(*args, **kwargs)

    def arrive(self, rid, prompt, output, slo, priority, subset, offset) -> None:
        taus = [t for k, t in enumerate((0.5, 0.6, 0.7, 0.8, 0.9)) if subset >> k & 1]
        arrival = self.now + offset
        try:
            self.both(
                "arrive",
                rid,
                arrival=arrival,
                deadline=arrival + slo,
                prompt_len=prompt,
                output_len=output,
                priority=priority,
                thresholds=taus or None,
            )
        except InvalidRequestError as exc:
            # Longer than a step's batch budget, or than every live instance's KV cache.
            seq = prompt + -(-output // 32) * 32
            pools = [self.rust.instance(i).kv_tokens for i in self.rust.instance_ids()]
            longest = None if not pools or None in pools else max(pools)
            assert seq > self.max_tokens or (longest is not None and seq > longest), exc
            return
        except AdmissionError:
            assert self.rust.overloaded and self.ref.overloaded
            self.rejected += 1
            return
        self.live.append(rid)
        self.generation[rid] = self.generation.get(rid, 0) + 1

    def apply(self, op: tuple) -> None:
        kind = op[0]
        if kind == "arrive":
            self.next_id += 1
            self.arrive(self.next_id, *op[1:])
        elif kind == "reuse" and self.cancelled:
            rid = self.cancelled.pop(op[1] % len(self.cancelled))
            self.arrive(rid, 30, 40, 2.0, 0, 0, 0.0)
        elif kind == "finish" and self.running:
            _, pick, commit, eos = op
            inst, members = self.running.pop(pick % len(self.running))
            results = []
            for rid, unmasked, gen in members:
                if rid in self.live and self.generation[rid] == gen:
                    c = min(commit, 32 - unmasked)
                    results.append(StepResult(rid, c, None, eos and rid % 5 == 0))
                elif commit % 2:
                    # Cancelled during the step (its id maybe reused since): ignored.
                    results.append(StepResult(rid, 1))
            measured = 0.02 + 0.001 * (commit % 7)
            expected = sorted(self.ref.step_done(inst, measured, results), key=lambda f: f.id)
            got = sorted(self.rust.step_done(inst, measured, results), key=lambda f: f.id)
            assert [dataclasses.astuple(f) for f in got] == [
                dataclasses.astuple(f) for f in expected
            ]
            done = {f.id for f in got}
            self.live = [r for r in self.live if r not in done]
        elif kind == "cancel" and self.live:
            rid = self.live.pop(op[1] % len(self.live))
            self.both("cancel", rid)
            self.cancelled.append(rid)
        elif kind == "add":
            _, tp, (kv, reqs, batch) = op
            node = self.next_instance
            self.both(
                "add_instance",
                self.next_instance,
                tp=tp,
                gpus=list(range(tp)),
                node=node,
                kv_tokens=kv,
                max_requests=reqs,
                max_batch_tokens=batch,
            )
            self.next_instance += 1
        elif kind in ("drain", "undrain", "remove"):
            ids = self.rust.instance_ids()
            if len(ids) > 1:
                target = ids[op[1] % len(ids)]
                self.both(f"{kind}_instance", target)
                if kind == "remove":
                    self.running = [b for b in self.running if b[0] != target]
            assert self.rust.drained_instances() == self.ref.drained_instances()
        elif kind == "abort" and self.running:
            inst, _ = self.running.pop(op[1] % len(self.running))
            assert self.rust.abort_step(inst) == self.ref.abort_step(inst)
        elif kind == "schedule":
            self.round()

    def round(self) -> None:
        self.now += 0.01
        expected = self.ref.schedule(self.now)
        got = self.rust.schedule(self.now)
        assert_same(got, expected)
        assert self.rust.queued_requests == self.ref.queued
        self.rounds += 1
        self.dispatched += len(got.entry_requests)
        self.migrations += len(got.migrations)
        self.waits.update(w.reason for w in got.waiting)
        for b in got.batches:
            members = [
                (e.request, e.unmasked_in_block, self.generation[e.request]) for e in b.entries
            ]
            self.running.append((b.instance, members))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(POLICIES),
    caching=st.booleans(),
    max_tokens=st.sampled_from([700, 2000, 8192]),
    window=st.sampled_from([None, 0.5, 30.0]),
    max_queued=st.sampled_from([None, None, 0, 3]),
    tps=st.lists(st.tuples(st.sampled_from([1, 2, 4]), capacity), min_size=1, max_size=4),
    trace=st.lists(ops, min_size=1, max_size=150),
)
def test_rust_matches_reference(
    policy, caching, max_tokens, window, max_queued, tps, trace
) -> None:
    config = SchedulerConfig(
        caching=caching,
        max_batch_tokens=max_tokens,
        slo_window_s=window,
        max_queued=max_queued,
        policy=policy,
    )
    profile = make_profile()
    ref = ReferenceScheduler(profile, config)
    run = Lockstep(Scheduler(profile, config), ref, caching, max_tokens)
    for tp, cap in tps:
        run.apply(("add", tp, cap))
    for op in trace:
        run.apply(op)
    run.round()


@pytest.mark.parametrize(
    "layout",
    [
        # Mixed degrees: instance choice prices the lookahead.
        ((1, NO_LIMITS), (2, (2500, None, None)), (4, (None, 6, 1500)), (1, (900, 3, None))),
        # One degree: next-step keys, and a move must pay over the lookahead's horizon.
        ((1, NO_LIMITS), (1, (2500, None, None)), (1, (None, 6, 1500)), (1, (900, 3, None))),
    ],
    ids=["mixed", "tp1"],
)
def test_long_trace_matches_reference(layout) -> None:
    """A busy deterministic trace: hundreds of rounds with migrations, drains and removals."""
    profile = make_profile()
    config = SchedulerConfig(max_batch_tokens=3000, slo_window_s=2.0, policy=_PAPER)
    run = Lockstep(Scheduler(profile, config), ReferenceScheduler(profile, config), True, 3000)
    for tp, cap in layout:
        run.apply(("add", tp, cap))
    for step in range(300):
        run.apply(("arrive", 20 + 37 * step % 500, 40 + 13 * step % 200, 1.0, step % 3, 31, 0.0))
        run.apply(("schedule",))
        for _ in range(2):
            run.apply(("finish", step, 1 + step % 9, False))
        if step == 100:
            run.apply(("drain", 1))
            run.apply(("drain", 0))
        if step == 150:
            run.apply(("remove", 1))
            run.apply(("add", layout[1][0], (1500, None, None)))
        if step % 40 == 7:
            run.apply(("abort", step))
        if step % 50 == 9:
            run.apply(("cancel", step))
            run.apply(("reuse", 0))
    assert run.rounds >= 300 and run.dispatched > 1000 and run.migrations > 0
    assert {"queued_busy", "no_kv_room"} <= run.waits, run.waits
