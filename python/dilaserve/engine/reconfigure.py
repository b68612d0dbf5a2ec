"""Live reconfiguration (DESIGN §7): plan a new instance layout and execute the planner's
Stage-2 sequence while serving — launch (start the worker, wait until ready, announce it
to the scheduler), drain by migration, stop once empty.

When the devices a launch needs are all held by running instances (two TP-1 instances on
a two-slot node becoming one TP-2), the last of them cannot drain anywhere: it is stopped
by handover instead — its requests wait with the engine's copy of their state and resume on
the new instance with a recompute step — so the change loses nothing, at the price of a
pause as long as the launch.

Nodes come from the launcher (one node of `device_slots` locally, the Ray cluster's nodes
with `RayLauncher`); the planner numbers them 0..n-1 in launcher-key order. A node that
leaves takes its instances with it (their requests resume elsewhere at once); a node that
leaves or joins triggers a replan for the cluster as it now is, adopted unless it is worse
than what runs.

When to plan, what the planner is asked, what an adopted plan changes and when a stop
hands over are the core's replanner's (`_core.Replanner`), which the simulator runs too;
this module executes its plans on workers. It knows the engine only through
`ManagedCluster`, the few engine methods it calls."""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import json
import logging
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from typing import Any, Protocol

from dilaserve import _core
from dilaserve.planner import (
    DEFAULT_BATCH_TOKENS,
    Deployment,
    Instance,
    LaunchAction,
    Plan,
    PlannerConfig,
    PlannerInputError,
    TransitionPlan,
    plan_from_json,
    plan_transition,
)
from dilaserve.protocol import CacheMode

from .admission import threshold_options


class ManagedCluster(Protocol):
    """What the reconfigurer needs of the engine."""

    config: Any
    profile: Any
    planner_degrees: tuple[int, ...]
    degrees: Any
    launcher: Any
    instances: Mapping[int, Any]
    launches_pending: int

    def now(self) -> float: ...
    async def launch_instance(self, tp: int, gpus: tuple[int, ...], node: int = 0) -> int: ...
    async def stop_instance(self, instance_id: int, *, handover: bool = False) -> None: ...
    def lose_instance(self, instance_id: int) -> None: ...
    def fail_if_unserved(self) -> None: ...
    def spawn(self, coroutine: Any) -> asyncio.Task[None]: ...


log = logging.getLogger(__name__)

#: Arrivals a replan after a node change plans from, when periodic planning is off.
MEMBERSHIP_WINDOW_S = 60.0


def replan_options(engine: ManagedCluster) -> str:
    """The replanner's options for the engine's current settings (JSON)."""
    c = engine.config
    window = c.replan_interval_s or MEMBERSHIP_WINDOW_S
    options = threshold_options(c)
    planner = PlannerConfig(
        slo_seconds=1.0,  # replaced at each plan: slo_scale x each class's isolated latency
        degrees=engine.planner_degrees,
        batch_tokens=DEFAULT_BATCH_TOKENS,
        caching=c.cache is not CacheMode.NONE,
        exact_cache=c.cache is CacheMode.BLOCK,
        block_length=c.block_length,
    )
    return json.dumps(
        {
            "interval_s": window,
            "window_s": window,
            "planner": dataclasses.asdict(planner),
            "slo": {
                "scaled": {"scale": c.slo_scale, "tokens_per_step": options[-1].tokens_per_step}
            },
            "thresholds": [dataclasses.asdict(t) for t in options],
        }
    )


class Reconfigurer:
    """Executes layout changes of one engine, one at a time."""

    def __init__(self, engine: ManagedCluster) -> None:
        self.engine = engine
        self._lock = asyncio.Lock()
        self._core_replanner: _core.Replanner | None = None
        #: The last plan computed by `replan`, adopted or not.
        self.last_plan: Plan | None = None
        self.runs = 0
        self.solve_seconds = 0.0
        #: Replans triggered by nodes that joined or left.
        self.membership_replans = 0
        self._membership: asyncio.Task[None] | None = None
        self._membership_again = False
        #: TP degrees of instances lost with their nodes and not replaced yet.
        self._lost: Counter[int] = Counter()

    @property
    def _replanner(self) -> _core.Replanner:
        """The core's replanner, made on first use (from the engine's settings then)."""
        if self._core_replanner is None:
            self._core_replanner = _core.Replanner(replan_options(self.engine))
        return self._core_replanner

    def record(self, time: float, prompt_tokens: int, output_tokens: int) -> None:
        """An arrival, for the plans to come."""
        self._replanner.record(time, prompt_tokens, output_tokens)

    def settings_changed(self) -> None:
        """The engine's rates changed (learned while serving): later plans use them."""
        self._replanner.set_options_json(replan_options(self.engine))

    def planned_batch(self, tp: int) -> int:
        """Batch size the running TP-`tp` instances are planned at: the last adopted plan's,
        or the configured budget before any plan chose one. It describes the deployment to
        the planner and caps nothing."""
        planned = self._replanner.planned_batch(tp)
        return self.engine.config.max_batch_tokens if planned is None else planned

    @property
    def next_plan(self) -> float:
        """When the next periodic plan is due, on the engine's clock."""
        return self._replanner.next_plan

    def layout(self) -> tuple[list[int], list[int]]:
        """Device slots per node in the planner's order, and each node's launcher key."""
        nodes = sorted(self.engine.launcher.node_slots(self.engine.config.slots).items())
        return [slots for _, slots in nodes], [key for key, _ in nodes]

    def running(self, keys: Sequence[int]) -> list[Any]:
        """Instances serving (not stopping) on the nodes of `keys`, by id."""
        nodes = set(keys)
        serving = (i for i in self.engine.instances.values() if not i.stopping and i.node in nodes)
        return sorted(serving, key=lambda i: i.id)

    def deployment(self, keys: Sequence[int] | None = None) -> tuple[Deployment, list[int]]:
        """The running layout as Stage 2 sees it, and the instance id of each entry."""
        keys = self.layout()[1] if keys is None else keys
        index = {key: n for n, key in enumerate(keys)}
        running = self.running(keys)
        instances = tuple(Instance(index[i.node], i.tp, i.gpus) for i in running)
        return Deployment(instances=instances), [i.id for i in running]

    def initial_placement(self, degrees: Sequence[int]) -> list[tuple[int, tuple[int, ...], int]]:
        """Where the engine's first instances go, as `(tp, devices, node key)`: consecutive
        slots of one node that holds them all, else the planner's Stage-2 placement (which
        raises `PlannerInputError` when they do not fit on the nodes)."""
        node_gpus, keys = self.layout()
        if len(keys) == 1 and node_gpus[0] >= sum(degrees):
            starts = itertools.accumulate(degrees[:-1], initial=0)
            return [
                (tp, tuple(range(s, s + tp)), keys[0])
                for tp, s in zip(degrees, starts, strict=True)
            ]
        transition = plan_transition(node_gpus, Counter(degrees))
        return [
            (a.degree, a.gpus, keys[a.node])
            for a in transition.actions
            if isinstance(a, LaunchAction)
        ]

    async def scale_to(self, targets: Mapping[int, int]) -> TransitionPlan:
        """Moves to `targets` instances per TP degree, keeping running instances where it
        can; returns once every launch is serving and every stopped instance has exited."""
        self.engine.degrees.check(d for d, count in targets.items() if count > 0)
        async with self._lock:
            node_gpus, keys = self.layout()
            current, ids = self.deployment(keys)
            transition = await asyncio.to_thread(plan_transition, node_gpus, targets, current)
            await self._execute(transition, ids, keys)
            return transition

    async def replan(self, min_improvement: float | None = None) -> Plan | None:
        """Plans for the arrivals of the last window (`replan_interval_s`, or
        `MEMBERSHIP_WINDOW_S` without periodic planning) and, if the planner adopts the new
        plan (an objective improves by `min_improvement`, 10 % by default), executes its
        transition."""
        engine = self.engine
        async with self._lock:
            node_gpus, keys = self.layout()
            current, ids = self.deployment(keys)
            running = [
                (id_, i.node, i.degree, list(i.gpus))
                for id_, i in zip(ids, current.instances, strict=True)
            ]
            asked = self._replanner.inputs_json(
                engine.now(),
                running,
                node_gpus,
                engine.config.max_batch_tokens,
                engine.profile,
                min_improvement=min_improvement,
            )
            if asked is None:
                if not node_gpus:
                    log.warning("replan: no node is left to plan for")
                return None
            inputs = json.loads(asked)
            raw = await asyncio.to_thread(
                _core.plan_json, json.dumps(inputs["inputs"]), engine.profile
            )
            self._replanner.adopt_json(raw)
            result = self.last_plan = plan_from_json(raw)
            self.runs += 1
            self.solve_seconds += result.stage1_seconds + result.stage2_seconds
            log.info("replan: %s", result.reason)
            if result.adopted and result.transition is not None:
                await self._execute(result.transition, inputs["instance_ids"], keys)
            return result

    def on_nodes_changed(self, lost: Collection[int], joined: Collection[int]) -> None:
        """The launcher's report of nodes that left or joined: instances on a lost node
        are gone (their requests resume elsewhere), and a replan follows."""
        engine = self.engine
        for inst in list(engine.instances.values()):
            if inst.node in lost:
                log.warning("instance %d: its node %d left the cluster", inst.id, inst.node)
                if not inst.stopping:
                    self._lost[inst.tp] += 1
                engine.lose_instance(inst.id)
        log.info("nodes changed (left %s, joined %s): replanning", sorted(lost), sorted(joined))
        if self._membership is not None and not self._membership.done():
            self._membership_again = True
            return
        self._membership = engine.spawn(self._replan_for_nodes())

    async def nodes_settled(self) -> None:
        """Returns once the replans triggered by node changes so far are done."""
        while self._membership is not None and not self._membership.done():
            await asyncio.shield(self._membership)

    async def _replan_for_nodes(self) -> None:
        """Replans until no node change arrived meanwhile. Without recent arrivals to plan
        from, the instances lost with their nodes are relaunched where they fit."""
        while True:
            self._membership_again = False
            self.membership_replans += 1
            try:
                result = await self.replan(min_improvement=0.0)
                if result is None and self._lost:
                    await self._replace_lost()
                elif result is not None and result.adopted:
                    self._lost.clear()
            except Exception:
                log.exception("replan after a node change failed")
            if not self._membership_again:
                return

    async def _replace_lost(self) -> None:
        current, _ = self.deployment()
        targets = Counter(i.degree for i in current.instances) + self._lost
        try:
            await self.scale_to(targets)
        except PlannerInputError as exc:
            log.warning("the lost instances %s do not fit: %s", dict(self._lost), exc)
        self._lost.clear()

    async def _execute(
        self, transition: TransitionPlan, ids: list[int], keys: Sequence[int]
    ) -> None:
        engine = self.engine
        actions = list(transition.actions)
        launches = sum(isinstance(a, LaunchAction) for a in actions)
        engine.launches_pending += launches
        try:
            for i, action in enumerate(actions):
                if isinstance(action, LaunchAction):
                    log.info("reconfigure: launch TP-%d on %s", action.degree, action.gpus)
                    try:
                        await engine.launch_instance(action.degree, action.gpus, keys[action.node])
                    finally:
                        engine.launches_pending -= 1
                        launches -= 1
                    continue
                instance = ids[action.instance]
                handover = _core.Replanner.handover(
                    self._others_serving(instance),
                    any(isinstance(a, LaunchAction) for a in actions[i + 1 :]),
                )
                log.info(
                    "reconfigure: stop instance %d%s", instance, " by handover" if handover else ""
                )
                await engine.stop_instance(instance, handover=handover)
        finally:
            engine.launches_pending -= launches
            engine.fail_if_unserved()

    def _others_serving(self, instance_id: int) -> bool:
        """Another instance is serving or starting up to take this one's requests."""
        return any(i.id != instance_id and not i.stopping for i in self.engine.instances.values())
