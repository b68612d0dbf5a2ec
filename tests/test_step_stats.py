"""A step's read-back as report columns (the core's `read_back`): committed positions and
tokens, and the confidence statistics against torch's own quantiles."""

import numpy as np
import pytest
import torch

from dilaserve._core import read_back


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


def test_read_back_matches_torch_quantiles_and_the_committed_columns() -> None:
    rng = np.random.default_rng(0)
    for b, m in ((1, 32), (8, 32), (5, 7), (3, 1), (64, 32)):
        for _ in range(10):
            counts = rng.integers(1, m + 1, size=b)
            candidate = np.arange(m)[None, :] < counts[:, None]
            confidence = np.where(candidate, rng.random((b, m)), -np.inf)
            committed = candidate & (rng.random((b, m)) < 0.5)
            ids = rng.integers(0, 1000, size=(b, m))
            columns = np.sort(rng.choice(64, size=(b, m)), axis=1).astype(np.int64)
            timesteps = rng.integers(1, 4, size=b)
            got = read_back(
                host_copy(committed, ids, confidence, timesteps), counts.tolist(), columns
            )
            n, positions, tokens, stats, passed = got
            assert n == committed.sum(axis=1).tolist()
            assert positions == columns[committed].tolist() and tokens == ids[committed].tolist()
            assert passed == timesteps.tolist()
            want = torch_stats(torch.from_numpy(confidence), torch.from_numpy(candidate))
            np.testing.assert_allclose(np.reshape(stats, (b, 5)), want.numpy(), rtol=1e-12)


def test_a_mis_shaped_read_back_is_refused() -> None:
    with pytest.raises(ValueError, match="values"):
        read_back(np.zeros((2, 5)), [1, 1], np.zeros((2, 2), dtype=np.int64))
    with pytest.raises(ValueError, match="candidate counts"):
        read_back(np.zeros((2, 7)), [1], np.zeros((2, 2), dtype=np.int64))
