"""The HTTP API end to end: the official openai client unchanged, SSE streams, every
error answer, the API key, disconnects, load, faults, reconfiguration and /metrics."""

from __future__ import annotations

import asyncio
import json

import aiohttp
import openai
import pytest
from prometheus_client.parser import text_string_to_metric_families
from tiny_problems import PINNED_TAU, decode_alone

from dilaserve.models import load_tokenizer
from dilaserve.tiny import default_model_dir
from dilaserve.tiny.tasks import check, gen_length, make_problems

API_KEY = "test-key"  # the shared server's key (conftest)
SEED = 99_001


def test_completion_with_usage_and_dilaserve_stats(server):
    client = server.client()
    resp = client.completions.create(model="dilaserve-tiny", prompt="12345+67890=", max_tokens=8)
    choice = resp.choices[0]
    assert choice.text == "80235" and choice.finish_reason == "stop"
    assert resp.usage.prompt_tokens == 12 and resp.usage.completion_tokens == 5
    served = resp.model_extra["dilaserve"]
    assert served["steps"] >= 1 and served["slo_met"] in (True, False)
    assert {"recompute_steps", "mean_threshold", "min_threshold", "instances"} <= set(served)
    assert {"migrations", "queue_ms", "latency_ms", "slo_ms"} <= set(served)


def test_chat_uses_the_models_template(server):
    resp = server.client().chat.completions.create(
        model="dilaserve-tiny",
        messages=[
            {"role": "system", "content": "add"},
            {"role": "user", "content": "12345+67890="},
        ],
        max_tokens=8,
    )
    assert resp.choices[0].message.content == "80235"
    assert resp.choices[0].message.role == "assistant"


def test_completion_stream_sends_blocks_then_done(server):
    (p,) = make_problems(1, SEED, tasks=("tr",))
    stream = server.client().completions.create(
        model="dilaserve-tiny", prompt=p.prompt, max_tokens=gen_length(p, 32), stream=True
    )
    chunks = list(stream)
    text = "".join(c.choices[0].text for c in chunks)
    assert check(p, text)
    assert chunks[-1].choices[0].finish_reason == "stop"
    assert sum(bool(c.choices[0].text) for c in chunks) >= 4  # one per 32-letter block


def test_chat_stream_with_usage(server):
    stream = server.client().chat.completions.create(
        model="dilaserve-tiny",
        messages=[{"role": "user", "content": "12345+67890="}],
        max_tokens=8,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(stream)
    assert chunks[0].choices[0].delta.role == "assistant"
    text = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    assert text == "80235"
    assert chunks[-1].usage.completion_tokens == 5 and chunks[-1].choices == []


def test_stop_strings_cut_the_text(server):
    resp = server.client().completions.create(
        model="dilaserve-tiny", prompt="12345+67890=", max_tokens=8, stop=["23"]
    )
    assert resp.choices[0].text == "80" and resp.choices[0].finish_reason == "stop"


def _error(exc: openai.APIStatusError) -> dict:
    body = exc.response.json()
    assert set(body["error"]) == {"message", "type", "param", "code"}
    return body["error"]


@pytest.mark.parametrize(
    "kwargs, param",
    [
        ({"model": "gpt-4"}, "model"),
        ({"max_tokens": 0}, "max_tokens"),
        ({"max_tokens": -3}, "max_tokens"),
        ({"prompt": "1" * 600}, None),
        ({"extra_body": {"confidence_threshold": 0.0}}, "confidence_threshold"),
        ({"extra_body": {"confidence_threshold": 1.5}}, "confidence_threshold"),
        ({"extra_body": {"slo_ms": -5}}, "slo_ms"),
        ({"extra_body": {"max_tokens": "ten"}}, "max_tokens"),
        ({"extra_body": {"priority": "high"}}, "priority"),
        ({"prompt": ""}, None),
        ({"top_p": 1.5}, "top_p"),
        ({"extra_body": {"alg": "greedy"}}, "alg"),
        ({"extra_body": {"top_k": 0}}, "top_k"),
        ({"extra_body": {"alg": "origin", "alg_temp": 0.5}}, "alg_temp"),
        ({"extra_body": {"alg": "entropy", "steps_per_block": 64}}, None),
        ({"seed": 2**63}, "seed"),
    ],
)
def test_bad_requests_are_400_with_an_openai_error_body(server, kwargs, param):
    args = {"model": "dilaserve-tiny", "prompt": "12+34=", "max_tokens": 8} | kwargs
    with pytest.raises(openai.BadRequestError) as info:
        server.client().completions.create(**args)
    error = _error(info.value)
    assert error["type"] == "invalid_request_error"
    if param:
        assert error["param"] == param


def test_dreams_generation_options_through_the_openai_client(server):
    resp = server.client().completions.create(
        model="dilaserve-tiny",
        prompt="12345+67890=",
        max_tokens=8,
        top_p=0.9,
        extra_body={"alg": "entropy", "steps_per_block": 8, "top_k": 5},
    )
    assert resp.choices[0].text == "80235"
    assert resp.model_extra["dilaserve"]["steps"] <= 8


def test_a_seeded_request_samples_what_it_samples_alone(server):
    """OpenAI's `seed`: with τ pinned (the scheduler's choice depends on the load), a
    sampled request decodes what the same seed decodes alone, on either instance, however
    far the instances' shared streams have moved; other seeds sample other text."""
    prompt = "draw:ajdhmnff,asxfmnee,kjxfmxef,asxhlfef>"  # a task the tiny model is unsure of

    def sample(seed: int) -> str:
        resp = server.client().completions.create(
            model="dilaserve-tiny",
            prompt=prompt,
            max_tokens=32,
            temperature=1.5,
            seed=seed,
            extra_body={"confidence_threshold": PINNED_TAU},
        )
        return resp.choices[0].text

    tokenizer = load_tokenizer(default_model_dir())
    alone = {
        seed: tokenizer.decode(
            decode_alone(prompt, 32, (PINNED_TAU,) * 33, temperature=1.5, seed=seed).output_ids,
            skip_special_tokens=True,
        )
        for seed in (1, 2, 5)
    }
    assert len(set(alone.values())) > 1
    for seed, text in alone.items():
        server.client().completions.create(  # moves an instance's shared stream on
            model="dilaserve-tiny", prompt="2+2=", max_tokens=8, temperature=2.0
        )
        assert sample(seed) == text


async def _post(url: str, data: bytes, headers: dict | None = None):
    headers = {"Authorization": f"Bearer {API_KEY}", "Content-Type": "application/json"} | (
        headers or {}
    )
    async with (
        aiohttp.ClientSession() as session,
        session.post(url, data=data, headers=headers) as r,
    ):
        return r.status, await r.json(content_type=None), r.headers


def test_malformed_json_and_oversized_bodies(server):
    status, body, _ = asyncio.run(_post(f"{server.url}/v1/completions", b"{not json"))
    assert status == 400 and "JSON" in body["error"]["message"]
    big = json.dumps({"prompt": "1" * 100_000, "max_tokens": 4}).encode()
    status, body, _ = asyncio.run(_post(f"{server.url}/v1/completions", big))
    assert status == 413 and body["error"]["code"] == "request_too_large"


def test_api_key_is_required_except_for_health(server):
    with pytest.raises(openai.AuthenticationError) as info:
        server.client(api_key="wrong").models.list()
    assert _error(info.value)["code"] == "invalid_api_key"
    assert [m.id for m in server.client().models.list().data] == ["dilaserve-tiny"]

    async def get(path):
        async with aiohttp.ClientSession() as s, s.get(server.url + path) as r:
            return r.status, await r.json()

    status, body = asyncio.run(get("/v1/models"))  # no Authorization header at all
    assert status == 401 and body["error"]["type"] == "authentication_error"
    assert asyncio.run(get("/health")) == (200, {"status": "ok"})
    assert asyncio.run(get("/ready")) == (200, {"ready": True})


def test_a_client_that_disconnects_cancels_its_request(server):
    (p,) = make_problems(1, SEED + 1, tasks=("tr",))

    async def disconnect():
        body = {"prompt": p.prompt, "max_tokens": 160, "stream": True}
        body["confidence_threshold"] = 1.0  # one token per step: runs for a long while
        headers = {"Authorization": f"Bearer {API_KEY}"}
        url = f"{server.url}/v1/completions"
        async with aiohttp.ClientSession() as s, s.post(url, json=body, headers=headers) as r:
            await r.content.readline()  # the first event: the request is running
            assert server.engine.active_requests == 1
        while server.engine.active_requests:
            await asyncio.sleep(0.01)

    asyncio.run(asyncio.wait_for(disconnect(), 60))
    assert server.engine.active_requests == 0


def test_cluster_and_metrics(server):
    async def get(path):
        headers = {"Authorization": f"Bearer {API_KEY}"}
        async with aiohttp.ClientSession() as s, s.get(server.url + path, headers=headers) as r:
            return r.status, await r.text()

    def finished() -> float:
        families = {
            f.name: f for f in text_string_to_metric_families(asyncio.run(get("/metrics"))[1])
        }
        samples = families["dilaserve:requests"].samples
        return next(s.value for s in samples if s.labels.get("outcome") == "finished")

    server.client().completions.create(model="dilaserve-tiny", prompt="12+34=", max_tokens=4)
    before = finished()
    server.client().completions.create(model="dilaserve-tiny", prompt="12+34=", max_tokens=4)
    assert finished() == before + 1
    families = {f.name for f in text_string_to_metric_families(asyncio.run(get("/metrics"))[1])}
    assert {"dilaserve:request_latency_seconds", "dilaserve:instances"} <= families
    assert {"dilaserve:worker_restarts", "dilaserve:threshold"} <= families
    status, text = asyncio.run(get("/v1/cluster"))
    cluster = json.loads(text)
    assert status == 200 and [i["tp"] for i in cluster["instances"]] == [1, 1]
    assert all(i["state"] == "serving" for i in cluster["instances"])
    times = cluster["step_times"]
    assert times["steps"] > 0 and times["round_trip_s"] >= times["worker_s"] > 0
    assert times["predicted_s"] > 0
