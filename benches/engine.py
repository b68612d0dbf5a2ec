"""Engine overhead on dilaserve-tiny: how much of a step's wall time is spent outside the
workers' step execution (engine round, transport, serialization) with 1, 2 and 4
instances under a steady stream of requests, the ZeroMQ round trip of an empty step, and
the time to migrate a request between two instances.

The closed-loop clients set no SLO, so the default admission (`reject`) serves them all:
deadline admission refuses only requests that asked for a deadline.

Prints one JSON object per line. `python benches/engine.py [--seconds S] [--quick]`
(`--quick`: 1 and 2 instances, 2 s each, 20 round trips).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import time

import zmq
import zmq.asyncio

from dilaserve.engine import Engine, EngineConfig, GenerationParams
from dilaserve.engine.launcher import LocalLauncher, WorkerSpec
from dilaserve.protocol import (
    CacheMode,
    RequestState,
    Shutdown,
    StepCommand,
    StepReport,
    WorkerReady,
    decode_worker_message,
    encode,
)
from dilaserve.tiny import default_model_dir
from dilaserve.tiny.tasks import gen_length, make_problems

CLIENTS_PER_INSTANCE = 4


def emit(name: str, value: float, unit: str, **extra: object) -> None:
    print(json.dumps({"name": name, "value": round(value, 4), "unit": unit, **extra}), flush=True)


async def steady_stream(instances: int, seconds: float) -> None:
    """Closed-loop clients keep every instance busy; reports the engine's step times."""
    config = EngineConfig(instances=(1,) * instances, threads_per_worker=1)
    async with Engine(config) as engine:
        problems = make_problems(512, 7)
        stop = time.monotonic() + seconds
        served = 0

        async def client(offset: int) -> None:
            nonlocal served
            i = offset
            while time.monotonic() < stop:
                p = problems[i % len(problems)]
                await engine.complete(p.prompt, GenerationParams(max_tokens=gen_length(p, 32)))
                served += 1
                i += CLIENTS_PER_INSTANCE * instances

        await asyncio.sleep(1.0)  # let the workers' first steps warm up
        await asyncio.gather(*(client(k) for k in range(CLIENTS_PER_INSTANCE * instances)))
        t = engine.step_times
        emit(
            f"engine_overhead_frac_{instances}inst",
            t.overhead_frac,
            "fraction",
            baseline="worker step execution",
            target=0.10,
            admission=config.policy.admission,
            steps=t.steps,
            requests=served,
            mean_step_ms=round(1e3 * (t.round_trip_s + t.dispatch_gap_s) / max(t.steps, 1), 3),
            mean_worker_ms=round(1e3 * t.worker_s / max(t.steps, 1), 3),
        )


class DirectWorkers:
    """Worker processes driven straight over a ROUTER socket, as the engine drives them."""

    def __init__(self) -> None:
        self.context = zmq.asyncio.Context()
        self.socket = self.context.socket(zmq.ROUTER)
        self.endpoint = f"ipc:///tmp/dilaserve-bench-{time.monotonic_ns()}.sock"
        self.socket.bind(self.endpoint)
        self.handles = []

    async def start(self, count: int) -> list[WorkerReady]:
        launcher = LocalLauncher()
        for i in range(count):
            spec = WorkerSpec(
                i, i + 1, self.endpoint, str(default_model_dir()), CacheMode.DUAL, 8, threads=1
            )
            self.handles.append(await launcher.launch(spec))
        return [await self.receive() for _ in range(count)]

    async def receive(self):
        _, frame = await self.socket.recv_multipart()
        return decode_worker_message(frame)

    async def command(self, worker: int, message: StepCommand) -> StepReport:
        await self.socket.send_multipart([str(worker + 1).encode(), encode(message)])
        return await self.receive()

    async def close(self) -> None:
        for i, h in enumerate(self.handles):
            await self.socket.send_multipart([str(i + 1).encode(), encode(Shutdown())])
            await h.wait()
        self.socket.close()
        self.context.term()


async def transport(repeats: int) -> None:
    workers = DirectWorkers()
    ready = await workers.start(2)
    mask = 2
    state = RequestState.new(1, [5] * 64, 256, block_length=32, mask_token_id=mask)
    state.output_ids[:64] = [7] * 64  # two blocks already committed
    rtt, move = [], []
    for step in range(repeats):
        began = time.perf_counter()
        await workers.command(0, StepCommand(step=step))
        rtt.append(time.perf_counter() - began)
    home = 0
    await workers.command(home, StepCommand(step=0, admit=[state]))
    for step in range(repeats):
        began = time.perf_counter()
        await workers.command(home, StepCommand(step=step, release=[1]))
        await workers.command(1 - home, StepCommand(step=step, admit=[state]))
        move.append(time.perf_counter() - began)
        home = 1 - home
    await workers.close()
    emit(
        "step_rtt_ms",
        1e3 * statistics.median(rtt),
        "ms",
        baseline="empty step command",
        device=ready[0].device,
    )
    emit(
        "migration_ms",
        1e3 * statistics.median(move),
        "ms",
        baseline="release on one instance + admit on another",
        request_tokens=state.seq_length,
    )


async def main(seconds: float, quick: bool) -> None:
    await transport(20 if quick else 200)
    for instances in (1, 2) if quick else (1, 2, 4):
        await steady_stream(instances, seconds)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=None, help="load per instance count")
    parser.add_argument("--quick", action="store_true", help="a short run that checks it works")
    args = parser.parse_args()
    asyncio.run(main(args.seconds or (2.0 if args.quick else 20.0), args.quick))
