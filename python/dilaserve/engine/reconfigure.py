"""Live reconfiguration (DESIGN §7): plan a new instance layout and execute the planner's
Stage-2 sequence while serving — launch (start the worker, wait until ready, announce it
to the scheduler), drain by migration, stop once empty.

When the devices a launch needs are all held by running instances (two TP-1 instances on
a two-slot node becoming one TP-2), the last of them cannot drain anywhere: it is stopped
by handover instead — its requests wait with the engine's copy of their state and resume on
the new instance with a recompute step — so the change loses nothing, at the price of a
pause as long as the launch."""

from __future__ import annotations

import asyncio
import logging
from collections.abc import Mapping
from typing import TYPE_CHECKING

from dilaserve.planner import (
    DEFAULT_BATCH_TOKENS,
    Deployment,
    Instance,
    LaunchAction,
    Plan,
    PlannerConfig,
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


class Reconfigurer:
    """Executes layout changes of one engine, one at a time."""

    def __init__(self, engine: Engine) -> None:
        self.engine = engine
        self._lock = asyncio.Lock()
        #: The last plan computed by `replan`, adopted or not.
        self.last_plan: Plan | None = None
        self.runs = 0
        self.solve_seconds = 0.0

    def deployment(self) -> tuple[Deployment, list[int]]:
        """The running layout as the planner sees it, and the instance id of each entry."""
        running = sorted(
            (i for i in self.engine.instances.values() if not i.stopping),
            key=lambda i: i.id,
        )
        c = self.engine.config
        degrees = {i.tp for i in running}
        deployment = Deployment(
            instances=tuple(Instance(i.node, i.tp, i.gpus) for i in running),
            batch_tokens={d: c.max_batch_tokens for d in degrees},
        )
        return deployment, [i.id for i in running]

    async def scale_to(self, targets: Mapping[int, int]) -> TransitionPlan:
        """Moves to `targets` instances per TP degree, keeping running instances where it
        can; returns once every launch is serving and every stopped instance has exited."""
        self.engine.degrees.check(d for d, count in targets.items() if count > 0)
        async with self._lock:
            current, ids = self.deployment()
            transition = await asyncio.to_thread(
                plan_transition, [self.engine.config.slots], targets, current
            )
            await self._execute(transition, ids)
            return transition

    async def replan(self, window_s: float) -> Plan | None:
        """Plans for the arrivals of the last `window_s` seconds and, if the planner adopts
        the new plan, executes its transition."""
        engine, c = self.engine, self.engine.config
        now = engine.now()
        arrivals = [a for a in engine.arrivals() if a.time >= now - window_s]
        if not arrivals:
            return None
        async with self._lock:
            current, ids = self.deployment()
            caching = c.cache is not CacheMode.NONE
            inputs = PlannerInputs(
                classes=classes_from_arrivals(arrivals, now - window_s, now),
                node_gpus=[c.slots],
                config=PlannerConfig(
                    slo_seconds=c.slo_scale * isolated_latency(c, engine.profile, arrivals),
                    degrees=engine.planner_degrees,
                    batch_tokens=tuple(sorted({*DEFAULT_BATCH_TOKENS, c.max_batch_tokens})),
                    caching=caching,
                    block_length=c.block_length,
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
                await self._execute(result.transition, ids)
            return result

    async def _execute(self, transition: TransitionPlan, ids: list[int]) -> None:
        engine = self.engine
        actions = list(transition.actions)
        launches = sum(isinstance(a, LaunchAction) for a in actions)
        engine.launches_pending += launches
        try:
            for i, action in enumerate(actions):
                if isinstance(action, LaunchAction):
                    log.info("reconfigure: launch TP-%d on %s", action.degree, action.gpus)
                    try:
                        await engine.launch_instance(action.degree, action.gpus, action.node)
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
