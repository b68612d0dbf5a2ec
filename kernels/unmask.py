"""Confidence-thresholded unmasking for one denoising step (DESIGN §1).

For every candidate position (still masked, inside the active block): x0 = argmax of the
logits (ties -> lowest vocabulary id) and its softmax probability in fp32. A row commits every
candidate with confidence >= its own tau; a row with candidates but no commit takes its single
most confident candidate (ties -> lowest position). Committed ids are written in place.

The Triton path never materialises the softmax: one program per position streams the
vocabulary in tiles with an online max / rescaled sum / argmax, and a second, per-row program
applies tau and the fallback and writes the ids. The confidence statistics the predictor
needs are computed on the host from the `[b, m]` confidences the step reads back anyway
(`worker.step_stats`), not here: a dozen tiny device ops per step would cost more than
the commit itself.

Tensor parallelism splits the vocabulary over the ranks, and full logits never leave their
rank: each rank reduces its vocabulary shard to the same three numbers per position that the
online softmax keeps (max, argmax, sum of exp(x - max)) — `vocab_partials` — and only those
12 bytes per position are exchanged; `combine_vocab_partials` merges them into the argmax and
confidence of the whole vocabulary, and `threshold_commit` applies τ and the fallback exactly
as `confidence_commit` does.
"""

from typing import NamedTuple

import torch

from .backend import require, require_triton, tl, triton, use_triton

LOGIT_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
# Narrowest row tile of the threshold kernel: every block of up to 32 positions (the usual
# block length) shares one compiled variant, whatever its count of masked positions.
MIN_BLOCK_M = 32
# Widest vocabulary tile: large enough to stream 152k-entry rows in ~75 iterations, small
# enough to keep the three running fp32 vectors in registers.
MAX_BLOCK_V = 2048


class CommitResult(NamedTuple):
    """Outcome of one step's commit for a batch of b rows with m positions each."""

    committed: torch.Tensor  # [b, m] bool
    counts: torch.Tensor  # [b] int64: committed positions per row
    x0: torch.Tensor  # [b, m] int64: argmax id, -1 where not a candidate
    confidence: torch.Tensor  # [b, m] fp32: softmax prob of x0, -inf where not a candidate


def _check_logit_tensor(logits: torch.Tensor, *, whole_vocab: bool) -> tuple[int, int, int]:
    """`[b, m, vocab]` of float logits; a vocabulary shard (not `whole_vocab`) may be empty."""
    require(
        logits.dim() == 3, lambda: f"logits must be [b, m, vocab], got shape {tuple(logits.shape)}"
    )
    b, m, vocab = logits.shape
    require(
        b > 0 and m > 0 and (vocab > 0 or not whole_vocab),
        lambda: f"logits has an empty dimension: {tuple(logits.shape)}",
    )
    require(
        logits.dtype in LOGIT_DTYPES,
        lambda: f"logits must be fp32, fp16 or bf16, got {logits.dtype}",
    )
    return b, m, vocab


def _check_candidate(b: int, m: int, candidate: torch.Tensor) -> None:
    require(
        candidate.shape == (b, m) and candidate.dtype == torch.bool,
        lambda: (
            f"candidate must be bool [{b}, {m}], got {candidate.dtype} {tuple(candidate.shape)}"
        ),
    )


def _check_logits(logits: torch.Tensor, candidate: torch.Tensor) -> None:
    b, m, _ = _check_logit_tensor(logits, whole_vocab=True)
    _check_candidate(b, m, candidate)
    require(
        candidate.device == logits.device,
        lambda: f"candidate is on {candidate.device}, logits on {logits.device}",
    )


def _check_inputs(
    logits: torch.Tensor, candidate: torch.Tensor, tau: torch.Tensor, ids: torch.Tensor
) -> None:
    b, m, _ = _check_logit_tensor(logits, whole_vocab=True)
    _check_commit_args(b, m, candidate, tau, ids, logits)


def _check_commit_args(
    b: int,
    m: int,
    candidate: torch.Tensor,
    tau: torch.Tensor,
    ids: torch.Tensor,
    *scores: torch.Tensor,
) -> None:
    _check_candidate(b, m, candidate)
    require(
        tau.shape == (b,) and tau.dtype == torch.float32,
        lambda: f"tau must be float32 [{b}], got {tau.dtype} {tuple(tau.shape)}",
    )
    require(
        ids.shape == (b, m) and ids.dtype == torch.int64,
        lambda: f"ids must be int64 [{b}, {m}], got {ids.dtype} {tuple(ids.shape)}",
    )
    devices = {t.device for t in (*scores, candidate, tau, ids)}
    require(
        len(devices) == 1,
        lambda: f"all tensors must be on one device, got {sorted(map(str, devices))}",
    )


def argmax_confidence_reference(
    logits: torch.Tensor, candidate: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Torch reference of `argmax_confidence` (any device)."""
    _check_logits(logits, candidate)
    return _argmax_confidence(logits, candidate)


def _argmax_confidence(
    logits: torch.Tensor, candidate: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    scores = logits.float()
    best = scores.argmax(dim=-1)
    top = scores.gather(-1, best[..., None]).squeeze(-1)
    confidence = torch.exp(top - torch.logsumexp(scores, dim=-1))
    return torch.where(candidate, best, -1), torch.where(candidate, confidence, -torch.inf)


def confidence_commit_reference(
    logits: torch.Tensor, candidate: torch.Tensor, tau: torch.Tensor, ids: torch.Tensor
) -> CommitResult:
    """Torch reference of the commit rule (any device); `ids` is updated in place."""
    _check_inputs(logits, candidate, tau, ids)
    best, confidence = _argmax_confidence(logits, candidate)
    return threshold_commit_reference(best, confidence, candidate, tau, ids)


def _check_scores(
    x0: torch.Tensor,
    confidence: torch.Tensor,
    candidate: torch.Tensor,
    tau: torch.Tensor,
    ids: torch.Tensor,
) -> None:
    require(x0.dim() == 2, lambda: f"x0 must be [b, m], got shape {tuple(x0.shape)}")
    b, m = x0.shape
    require(b > 0 and m > 0, lambda: f"x0 has an empty dimension: {tuple(x0.shape)}")
    require(x0.dtype == torch.int64, lambda: f"x0 must be int64, got {x0.dtype}")
    require(
        confidence.shape == (b, m) and confidence.dtype == torch.float32,
        lambda: (
            f"confidence must be float32 [{b}, {m}], "
            f"got {confidence.dtype} {tuple(confidence.shape)}"
        ),
    )
    _check_commit_args(b, m, candidate, tau, ids, x0, confidence)


def threshold_commit_reference(
    x0: torch.Tensor,
    confidence: torch.Tensor,
    candidate: torch.Tensor,
    tau: torch.Tensor,
    ids: torch.Tensor,
) -> CommitResult:
    """The commit rule on per-position argmax ids `x0` and confidences (any device): every
    candidate with confidence >= its row's τ, else the row's most confident candidate; `ids`
    is updated in place."""
    _check_scores(x0, confidence, candidate, tau, ids)
    confidence = torch.where(candidate, confidence, -torch.inf)
    x0 = torch.where(candidate, x0, -1)
    committed = candidate & (confidence >= tau[:, None])
    fallback = candidate.any(dim=1) & ~committed.any(dim=1)
    positions = torch.arange(candidate.shape[1], device=candidate.device)
    committed |= fallback[:, None] & (positions == confidence.argmax(dim=1)[:, None])
    ids.copy_(torch.where(committed, x0, ids))
    return CommitResult(committed, committed.sum(dim=1), x0, confidence)


# --- vocabulary-parallel commit --------------------------------------------------------------

#: Numbers one rank contributes per position: fp32 max, fp32 sum of exp(x - max), and the
#: argmax token id as int32 bits in the third fp32 slot.
PARTIAL_FIELDS = 3
#: Bytes one rank contributes per position, whatever the vocabulary.
PARTIAL_BYTES = 4 * PARTIAL_FIELDS
#: Argmax of a shard that holds no scorable token (only padding rows, or only the mask token).
NO_TOKEN = torch.iinfo(torch.int32).max


def _check_shard(logits: torch.Tensor, vocab_offset: int) -> None:
    _, _, vocab = _check_logit_tensor(logits, whole_vocab=False)
    require(
        vocab_offset >= 0 and vocab_offset + vocab < NO_TOKEN,
        lambda: f"vocab_offset {vocab_offset} + shard width {vocab} must lie in [0, {NO_TOKEN})",
    )


def partial_ids(partials: torch.Tensor) -> torch.Tensor:
    """The int32 argmax ids stored in a `[..., 3]` partials tensor (a view)."""
    return partials[..., 2].view(torch.int32)


def _empty_partials(b: int, m: int, device: torch.device) -> torch.Tensor:
    partials = torch.zeros((b, m, PARTIAL_FIELDS), dtype=torch.float32, device=device)
    partials[..., 0] = -torch.inf
    partial_ids(partials).fill_(NO_TOKEN)
    return partials


def vocab_partials_reference(logits: torch.Tensor, vocab_offset: int) -> torch.Tensor:
    """`[b, m, 3]` fp32 (max, sum of exp(x - max), argmax id) of a vocabulary shard whose
    first column is token `vocab_offset`; ties go to the lowest id. A shard with no finite
    logit gives (-inf, 0, NO_TOKEN)."""
    _check_shard(logits, vocab_offset)
    b, m, vocab = logits.shape
    partials = _empty_partials(b, m, logits.device)
    if vocab == 0:
        return partials
    scores = logits.float()
    best = scores.argmax(dim=-1)
    top = scores.gather(-1, best[..., None]).squeeze(-1)
    finite = top > -torch.inf
    shift = torch.where(finite, top, 0.0)
    partials[..., 0] = top
    partials[..., 1] = torch.exp(scores - shift[..., None]).sum(dim=-1)
    ids = torch.where(finite, best + vocab_offset, NO_TOKEN)
    partial_ids(partials).copy_(ids.to(torch.int32))
    return partials


def combine_vocab_partials(partials: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Merges `[ranks, b, m, 3]` shard partials into the whole vocabulary's argmax `x0`
    `[b, m]` int64 (ties -> lowest id, so lowest rank) and confidence `[b, m]` fp32:
    softmax(x)[argmax] = 1 / sum over shards of sum_r * exp(max_r - max)."""
    require(
        partials.dim() == 4 and partials.shape[-1] == PARTIAL_FIELDS,
        lambda: f"partials must be [ranks, b, m, {PARTIAL_FIELDS}], got {tuple(partials.shape)}",
    )
    require(
        partials.dtype == torch.float32, lambda: f"partials must be float32, got {partials.dtype}"
    )
    tops, sums, ids = partials[..., 0], partials[..., 1], partial_ids(partials)
    top = tops.max(dim=0).values
    shard_live = tops > -torch.inf
    # A live shard means a finite overall max, so the discarded branch is the only NaN.
    scale = torch.where(shard_live, torch.exp(tops - top), 0.0)
    total = (sums * scale).sum(dim=0)
    winners = torch.where(shard_live & (tops == top), ids, NO_TOKEN)
    x0 = winners.min(dim=0).values.to(torch.int64)
    confidence = torch.where(total > 0, 1.0 / total, 0.0)
    return x0, confidence


if triton is not None:

    @triton.jit
    def _online_softmax_argmax(base, vocab, end, stride_lv, BLOCK_V: tl.constexpr):
        """Streams `[0, end)` of one position's logits in tiles; per lane: running max, sum
        of exp(x - running max), first id reaching the max."""
        lanes = tl.arange(0, BLOCK_V)
        # Per lane: running max, sum of exp(x - running max), first id reaching the max.
        run_max = tl.full([BLOCK_V], float("-inf"), tl.float32)
        run_sum = tl.zeros([BLOCK_V], tl.float32)
        run_idx = tl.zeros([BLOCK_V], tl.int32)
        for start in range(0, end, BLOCK_V):
            idx = start + lanes
            x = tl.load(
                base + idx.to(tl.int64) * stride_lv, mask=idx < vocab, other=float("-inf")
            ).to(tl.float32)
            new_max = tl.maximum(run_max, x)
            # A lane that has seen only -inf keeps a zero sum instead of exp(-inf + inf) = NaN.
            shift = tl.where(new_max == float("-inf"), 0.0, new_max)
            run_sum = run_sum * tl.exp(run_max - shift) + tl.exp(x - shift)
            # Strictly greater: an equal value in a later tile has a higher id and loses.
            run_idx = tl.where(x > run_max, idx, run_idx)
            run_max = new_max
        return run_max, run_sum, run_idx

    @triton.jit(do_not_specialize=["m", "vocab", "stride_lb", "stride_lm"])
    def _argmax_confidence_kernel(
        logits_ptr,
        candidate_ptr,
        x0_ptr,
        confidence_ptr,
        m,
        vocab,
        stride_lb,
        stride_lm,
        stride_lv,
        BLOCK_V: tl.constexpr,
    ):
        """One program per (row, position): online softmax + argmax over vocabulary tiles."""
        pid = tl.program_id(0)
        row = pid // m
        col = pid % m
        is_candidate = tl.load(candidate_ptr + pid) != 0
        base = logits_ptr + row.to(tl.int64) * stride_lb + col.to(tl.int64) * stride_lm
        # Non-candidates stream nothing.
        end = tl.where(is_candidate, vocab, 0)
        run_max, run_sum, run_idx = _online_softmax_argmax(base, vocab, end, stride_lv, BLOCK_V)
        # A non-candidate streamed nothing: a zero max and unit sum keep it free of NaN and inf.
        top = tl.where(is_candidate, tl.max(run_max, axis=0), 0.0)
        total = tl.where(is_candidate, tl.sum(run_sum * tl.exp(run_max - top), axis=0), 1.0)
        best = tl.min(tl.where(run_max == top, run_idx, vocab), axis=0)
        # softmax(x)[argmax] = exp(top - logsumexp) = 1 / sum(exp(x - top)).
        tl.store(x0_ptr + pid, tl.where(is_candidate, best.to(tl.int64), -1))
        tl.store(confidence_ptr + pid, tl.where(is_candidate, 1.0 / total, float("-inf")))

    @triton.jit(do_not_specialize=["m", "stride_ib", "stride_im"])
    def _threshold_commit_kernel(
        confidence_ptr,
        x0_ptr,
        candidate_ptr,
        tau_ptr,
        ids_ptr,
        committed_ptr,
        counts_ptr,
        m,
        stride_ib,
        stride_im,
        BLOCK_M: tl.constexpr,
    ):
        """One program per row: tau, at-least-one fallback, in-place id write, count."""
        row = tl.program_id(0)
        cols = tl.arange(0, BLOCK_M)
        inside = cols < m
        flat = row.to(tl.int64) * m + cols
        is_candidate = tl.load(candidate_ptr + flat, mask=inside, other=0) != 0
        confidence = tl.load(confidence_ptr + flat, mask=inside, other=float("-inf"))
        commit = is_candidate & (confidence >= tl.load(tau_ptr + row))
        n_commit = tl.sum(commit.to(tl.int32), axis=0)
        n_candidate = tl.sum(is_candidate.to(tl.int32), axis=0)
        top = tl.max(tl.where(is_candidate, confidence, float("-inf")), axis=0)
        first_top = tl.min(tl.where(is_candidate & (confidence == top), cols, BLOCK_M), axis=0)
        # Fallback column, or BLOCK_M (no column) when the row needs none.
        fallback = tl.where((n_commit == 0) & (n_candidate > 0), first_top, BLOCK_M)
        commit = commit | (cols == fallback)
        x0 = tl.load(x0_ptr + flat, mask=inside, other=-1)
        id_offsets = row.to(tl.int64) * stride_ib + cols.to(tl.int64) * stride_im
        tl.store(ids_ptr + id_offsets, x0, mask=commit)
        tl.store(committed_ptr + flat, commit.to(tl.int8), mask=inside)
        tl.store(counts_ptr + row, tl.sum(commit.to(tl.int64), axis=0))

    @triton.jit(do_not_specialize=["m", "vocab", "vocab_offset", "stride_lb", "stride_lm"])
    def _vocab_partials_kernel(
        logits_ptr,
        top_ptr,
        ids_ptr,
        m,
        vocab,
        vocab_offset,
        stride_lb,
        stride_lm,
        stride_lv,
        NO_ID: tl.constexpr,
        BLOCK_V: tl.constexpr,
    ):
        """One program per (row, position) of a vocabulary shard: the same online reduction
        as `_argmax_confidence_kernel`, stopped before the division, ids made global."""
        pid = tl.program_id(0)
        row = pid // m
        col = pid % m
        base = logits_ptr + row.to(tl.int64) * stride_lb + col.to(tl.int64) * stride_lm
        run_max, run_sum, run_idx = _online_softmax_argmax(base, vocab, vocab, stride_lv, BLOCK_V)
        top = tl.max(run_max, axis=0)
        live = top > float("-inf")
        shift = tl.where(live, top, 0.0)
        total = tl.sum(run_sum * tl.exp(run_max - shift), axis=0)
        best = tl.min(tl.where(run_max == top, run_idx, vocab), axis=0)
        record = pid.to(tl.int64) * 3
        tl.store(top_ptr + record, top)
        tl.store(top_ptr + record + 1, total)
        tl.store(ids_ptr + record + 2, tl.where(live, best + vocab_offset, NO_ID).to(tl.int32))


def commit_width(m: int) -> int:
    """The threshold kernel's row tile for `m` positions."""
    return max(triton.next_power_of_2(m), MIN_BLOCK_M)


def confidence_commit_triton(
    logits: torch.Tensor,
    candidate: torch.Tensor,
    tau: torch.Tensor,
    ids: torch.Tensor,
    *,
    block_v: int | None = None,
) -> CommitResult:
    """Triton version of `confidence_commit_reference`. `block_v` (a power of two) is the
    vocabulary tile width; by default the vocabulary rounded up to a power of two, at most
    MAX_BLOCK_V."""
    _check_inputs(logits, candidate, tau, ids)
    x0, confidence = _argmax_confidence_triton(logits, candidate, block_v)
    b, m = x0.shape
    flags = candidate.contiguous().view(torch.int8)
    committed = torch.empty((b, m), dtype=torch.bool, device=logits.device)
    counts = torch.empty(b, dtype=torch.int64, device=logits.device)
    _threshold_commit_kernel[(b,)](
        confidence,
        x0,
        flags,
        tau.contiguous(),
        ids,
        committed.view(torch.int8),
        counts,
        m,
        *ids.stride(),
        BLOCK_M=commit_width(m),
    )
    return CommitResult(committed, counts, x0, confidence)


def argmax_confidence_triton(
    logits: torch.Tensor, candidate: torch.Tensor, *, block_v: int | None = None
) -> tuple[torch.Tensor, torch.Tensor]:
    """Triton version of `argmax_confidence_reference`: one program per position streams
    the vocabulary in tiles of `block_v` (a power of two; by default the vocabulary rounded
    up to one, at most MAX_BLOCK_V)."""
    _check_logits(logits, candidate)
    return _argmax_confidence_triton(logits, candidate, block_v)


def _argmax_confidence_triton(
    logits: torch.Tensor, candidate: torch.Tensor, block_v: int | None
) -> tuple[torch.Tensor, torch.Tensor]:
    require_triton(logits)
    b, m, vocab = logits.shape
    if block_v is None:
        block_v = min(triton.next_power_of_2(vocab), MAX_BLOCK_V)
    require(
        block_v > 0 and block_v & (block_v - 1) == 0,
        lambda: f"block_v must be a power of two, got {block_v}",
    )
    flags = candidate.contiguous().view(torch.int8)
    x0 = torch.empty((b, m), dtype=torch.int64, device=logits.device)
    confidence = torch.empty((b, m), dtype=torch.float32, device=logits.device)
    _argmax_confidence_kernel[(b * m,)](
        logits, flags, x0, confidence, m, vocab, *logits.stride(), BLOCK_V=block_v
    )
    return x0, confidence


def argmax_confidence(
    logits: torch.Tensor, candidate: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Each candidate position's argmax id (lowest on ties) and its softmax probability in
    fp32, -1 and -inf elsewhere: the scores `confidence_commit` commits by, for a step that
    scores some of its rows otherwise. Triton on CUDA, torch elsewhere."""
    if use_triton(logits):
        return argmax_confidence_triton(logits, candidate)
    return argmax_confidence_reference(logits, candidate)


def confidence_commit(
    logits: torch.Tensor, candidate: torch.Tensor, tau: torch.Tensor, ids: torch.Tensor
) -> CommitResult:
    """Commits this step's tokens (`ids` updated in place): Triton on CUDA, torch elsewhere."""
    if use_triton(logits):
        return confidence_commit_triton(logits, candidate, tau, ids)
    return confidence_commit_reference(logits, candidate, tau, ids)


def threshold_commit_triton(
    x0: torch.Tensor,
    confidence: torch.Tensor,
    candidate: torch.Tensor,
    tau: torch.Tensor,
    ids: torch.Tensor,
) -> CommitResult:
    """Triton version of `threshold_commit_reference` (the second half of the fused commit)."""
    _check_scores(x0, confidence, candidate, tau, ids)
    require_triton(x0)
    b, m = x0.shape
    flags = candidate.contiguous().view(torch.int8)
    x0 = torch.where(candidate, x0, -1).contiguous()
    confidence = torch.where(candidate, confidence, -torch.inf).contiguous()
    committed = torch.empty((b, m), dtype=torch.bool, device=x0.device)
    counts = torch.empty(b, dtype=torch.int64, device=x0.device)
    _threshold_commit_kernel[(b,)](
        confidence,
        x0,
        flags,
        tau.contiguous(),
        ids,
        committed.view(torch.int8),
        counts,
        m,
        *ids.stride(),
        BLOCK_M=commit_width(m),
    )
    return CommitResult(committed, counts, x0, confidence)


def threshold_commit(
    x0: torch.Tensor,
    confidence: torch.Tensor,
    candidate: torch.Tensor,
    tau: torch.Tensor,
    ids: torch.Tensor,
) -> CommitResult:
    """Applies τ and the fallback to given argmax ids and confidences (`ids` updated in
    place): Triton on CUDA, torch elsewhere."""
    if use_triton(x0):
        return threshold_commit_triton(x0, confidence, candidate, tau, ids)
    return threshold_commit_reference(x0, confidence, candidate, tau, ids)


def vocab_partials_triton(
    logits: torch.Tensor, vocab_offset: int, *, block_v: int | None = None
) -> torch.Tensor:
    """Triton version of `vocab_partials_reference`."""
    _check_shard(logits, vocab_offset)
    require_triton(logits)
    b, m, vocab = logits.shape
    partials = _empty_partials(b, m, logits.device)
    if vocab == 0:
        return partials
    if block_v is None:
        block_v = min(triton.next_power_of_2(vocab), MAX_BLOCK_V)
    require(
        block_v > 0 and block_v & (block_v - 1) == 0,
        lambda: f"block_v must be a power of two, got {block_v}",
    )
    _vocab_partials_kernel[(b * m,)](
        logits,
        partials,
        partials.view(torch.int32),
        m,
        vocab,
        vocab_offset,
        *logits.stride(),
        NO_ID=NO_TOKEN,
        BLOCK_V=block_v,
    )
    return partials


def vocab_partials(logits: torch.Tensor, vocab_offset: int) -> torch.Tensor:
    """A vocabulary shard's `[b, m, 3]` partials: Triton on CUDA, torch elsewhere."""
    if use_triton(logits):
        return vocab_partials_triton(logits, vocab_offset)
    return vocab_partials_reference(logits, vocab_offset)
