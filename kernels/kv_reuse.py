"""Approximate KV reuse (Fast-dLLM dual / prefix cache): per-row scatter of fresh K/V into
cache slots, and the slot gather that the cached attention reads.

Every batch row names its own slot (`rows`) and its own positions, so rows of different
lengths and step kinds never write into each other's entries. The Triton kernels skip a slot
or position outside the cache instead of writing past it.
"""

import torch

from .backend import require, require_triton, tl, triton, use_triton

INDEX_DTYPES = (torch.int32, torch.int64)
# Cache positions copied per gather program.
GATHER_BLOCK_L = 32


def _check_scatter(
    cache: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    new: torch.Tensor,
) -> None:
    require(cache.dim() == 4, f"cache must be [slots, heads, len, dim], got {tuple(cache.shape)}")
    require(new.dim() == 4, f"new must be [b, heads, n, dim], got {tuple(new.shape)}")
    b, heads, n, dim = new.shape
    require(
        heads == cache.shape[1] and dim == cache.shape[3],
        f"new {tuple(new.shape)} does not match cache heads/dim {tuple(cache.shape)}",
    )
    require(
        rows.shape == (b,) and rows.dtype in INDEX_DTYPES,
        f"rows must be an integer [{b}] tensor, got {rows.dtype} {tuple(rows.shape)}",
    )
    require(
        positions.shape == (b, n) and positions.dtype in INDEX_DTYPES,
        f"positions must be an integer [{b}, {n}] tensor, got "
        f"{positions.dtype} {tuple(positions.shape)}",
    )
    require(
        valid.shape == (b, n) and valid.dtype == torch.bool,
        f"valid must be bool [{b}, {n}], got {valid.dtype} {tuple(valid.shape)}",
    )
    devices = {t.device for t in (cache, rows, positions, valid, new)}
    require(
        len(devices) == 1, f"all tensors must be on one device, got {sorted(map(str, devices))}"
    )


def _check_gather(cache: torch.Tensor, rows: torch.Tensor, length: int) -> None:
    require(cache.dim() == 4, f"cache must be [slots, heads, len, dim], got {tuple(cache.shape)}")
    require(
        rows.dim() == 1 and rows.dtype in INDEX_DTYPES,
        f"rows must be a 1-D integer tensor, got {rows.dtype} {tuple(rows.shape)}",
    )
    require(rows.device == cache.device, f"rows on {rows.device}, cache on {cache.device}")
    require(
        0 <= length <= cache.shape[2], f"length {length} outside [0, {cache.shape[2]}] of the cache"
    )


def scatter_kv_reference(
    cache: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    new: torch.Tensor,
) -> None:
    """cache[rows[i], :, positions[i, j], :] = new[i, :, j, :] where valid[i, j] (torch)."""
    _check_scatter(cache, rows, positions, valid, new)
    b, n = positions.shape
    row_idx = rows[:, None].expand(b, n)[valid]
    pos_idx = positions[valid]
    cache[row_idx, :, pos_idx, :] = new.permute(0, 2, 1, 3)[valid].to(cache.dtype)


def gather_kv_reference(cache: torch.Tensor, rows: torch.Tensor, length: int) -> torch.Tensor:
    """cache[rows, :, :length, :] (torch); a view of the cache when the rows are consecutive."""
    _check_gather(cache, rows, length)
    # Narrow first: copying whole slots would cost max_len, not length, per row.
    window = cache[:, :, :length, :]
    first = int(rows[0])
    if torch.equal(rows, torch.arange(first, first + rows.numel(), device=rows.device)):
        return window[first : first + rows.numel()]  # consecutive slots: a view, no copy
    return window.index_select(0, rows)


if triton is not None:

    @triton.jit
    def _scatter_kv_kernel(
        cache_ptr,
        rows_ptr,
        positions_ptr,
        valid_ptr,
        new_ptr,
        n,
        head_dim,
        num_slots,
        max_len,
        stride_cs,
        stride_ch,
        stride_cl,
        stride_cd,
        stride_nb,
        stride_nh,
        stride_nn,
        stride_nd,
        BLOCK_D: tl.constexpr,
    ):
        """One program per (fed token, head): copies one head_dim vector into its slot."""
        entry = tl.program_id(0)
        head = tl.program_id(1).to(tl.int64)
        row = entry // n
        col = entry % n
        slot = tl.load(rows_ptr + row).to(tl.int64)
        pos = tl.load(positions_ptr + entry).to(tl.int64)
        keep = tl.load(valid_ptr + entry) != 0
        keep = keep & (slot >= 0) & (slot < num_slots) & (pos >= 0) & (pos < max_len)
        d = tl.arange(0, BLOCK_D)
        lanes = d < tl.where(keep, head_dim, 0)
        src = (
            new_ptr
            + row.to(tl.int64) * stride_nb
            + head * stride_nh
            + col.to(tl.int64) * stride_nn
            + d * stride_nd
        )
        dst = cache_ptr + slot * stride_cs + head * stride_ch + pos * stride_cl + d * stride_cd
        tl.store(dst, tl.load(src, mask=lanes), mask=lanes)

    @triton.jit
    def _gather_kv_kernel(
        cache_ptr,
        rows_ptr,
        out_ptr,
        heads,
        length,
        head_dim,
        num_slots,
        stride_cs,
        stride_ch,
        stride_cl,
        stride_cd,
        stride_ob,
        stride_oh,
        stride_ol,
        stride_od,
        BLOCK_L: tl.constexpr,
        BLOCK_D: tl.constexpr,
    ):
        """One program per (row, head, tile of positions): copies the tile out of the slot."""
        row_head = tl.program_id(0)
        row = (row_head // heads).to(tl.int64)
        head = (row_head % heads).to(tl.int64)
        pos = tl.program_id(1) * BLOCK_L + tl.arange(0, BLOCK_L)
        d = tl.arange(0, BLOCK_D)
        slot = tl.load(rows_ptr + row).to(tl.int64)
        tile = (pos[:, None] < length) & (d[None, :] < head_dim)
        # A slot outside the cache reads as zeros instead of out of bounds.
        readable = (pos[:, None] < tl.where((slot >= 0) & (slot < num_slots), length, 0)) & (
            d[None, :] < head_dim
        )
        src = (
            cache_ptr
            + slot * stride_cs
            + head * stride_ch
            + pos[:, None].to(tl.int64) * stride_cl
            + d[None, :] * stride_cd
        )
        values = tl.load(src, mask=readable, other=0.0)
        dst = (
            out_ptr
            + row * stride_ob
            + head * stride_oh
            + pos[:, None].to(tl.int64) * stride_ol
            + d[None, :] * stride_od
        )
        tl.store(dst, values, mask=tile)


def scatter_kv_triton(
    cache: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    new: torch.Tensor,
) -> None:
    """Triton version of `scatter_kv_reference`."""
    _check_scatter(cache, rows, positions, valid, new)
    require_triton(cache)
    b, heads, n, dim = new.shape
    if b * n == 0 or heads == 0:
        return
    # The kernel copies bits; a dtype change goes through torch's cast, as in the reference.
    new = new.to(cache.dtype)
    _scatter_kv_kernel[(b * n, heads)](
        cache,
        rows.contiguous(),
        positions.contiguous(),
        valid.contiguous().view(torch.int8),
        new,
        n,
        dim,
        cache.shape[0],
        cache.shape[2],
        *cache.stride(),
        *new.stride(),
        BLOCK_D=triton.next_power_of_2(dim),
    )


def gather_kv_triton(cache: torch.Tensor, rows: torch.Tensor, length: int) -> torch.Tensor:
    """Triton version of `gather_kv_reference` (returns a fresh contiguous tensor)."""
    _check_gather(cache, rows, length)
    require_triton(cache)
    _, heads, _, dim = cache.shape
    out = torch.empty((rows.shape[0], heads, length, dim), dtype=cache.dtype, device=cache.device)
    if out.numel() == 0:
        return out
    grid = (rows.shape[0] * heads, triton.cdiv(length, GATHER_BLOCK_L))
    _gather_kv_kernel[grid](
        cache,
        rows.contiguous(),
        out,
        heads,
        length,
        dim,
        cache.shape[0],
        *cache.stride(),
        *out.stride(),
        BLOCK_L=GATHER_BLOCK_L,
        BLOCK_D=triton.next_power_of_2(dim),
    )
    return out


def scatter_kv(
    cache: torch.Tensor,
    rows: torch.Tensor,
    positions: torch.Tensor,
    valid: torch.Tensor,
    new: torch.Tensor,
) -> None:
    """Writes fresh K/V into cache slots in place: Triton on CUDA, torch elsewhere."""
    if use_triton(cache):
        scatter_kv_triton(cache, rows, positions, valid, new)
    else:
        scatter_kv_reference(cache, rows, positions, valid, new)


def gather_kv(cache: torch.Tensor, rows: torch.Tensor, length: int) -> torch.Tensor:
    """K or V of slots `rows`, positions [0, length): Triton on CUDA, torch elsewhere."""
    if use_triton(cache):
        return gather_kv_triton(cache, rows, length)
    return gather_kv_reference(cache, rows, length)
