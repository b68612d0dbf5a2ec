"""Emulated workers (`EngineConfig(emulate=True)`, `dilaserve serve --emulate`): the server,
engine and scheduler unchanged against a cluster far larger than this machine."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import openai
import zmq.asyncio
from sched_profiles import flat_profile

from dilaserve.engine import Engine, EngineConfig, GenerationParams
from dilaserve.profiles import SIMULATED_LLADA8B, llada8b_progress
from dilaserve.protocol import RequestState, StepCommand, StepKind
from dilaserve.scheduler import LatencyProfile
from dilaserve.tiny.tasks import make_problems
from dilaserve.worker.emulated import EmulatedInstance, Emulation


def test_an_emulated_64_instance_cluster_serves_a_burst_over_http(start_server):
    live = start_server(emulate=True, instances=(1,) * 64, profile=None)
    problems = make_problems(256, 64_064)
    client = openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0)

    async def one(prompt: str):
        return await client.completions.create(model="dilaserve-tiny", prompt=prompt, max_tokens=64)

    async def burst():
        async with client:
            return await asyncio.gather(*(one(p.prompt) for p in problems))

    answers = asyncio.run(burst())
    assert len(answers) == len(problems)
    for answer in answers:
        (choice,) = answer.choices
        assert choice.finish_reason == "length" and answer.usage.completion_tokens == 64
    with urllib.request.urlopen(f"{live.url}/v1/cluster") as response:
        cluster = json.load(response)
    instances = cluster["instances"]
    assert len(instances) == 64 and all(i["state"] == "serving" for i in instances)
    assert sum(i["steps_run"] > 0 for i in instances) >= 32, "the burst spread over the cluster"
    assert cluster["active_requests"] == 0
    launcher = live.engine.launcher
    assert len(launcher._hosts) <= launcher.hosts_wanted, "64 instances share a few hosts"


def test_a_flat_profile_spreads_steps_over_emulated_instances(tmp_path):
    """Steps barely longer for a bigger batch (a GPU at small batches): closed-loop clients
    keep every instance working, each within 2x of the mean number of steps."""
    profile = tmp_path / "flat.json"
    profile.write_text(flat_profile().to_json())
    config = EngineConfig(emulate=True, instances=(1,) * 4, profile=profile)
    prompt = make_problems(1, 4_004)[0].prompt

    async def run() -> list[int]:
        async with Engine(config) as engine:

            async def client() -> None:
                for _ in range(25):
                    await engine.complete(prompt, GenerationParams(max_tokens=128))

            await asyncio.gather(*(client() for _ in range(8)))
            return [i.steps_run for i in engine.status().instances]

    steps = asyncio.run(run())
    mean = sum(steps) / len(steps)
    assert all(mean / 2 <= n <= 2 * mean for n in steps), steps


def test_an_emulated_instance_killed_mid_burst_loses_no_request():
    """Emulated instances share host processes but die alone: the engine restarts the one
    killed, its requests resume elsewhere, and every request completes."""
    config = EngineConfig(emulate=True, instances=(1,) * 4)
    problems = make_problems(64, 4_114)

    async def run() -> tuple[list, int, int]:
        async with Engine(config) as engine:
            params = GenerationParams(max_tokens=256)
            tasks = [asyncio.ensure_future(engine.complete(p.prompt, params)) for p in problems]
            while not engine.status().instances[0].residents:
                await asyncio.sleep(0.001)
            engine.instances[0].handle.kill()
            outputs = await asyncio.gather(*tasks)
            hosts = len(engine.launcher._hosts)
            return outputs, engine.restarts, hosts

    outputs, restarts, hosts = asyncio.run(run())
    assert restarts == 1 and hosts <= 4
    assert all(o.finished and len(o.token_ids) == 256 for o in outputs)


def test_a_queued_emulated_step_starts_where_the_one_before_ends_on_the_gpu_timeline():
    """The host loop waking late (timer ticks, a busy machine) must not slow the emulated
    GPU: a command queued behind a step starts at that step's end on the instance's
    timeline, and each report gives the profile's time for its batch."""
    emulation = Emulation(
        LatencyProfile.load(str(SIMULATED_LLADA8B)), json.dumps(llada8b_progress()), seed=0
    )
    spec = {"worker_id": 1, "instance": 1, "endpoint": "ipc://unused", "max_requests": 4}
    context = zmq.asyncio.Context()
    instance = EmulatedInstance(spec, emulation, context)
    state = RequestState.new(1, [5] * 16, 64, block_length=32, mask_token_id=0)

    async def two_steps():
        first = await instance.execute(
            StepCommand(1, [1], [0.9], [StepKind.RECOMPUTE], admit=[state])
        )
        first_end = instance.free_at
        await asyncio.sleep(0.02)  # the loop gets to the queued command late
        instance.queued = True
        second = await instance.execute(StepCommand(2, [1], [0.9], [StepKind.AUTO]))
        return first, first_end, second

    try:
        first, first_end, second = asyncio.run(two_steps())
    finally:
        instance.socket.close()
        context.term()
    assert first.seconds == emulation.step_seconds(1, 16 + 64, 0, 0.0)
    assert second.seconds == emulation.step_seconds(1, 0, 32, 16 + 64)
    assert instance.free_at == first_end + second.seconds
