"""Step runtime throughput: cache modes and batching against plain reference loops.

A random LLaDA-format model (d = 256, 4 layers) decodes prompts of 64 tokens to 256 output
tokens (block 32, τ 0.9) with cache `none` (batch 1), `prefix` and `dual` (batch 1 and 8).
Beside it, in the same process, two straightforward loops over the same model: the plain
loop (full forward every step, no cache) and a dual-cache loop (a full forward at each
block start writing the cache, then block-only forwards reading it), both one request at a
time; at batch 1 each request goes through every contender before the next one starts. On
the CPU (the default), rates are generated tokens per second of this process's
CPU time, with one intra-op thread: on a shared machine wall time mostly measures the
neighbours, CPU time measures the work. With `--device cuda` the model is bfloat16 and
rates are per wall-clock second, the device synchronised around each timed run; every
kernel is compiled and the device warmed before the first one. Ratios compare runs of
this process only. Prints one JSON object per line.
"""

from __future__ import annotations

import argparse
import json
import resource
import tempfile
import time

import torch

from dilaserve.models import load_model
from dilaserve.models.testing import write_tiny_checkpoint
from dilaserve.worker.generate import generate
from dilaserve.worker.kv_cache import KVCachePool
from dilaserve.worker.runner import StepRunner

GEN_LENGTH = 256
BLOCK = 32
PROMPT_LENGTH = 64
REQUESTS = 8
SEQUENTIAL_REQUESTS = 2
THRESHOLD = 0.9
MODEL = {"d_model": 256, "n_layers": 4, "n_heads": 4, "n_kv_heads": 4, "mlp_hidden_size": 704}


def emit(name: str, value: float, unit: str, **extra) -> None:
    print(json.dumps({"name": name, "value": round(value, 4), "unit": unit, **extra}), flush=True)


class Clock:
    """Seconds of work: this process's CPU time on the CPU, wall time on CUDA (the device
    synchronised first, so queued kernels count)."""

    def __init__(self, device: torch.device) -> None:
        self.device = device

    def now(self) -> float:
        if self.device.type == "cuda":
            torch.cuda.synchronize(self.device)
            return time.perf_counter()
        return time.process_time()

    def timed(self, fn):
        """Result of `fn()` and the seconds it took."""
        start = self.now()
        result = fn()
        return result, self.now() - start


def threshold_commit(x: torch.Tensor, logits: torch.Tensor, lo: int, mask_id: int) -> None:
    """The threshold rule on one block's `[B, vocab]` logits, written out; updates `x`."""
    logits[:, mask_id] = -float("inf")
    conf, x0 = torch.softmax(logits.float(), dim=-1).max(dim=-1)
    block = x[0, lo : lo + BLOCK]
    conf = torch.where(block == mask_id, conf, -float("inf"))
    commit = conf >= THRESHOLD
    if not commit.any():
        commit[conf.argmax()] = True
    x[0, lo : lo + BLOCK] = torch.where(commit, x0, block)


def reference_loop(model, prompt: list[int]) -> list[int]:
    """LLaDA's generate for one prompt: full-sequence forward every step, no cache."""
    mask_id = model.config.mask_token_id
    x = torch.tensor(prompt + [mask_id] * GEN_LENGTH, device=model.device)[None]
    positions = torch.arange(x.shape[1], device=model.device)[None]
    valid = torch.ones_like(x, dtype=torch.bool)
    for block in range(GEN_LENGTH // BLOCK):
        lo = len(prompt) + block * BLOCK
        while (x[0, lo : lo + BLOCK] == mask_id).any():
            logits = model(x, positions, valid)[0]
            threshold_commit(x, logits[lo : lo + BLOCK], lo, mask_id)
    return x[0, len(prompt) :].tolist()


def dual_reference_loop(model, prompt: list[int]) -> list[int]:
    """Fast-dLLM's dual cache for one prompt: at each block start a full forward writes
    every position's K/V, then each step feeds only the block and attends over the cache."""
    cfg, device = model.config, model.device
    mask_id = cfg.mask_token_id
    x = torch.tensor(prompt + [mask_id] * GEN_LENGTH, device=device)[None]
    n = x.shape[1]
    pool = KVCachePool(cfg.num_layers, n, cfg.num_kv_heads, cfg.head_dim, model.dtype, device)
    base, length = torch.tensor([0], device=device), torch.tensor([n], device=device)
    every = torch.ones(1, n, dtype=torch.bool, device=device)
    fed = torch.ones(1, BLOCK, dtype=torch.bool, device=device)
    for block in range(GEN_LENGTH // BLOCK):
        lo = len(prompt) + block * BLOCK
        first = True
        while (x[0, lo : lo + BLOCK] == mask_id).any():
            if first:
                positions = torch.arange(n, device=device)[None]
                logits = model(x, positions, every, cache=pool, cache_base=base, cache_mode="write")
                logits = logits[0, lo : lo + BLOCK]
                first = False
            else:
                logits = model(
                    x[:, lo : lo + BLOCK],
                    torch.arange(lo, lo + BLOCK, device=device)[None],
                    fed,
                    cache=pool,
                    cache_base=base,
                    cache_mode="read",
                    cache_len=length,
                )[0]
            threshold_commit(x, logits, lo, mask_id)
    return x[0, len(prompt) :].tolist()


class TimedModel:
    """The model, with the clock seconds spent inside its calls counted: how much of a
    reference loop any runtime making the same model calls could save at most."""

    def __init__(self, model, clock: Clock) -> None:
        self.model, self.clock, self.seconds = model, clock, 0.0
        self.config, self.device, self.dtype = model.config, model.device, model.dtype

    def __call__(self, *args, **kwargs):
        out, spent = self.clock.timed(lambda: self.model(*args, **kwargs))
        self.seconds += spent
        return out


def run_runner(runner: StepRunner, prompts: list[list[int]], batch: int) -> list[list[int]]:
    outs = []
    for i in range(0, len(prompts), batch):
        outs += generate(
            runner,
            prompts[i : i + batch],
            gen_length=GEN_LENGTH,
            block_length=BLOCK,
            threshold=THRESHOLD,
        )
    return [o.output_ids for o in outs]


def make_runner(model, cache: str, batch: int) -> StepRunner:
    return StepRunner(
        model, cache=cache, max_requests=batch, max_seq_len=PROMPT_LENGTH + GEN_LENGTH
    )


def warm_up(model, prompt: list[int]) -> None:
    """On CUDA, every contender once untimed: the kernels compile (once, whatever the batch
    shape) and the libraries initialise outside the timing, for either side. The CPU has
    nothing to warm."""
    if model.device.type != "cuda":
        return
    reference_loop(model, prompt)
    dual_reference_loop(model, prompt)
    for cache in ("none", "prefix", "dual"):
        runner = make_runner(model, cache, 1)
        runner.warm_up()
        run_runner(runner, [prompt], 1)


@torch.inference_mode()
def main(argv: list[str] | None = None) -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--device", default="cpu", help="cpu (default) or cuda")
    p.add_argument("--quick", action="store_true", help="64 positions, 2 requests: checks it runs")
    args = p.parse_args(argv)
    if args.quick:
        global GEN_LENGTH, REQUESTS, SEQUENTIAL_REQUESTS
        GEN_LENGTH, REQUESTS, SEQUENTIAL_REQUESTS = 64, 2, 1
    device = torch.device(args.device)
    imports_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    torch.manual_seed(0)
    on_cpu = device.type == "cpu"
    if on_cpu:
        torch.set_num_threads(1)
    dtype = "float32" if on_cpu else "bfloat16"
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(write_tiny_checkpoint(f"{tmp}/model", "llada", **MODEL), dtype, device)
    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(0, 256, (PROMPT_LENGTH,), generator=g).tolist() for _ in range(REQUESTS)
    ]
    common = {
        "model": "random-llada-d256-l4",
        "prompt": PROMPT_LENGTH,
        "gen_length": GEN_LENGTH,
        "block": BLOCK,
        "device": device.type,
        "dtype": dtype,
        **({"threads": 1} if on_cpu else {}),
    }
    rate_unit = "tok/cpu-s" if on_cpu else "tok/s"
    clock = Clock(device)
    sequential = prompts[:SEQUENTIAL_REQUESTS]
    tokens_b1 = len(sequential) * GEN_LENGTH
    warm_up(model, prompts[0])

    # Batch 1: each request goes through every contender before the next request starts,
    # so load that a neighbour adds or removes mid-run falls on all of them alike.
    contenders = {
        "reference_loop": lambda p: reference_loop(model, p),
        "dual_reference_loop": lambda p: dual_reference_loop(model, p),
    }
    runners = {f"{c}_batch1": make_runner(model, c, 1) for c in ("none", "prefix", "dual")}
    for tag, r in runners.items():
        contenders[tag] = lambda p, r=r: run_runner(r, [p], 1)[0]
    seconds = dict.fromkeys(contenders, 0.0)
    outputs: dict[str, list[list[int]]] = {name: [] for name in contenders}
    for prompt in sequential:
        for name, run in contenders.items():
            out, spent = clock.timed(lambda run=run, p=prompt: run(p))
            seconds[name] += spent
            outputs[name].append(out)
    rates = {name: tokens_b1 / spent for name, spent in seconds.items()}
    emit("reference_loop_tokens_per_s", rates["reference_loop"], rate_unit, **common)
    emit("dual_reference_loop_tokens_per_s", rates["dual_reference_loop"], rate_unit, **common)
    # Batch 8 (no cache at batch 8 would take minutes and compare nothing asked for).
    for cache in ("prefix", "dual"):
        runners[f"{cache}_batch8"] = r = make_runner(model, cache, 8)
        outputs[f"{cache}_batch8"], spent = clock.timed(lambda r=r: run_runner(r, prompts, 8))
        rates[f"{cache}_batch8"] = len(prompts) * GEN_LENGTH / spent
    for tag, r in runners.items():
        emit(f"tokens_per_s_{tag}", rates[tag], rate_unit, **common)
        emit(f"forward_tokens_{tag}", r.forward_tokens, "tokens", **common)
    for tag, want in (("none_batch1", "reference_loop"), ("dual_batch1", "dual_reference_loop")):
        emit(f"matches_reference_{tag}", float(outputs[tag] == outputs[want]), "bool", **common)

    emit(
        "ratio_runtime_vs_reference_loop",
        rates["none_batch1"] / rates["reference_loop"],
        "x",
        baseline="plain reference loop (no cache, batch 1, same model and commits)",
        ratio=round(rates["none_batch1"] / rates["reference_loop"], 3),
        target=1.5,
        **common,
    )
    emit(
        "ratio_dual_b1_vs_dual_reference_loop",
        rates["dual_batch1"] / rates["dual_reference_loop"],
        "x",
        baseline="dual-cache reference loop (batch 1, same model and commits)",
        ratio=round(rates["dual_batch1"] / rates["dual_reference_loop"], 3),
        target=1.5,
        **common,
    )
    emit(
        "ratio_batch8_vs_batch1",
        rates["dual_batch8"] / rates["dual_batch1"],
        "x",
        baseline="cache dual, batch 1",
        ratio=round(rates["dual_batch8"] / rates["dual_batch1"], 3),
        target=3.0,
        ratio_prefix=round(rates["prefix_batch8"] / rates["prefix_batch1"], 3),
        **common,
    )
    emit(
        "ratio_dual_vs_none",
        rates["dual_batch1"] / rates["none_batch1"],
        "x",
        baseline="cache none, batch 1",
        ratio=round(rates["dual_batch1"] / rates["none_batch1"], 3),
        **common,
    )
    if on_cpu:  # on CUDA, timing each call would add the synchronisations it measures
        loops = (("reference_loop", reference_loop), ("dual_reference_loop", dual_reference_loop))
        for name, loop in loops:
            timed_model = TimedModel(model, clock)
            _, spent = clock.timed(lambda loop=loop, m=timed_model: loop(m, prompts[0]))
            share = timed_model.seconds / spent
            emit(
                f"model_share_{name}",
                share,
                "share",
                baseline="the loop's time inside the model calls a runtime makes too",
                best_ratio_without_skipping_model_work=round(1 / share, 3),
                **common,
            )
    cfg = model.config
    emit(
        "kv_pool_bytes_per_token",
        runners["dual_batch1"].pool.bytes_per_token,  # type: ignore[union-attr]
        "bytes",
        baseline="2 x layers x kv_heads x head_dim x dtype bytes",
        expected=2 * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * model.dtype.itemsize,
        **common,
    )
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    emit(
        "worker_peak_rss_mb",
        peak_kb / 1024,
        "MB",
        baseline="this bench process (torch, triton and the package imported first)",
        imports_mb=round(imports_kb / 1024, 1),
        **common,
    )


if __name__ == "__main__":
    main()
