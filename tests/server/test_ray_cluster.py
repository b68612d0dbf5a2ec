"""Serving on a Ray cluster: three Ray nodes in this process tree
(`ray.cluster_utils.Cluster`), each offering two units of a custom `slot` resource that
stands in for GPUs. One server runs through the module, in order: its instances placed
across nodes with no tensor-parallel group spanning two, answers over HTTP, a node killed
under load with nothing lost and a replan for the smaller cluster, and a node added and
used after the replan. No assertion depends on speed."""

from __future__ import annotations

import asyncio
import contextlib
import itertools
import os
import threading
import time
from collections.abc import Iterator
from concurrent.futures import ThreadPoolExecutor

import psutil
import pytest
from tiny_problems import PINNED_TAU, solvable
from tp_profiles import write_tp_profile

from dilaserve.engine import GenerationParams
from dilaserve.tiny.tasks import check, gen_length

ray = pytest.importorskip("ray")
from ray.cluster_utils import Cluster  # noqa: E402

from dilaserve.engine.ray_launcher import RayInstance, RayLauncher  # noqa: E402

SLOTS = {"slot": 2}
TIMEOUT_S = 180


def params(problem) -> GenerationParams:
    return GenerationParams(max_tokens=gen_length(problem, 32), threshold=PINNED_TAU)


@pytest.fixture(scope="module")
def cluster() -> Iterator[Cluster]:
    cluster = Cluster(
        initialize_head=True,
        head_node_args={
            "num_cpus": 1,
            "resources": SLOTS,
            "include_dashboard": False,
            # A killed node is declared dead after ~10 s of missed health checks (Ray's
            # default: ~15 s), with room for a busy machine's late answers.
            "_system_config": {
                "health_check_period_ms": 1000,
                "health_check_failure_threshold": 10,
            },
        },
    )
    for _ in range(2):
        cluster.add_node(num_cpus=0, resources=SLOTS)
    cluster.wait_for_nodes()
    ray.init(address=cluster.address, log_to_driver=False)
    yield cluster
    # The server (set up after the cluster) has stopped: its workers must be gone too.
    deadline = time.monotonic() + 30
    while _worker_processes() and time.monotonic() < deadline:
        time.sleep(0.2)
    leaked = _worker_processes()
    ray.shutdown()
    cluster.shutdown()
    assert not leaked, f"worker processes outlived the server: {leaked}"


@pytest.fixture(scope="module")
def live(cluster, start_module_server, tmp_path_factory):
    profile = write_tp_profile(tmp_path_factory.mktemp("ray") / "tp.json", (1, 2))
    return start_module_server(
        launcher=RayLauncher(resource="slot"),
        profile=profile,
        instances=(2, 1),
        max_requests_per_instance=16,
    )


def _worker_processes() -> list[psutil.Process]:
    procs = []
    for proc in psutil.Process(os.getpid()).children(recursive=True):
        with contextlib.suppress(psutil.Error):
            if "dilaserve.worker" in " ".join(proc.cmdline()):
                procs.append(proc)
    return procs


def _placement(live) -> dict[int, tuple[int, list[str]]]:
    """Instance id -> (node key, Ray node of each rank)."""

    async def placement():
        out = {}
        for inst in live.engine.instances.values():
            assert isinstance(inst.handle, RayInstance)
            out[inst.id] = (inst.node, await inst.handle.rank_nodes())
        return out

    return live.run(placement())


def test_instances_are_placed_across_nodes_and_no_group_spans_two(live):
    launcher = live.engine.launcher
    assert launcher.node_slots(0) == {0: 2, 1: 2, 2: 2}
    placement = _placement(live)
    assert sorted(i.tp for i in live.engine.instances.values()) == [1, 2]
    for node, rank_nodes in placement.values():
        assert set(rank_nodes) == {launcher.nodes.get(node).node_id}
    assert len({node for node, _ in placement.values()}) == 2
    assert live.engine._channel.endpoint.startswith("tcp://")


def test_answers_over_http_are_correct(live):
    problems = solvable(4, 515)
    client = live.client()

    def ask(problem):
        return client.completions.create(
            model="dilaserve-tiny",
            prompt=problem.prompt,
            max_tokens=gen_length(problem, 32),
            extra_body={"confidence_threshold": PINNED_TAU},
        )

    with ThreadPoolExecutor(len(problems)) as pool:
        answers = list(pool.map(ask, problems))
    assert all(check(p, a.choices[0].text) for p, a in zip(problems, answers, strict=True))


def _ray_node(cluster: Cluster, node_id: str):
    return next(n for n in cluster.worker_nodes if n.node_id == node_id)


def test_node_removed_under_load_loses_nothing_and_replans(live, cluster):
    engine = live.engine
    launcher = engine.launcher
    busiest = max(
        (k for k in launcher.node_slots(0) if k != 0),
        key=lambda k: sum(i.node == k for i in engine.instances.values()),
    )
    victim = _ray_node(cluster, launcher.nodes.get(busiest).node_id)
    problems = solvable(12, 616)
    loaded = threading.Event()

    async def scenario():
        tasks = [asyncio.ensure_future(engine.complete(p.prompt, params(p))) for p in problems]
        on_victim = {i.id for i in engine.instances.values() if i.node == busiest}
        await _until(
            lambda: any(
                engine.instance_of(r.id) in on_victim and engine.stats_of(r.id).steps
                for r in engine._requests.values()
            )
        )
        loaded.set()
        outputs = await asyncio.gather(*tasks)
        await asyncio.wait_for(_until(lambda: engine.reconfigurer.membership_replans), 60)
        await engine.reconfigurer.nodes_settled()
        return outputs

    outputs = _while_running(
        live, scenario(), loaded, lambda: cluster.remove_node(victim, allow_graceful=False)
    )
    assert all(check(p, o.text) for p, o in zip(problems, outputs, strict=True))
    assert busiest not in launcher.node_slots(0)
    assert all(i.node != busiest for i in engine.instances.values())
    assert engine.restarts == 0  # lost with its node, not restarted there
    plan = engine.reconfigurer.last_plan  # planned for the two nodes left
    assert plan is not None and plan.adopted and plan.transition is not None
    assert {i.node for i in plan.transition.instances} <= {0, 1}
    assert engine.instances and all(i.registered for i in engine.instances.values())


def test_node_added_is_used_after_the_replan(live, cluster):
    engine = live.engine
    launcher = engine.launcher
    before = set(launcher.node_slots(0))
    replans = engine.reconfigurer.membership_replans
    problems = solvable(8, 717)
    loaded = threading.Event()

    def new_instance_served() -> bool:
        new = set(launcher.node_slots(0)) - before
        return any(
            i.node in new and i.registered and engine.scheduler.instance(i.id).steps_run
            for i in engine.instances.values()
        )

    async def scenario():
        done: list = []
        used = asyncio.Event()

        async def client(k: int) -> None:  # keeps one request in flight until the end
            for i in itertools.count(k, 4):
                p = problems[i % len(problems)]
                done.append((p, await engine.complete(p.prompt, params(p))))
                if used.is_set():
                    return

        clients = [asyncio.ensure_future(client(k)) for k in range(4)]
        await _until(lambda: engine.active_requests)
        loaded.set()
        try:
            await asyncio.wait_for(_until(new_instance_served), TIMEOUT_S - 30)
        finally:
            used.set()
            await asyncio.gather(*clients)
        await engine.reconfigurer.nodes_settled()
        return done

    add = lambda: cluster.add_node(num_cpus=0, resources=SLOTS)  # noqa: E731
    done = _while_running(live, scenario(), loaded, add)
    assert engine.reconfigurer.membership_replans > replans
    assert all(check(p, o.text) for p, o in done)


def _while_running(live, scenario, loaded: threading.Event, change):
    """Runs `scenario` on the server's loop and applies `change` to the cluster from this
    thread (Ray's cluster utilities need the main thread) once the load is on."""
    future = asyncio.run_coroutine_threadsafe(scenario, live.loop)
    if not loaded.wait(TIMEOUT_S):
        future.cancel()
        raise AssertionError("the load never reached the cluster")
    change()
    return future.result(TIMEOUT_S)


async def _until(condition) -> None:
    while not condition():
        await asyncio.sleep(0.01)
