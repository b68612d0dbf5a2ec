"""`kv_cache_memory`: the worker sizes its KV pool from the budget and the scheduler admits
against the tokens it reports."""

from __future__ import annotations

import asyncio

import pytest
import torch
from tp_profiles import write_tp_profile

from dilaserve.engine import BadRequestError, GenerationParams
from dilaserve.models import read_config
from dilaserve.tiny import default_model_dir
from dilaserve.worker.kv_cache import bytes_per_token


def test_the_pool_the_worker_reports_is_the_budget_in_tokens(make_engine):
    _, config = read_config(default_model_dir())
    per_token = bytes_per_token(
        config.num_layers, config.num_kv_heads, config.head_dim, torch.float32
    )
    harness = make_engine(kv_cache_memory=300 * per_token, max_requests_per_instance=8)
    (inst,) = harness.engine.instances.values()
    assert inst.ready.kv_tokens == 300  # not 8 x the model's context
    assert inst.ready.max_seq_len == 300

    async def finish(prompt: str):
        async for out in harness.engine.generate(prompt, GenerationParams(max_tokens=64)):
            last = out
        return last

    async def both():
        return await asyncio.gather(finish("12345+67890="), finish("2+2="))

    # Requests of ~76 tokens each share the 300-token pool and decode.
    outs = harness.run(both())
    assert [o.finish_reason for o in outs] == ["stop", "stop"]


def test_a_request_longer_than_the_pool_is_refused_at_once(make_engine):
    _, config = read_config(default_model_dir())
    per_token = bytes_per_token(
        config.num_layers, config.num_kv_heads, config.head_dim, torch.float32
    )
    harness = make_engine(kv_cache_memory=100 * per_token)
    with pytest.raises(BadRequestError, match="KV cache"):
        # About 60 prompt tokens and two 32-token blocks: 124 positions for a 100-token pool.
        harness.engine.add_request("1234567890+" * 5 + "1=", GenerationParams(max_tokens=64))
    # Refused second of three submitted together: the first, already admitted, goes too.
    fits, too_long = GenerationParams(max_tokens=8), GenerationParams(max_tokens=64)
    items = [("12345+67890=", fits), ("1234567890+" * 5 + "1=", too_long), ("1+1=", fits)]
    with pytest.raises(BadRequestError, match="KV cache") as info:
        harness.call(harness.engine.add_requests, items)
    assert info.value.index == 1 and harness.engine.active_requests == 0
    assert harness.call(harness.engine.scheduler.instance, 0).residents == 0


def test_a_waiting_request_no_instance_left_can_hold_fails_instead_of_waiting(
    make_engine, tmp_path
):
    """A TP-2 instance holds twice the tokens of a TP-1 one in the same per-device budget.
    A request only the TP-2 instance can hold is admitted, then that instance is stopped:
    the request leaves it after its first block at the latest, and once it has stopped
    nothing left can ever serve the request, so it fails (503) rather than wait."""
    _, config = read_config(default_model_dir())
    per_token = bytes_per_token(
        config.num_layers, config.num_kv_heads, config.head_dim, torch.float32
    )
    profile = write_tp_profile(tmp_path / "tp.json", (1, 2))
    h = make_engine(instances=(2, 1), profile=profile, kv_cache_memory=100 * per_token)
    engine = h.engine
    assert [engine.instances[i].ready.kv_tokens for i in (0, 1)] == [200, 100]

    async def outcome(req) -> str:
        while True:
            item = await req.outputs.get()
            if isinstance(item, BaseException):
                return str(item)
            if item.finished:
                return item.finish_reason

    async def scenario():
        # About 60 prompt tokens and two 32-token blocks: 121 positions.
        long = engine.add_request("1234567890+" * 5 + "1=", GenerationParams(max_tokens=64))
        short = engine.add_request("2+2=", GenerationParams(max_tokens=32))
        await engine.stop_instance(0)
        return await outcome(long), await outcome(short)

    long_outcome, short_outcome = h.run(asyncio.wait_for(scenario(), 120))
    assert "needs 121 tokens of KV cache and no instance left holds more than 100" in (long_outcome)
    assert short_outcome == "stop"  # the TP-1 instance still serves what it can hold
