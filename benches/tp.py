"""Tensor parallelism on this machine: TP-2 step time against TP-1, the all-reduce share of
a TP-2 step, and the bytes the vocabulary-parallel commit exchanges per position.

A random LLaDA-format model wide enough for the layers to dominate (d=768, 12 heads, MLP
2048, 4 layers, 32k vocabulary) runs a recompute step over 2 requests of 256 tokens and a
dual-cache step over 8 requests' 32-token blocks, through the serving `StepRunner`, three
ways: TP-2 as two rank processes with one intra-op thread each (two devices, gloo), TP-1
with one thread (one device), and TP-1 with two threads (the same two cores in one
process). The TP-1 model lives in rank 0's process and its steps are interleaved with the
TP-2 steps, trial by trial, so all three see the same load on a shared machine (the other
rank sleeps in a blocking receive meanwhile). Times are wall-clock medians of REPEATS steps
after a warm-up; the ratio, not the absolute time, is the figure. The all-reduce share is
rank 0's time inside all-reduce calls over its step time (waiting for the slower rank
included). The commit's bytes are what one rank contributes per position, measured on the
32k model and on a 152k-vocabulary model (Dream's), against gathering that rank's logits.
Prints one JSON object per line.
"""

from __future__ import annotations

import argparse
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
REPEATS = 7
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


class Timed:
    """One configuration's runner for one step kind, and what its steps cost."""

    def __init__(self, model, kind: StepKind, threads: int) -> None:
        requests, prompt = SHAPES[kind]
        self.kind, self.threads, self.requests, self.prompt = kind, threads, requests, prompt
        self.runner = StepRunner(
            model, cache="dual", max_requests=requests, max_seq_len=prompt + BLOCK
        )
        self.rng = random.Random(0)
        self.samples: list[float] = []
        self.all_reduce_s = 0.0
        self.calls = self.commit_bytes = self.commit_positions = 0
        self._next_id = 0

    def trial(self, keep: bool) -> None:
        runner, config = self.runner, self.runner.config
        ids = list(range(self._next_id, self._next_id + self.requests))
        self._next_id += self.requests
        for rid in ids:
            tokens = [self.rng.randrange(1, config.vocab_size) for _ in range(self.prompt)]
            tokens = [t if t != config.mask_token_id else 1 for t in tokens]
            state = RequestState.new(
                rid, tokens, BLOCK, block_length=BLOCK, mask_token_id=config.mask_token_id
            )
            runner.add(state)
        if self.kind is StepKind.CACHE:  # fill the cache; τ = 1 commits one token per request
            runner.step([StepEntry(rid, 1.0, StepKind.RECOMPUTE) for rid in ids])
        group = runner.group
        if group is not None:
            group.stats.reset()
        torch.set_num_threads(self.threads)
        started = time.perf_counter()
        runner.step([StepEntry(rid, 1.0, self.kind) for rid in ids])
        elapsed = time.perf_counter() - started
        torch.set_num_threads(1)
        if keep:
            self.samples.append(elapsed)
            if group is not None:
                self.all_reduce_s += group.stats.all_reduce_seconds
                self.calls += group.stats.all_reduce_calls
                self.commit_bytes += group.stats.commit_bytes
                self.commit_positions += group.stats.commit_positions
        for rid in ids:
            runner.release(rid)

    def summary(self) -> dict:
        steps = len(self.samples)
        return {
            "seconds": statistics.median(self.samples),
            "all_reduce_share": self.all_reduce_s / sum(self.samples),
            "all_reduce_calls": self.calls / steps,
            "commit_bytes_per_position": (
                self.commit_bytes / self.commit_positions if self.commit_positions else 0.0
            ),
        }


def side_by_side(tp2_model, tp1_dir: str, repeats: int) -> dict[str, dict[str, dict]]:
    """Rank 0 of the TP-2 group: per step kind, TP-2, TP-1 (one thread) and TP-1 (two
    threads) steps interleaved trial by trial, `repeats` timed trials each."""
    tp1_model = load_model(tp1_dir)
    results = {}
    for kind in SHAPES:
        configs = {
            "tp2": Timed(tp2_model, kind, 1),
            "tp1": Timed(tp1_model, kind, 1),
            "tp1_two_threads": Timed(tp1_model, kind, 2),
        }
        for trial in range(repeats + 1):  # the first is a warm-up
            for timed in configs.values():
                timed.trial(keep=trial > 0)
        results[kind.value] = {name: timed.summary() for name, timed in configs.items()}
    return results


def commit_only(model) -> dict:
    timed = Timed(model, StepKind.CACHE, 1)
    timed.trial(keep=True)
    return timed.summary()


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--quick", action="store_true", help="one timed trial: checks it runs")
    repeats = 1 if p.parse_args().quick else REPEATS
    with tempfile.TemporaryDirectory() as tmp:
        wide = write_tiny_checkpoint(Path(tmp) / "wide", "llada", **WIDE)
        large_vocab = write_tiny_checkpoint(Path(tmp) / "vocab", "llada", **LARGE_VOCAB)
        steps = run_on_group(2, wide, side_by_side, str(wide), repeats, threads=1, timeout_s=900)
        vocab_tp2 = run_on_group(2, large_vocab, commit_only, threads=1, timeout_s=300)

    def ms(kind: str) -> dict[str, float]:
        return {name: round(r["seconds"] * 1e3, 2) for name, r in steps[kind].items()}

    def ratio(kind: str, baseline: str = "tp1") -> float:
        return steps[kind]["tp2"]["seconds"] / steps[kind][baseline]["seconds"]

    recompute, cache = StepKind.RECOMPUTE.value, StepKind.CACHE.value
    requests, prompt = SHAPES[StepKind.RECOMPUTE]
    emit(
        "tp2_step_time_ratio",
        ratio(recompute),
        "x",
        baseline="tp1_one_thread",
        ratio=round(ratio(recompute), 4),
        kind=recompute,
        batch_tokens=requests * (prompt + BLOCK),
        cache_step_ratio=round(ratio(cache), 4),
        vs_tp1_two_threads=round(ratio(recompute, "tp1_two_threads"), 4),
        cache_step_vs_tp1_two_threads=round(ratio(cache, "tp1_two_threads"), 4),
        ms={recompute: ms(recompute), cache: ms(cache)},
        model={k: WIDE[k] for k in ("d_model", "n_layers", "mlp_hidden_size", "vocab_size")},
    )
    tp2 = {kind: steps[kind]["tp2"] for kind in steps}
    emit(
        "tp2_allreduce_share",
        tp2[recompute]["all_reduce_share"],
        "fraction",
        baseline="tp2_step_time",
        kind=recompute,
        cache_step=round(tp2[cache]["all_reduce_share"], 4),
        all_reduces_per_step=tp2[recompute]["all_reduce_calls"],
    )
    by_vocab = {
        WIDE["vocab_size"]: tp2[cache]["commit_bytes_per_position"],
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
