"""Prefix sharing in the engine: it knows which prompt blocks each instance holds and tells
the scheduler, so a request's first step is priced (and placed) at what it will feed; it
passes on the stored blocks each request reads, so admission counts a shared block once; it
counts the instances' lookups and hits and exports them."""

from __future__ import annotations

import asyncio

from prometheus_client import generate_latest
from prometheus_client.parser import text_string_to_metric_families

from dilaserve.engine import GenerationParams
from dilaserve.engine.prefix_index import PrefixIndex
from dilaserve.protocol import CacheMode, prompt_block_keys
from dilaserve.server.metrics import Metrics
from dilaserve.tiny import MOE_MODEL_NAME


def test_the_index_finds_the_instance_holding_the_longest_run_of_leading_blocks():
    index = PrefixIndex(2)
    index.add_instance(1, kv_tokens=100)
    index.add_instance(2, kv_tokens=6)  # three blocks
    index.record(1, index.keys([1, 1, 2, 2, 9]))
    index.record(2, index.keys([1, 1, 2, 2, 3, 3]))
    assert index.longest(index.keys([1, 1, 2, 2, 3, 3, 4])) == (2, 6)
    assert index.longest(index.keys([1, 1, 2, 2, 5, 5])) in ((1, 4), (2, 4))
    assert index.longest(index.keys([2, 2, 1, 1])) is None  # a block's key is all before it too
    # Instance 2 holds three blocks: the root of a new prompt stays, its tail goes first.
    index.record(2, index.keys([7, 7, 8, 8]))
    assert index.longest(index.keys([1, 1, 2, 2, 3, 3])) == (1, 4)
    assert index.longest(index.keys([7, 7, 8, 8])) == (2, 4)
    index.remove_instance(2)
    assert index.longest(index.keys([7, 7, 8, 8])) is None
    index.record(2, index.keys([7, 7]))  # an instance it does not know: nothing
    assert index.longest(index.keys([7, 7])) is None


def test_a_request_behind_a_stored_system_prompt_is_expected_where_it_is_stored(make_engine):
    """The engine records the blocks of each prompt it sends to an instance and announces a
    later request's stored prefix to the scheduler before it is placed."""
    harness = make_engine(model=MOE_MODEL_NAME, cache=CacheMode.BLOCK, instances=(1, 1))
    engine = harness.engine
    system = "sumsoffivedigits:"  # two whole blocks of 8, with or without a first token
    params = GenerationParams(max_tokens=8, threshold=0.9)
    first = harness.run(engine.complete(system + "12345+67890=", params))
    (home,) = first.stats.instances
    expected: list[tuple[int, int, int]] = []
    scheduler = engine.scheduler

    def spy(request_id: int, instance_id: int, tokens: int) -> None:
        expected.append((request_id, instance_id, tokens))
        original(request_id, instance_id, tokens)

    original = scheduler.expect_prefix
    with harness.patched(scheduler, "expect_prefix", spy):
        second = harness.run(engine.complete(system + "31415+42653=", params))
    # Where it runs is the scheduler's choice (each instance's measured speed counts too:
    # `a_stored_prefix_draws_a_request_to_the_instance_holding_it_at_its_shorter_step`).
    assert len(expected) == 1 and expected[0][1:] == (home, 16)
    assert second.stats.steps >= 1


def test_prefix_store_reads_lookups_and_hits_are_reported_counted_and_exported(make_engine):
    """Each report names the stored blocks its admitted requests read, which the engine
    passes to the scheduler, and counts their prompt tokens looked up in the instance's
    prefix store and found there; the engine sums those and /metrics exports the sums."""
    harness = make_engine(model=MOE_MODEL_NAME, cache=CacheMode.BLOCK, instances=(1,))
    engine = harness.engine
    system = "sumsoffivedigits:"  # two whole blocks of 8 shared
    params = GenerationParams(max_tokens=8, threshold=0.9)
    harness.run(engine.complete(system + "12345+67890=", params))
    assert harness.call(lambda: engine.status().prefix_cache)["hit_tokens"] == 0
    reads: list[tuple[int, list[int], list[int]]] = []
    scheduler = engine.scheduler
    read_prefix = scheduler.read_prefix

    def read(instance_id: int, request_id: int, keys: list[int]) -> None:
        prompt = engine._requests[request_id].state.prompt_ids
        reads.append((instance_id, keys, prompt_block_keys(prompt, 8)))
        read_prefix(instance_id, request_id, keys)

    # One position a step: its first step does not finish it (a finished request reads
    # nothing any more).
    one_a_step = GenerationParams(max_tokens=8, steps_per_block=8)
    with harness.patched(scheduler, "read_prefix", read):
        harness.run(engine.complete(system + "31415+42653=", one_a_step))
    # The two shared blocks, named as the engine names its prompt's blocks.
    (instance,) = harness.call(lambda: [i.id for i in engine.status().instances])
    ((at, keys, prompt_keys),) = reads
    assert at == instance and keys == prompt_keys[:2]
    use = harness.call(lambda: engine.status().prefix_cache)
    assert use["hit_tokens"] == 16 and use["queried_tokens"] >= 2 * 24
    metrics = Metrics(engine)
    text = harness.call(lambda: generate_latest(metrics.registry).decode())
    families = {f.name: f for f in text_string_to_metric_families(text)}
    (hits,) = families["dilaserve:prefix_cache_hits"].samples
    assert hits.value == 16
    assert families["dilaserve:prefix_cache_queries"].samples[0].value == use["queried_tokens"]


def test_readers_of_a_stored_prompt_leave_their_instance_charging_nothing(make_engine):
    """Requests behind one stored system prompt run side by side, each reading its blocks;
    once all have finished, the instance's KV charge is back to zero: no read outlives its
    reader, and no shared block stays counted."""
    harness = make_engine(model=MOE_MODEL_NAME, cache=CacheMode.BLOCK, instances=(1,))
    engine = harness.engine
    system = "sumsoffivedigits:"  # two whole blocks of 8 shared
    harness.run(engine.complete(system + "12345+67890=", GenerationParams(max_tokens=8)))
    scheduler = engine.scheduler
    read_prefix = scheduler.read_prefix
    reads: list[list[int]] = []

    def read(instance_id: int, request_id: int, keys: list[int]) -> None:
        reads.append(keys)
        read_prefix(instance_id, request_id, keys)

    async def together() -> None:
        # One position a step: the first step finishes none of them (a request that
        # finishes in the step that took it in reads nothing by its report).
        one_a_step = GenerationParams(max_tokens=8, steps_per_block=8)
        prompt = system + "31415+42653="
        await asyncio.gather(*(engine.complete(prompt, one_a_step) for _ in range(3)))

    with harness.patched(scheduler, "read_prefix", read):
        harness.run(together())
    assert len(reads) == 3 and len(reads[0]) == 2 and reads.count(reads[0]) == 3
    (instance,) = harness.call(lambda: engine.status().instances)
    assert (instance.residents, instance.resident_tokens, instance.kv_used_tokens) == (0, 0, 0)
