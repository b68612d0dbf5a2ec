"""A benchmark sweep: for each policy a server (spawned with that policy, or one already
running), for each rate one open-loop run; one `Summary` per (policy, rate)."""

from __future__ import annotations

import asyncio
import contextlib
import random
import socket
import subprocess
import sys
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass, field

import aiohttp

from dilaserve.traces import read_trace

from .client import Client, served_model
from .report import Summary, summarize
from .workload import (
    Arrival,
    gamma_times,
    poisson_times,
    task_arrivals,
    trace_arrivals,
)


@dataclass(frozen=True)
class SweepSpec:
    policies: Sequence[str]
    rates: Sequence[float]
    duration_s: float = 30.0
    arrivals: str = "poisson"  # poisson | gamma | trace
    gamma_cv: float = 2.0
    trace: str | None = None
    length_scale: float = 0.1
    slo_scale: float = 5.0
    seed: int = 0
    #: Extra `dilaserve serve` flags of spawned servers (instances, cache, ...).
    serve_args: Sequence[str] = field(default_factory=list)

    def workload(self, rate: float) -> list[Arrival]:
        rng = random.Random(self.seed * 1_000_003 + int(rate * 1000))
        if self.arrivals == "trace":
            if self.trace is None:
                raise ValueError("--arrivals trace needs --trace CSV")
            return trace_arrivals(
                read_trace(self.trace), rate, self.duration_s, self.length_scale, rng
            )
        if self.arrivals == "gamma":
            times = gamma_times(rate, self.gamma_cv, self.duration_s, rng)
        elif self.arrivals == "poisson":
            times = poisson_times(rate, self.duration_s, rng)
        else:
            raise ValueError(f"unknown arrival process {self.arrivals!r}")
        return task_arrivals(times, rng.randrange(1 << 30))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def spawned_server(policy: str, serve_args: Sequence[str]) -> Iterator[str]:
    """`dilaserve serve` with `policy` on a free loopback port, until the block ends."""
    port = _free_port()
    cmd = [
        sys.executable,
        "-m",
        "dilaserve",
        "serve",
        "--port",
        str(port),
        "--log-level",
        "warning",
        "--policy",
        policy,
        *serve_args,
    ]
    process = subprocess.Popen(cmd, stdin=subprocess.DEVNULL)
    url = f"http://127.0.0.1:{port}"
    try:
        asyncio.run(_wait_ready(url, process))
        yield url
    finally:
        process.terminate()
        try:
            process.wait(60)
        except subprocess.TimeoutExpired:
            process.kill()


async def _wait_ready(url: str, process: subprocess.Popen, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    async with aiohttp.ClientSession() as session:
        while time.monotonic() < deadline:
            if process.poll() is not None:
                raise RuntimeError(f"dilaserve serve exited with {process.returncode}")
            with contextlib.suppress(aiohttp.ClientError):
                async with session.get(f"{url}/ready") as r:
                    if r.status == 200:
                        return
            await asyncio.sleep(0.5)
    raise TimeoutError(f"{url} was not ready after {timeout} s")


def run_sweep(
    spec: SweepSpec,
    url: str | None = None,
    api_key: str | None = None,
    on_summary: Callable[[Summary], None] | None = None,
    progress: Callable[[], None] | None = None,
) -> tuple[list[Summary], dict[str, float]]:
    """Runs every (policy, rate); the SLO of each task is `slo_scale` × its isolated
    latency, measured once on the first server and used for every policy."""
    summaries: list[Summary] = []
    slo: dict[str, float] = {}
    for policy in spec.policies:
        server = contextlib.nullcontext(url) if url else spawned_server(policy, spec.serve_args)
        with server as base:
            client = Client(base, api_key, asyncio.run(served_model(base, api_key)))
            if not slo:
                isolated = asyncio.run(client.isolated_latency(seed=spec.seed))
                slo = {task: spec.slo_scale * s for task, s in isolated.items()}
            for rate in spec.rates:
                arrivals = spec.workload(rate)
                outcomes = asyncio.run(client.run(arrivals, slo, progress))
                summary = summarize(policy, rate, outcomes, spec.duration_s)
                summaries.append(summary)
                if on_summary is not None:
                    on_summary(summary)
    return summaries, slo
