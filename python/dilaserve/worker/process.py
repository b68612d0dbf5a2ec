"""One worker process: loads the model, then executes the engine's step commands over
ZeroMQ until told to stop (DESIGN §10).

The process holds a `StepRunner` and nothing else of its own: every decision arrives in a
`StepCommand`. Per command it releases the requests that left, admits the new ones, and
runs the step for every entry it can; a request it must refuse (bad token state, a cache
step without this instance's K/V) is reported in `StepReport.errors` while the others
run. A failure of the step itself (out of memory) is reported as `failure` with nothing
applied, and the process keeps serving. SIGTERM asks the engine to drain this instance;
the process exits once the engine says `Shutdown`.

A tensor-parallel instance is `tp` such processes joined by `torch.distributed`: rank 0 does
all of the above, the other ranks load their shard and follow rank 0's step plans
(`follower`). A lost group (a rank died) ends every rank with `GROUP_LOST_EXIT`, and the
engine restarts the instance as a whole.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import os
import signal
import time
from dataclasses import dataclass

import torch
import zmq

from dilaserve.channel_keys import WorkerKeys
from dilaserve.protocol import (
    CacheMode,
    RequestError,
    Shutdown,
    StepCommand,
    StepKind,
    StepReport,
    TokenStateError,
    WorkerLeaving,
    WorkerReady,
    decode_engine_message,
    encode,
)
from dilaserve.worker.errors import GroupLostError, WorkerError
from dilaserve.worker.follower import follow
from dilaserve.worker.runner import StepRunner
from dilaserve.worker.tp_group import TensorParallelGroup

log = logging.getLogger(__name__)

# How often the idle loop checks that the engine process is still there.
PARENT_CHECK_S = 1.0
# Exit code of a rank whose tensor-parallel group broke.
GROUP_LOST_EXIT = 3


@dataclass(frozen=True)
class WorkerSettings:
    endpoint: str
    instance: int
    worker_id: int
    model: str
    cache: CacheMode
    max_requests: int
    dtype: str = "float32"
    device: str = "cpu"
    threads: int | None = None
    #: Tensor-parallel degree, this process's rank, and the group's rendezvous URL
    #: (`file://...` or `tcp://host:port`).
    tp: int = 1
    rank: int = 0
    dist_init: str | None = None
    #: KV pool budget: bytes, a fraction of free device memory, or None for the default.
    kv_cache_memory: int | float | None = None
    #: Under the block cache, share the K/V of common prompt blocks (`prefix_cache`).
    prefix_caching: bool = True


def execute(runner: StepRunner, command: StepCommand) -> StepReport:
    """Applies one command to `runner`; never raises for a bad request or a failed step.
    The report also counts the admitted requests' prefix-store lookups and hits, and names
    the stored blocks each of those still here reads."""
    prefix = runner.prefix
    if prefix is None:
        return _execute(runner, command)
    before = dataclasses.replace(prefix.stats)
    report = _execute(runner, command)
    report.prefix_queried_tokens = prefix.stats.queried_tokens - before.queried_tokens
    report.prefix_hit_tokens = prefix.stats.hit_tokens - before.hit_tokens
    for state in command.admit:
        if keys := prefix.reads(state.request_id):
            report.prefix_reads[state.request_id] = keys
    return report


def _execute(runner: StepRunner, command: StepCommand) -> StepReport:
    errors: list[RequestError] = []
    for rid in command.release:
        if rid in runner:
            runner.release(rid)
    refused: set[int] = set()
    for state in command.admit:
        try:
            runner.add(state)
        except (TokenStateError, WorkerError) as exc:
            errors.append(RequestError(state.request_id, str(exc)))
            refused.add(state.request_id)
    entries = []
    for entry in command.entries():
        if entry.request_id in refused:
            continue
        try:
            if entry.kind is StepKind.AUTO:
                if runner.finished(entry.request_id):
                    continue  # a step ahead of a request its step before finished
                entry = dataclasses.replace(entry, kind=runner.next_kind(entry.request_id))
            runner.check_entry(entry)
        except (WorkerError, KeyError) as exc:
            errors.append(RequestError(entry.request_id, str(exc)))
            continue
        entries.append(entry)
    if not entries:
        return StepReport(step=command.step, errors=errors)
    try:
        report = runner.step(entries)
    except GroupLostError:
        raise  # not this step's failure: the instance is gone
    except (RuntimeError, WorkerError) as exc:  # torch's out-of-memory is a RuntimeError
        log.exception("step %d failed", command.step)
        return StepReport(step=command.step, errors=errors, failure=f"{type(exc).__name__}: {exc}")
    report.step = command.step
    report.errors = errors
    return report


def serve(settings: WorkerSettings) -> int:
    """Runs the worker until `Shutdown`, or until the engine process is gone."""
    from dilaserve.models import load_model

    if settings.threads:
        torch.set_num_threads(settings.threads)
    group = None
    try:
        if settings.tp > 1:
            if settings.dist_init is None:
                raise ValueError("a tensor-parallel worker needs --dist-init")
            group = TensorParallelGroup(
                settings.rank, settings.tp, settings.dist_init, settings.device
            )
        model = load_model(
            settings.model, dtype=settings.dtype, device=settings.device, group=group
        )
        if group is not None and group.rank > 0:
            follow(model, group)
            return 0
        runner = StepRunner(
            model,
            cache=settings.cache,
            max_requests=settings.max_requests,
            kv_cache_memory=settings.kv_cache_memory,
            prefix_caching=settings.prefix_caching,
        )
        runner.warm_up()
        try:
            return _serve_engine(settings, runner)
        finally:
            if group is not None:
                with contextlib.suppress(GroupLostError):
                    group.stop_followers()
    except GroupLostError as exc:
        log.error("instance %d, rank %d: %s", settings.instance, settings.rank, exc)
        return GROUP_LOST_EXIT
    finally:
        if group is not None:
            group.close()


def _serve_engine(settings: WorkerSettings, runner: StepRunner) -> int:
    """Rank 0: talks to the engine over ZeroMQ and executes its commands."""
    model = runner.model
    leaving = False

    def on_sigterm(signum: int, frame: object) -> None:
        nonlocal leaving
        leaving = True

    signal.signal(signal.SIGTERM, on_sigterm)
    parent = os.getppid()
    context = zmq.Context()
    socket = context.socket(zmq.DEALER)
    socket.setsockopt(zmq.IDENTITY, str(settings.worker_id).encode())
    socket.setsockopt(zmq.LINGER, 1000)
    keys = WorkerKeys.from_environment()
    if keys is not None and settings.endpoint.startswith("tcp://"):
        keys.secure(socket)
    socket.connect(settings.endpoint)
    socket.send(
        encode(
            WorkerReady(
                instance=settings.instance,
                rank=0,
                pid=os.getpid(),
                cache=runner.cache_mode,
                max_requests=settings.max_requests,
                kv_tokens=runner.kv_tokens,
                max_seq_len=runner.max_seq_len,
                vocab_size=model.config.vocab_size,
                device=str(runner.device),
                tp=settings.tp,
            )
        )
    )
    announced = False
    try:
        while True:
            if leaving and not announced:
                socket.send(encode(WorkerLeaving(settings.instance)))
                announced = True
            if not socket.poll(int(PARENT_CHECK_S * 1000)):
                if os.getppid() != parent:
                    log.warning("engine process is gone; worker %d exits", settings.worker_id)
                    return 1
                continue
            message = decode_engine_message(socket.recv())
            if isinstance(message, Shutdown):
                return 0
            started = time.perf_counter()
            report = execute(runner, message)
            if not message.requests:
                report.seconds = time.perf_counter() - started
            socket.send(encode(report))
    finally:
        socket.close()
        context.term()
