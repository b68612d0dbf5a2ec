"""Attention over packed rows and pool views against padded attention written out."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from dilaserve.models.packed import PackedBatch, attend


def _direct(q, k, v):
    """One row: `[n, H, D]` queries over `[L, KVH, D]` keys, heads repeated for GQA."""
    groups = q.shape[1] // k.shape[1]
    k, v = k.repeat_interleave(groups, dim=1), v.repeat_interleave(groups, dim=1)
    scores = torch.einsum("nhd,lhd->hnl", q, k) / q.shape[-1] ** 0.5
    return torch.einsum("hnl,lhd->nhd", F.softmax(scores, dim=-1), v)


@pytest.mark.parametrize("kv_heads", [4, 2])
@pytest.mark.parametrize("lengths", [(5, 5, 5), (3, 7, 1)])
def test_packed_self_attention_equals_rows_alone(kv_heads, lengths):
    g = torch.Generator().manual_seed(0)
    t = sum(lengths)
    q = torch.randn(t, 4, 8, generator=g)
    k, v = (torch.randn(t, kv_heads, 8, generator=g) for _ in range(2))
    out = attend(q, k, v, lengths)
    at = 0
    for n in lengths:
        rows = slice(at, at + n)
        torch.testing.assert_close(out[rows], _direct(q[rows], k[rows], v[rows]))
        at += n


@pytest.mark.parametrize(
    ("lengths", "reads"),
    [
        ((4, 4, 4), ((0, 10), (10, 10), (20, 10))),  # evenly spaced: one strided call
        ((4, 4, 4), ((20, 10), (10, 10), (0, 10))),  # evenly spaced, descending (it failed)
        ((4, 4), ((22, 6), (3, 10))),  # anywhere, any length
        ((4, 2), ((0, 10), (10, 10))),
    ],
)
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_pool_reads_attend_over_each_rows_extent(lengths, reads, kv_heads):
    g = torch.Generator().manual_seed(1)
    t = sum(lengths)
    q = torch.randn(t, 4, 8, generator=g)
    pool = tuple(torch.randn(40, kv_heads, 8, generator=g) for _ in range(2))
    unused = torch.empty(t, kv_heads, 8)
    out = attend(q, unused, unused, lengths, pool, reads)
    at = 0
    for n, (base, length) in zip(lengths, reads, strict=True):
        extent = slice(base, base + length)
        want = _direct(q[at : at + n], pool[0][extent], pool[1][extent])
        torch.testing.assert_close(out[at : at + n], want)
        at += n


def test_packed_batch_rejects_inconsistent_rows():
    ids = torch.arange(6)
    with pytest.raises(ValueError, match="partition"):
        PackedBatch(ids, ids, (2, 3))
    with pytest.raises(ValueError, match="one pool extent per row"):
        PackedBatch(ids, ids, (3, 3), cache_slots=ids, cache_reads=((0, 3),))
