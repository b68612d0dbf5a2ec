"""The paper's experiment, live: 16 emulated GPUs (4 nodes × 4, the shipped LLaDA-8B/H100
profile and progress model) serving the conversation trace through the HTTP server, with
the load sent by a separate process, at the simulator's knee rate and at 0.75× and 1.25× of
it, under `dilaserve`, `infaas` and `llumnix`; and the simulator on the same workload,
seed and settings beside it.

Lines: `live16_vs_sim_attainment_abs_diff_pp` (the largest |live − simulated| attainment
over every rate and policy), `live16_attainment_gain_pp_vs_infaas` and
`live16_attainment_gain_pp_vs_llumnix` (at the knee); one `live16_run` record per run.
Each request carries the simulator's SLO (`slo_ms`: 5 × its isolated latency at τ 0.9 on
TP-1) and its trace lengths (a prompt of that many token ids, `max_tokens` its output).

`python benches/live_emulated.py [--duration S] [--knee R] [--quick]` (`--quick`: the knee
only, 10 s, given knee 32 req/s).
"""

from __future__ import annotations

import argparse
import asyncio
import json
import shutil
import subprocess
import sys
import tempfile
from pathlib import Path

from sim import baselines_to_knee, conversation, llada8b_setup

from dilaserve.engine import Engine, EngineConfig
from dilaserve.engine.emulation import EmulatedLauncher
from dilaserve.profiles import SIMULATED_LLADA8B
from dilaserve.scheduler import Policy
from dilaserve.server import ServerSettings, serving
from dilaserve.sim import Workload, simulate
from dilaserve.tiny import default_model_dir
from dilaserve.traces import AZURE_CONV, read_trace

POLICIES = ("dilaserve", "infaas", "llumnix")
NODES = (4, 4, 4, 4)

LOADGEN = """
import asyncio, json, sys, time, aiohttp
url, path = sys.argv[1], sys.argv[2]
work = json.load(open(path))
async def main():
    met = rejected = 0
    async with aiohttp.ClientSession(connector=aiohttp.TCPConnector(limit=0)) as s:
        start = time.monotonic()
        async def one(t, prompt, output, slo):
            nonlocal met, rejected
            await asyncio.sleep(max(0.0, start + t - time.monotonic()))
            sent = time.monotonic()
            body = {"prompt": [7] * prompt, "max_tokens": output, "slo_ms": 1000 * slo}
            async with s.post(url + "/v1/completions", json=body) as r:
                await r.read()
                if r.status == 429:
                    rejected += 1
                elif r.status == 200 and time.monotonic() - sent <= slo:
                    met += 1
        await asyncio.gather(*(one(*w) for w in work))
    print(json.dumps({"met": met, "rejected": rejected, "requests": len(work)}))
asyncio.run(main())
"""


def emit(name: str, value: float, unit: str, **extra: object) -> None:
    print(json.dumps({"name": name, "value": round(value, 3), "unit": unit, **extra}), flush=True)


def model_dir(directory: str) -> str:
    """The embedded model's tokenizer with a context long enough for the trace (emulated
    workers read no weights)."""
    target = Path(directory, "model")
    shutil.copytree(default_model_dir(), target, ignore=shutil.ignore_patterns("*.safetensors"))
    config = json.loads((target / "config.json").read_text())
    config["max_sequence_length"] = 1 << 16
    (target / "config.json").write_text(json.dumps(config))
    return str(target)


async def live(policy: str, workload_file: str, model: str, **settings: object) -> dict:
    config = EngineConfig(
        model=model,
        emulate=True,
        instances=(1,) * sum(NODES),
        profile=SIMULATED_LLADA8B,
        policy=Policy.named(policy),
        max_accuracy_drop=None,
        max_requests_per_instance=256,
        **settings,
    )
    engine = Engine(config, EmulatedLauncher(SIMULATED_LLADA8B, nodes=NODES))
    async with serving(engine, ServerSettings("emulated")) as url:
        done = await asyncio.to_thread(
            subprocess.run,
            [sys.executable, "-c", LOADGEN, url, workload_file],
            capture_output=True,
            text=True,
            check=True,
        )
        steps = engine.status().step_times
    return {**json.loads(done.stdout), "step_times": steps}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--duration", type=float, default=60.0)
    parser.add_argument("--knee", type=float, help="skip finding the simulator's knee")
    parser.add_argument("--quick", action="store_true")
    args = parser.parse_args()
    duration = 10.0 if args.quick else args.duration
    trace = read_trace(AZURE_CONV)
    setup = llada8b_setup(len(NODES), NODES[0])
    knee = args.knee or (32.0 if args.quick else None)
    if knee is None:
        knee, _ = baselines_to_knee(setup, conversation(trace, 300.0))
    factors = (1.0,) if args.quick else (0.75, 1.0, 1.25)
    results = {}
    with tempfile.TemporaryDirectory() as directory:
        model = model_dir(directory)
        for factor in factors:
            rate = knee * factor
            workload = Workload.replay(trace, rate, duration)
            slo = setup.slo_seconds(workload)
            rows = list(
                zip(
                    workload.arrival.tolist(),
                    workload.prompt_len.tolist(),
                    workload.output_len.tolist(),
                    slo.tolist(),
                    strict=True,
                )
            )
            path = Path(directory, f"workload_{rate}.json")
            path.write_text(json.dumps(rows))
            for policy in POLICIES:
                run = simulate(setup, policy, workload, rate, slo_s=slo)
                simulated = run.summary()
                outcome = asyncio.run(live(policy, str(path), model))
                attained = outcome["met"] / max(outcome["requests"], 1)
                results[policy, factor] = (attained, simulated.attainment)
                print(
                    json.dumps(
                        {
                            "live16_run": {
                                "policy": policy,
                                "rate": rate,
                                "live_attainment": attained,
                                "sim_attainment": simulated.attainment,
                                "sim_steps": run.stats["steps"],
                                "sim_step_seconds": run.stats["step_seconds"],
                                **outcome,
                            }
                        }
                    ),
                    flush=True,
                )
    diff = max(abs(a - s) for a, s in results.values())
    emit("live16_vs_sim_attainment_abs_diff_pp", 100 * diff, "pp", target="<= 3")
    ours = results["dilaserve", 1.0][0]
    for baseline, target in (("infaas", 21), ("llumnix", 30)):
        gain = 100 * (ours - results[baseline, 1.0][0])
        emit(
            f"live16_attainment_gain_pp_vs_{baseline}",
            gain,
            "pp",
            target=f">= {target}",
            rate=knee,
        )


if __name__ == "__main__":
    main()
