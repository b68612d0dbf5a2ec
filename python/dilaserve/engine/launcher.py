"""Starting and stopping worker processes. The engine only sees the `Launcher` interface,
so a distributed launcher (`RayLauncher`: Ray placement groups) can replace the local one.
A launcher also says where workers connect (IPC on this machine, TCP across machines) and
which nodes with how many device slots the planner may use, and reports nodes that join or
leave.

An instance is one handle whatever its degree: a TP-d instance is d rank processes that
live and die together. Its handle's `wait` returns once every rank has exited, and the
first rank to exit brings the others down, so the engine restarts whole instances only and
a restarted instance never shares a device with a rank of its predecessor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import shutil
import signal
import sys
import tempfile
from abc import ABC, abstractmethod
from collections.abc import Awaitable, Callable, Collection
from dataclasses import dataclass

from dilaserve.channel_keys import WorkerKeys, without_keys
from dilaserve.protocol import CacheMode

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class WorkerSpec:
    """Everything a worker process needs to start serving one instance."""

    instance: int
    worker_id: int
    endpoint: str
    model: str
    cache: CacheMode
    max_requests: int
    tp: int = 1
    dtype: str = "float32"
    device: str = "cpu"
    threads: int | None = None
    #: Each rank's device (e.g. `cuda:2`, `cuda:3`); empty: every rank on `device`.
    devices: tuple[str, ...] = ()
    #: KV pool budget per rank: bytes, a fraction of free device memory, None: default.
    kv_cache_memory: int | float | None = None
    #: Under the block cache, share the K/V of common prompt blocks (`prefix_cache`).
    prefix_caching: bool = True
    #: The launcher's key of the node the instance is placed on.
    node: int = 0
    #: Keys of a TCP channel (None over IPC); they travel in the environment.
    keys: WorkerKeys | None = None

    def rank_device(self, rank: int) -> str:
        return self.devices[rank] if self.devices else self.device

    def environment(self) -> dict[str, str]:
        """Variables to add to a rank process's environment: the channel's keys."""
        return {} if self.keys is None else self.keys.environment()

    def argv(self, rank: int = 0, dist_init: str | None = None) -> list[str]:
        """Command-line arguments of rank `rank`'s process."""
        args = [
            "--endpoint", self.endpoint,
            "--instance", str(self.instance),
            "--worker-id", str(self.worker_id),
            "--model", self.model,
            "--cache", self.cache.value,
            "--max-requests", str(self.max_requests),
            "--dtype", self.dtype,
            "--device", self.rank_device(rank),
        ]  # fmt: skip
        if self.threads:
            args += ["--threads", str(self.threads)]
        if self.kv_cache_memory is not None:
            args += ["--kv-cache-memory", str(self.kv_cache_memory)]
        if not self.prefix_caching:
            args.append("--no-prefix-caching")
        if self.tp > 1:
            if dist_init is None:
                raise ValueError(f"instance {self.instance}: TP {self.tp} needs a rendezvous")
            args += ["--tp", str(self.tp), "--rank", str(rank), "--dist-init", dist_init]
        return args


class WorkerHandle(ABC):
    """A started worker: the engine waits on its exit and may stop or kill it."""

    spec: WorkerSpec

    @abstractmethod
    async def wait(self) -> int:
        """Returns the exit code once the worker has exited."""

    @abstractmethod
    def terminate(self) -> None:
        """Asks the worker to drain and stop (SIGTERM)."""

    @abstractmethod
    def kill(self) -> None:
        """Stops the worker at once."""


#: Called with the keys of the nodes that left and of those that joined.
NodesChanged = Callable[[Collection[int], Collection[int]], None]


class Launcher(ABC):
    """Places worker processes; each connects to the engine at `WorkerSpec.endpoint`."""

    #: Address the engine's worker endpoint listens on: None for IPC (every worker on this
    #: machine), a host address for TCP.
    endpoint_host: str | None = None

    async def start(self, on_nodes_changed: NodesChanged) -> None:
        """Called once by the engine before its first launch; this machine alone never
        changes."""
        return

    async def close(self) -> None:
        """Called once by the engine after its last worker has exited."""
        return

    def node_slots(self, local_slots: int) -> dict[int, int]:
        """Device slots per node key (a key is stable while its node lives); one node of
        `local_slots` unless the launcher knows a cluster."""
        return {0: local_slots}

    @abstractmethod
    async def launch(self, spec: WorkerSpec) -> WorkerHandle: ...


class LocalProcess(WorkerHandle):
    def __init__(self, spec: WorkerSpec, process: asyncio.subprocess.Process) -> None:
        self.spec = spec
        self.process = process

    @property
    def pid(self) -> int:
        return self.process.pid

    async def wait(self) -> int:
        return await self.process.wait()

    def terminate(self) -> None:
        self._signal(signal.SIGTERM)

    def kill(self) -> None:
        self._signal(signal.SIGKILL)

    def _signal(self, sig: int) -> None:
        _signal(self.process, sig)


class LocalGroup(WorkerHandle):
    """The rank processes of one tensor-parallel instance, handled as one worker: rank 0
    speaks for the instance; once any rank exits, the others are given `GRACE_S` to leave
    on their own (they do when rank 0 stops them, or when a collective fails) and are then
    killed."""

    GRACE_S = 5.0

    def __init__(
        self, spec: WorkerSpec, processes: list[asyncio.subprocess.Process], rendezvous: str
    ) -> None:
        self.spec = spec
        self.processes = processes
        self._rendezvous = rendezvous
        self._waiter: asyncio.Task[int] | None = None

    @property
    def pid(self) -> int:
        return self.processes[0].pid

    @property
    def pids(self) -> list[int]:
        return [p.pid for p in self.processes]

    async def wait(self) -> int:
        if self._waiter is None:
            self._waiter = asyncio.get_running_loop().create_task(self._wait_all())
        return await asyncio.shield(self._waiter)

    async def _wait_all(self) -> int:
        try:
            return await wait_group(
                [p.wait() for p in self.processes], self.kill, self.GRACE_S, self.spec.instance
            )
        finally:
            shutil.rmtree(self._rendezvous, ignore_errors=True)

    def terminate(self) -> None:
        # Rank 0 drains the instance and then stops the other ranks itself.
        _signal(self.processes[0], signal.SIGTERM)

    def kill(self) -> None:
        for process in self.processes:
            _signal(process, signal.SIGKILL)


async def wait_group(
    exits: list[Awaitable[int]], kill: Callable[[], None], grace_s: float, instance: int
) -> int:
    """Waits until every rank of an instance has exited: once one has, the others get
    `grace_s` to leave on their own, then `kill` ends them. Returns the instance's exit
    code: the first rank's if it failed, else any rank's failure, else 0."""
    waits = [asyncio.ensure_future(e) for e in exits]
    await asyncio.wait(waits, return_when=asyncio.FIRST_COMPLETED)
    first = next(rank for rank, w in enumerate(waits) if w.done())
    _, alive = await asyncio.wait(waits, timeout=grace_s)
    if alive:
        log.warning(
            "instance %d: rank %d exited; killing %d remaining ranks", instance, first, len(alive)
        )
        kill()
        await asyncio.wait(waits)
    codes = [w.result() for w in waits]
    return next((c for c in [codes[first], *codes] if c), 0)


def _signal(process: asyncio.subprocess.Process, sig: int) -> None:
    if process.returncode is None:
        with contextlib.suppress(ProcessLookupError):
            process.send_signal(sig)


class LocalLauncher(Launcher):
    """Worker processes on this machine (`python -m dilaserve.worker`), reached over IPC; a
    TP-d instance is d processes joined by a `file://` rendezvous in a private directory."""

    async def launch(self, spec: WorkerSpec) -> WorkerHandle:
        if spec.tp == 1:
            process = await self._start(spec, spec.argv())
            return LocalProcess(spec, process)
        rendezvous = tempfile.mkdtemp(prefix=f"dilaserve-tp{spec.tp}-")
        init = f"file://{rendezvous}/store"
        processes: list[asyncio.subprocess.Process] = []
        try:
            for rank in range(spec.tp):
                processes.append(await self._start(spec, spec.argv(rank, init), rank))
        except BaseException:
            for process in processes:
                _signal(process, signal.SIGKILL)
            shutil.rmtree(rendezvous, ignore_errors=True)
            raise
        return LocalGroup(spec, processes, rendezvous)

    @staticmethod
    async def _start(
        spec: WorkerSpec, argv: list[str], rank: int = 0
    ) -> asyncio.subprocess.Process:
        process = await asyncio.create_subprocess_exec(
            sys.executable,
            "-m",
            "dilaserve.worker",
            *argv,
            stdin=asyncio.subprocess.DEVNULL,
            env=without_keys(os.environ) | spec.environment(),
        )
        log.info(
            "launched worker %d of instance %d, rank %d of %d (pid %d)",
            spec.worker_id,
            spec.instance,
            rank,
            spec.tp,
            process.pid,
        )
        return process
