"""The reconfigurer's view of the launcher's nodes: initial placement, and launcher node
keys (stable while a node lives, with gaps once nodes have left) mapped to the planner's
node numbers. No worker runs here."""

from __future__ import annotations

import asyncio
from types import SimpleNamespace

import pytest

from dilaserve.engine import InstanceRecord
from dilaserve.engine.reconfigure import Reconfigurer
from dilaserve.planner import PlannerInputError


def reconfigurer(node_slots: dict[int, int], instances=()) -> Reconfigurer:
    launcher = SimpleNamespace(node_slots=lambda local: node_slots)
    engine = SimpleNamespace(
        launcher=launcher,
        config=SimpleNamespace(slots=sum(node_slots.values()), max_batch_tokens=4096),
        instances={i.id: i for i in instances},
    )
    return Reconfigurer(engine)


def test_one_node_takes_consecutive_slots():
    assert reconfigurer({0: 4}).initial_placement((1, 2, 1)) == [
        (1, (0,), 0),
        (2, (1, 2), 0),
        (1, (3,), 0),
    ]


def test_a_cluster_is_placed_by_the_planner_without_spanning_nodes():
    placement = reconfigurer({3: 2, 5: 2, 9: 2}).initial_placement((2, 2, 1, 1))
    assert sorted(tp for tp, _, _ in placement) == [1, 1, 2, 2]
    used = [(node, gpu) for _, gpus, node in placement for gpu in gpus]
    assert len(used) == len(set(used)) == 6
    assert {node for _, _, node in placement} == {3, 5, 9}
    assert all(len(gpus) == tp and max(gpus) < 2 for tp, gpus, _ in placement)


def test_instances_that_do_not_fit_the_nodes_are_refused():
    with pytest.raises(PlannerInputError):
        reconfigurer({7: 2}).initial_placement((2, 1))
    with pytest.raises(PlannerInputError):
        reconfigurer({0: 2, 1: 2}).initial_placement((4,))


def test_deployment_numbers_nodes_in_key_order_and_drops_lost_ones():
    async def records() -> list[InstanceRecord]:  # a record's futures need a loop
        return [
            InstanceRecord(0, 1, (0,), node=9),
            InstanceRecord(1, 2, (0, 1), node=3),
            InstanceRecord(2, 1, (1,), node=4),  # its node has left
            InstanceRecord(3, 1, (1,), node=9, stopping=True),
        ]

    running = asyncio.run(records())
    r = reconfigurer({3: 2, 9: 2}, running)
    assert r.layout() == ([2, 2], [3, 9])
    deployment, ids = r.deployment()
    assert ids == [0, 1]
    assert [(i.node, i.degree, i.gpus) for i in deployment.instances] == [
        (1, 1, (0,)),
        (0, 2, (0, 1)),
    ]
