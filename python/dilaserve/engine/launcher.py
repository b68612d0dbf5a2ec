"""Starting and stopping worker processes. The engine only sees the `Launcher` interface,
so a distributed launcher (Ray placement groups) can replace the local one.

An instance is one handle whatever its degree: a TP-d instance is d rank processes that
live and die together. Its handle's `wait` returns once every rank has exited, and the
first rank to exit brings the others down, so the engine restarts whole instances only and
a restarted instance never shares a device with a rank of its predecessor.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import shutil
import signal
import sys
import tempfile
from abc import ABC, abstractmethod
from dataclasses import dataclass

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

    def rank_device(self, rank: int) -> str:
        return self.devices[rank] if self.devices else self.device

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


class Launcher(ABC):
    """Places worker processes; each connects to the engine at `WorkerSpec.endpoint`."""

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
        exits = [asyncio.ensure_future(p.wait()) for p in self.processes]
        try:
            await asyncio.wait(exits, return_when=asyncio.FIRST_COMPLETED)
            first = next(rank for rank, e in enumerate(exits) if e.done())
            _, alive = await asyncio.wait(exits, timeout=self.GRACE_S)
            if alive:
                log.warning(
                    "instance %d: rank %d exited; killing %d remaining ranks",
                    self.spec.instance,
                    first,
                    len(alive),
                )
                self.kill()
                await asyncio.wait(exits)
            codes = [e.result() for e in exits]
            return next((c for c in [codes[first], *codes] if c), 0)
        finally:
            shutil.rmtree(self._rendezvous, ignore_errors=True)

    def terminate(self) -> None:
        # Rank 0 drains the instance and then stops the other ranks itself.
        _signal(self.processes[0], signal.SIGTERM)

    def kill(self) -> None:
        for process in self.processes:
            _signal(process, signal.SIGKILL)


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
            sys.executable, "-m", "dilaserve.worker", *argv, stdin=asyncio.subprocess.DEVNULL
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
