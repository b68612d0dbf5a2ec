"""Step runtime throughput: cache modes and batching against a plain reference loop.

A tiny random LLaDA-format model decodes 8 prompts to 256 output tokens (block 32) with
cache `none` / `prefix` / `dual` all together (batch 8), and the first 2 of them one at a
time (batch 1) and through a straightforward LLaDA-style generate loop (full forward, no
cache, no batching). Rates are generated tokens per second of this process's CPU time, with
one intra-op thread: on a shared 2-core machine wall time mostly measures the neighbours,
CPU time measures the work. Everything runs side by side in this one process; ratios
compare runs of this process only. Prints one JSON object per line.
"""

from __future__ import annotations

import json
import resource
import tempfile
import time

import torch

from dilaserve.models import load_model
from dilaserve.models.testing import write_tiny_checkpoint
from dilaserve.worker.generate import generate
from dilaserve.worker.runner import StepRunner

GEN_LENGTH = 256
BLOCK = 32
PROMPT_LENGTH = 32
REQUESTS = 8
SEQUENTIAL_REQUESTS = 2
THRESHOLD = 0.9
MODEL = {"d_model": 128, "n_layers": 4, "n_heads": 4, "n_kv_heads": 4, "mlp_hidden_size": 352}


def emit(name: str, value: float, unit: str, **extra) -> None:
    print(json.dumps({"name": name, "value": round(value, 4), "unit": unit, **extra}), flush=True)


def reference_loop(model, prompt: list[int]) -> tuple[list[int], int]:
    """LLaDA's generate for one prompt: full-sequence forward every step, no cache."""
    cfg = model.config
    x = torch.tensor(prompt + [cfg.mask_token_id] * GEN_LENGTH)[None]
    positions = torch.arange(x.shape[1])[None]
    valid = torch.ones_like(x, dtype=torch.bool)
    fed = 0
    for block in range(GEN_LENGTH // BLOCK):
        lo = len(prompt) + block * BLOCK
        hi = lo + BLOCK
        while (x[0, lo:hi] == cfg.mask_token_id).any():
            logits = model(x, positions, valid)[0].float()
            fed += x.shape[1]
            logits[:, cfg.mask_token_id] = -float("inf")
            conf, x0 = torch.softmax(logits, dim=-1).max(dim=-1)
            masked = x[0] == cfg.mask_token_id
            conf = torch.where(masked, conf, -float("inf"))
            conf[:lo] = -float("inf")
            conf[hi:] = -float("inf")
            commit = conf >= THRESHOLD
            if not commit.any():
                commit[conf.argmax()] = True
            x[0] = torch.where(commit, x0, x[0])
    return x[0, len(prompt) :].tolist(), fed


def timed(fn):
    """Result of `fn()` and the CPU seconds this process spent on it."""
    start = time.process_time()
    result = fn()
    return result, time.process_time() - start


@torch.inference_mode()
def main() -> None:
    torch.manual_seed(0)
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        model = load_model(write_tiny_checkpoint(f"{tmp}/model", "llada", **MODEL))
    g = torch.Generator().manual_seed(1)
    prompts = [
        torch.randint(0, 256, (PROMPT_LENGTH,), generator=g).tolist() for _ in range(REQUESTS)
    ]
    common = {"model": "tiny-llada-random", "gen_length": GEN_LENGTH, "block": BLOCK, "threads": 1}
    sequential = prompts[:SEQUENTIAL_REQUESTS]

    reference, ref_seconds = timed(lambda: [reference_loop(model, p) for p in sequential])
    ref_rate = len(sequential) * GEN_LENGTH / ref_seconds
    emit("reference_loop_tokens_per_s", ref_rate, "tok/cpu-s", **common)
    emit("reference_loop_forward_tokens", sum(f for _, f in reference), "tokens", **common)

    rates: dict[tuple[str, int], float] = {}
    for cache in ("none", "prefix", "dual"):
        for batch in (1, 8):
            runner = StepRunner(model, cache=cache, max_requests=batch)

            todo = prompts if batch > 1 else sequential

            def run(runner=runner, batch=batch, todo=todo):
                outs = []
                for i in range(0, len(todo), batch):
                    outs += generate(
                        runner,
                        todo[i : i + batch],
                        gen_length=GEN_LENGTH,
                        block_length=BLOCK,
                        threshold=THRESHOLD,
                    )
                return outs

            outs, seconds = timed(run)
            rate = len(todo) * GEN_LENGTH / seconds
            rates[cache, batch] = rate
            tag = f"{cache}_batch{batch}"
            emit(f"tokens_per_s_{tag}", rate, "tok/cpu-s", **common)
            emit(f"forward_tokens_{tag}", runner.forward_tokens, "tokens", **common)
            if cache == "none":
                same = [o.output_ids for o in outs[: len(reference)]] == [r for r, _ in reference]
                emit(f"matches_reference_{tag}", float(same), "bool", **common)

    emit(
        "ratio_dual_vs_none",
        rates["dual", 8] / rates["none", 8],
        "x",
        baseline="cache none, batch 8",
        target=2.0,
        ratio_batch1=round(rates["dual", 1] / rates["none", 1], 3),
        **common,
    )
    emit(
        "ratio_batch8_vs_batch1",
        rates["dual", 8] / rates["dual", 1],
        "x",
        baseline="cache dual, batch 1",
        target=2.0,
        ratio_cache_none=round(rates["none", 8] / rates["none", 1], 3),
        **common,
    )
    emit(
        "ratio_runtime_vs_reference_loop",
        rates["none", 1] / ref_rate,
        "x",
        baseline="reference loop (cache none, batch 1, same semantics)",
        target=1.0,
        **common,
    )
    peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    emit("worker_peak_rss_mb", peak_kb / 1024, "MB", **common)


if __name__ == "__main__":
    main()
