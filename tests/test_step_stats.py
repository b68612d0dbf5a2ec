"""A step's read-back applied to the worker's token state (`HeldTokens.commit`): the
committed positions and tokens, and the confidence statistics against torch's own
quantiles."""

import numpy as np
import pytest
import torch

from dilaserve._core import STEP_KINDS, HeldTokens

MASK = 999
CACHE = STEP_KINDS.index("cache")


def torch_stats(confidence: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """min, q25, median, mean, q75 of each row's candidates by `torch.nanquantile`."""
    values = torch.where(candidate, confidence, torch.nan)
    levels = torch.tensor([0.0, 0.25, 0.5, 0.75], dtype=values.dtype)
    low, q25, median, q75 = torch.nanquantile(values, levels, dim=1)
    return torch.stack([low, q25, median, torch.nanmean(values, dim=1), q75], dim=1)


def host_copy(committed, ids, confidence, timesteps) -> np.ndarray:
    """The runner's read-back layout."""
    return np.concatenate(
        [committed.astype(float), ids.astype(float), confidence, timesteps[:, None] * 1.0],
        axis=1,
    )


def held(columns: list[np.ndarray], block: int) -> HeldTokens:
    """Requests 0.. of one block each, masked exactly at `columns[i]`."""
    t = HeldTokens()
    for rid, c in enumerate(columns):
        output = np.ones(block, dtype=np.int64)
        output[c] = MASK
        t.add(rid, [1, 2], output.tolist(), block, MASK, [], False, (3, 1, 1))
    return t


def test_a_read_back_commits_its_columns_with_torch_quantiles() -> None:
    rng = np.random.default_rng(0)
    block = 64
    for b, m in ((1, 32), (8, 32), (5, 7), (3, 1), (64, 32)):
        for _ in range(10):
            counts = rng.integers(1, m + 1, size=b)
            columns = [np.sort(rng.choice(block, size=n, replace=False)) for n in counts]
            width = int(counts.max())
            candidate = np.arange(width)[None, :] < counts[:, None]
            confidence = np.where(candidate, rng.random((b, width)), -np.inf)
            committed = candidate & (rng.random((b, width)) < 0.5)
            committed[:, 0] = True  # a step commits at least one position
            ids = rng.integers(0, 998, size=(b, width))
            timesteps = rng.integers(1, 4, size=b)
            t = held(columns, block)
            got = t.commit(
                list(range(b)), [CACHE] * b, host_copy(committed, ids, confidence, timesteps)
            )
            blocks, n, positions, tokens, stats, done, passed = got
            assert blocks == [0] * b and n == committed.sum(axis=1).tolist()
            picked = [c[row[: len(c)]] for c, row in zip(columns, committed, strict=True)]
            assert positions == np.concatenate(picked).tolist()
            assert tokens == ids[committed].tolist()
            assert passed == timesteps.tolist()
            # One block each, no stop tokens: a row is done once all its candidates are.
            assert done == [k == c for k, c in zip(n, counts.tolist(), strict=True)]
            want = torch_stats(torch.from_numpy(confidence), torch.from_numpy(candidate))
            np.testing.assert_allclose(np.reshape(stats, (b, 5)), want.numpy(), rtol=1e-12)
            for rid in range(b):
                output = np.array(t.output(rid))
                assert (output[picked[rid]] == ids[rid][committed[rid]]).all()
                assert t.counters(rid)[0] == 4


def test_a_mis_shaped_or_malformed_read_back_changes_nothing() -> None:
    t = held([np.array([0, 1]), np.array([2])], 4)
    with pytest.raises(ValueError, match="values"):
        t.commit([0, 1], [CACHE] * 2, np.zeros((2, 5)))
    host = host_copy(
        np.array([[True, False], [True, False]]),
        np.array([[5, 5], [MASK, 0]]),  # request 1 would write the mask token
        np.full((2, 2), 0.5),
        np.ones(2, dtype=np.int64),
    )
    with pytest.raises(ValueError, match="request 1"):
        t.commit([0, 1], [CACHE] * 2, host)
    assert t.output(0) == [MASK, MASK, 1, 1] and t.counters(0)[0] == 3
    with pytest.raises(ValueError, match="not held"):
        t.commit([7], [CACHE], host[:1])
