"""Runs a function on rank 0 of a tensor-parallel group of local processes, the other ranks
following its step plans — how `dilaserve profile --tp`, the benchmark and the tests drive
a TP-d model without an engine.

`run_on_group(d, model_dir, fn, *args)` spawns d processes joined by a `file://`
rendezvous in a private directory; each loads its shard, rank 0 calls
`fn(model, *args)` (a `StepRunner` built on that model is a TP-d runner) and its return
value comes back pickled. The call is bounded in time and never leaves a process behind.
"""

from __future__ import annotations

import logging
import os
import pickle
import tempfile
import time
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import torch
import torch.multiprocessing as mp

from dilaserve.worker.errors import WorkerError
from dilaserve.worker.follower import follow
from dilaserve.worker.tp_group import TensorParallelGroup

log = logging.getLogger(__name__)


class LocalGroupError(WorkerError):
    """A rank of a local group failed or the group ran past its time limit."""


def run_on_group(
    world_size: int,
    model_dir: str | Path,
    fn: Callable[..., Any],
    *args: Any,
    dtype: str = "float32",
    devices: Sequence[str] | None = None,
    threads: int | None = 1,
    timeout_s: float = 600.0,
) -> Any:
    """`fn(model, *args)` on rank 0 of a `world_size`-rank group over `model_dir`; `fn` and
    its arguments must be picklable (module-level). `devices` gives each rank's device
    (default: all on the CPU)."""
    devices = list(devices or ["cpu"] * world_size)
    if len(devices) != world_size:
        raise ValueError(f"{world_size} ranks need {world_size} devices, got {devices}")
    with tempfile.TemporaryDirectory(prefix="dilaserve-group-") as tmp:
        result = Path(tmp) / "result.pkl"
        init = f"file://{tmp}/rendezvous"
        spawn_ranks(
            _rank_main,
            (world_size, init, str(model_dir), dtype, devices, threads, fn, args, result),
            world_size,
            timeout_s=timeout_s,
        )
        with result.open("rb") as f:
            return pickle.load(f)


def spawn_ranks(
    fn: Callable[..., None], args: tuple[Any, ...], world_size: int, *, timeout_s: float
) -> None:
    """Runs `fn(rank, *args)` in `world_size` fresh processes and waits for all of them; a
    failing rank, or the time limit, ends every rank and raises `LocalGroupError`."""
    context = mp.start_processes(fn, args=args, nprocs=world_size, join=False, start_method="spawn")
    deadline = time.monotonic() + timeout_s
    try:
        while not context.join(timeout=0.5):
            if time.monotonic() > deadline:
                raise LocalGroupError(f"local group of {world_size} ran past {timeout_s} s")
    except mp.ProcessRaisedException as exc:
        raise LocalGroupError(f"a rank failed: {exc}") from exc
    except mp.ProcessExitedException as exc:
        raise LocalGroupError(f"a rank exited: {exc}") from exc
    finally:
        for process in context.processes:
            if process.is_alive():
                process.kill()
            process.join()


def _rank_main(
    rank: int,
    world_size: int,
    init: str,
    model_dir: str,
    dtype: str,
    devices: list[str],
    threads: int | None,
    fn: Callable[..., Any],
    args: tuple[Any, ...],
    result: Path,
) -> None:
    from dilaserve.models import load_model

    if threads:
        torch.set_num_threads(threads)
    group = TensorParallelGroup(rank, world_size, init, devices[rank])
    try:
        model = load_model(model_dir, dtype=dtype, device=devices[rank], group=group)
        if rank:
            follow(model, group)
            return
        try:
            value = fn(model, *args)
        finally:
            group.stop_followers()
        partial = result.with_suffix(f".{os.getpid()}")
        with partial.open("wb") as f:
            pickle.dump(value, f)
        partial.replace(result)
    finally:
        group.close()
