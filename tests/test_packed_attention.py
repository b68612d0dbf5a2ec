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


@pytest.mark.parametrize("queries", [4, 70])  # a block's step, a prefill
@pytest.mark.parametrize("kv_heads", [4, 2])
def test_rows_read_their_shared_prefix_segments_then_their_extent(kv_heads, queries):
    """Prefix sharing: a row's keys are its shared segments, then its extent (masked
    block-causally or not); a row that shares nothing reads its extent alone."""
    g = torch.Generator().manual_seed(2)
    lengths, reads = (queries, 4), ((30, 6), (10, 10))
    shared = (((0, 8), (20, 4)), ())
    q = torch.randn(queries + 4, 4, 8, generator=g)
    pool = tuple(torch.randn(40, kv_heads, 8, generator=g) for _ in range(2))
    unused = torch.empty(queries + 4, kv_heads, 8)
    mask = torch.rand(queries, 18, generator=g) < 0.7
    mask[:, 0] = True  # every query sees something
    for masks in (None, [mask, torch.ones(4, 10, dtype=torch.bool)]):
        out = attend(q, unused, unused, lengths, pool, reads, masks=masks, shared=shared)
        rows = torch.cat([torch.arange(0, 8), torch.arange(20, 24), torch.arange(30, 36)])
        k, v = pool[0][rows], pool[1][rows]
        if masks is None:
            want = _direct(q[:queries], k, v)
        else:
            groups = 4 // kv_heads
            kk, vv = k.repeat_interleave(groups, 1), v.repeat_interleave(groups, 1)
            scores = torch.einsum("nhd,lhd->hnl", q[:queries], kk) / 8**0.5
            scores = scores.masked_fill(~mask, float("-inf"))
            want = torch.einsum("hnl,lhd->nhd", F.softmax(scores, dim=-1), vv)
        torch.testing.assert_close(out[:queries], want)
        last = _direct(q[queries:], pool[0][10:20], pool[1][10:20])
        torch.testing.assert_close(out[queries:], last)


def test_packed_batch_rejects_inconsistent_rows():
    ids = torch.arange(6)
    with pytest.raises(ValueError, match="partition"):
        PackedBatch(ids, ids, (2, 3))
    with pytest.raises(ValueError, match="one pool extent per row"):
        PackedBatch(ids, ids, (3, 3), cache_slots=ids, cache_reads=((0, 3),))
    with pytest.raises(ValueError, match="segments per reading row"):
        PackedBatch(ids, ids, (3, 3), cache_slots=ids, cache_shared=((), ()))
