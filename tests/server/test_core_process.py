"""The engine core in its own process (`EngineClient`, what `dilaserve serve` runs): the
HTTP front end tokenizes, decodes and counts usage; the core sees token ids only."""

from __future__ import annotations

import asyncio
import contextlib
import json
import os
import signal
import time
import urllib.request

import openai
import pytest

from dilaserve.engine import EngineClient, EngineConfig, EngineStoppedError, GenerationParams
from dilaserve.server.streaming import tokens_spelling


@pytest.fixture(scope="module")
def live(start_module_server):
    return start_module_server(core_process=True, instances=(1, 1))


def cluster(live) -> dict:
    with urllib.request.urlopen(f"{live.url}/v1/cluster") as response:
        return json.load(response)


def wait_for(condition, seconds: float = 30.0) -> None:
    """Polls `condition` (the core's status arrives every quarter second)."""
    deadline = time.monotonic() + seconds
    while not condition():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.05)


def test_completions_streams_and_samples_through_the_core_process(live):
    client = live.client()
    resp = client.completions.create(model="dilaserve-tiny", prompt="12345+67890=", max_tokens=8)
    assert resp.choices[0].text == "80235" and resp.choices[0].finish_reason == "stop"
    assert resp.usage.prompt_tokens == 12 and resp.usage.completion_tokens == 5
    assert resp.model_extra["dilaserve"]["steps"] >= 1
    stream = client.completions.create(
        model="dilaserve-tiny", prompt="12345+67890=", max_tokens=8, stream=True
    )
    assert "".join(c.choices[0].text for c in stream if c.choices) == "80235"
    many = client.completions.create(
        model="dilaserve-tiny", prompt=["12345+67890=", "11111+22222="], max_tokens=8, n=2
    )
    assert [c.text for c in many.choices] == ["80235", "80235", "33333", "33333"]

    def settled() -> bool:  # a status from after the six requests ended
        state = cluster(live)
        steps = sum(i["steps_run"] for i in state["instances"])
        return len(state["instances"]) == 2 and steps >= 6 and state["active_requests"] == 0

    wait_for(settled)


def test_a_bad_prompt_among_several_is_refused_naming_its_index(live):
    with pytest.raises(openai.BadRequestError, match="prompt 1"):
        live.client().completions.create(
            model="dilaserve-tiny", prompt=[[5, 6, 7], [10**9]], max_tokens=8
        )
    with pytest.raises(openai.BadRequestError, match="context"):
        live.client().completions.create(model="dilaserve-tiny", prompt="1+1=", max_tokens=100_000)


def test_a_stop_string_cut_counts_its_tokens_without_tokenizing_again(live, monkeypatch):
    """The usage of a completion cut by a stop string comes from the ids the core sent."""

    def no_tokenizing(*args, **kwargs):
        raise AssertionError("the front end tokenized a completion again")

    ids = live.engine.tokenizer("12345+67890=", add_special_tokens=False)["input_ids"]
    monkeypatch.setattr(type(live.engine.tokenizer), "__call__", no_tokenizing)
    monkeypatch.setattr(type(live.engine.tokenizer), "encode", no_tokenizing)
    resp = live.client().completions.create(
        model="dilaserve-tiny", prompt=ids, max_tokens=8, stop=["23"]
    )
    assert resp.choices[0].text == "80" and resp.usage.completion_tokens == 2
    assert resp.choices[0].finish_reason == "stop"


def test_tokens_spelling_is_the_fewest_leading_ids_that_spell_the_text():
    words = {1: "ab", 2: "c", 3: "", 4: "def"}

    def decode(ids):
        return "".join(words[i] for i in ids)

    ids = [1, 2, 3, 4]
    assert [tokens_spelling(decode, ids, n) for n in range(7)] == [0, 1, 1, 2, 4, 4, 4]


def test_a_core_that_dies_fails_its_requests_and_stops_the_server(start_server):
    live = start_server(core_process=True, instances=(1,), stop_at_eos=False)
    client = live.client()
    assert (
        client.completions.create(model="dilaserve-tiny", prompt="12345+67890=", max_tokens=8)
        .choices[0]
        .text
        == "80235"
    )
    with urllib.request.urlopen(f"{live.url}/ready") as response:
        assert json.load(response) == {"ready": True}
    stream = client.completions.create(
        model="dilaserve-tiny",
        prompt="1+1=",
        max_tokens=480,
        stream=True,
        extra_body={"steps_per_block": 32},  # 480 steps: it runs when the core dies
    )
    next(iter(stream))  # the request is admitted and running
    os.kill(live.engine._process.pid, signal.SIGKILL)
    with pytest.raises(openai.APIError):
        for chunk in stream:
            assert chunk.choices[0].finish_reason is None, "it did not finish"
    with pytest.raises(EngineStoppedError, match="core exited"):
        live.task.result(60)  # the server stops: it does not pose as alive
    assert not live.engine.status().ready


def test_a_core_that_cannot_start_says_why(tiny_profile, tmp_path):
    config = EngineConfig(instances=(1,), profile=tmp_path / "missing.json")

    async def start() -> None:
        async with EngineClient(config) as engine:
            await engine.submit([("1+1=", GenerationParams())])

    with pytest.raises(EngineStoppedError, match="missing.json"):
        asyncio.run(start())


def test_a_submit_its_caller_leaves_does_not_leave_requests_running(tiny_profile):
    """A caller cancelled while the core admits its requests (a client that disconnects):
    the admitted requests are cancelled, not left to run to their end unread."""
    config = EngineConfig(instances=(1,), profile=tiny_profile, stop_at_eos=False)
    long = GenerationParams(max_tokens=480, steps_per_block=32)  # 480 steps

    async def scenario() -> tuple[int, int]:
        async with EngineClient(config) as engine:
            submit = asyncio.ensure_future(engine.submit([("1+1=", long)]))
            await asyncio.sleep(0)  # sent; the core's answer is on its way
            submit.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await submit
            left = engine.status().taken_s
            while engine.status().taken_s < left + 1.0:  # a status from well after it
                await asyncio.sleep(0.05)
            return engine.status().active_requests, len(engine._requests)

    assert asyncio.run(scenario()) == (0, 0)
