"""Triton kernels against their torch references, and the references against a direct
computation. Without a GPU the kernels run in the Triton interpreter (conftest), so shapes stay
small; on a GPU the same tests run the compiled kernels on CUDA tensors."""

import pytest
import torch

from dilaserve.kernels import (
    CommitResult,
    KernelInputError,
    TritonUnavailableError,
    argmax_confidence_reference,
    argmax_confidence_triton,
    confidence_commit,
    confidence_commit_reference,
    confidence_commit_triton,
    scatter_kv,
    scatter_kv_reference,
    scatter_kv_triton,
)

DEVICE = "cuda" if torch.cuda.is_available() else "cpu"
LOGIT_DTYPES = [torch.float32, torch.float16, torch.bfloat16]


def _gen(seed: int) -> torch.Generator:
    return torch.Generator().manual_seed(seed)


def _logits(b: int, m: int, vocab: int, dtype: torch.dtype, seed: int) -> torch.Tensor:
    scale = 4.0  # spread the confidences over (0, 1)
    return (torch.randn(b, m, vocab, generator=_gen(seed)) * scale).to(dtype).to(DEVICE)


def _candidates(b: int, m: int, seed: int, p: float = 0.7) -> torch.Tensor:
    return (torch.rand(b, m, generator=_gen(seed)) < p).to(DEVICE)


def _tau(*values: float) -> torch.Tensor:
    return torch.tensor(values, dtype=torch.float32, device=DEVICE)


def _ids(b: int, m: int) -> torch.Tensor:
    return torch.full((b, m), 999_999, dtype=torch.int64, device=DEVICE)


def direct_commit(
    logits: torch.Tensor, candidate: torch.Tensor, tau: torch.Tensor, ids: torch.Tensor
) -> CommitResult:
    """The rule written out position by position: softmax, max, threshold, fallback."""
    b, m, _ = logits.shape
    committed = torch.zeros(b, m, dtype=torch.bool)
    x0 = torch.full((b, m), -1, dtype=torch.int64)
    confidence = torch.full((b, m), -torch.inf)
    for i in range(b):
        for j in range(m):
            if candidate[i, j]:
                probs = torch.softmax(logits[i, j].float().cpu(), dim=0)
                top = probs.max()
                x0[i, j] = int((probs == top).nonzero()[0])
                confidence[i, j] = top
        cols = [j for j in range(m) if candidate[i, j]]
        for j in cols:
            committed[i, j] = bool(confidence[i, j] >= tau[i].item())
        if cols and not committed[i].any():
            best = max(confidence[i, j].item() for j in cols)
            committed[i, next(j for j in cols if confidence[i, j].item() == best)] = True
        for j in range(m):
            if committed[i, j]:
                ids[i, j] = int(x0[i, j])
    return CommitResult(committed, committed.sum(dim=1), x0, confidence)


def assert_results_match(got: CommitResult, want: CommitResult) -> None:
    assert torch.equal(got.committed.cpu(), want.committed.cpu())
    assert torch.equal(got.counts.cpu(), want.counts.cpu())
    assert torch.equal(got.x0.cpu(), want.x0.cpu())
    torch.testing.assert_close(got.confidence.cpu(), want.confidence.cpu(), rtol=1e-5, atol=1e-6)


def commit_both(
    logits: torch.Tensor,
    candidate: torch.Tensor,
    tau: torch.Tensor,
    ids: torch.Tensor,
    block_v: int | None = None,
) -> tuple[CommitResult, torch.Tensor]:
    """Runs kernel and reference on copies of `ids`, checks they agree; returns the kernel's
    result and ids."""
    ids_kernel, ids_ref = ids.clone(), ids.clone()
    got = confidence_commit_triton(logits, candidate, tau, ids_kernel, block_v=block_v)
    want = confidence_commit_reference(logits, candidate, tau, ids_ref)
    assert_results_match(got, want)
    assert torch.equal(ids_kernel, ids_ref)
    return got, ids_kernel


@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
def test_argmax_confidence_is_what_the_commit_commits_by(dtype: torch.dtype) -> None:
    logits = _logits(3, 5, 37, dtype, seed=21)
    candidate = _candidates(3, 5, seed=22)
    committed, _ = commit_both(logits, candidate, _tau(0.5, 0.9, 0.2), _ids(3, 5), 16)
    for x0, confidence in (
        argmax_confidence_triton(logits, candidate, block_v=16),
        argmax_confidence_reference(logits, candidate),
    ):
        assert torch.equal(x0.cpu(), committed.x0.cpu())
        torch.testing.assert_close(confidence.cpu(), committed.confidence.cpu())


# --- the reference against the rule written out ---------------------------------------------


@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
def test_reference_matches_direct_computation(dtype: torch.dtype) -> None:
    logits = _logits(4, 6, 29, dtype, seed=1)
    candidate = _candidates(4, 6, seed=2)
    candidate[3] = False
    tau = _tau(0.3, 0.9, 1.0, 0.5)
    ids_ref, ids_direct = _ids(4, 6), _ids(4, 6).cpu()
    got = confidence_commit_reference(logits, candidate, tau, ids_ref)
    want = direct_commit(logits, candidate, tau, ids_direct)
    assert_results_match(got, want)
    assert torch.equal(ids_ref.cpu(), ids_direct)


def test_reference_tie_rules_match_direct_computation() -> None:
    # Integer logits in bf16: many equal maxima and many equal confidences.
    logits = torch.randint(0, 3, (3, 8, 12), generator=_gen(3)).to(torch.bfloat16).to(DEVICE)
    candidate = _candidates(3, 8, seed=4)
    tau = _tau(1.0, 1.0, 0.6)
    ids_ref, ids_direct = _ids(3, 8), _ids(3, 8).cpu()
    assert_results_match(
        confidence_commit_reference(logits, candidate, tau, ids_ref),
        direct_commit(logits, candidate, tau, ids_direct),
    )
    assert torch.equal(ids_ref.cpu(), ids_direct)


# --- the fused Triton kernel against the reference ------------------------------------------


@pytest.mark.parametrize("dtype", LOGIT_DTYPES)
@pytest.mark.parametrize(("vocab", "block_v"), [(50, 16), (37, None), (8, 8)])
def test_kernel_matches_reference(dtype: torch.dtype, vocab: int, block_v: int | None) -> None:
    logits = _logits(3, 5, vocab, dtype, seed=vocab)
    candidate = _candidates(3, 5, seed=vocab + 1)
    got, ids = commit_both(logits, candidate, _tau(0.2, 0.6, 0.95), _ids(3, 5), block_v)
    assert (got.counts >= candidate.any(dim=1).long()).all()
    assert torch.equal(ids[got.committed], got.x0[got.committed])
    assert (ids[~got.committed] == 999_999).all()


def test_equal_logits_pick_lowest_id_across_and_within_tiles() -> None:
    vocab, block_v = 40, 16
    logits = torch.zeros(1, 5, vocab)
    logits[0, :4] = -1.0
    planted = [(7, 23), (9, 2), (30, 12), (35, 19)]  # same lane / same tile / mixed
    for j, tied in enumerate(planted):
        logits[0, j, list(tied)] = 3.0
    # position 4: every entry equal -> id 0
    logits = logits.to(DEVICE)
    got, _ = commit_both(
        logits, torch.ones(1, 5, dtype=torch.bool, device=DEVICE), _tau(0.0), _ids(1, 5), block_v
    )
    assert got.x0.cpu().tolist() == [[7, 2, 12, 19, 0]]


def test_ties_everywhere_in_bf16() -> None:
    logits = torch.randint(0, 3, (4, 8, 20), generator=_gen(5)).to(torch.bfloat16).to(DEVICE)
    commit_both(logits, _candidates(4, 8, seed=6), _tau(1.0, 0.3, 1.0, 0.0), _ids(4, 8), 8)


def test_fallback_takes_lowest_candidate_position_among_equal_confidences() -> None:
    row = torch.randn(24, generator=_gen(7))
    logits = row.expand(2, 6, 24).clone().to(DEVICE)  # every position equally confident
    candidate = torch.tensor(
        [[False, False, True, False, True, True], [False, True, True, True, True, True]],
        device=DEVICE,
    )
    got, ids = commit_both(logits, candidate, _tau(1.0, 1.0), _ids(2, 6), 16)
    assert got.committed.cpu().tolist() == [
        [False, False, True, False, False, False],
        [False, True, False, False, False, False],
    ]
    assert ids[0, 2] == ids[1, 1] == int(row.argmax())


def test_nothing_above_tau_commits_exactly_the_most_confident() -> None:
    logits = _logits(3, 7, 30, torch.float32, seed=8)
    candidate = _candidates(3, 7, seed=9, p=0.8)
    candidate[:, 0] = True
    got, _ = commit_both(logits, candidate, _tau(0.999, 1.0, 2.0), _ids(3, 7), 16)
    assert got.counts.cpu().tolist() == [1, 1, 1]
    assert torch.equal(got.committed.float().argmax(dim=1), got.confidence.argmax(dim=1))
    assert (got.confidence.max(dim=1).values < 0.999).all()


def test_rows_without_candidates_commit_nothing() -> None:
    logits = _logits(3, 4, 21, torch.float16, seed=10)
    candidate = torch.tensor([[False] * 4, [True, False, True, False], [False] * 4], device=DEVICE)
    got, ids = commit_both(logits, candidate, _tau(0.0, 0.5, 0.0), _ids(3, 4), 16)
    assert got.counts.cpu().tolist()[0::2] == [0, 0]
    for i in (0, 2):
        assert not got.committed[i].any()
        assert (ids[i] == 999_999).all()
        assert (got.x0[i] == -1).all()
        assert torch.isneginf(got.confidence[i]).all()


def test_tau_one_commits_one_token_unless_confidence_is_exactly_one() -> None:
    logits = _logits(3, 6, 33, torch.float32, seed=11)
    # Row 2: positions 1 and 4 are so sure that their softmax rounds to exactly 1.0.
    logits[2, 1, 5] = 200.0
    logits[2, 4, 17] = 200.0
    candidate = torch.ones(3, 6, dtype=torch.bool, device=DEVICE)
    got, ids = commit_both(logits, candidate, _tau(1.0, 1.0, 1.0), _ids(3, 6), 16)
    assert got.counts.cpu().tolist() == [1, 1, 2]
    assert got.confidence[2, 1] == 1.0 and got.confidence[2, 4] == 1.0
    assert got.committed[2].cpu().tolist() == [False, True, False, False, True, False]
    assert ids[2, 1] == 5 and ids[2, 4] == 17


def test_each_row_uses_its_own_tau() -> None:
    logits = _logits(1, 8, 26, torch.float32, seed=12).expand(4, 8, 26).contiguous()
    candidate = torch.ones(4, 8, dtype=torch.bool, device=DEVICE)
    tau = _tau(0.0, 0.3, 0.7, 1.0)
    got, _ = commit_both(logits, candidate, tau, _ids(4, 8), 16)
    assert got.counts[0] == 8 and got.counts[3] == 1
    for i in range(4):
        above = (got.confidence[i] >= tau[i]).sum()
        assert got.counts[i] == max(int(above), 1)


def test_large_vocabulary_streams_in_tiles() -> None:
    vocab = 152_064
    logits = _logits(1, 2, vocab, torch.bfloat16, seed=13)
    logits[0, 0, [100_000, 151_999]] = 30.0  # tie across far-apart tiles
    got, _ = commit_both(
        logits, torch.ones(1, 2, dtype=torch.bool, device=DEVICE), _tau(0.5), _ids(1, 2)
    )
    assert got.x0[0, 0] == 100_000


def test_strided_logits_and_ids_are_respected() -> None:
    wide = _logits(2, 10, 19, torch.float32, seed=14)
    logits = wide[:, ::2, :]  # non-contiguous position stride
    ids_storage = _ids(2, 10)
    ids = ids_storage[:, 1::2]  # writes must land in the view only
    candidate = _candidates(2, 5, seed=15)
    _, want = commit_both(logits, candidate, _tau(0.1, 0.9), ids.clone(), 16)
    confidence_commit_triton(logits, candidate, _tau(0.1, 0.9), ids, block_v=16)
    assert torch.equal(ids, want)
    assert (ids_storage[:, 0::2] == 999_999).all()


def test_commit_rejects_bad_inputs() -> None:
    logits = _logits(2, 3, 10, torch.float32, seed=16)
    candidate = torch.ones(2, 3, dtype=torch.bool, device=DEVICE)
    with pytest.raises(KernelInputError, match="tau"):
        confidence_commit(
            logits, candidate, torch.tensor([0.5, 0.5], dtype=torch.float64), _ids(2, 3)
        )
    with pytest.raises(KernelInputError, match="candidate"):
        confidence_commit(logits, candidate[:, :2], _tau(0.5, 0.5), _ids(2, 3))
    with pytest.raises(KernelInputError, match="logits"):
        confidence_commit(logits.long(), candidate, _tau(0.5, 0.5), _ids(2, 3))
    with pytest.raises(KernelInputError, match="block_v"):
        confidence_commit_triton(logits, candidate, _tau(0.5, 0.5), _ids(2, 3), block_v=12)


def test_triton_on_cpu_outside_the_interpreter_fails_clearly(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    monkeypatch.delenv("TRITON_INTERPRET", raising=False)
    logits = torch.zeros(1, 1, 4)
    with pytest.raises(TritonUnavailableError, match="CUDA"):
        confidence_commit_triton(
            logits,
            torch.ones(1, 1, dtype=torch.bool),
            _tau(0.5).cpu(),
            torch.zeros(1, 1, dtype=torch.long),
        )


def test_dispatcher_commits_like_the_reference() -> None:
    logits = _logits(2, 4, 17, torch.float16, seed=17)
    candidate = _candidates(2, 4, seed=18)
    ids, ids_ref = _ids(2, 4), _ids(2, 4)
    got = confidence_commit(logits, candidate, _tau(0.4, 1.0), ids)
    assert_results_match(
        got, confidence_commit_reference(logits, candidate, _tau(0.4, 1.0), ids_ref)
    )
    assert torch.equal(ids, ids_ref)


# --- KV reuse ---------------------------------------------------------------------------------


def _cache(tokens: int = 24, heads: int = 2, dim: int = 6, seed: int = 20) -> torch.Tensor:
    return torch.randn(tokens, heads, dim, generator=_gen(seed)).to(DEVICE)


def _scatter_inputs(
    dtype: torch.dtype = torch.float32, seed: int = 21
) -> tuple[torch.Tensor, torch.Tensor]:
    """slots [7] distinct pool rows; new [7, 2, 6]."""
    g = _gen(seed)
    slots = torch.randperm(24, generator=g)[:7]
    new = torch.randn(7, 2, 6, generator=g).to(dtype)
    return slots.to(DEVICE), new.to(DEVICE)


def test_scatter_reference_matches_direct_loop() -> None:
    cache = _cache()
    slots, new = _scatter_inputs()
    want = cache.clone()
    for t in range(7):
        want[slots[t]] = new[t]
    scatter_kv_reference(cache, slots, new)
    assert torch.equal(cache, want)


@pytest.mark.parametrize(
    ("cache_dtype", "new_dtype"),
    [
        (torch.float32, torch.float32),
        (torch.bfloat16, torch.float32),
        (torch.float16, torch.float16),
    ],
)
def test_scatter_kernel_matches_reference(cache_dtype: torch.dtype, new_dtype: torch.dtype) -> None:
    cache = _cache().to(cache_dtype)
    slots, new = _scatter_inputs(new_dtype)
    got, want = cache.clone(), cache.clone()
    scatter_kv_triton(got, slots, new)
    scatter_kv_reference(want, slots, new)
    assert torch.equal(got, want)
    untouched = torch.ones(24, dtype=torch.bool, device=DEVICE)
    untouched[slots] = False
    assert torch.equal(got[untouched], cache[untouched])


def test_scatter_kernel_reads_strided_new_and_int32_slots() -> None:
    cache = _cache(heads=3)
    slots, _ = _scatter_inputs()
    new = torch.randn(3, 7, 6, generator=_gen(5)).to(DEVICE).transpose(0, 1)  # [7, 3, 6] view
    got, want = cache.clone(), cache.clone()
    scatter_kv_triton(got, slots.int(), new)
    scatter_kv_reference(want, slots, new)
    assert torch.equal(got, want)


def test_scatter_kernel_skips_slots_outside_the_cache() -> None:
    cache = _cache()
    slots, new = _scatter_inputs()
    slots[0], slots[1] = -1, 24
    got = cache.clone()
    scatter_kv_triton(got, slots, new)
    want = cache.clone()
    scatter_kv_reference(want, slots[2:], new[2:])
    assert torch.equal(got, want)


def test_kv_dispatcher_matches_reference() -> None:
    cache = _cache()
    slots, new = _scatter_inputs()
    want = cache.clone()
    scatter_kv(cache, slots, new)
    scatter_kv_reference(want, slots, new)
    assert torch.equal(cache, want)


def test_kv_kernels_reject_bad_inputs() -> None:
    cache = _cache()
    slots, new = _scatter_inputs()
    with pytest.raises(KernelInputError, match="heads"):
        scatter_kv(cache, slots, new[:, :1])
    with pytest.raises(KernelInputError, match="slots"):
        scatter_kv_triton(cache, slots.float(), new)
    with pytest.raises(KernelInputError, match="slots"):
        scatter_kv(cache, slots[:3], new)
    with pytest.raises(IndexError):
        scatter_kv_reference(cache, torch.full_like(slots, 24), new)
