"""Block diffusion decoding with the exact block KV cache against the reference loop.

On the embedded MoE model in LLaDA2.x format (`dilaserve-tiny-moe`, block 8), with prompts
of random characters: tokens per second of the step runner's `block` cache —
each step feeds only the current block, plus once the block just finished, and attends to
the cached prefix — against the release's loop, which re-runs the whole prefix every step
for one request at a time. Batch 1 (requests one after another on both sides) and batch
8. Also whether batching changes any token.

Prefix sharing: a stream of requests arriving one per step, half of them behind one long
system prompt, on runners with and without the prefix store — the share of prompt tokens
whose K/V was found stored, the prefill tokens that saved, the KV rows the requests hold
per step on average against the runner without the store (shared blocks are held once), and
that sharing changes no token.

Prints one JSON object per line. `python benches/block_diffusion.py [--quick]`.
"""

from __future__ import annotations

import argparse
import json
import random
import time

import torch

from dilaserve.models import load_model
from dilaserve.protocol import RequestState, StepEntry
from dilaserve.tiny import MOE_MODEL_NAME, default_model_dir
from dilaserve.tiny.tokenizer import ALPHABET, encode
from dilaserve.worker.generate import generate
from dilaserve.worker.runner import StepRunner

TAU = 0.9


def emit(name: str, value: float, unit: str, **extra: object) -> None:
    print(json.dumps({"name": name, "value": round(value, 4), "unit": unit, **extra}), flush=True)


def reference_loop(model, prompt: list[int], gen_length: int, tau: float) -> list[int]:
    """The release's `generate` with no cache: every step forwards `[0, end of block)`
    under the block-causal mask; commits the block's masked positions at τ, at least one."""
    mask, size = model.config.mask_token_id, model.config.block_size
    total = -(-(len(prompt) + gen_length) // size) * size
    x = prompt + [mask] * (total - len(prompt))
    for block in range(len(prompt) // size, total // size):
        start, end = block * size, (block + 1) * size
        while mask in x[start:end]:
            ids, positions = torch.tensor([x[:end]]), torch.arange(end)[None]
            logits = model(ids, positions, torch.ones(1, end, dtype=torch.bool))[0, start:end]
            logits[:, mask] = float("-inf")
            confidence, tokens = logits.softmax(-1).max(-1)
            masked = [i for i in range(size) if x[start + i] == mask]
            picked = [i for i in masked if confidence[i] >= tau]
            for i in picked or [max(masked, key=lambda i: confidence[i].item())]:
                x[start + i] = int(tokens[i])
    return x[len(prompt) :]


def cached(model, prompts: list[list[int]], gen_length: int, batch: int) -> list[list[int]]:
    runner = StepRunner(model, cache="block", max_requests=batch, max_seq_len=1024)
    out: list[list[int]] = []
    for i in range(0, len(prompts), batch):
        done = generate(runner, prompts[i : i + batch], gen_length=gen_length, threshold=TAU)
        out += [g.output_ids for g in done]
    return out


def stream(model, prompts: list[list[int]], gen_length: int, sharing: bool):
    """Adds one request per step (arrivals spread over time, as a server sees them) and
    steps every live one until all are done; their outputs, the runner, and the KV pool
    rows the requests held per step on average (shared blocks they read counted once)."""
    runner = StepRunner(
        model, cache="block", max_requests=len(prompts), max_seq_len=1024, prefix_caching=sharing
    )
    mask = model.config.mask_token_id
    waiting = [
        RequestState.new(
            i, p, gen_length, block_length=model.config.block_size, mask_token_id=mask, aligned=True
        )
        for i, p in enumerate(prompts)
    ]
    live: list[int] = []
    held: list[int] = []
    while waiting or live:
        if waiting:
            runner.add(waiting[0])
            live.append(waiting.pop(0).request_id)
        held.append(runner.pool.held_tokens)
        batch = [StepEntry(r, TAU, runner.next_kind(r)) for r in live]
        report = runner.step(batch)
        live = [o.request_id for o in report.outputs if not o.done]
    outputs = [runner.state(i).generated_ids() for i in range(len(prompts))]
    return outputs, runner, sum(held) / len(held)


def timed(fn, *args):
    start = time.perf_counter()
    result = fn(*args)
    return result, time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--quick", action="store_true", help="8 short requests")
    args = parser.parse_args()
    torch.manual_seed(0)
    torch.set_num_threads(1)
    count, prompt_len, gen_length = (8, 64, 16) if args.quick else (16, 256, 64)
    rng = random.Random(0)
    model = load_model(default_model_dir(MOE_MODEL_NAME))
    block = model.config.block_size

    def text(n: int) -> list[int]:
        return encode("".join(rng.choice(ALPHABET) for _ in range(n)))

    prompts = [text(prompt_len + rng.randrange(block)) for _ in range(count)]
    with torch.inference_mode():
        reference, reference_s = timed(
            lambda: [reference_loop(model, p, gen_length, TAU) for p in prompts]
        )
        alone, b1_s = timed(cached, model, prompts, gen_length, 1)
        batched, b8_s = timed(cached, model, prompts, gen_length, 8)
    tokens = sum(len(t) for t in reference)
    shape = {"requests": count, "prompt_tokens": prompt_len, "gen_length": gen_length}
    emit("bd_reference_tokens_per_s", tokens / reference_s, "tokens/s", **shape)
    emit("ratio_bd_cache_vs_full_recompute_b1", reference_s / b1_s, "x", **shape)
    emit("ratio_bd_cache_vs_full_recompute_b8", reference_s / b8_s, "x", **shape)
    same = batched == alone == reference
    emit("bd_tokens_identical_batched_vs_alone", float(same), "bool", **shape)

    # Half the requests open with one system prompt of whole blocks, then their own text.
    system_len = prompt_len - prompt_len // 16
    system = text(system_len)
    shared = [
        (system if i % 2 else text(system_len)) + text(prompt_len - system_len)
        for i in range(2 * count)
    ]
    with torch.inference_mode():
        (plain, runner, plain_held), plain_s = timed(stream, model, shared, gen_length, False)
        plain_fed = runner.forward_tokens
        (reused, runner, shared_held), shared_s = timed(stream, model, shared, gen_length, True)
    stats = runner.prefix.stats
    shape = {"requests": 2 * count, "prompt_tokens": prompt_len, "system_tokens": system_len}
    emit("prefix_hit_token_share", stats.hit_token_share, "share", **shape)
    emit("bd_prefix_saved_prefill_tokens", stats.hit_tokens, "tokens", **shape)
    emit("bd_prefix_fed_token_ratio", runner.forward_tokens / plain_fed, "x", **shape)
    emit("ratio_bd_prefix_sharing_vs_none", plain_s / shared_s, "x", **shape)
    emit("bd_prefix_kv_rows_ratio", shared_held / plain_held, "x", **shape)
    emit("bd_tokens_identical_prefix_shared_vs_not", float(reused == plain), "bool", **shape)


if __name__ == "__main__":
    main()
