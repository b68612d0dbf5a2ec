"""The Rust scheduler against the independent pure-Python implementation in
benches/sched_reference.py: random event traces under every policy must produce
identical decisions, round after round."""

from __future__ import annotations

import sys
from dataclasses import dataclass, field
from pathlib import Path

from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from sched_profiles import make_profile

from dilaserve.scheduler import (
    InvalidRequestError,
    Policy,
    Scheduler,
    SchedulerConfig,
    StepResult,
)

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benches"))
from sched_reference import ReferenceScheduler, assert_same  # noqa: E402

POLICIES = [
    Policy.dilaserve(),
    Policy.dilaserve().without_load_control(),
    Policy.dilaserve().without_migration(),
    Policy.dilaserve().one_shot(),
    Policy(load_order="priority", predict_every=3, instance_choice="least_loaded"),
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
    st.tuples(st.just("add"), st.sampled_from([1, 2, 4])),
    st.tuples(st.just("drain"), st.integers(0, 99)),
    st.tuples(st.just("remove"), st.integers(0, 99)),
)


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
    running: list[tuple[int, list[int]]] = field(default_factory=list)
    in_block: dict[int, int] = field(default_factory=dict)
    rounds: int = 0
    dispatched: int = 0
    migrations: int = 0

    def both(self, method: str, *args, **kwargs) -> None:
        """Rust first: the reference does no input checks, so it only sees accepted events."""
        getattr(self.rust, method)(*args, **kwargs)
        getattr(self.ref, method)(*args, **kwargs)

    def apply(self, op: tuple) -> None:
        kind = op[0]
        if kind == "arrive":
            _, prompt, output, slo, priority, subset, offset = op
            taus = [t for k, t in enumerate((0.5, 0.6, 0.7, 0.8, 0.9)) if subset >> k & 1]
            arrival = self.now + offset
            self.next_id += 1
            try:
                self.both(
                    "arrive",
                    self.next_id,
                    arrival=arrival,
                    deadline=arrival + slo,
                    prompt_len=prompt,
                    output_len=output,
                    priority=priority,
                    thresholds=taus or None,
                )
            except InvalidRequestError:
                assert prompt + -(-output // 32) * 32 > self.max_tokens
                return
            self.live.append(self.next_id)
        elif kind == "finish" and self.running:
            _, pick, commit, eos = op
            inst, members = self.running.pop(pick % len(self.running))
            results = []
            for rid in members:
                if rid not in self.live:
                    continue
                c = min(commit, 32 - self.in_block.get(rid, 0))
                self.in_block[rid] = (self.in_block.get(rid, 0) + c) % 32
                results.append(StepResult(rid, c, None, eos and rid % 5 == 0))
            measured = 0.02 + 0.001 * (commit % 7)
            done = self.ref.step_done(inst, measured, results)
            assert sorted(self.rust.step_done(inst, measured, results)) == sorted(done)
            self.live = [r for r in self.live if r not in done]
        elif kind == "cancel" and self.live:
            self.both("cancel", self.live.pop(op[1] % len(self.live)))
        elif kind == "add":
            tp = op[1]
            node = self.next_instance
            self.both("add_instance", self.next_instance, tp=tp, gpus=list(range(tp)), node=node)
            self.next_instance += 1
        elif kind in ("drain", "remove"):
            ids = self.rust.instance_ids()
            if len(ids) > 1:
                target = ids[op[1] % len(ids)]
                self.both(f"{kind}_instance", target)
                if kind == "remove":
                    self.running = [b for b in self.running if b[0] != target]
        elif kind == "schedule":
            self.round()

    def round(self) -> None:
        self.now += 0.01
        expected = self.ref.schedule(self.now)
        got = self.rust.schedule(self.now)
        assert_same(got, expected)
        self.rounds += 1
        self.dispatched += len(got.entry_requests)
        self.migrations += len(got.migrations)
        for b in got.batches:
            self.running.append((b.instance, [e.request for e in b.entries]))


@settings(max_examples=60, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(
    policy=st.sampled_from(POLICIES),
    caching=st.booleans(),
    max_tokens=st.sampled_from([700, 2000, 8192]),
    window=st.sampled_from([None, 0.5, 30.0]),
    tps=st.lists(st.sampled_from([1, 2, 4]), min_size=1, max_size=4),
    trace=st.lists(ops, min_size=1, max_size=150),
)
def test_rust_matches_reference(policy, caching, max_tokens, window, tps, trace) -> None:
    config = SchedulerConfig(
        caching=caching, max_batch_tokens=max_tokens, slo_window_s=window, policy=policy
    )
    profile = make_profile()
    ref = ReferenceScheduler(profile, config)
    run = Lockstep(Scheduler(profile, config), ref, caching, max_tokens)
    for tp in tps:
        run.apply(("add", tp))
    for op in trace:
        run.apply(op)
    run.round()


def test_long_trace_matches_reference() -> None:
    """A busy deterministic trace: hundreds of rounds with migrations, drains and removals."""
    profile = make_profile()
    config = SchedulerConfig(max_batch_tokens=3000, slo_window_s=2.0)
    run = Lockstep(Scheduler(profile, config), ReferenceScheduler(profile, config), True, 3000)
    for tp in (1, 2, 4, 1):
        run.apply(("add", tp))
    for step in range(300):
        run.apply(("arrive", 20 + 37 * step % 500, 40 + 13 * step % 200, 1.0, step % 3, 31, 0.0))
        run.apply(("schedule",))
        for _ in range(2):
            run.apply(("finish", step, 1 + step % 9, False))
        if step == 100:
            run.apply(("drain", 1))
        if step == 150:
            run.apply(("remove", 1))
            run.apply(("add", 2))
    assert run.rounds >= 300 and run.dispatched > 1000 and run.migrations > 0
