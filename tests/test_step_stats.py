"""The host-side confidence statistics against torch's own quantiles."""

import numpy as np
import torch

from dilaserve.worker.step_stats import confidence_stats


def torch_stats(confidence: torch.Tensor, candidate: torch.Tensor) -> torch.Tensor:
    """min, q25, median, mean, q75 of each row's candidates by `torch.nanquantile`."""
    values = torch.where(candidate, confidence, torch.nan)
    levels = torch.tensor([0.0, 0.25, 0.5, 0.75], dtype=values.dtype)
    low, q25, median, q75 = torch.nanquantile(values, levels, dim=1)
    return torch.stack([low, q25, median, torch.nanmean(values, dim=1), q75], dim=1)


def test_statistics_match_torch_quantiles_for_any_candidate_count() -> None:
    g = torch.Generator().manual_seed(0)
    for b, m in ((1, 32), (8, 32), (5, 7), (3, 1)):
        for _ in range(20):
            confidence = torch.rand(b, m, generator=g, dtype=torch.float64)
            candidate = torch.rand(b, m, generator=g) < torch.rand(b, 1, generator=g)
            # What the commit reports where a position is no candidate.
            confidence = torch.where(candidate, confidence, -torch.inf)
            got = confidence_stats(confidence.numpy(), candidate.numpy())
            want = torch_stats(confidence, candidate).numpy()
            np.testing.assert_allclose(got, want, rtol=1e-12, atol=0)


def test_a_row_without_candidates_has_nan_statistics_and_leaves_others_alone() -> None:
    confidence = np.array([[0.1, 0.9, 0.5, 0.3], [-np.inf] * 4, [0.2, 0.4, -np.inf, -np.inf]])
    candidate = np.isfinite(confidence)
    stats = confidence_stats(confidence, candidate)
    assert np.isnan(stats[1]).all()
    np.testing.assert_allclose(stats[0], [0.1, 0.25, 0.4, 0.45, 0.6])
    np.testing.assert_allclose(stats[2], [0.2, 0.25, 0.3, 0.3, 0.35])
