"""Requests that never asked for a deadline, on a model without measured rates: the
engine learns the model's tokens per step from what it serves (default SLOs and
predictions follow), and never trades such a request's quality for its default SLO."""

from __future__ import annotations

import asyncio

from dilaserve.engine import GenerationParams
from dilaserve.engine.rates import MIN_STEPS, REVISE_EVERY, OnlineRates
from dilaserve.planner import FAST_DLLM_THRESHOLDS

ASSUMED = [(o.threshold, o.tokens_per_step) for o in FAST_DLLM_THRESHOLDS]


def test_a_threshold_measured_often_enough_replaces_the_assumption():
    rates = OnlineRates(ASSUMED)
    assumed = dict(rates.table)
    for _ in range(MIN_STEPS - 1):
        rates.record(0.9, 1, 1)
    assert dict(rates.table) == assumed and rates.measured == ()
    revised = any(rates.record(0.9, 1, 1) for _ in range(REVISE_EVERY))
    table = dict(rates.table)
    assert revised and rates.measured == (0.9,) and table[0.9] == 1.0
    # The unmeasured thresholds keep the assumption's shape, scaled to what was measured.
    scale = 1.0 / assumed[0.9]
    assert table[0.5] == max(1.0, scale * assumed[0.5])
    assert [r for _, r in rates.table] == sorted((r for _, r in rates.table), reverse=True)
    assert rates.record(0.55, 1, 3) is False  # a pinned τ between candidates is not counted


def test_an_unmeasured_model_learns_its_rates_and_keeps_default_slo_requests_at_the_top(
    make_engine, tiny_llada_dir
):
    h = make_engine(model=str(tiny_llada_dir), instances=(1,), max_accuracy_drop=0.03)
    engine = h.engine
    assert engine.tokens_per_step()["source"] == "assumed"
    prompt = [5, 6, 7, 8]

    def default_slo() -> float:
        return engine.builder.build(0, prompt, GenerationParams(max_tokens=32))[1]

    before = h.call(default_slo)

    async def serve(n: int):
        outs = await asyncio.gather(
            *(engine.complete(prompt, GenerationParams(max_tokens=32)) for _ in range(n))
        )
        return [o.stats for o in outs]

    stats = []
    while engine.tokens_per_step()["source"] == "assumed":
        assert len(stats) < 64, "the rates were never learned"
        stats += h.run(serve(4))
    # Nothing asked for a deadline and the model's accuracy per τ is unmeasured: every
    # step ran at the top threshold, however tight the assumed rates made the default SLO.
    assert {tau for s in stats for tau in s.taus} == {0.9}
    learned = dict(engine.tokens_per_step()["table"])
    assert 1.0 <= learned[0.9] < dict(ASSUMED)[0.9]  # a random model commits little per step
    assert h.call(default_slo) > before
