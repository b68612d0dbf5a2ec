"""GPU readiness: the Triton kernels and the step runner on CUDA at real shapes.

1. Kernels against their torch references at LLaDA-8B's shapes: logits of a bfloat16
   hidden state (4096) through a 126 464-token head, batch 1-64 x block 32 — the fused
   commit and the vocabulary partials — and the KV scatter into a token-major pool.
2. The step runner on a random model with LLaDA-8B's layer shapes (2 layers) in every
   cache mode, on CUDA against the same model on the CPU (float32 on both, TF32 off, so
   the committed tokens must agree), and in bfloat16 (agreement reported, not required).
3. A latency profile of that runner on CUDA in bfloat16: step milliseconds per kind and
   batch, and whether the kernels compiled once (no recompilation as batch shapes change).
4. `benches/runtime.py --device cuda`: the runtime against the plain and dual-cache
   reference loops, and batch 8 against batch 1, on CUDA (its lines carry `"device":
   "cuda"`).

Runs only where CUDA is present (it prints one line saying so and exits 0 elsewhere).
Prints one JSON object per line.
"""

from __future__ import annotations

import argparse
import copy
import importlib.util
import json
import time
from pathlib import Path

import torch

from dilaserve.kernels import (
    confidence_commit_reference,
    confidence_commit_triton,
    partial_ids,
    scatter_kv_reference,
    scatter_kv_triton,
    vocab_partials_reference,
    vocab_partials_triton,
)
from dilaserve.models import LLADA, DiffusionLM
from dilaserve.models.testing import randomize, tiny_config
from dilaserve.protocol import RequestState, StepEntry
from dilaserve.worker.runner import StepRunner

VOCAB = 126_464
HIDDEN = 4096
BLOCK = 32
BATCHES = (1, 8, 32, 64)
#: LLaDA-8B's layer shapes, two layers of them.
LLADA_8B = {
    "d_model": HIDDEN,
    "n_heads": 32,
    "n_kv_heads": 32,
    "mlp_hidden_size": 12288,
    "n_layers": 2,
    "vocab_size": VOCAB,
    "embedding_size": VOCAB,
    "mask_token_id": 126_336,
    "eos_token_id": 126_081,
    "pad_token_id": 126_081,
    "max_sequence_length": 4096,
}


def emit(name: str, value: float, unit: str, **extra) -> None:
    print(json.dumps({"name": name, "value": round(value, 6), "unit": unit, **extra}), flush=True)


# --- 1. kernels -----------------------------------------------------------------------------


def check_kernels(
    device: torch.device,
    batches: tuple[int, ...] = BATCHES,
    vocab: int = VOCAB,
    hidden: int = HIDDEN,
    kv_heads: int = 32,
    head_dim: int = 128,
) -> None:
    """Kernel against reference at these shapes; one JSON line per comparison."""
    g = torch.Generator(device=device).manual_seed(0)
    head = (
        torch.randn(hidden, vocab, generator=g, device=device, dtype=torch.bfloat16) / hidden**0.5
    )
    for b in batches:
        states = torch.randn(b, BLOCK, hidden, generator=g, device=device, dtype=torch.bfloat16)
        logits = (states * 4) @ head
        candidate = torch.rand(b, BLOCK, generator=g, device=device) < 0.7
        tau = torch.rand(b, generator=g, device=device)
        ids = torch.full((b, BLOCK), -7, dtype=torch.long, device=device)
        got_ids, want_ids = ids.clone(), ids.clone()
        got = confidence_commit_triton(logits, candidate, tau, got_ids)
        want = confidence_commit_reference(logits, candidate, tau, want_ids)
        live = candidate
        emit(
            "kernel_commit_mismatches",
            float((got.committed != want.committed).sum() + (got_ids != want_ids).sum()),
            "positions",
            batch=b,
            vocab=vocab,
            dtype="bfloat16",
        )
        emit(
            "kernel_commit_confidence_max_abs_err",
            float((got.confidence[live] - want.confidence[live]).abs().max()),
            "prob",
            batch=b,
        )
        partials = vocab_partials_triton(logits, 0)
        reference = vocab_partials_reference(logits, 0)
        emit(
            "kernel_partials_max_rel_err",
            float(
                (
                    (partials[..., :2] - reference[..., :2]).abs()
                    / reference[..., :2].abs().clamp(min=1e-6)
                ).max()
            ),
            "x",
            batch=b,
            argmax_mismatches=int((partial_ids(partials) != partial_ids(reference)).sum()),
        )
    rows = max(batches) * BLOCK
    pool = torch.zeros(10 * rows, kv_heads, head_dim, dtype=torch.bfloat16, device=device)
    slots = torch.randperm(pool.shape[0], generator=g, device=device)[:rows]
    new = torch.randn(rows, kv_heads, head_dim, generator=g, device=device, dtype=torch.bfloat16)
    got_pool, want_pool = pool.clone(), pool.clone()
    scatter_kv_triton(got_pool, slots, new)
    scatter_kv_reference(want_pool, slots, new)
    emit("kernel_scatter_mismatches", float((got_pool != want_pool).sum()), "elements")


# --- 2. the runner on CUDA against the CPU ---------------------------------------------------


def build_model(overrides: dict, seed: int = 0) -> DiffusionLM:
    raw = {**tiny_config("llada"), **overrides}
    model = DiffusionLM(LLADA.parse(raw, Path("config.json")))
    randomize(model, seed)
    return model.eval()


def decode_steps(
    runner: StepRunner, prompts: list[list[int]], *, gen_length: int, steps: int, tau: float
) -> list[list[int]]:
    """Runs `steps` steps of `prompts` together; each step's committed tokens per request."""
    mask = runner.config.mask_token_id
    for i, p in enumerate(prompts):
        runner.add(RequestState.new(i, p, gen_length, block_length=BLOCK, mask_token_id=mask))
    trace = []
    try:
        active = list(range(len(prompts)))
        for _ in range(steps):
            if not active:
                break
            report = runner.step([StepEntry(r, tau, runner.next_kind(r)) for r in active])
            trace += [o.committed_positions + o.committed_tokens for o in report.outputs]
            active = [o.request_id for o in report.outputs if not o.done]
    finally:
        for i in range(len(prompts)):
            if i in runner:
                runner.release(i)
    return trace


def compare_runners(
    model: DiffusionLM,
    device: torch.device,
    *,
    prompts: list[list[int]],
    gen_length: int = 2 * BLOCK,
    steps: int = 6,
    tau: float = 0.9,
) -> dict[str, float]:
    """Share of step commits of copies of the CPU float32 `model` on `device` (float32,
    then bfloat16) equal to the CPU's own, per cache mode."""
    torch.backends.cuda.matmul.allow_tf32 = False
    torch.backends.cudnn.allow_tf32 = False
    copies = {
        dtype: copy.deepcopy(model).to(device=device, dtype=getattr(torch, dtype))
        for dtype in ("float32", "bfloat16")
    }
    seq = max(len(p) for p in prompts) + gen_length
    agreement = {}
    for cache in ("none", "prefix", "dual"):
        runs = {
            dtype: decode_steps(
                StepRunner(m, cache=cache, max_requests=len(prompts), max_seq_len=seq),
                prompts,
                gen_length=gen_length,
                steps=steps,
                tau=tau,
            )
            for dtype, m in (("cpu", model), *copies.items())
        }
        want = runs.pop("cpu")
        for dtype, got in runs.items():
            same = sum(a == b for a, b in zip(got, want, strict=True)) / len(want)
            agreement[f"{cache}_{dtype}"] = same
    return agreement


# --- 3. latency profile ----------------------------------------------------------------------


def profile_steps(model: DiffusionLM, *, prompt: int = 224, repeats: int = 5) -> None:
    """Milliseconds of a recompute and a cache step (dual) and a no-cache step per batch."""
    seq = prompt + BLOCK
    for cache in ("none", "dual"):
        runner = StepRunner(model, cache=cache, max_requests=max(BATCHES), max_seq_len=seq)
        runner.warm_up()
        for b in BATCHES:
            mask = runner.config.mask_token_id
            g = torch.Generator().manual_seed(b)
            for i in range(b):
                ids = torch.randint(0, 126_000, (prompt,), generator=g).tolist()
                runner.add(RequestState.new(i, ids, BLOCK, block_length=BLOCK, mask_token_id=mask))
            kinds: dict[str, list[float]] = {}
            for _ in range(repeats):
                for _ in range(2 if cache == "dual" else 1):
                    entries = [StepEntry(i, 1.0, runner.next_kind(i)) for i in range(b)]
                    torch.cuda.synchronize()
                    start = time.perf_counter()
                    runner.step(entries)
                    torch.cuda.synchronize()
                    kinds.setdefault(entries[0].kind.value, []).append(time.perf_counter() - start)
                for i in range(b):  # start the block again: a fresh state, same shapes
                    runner.release(i)
                    ids = torch.randint(0, 126_000, (prompt,), generator=g).tolist()
                    runner.add(
                        RequestState.new(i, ids, BLOCK, block_length=BLOCK, mask_token_id=mask)
                    )
            for kind, times in kinds.items():
                times.sort()
                emit(
                    f"gpu_step_ms_{kind}",
                    1e3 * times[len(times) // 2],
                    "ms",
                    batch=b,
                    tokens=b * (BLOCK if kind == "cache" else seq),
                    model="random LLaDA-8B shapes, 2 layers, bfloat16",
                )
            for i in range(b):
                runner.release(i)
    emit("kernel_compiled_variants", float(compiled_variants()), "kernels", baseline="one each")


def compiled_variants() -> int:
    """Compiled Triton kernels of the commit across every batch shape run so far (Triton
    keeps one per specialisation; `do_not_specialize` keeps that at one per kernel)."""
    from dilaserve.kernels import unmask

    total = 0
    for kernel in (unmask._argmax_confidence_kernel, unmask._threshold_commit_kernel):
        caches = getattr(kernel, "device_caches", None) or getattr(kernel, "cache", {})
        for cache in caches.values():
            total += len(cache[0] if isinstance(cache, tuple) else cache)
    return total


# --- 4. the runtime bench on CUDA ------------------------------------------------------------


def runtime_bench(device: torch.device, quick: bool) -> None:
    """Runs `benches/runtime.py` (beside this file) on `device`."""
    spec = importlib.util.spec_from_file_location(
        "runtime_bench", Path(__file__).with_name("runtime.py")
    )
    module = importlib.util.module_from_spec(spec)  # type: ignore[arg-type]
    spec.loader.exec_module(module)  # type: ignore[union-attr]
    module.main(["--device", device.type, *(["--quick"] if quick else [])])


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--skip-cpu", action="store_true", help="no CPU comparison (faster)")
    p.add_argument("--quick", action="store_true", help="no CPU comparison, a short runtime bench")
    args = p.parse_args(argv)
    if not torch.cuda.is_available():
        print(json.dumps({"name": "gpu_check", "skipped": "no CUDA device"}), flush=True)
        return 0
    device = torch.device("cuda")
    emit("gpu_check_device", 1.0, "device", device=torch.cuda.get_device_name(device))
    with torch.inference_mode():
        check_kernels(device)
        model = build_model(LLADA_8B)
        if not (args.skip_cpu or args.quick):
            g = torch.Generator().manual_seed(3)
            prompts = [torch.randint(0, 126_000, (n,), generator=g).tolist() for n in (40, 23)]
            for mode, share in compare_runners(model, device, prompts=prompts).items():
                emit("runner_cuda_vs_cpu_agreement", share, "share", mode=mode)
        profile_steps(model.to(device=device, dtype=torch.bfloat16))
    runtime_bench(device, args.quick)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
