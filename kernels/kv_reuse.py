"""Approximate KV reuse (Fast-dLLM dual / prefix cache): the scatter of fresh K/V into the
token-major pool.

The pool stores every layer's K (and V) as `[tokens, kv_heads, head_dim]`: a request owns a
contiguous range of its rows, so attention reads a request's cache as a view and nothing is
ever gathered. A write names, for every fed token, its pool row (`slots`), so rows of
different lengths and step kinds never write into each other's entries.
"""

import torch

from .backend import require, require_triton, tl, triton, use_triton

INDEX_DTYPES = (torch.int32, torch.int64)


def _check_scatter(cache: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
    require(
        cache.dim() == 3, lambda: f"cache must be [tokens, heads, dim], got {tuple(cache.shape)}"
    )
    require(new.dim() == 3, lambda: f"new must be [n, heads, dim], got {tuple(new.shape)}")
    require(
        new.shape[1:] == cache.shape[1:],
        lambda: f"new {tuple(new.shape)} does not match cache heads/dim {tuple(cache.shape)}",
    )
    require(
        slots.shape == new.shape[:1] and slots.dtype in INDEX_DTYPES,
        lambda: (
            f"slots must be an integer [{new.shape[0]}] tensor, "
            f"got {slots.dtype} {tuple(slots.shape)}"
        ),
    )
    require(cache.stride(2) == 1, "cache rows must be contiguous in head_dim")
    devices = {t.device for t in (cache, slots, new)}
    require(
        len(devices) == 1,
        lambda: f"all tensors must be on one device, got {sorted(map(str, devices))}",
    )


def scatter_kv_reference(cache: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
    """cache[slots[t]] = new[t] for every fed token t (torch); a slot outside the cache
    raises IndexError."""
    _check_scatter(cache, slots, new)
    cache.index_copy_(0, slots.long(), new.to(cache.dtype))


if triton is not None:

    @triton.jit(
        do_not_specialize=[
            "heads",
            "head_dim",
            "num_slots",
            "stride_ct",
            "stride_ch",
            "stride_nt",
            "stride_nh",
        ]
    )
    def _scatter_kv_kernel(
        cache_ptr,
        slots_ptr,
        new_ptr,
        heads,
        head_dim,
        num_slots,
        stride_ct,
        stride_ch,
        stride_nt,
        stride_nh,
        stride_nd,
        BLOCK_H: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """One program per fed token: copies all of its heads into its pool row. A slot
        outside the cache is skipped instead of written past it."""
        token = tl.program_id(0).to(tl.int64)
        slot = tl.load(slots_ptr + token).to(tl.int64)
        keep = (slot >= 0) & (slot < num_slots)
        h = tl.arange(0, BLOCK_H)[:, None]
        d = tl.arange(0, BLOCK_D)[None, :]
        lanes = (h < tl.where(keep, heads, 0)) & (d < head_dim)
        src = new_ptr + token * stride_nt + h.to(tl.int64) * stride_nh + d * stride_nd
        dst = cache_ptr + slot * stride_ct + h.to(tl.int64) * stride_ch + d
        tl.store(dst, tl.load(src, mask=lanes), mask=lanes)


def scatter_kv_triton(cache: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
    """Triton version of `scatter_kv_reference` (out-of-range slots are skipped)."""
    _check_scatter(cache, slots, new)
    require_triton(cache)
    tokens, heads, dim = new.shape
    if tokens == 0 or heads == 0:
        return
    # The kernel copies bits; a dtype change goes through torch's cast, as in the reference.
    new = new.to(cache.dtype)
    _scatter_kv_kernel[(tokens,)](
        cache,
        slots.contiguous(),
        new,
        heads,
        dim,
        cache.shape[0],
        cache.stride(0),
        cache.stride(1),
        *new.stride(),
        BLOCK_H=triton.next_power_of_2(heads),
        BLOCK_D=triton.next_power_of_2(dim),
    )


def scatter_kv(cache: torch.Tensor, slots: torch.Tensor, new: torch.Tensor) -> None:
    """Writes fresh K/V into pool rows in place: Triton on CUDA, torch elsewhere."""
    if use_triton(cache):
        scatter_kv_triton(cache, slots, new)
    else:
        scatter_kv_reference(cache, slots, new)
