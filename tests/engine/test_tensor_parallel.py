"""Tensor-parallel instances served live on dilaserve-tiny: a mixed-degree cluster, a rank
killed mid-step, the planner's move from two TP-1 instances to one TP-2 under load, and
degrees the model cannot be split into. Every TP-2 instance is two CPU processes joined by
gloo; every assertion checks what was answered, never how fast."""

from __future__ import annotations

import asyncio
import itertools
import os
import signal

import pytest
from tiny_problems import PINNED_TAU, decode_alone, solvable
from tp_profiles import write_tp_profile

from dilaserve.engine import GenerationParams
from dilaserve.engine.launcher import LocalGroup
from dilaserve.models import UnsupportedDegreeError
from dilaserve.models.testing import write_tiny_checkpoint
from dilaserve.tiny.tasks import check, gen_length, make_problems

SEED = 515_151
PINNED = {"threshold": PINNED_TAU}


@pytest.fixture(scope="module")
def tp_profile(tmp_path_factory) -> str:
    return write_tp_profile(tmp_path_factory.mktemp("tp_profile") / "tp.json", (1, 2))


def params(problem, **kw) -> GenerationParams:
    return GenerationParams(max_tokens=gen_length(problem, 32), **kw)


def _gone(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return True
    return False


def test_mixed_degree_cluster_answers_like_decoding_alone(make_engine, tp_profile):
    h = make_engine(instances=(2, 1), profile=tp_profile)
    engine = h.engine
    assert [engine.instances[i].tp for i in (0, 1)] == [2, 1]
    assert engine.instances[0].ready.tp == 2
    problems = make_problems(24, SEED)

    async def complete_all():
        return await asyncio.gather(*(engine.complete(p.prompt, params(p)) for p in problems))

    outputs = h.run(complete_all())
    visited = set()
    for problem, out in zip(problems, outputs, strict=True):
        ref = decode_alone(problem.prompt, gen_length(problem, 32), out.stats.taus)
        assert out.token_ids == ref.output_ids, problem
        assert out.stats.steps == ref.steps
        visited.update(out.stats.instances)
    assert visited == {0, 1}
    assert engine.active_requests == 0


def test_a_killed_rank_brings_its_instance_down_and_its_requests_resume(make_engine, tp_profile):
    h = make_engine(instances=(2, 1), profile=tp_profile)
    problems = solvable(16, SEED + 1)

    async def scenario():
        engine = h.engine
        tasks = [
            asyncio.ensure_future(engine.complete(p.prompt, params(p, **PINNED))) for p in problems
        ]
        inst = engine.instances[0]
        while not (
            inst.inflight is not None
            and any(
                engine.instance_of(r.id) == 0 and engine.stats_of(r.id).steps
                for r in engine._requests.values()
            )
        ):
            await asyncio.sleep(0.001)
        handle = inst.handle
        os.kill(handle.pids[1], signal.SIGKILL)  # rank 1, while rank 0 is in a step
        return await asyncio.gather(*tasks), handle

    outputs, old = h.run(scenario())
    assert isinstance(old, LocalGroup)
    assert all(check(p, o.text) for p, o in zip(problems, outputs, strict=True))
    engine = h.engine
    assert engine.restarts == 1
    h.run(asyncio.wait_for(asyncio.shield(engine.instances[0].started), 120))
    new = engine.instances[0].handle
    assert engine.instances[0].registered and new is not old
    assert all(_gone(pid) for pid in old.pids)  # no rank of the broken instance is left
    (p,) = make_problems(1, SEED + 2, tasks=("add",))
    assert check(p, h.run(engine.complete(p.prompt, params(p))).text)


@pytest.mark.parametrize("slots", [3, 2], ids=["by-migration", "by-handover"])
def test_planner_moves_two_tp1_instances_to_one_tp2_under_load_losing_nothing(
    make_engine, tp_profile, slots
):
    h = make_engine(instances=(1, 1), device_slots=slots, profile=tp_profile)
    # Five-block answers only: a request still on a TP-1 instance when it drains moves at
    # its next block (a one-block answer may finish in place, leaving nothing to check).
    problems = [p for p in solvable(40, SEED + 3) if p.task == "tr"]

    async def scenario():
        engine = h.engine
        done: list = []
        reconfigured = asyncio.Event()

        mid_decode: set[int] = set()  # live requests with their first block committed

        async def client(k: int) -> None:  # keeps one request in flight until the end
            for i in itertools.count(k, 6):
                p = problems[i % len(problems)]
                async for out in engine.generate(p.prompt, params(p, **PINNED)):
                    (mid_decode.discard if out.finished else mid_decode.add)(out.request_id)
                done.append((p, out))
                if reconfigured.is_set():
                    return

        def held_mid_decode(instance: int) -> bool:
            live = (r for r in mid_decode if engine.stats_of(r) is not None)
            return any(engine.instance_of(r) == instance for r in live)

        clients = [asyncio.ensure_future(client(k)) for k in range(6)]
        # Drain only once each TP-1 instance holds a request with blocks still to go, so
        # that one of them must move (waiting for steps alone could drain an idle one).
        while not all(held_mid_decode(i) for i in (0, 1)):
            await asyncio.sleep(0.001)
        await engine.scale_to({2: 1, 1: 0})
        (inst,) = engine.instances.values()
        while not engine.scheduler.instance(inst.id).steps_run:
            await asyncio.sleep(0.001)
        reconfigured.set()
        await asyncio.gather(*clients)
        return done, inst

    done, inst = h.run(scenario())
    assert inst.tp == 2 and len(inst.gpus) == 2
    assert all(check(p, o.text) for p, o in done)
    # Requests that began on a TP-1 instance finished on the TP-2 one.
    assert any({0, 1} & set(o.stats.instances) and inst.id in o.stats.instances for _, o in done)
    if slots == 3:
        assert any(o.stats.migrations and inst.id in o.stats.instances for _, o in done)


def test_degrees_the_model_cannot_be_split_into_are_refused_at_launch(make_engine, tmp_path):
    # Dream-7B's attention shape: 28 query heads, 4 KV heads — TP 8 is impossible.
    model = write_tiny_checkpoint(
        tmp_path / "dream28",
        "dream",
        hidden_size=112,
        num_attention_heads=28,
        num_key_value_heads=4,
        intermediate_size=64,
    )
    profile = write_tp_profile(tmp_path / "tp.json", (1, 2, 4, 8))
    with pytest.raises(UnsupportedDegreeError, match="28 query heads, 4 KV heads"):
        make_engine(model=str(model), profile=profile, instances=(8,))
    h = make_engine(model=str(model), profile=profile, instances=(1,), device_slots=8)
    engine = h.engine
    assert engine.degrees.allowed == (1, 2, 4)
    assert engine.planner_degrees == (1, 2, 4)  # what the planner is told it may choose
    with pytest.raises(UnsupportedDegreeError, match="TP 8"):
        h.run(engine.scale_to({8: 1}))
    with pytest.raises(UnsupportedDegreeError, match="TP 8"):
        h.run(engine.launch_instance(8, tuple(range(8))))
    assert list(engine.instances) == [0]
