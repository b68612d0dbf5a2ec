"""Does the engine keep a GPU-speed cluster busy? Emulated workers (no model: each step
sleeps the profile's time) driven by the real engine under closed-loop load, ~16 requests
per instance, a step costing 4 ms + 0.05 ms per request unless a line says otherwise.

Lines (JSON):
- `engine_idle_share_1inst`, `engine_idle_share_16inst`, `engine_idle_share_64inst_16ms`:
  1 − Σ worker busy time / (instances × wall), the load offered by closed-loop clients in
  the front end's process (`EngineClient`) to the engine core in its own;
- each with `synchronous` (the same with `overlap` off) and `in_process` (`Engine` with
  the clients on its own loop), measured beside it;
- `engine_core_us_per_step`: CPU time of the engine core's process per step at 64
  instances (`in_process`: of the one process holding `Engine` and the clients, an upper
  bound of the engine's own time); `zmq_io_threads_us`: the part of it spent in the core's
  ZeroMQ I/O threads (libzmq moving the frames of a step and of the front end's messages);
- `http_idle_share_16inst`: the 16-instance load sent through the HTTP server by a separate
  load-generator process, the engine core in its own process (as `dilaserve serve` runs
  it); `in_process`: the same with `Engine` in the server's process;
- `worker_host_ms_per_step_b1`, `worker_host_ms_per_step_b64`: a real worker's host time
  per step (packing, the host read, applying the commit), tiny model, dual cache: outside
  the model's forward and the commit's kernels, which a GPU runs (the commit is one fused
  launch); `with_commit_kernels_ms` counts those kernels too, as they run on this CPU.

The machine's cores are split: the engine core on core 0 (with the direct clients where
they share its process, and with the HTTP server, whose parsing and streaming would
otherwise starve the emulated workers of their core), everything else (the emulated
workers, the direct clients' front end of a core process, the load generator) on the
others where the machine has them.
`python benches/engine_scale.py [--seconds S] [--quick]`.
"""

from __future__ import annotations

import argparse
import asyncio
import functools
import json
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from dilaserve.engine import Engine, EngineClient, EngineConfig, GenerationParams
from dilaserve.engine.emulation import EmulatedLauncher
from dilaserve.scheduler import LatencyProfile
from dilaserve.server import ServerSettings, serving
from dilaserve.tiny.tasks import make_problems

REQUESTS_PER_INSTANCE = 16
PROMPT = make_problems(1, 11)[0].prompt
MAX_TOKENS = 128
BLOCK = 32


def emit(name: str, value: float, unit: str, **extra: object) -> None:
    print(json.dumps({"name": name, "value": round(value, 4), "unit": unit, **extra}), flush=True)


def profile_file(step_ms: float, per_request_ms: float, directory: str) -> str:
    """A flat profile: `step_ms` a step plus `per_request_ms` per request of the batch
    (per token: a cache step feeds a block, a full step the whole sequence)."""
    seq = 64 + MAX_TOKENS  # the bench's requests are shorter than this
    tables = []
    for kind, tokens_per_request in (("recompute", seq), ("no_cache", seq), ("cache", BLOCK)):
        per_token = per_request_ms / 1000 / tokens_per_request
        points = [(n, step_ms / 1000 + per_token * n) for n in (32, 256, 2048, 16384, 65536)]
        tables.append((1, kind, points))
    path = Path(directory, f"flat_{step_ms}ms.json")
    path.write_text(LatencyProfile.from_tables(tables).to_json())
    return str(path)


def pin(pid: int, cores: set[int]) -> None:
    """Every thread of process `pid` (its ZeroMQ I/O thread too) to `cores`."""
    if not hasattr(os, "sched_setaffinity") or not cores:
        return
    tasks = Path(f"/proc/{pid}/task")
    for tid in [int(t.name) for t in tasks.iterdir()] if tasks.is_dir() else [pid]:
        os.sched_setaffinity(tid, cores)


def _split_cores() -> tuple[set[int], set[int]]:
    cores = sorted(os.sched_getaffinity(0)) if hasattr(os, "sched_getaffinity") else [0]
    return {cores[0]}, set(cores[1:]) or {cores[0]}


#: (the engine's cores, everyone else's), taken before anything is pinned.
ENGINE_CORES, OTHER_CORES = _split_cores()


def split_cores() -> tuple[set[int], set[int]]:
    """(engine's cores, everyone else's)."""
    return ENGINE_CORES, OTHER_CORES


def emulated_engine(
    instances: int, profile: str, overlap: bool = True, core_process: bool = False
) -> Engine | EngineClient:
    config = EngineConfig(
        emulate=True,
        instances=(1,) * instances,
        profile=profile,
        max_requests_per_instance=64,
        overlap=overlap,
    )
    launcher = functools.partial(EmulatedLauncher, profile, hosts=max(1, (os.cpu_count() or 2) - 1))
    return EngineClient(config, launcher) if core_process else Engine(config, launcher())


def descendants(pid: int) -> list[int]:
    """Every process below `pid`."""
    found = []
    for task in Path(f"/proc/{pid}/task").iterdir():
        for child in (task / "children").read_text().split():
            found += [int(child), *descendants(int(child))]
    return found


def pin_core_process(client: EngineClient, front_end_with_core: bool = False) -> None:
    """The core process to the engine's cores, its emulated hosts to the others; this
    process (the front end) to the others too, or beside the core where it would crowd the
    emulated workers' core (an HTTP server's parsing and streaming, with the load
    generator beside them, starve the workers' reports on a 2-core machine)."""
    engine_cores, others = split_cores()
    core = client._process.pid
    pin(core, engine_cores)
    for pid in descendants(core):
        pin(pid, others)
    pin(os.getpid(), engine_cores if front_end_with_core else others)


def _stat_cpu_seconds(stat: str) -> float:
    fields = stat.rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def cpu_seconds(pid: int) -> float:
    """User and system CPU time of process `pid` so far."""
    return _stat_cpu_seconds(Path(f"/proc/{pid}/stat").read_text())


def io_thread_cpu_seconds(pid: int) -> float:
    """CPU time so far of process `pid`'s ZeroMQ I/O threads (libzmq's own work of moving
    frames, which no change to the engine's code removes)."""
    total = 0.0
    for task in Path(f"/proc/{pid}/task").iterdir():
        stat = (task / "stat").read_text()
        if "(ZMQbg/IO" in stat:
            total += _stat_cpu_seconds(stat)
    return total


def pin_hosts(engine: Engine) -> None:
    """The emulated hosts to the cores the engine does not use."""
    _, others = split_cores()
    for host in engine.launcher._hosts:
        pin(host.process.pid, others)


def status_idle_share(before, after, instances: int) -> float:
    """Idle share between two status snapshots (a core process sends them)."""
    busy = after.step_times["worker_s"] - before.step_times["worker_s"]
    return 1.0 - busy / (instances * (after.taken_s - before.taken_s))


async def closed_loop(engine: Engine | EngineClient, clients: int, seconds: float):
    """`clients` closed-loop clients on `engine` until `seconds` from now."""
    params = GenerationParams(max_tokens=MAX_TOKENS)
    stop = time.monotonic() + seconds

    async def client() -> None:
        while time.monotonic() < stop:
            (req,) = await engine.submit([(PROMPT, params)])
            async for _ in engine.outputs(req):
                pass

    return asyncio.gather(*(client() for _ in range(clients)))


async def direct(
    instances: int, profile: str, seconds: float, overlap: bool = True, core_process: bool = True
) -> tuple[float, float, int]:
    """Idle share, the engine core's CPU µs per step, of them its ZeroMQ I/O threads', and
    its steps, with closed-loop clients in this process: the front end of a core process,
    or `Engine`'s own (the CPU time is then this process's, the clients' included)."""
    async with emulated_engine(instances, profile, overlap, core_process) as engine:
        if isinstance(engine, EngineClient):
            pin_core_process(engine)
            pid = engine._process.pid
        else:
            pin_hosts(engine)
            pid = os.getpid()
        clients = await closed_loop(engine, REQUESTS_PER_INSTANCE * instances, seconds + 1.5)
        await asyncio.sleep(1.0)  # warm up
        before, cpu, io = engine.status(), cpu_seconds(pid), io_thread_cpu_seconds(pid)
        await asyncio.sleep(seconds)
        after, cpu = engine.status(), cpu_seconds(pid) - cpu
        io = io_thread_cpu_seconds(pid) - io
        await clients
    pin(os.getpid(), split_cores()[0])
    steps = max(int(after.step_times["steps"] - before.step_times["steps"]), 1)
    return status_idle_share(before, after, instances), 1e6 * cpu / steps, 1e6 * io / steps, steps


LOADGEN = """
import asyncio, sys, time, aiohttp
url, clients, seconds = sys.argv[1], int(sys.argv[2]), float(sys.argv[3])
body = {"prompt": sys.argv[4], "max_tokens": int(sys.argv[5])}
async def main():
    stop = time.monotonic() + seconds
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        async def client():
            while time.monotonic() < stop:
                async with s.post(url + "/v1/completions", json=body) as r:
                    await r.read()
        await asyncio.gather(*(client() for _ in range(clients)))
asyncio.run(main())
"""


async def over_http(
    instances: int, profile: str, seconds: float, core_process: bool = True
) -> float:
    engine = emulated_engine(instances, profile, core_process=core_process)
    async with serving(engine, ServerSettings("dilaserve-tiny")) as url:
        if isinstance(engine, EngineClient):
            pin_core_process(engine, front_end_with_core=True)
        else:
            pin_hosts(engine)
        _, others = split_cores()
        load = subprocess.Popen(
            [
                sys.executable,
                "-c",
                LOADGEN,
                url,
                str(REQUESTS_PER_INSTANCE * instances),
                str(seconds + 1.0),
                PROMPT,
                str(MAX_TOKENS),
            ]
        )
        try:
            pin(load.pid, others)
            await asyncio.sleep(1.0)
            before = engine.status()
            await asyncio.sleep(seconds)
            return status_idle_share(before, engine.status(), instances)
        finally:
            await asyncio.to_thread(load.wait)
            pin(os.getpid(), split_cores()[0])


def worker_host_ms(batch: int, steps: int) -> tuple[float, float]:
    """A real worker's time per step on the host (tiny model, dual cache): outside the
    model's forward and the commit's kernels (on a GPU both are device work; the commit
    is one fused launch), and, second, with the commit's kernels counted as host time (on
    this CPU they run here)."""
    import torch

    from dilaserve.models import encode_prompt, load_model, load_tokenizer
    from dilaserve.protocol import RequestState, StepEntry
    from dilaserve.tiny import default_model_dir
    from dilaserve.worker import runner as runner_module
    from dilaserve.worker.runner import StepRunner

    torch.set_num_threads(1)
    model_dir = default_model_dir()
    model = load_model(model_dir)
    tokenizer = load_tokenizer(model_dir)
    runner = StepRunner(model, cache="dual", max_requests=batch)
    spent = {"forward": 0.0, "commit": 0.0}

    def timed(name, fn):
        def run(*args, **kwargs):
            start = time.perf_counter()
            out = fn(*args, **kwargs)
            spent[name] += time.perf_counter() - start
            return out

        return run

    forward = runner_module.forward_logits
    runner_module.forward_logits = timed("forward", forward)
    runner._scores_and_commit = timed("commit", runner._scores_and_commit)
    try:
        ids = encode_prompt(tokenizer, PROMPT)
        mask = model.config.mask_token_id
        host = kernels = 0.0
        measured = 0
        rid = 0
        while measured < steps:
            live = []
            for _ in range(batch):
                rid += 1
                runner.add(
                    RequestState.new(rid, ids, MAX_TOKENS, block_length=BLOCK, mask_token_id=mask)
                )
                live.append(rid)
            while live and measured < steps:
                entries = [StepEntry(r, 0.9, runner.next_kind(r)) for r in live]
                spent.update(forward=0.0, commit=0.0)
                start = time.perf_counter()
                report = runner.step(entries)
                host += time.perf_counter() - start - spent["forward"] - spent["commit"]
                kernels += spent["commit"]
                measured += 1
                done = {o.request_id for o in report.outputs if o.done}
                live = [r for r in live if r not in done]
            for r in live:
                runner.release(r)
        return 1000 * host / measured, 1000 * (host + kernels) / measured
    finally:
        runner_module.forward_logits = forward


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--seconds", type=float, default=6.0)
    parser.add_argument("--quick", action="store_true", help="1 s per line, fewer instances")
    args = parser.parse_args()
    seconds = 1.0 if args.quick else args.seconds
    engine_cores, _ = split_cores()
    pin(0, engine_cores)
    with tempfile.TemporaryDirectory() as directory:
        fast = profile_file(4.0, 0.05, directory)
        slow = profile_file(16.0, 0.05, directory)
        scale = {"1inst": (1, fast), "16inst": (4 if args.quick else 16, fast)}
        scale["64inst_16ms"] = (8 if args.quick else 64, slow)
        for name, (instances, profile) in scale.items():
            share, us, io_us, steps = asyncio.run(direct(instances, profile, seconds))
            sync, sync_us, _, _ = asyncio.run(direct(instances, profile, seconds, overlap=False))
            alone, alone_us, _, _ = asyncio.run(
                direct(instances, profile, seconds, core_process=False)
            )
            emit(
                f"engine_idle_share_{name}",
                share,
                "share",
                instances=instances,
                steps=steps,
                synchronous=round(sync, 4),
                in_process=round(alone, 4),
            )
            if name == "64inst_16ms":
                emit(
                    "engine_core_us_per_step",
                    us,
                    "us",
                    instances=instances,
                    zmq_io_threads_us=round(io_us, 1),
                    synchronous=round(sync_us, 1),
                    in_process=round(alone_us, 1),
                )
        instances = 4 if args.quick else 16
        share = asyncio.run(over_http(instances, fast, seconds))
        alone = asyncio.run(over_http(instances, fast, seconds, core_process=False))
        emit(
            "http_idle_share_16inst",
            share,
            "share",
            instances=instances,
            in_process=round(alone, 4),
        )
    for batch in (1, 64):
        ms, with_kernels = worker_host_ms(batch, 20 if args.quick else 200)
        emit(
            f"worker_host_ms_per_step_b{batch}",
            ms,
            "ms",
            batch=batch,
            with_commit_kernels_ms=round(with_kernels, 4),
        )


if __name__ == "__main__":
    main()
