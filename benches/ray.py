"""Serving through Ray vs the local launcher, side by side on this machine (a one-node Ray
cluster whose `slot` resource stands in for GPUs):

- `ray_launch_s_per_instance`: time from a plan (the engine scaling from one TP-1
  instance to three) to every new instance serving, per launched instance, through
  `RayLauncher` (placement group, rank actor, worker process) vs `LocalLauncher`; the two
  engines alternate, `--repeats` times each.
- `ray_step_rtt_ms`: the per-step latency added by a worker reached over TCP from a Ray
  actor vs one reached over IPC: empty step commands through the engine's `WorkerChannel`,
  alternating between the two workers so both see the same load; medians.

Prints one JSON object per line. `python benches/ray.py [--repeats N] [--steps N] [--quick]`.
"""

from __future__ import annotations

import argparse
import asyncio
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

# This file shares its name with the package it measures: keep its directory (the script's
# sys.path[0], which Ray would also hand to its workers) off the import path.
sys.path[:] = [p for p in sys.path if Path(p or ".").resolve() != Path(__file__).parent.resolve()]

import ray  # noqa: E402

from dilaserve.engine import Engine, EngineConfig, Launcher, LocalLauncher  # noqa: E402
from dilaserve.engine.launcher import WorkerHandle, WorkerSpec  # noqa: E402
from dilaserve.engine.ray_launcher import RayLauncher  # noqa: E402
from dilaserve.engine.transport import WorkerChannel  # noqa: E402
from dilaserve.protocol import CacheMode, Shutdown, StepCommand, WorkerMessage  # noqa: E402
from dilaserve.scheduler import LatencyProfile  # noqa: E402
from dilaserve.tiny import default_model_dir  # noqa: E402

SLOTS = 3
RESOURCE = "slot"


def emit(name: str, value: float, unit: str, **extra: object) -> None:
    print(json.dumps({"name": name, "value": round(value, 4), "unit": unit, **extra}), flush=True)


def tiny_profile(directory: Path) -> str:
    """A profile shaped like dilaserve-tiny's on a CPU, so no engine measures one."""
    points = [(32, 0.004), (512, 0.012), (8192, 0.15)]
    profile = LatencyProfile.from_tables(
        [(1, kind, points) for kind in ("no_cache", "recompute", "cache")]
    )
    path = directory / "tiny.json"
    path.write_text(profile.to_json())
    return str(path)


async def launch_times(profile: str, repeats: int) -> None:
    config = EngineConfig(profile=profile, instances=(1,), device_slots=SLOTS, threads_per_worker=1)
    engines = {
        "local": Engine(config, LocalLauncher()),
        "ray": Engine(config, RayLauncher(resource=RESOURCE)),
    }
    for engine in engines.values():
        await engine.start()
    seconds: dict[str, list[float]] = {name: [] for name in engines}
    try:
        for _ in range(repeats):
            for name, engine in engines.items():
                began = time.perf_counter()
                await engine.scale_to({1: SLOTS})
                seconds[name].append((time.perf_counter() - began) / (SLOTS - 1))
                await engine.scale_to({1: 1})
    finally:
        for engine in engines.values():
            await engine.shutdown()
    ray_s, local_s = statistics.median(seconds["ray"]), statistics.median(seconds["local"])
    emit(
        "ray_launch_s_per_instance",
        ray_s,
        "s",
        baseline="local_launcher",
        baseline_value=round(local_s, 4),
        ratio=round(ray_s / local_s, 3),
        launches=repeats * (SLOTS - 1),
    )


class DirectWorker:
    """One worker started by `launcher` and driven straight through a `WorkerChannel`."""

    def __init__(self, launcher: Launcher, tcp_host: str | None, worker_id: int) -> None:
        self.launcher = launcher
        self.worker_id = worker_id
        self.replies: asyncio.Queue[WorkerMessage] = asyncio.Queue()
        self.channel = WorkerChannel(lambda _, m: self.replies.put_nowait(m), tcp_host)
        self.handle: WorkerHandle | None = None

    async def start(self) -> None:
        self.channel.start()
        spec = WorkerSpec(
            0, self.worker_id, self.channel.endpoint, str(default_model_dir()), CacheMode.DUAL,
            8, threads=1, keys=self.channel.worker_keys,
        )  # fmt: skip
        self.handle = await self.launcher.launch(spec)
        await self.replies.get()  # WorkerReady

    async def step(self, number: int) -> float:
        began = time.perf_counter()
        self.channel.send(self.worker_id, StepCommand(step=number))
        await self.replies.get()
        return time.perf_counter() - began

    async def close(self) -> None:
        self.channel.send(self.worker_id, Shutdown())
        if self.handle is not None:
            await self.handle.wait()
        await self.channel.close()


async def step_rtt(steps: int) -> None:
    launcher = RayLauncher(resource=RESOURCE)
    await launcher.start(lambda lost, joined: None)
    workers = {
        "ipc": DirectWorker(LocalLauncher(), None, 1),
        "tcp": DirectWorker(launcher, launcher.endpoint_host, 2),
    }
    rtt: dict[str, list[float]] = {name: [] for name in workers}
    try:
        for worker in workers.values():
            await worker.start()
        for step in range(steps):
            for name, worker in workers.items():
                rtt[name].append(await worker.step(step))
    finally:
        for worker in workers.values():
            await worker.close()
        await launcher.close()
    tcp, ipc = (1e3 * statistics.median(rtt[k]) for k in ("tcp", "ipc"))
    emit(
        "ray_step_rtt_ms",
        tcp - ipc,
        "ms",
        baseline="ipc_local_worker",
        tcp_ms=round(tcp, 4),
        ipc_ms=round(ipc, 4),
        ratio=round(tcp / ipc, 3),
        steps=steps,
    )


async def main(repeats: int, steps: int) -> None:
    with tempfile.TemporaryDirectory() as tmp:
        profile = tiny_profile(Path(tmp))
        await step_rtt(steps)
        await launch_times(profile, repeats)


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--repeats", type=int, default=3, help="scale-ups per launcher")
    parser.add_argument("--steps", type=int, default=500, help="empty steps per transport")
    parser.add_argument("--quick", action="store_true", help="1 scale-up, 50 steps")
    args = parser.parse_args()
    if args.quick:
        args.repeats, args.steps = 1, 50
    ray.init(num_cpus=2, resources={RESOURCE: SLOTS}, include_dashboard=False, log_to_driver=False)
    try:
        asyncio.run(main(args.repeats, args.steps))
    finally:
        ray.shutdown()
