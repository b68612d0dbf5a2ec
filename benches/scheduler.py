"""Scheduling-round benchmark: the Rust core against the pure-Python reference
(`tests/sched_reference.py`) on the same events, side by side in one run.

A round is load control + instance choice + threshold choice over every active request.
Each configuration admits N requests on M instances (TP 1/2/4), then runs rounds in a
steady state: every dispatched batch reports its step before the next round. Both
implementations get identical events and must make identical decisions in every compared
round. Prints one JSON object per line.

Run: python benches/scheduler.py [--quick]   (about a minute on 2 cores; --quick: seconds)
"""

from __future__ import annotations

import argparse
import gc
import json
import statistics
import sys
import time
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))

from sched_reference import ReferenceScheduler, assert_same  # noqa: E402

from dilaserve.scheduler import LatencyProfile, Scheduler, SchedulerConfig, StepResult  # noqa: E402

TP_SPEED = {1: 1.0, 2: 0.75, 4: 0.45}  # DESIGN §2: TP2 -25 %, TP4 -55 % per step
BLOCK = 32


def llada_like_profile() -> LatencyProfile:
    """A synthetic LLaDA-8B-shaped profile: fixed per-step overhead plus per-token cost."""
    tables = []
    for tp, speed in TP_SPEED.items():
        full = [(n, (0.015 + 3.0e-5 * n) * speed) for n in (128, 512, 2048, 8192, 32768)]
        cache = [(n, (0.008 + 1.5e-5 * n) * speed) for n in (32, 256, 2048, 8192, 32768)]
        tables += [(tp, "recompute", full), (tp, "cache", cache)]
    return LatencyProfile.from_tables(tables)


@dataclass
class Setup:
    requests: int
    instances: int
    rounds: int
    compared: int
    rust_ms: list[float] = field(default_factory=list)
    python_call_ms: list[float] = field(default_factory=list)
    overhead: list[float] = field(default_factory=list)
    reference_ms: list[float] = field(default_factory=list)
    dispatched: list[int] = field(default_factory=list)


def populate(scheds: list, n_req: int, n_inst: int, seed: int) -> None:
    """Same instances and ShareGPT-like requests into every scheduler."""
    rng = np.random.default_rng(seed)
    tps = [(1, 2, 4)[i % 3] for i in range(n_inst)]
    prompts = np.clip(rng.lognormal(4.2, 1.2, n_req), 4, 1698).astype(int)
    outputs = np.clip(rng.lognormal(5.3, 0.7, n_req), 64, 928).astype(int)
    arrivals = -rng.uniform(0.0, 10.0, n_req)
    slos = rng.uniform(5.0, 60.0, n_req)
    for s in scheds:
        for i, tp in enumerate(tps):
            s.add_instance(i, tp=tp, gpus=list(range(tp)), node=i)
        for i in range(n_req):
            s.arrive(
                i,
                arrival=float(arrivals[i]),
                deadline=float(arrivals[i] + slos[i]),
                prompt_len=int(prompts[i]),
                output_len=int(outputs[i]),
            )


def step_reports(decisions, in_block: dict[int, int], step: int) -> list[tuple[int, float, list]]:
    """Deterministic worker replies: 1-3 tokens per step, never past the block end."""
    out = []
    columns = zip(
        decisions.batch_instances.tolist(),
        decisions.batch_starts.tolist(),
        decisions.batch_lens.tolist(),
        decisions.batch_finish.tolist(),
        strict=True,
    )
    for inst, start, length, finish in columns:
        ids = decisions.entry_requests[start : start + length].tolist()
        results = []
        for rid in ids:
            c = min(1 + (rid + step) % 3, BLOCK - in_block.get(rid, 0))
            in_block[rid] = (in_block.get(rid, 0) + c) % BLOCK
            results.append(StepResult(rid, c))
        measured = (finish - decisions.now) * (1.0 + 0.1 * (inst % 3))
        out.append((inst, measured, results))
    return out


def run(setup: Setup, profile: LatencyProfile, config: SchedulerConfig) -> None:
    rust = Scheduler(profile, config)
    ref = ReferenceScheduler(profile, config)
    populate([rust, ref], setup.requests, setup.instances, seed=setup.requests + setup.instances)
    in_block: dict[int, int] = {}
    now = 0.0
    gc.disable()
    try:
        for step in range(setup.rounds):
            compare = step < setup.compared
            t0 = time.perf_counter()
            d = rust.schedule(now)
            # A caller needs the decisions in hand: fetch the columns it dispatches from.
            _ = (d.batch_instances, d.batch_starts, d.batch_lens, d.entry_requests, d.entry_taus)
            _ = (d.entry_kinds, d.entry_new_here)
            py_s = time.perf_counter() - t0
            if step >= 2:  # the first rounds place fresh arrivals only
                setup.rust_ms.append(d.elapsed_s * 1e3)
                setup.python_call_ms.append(py_s * 1e3)
                setup.overhead.append((py_s - d.elapsed_s) / py_s)
            setup.dispatched.append(len(d.entry_requests))
            if compare:
                t0 = time.perf_counter()
                expected = ref.schedule(now)
                ref_s = time.perf_counter() - t0
                if step >= 2:
                    setup.reference_ms.append(ref_s * 1e3)
                assert_same(d, expected)
            for inst, measured, results in step_reports(d, in_block, step):
                rust.step_done(inst, measured, results)
                if compare:
                    ref.step_done(inst, measured, results)
            # Drop this round's objects before the next timed call, not inside it.
            del d
            now += 0.05
    finally:
        gc.enable()


def emit(name: str, value: float, unit: str, **extra: object) -> None:
    print(json.dumps({"name": name, "value": round(value, 4), "unit": unit, **extra}), flush=True)


def label(n: int) -> str:
    return f"{n // 1000}k"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="small sizes, few rounds: checks it runs")
    quick = p.parse_args().quick
    profile = llada_like_profile()
    config = SchedulerConfig(thresholds=(0.5, 0.6, 0.7, 0.8, 0.9), max_batch_tokens=8192)
    results: dict[tuple[int, int], Setup] = {}
    plan = {1_000: (60, 60), 10_000: (30, 30), 100_000: (12, 3)}
    runs = [(n, i, *plan[n]) for n in plan for i in (16, 256, 1024)]
    if quick:
        runs = [(1_000, 16, 3, 3), (10_000, 256, 3, 3)]  # rounds from the third are timed
    for n_req, n_inst, rounds, compared in runs:
        setup = Setup(n_req, n_inst, rounds, compared)
        run(setup, profile, config)
        results[(n_req, n_inst)] = setup
        med = statistics.median(setup.rust_ms)
        ref = statistics.median(setup.reference_ms)
        py = statistics.median(setup.python_call_ms)
        emit(
            f"sched_round_ms_{label(n_req)}_req_{n_inst}_inst",
            med,
            "ms",
            baseline="python_reference",
            ratio=round(ref / med, 1),
            reference_ms=round(ref, 3),
            python_call_ms=round(py, 4),
            rounds=len(setup.rust_ms),
            compared_rounds=compared,
            mean_dispatched=round(statistics.mean(setup.dispatched)),
            identical_decisions=True,
        )
    for n_req, n_inst in ((1_000, 16), (10_000, 256), (100_000, 1024)):
        if (n_req, n_inst) not in results:
            continue
        s = results[(n_req, n_inst)]
        py = statistics.median(s.python_call_ms)
        ref = statistics.median(s.reference_ms)
        emit(
            f"ratio_rust_vs_python_{label(n_req)}",
            ref / py,
            "x",
            baseline="python_reference",
            detail=f"{n_req} requests x {n_inst} instances; Rust timed as called from Python",
            rust_python_call_ms=round(py, 4),
            reference_ms=round(ref, 3),
            ratio_core_only=round(ref / statistics.median(s.rust_ms), 1),
        )
    s = results[(10_000, 256)]
    emit(
        "binding_overhead_frac_10k",
        statistics.median(s.overhead),
        "fraction",
        baseline="rust_core_round",
        detail="(python-called round incl. fetching decision columns - core round) / python-called",
        python_call_ms=round(statistics.median(s.python_call_ms), 4),
        core_ms=round(statistics.median(s.rust_ms), 4),
    )


if __name__ == "__main__":
    main()
