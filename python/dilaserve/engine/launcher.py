"""Starting and stopping worker processes. The engine only sees the `Launcher` interface,
so a distributed launcher (Ray placement groups) can replace the local one."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import signal
import sys
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

    def argv(self) -> list[str]:
        args = [
            "--endpoint", self.endpoint,
            "--instance", str(self.instance),
            "--worker-id", str(self.worker_id),
            "--model", self.model,
            "--cache", self.cache.value,
            "--max-requests", str(self.max_requests),
            "--dtype", self.dtype,
            "--device", self.device,
        ]  # fmt: skip
        if self.threads:
            args += ["--threads", str(self.threads)]
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
        if self.process.returncode is None:
            with contextlib.suppress(ProcessLookupError):
                self.process.send_signal(sig)


class LocalLauncher(Launcher):
    """Worker processes on this machine (`python -m dilaserve.worker`), reached over IPC."""

    async def launch(self, spec: WorkerSpec) -> LocalProcess:
        if spec.tp != 1:
            raise ValueError(
                f"instance {spec.instance}: TP degree {spec.tp} is not supported by this "
                "worker; every instance is one process (TP 1)"
            )
        process = await asyncio.create_subprocess_exec(
            sys.executable, "-m", "dilaserve.worker", *spec.argv(), stdin=asyncio.subprocess.DEVNULL
        )
        log.info(
            "launched worker %d of instance %d (pid %d)", spec.worker_id, spec.instance, process.pid
        )
        return LocalProcess(spec, process)
