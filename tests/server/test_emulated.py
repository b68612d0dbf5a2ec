"""Emulated workers (`EngineConfig(emulate=True)`, `dilaserve serve --emulate`): the server,
engine and scheduler unchanged against a cluster far larger than this machine."""

from __future__ import annotations

import asyncio
import json
import urllib.request

import openai

from dilaserve.tiny.tasks import make_problems


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
