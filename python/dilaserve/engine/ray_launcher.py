"""`RayLauncher`: instances on a Ray cluster (DESIGN §10: multi-node serving runs on an
existing launcher, not a home-made cluster manager). Importing this module imports Ray;
nothing else in the package does.

- An instance is a placement group of `tp` bundles, `STRICT_PACK`ed on the node the planner
  chose (selected by Ray's node-id label), so a tensor-parallel group never spans nodes.
  A bundle is one unit of the device resource: `GPU` on a GPU cluster, `CPU`, or a custom
  resource.
- Each rank is a Ray actor that runs `python -m dilaserve.worker` on its node, the same
  worker the local launcher starts, and reports its exit. Ranks join their group through a
  TCP rendezvous on rank 0's node and reach the engine over TCP (ZeroMQ).
- The planner's nodes are the live Ray nodes offering the resource (`RayNodes`); they are
  polled, and a node that joins or leaves is reported to the engine, which replans. An
  actor lost with its node makes the launcher look at once, so the engine learns of the
  loss before it would restart the instance there.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import logging
import os
import signal
import socket
import subprocess
import sys
import threading
import time
from typing import Any

import ray
from ray.exceptions import ActorUnavailableError, RayActorError
from ray.util.placement_group import PlacementGroup, placement_group, remove_placement_group
from ray.util.scheduling_strategies import PlacementGroupSchedulingStrategy

from dilaserve.channel_keys import without_keys

from .errors import LaunchError
from .launcher import Launcher, NodesChanged, WorkerHandle, WorkerSpec, wait_group
from .ray_nodes import NODE_ID_LABEL, RayNodes

log = logging.getLogger(__name__)

#: Exit code reported for a rank whose actor died without reporting (its node left).
ACTOR_LOST_EXIT = -int(signal.SIGKILL)


class RankProcess:
    """One rank of an instance, on the node Ray placed it: starts the worker process there
    and waits for it. Methods run on a thread pool, so `signal` reaches a running worker."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._process: subprocess.Popen[bytes] | None = None
        self._killed = False

    def node_id(self) -> str:
        return ray.get_runtime_context().get_node_id()

    def rendezvous(self) -> str:
        """A free TCP address on this node for the group's `torch.distributed` store."""
        host = ray.util.get_node_ip_address()
        with socket.socket(socket.AF_INET6 if ":" in host else socket.AF_INET) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        return f"tcp://[{host}]:{port}" if ":" in host else f"tcp://{host}:{port}"

    def run(self, argv: list[str], env: dict[str, str]) -> int:
        """Runs the worker to its end, `env` added to its environment; returns its exit
        code."""
        with self._lock:
            if self._killed:
                return ACTOR_LOST_EXIT
            self._process = subprocess.Popen(
                [sys.executable, "-m", "dilaserve.worker", *argv],
                stdin=subprocess.DEVNULL,
                env=without_keys(os.environ) | env,
            )
        return self._process.wait()

    def signal(self, sig: int) -> None:
        with self._lock:
            if self._process is None:  # killed before it started: never start it
                self._killed = self._killed or sig == signal.SIGKILL
            elif self._process.poll() is None:
                self._process.send_signal(sig)


_RankActor = ray.remote(max_concurrency=4)(RankProcess)


class RayInstance(WorkerHandle):
    """The rank actors of one instance and their placement group, handled as one worker
    (as `LocalGroup` handles rank processes): the first rank to exit brings the others
    down, and the group's resources are returned once all have exited."""

    GRACE_S = 5.0

    def __init__(
        self,
        spec: WorkerSpec,
        launcher: RayLauncher,
        group: PlacementGroup,
        ranks: list[Any],
        exits: list[ray.ObjectRef],
    ) -> None:
        self.spec = spec
        self.group = group
        self.ranks = ranks
        self._launcher = launcher
        self._exits = exits
        self._waiter: asyncio.Task[int] | None = None

    async def rank_nodes(self) -> list[str]:
        """The Ray node id each rank runs on."""
        return list(await asyncio.gather(*(_awaitable(r.node_id.remote()) for r in self.ranks)))

    async def wait(self) -> int:
        if self._waiter is None:
            self._waiter = asyncio.get_running_loop().create_task(self._wait_all())
        return await asyncio.shield(self._waiter)

    async def _wait_all(self) -> int:
        try:
            exits = [
                self._exit_code(r, ref) for r, ref in zip(self.ranks, self._exits, strict=True)
            ]
            return await wait_group(exits, self.kill, self.GRACE_S, self.spec.instance)
        finally:
            _release(self.ranks, self.group)

    async def _exit_code(self, rank: Any, ref: ray.ObjectRef) -> int:
        try:
            return await _awaitable(ref)
        except RayActorError as exc:
            log.warning("instance %d: a rank's actor is lost: %s", self.spec.instance, exc)
            await self._settled(rank)
            await self._launcher.refresh()
            return ACTOR_LOST_EXIT

    async def _settled(self, rank: Any) -> None:
        """Waits until Ray knows whether an unreachable rank's actor is dead: a node that
        vanished is declared dead only once its health checks fail, and until then the
        engine must not restart the instance there."""
        while True:
            try:
                await _awaitable(rank.node_id.remote())
                return
            except ActorUnavailableError:
                await asyncio.sleep(self._launcher.poll_s)
            except RayActorError:
                return

    def terminate(self) -> None:
        # Rank 0 drains the instance and then stops the other ranks itself.
        self.ranks[0].signal.remote(signal.SIGTERM)

    def kill(self) -> None:
        for rank in self.ranks:
            rank.signal.remote(signal.SIGKILL)


class RayLauncher(Launcher):
    """Places instances on the Ray cluster at `address` (`auto`, `HOST:PORT`, or None to
    use the connection this process already has), one unit of `resource` per rank."""

    def __init__(
        self,
        address: str | None = None,
        resource: str = "GPU",
        *,
        endpoint_host: str | None = None,
        poll_s: float = 1.0,
        ready_timeout_s: float = 300.0,
    ) -> None:
        self.address = address
        self.resource = resource
        self.endpoint_host = endpoint_host
        self.poll_s = poll_s
        self.ready_timeout_s = ready_timeout_s
        self.nodes = RayNodes(resource)
        self._owns_connection = False
        self._on_nodes_changed: NodesChanged | None = None
        self._refreshing = asyncio.Lock()
        self._watcher: asyncio.Task[None] | None = None

    async def start(self, on_nodes_changed: NodesChanged) -> None:
        if not ray.is_initialized():
            ray.init(address=self.address or "auto", namespace="dilaserve")
            self._owns_connection = True
        if self.endpoint_host is None:
            self.endpoint_host = ray.util.get_node_ip_address()
        await self.refresh()
        if not len(self.nodes):
            raise LaunchError(f"no live Ray node offers the resource {self.resource!r}")
        log.info(
            "Ray cluster: %d nodes with %s slots %s",
            len(self.nodes),
            self.resource,
            self.nodes.slots(),
        )
        self._on_nodes_changed = on_nodes_changed
        self._watcher = asyncio.get_running_loop().create_task(self._watch())

    async def close(self) -> None:
        if self._watcher is not None:
            self._watcher.cancel()
            with contextlib.suppress(asyncio.CancelledError):
                await self._watcher
        if self._owns_connection:
            ray.shutdown()

    def node_slots(self, local_slots: int) -> dict[int, int]:
        return self.nodes.slots()

    async def refresh(self) -> None:
        """Reads the cluster's nodes and reports those that left or joined."""
        async with self._refreshing:
            lost, joined = await asyncio.to_thread(self.nodes.refresh)
        for node in lost:
            log.warning("Ray node %s (%s) left", node.node_id, node.address)
        for node in joined:
            log.info("Ray node %s (%s) joined: %d slots", node.node_id, node.address, node.slots)
        if (lost or joined) and self._on_nodes_changed is not None:
            self._on_nodes_changed([n.key for n in lost], [n.key for n in joined])

    async def _watch(self) -> None:
        while True:
            await asyncio.sleep(self.poll_s)
            try:
                await self.refresh()
            except Exception:
                log.exception("reading the Ray cluster's nodes failed")

    async def launch(self, spec: WorkerSpec) -> WorkerHandle:
        node = self.nodes.get(spec.node)
        if node is None:
            raise LaunchError(f"instance {spec.instance}: node {spec.node} is not in the cluster")
        group = placement_group(
            [{self.resource: 1.0}] * spec.tp,
            strategy="STRICT_PACK",
            name=f"dilaserve-instance-{spec.instance}-worker-{spec.worker_id}",
            bundle_label_selector=[{NODE_ID_LABEL: node.node_id}] * spec.tp,
        )
        ranks: list[Any] = []
        try:
            await self._placed(group, spec)
            options = self._rank_options()
            ranks = [
                _RankActor.options(
                    scheduling_strategy=PlacementGroupSchedulingStrategy(group, rank), **options
                ).remote()
                for rank in range(spec.tp)
            ]
            init = await _awaitable(ranks[0].rendezvous.remote()) if spec.tp > 1 else None
            ranked = self._rank_spec(spec)
            env = ranked.environment()
            exits = [r.run.remote(ranked.argv(rank, init), env) for rank, r in enumerate(ranks)]
        except BaseException:
            _release(ranks, group)
            raise
        log.info(
            "launched instance %d (worker %d, TP-%d) on Ray node %s",
            spec.instance,
            spec.worker_id,
            spec.tp,
            node.node_id,
        )
        return RayInstance(spec, self, group, ranks, exits)

    async def _placed(self, group: PlacementGroup, spec: WorkerSpec) -> None:
        """Waits until the group's bundles are reserved; fails once its node has left or
        the time is up."""
        ready = asyncio.ensure_future(_awaitable(group.ready()))
        deadline = time.monotonic() + self.ready_timeout_s
        try:
            while True:
                done, _ = await asyncio.wait({ready}, timeout=self.poll_s)
                if done:
                    ready.result()
                    return
                if self.nodes.get(spec.node) is None:
                    raise LaunchError(f"instance {spec.instance}: node {spec.node} left")
                if time.monotonic() > deadline:
                    raise LaunchError(
                        f"instance {spec.instance}: {spec.tp} x {self.resource} on node "
                        f"{spec.node} not reserved within {self.ready_timeout_s:.0f} s"
                    )
        finally:
            ready.cancel()

    def _rank_options(self) -> dict[str, Any]:
        if self.resource == "GPU":
            return {"num_cpus": 0, "num_gpus": 1}
        if self.resource == "CPU":
            return {"num_cpus": 1}
        return {"num_cpus": 0, "resources": {self.resource: 1}}

    def _rank_spec(self, spec: WorkerSpec) -> WorkerSpec:
        """Ray shows each GPU rank only its own GPU, so every rank uses its first one."""
        if self.resource == "GPU" and spec.device.startswith("cuda"):
            return dataclasses.replace(spec, device="cuda:0", devices=())
        return spec


def _awaitable(ref: ray.ObjectRef) -> asyncio.Future[Any]:
    return asyncio.wrap_future(ref.future())


def _release(ranks: list[Any], group: PlacementGroup) -> None:
    """Ends the rank actors and returns the group's resources; both may already be gone."""
    for rank in ranks:
        with contextlib.suppress(Exception):
            ray.kill(rank, no_restart=True)
    with contextlib.suppress(Exception):
        remove_placement_group(group)
