"""The engine end to end on dilaserve-tiny: worker processes over ZeroMQ, the Rust
scheduler, migration, reconfiguration, faults and bad input. No assertion depends on
wall-clock speed: every test checks what was answered, not how fast."""

from __future__ import annotations

import asyncio
import itertools

import pytest
from tiny_problems import PINNED_TAU, decode_alone, solvable

from dilaserve.engine import (
    LLM,
    BadRequestError,
    EngineConfig,
    GenerationParams,
    RequestCancelledError,
    UnknownRequestError,
)
from dilaserve.engine.transport import SendError
from dilaserve.protocol import StepCommand, StepReport
from dilaserve.tiny.tasks import check, gen_length, make_problems

SEED = 424_242


def params(problem, **kw) -> GenerationParams:
    return GenerationParams(max_tokens=gen_length(problem, 32), **kw)


async def complete_all(engine, problems, **kw):
    return await asyncio.gather(*(engine.complete(p.prompt, params(p, **kw)) for p in problems))


@pytest.mark.parametrize("overlap", [True, False], ids=["overlap", "synchronous"])
def test_concurrent_requests_equal_decoding_alone(make_engine, overlap):
    h = make_engine(instances=(1, 1, 1), overlap=overlap)
    problems = make_problems(200, SEED)
    outputs = h.run(complete_all(h.engine, problems))
    # With overlap, most steps were sent while the instance's step before still ran.
    ahead = h.engine.step_times.steps_ahead
    assert ahead > h.engine.step_times.steps / 2 if overlap else ahead == 0
    visited = set()
    for problem, out in zip(problems, outputs, strict=True):
        assert out.finished and out.stats is not None
        ref = decode_alone(problem.prompt, gen_length(problem, 32), out.stats.taus)
        assert out.token_ids == ref.output_ids, problem
        assert out.stats.steps == ref.steps
        assert out.text == h.engine.tokenizer.decode(ref.output_ids, skip_special_tokens=True)
        visited.update(out.stats.instances)
    assert visited == {0, 1, 2}
    assert h.engine.active_requests == 0


def test_stream_sends_each_block_once_and_never_changes_it(make_engine):
    h = make_engine(instances=(1,))
    (problem,) = make_problems(1, SEED, tasks=("tr",))

    async def stream():
        return [o async for o in h.engine.generate(problem.prompt, params(problem))]

    updates = h.run(stream())
    assert len(updates) >= 4  # four 32-letter blocks, then the end
    for before, after in zip(updates, updates[1:], strict=False):
        assert after.text.startswith(before.text)
        assert after.text == before.text + after.delta
    assert updates[-1].finished and updates[-1].finish_reason == "stop"
    assert check(problem, updates[-1].text)
    assert all(not u.finished for u in updates[:-1])


PINNED = {"threshold": PINNED_TAU}


async def start_and_wait_for_progress(engine, problems, instance: int) -> list[asyncio.Future]:
    """Submits every problem (τ pinned), then returns once a request held by `instance`
    has run a step: the moment to break that instance mid-request."""
    tasks = [
        asyncio.ensure_future(engine.complete(p.prompt, params(p, **PINNED))) for p in problems
    ]
    while not any(
        engine.instance_of(r.id) == instance and engine.stats_of(r.id).steps
        for r in engine._requests.values()
    ):
        await asyncio.sleep(0.001)
    return tasks


def test_killed_worker_loses_no_request(make_engine):
    h = make_engine(instances=(1, 1))
    problems = solvable(30, SEED + 1)

    async def scenario():
        engine = h.engine
        tasks = await start_and_wait_for_progress(engine, problems, 0)
        engine.instances[0].handle.kill()
        return await asyncio.gather(*tasks)

    outputs = h.run(scenario())
    assert all(check(p, o.text) for p, o in zip(problems, outputs, strict=True))
    assert h.engine.restarts == 1
    h.run(asyncio.wait_for(asyncio.shield(h.engine.instances[0].started), 120))
    assert h.engine.instances[0].registered
    # The restarted instance serves again.
    (p,) = make_problems(1, SEED + 2, tasks=("add",))
    assert check(p, h.run(h.engine.complete(p.prompt, params(p))).text)


def test_sigterm_drains_the_worker_and_stops_it_cleanly(make_engine):
    h = make_engine(instances=(1, 1))
    problems = solvable(20, SEED + 1)

    async def scenario():
        engine = h.engine
        tasks = await start_and_wait_for_progress(engine, problems, 1)
        inst = engine.instances[1]
        handle = inst.handle
        handle.terminate()
        outputs = await asyncio.gather(*tasks)
        await asyncio.wait_for(asyncio.shield(inst.stopped), 60)
        return outputs, await handle.wait()

    outputs, code = h.run(scenario())
    assert code == 0
    assert all(check(p, o.text) for p, o in zip(problems, outputs, strict=True))
    assert set(h.engine.instances) == {0} and h.engine.restarts == 0


def test_reconfiguration_under_load_loses_nothing(make_engine):
    h = make_engine(instances=(1, 1), device_slots=3)
    problems = solvable(80, SEED + 1)

    async def scenario():
        engine = h.engine
        done: list = []
        reconfigured = asyncio.Event()

        async def client(k: int) -> None:  # keeps one request in flight until the end
            for i in itertools.count(k, 8):
                p = problems[i % len(problems)]
                done.append((p, await engine.complete(p.prompt, params(p, **PINNED))))
                if reconfigured.is_set():
                    return

        clients = [asyncio.ensure_future(client(k)) for k in range(8)]
        await engine.scale_to({1: 3})
        assert len(engine.instances) == 3
        while not engine.scheduler.instance(2).steps_run:
            await asyncio.sleep(0.001)
        await engine.scale_to({1: 1})
        assert len(engine.instances) == 1
        reconfigured.set()
        await asyncio.gather(*clients)
        return done

    done = h.run(scenario())
    assert all(check(p, o.text) for p, o in done)
    assert any(o.stats.migrations for _, o in done)
    assert any(2 in o.stats.instances for _, o in done)


def test_cancel_frees_capacity(make_engine):
    h = make_engine(instances=(1,), max_requests_per_instance=2)
    long_a, long_b = make_problems(2, SEED + 3, tasks=("tr",))
    (short,) = make_problems(1, SEED + 4, tasks=("add",))
    pinned = {"threshold": 1.0}  # one token per step: these two run for a long while

    async def scenario():
        engine = h.engine
        a = engine.add_request(long_a.prompt, params(long_a, **pinned))
        b = engine.add_request(long_b.prompt, params(long_b, **pinned))
        while not (engine.stats_of(a.id).steps and engine.stats_of(b.id).steps):
            await asyncio.sleep(0.001)
        third = asyncio.ensure_future(engine.complete(short.prompt, params(short)))
        await asyncio.sleep(0.05)
        assert not third.done()  # both KV slots are taken
        engine.cancel(a.id)
        out = await third
        assert b.id in engine._requests, "the short request waited for the long one"
        engine.cancel(b.id)
        return out, a.outputs.get_nowait()

    out, cancelled = h.run(scenario())
    assert check(short, out.text)
    assert isinstance(cancelled, RequestCancelledError)
    assert h.engine.active_requests == 0
    assert h.call(h.engine.scheduler.instance, 0).residents == 0


@pytest.mark.parametrize(
    "prompt, kw, message",
    [
        ("", {}, "empty"),
        ("1" * 600, {}, "context"),
        ("12+34=", {"threshold": 0.0}, "threshold"),
        ("12+34=", {"threshold": 1.5}, "threshold"),
        ("12+34=", {"max_tokens": 0}, "max_tokens"),
        ("12+34=", {"slo_s": -1.0}, "slo_s"),
        ("€", {}, "represent"),
        ("12+34=", {"alg": "greedy"}, "alg"),
        ("12+34=", {"alg_temp": 0.5}, "alg_temp"),
        ("12+34=", {"alg": "entropy", "steps_per_block": 64}, "exceeds the block length"),
    ],
)
def test_bad_requests_get_typed_errors(shared_engine, prompt, kw, message):
    h = shared_engine
    with pytest.raises(BadRequestError, match=message):
        h.call(h.engine.add_request, prompt, GenerationParams(**kw))


def test_bad_requests_do_not_disturb_others(shared_engine):
    h = shared_engine
    (p,) = make_problems(1, SEED + 5, tasks=("add",))

    async def scenario():
        good = asyncio.ensure_future(h.engine.complete(p.prompt, params(p)))
        for bad in ("", "€", "1" * 600):
            with pytest.raises(BadRequestError):
                h.engine.add_request(bad)
        with pytest.raises(UnknownRequestError):
            h.engine.cancel(10**9)
        return await good

    assert check(p, h.run(scenario()).text)


def test_offline_llm_answers_in_prompt_order(tiny_profile):
    problems = make_problems(8, SEED + 6, tasks=("add",))
    config = EngineConfig(profile=tiny_profile, instances=(1, 1), threads_per_worker=1)
    with LLM(config) as llm:
        outputs = llm.generate([p.prompt for p in problems], GenerationParams(max_tokens=32))
    assert [check(p, o.text) for p, o in zip(problems, outputs, strict=True)] == [True] * 8
    assert all(o.stats.slo_s > 0 for o in outputs)


def test_replan_from_recent_arrivals_plans_and_applies_the_transition(make_engine):
    h = make_engine(instances=(1,), device_slots=2)
    problems = make_problems(6, SEED + 7, tasks=("add",))

    async def scenario():
        engine = h.engine
        await asyncio.gather(*(engine.complete(p.prompt, params(p)) for p in problems))
        before = set(engine.instances)
        result = await engine.reconfigurer.replan()
        return result, sorted(i.tp for i in engine.instances.values()), before

    result, degrees, before = h.run(scenario())
    assert result is not None and h.engine.reconfigurer.runs == 1
    assert h.engine.reconfigurer.last_plan is result
    expected = [i.degree for i in result.transition.instances] if result.adopted else [1]
    assert degrees == sorted(expected)
    # The plan's batch sizes describe the deployment to the next plan; instances it
    # launched keep the configured batch-token budget.
    planned = {d.degree: d.batch_tokens for d in result.capacity.degrees if d.batch_tokens}
    launched = [i for i in h.engine.instances.values() if i.id not in before]
    assert launched or not result.adopted
    for inst in launched:
        assert h.engine.reconfigurer.planned_batch(inst.tp) == planned[inst.tp]
        budget = h.engine.scheduler.instance(inst.id).max_batch_tokens
        assert budget == h.engine.config.max_batch_tokens


def test_requests_submitted_together_are_admitted_all_or_none(shared_engine):
    h = shared_engine
    good, bad = GenerationParams(max_tokens=8), GenerationParams(max_tokens=10**9)

    def submit(items):
        return h.engine.add_requests(items)

    with pytest.raises(BadRequestError) as info:
        h.call(submit, [("12345+67890=", good), ("11111+22222=", bad), ("23456+11111=", good)])
    assert info.value.index == 1
    assert h.engine.active_requests == 0

    async def both():
        reqs = submit([("12345+67890=", good), ("11111+22222=", good)])
        return [[o async for o in h.engine.outputs(r)][-1].text for r in reqs]

    assert h.run(both()) == ["80235", "33333"]


def test_a_command_that_cannot_be_sent_restarts_the_instance_and_fails_no_request(make_engine):
    """Sends to a gone worker fail at once (`SendError`): its requests resume elsewhere
    with no failed step counted against them (they used to fail after three), and the
    instance is restarted rather than sent commands in vain."""
    h = make_engine(instances=(1, 1))
    engine = h.engine
    send = engine._channel.send
    refused: list[int] = []

    def unreachable_once(worker_id, message):
        if isinstance(message, StepCommand) and message.requests and not refused:
            refused.append(worker_id)
            raise SendError(f"worker {worker_id}: Host unreachable")
        return send(worker_id, message)

    problems = solvable(4, SEED + 5)
    with h.patched(engine._channel, "send", unreachable_once):
        outputs = h.run(complete_all(engine, problems, **PINNED))
    assert refused and all(check(p, o.text) for p, o in zip(problems, outputs, strict=True))

    async def restarted():
        while not engine.restarts:
            await asyncio.sleep(0.01)

    h.run(restarted())  # its exit is noticed after the kill
    assert engine.restarts == 1


def test_a_pinned_threshold_is_what_the_worker_ran_and_the_statistics_report(shared_engine):
    """τ 0.73 is no candidate: the scheduler plans it as 0.7 but every step command carries
    0.73, and the statistics (the scheduler's record) say so."""
    engine = shared_engine.engine
    sent: list[float] = []
    send = engine._channel.send

    def spy(worker_id, message):
        sent.extend(getattr(message, "taus", ()))
        return send(worker_id, message)

    (problem,) = make_problems(1, SEED + 1, tasks=("add",))
    with shared_engine.patched(engine._channel, "send", spy):
        out = shared_engine.run(engine.complete(problem.prompt, params(problem, threshold=0.73)))
    assert out.stats.taus == (0.73,) * out.stats.steps and out.stats.steps > 0
    # Every step sent carried it; with overlap one more may have been sent ahead of the
    # last, which the worker skipped (the step before finished the request).
    assert set(sent) == {0.73} and out.stats.steps <= len(sent) <= out.stats.steps + 1
    ref = decode_alone(problem.prompt, gen_length(problem, 32), out.stats.taus)
    assert out.token_ids == ref.output_ids


def test_a_report_that_does_not_fit_the_token_state_is_rerun_not_applied(shared_engine):
    """A worker's report committing a position outside its block is refused whole by the
    core; the step's requests run again from the core's token state and decode as alone."""
    engine = shared_engine.engine
    receive = engine._channel._on_message
    corrupted = []

    def corrupt_first_report(worker_id, message):
        if isinstance(message, StepReport) and message.positions and not corrupted:
            message.positions[0] += 10_000
            corrupted.append(message.step)
        return receive(worker_id, message)

    (problem,) = make_problems(1, SEED + 3, tasks=("add",))
    with shared_engine.patched(engine._channel, "_on_message", corrupt_first_report):
        out = shared_engine.run(engine.complete(problem.prompt, params(problem, threshold=0.9)))
    assert corrupted
    ref = decode_alone(problem.prompt, gen_length(problem, 32), out.stats.taus)
    assert out.token_ids == ref.output_ids and check(problem, out.text)
