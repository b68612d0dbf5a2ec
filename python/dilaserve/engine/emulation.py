"""Emulated instances (`EngineConfig(emulate=True)`, `dilaserve serve --emulate`): the
engine runs unchanged against workers that have no model (`dilaserve.worker.emulated`).

`EmulatedLauncher` spreads the instances over a few host processes, each running many of
them on one loop, so that hundreds fit on one machine; each instance still has its own
worker id and socket, and its handle stops, kills and waits for it alone. By default the
workers emulate LLaDA-8B on an H100: the shipped simulated profile, and the embedded
model's recorded progress rescaled to Fast-dLLM's tokens per step (what the simulator
runs).
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import json
import logging
import os
import sys
import tempfile
from collections.abc import Sequence
from pathlib import Path

from dilaserve.predictor import progress as progress_model
from dilaserve.profiles import SIMULATED_LLADA8B, llada8b_progress

from .config import EngineConfig
from .launcher import Launcher, WorkerHandle, WorkerSpec

log = logging.getLogger(__name__)


def emulated_config(config: EngineConfig) -> EngineConfig:
    """An emulating engine's settings: the shipped profile unless one is given, and a
    mean-rate predictor of the emulated progress unless rates are given (the model
    directory's predictor describes another model)."""
    profile = config.profile or SIMULATED_LLADA8B
    rates = config.predictor_rates
    if rates is None:
        progress = progress_model.load(config.progress) if config.progress else llada8b_progress()
        rates = tuple(progress_model.mean_rates(progress))
    return dataclasses.replace(config, profile=profile, predictor_rates=rates)


def default_hosts() -> int:
    """Host processes: one per core, at most four (one loop carries dozens of instances)."""
    return max(1, min(4, os.cpu_count() or 1))


class EmulatedHandle(WorkerHandle):
    def __init__(self, spec: WorkerSpec, host: _Host) -> None:
        self.spec = spec
        self.host = host
        self.exited: asyncio.Future[int] = asyncio.get_running_loop().create_future()

    @property
    def pid(self) -> int:
        return self.host.process.pid

    async def wait(self) -> int:
        return await asyncio.shield(self.exited)

    def terminate(self) -> None:
        self.host.send({"op": "terminate", "worker_id": self.spec.worker_id})

    def kill(self) -> None:
        self.host.send({"op": "kill", "worker_id": self.spec.worker_id})


class _Host:
    """One host process and the handles of the instances it runs."""

    def __init__(self, process: asyncio.subprocess.Process) -> None:
        self.process = process
        self.handles: dict[int, EmulatedHandle] = {}
        self.reader = asyncio.get_running_loop().create_task(self._read())

    def send(self, order: dict) -> None:
        stdin = self.process.stdin
        if stdin is not None and not stdin.is_closing():
            stdin.write((json.dumps(order) + "\n").encode())

    async def _read(self) -> None:
        assert self.process.stdout is not None
        while line := await self.process.stdout.readline():
            try:
                report = json.loads(line)
                worker_id, code = int(report["exited"]), int(report["code"])
            except (ValueError, KeyError, TypeError):
                log.warning("emulated host %d said %r", self.process.pid, line)
                continue
            handle = self.handles.pop(worker_id, None)
            if handle is not None and not handle.exited.done():
                handle.exited.set_result(code)
        code = await self.process.wait()
        for handle in self.handles.values():  # they went down with their host
            if not handle.exited.done():
                handle.exited.set_result(code)
        self.handles.clear()


class EmulatedLauncher(Launcher):
    """Emulated instances on this machine, in `hosts` processes (IPC)."""

    def __init__(
        self,
        profile: str | Path | None = None,
        progress: str | Path | None = None,
        hosts: int | None = None,
        seed: int = 0,
        nodes: Sequence[int] | None = None,
    ) -> None:
        """`nodes`: device slots of each emulated node (None: one node of the engine's
        slots), which the planner and initial placement see as a cluster's."""
        self.profile = str(profile or SIMULATED_LLADA8B)
        self.nodes = None if nodes is None else tuple(nodes)
        self._progress = progress
        self.hosts_wanted = hosts or default_hosts()
        self.seed = seed
        self._hosts: list[_Host] = []
        self._started = 0
        self._choosing = asyncio.Lock()
        self._dir: str | None = None

    def node_slots(self, local_slots: int) -> dict[int, int]:
        if self.nodes is None:
            return {0: local_slots}
        return dict(enumerate(self.nodes))

    def progress_path(self) -> str:
        """The progress model's file (the default one written once to a private file)."""
        if self._progress is not None:
            return str(self._progress)
        if self._dir is None:
            self._dir = tempfile.mkdtemp(prefix="dilaserve-emulated-")
            Path(self._dir, "progress.json").write_text(json.dumps(llada8b_progress()))
        return str(Path(self._dir, "progress.json"))

    async def launch(self, spec: WorkerSpec) -> WorkerHandle:
        host = await self._host()
        handle = EmulatedHandle(spec, host)
        host.handles[spec.worker_id] = handle
        order = {
            "instance": spec.instance,
            "worker_id": spec.worker_id,
            "endpoint": spec.endpoint,
            "cache": spec.cache.value,
            "max_requests": spec.max_requests,
            "tp": spec.tp,
        }
        host.send({"op": "start", "spec": order})
        return handle

    async def _host(self) -> _Host:
        """The live host with the fewest instances, starting hosts up to `hosts_wanted`
        (one launch at a time: concurrent launches must not each start one)."""
        async with self._choosing:
            return await self._choose_host()

    async def _choose_host(self) -> _Host:
        self._hosts = [h for h in self._hosts if h.process.returncode is None]
        if len(self._hosts) < self.hosts_wanted:
            process = await asyncio.create_subprocess_exec(
                sys.executable,
                "-m",
                "dilaserve.worker.emulated",
                "--profile",
                self.profile,
                "--progress",
                self.progress_path(),
                "--seed",
                str(self.seed + self._started),
                stdin=asyncio.subprocess.PIPE,
                stdout=asyncio.subprocess.PIPE,
            )
            self._started += 1
            log.info("started emulated worker host (pid %d)", process.pid)
            self._hosts.append(_Host(process))
        return min(self._hosts, key=lambda h: len(h.handles))

    async def close(self) -> None:
        for host in self._hosts:
            if host.process.stdin is not None:
                host.process.stdin.close()
        for host in self._hosts:
            try:
                await asyncio.wait_for(host.process.wait(), 5.0)
            except TimeoutError:
                host.process.kill()
                await host.process.wait()
            host.reader.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await host.reader
        if self._dir is not None:
            with contextlib.suppress(OSError):
                Path(self._dir, "progress.json").unlink()
                os.rmdir(self._dir)
