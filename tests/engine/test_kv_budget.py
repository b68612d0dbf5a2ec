"""`kv_cache_memory`: the worker sizes its KV pool from the budget and the scheduler admits
against the tokens it reports."""

from __future__ import annotations

import asyncio

import pytest
import torch

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
