"""The Ray cluster as the planner sees it: the live nodes that offer the device resource
(GPUs, CPUs, or a custom resource) and how many whole units each has.

Every node gets a key the first time it is seen and keeps it while it lives, so an
instance's node stays the same node when others join or leave; a node that comes back
after leaving is a new node with a new key.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from typing import Any

import ray

#: Ray's label holding a node's id, which placement-group bundles can select on.
NODE_ID_LABEL = "ray.io/node-id"


@dataclass(frozen=True)
class RayNode:
    key: int
    node_id: str
    address: str
    slots: int


class RayNodes:
    """The live nodes with at least one unit of `resource`, refreshed from Ray's state."""

    def __init__(self, resource: str) -> None:
        self.resource = resource
        self._nodes: dict[str, RayNode] = {}
        self._keys = itertools.count()

    def refresh(self) -> tuple[list[RayNode], list[RayNode]]:
        """Reads the cluster's nodes; returns those that left and those that joined since
        the last refresh. Blocks on a call to Ray's control store."""
        return self.update(ray.nodes())

    def update(self, nodes: list[dict[str, Any]]) -> tuple[list[RayNode], list[RayNode]]:
        """`refresh` on a given `ray.nodes()` listing."""
        alive = {
            n["NodeID"]: n
            for n in nodes
            if n.get("Alive") and int(n.get("Resources", {}).get(self.resource, 0)) >= 1
        }
        lost = [self._nodes.pop(node_id) for node_id in list(self._nodes) if node_id not in alive]
        joined = []
        for node_id, n in sorted(alive.items(), key=lambda item: _order(item[1])):
            if node_id not in self._nodes:
                node = RayNode(
                    next(self._keys),
                    node_id,
                    n.get("NodeManagerAddress", ""),
                    int(n["Resources"][self.resource]),
                )
                self._nodes[node_id] = node
                joined.append(node)
        return lost, joined

    def get(self, key: int) -> RayNode | None:
        return next((n for n in self._nodes.values() if n.key == key), None)

    def slots(self) -> dict[int, int]:
        return {n.key: n.slots for n in self._nodes.values()}

    def __len__(self) -> int:
        return len(self._nodes)


def _order(node: dict[str, Any]) -> tuple[bool, str, str]:
    """Head node first, then by address: stable keys across engine restarts."""
    head = "node:__internal_head__" in node.get("Resources", {})
    return (not head, node.get("NodeManagerAddress", ""), node["NodeID"])
