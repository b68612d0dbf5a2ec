"""The server under load and faults: concurrent clients, a killed worker and a live
reconfiguration, with every answer right and nothing lost."""

from __future__ import annotations

import asyncio

import aiohttp
import openai
from tiny_problems import PINNED_TAU, solvable

from dilaserve.tiny.tasks import check, gen_length, make_problems

SEED = 77_001


async def _ask(client: openai.AsyncOpenAI, problem) -> str:
    resp = await client.completions.create(
        model="dilaserve-tiny",
        prompt=problem.prompt,
        max_tokens=gen_length(problem, 32),
        # Deadlines far off: these tests are about answers under load, and deadline
        # admission refuses what cannot meet the default SLO in a burst of 100.
        extra_body={"confidence_threshold": PINNED_TAU, "slo_ms": 600_000},
    )
    return resp.choices[0].text


def _async_client(live) -> openai.AsyncOpenAI:
    return openai.AsyncOpenAI(base_url=f"{live.url}/v1", api_key="none", max_retries=0)


def test_hundred_concurrent_requests_are_all_answered_right(start_server):
    live = start_server(instances=(1, 1))
    problems = solvable(100, SEED)

    async def clients():
        client = _async_client(live)
        return await asyncio.gather(*(_ask(client, p) for p in problems))

    texts = asyncio.run(clients())
    assert all(check(p, t) for p, t in zip(problems, texts, strict=True))


def test_killed_worker_and_reconfiguration_through_the_server(start_server):
    live = start_server(instances=(1, 1), device_slots=3)
    problems = solvable(40, SEED + 1)
    engine = live.engine

    async def wait_for(predicate) -> None:
        while not predicate():
            await asyncio.sleep(0.001)

    async def kill_and_reconfigure() -> None:
        await wait_for(
            lambda: any(
                engine.instance_of(r.id) == 0 and engine.stats_of(r.id).steps
                for r in engine._requests.values()
            )
        )
        engine.instances[0].handle.kill()
        await engine.scale_to({1: 3})
        await wait_for(lambda: engine.restarts == 1 and len(engine.instances) == 3)
        await engine.scale_to({1: 1})

    async def clients():
        client = _async_client(live)
        asks = [asyncio.ensure_future(_ask(client, p)) for p in problems]
        live.run(asyncio.sleep(0))  # the engine's loop is alive
        faults = asyncio.run_coroutine_threadsafe(kill_and_reconfigure(), live.loop)
        texts = await asyncio.gather(*asks)
        await asyncio.wrap_future(faults)
        return texts

    texts = asyncio.run(clients())
    assert all(check(p, t) for p, t in zip(problems, texts, strict=True))
    assert len(engine.instances) == 1 and engine.restarts == 1


def test_over_the_admission_limit_is_429_with_retry_after(start_server):
    live = start_server(instances=(1,), max_queued=0)
    (p,) = make_problems(1, SEED + 2, tasks=("tr",))  # 160 steps at τ 1.0

    async def overloaded() -> bool:
        return live.engine.scheduler.overloaded

    async def scenario():
        url = f"{live.url}/v1/completions"
        # One token per step under a 1 ms deadline: no threshold can carry that load.
        hopeless = {"prompt": p.prompt, "max_tokens": 160, "stream": True, "slo_ms": 1}
        hopeless["confidence_threshold"] = 1.0
        async with aiohttp.ClientSession() as s, s.post(url, json=hopeless) as running:
            await running.content.readline()  # it has run a step: load control has seen it
            # Read on the engine's loop: from this thread it races the scheduler's rounds.
            on_loop = asyncio.run_coroutine_threadsafe(overloaded(), live.loop)
            assert await asyncio.wrap_future(on_loop)
            async with s.post(url, json={"prompt": "12+34=", "max_tokens": 4}) as rejected:
                return rejected.status, rejected.headers, await rejected.json()

    status, headers, body = asyncio.run(asyncio.wait_for(scenario(), 120))
    assert status == 429 and int(headers["Retry-After"]) >= 1
    assert body["error"]["type"] == "rate_limit_error"


def test_a_burst_that_asks_for_no_deadline_is_never_refused(start_server):
    """Clients that set no SLO (lm-eval, LangChain) get no 429 for a predicted deadline
    miss: a burst of 120 on three instances is served whole."""
    live = start_server(instances=(1, 1, 1))
    problems = make_problems(120, SEED + 2, tasks=("add", "rep"))

    async def burst():
        client = _async_client(live)
        return await asyncio.gather(
            *(
                client.completions.create(
                    model="dilaserve-tiny", prompt=p.prompt, max_tokens=gen_length(p, 32)
                )
                for p in problems
            )
        )

    answers = asyncio.run(burst())
    assert len(answers) == 120 and all(a.choices[0].text for a in answers)
