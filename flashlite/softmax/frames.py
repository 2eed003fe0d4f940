"""Rows of any length read with whole 16-byte vectors: a row's frame, and how a tile is read.

A contiguous row of odd length starts anywhere inside a 16-byte vector; Triton
then loads it one element at a time, each with its own 64-bit address. Such a
row is read instead from the first vector boundary in it (its *frame*,
``row_frame``): whole vectors by every program, the at most 2 (VEC_COLS - 1)
columns outside them (``row_edges``) apart; the output starts as far past a
boundary as the input (``rows_output``). ``row_vectors`` and
``backward_vectors`` say how a launch reads its rows.

How a tile is read (``REREAD`` in the fused kernels): held in registers from its
one load to the output (``HOLD_READ``), or loaded twice, ``evict_last`` for the
row's reduction and ``evict_first`` for the output, found in L1 or L2.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl


# How a fused tile is read (REREAD, forward and backward): held in registers from its one load to the output,
# or loaded twice, first evict_last for the row's reduction (the forward's (m, d), the backward's sum(dy * y)),
# then evict_first for the output, found in L1 or L2: nothing is held across the reduction.
HOLD_READ = tl.constexpr("")


FIRST_OF_TWO_READS, SECOND_OF_TWO_READS = tl.constexpr("evict_last"), tl.constexpr("evict_first")


@triton.jit
def row_frame(row_start, n_cols, VEC_COLS: tl.constexpr):
    """``(pre, hi)``: where a shared row lies in the columns it is read in.

    With ``VEC_COLS > 1`` (columns in one 16-byte vector; rows start anywhere) a row
    whose first element is ``row_start`` elements past an aligned address is read
    from the first vector boundary at or after its start, ``pre`` columns in: its
    columns are ``[-pre, n_cols - pre)`` of that frame, its whole vectors ``[0, hi)``.
    A bound that is a multiple of ``VEC_COLS`` keeps masked loads and stores
    vectorized; the at most ``2 (VEC_COLS - 1)`` columns outside ``[0, hi)`` are
    ``row_edges``. With ``VEC_COLS = 1`` rows start aligned: ``(0, n_cols)``.
    """
    if VEC_COLS > 1:
        pre = ((VEC_COLS - row_start % VEC_COLS) % VEC_COLS).to(tl.int32)
        hi = tl.maximum(n_cols - pre, 0) // VEC_COLS * VEC_COLS  # 0 for a row inside one vector
    else:
        pre = 0
        hi = n_cols
    return pre, hi


@triton.jit
def in_row(cols, hi, EVEN_COLS: tl.constexpr):
    """Which columns ``cols`` of a row's frame lie in its whole vectors ``[0, hi)`` (``row_frame``); all with
    ``EVEN_COLS``."""
    return (cols < hi) | EVEN_COLS


@triton.jit
def row_edges(pre, hi, n_cols, VEC_COLS: tl.constexpr):
    """``(cols, ok)`` [1, 2 VEC_COLS]: the columns of a row's frame outside its whole vectors, the vector
    before 0 then the one at ``hi``; ``ok`` marks those in the row."""
    lanes = tl.arange(0, 2 * VEC_COLS)[None, :]
    cols = tl.where(lanes < VEC_COLS, lanes - VEC_COLS, hi + lanes - VEC_COLS)
    ok = (cols >= -pre) & (cols < n_cols - pre) & ((cols < 0) | (cols >= hi))
    return cols, ok


@triton.jit
def frame_start(base_lead, row_offset, pre, VEC_COLS: tl.constexpr):
    """Offset of column 0 of the frame (``row_frame``) of a row ``row_offset`` elements past row 0, which lies
    ``base_lead`` elements past an aligned pointer: ``base_lead + row_offset + pre``, a multiple of ``VEC_COLS``;
    with ``VEC_COLS = 1`` (no frames, ``base_lead`` 0) the row's own offset."""
    if VEC_COLS > 1:
        return tl.multiple_of(base_lead + row_offset + pre, VEC_COLS)
    return row_offset


@triton.jit
def in_frame(cols, col_ok, hi, VEC_COLS: tl.constexpr):
    """Which ``cols`` of each row's frame to load and store as whole vectors: ``cols < hi`` (``frame_rows``)
    with ``VEC_COLS > 1``, else ``col_ok`` (the row's columns, worked out once by the caller)."""
    if VEC_COLS > 1:
        return cols < hi
    return col_ok


@triton.jit
def frame_rows(rows, n_cols, base_lead, stride_m, VEC_COLS: tl.constexpr):
    """``(starts, pre, hi)``, ``[len(rows), 1]`` each with ``VEC_COLS > 1``: where rows ``rows`` (64-bit) of a
    tensor of row stride ``stride_m`` are read or written in their frames (``frame_start``, ``row_frame``),
    its pointer ``base_lead`` elements before its row 0. Tensors read in the same frames have one row stride."""
    pre, hi = row_frame(base_lead + rows * stride_m, n_cols, VEC_COLS)
    starts = frame_start(base_lead, rows * stride_m, pre, VEC_COLS)[:, None]
    if VEC_COLS > 1:
        pre, hi = pre[:, None], hi[:, None]
    return starts, pre, hi


@triton.jit
def aligned_body_end(col_end, hi, VEC_COLS: tl.constexpr):
    """Where a chunk of a row that ends at ``col_end`` stops being whole vectors of its frame (``row_frame``):
    ``min(col_end, hi)``, a multiple of ``VEC_COLS`` as chunks are (the planner keeps ``BLOCK_N`` one), which
    keeps the masked loads and stores up to it vectorized."""
    if VEC_COLS > 1:
        return tl.multiple_of(tl.minimum(col_end, hi), VEC_COLS)
    return col_end


# ----------------------------------------------------------------------------- host side


def row_vectors(x2d: torch.Tensor, out_dtype: torch.dtype) -> int:
    """How the shared-row kernel reads the rows of ``x2d`` (n_rows, n_cols) and writes a contiguous output.

    1: every row starts 16-byte aligned in both, as Triton sees it (an aligned
    base, row stride and length multiples of 16 elements): vector loads and
    stores. The columns of one 16-byte vector (> 1): rows start anywhere, but
    ``x2d`` is contiguous, so each row is read from the first vector boundary in
    it (``row_frame``; the output starts as far past a boundary as ``x2d``:
    ``rows_output``). 0: neither (a strided view of odd rows): one element a
    load, in ``tuning.SHARED_TILES_UNALIGNED``.
    """
    n_rows, n_cols = x2d.shape
    if x2d.stride(1) != 1:
        return 0
    if x2d.data_ptr() % 16 == 0 and n_cols % 16 == 0 and x2d.stride(0) % 16 == 0:
        return 1
    if (x2d.stride(0) == n_cols or n_rows == 1) and frame_in_storage(x2d):
        return 16 // min(x2d.element_size(), out_dtype.itemsize)
    return 0


def frame_in_storage(t: torch.Tensor) -> bool:
    """True if the 16-byte boundary at or before ``t``'s first element lies in its storage (``aligned_frame``)."""
    return t.data_ptr() % t.element_size() == 0 and t.storage_offset() * t.element_size() >= t.data_ptr() % 16


def frame_lead(t: torch.Tensor) -> int:
    """Elements between the 16-byte boundary at or before ``t``'s first element and that element."""
    return t.data_ptr() % 16 // t.element_size()


def aligned_frame(t: torch.Tensor) -> tuple[torch.Tensor, int]:
    """``(view, lead)``: ``t`` viewed from the 16-byte boundary at or before its first element, ``lead`` elements
    before it (``row_vectors`` checked that the boundary lies inside ``t``'s storage)."""
    lead = frame_lead(t)
    if lead == 0:
        return t, 0
    return t.as_strided(t.shape, t.stride(), t.storage_offset() - lead), lead




def rows_output(n_rows: int, n_cols: int, dtype: torch.dtype, device: torch.device, lead: int) -> tuple:
    """``(y, frame)``: a contiguous (n_rows, n_cols) output that starts ``lead`` elements past a 16-byte
    boundary, as its input does (``aligned_frame``), and the same rows viewed from that boundary."""
    storage = torch.empty(n_rows * n_cols + lead, dtype=dtype, device=device)
    return storage[lead:].view(n_rows, n_cols), storage[:n_rows * n_cols].view(n_rows, n_cols)
