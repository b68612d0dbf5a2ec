"""What a benchmark sends: arrival times (Poisson, Gamma, or a replayed trace) and, for
each arrival, a task problem of the embedded model's suite, so every answer is checked."""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

from dilaserve.tiny.tasks import Problem, make_problems

#: Tasks by answer length, used to match a trace's output lengths.
TASKS_BY_LENGTH = (("add", 5), ("rep", 8), ("draw", 8), ("tr", 128))


@dataclass(frozen=True)
class Arrival:
    time: float
    problem: Problem


def _check_window(rate: float, duration: float) -> None:
    """Arrivals need a positive rate and a finite window: anything else never ends."""
    if not (rate > 0 and math.isfinite(rate) and math.isfinite(duration)):
        raise ValueError(f"arrivals need a positive finite rate and window: {rate}/s, {duration} s")


def poisson_times(rate: float, duration: float, rng: random.Random) -> list[float]:
    _check_window(rate, duration)
    times, t = [], rng.expovariate(rate)
    while t < duration:
        times.append(t)
        t += rng.expovariate(rate)
    return times


def gamma_times(rate: float, cv: float, duration: float, rng: random.Random) -> list[float]:
    """Bursty arrivals: Gamma inter-arrival times with mean 1/rate and coefficient of
    variation `cv` (BurstGPT's shape; cv = 1 is Poisson)."""
    _check_window(rate, duration)
    if not cv > 0:
        raise ValueError(f"a Gamma coefficient of variation must be positive, got {cv}")
    shape = 1.0 / (cv * cv)
    times, t = [], rng.gammavariate(shape, 1.0 / (rate * shape))
    while t < duration:
        times.append(t)
        t += rng.gammavariate(shape, 1.0 / (rate * shape))
    return times


def replayed(
    trace: list[tuple[float, int, int]], rate: float, duration: float
) -> list[tuple[float, int, int]]:
    """The trace's rows with their times scaled so that requests arrive at `rate` per
    second on average, bursts kept, cut at `duration`. A window longer than the scaled
    trace replays it again from its start, one mean gap after its last arrival, so the
    whole window carries `rate` (a trace that ran out would leave its end idle)."""
    _check_window(rate, duration)
    if not trace:
        raise ValueError("an empty trace has no arrivals to replay")
    n, span = len(trace), trace[-1][0]
    # The n - 1 gaps inside the trace and the one before its next pass average 1/rate.
    scale = (n - 1) / (rate * span) if span > 0 else 0.0
    period = n / rate
    rows, passes = [], 0
    while True:
        for t, p, o in trace:
            when = passes * period + t * scale
            if when >= duration:
                return rows
            rows.append((when, p, o))
        passes += 1


def trace_arrivals(
    trace: list[tuple[float, int, int]],
    rate: float,
    duration: float,
    length_scale: float,
    rng: random.Random,
) -> list[Arrival]:
    """The trace's arrival pattern compressed in time to `rate` requests per second (its
    bursts kept; `replayed`) over `duration`; each output length, times `length_scale`,
    picks the task whose answers are closest in length."""
    arrivals = []
    for when, _, generated in replayed(trace, rate, duration):
        target = generated * length_scale
        task = min(TASKS_BY_LENGTH, key=lambda tl: abs(tl[1] - target))[0]
        (problem,) = make_problems(1, rng.randrange(1 << 30), tasks=(task,))
        arrivals.append(Arrival(when, problem))
    return arrivals


def task_arrivals(times: list[float], seed: int) -> list[Arrival]:
    """Arrivals at `times`, each with a problem of the evaluated task mix."""
    return [Arrival(t, p) for t, p in zip(times, make_problems(len(times), seed), strict=True)]
