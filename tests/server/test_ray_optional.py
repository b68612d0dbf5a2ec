"""Ray is optional: `dilaserve serve` without `--launcher ray` never imports it, and the
Ray options reach a `RayLauncher` from flags or TOML."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from dilaserve.cli import build_parser
from dilaserve.cli.serve import engine_config, launcher_from, settings_from
from dilaserve.engine import LocalLauncher

NO_RAY = """
import sys
from pathlib import Path
from dilaserve.cli import build_parser, main
from dilaserve.cli.serve import engine_config, launcher_from, settings_from
from dilaserve.engine import Engine
from dilaserve.server import serve
values = settings_from(build_parser().parse_args(["serve", "--device", "cpu"]))
Engine(engine_config(values), launcher_from(values, engine_config(values)))
assert "ray" not in sys.modules, sorted(m for m in sys.modules if m.split(".")[0] == "ray")
"""


def test_serving_without_the_ray_launcher_never_imports_ray():
    subprocess.run([sys.executable, "-c", NO_RAY], check=True, timeout=120)


def test_ray_options_from_flags_and_toml(tmp_path):
    pytest.importorskip("ray")
    from dilaserve.engine.ray_launcher import RayLauncher

    parse = build_parser().parse_args
    values = settings_from(parse(["serve", "--device", "cpu"]))
    assert isinstance(launcher_from(values, engine_config(values)), LocalLauncher)
    argv = ["serve", "--device", "cpu", "--launcher", "ray", "--ray-address", "10.0.0.1:6379"]
    with pytest.raises(ValueError, match="needs --instances"):
        engine_config(settings_from(parse(argv)))
    values = settings_from(parse([*argv, "--instances", "2x1"]))
    launcher = launcher_from(values, engine_config(values))
    assert isinstance(launcher, RayLauncher)
    assert (launcher.address, launcher.resource) == ("10.0.0.1:6379", "CPU")
    config = tmp_path / "serve.toml"
    config.write_text('launcher = "ray"\nray_resource = "accelerator"\ninstances = "1x2"\n')
    values = settings_from(parse(["serve", "--device", "cpu", "--config", str(config)]))
    launcher = launcher_from(values, engine_config(values))
    assert (launcher.address, launcher.resource) == ("auto", "accelerator")
    config.write_text('launcher = "slurm"\n')
    values = settings_from(parse(["serve", "--device", "cpu", "--config", str(config)]))
    with pytest.raises(ValueError, match="local or ray"):
        launcher_from(values, engine_config(values))


def test_ray_nodes_keep_their_keys_while_others_come_and_go():
    pytest.importorskip("ray")
    from dilaserve.engine.ray_nodes import RayNodes

    def node(node_id, slots, alive=True, head=False):
        resources = {"slot": slots, "CPU": 4.0, **({"node:__internal_head__": 1.0} if head else {})}
        return {"NodeID": node_id, "Alive": alive, "Resources": resources}

    nodes = RayNodes("slot")
    lost, joined = nodes.update([node("b", 2), node("a", 4, head=True), node("c", 0)])
    assert lost == [] and [(n.node_id, n.key) for n in joined] == [("a", 0), ("b", 1)]
    assert nodes.slots() == {0: 4, 1: 2}
    lost, joined = nodes.update([node("a", 4, head=True), node("b", 2, alive=False), node("d", 1)])
    assert [n.key for n in lost] == [1] and [(n.node_id, n.key) for n in joined] == [("d", 2)]
    assert nodes.slots() == {0: 4, 2: 1} and nodes.get(1) is None
    lost, joined = nodes.update([node("a", 4, head=True), node("d", 1), node("b", 2)])
    assert lost == [] and [(n.node_id, n.key) for n in joined] == [("b", 3)]


def test_kuberay_manifest_starts_a_server_the_cli_accepts():
    yaml = pytest.importorskip("yaml")
    manifest = Path(__file__).parents[2] / "deploy" / "kuberay-raycluster.yaml"
    cluster, service = yaml.safe_load_all(manifest.read_text())
    assert cluster["kind"] == "RayCluster" and service["kind"] == "Service"
    (head,) = cluster["spec"]["headGroupSpec"]["template"]["spec"]["containers"]
    command = head["args"][0].split("exec dilaserve ", 1)[1].split()
    args = build_parser().parse_args(command)
    values = settings_from(args)
    assert (values["launcher"], values["ray_address"], values["device"]) == ("ray", "auto", "cuda")
    ports = {p["containerPort"] for p in head["ports"]}
    assert values["port"] in ports and service["spec"]["ports"][0]["targetPort"] == values["port"]
