"""Tensor parallelism on this machine: TP-2 step time against TP-1, the all-reduce share of
a TP-2 step, and the bytes the vocabulary-parallel commit exchanges per position.

A random LLaDA-format model wide enough for the layers to dominate (d=768, 12 heads, MLP
2048, 4 layers, 32k vocabulary) runs a recompute step over 2 requests of 256 tokens and a
dual-cache step over 8 requests' 32-token blocks, through the serving `StepRunner`:
TP-1 in this process with one intra-op thread (one device), TP-2 as two rank processes
with one thread each (two devices, gloo), and TP-1 with two threads (the same two cores
inside one process). Times are wall-clock medians of REPEATS steps after a warm-up; on a
CPU the ranks share the machine's cores with everything else, so the ratio, not the
absolute time, is the figure. The all-reduce share is rank 0's time inside all-reduce calls
over its step time (waiting for the slower rank included). The commit's bytes are what one
rank contributes per position, measured on the 32k model and on a 152k-vocabulary model
(Dream's), against gathering that rank's logits. Prints one JSON object per line.
"""

from __future__ import annotations

import json
import random
import statistics
import tempfile
import time
from pathlib import Path

import torch

from dilaserve.kernels import PARTIAL_BYTES
from dilaserve.models import load_model
from dilaserve.models.testing import write_tiny_checkpoint
from dilaserve.protocol import RequestState, StepEntry, StepKind
from dilaserve.worker.local_group import run_on_group
from dilaserve.worker.runner import StepRunner

BLOCK = 32
REPEATS = 5
WIDE = {
    "d_model": 768,
    "n_heads": 12,
    "n_kv_heads": 12,
    "mlp_hidden_size": 2048,
    "n_layers": 4,
    "vocab_size": 32000,
    "embedding_size": 32000,
}
# Dream-7B's vocabulary on a narrow model: only the commit's bytes are measured on it.
LARGE_VOCAB = {**WIDE, "d_model": 64, "n_heads": 2, "n_kv_heads": 2, "mlp_hidden_size": 128}
LARGE_VOCAB.update(n_layers=1, vocab_size=152064, embedding_size=152064)
# (step kind, requests, prompt tokens): the recompute step feeds 2 x (256 + 32) tokens, the
# cache step 8 x 32 tokens over a 256-token context.
SHAPES = {StepKind.RECOMPUTE: (2, 256 - BLOCK), StepKind.CACHE: (8, 256 - BLOCK)}


def emit(name: str, value: float, unit: str, **extra) -> None:
    print(json.dumps({"name": name, "value": round(value, 4), "unit": unit, **extra}), flush=True)


def time_steps(model, kind: StepKind, repeats: int = REPEATS) -> dict:
    """Median step time of `kind` and, on a TP rank 0, what its group spent per step."""
    requests, prompt = SHAPES[kind]
    runner = StepRunner(model, cache="dual", max_requests=requests, max_seq_len=prompt + BLOCK)
    group = runner.group
    rng = random.Random(0)
    config = model.config
    samples, all_reduce_s, calls = [], 0.0, 0
    commit_bytes = commit_positions = 0
    for trial in range(repeats + 1):  # the first is a warm-up
        ids = [trial * requests + i for i in range(requests)]
        for rid in ids:
            tokens = [rng.randrange(1, config.vocab_size) for _ in range(prompt)]
            tokens = [t if t != config.mask_token_id else 1 for t in tokens]
            runner.add(
                RequestState.new(
                    rid, tokens, BLOCK, block_length=BLOCK, mask_token_id=config.mask_token_id
                )
            )
        if kind is StepKind.CACHE:  # fill the cache; τ = 1 commits one token per request
            runner.step([StepEntry(rid, 1.0, StepKind.RECOMPUTE) for rid in ids])
        if group is not None:
            group.stats.reset()
        started = time.perf_counter()
        runner.step([StepEntry(rid, 1.0, kind) for rid in ids])
        elapsed = time.perf_counter() - started
        if trial:
            samples.append(elapsed)
            if group is not None:
                all_reduce_s += group.stats.all_reduce_seconds
                calls += group.stats.all_reduce_calls
                commit_bytes += group.stats.commit_bytes
                commit_positions += group.stats.commit_positions
        for rid in ids:
            runner.release(rid)
    return {
        "seconds": statistics.median(samples),
        "all_reduce_share": all_reduce_s / sum(samples),
        "all_reduce_calls": calls / repeats,
        "commit_bytes_per_position": commit_bytes / commit_positions if commit_positions else 0,
    }


def time_every_kind(model) -> dict[str, dict]:
    return {kind.value: time_steps(model, kind) for kind in SHAPES}


def commit_only(model) -> dict:
    return time_steps(model, StepKind.CACHE, repeats=1)


def main() -> None:
    torch.set_num_threads(1)
    with tempfile.TemporaryDirectory() as tmp:
        wide = write_tiny_checkpoint(Path(tmp) / "wide", "llada", **WIDE)
        large_vocab = write_tiny_checkpoint(Path(tmp) / "vocab", "llada", **LARGE_VOCAB)
        model = load_model(wide)
        tp1 = time_every_kind(model)
        torch.set_num_threads(2)
        tp1_two_threads = time_every_kind(model)
        torch.set_num_threads(1)
        del model
        tp2 = run_on_group(2, wide, time_every_kind, threads=1, timeout_s=600)
        vocab_tp2 = run_on_group(2, large_vocab, commit_only, threads=1, timeout_s=600)

    ms = {
        k: {n: round(v[k]["seconds"] * 1e3, 2) for n, v in (("tp1", tp1), ("tp2", tp2))}
        for k in tp1
    }
    for k in tp1:
        ms[k]["tp1_two_threads"] = round(tp1_two_threads[k]["seconds"] * 1e3, 2)
    main_kind = StepKind.RECOMPUTE.value
    ratio = tp2[main_kind]["seconds"] / tp1[main_kind]["seconds"]
    emit(
        "tp2_step_time_ratio",
        ratio,
        "x",
        baseline="tp1_one_thread",
        ratio=round(ratio, 4),
        kind=main_kind,
        batch_tokens=SHAPES[StepKind.RECOMPUTE][0] * (SHAPES[StepKind.RECOMPUTE][1] + BLOCK),
        cache_step_ratio=round(tp2["cache"]["seconds"] / tp1["cache"]["seconds"], 4),
        vs_tp1_two_threads=round(
            tp2[main_kind]["seconds"] / tp1_two_threads[main_kind]["seconds"], 4
        ),
        ms=ms,
        model={k: WIDE[k] for k in ("d_model", "n_layers", "mlp_hidden_size", "vocab_size")},
    )
    emit(
        "tp2_allreduce_share",
        tp2[main_kind]["all_reduce_share"],
        "fraction",
        baseline="tp2_step_time",
        kind=main_kind,
        cache_step=round(tp2["cache"]["all_reduce_share"], 4),
        all_reduces_per_step=tp2[main_kind]["all_reduce_calls"],
    )
    by_vocab = {
        WIDE["vocab_size"]: tp2["cache"]["commit_bytes_per_position"],
        LARGE_VOCAB["vocab_size"]: vocab_tp2["commit_bytes_per_position"],
    }
    worst = max(by_vocab.values())
    gather_logits = 4 * LARGE_VOCAB["vocab_size"] // 2  # one rank's fp32 logits shard
    emit(
        "tp_commit_bytes_per_position",
        worst,
        "bytes",
        baseline="gather_logits_shard_fp32",
        ratio=round(gather_logits / worst, 1),
        by_vocab=by_vocab,
        design=PARTIAL_BYTES,
        target=32,
    )


if __name__ == "__main__":
    main()
