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
than what runs."""

from __future__ import annotations

import asyncio
import itertools
import logging
from collections import Counter
from collections.abc import Collection, Mapping, Sequence
from typing import TYPE_CHECKING

from dilaserve.planner import (
    DEFAULT_BATCH_TOKENS,
    Deployment,
    Instance,
    LaunchAction,
    Plan,
    PlannerConfig,
    PlannerInputError,
    PlannerInputs,
    TransitionPlan,
    classes_from_arrivals,
    plan,
    plan_transition,
)
from dilaserve.protocol import CacheMode

from .admission import isolated_latency, threshold_options

if TYPE_CHECKING:
    from .engine import Engine

log = logging.getLogger(__name__)

#: Arrivals a replan after a node change plans from, when periodic planning is off.
MEMBERSHIP_WINDOW_S = 60.0


class Reconfigurer:
    """Executes layout changes of one engine, one at a time."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = asyncio.Lock()
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
        #: Batch size per TP degree of the last adopted plan: how the running deployment
        #: is described to the next plan (the plan's latencies assume it). It is no cap on
        #: the instances, which keep the configured budget: capping them at it cost 11
        #: points of attainment on the simulated day trace (`benches/sim.py`).
        self.batch_tokens: dict[int, int] = {}

    def planned_batch(self, tp: int) -> int:
        """Batch size the running TP-`tp` instances are planned at: the last adopted
        plan's, or the configured budget before any plan chose one."""
        return self.batch_tokens.get(tp, self.engine.config.max_batch_tokens)

    def layout(self) -> tuple[list[int], list[int]]:
        """Device slots per node in the planner's order, and each node's launcher key."""
        nodes = sorted(self.engine.launcher.node_slots(self.engine.config.slots).items())
        return [slots for _, slots in nodes], [key for key, _ in nodes]

    def deployment(self, keys: Sequence[int] | None = None) -> tuple[Deployment, list[int]]:
        """The running layout as the planner sees it, and the instance id of each entry."""
        keys = self.layout()[1] if keys is None else keys
        index = {key: n for n, key in enumerate(keys)}
        running = sorted(
            (i for i in self.engine.instances.values() if not i.stopping and i.node in index),
            key=lambda i: i.id,
        )
        degrees = {i.tp for i in running}
        deployment = Deployment(
            instances=tuple(Instance(index[i.node], i.tp, i.gpus) for i in running),
            batch_tokens={d: self.planned_batch(d) for d in degrees},
        )
        return deployment, [i.id for i in running]

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

    async def replan(self, window_s: float, min_improvement: float = 0.10) -> Plan | None:
        """Plans for the arrivals of the last `window_s` seconds and, if the planner adopts
        the new plan (one objective improves by `min_improvement`), executes its
        transition."""
        engine, c = self.engine, self.engine.config
        now = engine.now()
        arrivals = [a for a in engine.arrivals() if a.time >= now - window_s]
        if not arrivals:
            return None
        async with self._lock:
            node_gpus, keys = self.layout()
            if not node_gpus:
                log.warning("replan: no node is left to plan for")
                return None
            current, ids = self.deployment(keys)
            caching = c.cache is not CacheMode.NONE
            inputs = PlannerInputs(
                classes=classes_from_arrivals(arrivals, now - window_s, now),
                node_gpus=node_gpus,
                config=PlannerConfig(
                    slo_seconds=c.slo_scale * isolated_latency(c, engine.profile, arrivals),
                    # No degree wider than the largest node (a cluster's nodes may differ).
                    degrees=tuple(d for d in engine.planner_degrees if d <= max(node_gpus)) or (1,),
                    batch_tokens=tuple(
                        sorted(
                            {
                                *DEFAULT_BATCH_TOKENS,
                                c.max_batch_tokens,
                                *current.batch_tokens.values(),
                            }
                        )
                    ),
                    caching=caching,
                    block_length=c.block_length,
                    min_improvement=min_improvement,
                ),
                thresholds=threshold_options(c),
                current=current,
            )
            result = await asyncio.to_thread(plan, inputs, engine.profile)
            self.last_plan = result
            self.runs += 1
            self.solve_seconds += result.stage1_seconds + result.stage2_seconds
            log.info("replan: %s", result.reason)
            if result.adopted and result.transition is not None:
                self.batch_tokens.update(
                    (d.degree, d.batch_tokens)
                    for d in result.capacity.degrees
                    if d.batch_tokens is not None
                )
                await self._execute(result.transition, ids, keys)
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
        self._membership = asyncio.get_running_loop().create_task(self._replan_for_nodes())
        engine._tasks.append(self._membership)  # cancelled with the engine's other tasks

    async def nodes_settled(self) -> None:
        """Returns once the replans triggered by node changes so far are done."""
        while self._membership is not None and not self._membership.done():
            await asyncio.shield(self._membership)

    async def _replan_for_nodes(self) -> None:
        """Replans until no node change arrived meanwhile. Without recent arrivals to plan
        from, the instances lost with their nodes are relaunched where they fit."""
        window = self.engine.config.replan_interval_s or MEMBERSHIP_WINDOW_S
        while True:
            self._membership_again = False
            self.membership_replans += 1
            try:
                result = await self.replan(window, min_improvement=0.0)
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
                handover = self._last_serving(instance) and any(
                    isinstance(a, LaunchAction) for a in actions[i + 1 :]
                )
                log.info(
                    "reconfigure: stop instance %d%s", instance, " by handover" if handover else ""
                )
                await engine.stop_instance(instance, handover=handover)
        finally:
            engine.launches_pending -= launches
            engine.fail_if_unserved()

    def _last_serving(self, instance_id: int) -> bool:
        """No other instance is serving or starting up to take this one's requests."""
        return not any(
            i.id != instance_id and not i.stopping for i in self.engine.instances.values()
        )
