"""`dilaserve serve`: the OpenAI-compatible server on one model (the embedded
dilaserve-tiny by default), configured by flags or the same keys in a TOML file.

The scheduler's settings (`--max-batch-tokens`, `--thresholds`, the policy's fields such as
`--admission` or `--no-migration`) come from the core's one declaration of them
(`dilaserve.settings`): a named `--policy` first, then any of its fields given."""

from __future__ import annotations

import argparse
import asyncio
import dataclasses
import functools
import logging
import os
import sys
import tomllib
from pathlib import Path

import torch

from dilaserve.cli.common import default_dtype
from dilaserve.engine import (
    Engine,
    EngineClient,
    EngineConfig,
    EngineStoppedError,
    Launcher,
    LocalLauncher,
)
from dilaserve.engine.config import ENGINE_SCHEDULER_SETTINGS
from dilaserve.models import read_config
from dilaserve.protocol import CacheMode
from dilaserve.scheduler import POLICY_SETTINGS, PRESETS, Policy
from dilaserve.server import ServerSettings, bind, serve
from dilaserve.settings import add_settings_flags, flatten, parse_setting
from dilaserve.tiny import MODEL_NAME, MOE_MODEL_NAME, model_path
from dilaserve.worker.kv_cache import parse_kv_memory

#: The scheduler's settings a flag or key may give (nested policy fields flattened).
SCHEDULER_KEYS = {f["name"]: f for f in flatten(ENGINE_SCHEDULER_SETTINGS)}
_POLICY_KEYS = {f["name"] for f in POLICY_SETTINGS}

# Flag defaults; a TOML file (`--config`) overrides them, explicit flags override both. A
# scheduler setting left at None keeps the named policy's or the core's default.
DEFAULTS = {
    "model": None,
    "served_model_name": None,
    "instances": None,
    "device_slots": None,
    "cache": None,
    "slo_scale": 5.0,
    "policy": "dilaserve",
    "max_accuracy_drop": 3.0,
    "max_requests_per_instance": 64,
    "kv_cache_memory": None,
    "prefix_caching": True,
    "profile": None,
    "emulate": False,
    "progress": None,
    "replan_interval": None,
    "core_process": True,
    "dtype": None,
    "device": None,
    "host": "127.0.0.1",
    "port": 8000,
    "api_key": None,
    "max_body_bytes": 1 << 20,
    "max_connections": 2048,
    "read_timeout": 10.0,
    "keepalive_timeout": 15.0,
    "log_level": "info",
    "launcher": "local",
    "ray_address": "auto",
    "ray_resource": None,
}
assert not set(DEFAULTS) & set(SCHEDULER_KEYS), "a serve key shadows a scheduler setting"
DEFAULTS |= dict.fromkeys(SCHEDULER_KEYS)


def add_parser(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser(
        "serve",
        help="serve a model over an OpenAI-compatible HTTP API",
        description=__doc__,
        argument_default=argparse.SUPPRESS,
    )
    p.add_argument("--config", help="TOML file with any of the keys below (dashes as _)")
    p.add_argument(
        "--model", help=f"checkpoint directory, or {MOE_MODEL_NAME} (default: {MODEL_NAME})"
    )
    p.add_argument("--served-model-name", help="name clients use (default: directory name)")
    p.add_argument(
        "--instances",
        help='instances as COUNTxTP, comma-separated, e.g. "2x1,1x2" (default: what fits '
        "this machine: one TP-1 instance per GPU, or per CPU core up to 2)",
    )
    p.add_argument("--device-slots", type=int, help="GPUs (or CPU slots) instances may use")
    p.add_argument(
        "--cache",
        choices=[m.value for m in CacheMode],
        help="KV cache (default: 'block', the exact cache, for a block diffusion model; "
        "else 'dual')",
    )
    p.add_argument("--slo-scale", type=float, help="default SLO = scale x isolated latency")
    p.add_argument(
        "--policy",
        help="a named policy, then adjusted by the policy flags below: "
        + "; ".join(f"{name} ({p['doc']})" for name, p in PRESETS.items())
        + "; or fixed-T (τ fixed at T)",
    )
    p.add_argument(
        "--max-accuracy-drop",
        help="quality floor in accuracy points: never choose a threshold whose accuracy, "
        "measured on the model (its progress.json), is more than this below the top "
        "threshold's (3; 'none' allows every threshold)",
    )
    p.add_argument(
        "--max-requests-per-instance", type=int, help="resident requests per instance (64)"
    )
    p.add_argument(
        "--kv-cache-memory",
        help="KV pool per worker: bytes (8GiB) or a fraction of free device memory (0.5); "
        "default: 0.9 of a GPU's free memory, 0.25 of a host's",
    )
    p.add_argument(
        "--prefix-caching",
        action=argparse.BooleanOptionalAction,
        help="block diffusion models: requests share the exact K/V of the prompt blocks "
        "they have in common (default: on)",
    )
    p.add_argument("--profile", help="latency profile JSON (default: measured at start-up)")
    p.add_argument("--replan-interval", type=float, help="seconds between cluster re-plans")
    p.add_argument(
        "--emulate",
        action="store_true",
        help="emulated workers, no model: each step takes --profile's time (default: the "
        "shipped LLaDA-8B/H100 profile) and commits tokens drawn from --progress; the "
        "rest of the server runs unchanged (default instances: 8x1)",
    )
    p.add_argument(
        "--progress",
        help="progress model JSON of emulated workers (default: LLaDA-8B's, as the simulator's)",
    )
    p.add_argument(
        "--core-process",
        action=argparse.BooleanOptionalAction,
        help="run the engine core (scheduler, workers' channel) in its own process, apart "
        "from the HTTP front end that parses, tokenizes and decodes (default: on)",
    )
    p.add_argument(
        "--dtype", choices=["float32", "bfloat16", "float16"], help="bfloat16 on CUDA, else float32"
    )
    p.add_argument("--device", help="cpu or cuda (default: cuda if available)")
    p.add_argument("--host")
    p.add_argument("--port", type=int)
    p.add_argument("--api-key", help="require `Authorization: Bearer KEY` (or DILASERVE_API_KEY)")
    p.add_argument("--max-body-bytes", type=int)
    p.add_argument(
        "--max-connections", type=int, help="open connections at once; more get 503 (2048)"
    )
    p.add_argument(
        "--read-timeout",
        type=float,
        help="seconds a connection's first request head may take to arrive, and a body "
        "after its head; slower connections are closed (10)",
    )
    p.add_argument(
        "--keepalive-timeout", type=float, help="seconds an idle keep-alive connection stays (15)"
    )
    p.add_argument("--log-level", choices=["debug", "info", "warning", "error"])
    p.add_argument(
        "--launcher",
        choices=["local", "ray"],
        help="where workers run: processes on this machine, or a Ray cluster's nodes "
        "(needs `pip install 'dilaserve[ray]'`)",
    )
    p.add_argument("--ray-address", help="the Ray cluster: auto (default) or HOST:PORT")
    p.add_argument(
        "--ray-resource",
        help="the Ray resource one rank takes (default: GPU on cuda, else CPU; or a custom one)",
    )
    settings = p.add_argument_group("scheduler settings (the core's SchedulerConfig)")
    add_settings_flags(settings, ENGINE_SCHEDULER_SETTINGS, exclude=("policy",))
    policy = p.add_argument_group("policy settings (the core's Policy; they adjust --policy)")
    add_settings_flags(policy, POLICY_SETTINGS, default_label="dilaserve")
    p.set_defaults(run=run)


def settings_from(args: argparse.Namespace) -> dict:
    """Defaults, then the TOML file, then the flags given."""
    values = dict(DEFAULTS)
    given = vars(args)
    if "config" in given:
        with open(given["config"], "rb") as f:
            table = tomllib.load(f)
        unknown = set(table) - set(DEFAULTS)
        if unknown:
            raise ValueError(f"{given['config']}: unknown keys {sorted(unknown)}")
        values |= table
    values |= {k: v for k, v in given.items() if k in DEFAULTS}
    return values


def parse_instances(spec: str) -> tuple[int, ...]:
    """'2x1,1x2' -> (1, 1, 2)."""
    degrees: list[int] = []
    for part in spec.split(","):
        try:
            count, tp = (int(x) for x in part.strip().lower().split("x"))
        except ValueError:
            raise ValueError(f"--instances: {part!r} is not COUNTxTP") from None
        if count <= 0 or tp <= 0:
            raise ValueError(f"--instances: {part!r} needs positive numbers")
        degrees += [tp] * count
    return tuple(degrees)


def accuracy_drop(value: str | float | None) -> float | None:
    """`max_accuracy_drop` in points ('3', 3.0 or 'none') as a fraction, or None."""
    if value is None or str(value).lower() == "none":
        return None
    points = float(value)
    if points < 0:
        raise ValueError(f"--max-accuracy-drop must not be negative, got {value!r}")
    return points / 100


def kv_memory(value: str | int | float | None) -> int | float | None:
    """`kv_cache_memory` from the command line (a string) or a config file (a number)."""
    if value is None or isinstance(value, int | float):
        return value
    return parse_kv_memory(str(value))


def scheduler_settings(values: dict) -> dict:
    """The scheduler settings `values` give, parsed and checked: the named policy with its
    given fields replaced, and every other setting given (None: not given)."""
    given = {
        name: parse_setting(SCHEDULER_KEYS[name], value)
        for name, value in values.items()
        if name in SCHEDULER_KEYS and value is not None
    }
    policy = Policy.named(values["policy"])
    policy = dataclasses.replace(policy, **{k: v for k, v in given.items() if k in _POLICY_KEYS})
    return {k: v for k, v in given.items() if k not in _POLICY_KEYS} | {"policy": policy}


def engine_config(values: dict) -> EngineConfig:
    emulate = bool(values["emulate"])
    device = values["device"] or ("cuda" if torch.cuda.is_available() and not emulate else "cpu")
    if values["instances"]:
        instances = parse_instances(values["instances"])
    elif emulate:
        instances = (1,) * 8
    elif values["launcher"] == "ray":
        raise ValueError("--launcher ray needs --instances (this machine's devices say nothing)")
    elif device == "cuda":
        instances = (1,) * torch.cuda.device_count()
    else:
        instances = (1,) * min(2, os.cpu_count() or 1)
    block = read_config(model_path(values["model"]))[1].block_size
    cache = CacheMode(values["cache"]) if values["cache"] else CacheMode.default_for(block)
    cache.check_model(block)
    if block and values.get("block_length") not in (None, block):
        raise ValueError(
            f"--block-length {values['block_length']}: this block diffusion model decodes "
            f"blocks of {block} positions"
        )
    return EngineConfig(
        model=values["model"],
        instances=instances,
        device_slots=values["device_slots"],
        cache=cache,
        dtype=values["dtype"] or default_dtype(device),
        device=device,
        slo_scale=values["slo_scale"],
        max_accuracy_drop=accuracy_drop(values["max_accuracy_drop"]),
        max_requests_per_instance=values["max_requests_per_instance"],
        kv_cache_memory=kv_memory(values["kv_cache_memory"]),
        prefix_caching=values["prefix_caching"],
        profile=values["profile"],
        emulate=emulate,
        progress=values["progress"],
        replan_interval_s=values["replan_interval"],
        **scheduler_settings(values),
    )


def launcher_from(values: dict, config: EngineConfig) -> Launcher | None:
    """The local launcher (None with `--emulate`: the engine starts emulated instances), or
    a `RayLauncher` (Ray is imported only then)."""
    if values["launcher"] == "local":
        return None if config.emulate else LocalLauncher()
    if config.emulate:
        raise ValueError("--emulate runs its instances on this machine: use --launcher local")
    if values["launcher"] != "ray":
        raise ValueError(f"launcher must be local or ray, got {values['launcher']!r}")
    try:
        from dilaserve.engine.ray_launcher import RayLauncher
    except ImportError as exc:
        raise ValueError(
            f"--launcher ray needs Ray: pip install 'dilaserve[ray]' ({exc})"
        ) from None
    resource = values["ray_resource"] or ("CPU" if config.device == "cpu" else "GPU")
    return RayLauncher(values["ray_address"], resource)


def run(args: argparse.Namespace) -> int:
    values = settings_from(args)
    logging.basicConfig(
        level=values["log_level"].upper(),
        format="%(asctime)s %(levelname)s %(name)s: %(message)s",
    )
    config = engine_config(values)
    name = values["served_model_name"] or (
        Path(values["model"]).name if values["model"] else MODEL_NAME
    )
    settings = ServerSettings(
        model_name=name,
        api_key=values["api_key"] or os.environ.get("DILASERVE_API_KEY"),
        max_body_bytes=values["max_body_bytes"],
        max_connections=values["max_connections"],
        read_timeout_s=values["read_timeout"],
        keepalive_timeout_s=values["keepalive_timeout"],
    )
    sock = bind(values["host"], values["port"])
    if values["core_process"]:
        launcher = functools.partial(launcher_from, values, config)
        engine: Engine | EngineClient = EngineClient(config, launcher)
    else:
        engine = Engine(config, launcher_from(values, config))
    try:
        asyncio.run(serve(engine, settings, sock))
    except EngineStoppedError as exc:  # the core failed to start, or ended on its own
        print(f"dilaserve serve: error: {exc}", file=sys.stderr)
        return 1
    return 0
