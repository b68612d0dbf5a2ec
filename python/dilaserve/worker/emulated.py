"""Emulated workers: instances that speak the worker protocol without a model.

Each step takes the latency profile's time for its batch (its full-sequence tokens and its
cache-step tokens, as the scheduler prices them) and commits, per request, a token count
drawn from a progress model (`_core.ProgressSampler`, the simulator's draws), left to right
in the current block. Each instance keeps the timeline of the GPU it emulates: a step
starts when its command arrives or, for a command already queued behind the step before
(overlap), when that step ends on the timeline, and it reports at the timeline's end of
it. A host loop's timer wakes a little late (epoll's millisecond ticks, two cores shared
with the engine); that lateness is taken out of the next queued step instead of adding
up, as a GPU runs queued kernels back to back. `StepReport.seconds` is the profile's time,
the time the emulated GPU was busy. Everything above the workers — server, engine,
scheduler, predictor, planner, migration, reconfiguration, launchers — runs unchanged, so
a cluster of hundreds of GPUs can be tested on a laptop.

One host process (`python -m dilaserve.worker.emulated`) runs many instances on one
asyncio loop, each with its own socket and worker id, so the engine cannot tell them from
real ones (they connect over IPC: emulation runs on one machine). The launcher controls
it over stdin/stdout, one JSON object a line: `start` (a `WorkerSpec`), `kill` (the
instance vanishes at once, as on SIGKILL) and `terminate` (it asks to be drained, as on
SIGTERM); the host answers `{"exited": worker_id, "code": n}`.
Emulated instances hold no KV cache (`kv_tokens` None): only `max_requests` bounds them.
"""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import json
import logging
import os
import sys
import time
from dataclasses import dataclass

import zmq
import zmq.asyncio

from dilaserve import _core
from dilaserve.protocol import (
    CONFIDENCE_STATS,
    CacheMode,
    RequestError,
    RequestState,
    Shutdown,
    StepCommand,
    StepKind,
    StepReport,
    WorkerLeaving,
    WorkerReady,
    ahead_kind,
    decode_engine_message,
    encode,
)
from dilaserve.scheduler import LatencyProfile

log = logging.getLogger(__name__)

#: Confidence features an emulated step reports: none (the scheduler drops non-finite ones).
NO_CONFIDENCE = (float("nan"),) * CONFIDENCE_STATS


@dataclass
class _Held:
    """An emulated resident request: its state and the first masked output position."""

    state: RequestState
    first_masked: int
    #: A token it commits (from its prompt, never a stop or mask token).
    token: int
    #: Its current block's recompute step ran here (a cache step may follow).
    cache_valid: bool = False


class Emulation:
    """What every emulated instance of a host shares: step times and commit draws."""

    def __init__(self, profile: LatencyProfile, progress_json: str, seed: int) -> None:
        self.profile = profile
        self.sampler = _core.ProgressSampler(progress_json, seed)

    def step_seconds(self, tp: int, full_tokens: int, cache_tokens: int, context: float) -> float:
        """The profile's time of a batch: its full-sequence and its cache-step forwards."""
        seconds = 0.0
        if full_tokens:
            seconds += self.profile.latency(tp, "recompute", float(full_tokens))
        if cache_tokens:
            seconds += self.profile.step_time(tp, "cache", float(cache_tokens), context)
        return seconds


class EmulatedInstance:
    """One instance: connects to the engine, answers its commands after the step's time."""

    def __init__(self, spec: dict, emulation: Emulation, context: zmq.asyncio.Context) -> None:
        self.spec = spec
        self.emulation = emulation
        self.worker_id = int(spec["worker_id"])
        self.tp = int(spec.get("tp", 1))
        self.cache = CacheMode(spec.get("cache", "dual"))
        self.socket = context.socket(zmq.DEALER)
        self.socket.setsockopt(zmq.IDENTITY, str(self.worker_id).encode())
        self.socket.setsockopt(zmq.LINGER, 0)
        self.held: dict[int, _Held] = {}
        #: Requests the last step finished: a step ahead of theirs is skipped.
        self.finished: set[int] = set()
        self.leaving = asyncio.Event()
        #: When the emulated GPU ends its last step (`time.perf_counter`).
        self.free_at = 0.0
        #: The next command was queued before the last step's report went out.
        self.queued = False

    async def run(self) -> int:
        """Serves until `Shutdown`; returns the exit code."""
        spec = self.spec
        self.socket.connect(spec["endpoint"])
        ready = WorkerReady(
            instance=int(spec["instance"]),
            rank=0,
            pid=os.getpid(),
            cache=self.cache,
            max_requests=int(spec["max_requests"]),
            kv_tokens=None,
            max_seq_len=1 << 30,
            vocab_size=1 << 30,
            device="emulated",
            tp=self.tp,
        )
        await self.socket.send(encode(ready))
        announce = asyncio.ensure_future(self._announce_leaving())
        try:
            while True:
                message = decode_engine_message(await self.socket.recv())
                if isinstance(message, Shutdown):
                    return 0
                await self.socket.send(encode(await self.execute(message)))
                self.queued = bool(self.socket.get(zmq.EVENTS) & zmq.POLLIN)
        finally:
            announce.cancel()
            self.socket.close()

    async def _announce_leaving(self) -> None:
        """Asks the engine to drain this instance once it is told to terminate."""
        await self.leaving.wait()
        await self.socket.send(encode(WorkerLeaving(int(self.spec["instance"]))))

    async def execute(self, command: StepCommand) -> StepReport:
        now = time.perf_counter()
        started = self.free_at if self.queued else now
        for rid in command.release:
            self.held.pop(rid, None)
        errors = []
        for state in command.admit:
            if state.request_id in self.held:
                errors.append(RequestError(state.request_id, "already on this instance"))
                continue
            self.held[state.request_id] = _admitted(state)
        entries = []
        for e in command.entries():
            rid = e.request_id
            h = self.held.get(rid)
            if h is None:
                if not (e.kind is StepKind.AUTO and rid in self.finished):
                    errors.append(RequestError(rid, f"request {rid} is not on this instance"))
                continue
            if e.kind is StepKind.AUTO:
                e = dataclasses.replace(e, kind=ahead_kind(self.cache, h.cache_valid))
            entries.append(e)
        self.finished.clear()
        if not entries:
            return StepReport(step=command.step, errors=errors)
        full = cache = 0
        context = 0.0
        draws = []
        for e in entries:
            h = self.held[e.request_id]
            state = h.state
            if e.kind is StepKind.CACHE:
                cache += state.block_length
                context += state.seq_length
            else:
                full += state.seq_length
            draws.append((e.tau, h.first_masked % state.block_length, state.block_length))
        counts = self.emulation.sampler.sample(draws)
        cache_steps = sum(e.kind is StepKind.CACHE for e in entries)
        seconds = self.emulation.step_seconds(
            self.tp, full, cache, context / cache_steps if cache_steps else 0.0
        )
        report = StepReport(command.step, errors=errors, forward_tokens=full + cache)
        for e, n in zip(entries, counts, strict=True):
            if _commit(report, self.held[e.request_id], e.kind, n):
                del self.held[e.request_id]
                self.finished.add(e.request_id)
        self.free_at = started + seconds
        await asyncio.sleep(max(0.0, self.free_at - time.perf_counter()))
        report.seconds = seconds
        return report


def _admitted(state: RequestState) -> _Held:
    first = state.first_masked()
    stops = set(state.stop_token_ids)
    token = next((t for t in state.prompt_ids if t not in stops), state.prompt_ids[0])
    return _Held(state, state.output_length if first is None else first, token)


def _commit(report: StepReport, h: _Held, kind: StepKind, count: int) -> bool:
    """Unmasks the next `count` positions of the current block (left to right), adds the
    row to `report`, and says whether the request is done."""
    state = h.state
    block = h.first_masked // state.block_length
    end = min((block + 1) * state.block_length, h.first_masked + max(1, count))
    positions = list(range(h.first_masked, end))
    tokens = [h.token] * len(positions)
    state.commit(block, positions, tokens)
    h.first_masked = end
    h.cache_valid = kind is not StepKind.NO_CACHE and end % state.block_length != 0
    done = end >= state.output_length
    report.add_row(state.request_id, kind, block, positions, tokens, NO_CONFIDENCE, done)
    return done


class Host:
    """The instances of one host process and their control channel."""

    def __init__(self, emulation: Emulation) -> None:
        self.emulation = emulation
        self.context = zmq.asyncio.Context()
        self.instances: dict[int, tuple[EmulatedInstance, asyncio.Task[int]]] = {}

    def start(self, spec: dict) -> None:
        instance = EmulatedInstance(spec, self.emulation, self.context)
        task = asyncio.get_running_loop().create_task(instance.run())
        self.instances[instance.worker_id] = (instance, task)
        task.add_done_callback(lambda t, wid=instance.worker_id: self._exited(wid, t))

    def _exited(self, worker_id: int, task: asyncio.Task[int]) -> None:
        self.instances.pop(worker_id, None)
        if task.cancelled():
            code = -9
        elif task.exception() is not None:
            log.error("emulated worker %d failed: %s", worker_id, task.exception())
            code = 1
        else:
            code = task.result()
        print(json.dumps({"exited": worker_id, "code": code}), flush=True)

    def control(self, line: str) -> None:
        order = json.loads(line)
        op = order["op"]
        if op == "start":
            self.start(order["spec"])
            return
        entry = self.instances.get(int(order["worker_id"]))
        if entry is None:
            return
        instance, task = entry
        if op == "kill":
            task.cancel()
        elif op == "terminate":
            instance.leaving.set()

    async def serve(self) -> None:
        """Follows the control lines on stdin until it closes (the launcher is gone)."""
        loop = asyncio.get_running_loop()
        reader = asyncio.StreamReader()
        await loop.connect_read_pipe(lambda: asyncio.StreamReaderProtocol(reader), sys.stdin)
        while line := await reader.readline():
            self.control(line.decode())
        for _, task in list(self.instances.values()):
            task.cancel()


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(prog="python -m dilaserve.worker.emulated", description=__doc__)
    p.add_argument("--profile", required=True, help="latency profile JSON")
    p.add_argument("--progress", required=True, help="progress model JSON")
    p.add_argument("--seed", type=int, default=0)
    args = p.parse_args(argv)
    logging.basicConfig(level=logging.WARNING, format="%(asctime)s emulated %(message)s")
    with open(args.progress) as f:
        progress = f.read()
    emulation = Emulation(LatencyProfile.load(args.profile), progress, args.seed)
    asyncio.run(Host(emulation).serve())
    return 0


if __name__ == "__main__":
    sys.exit(main())
