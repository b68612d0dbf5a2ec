"""The latency profile the scheduler plans with: a given file, or one measured on this
machine by `dilaserve profile` in a separate process (so the engine never loads weights)
with the workers' thread count, for every TP degree the engine starts or may plan, cached
per model, device and settings."""

from __future__ import annotations

import asyncio
import hashlib
import json
import logging
import sys
from pathlib import Path

from dilaserve._core import LatencyProfile

from .config import EngineConfig

log = logging.getLogger(__name__)

CACHE_DIR = Path.home() / ".cache" / "dilaserve" / "profiles"
# Batch-token grid of a start-up profile: enough points to interpolate, quick on a CPU.
STARTUP_TOKENS = (32, 128, 512, 2048, 8192)
STARTUP_REPEATS = 3
#: One cached context for cache steps at start-up: every extra context is another sweep of
#: the token grid (three took over nine minutes on 2 CPU cores); `dilaserve profile
#: --cache-context` measures more for `--profile`.
STARTUP_CACHE_CONTEXTS = (256,)


class ProfileMeasurementError(RuntimeError):
    """`dilaserve profile` failed, so the engine has no latency profile to plan with."""


def cache_path(config: EngineConfig, model_dir: str) -> Path:
    """Where the profile for these settings is kept; any change of the weights, dtype,
    device, threads or block length gives another file."""
    model = Path(model_dir).resolve()
    weights = sorted((p.name, p.stat().st_size, p.stat().st_mtime_ns) for p in model.glob("*"))
    key = json.dumps(
        [
            str(model),
            weights,
            config.dtype,
            config.device,
            config.worker_threads,
            config.block_length,
            config.measured_degrees,
            STARTUP_TOKENS,
            STARTUP_REPEATS,
            STARTUP_CACHE_CONTEXTS,
        ]
    )
    return CACHE_DIR / f"{hashlib.sha256(key.encode()).hexdigest()[:16]}.json"


async def load_or_measure_profile(config: EngineConfig, model_dir: str) -> LatencyProfile:
    if config.profile is not None:
        return LatencyProfile.load(str(config.profile))
    path = cache_path(config, model_dir)
    if path.exists():
        return LatencyProfile.load(str(path))
    log.info("measuring a latency profile of %s (cached at %s)", model_dir, path)
    path.parent.mkdir(parents=True, exist_ok=True)
    partial = path.with_suffix(".partial.json")
    process = await asyncio.create_subprocess_exec(
        sys.executable, "-m", "dilaserve", "profile",
        "--model", model_dir, "--dtype", config.dtype, "--device", config.device,
        "--threads", str(config.worker_threads), "--block-length", str(config.block_length),
        "--tokens", ",".join(map(str, STARTUP_TOKENS)), "--repeats", str(STARTUP_REPEATS),
        "--cache-context", ",".join(map(str, STARTUP_CACHE_CONTEXTS)),
        "--tp", ",".join(map(str, config.measured_degrees)),
        "--output", str(partial),
        stdout=asyncio.subprocess.DEVNULL, stderr=asyncio.subprocess.PIPE,
    )  # fmt: skip
    _, stderr = await process.communicate()
    if process.returncode != 0:
        raise ProfileMeasurementError(
            f"dilaserve profile exited with {process.returncode}: {stderr.decode()[-2000:]}"
        )
    partial.replace(path)
    return LatencyProfile.load(str(path))
