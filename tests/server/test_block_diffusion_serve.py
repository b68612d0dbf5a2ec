"""The server on the embedded block diffusion model, dilaserve-tiny-moe (LLaDA2.x format,
MoE, exact block cache), through the official `openai` client and `dilaserve bench`'s."""

from __future__ import annotations

import asyncio

import aiohttp

from dilaserve.bench.client import Client, served_model
from dilaserve.bench.workload import Arrival
from dilaserve.protocol import CacheMode
from dilaserve.server import ServerSettings
from dilaserve.tiny import MOE_MODEL_NAME
from dilaserve.tiny.tasks import Problem

#: Sums of the `add` task's layout (two five-digit numbers, a five-digit sum).
SUMS = {"12345+67890=": "80235", "31415+42653=": "74068", "50505+19999=": "70504"}


def test_the_embedded_moe_model_answers_through_the_openai_client(start_server):
    live = start_server(
        ServerSettings(MOE_MODEL_NAME),
        model=MOE_MODEL_NAME,
        cache=CacheMode.BLOCK,
        instances=(1, 1),
    )
    client = live.client()
    assert [m.id for m in client.models.list().data] == [MOE_MODEL_NAME]
    for prompt, answer in SUMS.items():
        resp = client.completions.create(
            model=MOE_MODEL_NAME,
            prompt=prompt,
            max_tokens=8,
            extra_body={"confidence_threshold": 0.9},
        )
        assert resp.choices[0].text == answer, prompt
        assert resp.choices[0].finish_reason == "stop"
        assert resp.model_extra["dilaserve"]["steps"] >= 1

    # `dilaserve bench`'s client names the model the server lists and checks the answer.
    bench = Client(live.url, model=asyncio.run(served_model(live.url)))
    assert bench.model == MOE_MODEL_NAME
    problem = Problem("add", "12345+67890=", "80235", 5)
    outcome = asyncio.run(ask_once(bench, Arrival(0.0, problem)))
    assert outcome.status == 200 and outcome.correct


async def ask_once(client: Client, arrival: Arrival):
    async with aiohttp.ClientSession() as session:
        return await client.ask(session, arrival, 60.0, confidence_threshold=0.9)
