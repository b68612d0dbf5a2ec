"""Sending a workload to a server at its arrival times and recording what came back."""

from __future__ import annotations

import asyncio
import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass

import aiohttp

from dilaserve.tiny.tasks import check, gen_length, make_problems

from .workload import Arrival

#: τ at which isolated latency (the SLO unit, DESIGN §9) is measured: the baselines'.
ISOLATED_TAU = 0.9


@dataclass(frozen=True)
class Outcome:
    task: str
    sent_at: float
    latency_s: float | None  # None: no answer (rejected or failed)
    status: int
    slo_s: float
    correct: bool = False
    mean_tau: float | None = None

    @property
    def slo_met(self) -> bool:
        return self.latency_s is not None and self.latency_s <= self.slo_s


async def served_model(url: str, api_key: str | None = None) -> str:
    """The model a server serves (the first `/v1/models` lists): what requests name."""
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    async with (
        aiohttp.ClientSession() as session,
        session.get(f"{url.rstrip('/')}/v1/models", headers=headers) as r,
    ):
        data = await r.json(content_type=None)
    if r.status != 200 or not data.get("data"):
        raise RuntimeError(f"{url}/v1/models answered {r.status}: {data}")
    return str(data["data"][0]["id"])


class Client:
    def __init__(self, url: str, api_key: str | None = None, model: str = "dilaserve-tiny"):
        self.url = url.rstrip("/")
        self.model = model
        self.headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}

    async def ask(
        self, session: aiohttp.ClientSession, arrival: Arrival, slo_s: float, **extra: object
    ) -> Outcome:
        p = arrival.problem
        body = {
            "model": self.model,
            "prompt": p.prompt,
            "max_tokens": gen_length(p, 32),
            "slo_ms": 1e3 * slo_s,
            **extra,
        }
        began = time.monotonic()
        async with session.post(f"{self.url}/v1/completions", json=body, headers=self.headers) as r:
            data = await r.json(content_type=None)
        latency = time.monotonic() - began
        if r.status != 200:
            return Outcome(p.task, arrival.time, None, r.status, slo_s)
        served = data.get("dilaserve") or {}
        return Outcome(
            p.task,
            arrival.time,
            latency,
            200,
            slo_s,
            correct=check(p, data["choices"][0]["text"]),
            mean_tau=served.get("mean_threshold"),
        )

    async def isolated_latency(self, repeats: int = 3, seed: int = 1) -> dict[str, float]:
        """Mean latency of each task alone at τ 0.9, sent one at a time."""
        out = {}
        async with aiohttp.ClientSession() as session:
            for task in ("add", "rep", "draw", "tr"):
                times = []
                for p in make_problems(repeats + 1, seed, tasks=(task,)):
                    outcome = await self.ask(
                        session, Arrival(0.0, p), 3600.0, confidence_threshold=ISOLATED_TAU
                    )
                    if outcome.latency_s is None:
                        raise RuntimeError(f"isolated {task} request failed ({outcome.status})")
                    times.append(outcome.latency_s)
                out[task] = statistics.mean(times[1:])  # the first warms up
        return out

    async def run(
        self,
        arrivals: list[Arrival],
        slo_by_task: dict[str, float],
        progress: Callable[[], None] | None = None,
    ) -> list[Outcome]:
        """Sends every arrival at its time (open loop) and waits for all answers."""
        connector = aiohttp.TCPConnector(limit=0)
        timeout = aiohttp.ClientTimeout(total=None)
        async with aiohttp.ClientSession(connector=connector, timeout=timeout) as session:
            start = time.monotonic()

            async def one(arrival: Arrival) -> Outcome:
                await asyncio.sleep(max(0.0, start + arrival.time - time.monotonic()))
                try:
                    return await self.ask(session, arrival, slo_by_task[arrival.problem.task])
                finally:
                    if progress is not None:
                        progress()

            return await asyncio.gather(*(one(a) for a in arrivals))
