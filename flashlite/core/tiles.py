"""Tiles: loading, storing and multiplying the blocks kernels work on, and the TMA descriptors that load them.

Attention's kernels move ``[BLOCK, HEAD_DIM_PADDED]`` tiles of one (batch, head)'s
``(L, D)`` matrix: ``load_tile`` gives zeros past its ends (through pointers, or
through a TMA tensor descriptor on Hopper), ``store_tile`` drops what lies
past them, ``dot`` multiplies in fp32. Row indices grow with batch and heads,
so they are 64-bit (``tile_rows``). Host side: ``tensor_descriptor`` and the
checks TMA needs (``tma_usable``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

try:  # host-side tensor descriptors (TMA on Hopper): Triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: K/V through pointers only
    TensorDescriptor = None

from .runtime import device_info


@triton.jit
def load_tile(
    src, row_start, n_rows, stride_row, head_dim,
    BLOCK: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    CHECK_ROWS: tl.constexpr, EVEN_D: tl.constexpr, USE_TMA: tl.constexpr,
):
    """Rows ``[row_start, row_start + BLOCK)`` of one head's (n_rows, head_dim) matrix, zeros past its ends.

    ``src`` is the head's base pointer, or with ``USE_TMA`` a tuple ``(desc, b, h)``:
    a (B, H, L, D) tensor descriptor and the head's coordinates in it (its
    bounds give the zeros). Without ``CHECK_ROWS`` the rows must all be in bounds.
    """
    if USE_TMA:
        desc, b, h = src
        tile = desc.load([b, h, row_start, 0]).reshape(BLOCK, HEAD_DIM_PADDED)
    else:
        rows = tl.arange(0, BLOCK)
        dims = tl.arange(0, HEAD_DIM_PADDED)
        # The 64-bit part is the scalar tile start; the in-tile offsets stay 32-bit.
        ptrs = src + tl.cast(row_start, tl.int64) * stride_row + (rows[:, None] * stride_row + dims[None, :])
        if CHECK_ROWS:
            row_ok = (row_start + rows) < n_rows
            if EVEN_D:
                tile = tl.load(ptrs, mask=row_ok[:, None], other=0.0)
            else:
                tile = tl.load(ptrs, mask=row_ok[:, None] & (dims < head_dim)[None, :], other=0.0)
        elif EVEN_D:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=(dims < head_dim)[None, :], other=0.0)
    return tile


@triton.jit
def load_paged_tile(
    src, pages, row_start, n_rows, stride_row, head_dim,
    BLOCK: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, EVEN_D: tl.constexpr,
):
    """``load_tile`` of a paged cache: rows ``[row_start, row_start + BLOCK)`` of one head, zeros past ``n_rows``,
    row ``j`` at row ``j % page_size`` of page ``table[j // page_size]`` (clamped to ``[0, last_block]``), with
    ``pages = (table, page_size, stride_page, last_block)`` and ``src`` the head's base in page 0. A tile may
    span several pages (each row finds its own)."""
    table, page_size, stride_page, last_block = pages
    rows = row_start + tl.arange(0, BLOCK)
    row_ok = rows < n_rows
    block = tl.minimum(tl.maximum(tl.load(table + rows // page_size, mask=row_ok, other=0), 0), last_block)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    offsets = block.to(tl.int64) * stride_page + (rows % page_size) * stride_row
    ok = row_ok[:, None]
    if not EVEN_D:
        ok = ok & (dims < head_dim)[None, :]
    return tl.load(src + offsets[:, None] + dims[None, :], mask=ok, other=0.0)


@triton.jit
def store_tile(
    dst, tile, row_start, n_rows, stride_row, head_dim,
    BLOCK: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, EVEN_D: tl.constexpr,
):
    """Write ``tile`` to rows ``[row_start, row_start + BLOCK)`` of one head, dropping rows and columns past the ends."""
    rows = tl.arange(0, BLOCK)
    dims = tl.arange(0, HEAD_DIM_PADDED)
    ptrs = dst + tl.cast(row_start, tl.int64) * stride_row + (rows[:, None] * stride_row + dims[None, :])
    ok = ((row_start + rows) < n_rows)[:, None]
    if not EVEN_D:
        ok = ok & (dims < head_dim)[None, :]
    tl.store(ptrs, tile, mask=ok)


@triton.jit
def dot(a, b, acc, DOT_PRECISION: tl.constexpr, UPCAST_DOTS: tl.constexpr):
    """``acc + a @ b`` in fp32 (``acc`` None: ``a @ b``).

    ``UPCAST_DOTS`` widens the operands first. Only the host sets it, for bf16
    under Triton's interpreter, which multiplies bf16 bit patterns as integers
    (triton-lang/triton#11584: "not supported yet"); the bf16 values, and so the
    products, are unchanged.
    """
    if UPCAST_DOTS:
        out = tl.dot(a.to(tl.float32), b.to(tl.float32), acc, input_precision="ieee")
    else:
        out = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
    return out


@triton.jit
def tile_rows(tile, BLOCK_M: tl.constexpr):
    """The (64-bit) row indices of tile number ``tile``: rows times strides can pass 2^31."""
    return tl.cast(tile, tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)


# ----------------------------------------------------------------------------- host side

# Tensor descriptors lower to TMA from compute capability 9.0 (Hopper) on.
TMA_MIN_CAPABILITY = (9, 0)


def descriptor_strides(t: torch.Tensor) -> list[int]:
    """Strides of a (B, H, L, D) tensor with each size-1 dim's stride made dense (it is never stepped,
    but a TMA descriptor still wants every stride 16-byte aligned)."""
    strides = list(t.stride())
    shape = t.shape
    if 1 in shape:
        for dim in (2, 1, 0):
            if shape[dim] == 1:
                strides[dim] = strides[dim + 1] * shape[dim + 1]
    return strides


def tma_usable(*tensors: torch.Tensor) -> bool:
    """TMA needs Hopper or newer (or the interpreter), 16-byte aligned bases and strides, and no zero strides.

    The tensors are on one device (the callers' argument checks ensure it).
    """
    if TensorDescriptor is None:
        return False
    if tensors[0].is_cuda and device_info(tensors[0].device).capability < TMA_MIN_CAPABILITY:
        return False
    for t in tensors:
        size = t.element_size()
        if t.data_ptr() % 16 or any(st <= 0 or st * size % 16 for st in descriptor_strides(t)[:3]):
            return False
    return True


def tensor_descriptor(t: torch.Tensor, block_rows: int, head_dim_pad: int) -> TensorDescriptor:
    """A (B, H, L, D) descriptor loading [1, 1, block_rows, HEAD_DIM_PADDED] boxes, zeros past L and D."""
    return TensorDescriptor(t, list(t.shape), descriptor_strides(t), [1, 1, block_rows, head_dim_pad])
