"""Softmax and log-sum-exp over one dimension, in two regimes.

* **fused**: a whole row (several rows when rows are short) is one tile held on
  chip: one read of ``x``, one write of ``y``. For short rows the grid is
  persistent (as many programs as the device holds at once, each looping over
  tiles), so they are not launch-bound; wider tiles get a program each. One
  program holds rows of up to ``FUSED_MAX_COLS`` elements, past which the tile
  no longer fits in its registers. On a GPU,
  longer rows (up to a few million elements) are held by several programs at
  once, each with a part of the row: every program publishes the partial
  ``(m, d)`` of its part, waits until the row's other parts have published
  theirs (``online_softmax.share_partial_states``), merges them, and normalises
  the part it still holds. Waiting needs all of a row's programs resident, so
  the launch is cooperative and sized from the compiled kernel. A row longer
  than the resident programs hold is still shared by them: each part first
  streams a head, holds the rest on chip, and re-reads the head from L2 once
  the row's state is known. Many 16-bit rows of up to 65536 elements take a
  program each instead, which reads its row twice (``REREAD``: once for
  ``(m, d)``, again from L1/L2 for ``y``; ``FWD_REREAD_MAX_COLS``), as the wide
  rows of the backward do. Rows of an odd length (or from an unaligned base)
  start anywhere inside a 16-byte vector; they are read from the first vector
  boundary in them (``_row_frame``), so that loads and stores stay vectorized
  (4096 x 50257 on an H100: 149 -> 2373 GB/s fp32). One-row fused tiles, the
  online kernels and the backward kernels read such rows the same way
  (``_frame_rows``; bench/results/h100/softmax_odd_rows_frames.log: backward of
  fp32 4096 x 30001 339 -> 2281 GB/s, where one element a load spilled).
* **online**: a row is streamed in blocks of ``BLOCK_N``. Pass 1 folds the
  blocks into running states ``(m, d)``, one per lane, with the core's
  ``online_update_lanes`` (no reduction inside the loop), then merges the lanes;
  pass 2 re-reads the blocks, last first (most likely still in L2), and writes
  ``y = e^(x - m) / d``. When there are too few rows to fill the GPU, each row
  is split across programs: every program computes a partial ``(m, d)`` of its
  chunk, a second launch merges the partials of the row with
  ``merge_partial_states`` and normalises its chunk.

Both regimes accumulate in fp32 and write the input dtype (or ``dtype``). The
backward pass ``dx = y * (dy - sum(dy * y))`` follows the same regimes: rows
on chip (a program a tile, wide rows loading y and dy twice rather than holding
them; longer rows held by resident programs that share their sum(dy * y),
``BWD_TILES``), or streamed.
CPU tensors run these kernels through Triton's interpreter when
``TRITON_INTERPRET=1``; otherwise they use ``torch.softmax`` in fp32.
"""

from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from ._runtime import (
    check_dim, check_float_dtype, compiled_launcher, cooperative_launch_supported, device_info, is_compiling, launch,
    launch_persistent, occupancy, persistent_grid, record_residency, runs_kernels, signature_key, zeroed_slots,
    SLOTS_ALIGN,
)
from .online_softmax import (
    LOG2E,
    empty_state,
    final_weights,
    merge_partial_states,
    normalize,
    online_update,
    online_update_lanes,
    rescale_factor,
    share_partial_states,
    share_partial_sums,
    state_logsumexp,
)

ALGORITHMS = ("auto", "fused", "online")


# ----------------------------------------------------------------------------- jit helpers


@triton.jit
def _tile_rows(tile, BLOCK_M: tl.constexpr):
    """The (64-bit) row indices of tile number ``tile``: rows times strides can pass 2^31."""
    return tl.cast(tile, tl.int64) * BLOCK_M + tl.arange(0, BLOCK_M)


# What a program of a shared row fetches of its next part before waiting for the other parts of this one.
PREFETCH_NONE = tl.constexpr(0)
PREFETCH_L2 = tl.constexpr(1)  # the next part's columns into L2: no registers held
# Bytes of one L2 sector, what a prefetch fetches at least.
L2_SECTOR_BYTES = tl.constexpr(32)


@triton.jit
def _prefetch_to_l2(row_ptr, start, n_cols, stride_xn, COLS: tl.constexpr):
    """Ask L2 to fetch columns ``[start, start + COLS)`` of a row (cut at ``n_cols``): no registers, no wait.

    One ``prefetch.global.L2`` a sector, issued and forgotten, so a later load of
    those columns finds them in L2. GPU only (inline PTX; the interpreter has none).
    """
    SECTOR_COLS: tl.constexpr = L2_SECTOR_BYTES * 8 // row_ptr.dtype.element_ty.primitive_bitwidth
    cols = tl.minimum(start + tl.arange(0, COLS // SECTOR_COLS) * SECTOR_COLS, n_cols - 1)
    tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tprefetch.global.L2 [$1];", "=r,l", [row_ptr + cols * stride_xn],
                              dtype=tl.int32, is_pure=False, pack=1)


# Pass numbers of the online kernels.
BOTH_PASSES = tl.constexpr(0)  # one program owns a whole row: statistics, then normalise
PARTIAL_PASS = tl.constexpr(1)  # split rows, first launch: each program publishes the partial of its chunk
FINAL_PASS = tl.constexpr(2)  # split rows, second launch: merge the row's partials, then normalise the chunk


@triton.jit
def _work_item(item, n_items, n_splits, cols_per_split, n_cols, PASS: tl.constexpr):
    """Row and column range ``[col_start, col_end)`` of work item ``item`` = row * n_splits + split.

    The ``FINAL_PASS`` launch walks the items backwards: what the first launch
    read last is still in L2.
    """
    if PASS == FINAL_PASS:
        item = n_items - 1 - item
    item = tl.cast(item, tl.int64)
    row = item // n_splits
    col_start = (item % n_splits) * cols_per_split
    col_end = tl.minimum(col_start + cols_per_split, n_cols)
    return row, col_start, col_end


# ----------------------------------------------------------------------------- kernels


# How a fused tile is read (REREAD, forward and backward): held in registers from its one load to the output,
# or loaded twice, first evict_last for the row's reduction (the forward's (m, d), the backward's sum(dy * y)),
# then evict_first for the output, found in L1 or L2: nothing is held across the reduction.
HOLD_READ = tl.constexpr("")
FIRST_OF_TWO_READS, SECOND_OF_TWO_READS = tl.constexpr("evict_last"), tl.constexpr("evict_first")


@triton.jit
def _softmax_fused_kernel(
    x_ptr, y_ptr, lse_ptr,
    n_rows, n_cols, base_lead,
    stride_xm, stride_xn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, VEC_COLS: tl.constexpr, REREAD: tl.constexpr,
    WRITE_Y: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    # Columns are those of each row's frame (_row_frame): with VEC_COLS > 1 (rows that start unaligned:
    # stride_xm = stride_ym, stride_xn = 1) a row's whole vectors are read from an aligned address and
    # its edges apart; x_ptr and y_ptr are then 16-byte aligned, base_lead elements before row 0 of each.
    # With REREAD (one row a tile) the row is read twice, nothing held across the reduction: first as two
    # halves, both in flight, folded into the state one after the other (only one half is ever widened to
    # fp32: a 16-bit row of 65536 read whole on 32 warps spilled 28 registers), then whole for y, its
    # weights worked out again from x under the final state. A row's edges stay held.
    HALF_N: tl.constexpr = BLOCK_N // 2
    cols = tl.arange(0, BLOCK_N)[None, :]
    col_ok = cols < n_cols  # without frames; a frame's whole vectors end at its row's own bound
    n_tiles = tl.cdiv(n_rows, BLOCK_M)
    for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        rows = _tile_rows(tile, BLOCK_M)
        row_ok = (rows < n_rows)[:, None]
        x_starts, pre, hi = _frame_rows(rows, n_cols, base_lead, stride_xm, VEC_COLS)
        y_starts, _, _ = _frame_rows(rows, n_cols, base_lead, stride_ym, VEC_COLS)
        x_rows, y_rows = x_ptr + x_starts, y_ptr + y_starts
        ok = row_ok & _in_frame(cols, col_ok, hi, VEC_COLS)
        if REREAD:
            low_cols = tl.arange(0, HALF_N)[None, :]
            high_cols = low_cols + HALF_N
            low_ok = row_ok & _in_frame(low_cols, low_cols < n_cols, hi, VEC_COLS)
            high_ok = row_ok & _in_frame(high_cols, high_cols < n_cols, hi, VEC_COLS)
            x_low = tl.load(x_rows + low_cols * stride_xn, mask=low_ok, other=float("-inf"),
                            eviction_policy=FIRST_OF_TWO_READS)
            x_high = tl.load(x_rows + high_cols * stride_xn, mask=high_ok, other=float("-inf"),
                             eviction_policy=FIRST_OF_TWO_READS)
        else:
            x = tl.load(x_rows + cols * stride_xn, mask=ok, other=float("-inf"))
        m, d = empty_state(BLOCK_M)
        if VEC_COLS > 1:  # the edges first: their few weights are worked out again from the final state
            edge_cols, edge_ok = _row_edges(pre, hi, n_cols, VEC_COLS)
            edge_ok = row_ok & edge_ok
            x_edge = tl.load(x_rows + edge_cols, mask=edge_ok, other=float("-inf")).to(tl.float32)
            m, d, _, _ = online_update(m, d, x_edge, LOG2E)
        if REREAD:
            m, d, _, _ = online_update(m, d, x_low.to(tl.float32), LOG2E)
            m, d, _, _ = online_update(m, d, x_high.to(tl.float32), LOG2E)
        else:
            m, d, p, _ = online_update(m, d, x.to(tl.float32), LOG2E)
        if WRITE_LSE:
            tl.store(lse_ptr + rows, state_logsumexp(m, d, LOG2E), mask=rows < n_rows)
        if WRITE_Y:
            if VEC_COLS > 1:
                tl.store(y_rows + edge_cols, final_weights(x_edge, m, d, LOG2E, False).to(y_ptr.dtype.element_ty),
                         mask=edge_ok)
            if REREAD:
                x = tl.load(x_rows + cols * stride_xn, mask=ok, other=float("-inf"),
                            eviction_policy=SECOND_OF_TWO_READS)
                y = final_weights(x.to(tl.float32), m, d, LOG2E, False)
            else:
                y = normalize(p, d, False)
            tl.store(y_rows + cols, y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _row_frame(row_start, n_cols, VEC_COLS: tl.constexpr):
    """``(pre, hi)``: where a shared row lies in the columns it is read in.

    With ``VEC_COLS > 1`` (columns in one 16-byte vector; rows start anywhere) a row
    whose first element is ``row_start`` elements past an aligned address is read
    from the first vector boundary at or after its start, ``pre`` columns in: its
    columns are ``[-pre, n_cols - pre)`` of that frame, its whole vectors ``[0, hi)``.
    A bound that is a multiple of ``VEC_COLS`` keeps masked loads and stores
    vectorized; the at most ``2 (VEC_COLS - 1)`` columns outside ``[0, hi)`` are
    ``_row_edges``. With ``VEC_COLS = 1`` rows start aligned: ``(0, n_cols)``.
    """
    if VEC_COLS > 1:
        pre = ((VEC_COLS - row_start % VEC_COLS) % VEC_COLS).to(tl.int32)
        hi = tl.maximum(n_cols - pre, 0) // VEC_COLS * VEC_COLS  # 0 for a row inside one vector
    else:
        pre = 0
        hi = n_cols
    return pre, hi


@triton.jit
def _in_row(cols, hi, EVEN_COLS: tl.constexpr):
    """Which columns ``cols`` of a row's frame lie in its whole vectors ``[0, hi)`` (``_row_frame``); all with
    ``EVEN_COLS``."""
    return (cols < hi) | EVEN_COLS


@triton.jit
def _row_edges(pre, hi, n_cols, VEC_COLS: tl.constexpr):
    """``(cols, ok)`` [1, 2 VEC_COLS]: the columns of a row's frame outside its whole vectors, the vector
    before 0 then the one at ``hi``; ``ok`` marks those in the row."""
    lanes = tl.arange(0, 2 * VEC_COLS)[None, :]
    cols = tl.where(lanes < VEC_COLS, lanes - VEC_COLS, hi + lanes - VEC_COLS)
    ok = (cols >= -pre) & (cols < n_cols - pre) & ((cols < 0) | (cols >= hi))
    return cols, ok


@triton.jit
def _frame_start(base_lead, row_offset, pre, VEC_COLS: tl.constexpr):
    """Offset of column 0 of the frame (``_row_frame``) of a row ``row_offset`` elements past row 0, which lies
    ``base_lead`` elements past an aligned pointer: ``base_lead + row_offset + pre``, a multiple of ``VEC_COLS``;
    with ``VEC_COLS = 1`` (no frames, ``base_lead`` 0) the row's own offset."""
    if VEC_COLS > 1:
        return tl.multiple_of(base_lead + row_offset + pre, VEC_COLS)
    return row_offset


@triton.jit
def _in_frame(cols, col_ok, hi, VEC_COLS: tl.constexpr):
    """Which ``cols`` of each row's frame to load and store as whole vectors: ``cols < hi`` (``_frame_rows``)
    with ``VEC_COLS > 1``, else ``col_ok`` (the row's columns, worked out once by the caller)."""
    if VEC_COLS > 1:
        return cols < hi
    return col_ok


@triton.jit
def _frame_rows(rows, n_cols, base_lead, stride_m, VEC_COLS: tl.constexpr):
    """``(starts, pre, hi)``, ``[len(rows), 1]`` each with ``VEC_COLS > 1``: where rows ``rows`` (64-bit) of a
    tensor of row stride ``stride_m`` are read or written in their frames (``_frame_start``, ``_row_frame``),
    its pointer ``base_lead`` elements before its row 0. Tensors read in the same frames have one row stride."""
    pre, hi = _row_frame(base_lead + rows * stride_m, n_cols, VEC_COLS)
    starts = _frame_start(base_lead, rows * stride_m, pre, VEC_COLS)[:, None]
    if VEC_COLS > 1:
        pre, hi = pre[:, None], hi[:, None]
    return starts, pre, hi


@triton.jit
def _body_end(col_end, hi, VEC_COLS: tl.constexpr):
    """Where a chunk of a row that ends at ``col_end`` stops being whole vectors of its frame (``_row_frame``):
    ``min(col_end, hi)``, a multiple of ``VEC_COLS`` as chunks are (the planner keeps ``BLOCK_N`` one), which
    keeps the masked loads and stores up to it vectorized."""
    if VEC_COLS > 1:
        return tl.multiple_of(tl.minimum(col_end, hi), VEC_COLS)
    return col_end


@triton.jit
def _head_block(x_row, start, head_end, hi, stride_xn, HEAD_BLOCK_N: tl.constexpr, GROUP_N: tl.constexpr,
                EVEN_COLS: tl.constexpr, EVICTION: tl.constexpr):
    """Columns ``[start, start + HEAD_BLOCK_N)`` of a row, loaded with the L2 eviction hint ``EVICTION``
    ("" for none, or "evict_last"), -inf past ``head_end``: ``[1, HEAD_BLOCK_N]`` lanes with
    ``GROUP_N = 1``, else ``[HEAD_BLOCK_N / GROUP_N, GROUP_N]`` groups of adjacent columns."""
    if GROUP_N == 1:
        cols = start + tl.arange(0, HEAD_BLOCK_N)[None, :]
    else:
        cols = start + tl.arange(0, HEAD_BLOCK_N // GROUP_N)[:, None] * GROUP_N + tl.arange(0, GROUP_N)[None, :]
    return tl.load(x_row + cols * stride_xn, mask=(cols < head_end) & _in_row(cols, hi, EVEN_COLS), other=float("-inf"),
                   eviction_policy=EVICTION)


@triton.jit
def _fold_head_block(group_m, group_d, x_block, GROUP_N: tl.constexpr):
    """Fold a head block (``_head_block``) into its groups' states ``(m, d)`` (``_head_states``): per lane
    with ``GROUP_N = 1`` (``online_update_lanes``: one exponential a value), else per group
    (``online_update``: the group's maximum first, reduced within the thread that loaded it)."""
    if GROUP_N == 1:
        group_m, group_d = online_update_lanes(group_m, group_d, x_block, LOG2E)
    else:
        group_m, group_d, _, _ = online_update(group_m, group_d, x_block, LOG2E)
    return group_m, group_d


@triton.jit
def _head_states(HEAD_BLOCK_N: tl.constexpr, GROUP_N: tl.constexpr):
    """Empty states of a head block's groups: ``[1, HEAD_BLOCK_N]`` lanes with ``GROUP_N = 1``, else
    ``[HEAD_BLOCK_N / GROUP_N]`` groups."""
    if GROUP_N == 1:
        m = tl.full([1, HEAD_BLOCK_N], float("-inf"), tl.float32)
        d = tl.zeros([1, HEAD_BLOCK_N], tl.float32)
    else:
        m, d = empty_state(HEAD_BLOCK_N // GROUP_N)
    return m, d


@triton.jit
def _head_statistics(x_row, head_start, head_end, hi, stride_xn, HEAD_BLOCK_N: tl.constexpr,
                     GROUP_N: tl.constexpr, EVEN_COLS: tl.constexpr, EVICTION: tl.constexpr):
    """The state ``(m, d)`` [1] of columns ``[head_start, head_end)`` of a row (whole blocks), read with the
    eviction hint ``EVICTION``: ``_head_normalize`` reads them again, from L2 if they are still there.

    A block is ``[HEAD_BLOCK_N / GROUP_N, GROUP_N]`` groups of adjacent columns (``_head_block``), each
    keeping its own state over the blocks (``_fold_head_block``: no exchange between threads in the
    loop); the groups are merged once. Two blocks are in flight, in two buffers taken in turn: a
    buffer is loaded again as soon as it is folded in, while the other one's loads are still on their
    way. (One buffer handed on to the next turn, ``x_block = x_next``, compiles to register moves that
    wait for the loads: one block in flight.) Plain loads: Triton's pipelined ones (cp.async) would
    drop the eviction hint.
    """
    group_m, group_d = _head_states(HEAD_BLOCK_N, GROUP_N)
    x_even = _head_block(x_row, head_start, head_end, hi, stride_xn, HEAD_BLOCK_N, GROUP_N, EVEN_COLS, EVICTION)
    # Past head_end when the head is one block: nothing loaded, folded as -inf.
    x_odd = _head_block(x_row, head_start + HEAD_BLOCK_N, head_end, hi, stride_xn, HEAD_BLOCK_N, GROUP_N, EVEN_COLS,
                        EVICTION)
    for start in tl.range(head_start + 2 * HEAD_BLOCK_N, head_end + 2 * HEAD_BLOCK_N, 2 * HEAD_BLOCK_N,
                          num_stages=1):
        group_m, group_d = _fold_head_block(group_m, group_d, x_even.to(tl.float32), GROUP_N)
        # Past head_end on the last turn: nothing loaded.
        x_even = _head_block(x_row, start, head_end, hi, stride_xn, HEAD_BLOCK_N, GROUP_N, EVEN_COLS, EVICTION)
        group_m, group_d = _fold_head_block(group_m, group_d, x_odd.to(tl.float32), GROUP_N)
        x_odd = _head_block(x_row, start + HEAD_BLOCK_N, head_end, hi, stride_xn, HEAD_BLOCK_N, GROUP_N, EVEN_COLS,
                            EVICTION)
    if GROUP_N == 1:
        m, d = merge_partial_states(group_m, group_d, LOG2E)
    else:
        m, d = merge_partial_states(group_m[None, :], group_d[None, :], LOG2E)
    return m, d


@triton.jit
def _head_normalize(x_row, y_row, head_start, head_end, hi, stride_xn, m, d, HEAD_BLOCK_N: tl.constexpr,
                    EVEN_COLS: tl.constexpr):
    """Write the softmax of columns ``[head_start, head_end)`` (whole blocks) under the row's final state
    ``(m, d)`` [1], reading them again last block first (the likeliest still in L2), two blocks in flight
    in two buffers taken in turn, as ``_head_statistics``. Block k (from the end) is columns
    ``[head_end - (k + 1) HEAD_BLOCK_N, head_end - k HEAD_BLOCK_N)``."""
    cols = head_end - HEAD_BLOCK_N + tl.arange(0, HEAD_BLOCK_N)[None, :]
    x_even = tl.load(x_row + cols * stride_xn, mask=_in_row(cols, hi, EVEN_COLS), other=float("-inf"),
                     eviction_policy="evict_first")
    cols -= HEAD_BLOCK_N  # before head_start when the head is one block: nothing loaded or stored
    x_odd = tl.load(x_row + cols * stride_xn, mask=(cols >= head_start) & _in_row(cols, hi, EVEN_COLS),
                    other=float("-inf"), eviction_policy="evict_first")
    for k in tl.range(0, (head_end - head_start) // HEAD_BLOCK_N, 2, num_stages=1):
        cols = head_end - (k + 1) * HEAD_BLOCK_N + tl.arange(0, HEAD_BLOCK_N)[None, :]
        y_block = final_weights(x_even.to(tl.float32), m, d, LOG2E, False)
        tl.store(y_row + cols, y_block.to(y_row.dtype.element_ty), mask=_in_row(cols, hi, EVEN_COLS),
                 eviction_policy="evict_first")
        ahead = cols - 2 * HEAD_BLOCK_N  # before head_start on the last turns: nothing loaded
        x_even = tl.load(x_row + ahead * stride_xn, mask=(ahead >= head_start) & _in_row(ahead, hi, EVEN_COLS),
                         other=float("-inf"), eviction_policy="evict_first")
        cols -= HEAD_BLOCK_N  # block k + 1: before head_start when the head has an odd number of blocks
        y_block = final_weights(x_odd.to(tl.float32), m, d, LOG2E, False)
        tl.store(y_row + cols, y_block.to(y_row.dtype.element_ty),
                 mask=(cols >= head_start) & _in_row(cols, hi, EVEN_COLS), eviction_policy="evict_first")
        ahead = cols - 2 * HEAD_BLOCK_N
        x_odd = tl.load(x_row + ahead * stride_xn, mask=(ahead >= head_start) & _in_row(ahead, hi, EVEN_COLS),
                        other=float("-inf"), eviction_policy="evict_first")


@triton.jit
def _clear_slots(clear_ptr, n_clear, CLEAR_BLOCK: tl.constexpr):
    """Zero slots ``[0, n_clear)`` of ``clear_ptr``, spread over the programs: the next launch publishes there."""
    for start in tl.range(tl.program_id(0) * CLEAR_BLOCK, n_clear, tl.num_programs(0) * CLEAR_BLOCK):
        offsets = start + tl.arange(0, CLEAR_BLOCK)
        tl.store(clear_ptr + offsets, tl.zeros([CLEAR_BLOCK], tl.int64), mask=offsets < n_clear)


@triton.jit
def _softmax_shared_rows_kernel(
    x_ptr, y_ptr, lse_ptr, slot_ptr, clear_ptr, n_clear,
    n_rows, n_cols, n_parts, head_cols, base_lead,
    stride_xm, stride_xn, stride_ym,
    BLOCK_N: tl.constexpr, HEAD_BLOCK_N: tl.constexpr, HEAD_GROUP_N: tl.constexpr, HEAD_EVICTION: tl.constexpr,
    PARTS_POW2: tl.constexpr,
    HAS_HEAD: tl.constexpr, PREFETCH: tl.constexpr, VEC_COLS: tl.constexpr, EVEN_COLS: tl.constexpr,
    WRITE_Y: tl.constexpr, WRITE_LSE: tl.constexpr, CLEAR_BLOCK: tl.constexpr,
):
    # n_parts resident programs hold a row between them; program pid = k * n_parts + part takes part
    # `part` of the rows k, k + rows_at_once, ... (the grid is a multiple of n_parts). A part is
    # [head_cols streamed twice | BLOCK_N held in registers]: with head_cols = 4096 and BLOCK_N = 16384,
    # part 2 is columns [40960, 45056) streamed, then [45056, 61440) on chip. Columns are those of the
    # row's frame (_row_frame): with VEC_COLS > 1 (rows that start unaligned: stride_xm = stride_ym,
    # stride_xn = 1) a row is read from the first vector boundary in it, and part 0 also takes its edges;
    # x_ptr and y_ptr are then 16-byte aligned, base_lead elements before row 0 of x and of y.
    # The row's slots at slot_ptr are zero (unpublished); those at clear_ptr, which the last launch
    # published into, are zeroed for the next one (_runtime.zeroed_slots).
    _clear_slots(clear_ptr, n_clear, CLEAR_BLOCK)
    part = tl.program_id(0) % n_parts
    row_step = tl.num_programs(0) // n_parts
    part_start = part * (head_cols + BLOCK_N)  # columns fit 32 bits; rows times strides are 64-bit below
    head_end = part_start + head_cols
    # Every tile is [1, COLS], the core's layout: offsets, data and stores share one register layout.
    tail_cols = head_end + tl.arange(0, BLOCK_N)[None, :]
    rows_prefetched = n_rows  # rows whose part is prefetched while the row before waits
    if VEC_COLS > 1:  # a frame's prefetch reaches this row's pre past the next row: never let that be the last
        rows_prefetched = n_rows - 1
    for row in tl.range(tl.program_id(0) // n_parts, n_rows, row_step):
        row = tl.cast(row, tl.int64)
        rows = row + tl.arange(0, 1)
        pre, hi = _row_frame(base_lead + row * stride_xm, n_cols, VEC_COLS)
        tail_ok = _in_row(tail_cols, hi, EVEN_COLS)  # with EVEN_COLS (every part inside the row): folds away
        x_row = x_ptr + _frame_start(base_lead, row * stride_xm, pre, VEC_COLS)
        if PREFETCH == PREFETCH_L2:  # the first BLOCK_N columns of the next row's part travel to L2
            if row + row_step < rows_prefetched:
                _prefetch_to_l2(x_row + row_step * stride_xm, part_start, n_cols, stride_xn, BLOCK_N)
        m_head, d_head = empty_state(1)
        if HAS_HEAD:
            m_head, d_head = _head_statistics(x_row, part_start, head_end, hi, stride_xn, HEAD_BLOCK_N, HEAD_GROUP_N,
                                              EVEN_COLS, HEAD_EVICTION)
        if VEC_COLS > 1:  # part 0 takes the row's edges (masks from tl.where: the interpreter's scalar & is int32)
            edge_cols, edge_ok = _row_edges(pre, hi, n_cols, VEC_COLS)
            edge_ok = tl.where(part == 0, edge_ok, False)
            x_edge = tl.load(x_row + edge_cols, mask=edge_ok, other=float("-inf")).to(tl.float32)
            m_head, d_head, _, _ = online_update(m_head, d_head, x_edge, LOG2E)
        x = tl.load(x_row + tail_cols * stride_xn, mask=tail_ok, other=float("-inf"), eviction_policy="evict_first")
        m_part, d_part, p, _ = online_update(m_head, d_head, x.to(tl.float32), LOG2E)
        # p = e^(x - m_part) stays on chip while the parts meet; it then needs e^(m_part - m_row).
        m_row, d_row = share_partial_states(slot_ptr + rows * n_parts, part, n_parts, m_part, d_part, PARTS_POW2, LOG2E)
        if WRITE_LSE:
            if part == 0:
                tl.store(lse_ptr + rows, state_logsumexp(m_row, d_row, LOG2E))
        if WRITE_Y:
            y_row = y_ptr + _frame_start(base_lead, row * stride_ym, pre, VEC_COLS)
            if VEC_COLS > 1:
                y_edge = final_weights(x_edge, m_row, d_row, LOG2E, False)
                tl.store(y_row + edge_cols, y_edge.to(y_ptr.dtype.element_ty), mask=edge_ok)
            y = normalize(p * rescale_factor(m_part, m_row, LOG2E)[:, None], d_row, False)
            tl.store(y_row + tail_cols, y.to(y_ptr.dtype.element_ty), mask=tail_ok, eviction_policy="evict_first")
            if HAS_HEAD:
                _head_normalize(x_row, y_row, part_start, head_end, hi, stride_xn, m_row, d_row, HEAD_BLOCK_N,
                                EVEN_COLS)


@triton.jit
def _softmax_online_kernel(
    x_ptr, y_ptr, lse_ptr, part_m_ptr, part_d_ptr,
    n_rows, n_cols, n_splits, cols_per_split, base_lead,
    stride_xm, stride_xn, stride_ym,
    BLOCK_N: tl.constexpr, SPLITS_POW2: tl.constexpr, PASS: tl.constexpr, NUM_STAGES: tl.constexpr,
    VEC_COLS: tl.constexpr, WRITE_Y: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    # Columns are those of the row's frame, as in _softmax_fused_kernel; a row's first chunk also takes its edges.
    n_items = n_rows * n_splits
    for item in tl.range(tl.program_id(0), n_items, tl.num_programs(0)):
        row, col_start, col_end = _work_item(item, n_items, n_splits, cols_per_split, n_cols, PASS)
        pre, hi = _row_frame(base_lead + row * stride_xm, n_cols, VEC_COLS)
        x_row = x_ptr + _frame_start(base_lead, row * stride_xm, pre, VEC_COLS)
        y_row = y_ptr + _frame_start(base_lead, row * stride_ym, pre, VEC_COLS)
        body_end = _body_end(col_end, hi, VEC_COLS)
        if VEC_COLS > 1:
            edge_cols, edge_ok = _row_edges(pre, hi, n_cols, VEC_COLS)
            edge_ok = tl.where(col_start == 0, edge_ok, False)
            x_edge = tl.load(x_row + edge_cols, mask=edge_ok, other=float("-inf")).to(tl.float32)

        if PASS == FINAL_PASS:
            parts = tl.arange(0, SPLITS_POW2)
            part_ok = parts < n_splits
            part_m = tl.load(part_m_ptr + row * n_splits + parts, mask=part_ok, other=float("-inf"))
            part_d = tl.load(part_d_ptr + row * n_splits + parts, mask=part_ok, other=0.0)
            m, d = merge_partial_states(part_m[None, :], part_d[None, :], LOG2E)
        else:
            # Every lane keeps its own (m, d) over the blocks; the lanes merge once, after the loop.
            lane_m = tl.full([1, BLOCK_N], float("-inf"), tl.float32)
            lane_d = tl.zeros([1, BLOCK_N], tl.float32)
            for start in tl.range(col_start, body_end, BLOCK_N, num_stages=NUM_STAGES):
                cols = start + tl.arange(0, BLOCK_N)[None, :]
                x = tl.load(x_row + cols * stride_xn, mask=cols < body_end, other=float("-inf"))
                lane_m, lane_d = online_update_lanes(lane_m, lane_d, x.to(tl.float32), LOG2E)
            m, d = merge_partial_states(lane_m, lane_d, LOG2E)
            if VEC_COLS > 1:
                m, d, _, _ = online_update(m, d, x_edge, LOG2E)
            if PASS == PARTIAL_PASS:
                here = row * n_splits + col_start // cols_per_split + tl.arange(0, 1)
                tl.store(part_m_ptr + here, m)
                tl.store(part_d_ptr + here, d)

        if PASS != PARTIAL_PASS:
            if WRITE_LSE:
                tl.store(lse_ptr + row + tl.arange(0, 1), state_logsumexp(m, d, LOG2E), mask=(col_start + tl.arange(0, 1)) == 0)
            if WRITE_Y:
                if VEC_COLS > 1:
                    y_edge = final_weights(x_edge, m, d, LOG2E, False)
                    tl.store(y_row + edge_cols, y_edge.to(y_ptr.dtype.element_ty), mask=edge_ok)
                n_blocks = tl.cdiv(body_end - col_start, BLOCK_N)
                for k in tl.range(0, n_blocks, num_stages=NUM_STAGES):
                    cols = col_start + (n_blocks - 1 - k) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
                    col_ok = cols < body_end
                    x = tl.load(x_row + cols * stride_xn, mask=col_ok, other=float("-inf"))
                    y = final_weights(x.to(tl.float32), m, d, LOG2E, False)
                    tl.store(y_row + cols, y.to(y_ptr.dtype.element_ty), mask=col_ok)


@triton.jit
def _load_grad_inputs(y_ptrs, dy_ptrs, mask, EVICTION: tl.constexpr):
    """``(y, dy)`` as fp32 at the pointers given (0 where masked), loaded with the L2 ``EVICTION`` hint."""
    y = tl.load(y_ptrs, mask=mask, other=0.0, eviction_policy=EVICTION).to(tl.float32)
    dy = tl.load(dy_ptrs, mask=mask, other=0.0, eviction_policy=EVICTION).to(tl.float32)
    return y, dy


@triton.jit
def _softmax_bwd_fused_kernel(
    y_ptr, dy_ptr, dx_ptr,
    n_rows, n_cols,
    stride_ym, stride_dym, stride_dyn, stride_dxm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, VEC_COLS: tl.constexpr, REREAD: tl.constexpr,
):
    # With VEC_COLS > 1 (rows that start unaligned) y, dy and dx are read and written in the rows' frames, as
    # x and y in _softmax_fused_kernel: every pointer 16-byte aligned at row 0, one row stride, stride_dyn = 1.
    # With REREAD the tile's y and dy are loaded again for dx (a row's edges stay held).
    FIRST_READ: tl.constexpr = FIRST_OF_TWO_READS if REREAD else HOLD_READ
    cols = tl.arange(0, BLOCK_N)[None, :]
    col_ok = cols < n_cols  # without frames
    n_tiles = tl.cdiv(n_rows, BLOCK_M)
    for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        rows = _tile_rows(tile, BLOCK_M)
        row_ok = (rows < n_rows)[:, None]
        y_starts, pre, hi = _frame_rows(rows, n_cols, 0, stride_ym, VEC_COLS)
        dy_starts, _, _ = _frame_rows(rows, n_cols, 0, stride_dym, VEC_COLS)
        dx_starts, _, _ = _frame_rows(rows, n_cols, 0, stride_dxm, VEC_COLS)
        ok = row_ok & _in_frame(cols, col_ok, hi, VEC_COLS)
        y, dy = _load_grad_inputs(y_ptr + y_starts + cols, dy_ptr + dy_starts + cols * stride_dyn, ok, FIRST_READ)
        dot = tl.sum(y * dy, axis=1)
        if VEC_COLS > 1:
            edge_cols, edge_ok = _row_edges(pre, hi, n_cols, VEC_COLS)
            edge_ok = row_ok & edge_ok
            y_edge, dy_edge = _load_grad_inputs(y_ptr + y_starts + edge_cols, dy_ptr + dy_starts + edge_cols, edge_ok,
                                                HOLD_READ)
            dot += tl.sum(y_edge * dy_edge, axis=1)
            tl.store(dx_ptr + dx_starts + edge_cols, (y_edge * (dy_edge - dot[:, None])).to(dx_ptr.dtype.element_ty),
                     mask=edge_ok)
        if REREAD:
            y, dy = _load_grad_inputs(y_ptr + y_starts + cols, dy_ptr + dy_starts + cols * stride_dyn, ok,
                                      SECOND_OF_TWO_READS)
        tl.store(dx_ptr + dx_starts + cols, (y * (dy - dot[:, None])).to(dx_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _softmax_bwd_online_kernel(
    y_ptr, dy_ptr, dx_ptr, part_ptr,
    n_rows, n_cols, n_splits, cols_per_split,
    stride_ym, stride_dym, stride_dyn, stride_dxm,
    BLOCK_N: tl.constexpr, SPLITS_POW2: tl.constexpr, PASS: tl.constexpr, NUM_STAGES: tl.constexpr,
    VEC_COLS: tl.constexpr,
):
    # Frames as in _softmax_bwd_fused_kernel; a row's first chunk also takes its edges.
    n_items = n_rows * n_splits
    for item in tl.range(tl.program_id(0), n_items, tl.num_programs(0)):
        row, col_start, col_end = _work_item(item, n_items, n_splits, cols_per_split, n_cols, PASS)
        pre, hi = _row_frame(row * stride_ym, n_cols, VEC_COLS)
        y_row = y_ptr + _frame_start(0, row * stride_ym, pre, VEC_COLS)
        dy_row = dy_ptr + _frame_start(0, row * stride_dym, pre, VEC_COLS)
        body_end = _body_end(col_end, hi, VEC_COLS)
        if VEC_COLS > 1:
            edge_cols, edge_ok = _row_edges(pre, hi, n_cols, VEC_COLS)
            edge_ok = tl.where(col_start == 0, edge_ok, False)
            y_edge = tl.load(y_row + edge_cols, mask=edge_ok, other=0.0).to(tl.float32)
            dy_edge = tl.load(dy_row + edge_cols, mask=edge_ok, other=0.0).to(tl.float32)

        if PASS == FINAL_PASS:
            parts = tl.arange(0, SPLITS_POW2)
            dot = tl.sum(tl.load(part_ptr + row * n_splits + parts, mask=parts < n_splits, other=0.0), axis=0)
        else:
            acc = tl.zeros([1, BLOCK_N], tl.float32)
            for start in tl.range(col_start, body_end, BLOCK_N, num_stages=NUM_STAGES):
                cols = start + tl.arange(0, BLOCK_N)[None, :]
                ok = cols < body_end
                y = tl.load(y_row + cols, mask=ok, other=0.0).to(tl.float32)
                dy = tl.load(dy_row + cols * stride_dyn, mask=ok, other=0.0).to(tl.float32)
                acc += y * dy
            dot = tl.sum(tl.sum(acc, axis=1), axis=0)
            if VEC_COLS > 1:
                dot += tl.sum(tl.sum(y_edge * dy_edge, axis=1), axis=0)
            if PASS == PARTIAL_PASS:
                tl.store(part_ptr + row * n_splits + col_start // cols_per_split, dot)

        if PASS != PARTIAL_PASS:
            dx_row = dx_ptr + _frame_start(0, row * stride_dxm, pre, VEC_COLS)
            if VEC_COLS > 1:
                tl.store(dx_row + edge_cols, (y_edge * (dy_edge - dot)).to(dx_ptr.dtype.element_ty), mask=edge_ok)
            n_blocks = tl.cdiv(body_end - col_start, BLOCK_N)
            for k in tl.range(0, n_blocks, num_stages=NUM_STAGES):
                cols = col_start + (n_blocks - 1 - k) * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
                ok = cols < body_end
                y = tl.load(y_row + cols, mask=ok, other=0.0).to(tl.float32)
                dy = tl.load(dy_row + cols * stride_dyn, mask=ok, other=0.0).to(tl.float32)
                tl.store(dx_row + cols, (y * (dy - dot)).to(dx_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _softmax_bwd_shared_rows_kernel(
    y_ptr, dy_ptr, dx_ptr, slot_ptr, clear_ptr, n_clear,
    n_rows, n_cols, n_parts,
    stride_ym, stride_dym, stride_dyn, stride_dxm,
    BLOCK_N: tl.constexpr, PARTS_POW2: tl.constexpr, PREFETCH: tl.constexpr, VEC_COLS: tl.constexpr,
    EVEN_COLS: tl.constexpr, CLEAR_BLOCK: tl.constexpr,
):
    # The backward of rows that n_parts resident programs hold between them, laid out as in
    # _softmax_shared_rows_kernel without heads: program pid = k * n_parts + part holds columns
    # [part * BLOCK_N, (part + 1) * BLOCK_N) of y and dy of rows k, k + rows_at_once, ..., publishes the
    # sum(dy * y) of its part, waits for the row's other parts (share_partial_sums) and writes its part of
    # dx. Frames as in _softmax_bwd_fused_kernel (part 0 takes a row's edges); slots as in the forward. The parts
    # hold y and dy: loading them again for dx lost at every shape (BWD_TILES' log).
    _clear_slots(clear_ptr, n_clear, CLEAR_BLOCK)
    part = tl.program_id(0) % n_parts
    row_step = tl.num_programs(0) // n_parts
    cols = part * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    for row in tl.range(tl.program_id(0) // n_parts, n_rows, row_step):
        row = tl.cast(row, tl.int64)  # rows times strides can pass 2^31
        rows = row + tl.arange(0, 1)
        y_starts, pre, hi = _frame_rows(rows, n_cols, 0, stride_ym, VEC_COLS)
        dy_starts, _, _ = _frame_rows(rows, n_cols, 0, stride_dym, VEC_COLS)
        dx_starts, _, _ = _frame_rows(rows, n_cols, 0, stride_dxm, VEC_COLS)
        ok = _in_row(cols, hi, EVEN_COLS)
        y, dy = _load_grad_inputs(y_ptr + y_starts + cols, dy_ptr + dy_starts + cols * stride_dyn, ok, HOLD_READ)
        part_dot = tl.sum(y * dy, axis=1)
        if VEC_COLS > 1:  # masks from tl.where: the interpreter's scalar & is int32
            edge_cols, edge_ok = _row_edges(pre, hi, n_cols, VEC_COLS)
            edge_ok = tl.where(part == 0, edge_ok, False)
            y_edge, dy_edge = _load_grad_inputs(y_ptr + y_starts + edge_cols, dy_ptr + dy_starts + edge_cols, edge_ok,
                                                HOLD_READ)
            part_dot += tl.sum(y_edge * dy_edge, axis=1)
        if PREFETCH == PREFETCH_L2:  # the next row's part of y and dy travels to L2 while the parts meet
            if row + row_step < n_rows:
                _prefetch_to_l2(y_ptr + (row + row_step) * stride_ym, part * BLOCK_N, n_cols, 1, BLOCK_N)
                _prefetch_to_l2(dy_ptr + (row + row_step) * stride_dym, part * BLOCK_N, n_cols, stride_dyn, BLOCK_N)
        dot = share_partial_sums(slot_ptr + rows * n_parts, part, n_parts, part_dot, PARTS_POW2)
        if VEC_COLS > 1:
            tl.store(dx_ptr + dx_starts + edge_cols, (y_edge * (dy_edge - dot[:, None])).to(dx_ptr.dtype.element_ty),
                     mask=edge_ok)
        tl.store(dx_ptr + dx_starts + cols, (y * (dy - dot[:, None])).to(dx_ptr.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------- host launchers

# Largest row the fused kernel holds on chip. The row lives in registers as fp32
# whatever the input dtype: 32768 values over 16 warps are 64 registers a thread.
# Measured on an H100 (CUDA-graph times, M = 4096, `bench/softmax.py --tune`):
# fused fp32 2.81 TB/s at N = 32768, but 2.12 TB/s at 65536 where it spills.
FUSED_MAX_COLS = 32768
# Elements in one fused tile when rows are short: 16 rows of 256, 4 of 1024, ...
# With 4 warps for a 4096 tile this gave the best
# fp32 mix on the H100: 0.96 / 2.14 / 2.63 / 2.80 TB/s at N = 256 / 1024 / 4096 / 16384.
FUSED_TILE_ELEMS = 4096
# Rows of at most FUSED_SHORT_MAX_COLS take smaller tiles (more programs, more loads in flight,
# and the kernel is latency-bound there): measured in softmax_short_rows_tune.log (`--tune short`).
FUSED_SHORT_MAX_COLS, FUSED_SHORT_TILE_ELEMS = 512, 1024
# Elements a thread of the fused kernel holds; sets num_warps from the tile size (at least 4, at most 16).
# Tiles of up to 8192 elements get 4 warps either way; wider rows got half the warps of 32 elements a thread
# (softmax_fused_warps_ab.log, same process, do_bench / CUDA graph GB/s): fp32 4096 x 16384 2904 / 2894 ->
# 2921 / 2910, 2048 x 16384 2791 / 2791 -> 2828 / 2813, bf16 4096 x 8192 2658 / 2670 -> 2679 / 2673; the
# other wide shapes within 0.3% (bf16 4096 x 16384 2835 / 2815 -> 2829 / 2815).
FUSED_ELEMS_PER_THREAD = 64
# Tiles wider than this get one program each instead of a persistent grid. H100, M = 4096, GB/s
# persistent -> one program a tile (bench/results/h100/softmax_grid_tune.log, `--tune grid`):
# fp32 at 4096 / 8192 / 16384 / 32768 columns 2851 / 2742 / 2805 / 2812 -> 2899 / 2854 / 2903 / 2929,
# bf16 2720 / 2718 / 2717 / 2700 -> 2703 / 2802 / 2829 / 2801; at 1024 columns the persistent grid wins.
FUSED_PERSISTENT_MAX_COLS = 2048
# Online kernels, measured on an H100 (`bench/softmax.py --tune online`, CUDA-graph times):
# whole rows (many rows): blocks of 4096 over 16 warps, 2.07 TB/s fp32 at 4096 x 65536
# (capping the grid so re-read rows stay in L2 only lost speed);
# split rows (few rows): blocks of 2048 over 4 warps, 1.3-1.7 TB/s fp32 on 128 x 128K ... 1 x 16M.
ONLINE_BLOCK_N, ONLINE_NUM_WARPS = 4096, 16
SPLIT_BLOCK_N, SPLIT_NUM_WARPS = 2048, 4
# Loads in flight in the streaming loops (software pipelining of `tl.range`).
ONLINE_NUM_STAGES = 3
# Rows are split across programs until there are this many work items per multiprocessor.
ONLINE_ITEMS_PER_SM = 4
# ... but only while there are fewer rows than this many per multiprocessor. H100, fp32, CUDA-graph
# times (bench/results/h100/softmax_split_tune.log): 128 x 128K ran at 1.76 TB/s as whole rows and
# at 1.69 / 1.31 in 2 / 5 parts; 16 x 1M gained from splitting (1.04 TB/s in 5 parts, 1.38 in 32).
ONLINE_SPLIT_BELOW_ROWS_PER_SM = 0.5
# ... but never into chunks shorter than this many blocks.
ONLINE_MIN_BLOCKS_PER_SPLIT = 4


# Rows longer than FUSED_MAX_COLS can still be held on chip, by several programs at once that
# trade partial states through memory and wait for each other (online_softmax.share_partial_states):
# one read and one write, where the online path reads twice. All programs of a row must be
# resident, so the launch is cooperative, sized from the compiled kernel (the launcher streams
# the rows instead if it holds fewer programs than a row has parts).


@dataclass(frozen=True)
class SharedRowTile:
    """How the programs of a shared row are shaped, for one input element size."""

    cols: int  # columns a program holds on chip (BLOCK_N)
    num_warps: int
    programs_per_sm: int  # resident at once
    prefetch: int  # what a program fetches of its next row's part while the parts wait: PREFETCH_NONE / _L2
    head_block: int  # columns of one streamed head block (HEAD_BLOCK_N)
    head_group: int = 1  # columns of a head block that keep one state (HEAD_GROUP_N): 1, a state per lane
    wave_head: int = 0  # many rows in waves (SHARED_WAVE_TILES): columns of head each part streams before its held ones
    head_eviction: str = ""  # L2 eviction hint of the head loads: "" (none) or "evict_last"


# H100, GB/s (do_bench), bench/results/h100/softmax_shared_tune.log (`--tune shared`):
#                                         4096 x 65536   128 x 128K   16 x 1M   4 x 4M (in waves)
#   fp32  16384, 4 warps, 2 an SM, none        2718          2132       2006      1795
#   bf16  32768, 16 warps, 1 an SM, into L2    2532          1543       1413      1294
#   bf16  the same, nothing                    2210          1504       1297      1288
#   bf16  16384, 4 warps, 2 an SM, none        2360          1668       1503      1180
# fp32 runs two programs a multiprocessor at 255 registers: one's load already overlaps the other's
# wait, and the prefetch lost speed there (2457 at 4096 x 65536 in an earlier run of that log).
SHARED_TILES = {
    4: SharedRowTile(16384, 4, 2, PREFETCH_NONE.value, 4096),
    2: SharedRowTile(32768, 16, 1, PREFETCH_L2.value, 8192, head_group=8),
}
# Many rows, taken in waves of held parts (more parts than the resident programs, and no wave of heads
# fits L2; fp32 4096 x 65536, say; 16-bit rows of up to 65536 are read twice now, FWD_REREAD_MAX_COLS), get tiles
# of their own. H100, GB/s, CUDA graph / do_bench, same process,
# against the tiles above (softmax_wave_tiles_ab.log):
# * fp32: parts that hold 16384 columns after streaming a head as long: half as many parts a row wait
#   for each other. 4096 x 65536 2716 / 2699 -> 2753 / 2754, 1024 x 131072 2591 / 2567 -> 2650 / 2658,
#   2048 x 98304 2655 / 2647 -> 2707 / 2712, 512 x 262144 2489 / 2476 -> 2606 / 2616; 4096 x 40000
#   (heads of 4096) 2657 / 2655 -> 2641 / 2640. Rows read in frames lost (4096 x 50257: 2404 / 2377 ->
#   2307 / 2315), so they keep their parts without heads.
# * bf16: 16384 columns, 4 warps, 2 an SM, the next part asked into L2: 4096 x 65536 2539 / 2506 ->
#   2575 / 2558, 2048 x 131072 2414 / 2394 -> 2509 / 2490, 4096 x 50257 2092 / 2088 -> 2223 / 2189,
#   4096 x 40000 (2 parts of 32768 a third empty before) 2014 / 1968 -> 2541 / 2487. With heads, or
#   without the prefetch, it lost; where rows take heads (few rows) the 32768-column tile stays ahead
#   (bf16 1 x 16M 1745 / 1859 against 1629 / 1715). Narrower parts (8192 columns, 3-4 programs an SM), 8 warps,
#   longer fp32 heads and the prefetch for fp32 led nowhere, or gained on one shape and lost on another (run 3).
# The fp32 wave heads keep evict_last, which few rows' heads dropped (below): one hint a process, without it 4096 x
# 65536 / 1024 x 131072 / 512 x 262144 ran 2752 / 2647 / 2603 -> 2732 / 2635 / 2594 GB/s (CUDA graph,
# softmax_head_eviction_ab.log, part 11).
SHARED_WAVE_TILES = {
    4: SharedRowTile(16384, 4, 2, PREFETCH_NONE.value, 4096, wave_head=16384, head_eviction="evict_last"),
    2: SharedRowTile(16384, 4, 2, PREFETCH_L2.value, 8192, head_group=8),
}
# Rows neither aligned nor in a frame that aligns them (row_vectors() = 0: a strided view with an odd
# row length) are read one element a load: every element then has its own 64-bit address, and the
# tiles above spilled to local memory (4096 x 50257 fp32 / bf16 147 / 78 GB/s, before frames).
# H100, GB/s (do_bench), bench/results/h100/softmax_unaligned_tune.log, 4096 x 50257 / 128 x 131071 / 1 x 16777215:
#   fp32  8192, 4 warps    1841 / 1633 / 1002      8192, 8 warps   1592 / 1331 / 1547
#   bf16  8192, 4 warps    1264 /  895 /  648      8192, 8 warps   1118 / 1179 /  981
SHARED_TILES_UNALIGNED = {  # heads loaded evict_last, as these tiles were measured (not since)
    4: SharedRowTile(8192, 4, 2, PREFETCH_NONE.value, 2048, head_eviction="evict_last"),
    2: SharedRowTile(8192, 8, 1, PREFETCH_L2.value, 8192, head_eviction="evict_last"),
}
# More than the resident programs hold at once is still taken in one read of memory where L2
# allows: every program streams a head of its part (blocks of head_block columns, two blocks in
# flight in two buffers taken in turn) before the columns it holds, and reads the head again, last
# block first, once the row's state is known. Plain loads: Triton's pipelined ones (cp.async) drop
# eviction hints (the wave heads' evict_last). Heads serve
# * a row longer than all resident programs hold (past 4.3M columns on an H100): 1 x 16M, GB/s,
#   fp32 1753 (online path 1428), bf16 1597 (online 905);
# * few rows that would take several waves of resident programs (a read, a wait, a write each):
#   in at most SHARED_MAX_HEAD_WAVES waves, as few as keep one wave's heads within
#   SHARED_HEADS_L2_FRACTION of L2. 128 x 128K / 16 x 1M / 4 x 4M: bf16 (24 MB of heads in one
#   wave) 1543 / 1413 / 1294 in waves of held parts, 1749 / 1702 / 1680 in one; fp32 2132 / 2006 /
#   1795 in waves, 1917 / 1863 / 1844 in one (48 MB of heads), 2129 / 2152 / 1994 in two (17 MB a
#   wave). Three waves gave the same as two (softmax_waves_tune.log).
# Head blocks (the same log, another run): bf16 8192 columns, 1720 / 1720 / 1694 in one wave (4096:
# 1655 / 1592 / 1572; 16384: 1664 / 1662 / 1635); fp32 4096, 1860 at 4 x 4M and 1763 at 1 x 16M
# (2048: 1696 / 1656). One buffer handed from turn to turn kept one block in flight (its register
# moves wait for the loads); two taken in turn: bf16 16 x 1M / 1 x 16M 1864 / 1720 -> 1879 / 1762, fp32
# even (softmax_head_buffers_ab.log). Blocks asked into L2 further ahead (prefetch.global.L2::evict_last,
# 2-8 blocks) only lost speed: fp32 128 x 128K 2330 -> 1976 at 2 blocks (softmax_head_prefetch.log).
# Head states (head_group; softmax_head_groups_ab.log, same process, CUDA-graph GB/s at 128 x 128K / 16 x 1M
# / 4 x 4M / 1 x 16M / 16 x 1000003): bf16 in groups of the 8 columns a thread loads at once (16 bytes;
# 29% fewer instructions in the loop) 1841 / 1780 / 1759 / 1689 / 1546 a lane -> 1866 / 1800 / 1783 /
# 1735 / 1665; fp32 in groups of 4: 2291 / 2208 / 2010 / 1806 / 1955 -> 2206 / 2198 / 2003 / 1820 / 2003,
# so fp32 keeps a state per lane; groups of 32 bytes were slower for both. Holding 65536 bf16 columns
# a multiprocessor as input (weights worked out again after the parts meet) instead of 32768 as fp32
# weights lost at every shape: 4096 x 65536 2543 -> 1950, 1 x 16M 1697 -> 1560 (softmax_hold_input_ab.log).
# A Gluon prototype that also held part of each program's columns in shared memory (cp.async; 96 KB a program fp32,
# 192 KB bf16: every long-row shape on chip in bf16) was correct but slower for bf16 everywhere (1 x 16M 1758 -> 1248)
# and for fp32 gained only at 1 x 16M (+3%) and 3 x 5000000 (+9%), losing up to 15% on the other long rows
# (softmax_smem_ab.log): presumably L1 already keeps the heads where they fit. Many rows
# in fewer parts, each streaming a head, gained 1-2% for aligned fp32 only and lost elsewhere (softmax_head_rows_ab.log).
# Head loads carry no eviction hint (SharedRowTile.head_eviction ""); the numbers above had evict_last. One hint a
# process, CUDA graph GB/s (softmax_head_eviction_ab.log, part 11): bf16 even (128 x 128K 1868 -> 1871), fp32
# 128 x 128K 2216 -> 2229, 1 x 16M 1807 -> 1830. Lines loaded evict_last also outlive the call: do_bench's memset
# flush leaves them in L2, where they served whatever read the same addresses next (timed in one process, the
# other hint looked 4-7% faster for it). evict_first on the heads, no hint on the held columns' load or the heads'
# second read, .cg head loads, streaming stores, or the heads written before the held columns lost or tied.
SHARED_HEADS_L2_FRACTION = 0.5
SHARED_MAX_HEAD_WAVES = 2
# Many 16-bit rows a little too long for one program to hold take a program each that reads its row twice (REREAD:
# evict_last for (m, d), then evict_first for y, found again in L1 or L2), as the backward's wide rows do (BWD_TILES):
# nothing is held across the reduction and no program waits for another. H100, GB/s do_bench / CUDA graph, two
# alternating rounds on fresh copies (bench/results/h100/softmax_reread_tune.log, parts 3-5):
#   bf16 4096 x 65536: shared rows in waves 2556-2568 / 2580-2589 -> read twice, 32 warps 2869-2888 / 2869-2882
#   bf16 1024 / 768 x 65536 (7.8 / 5.8 waves of one program a multiprocessor): 2298-2337 / 2406-2422 ->
#     2476-2500 / 2466-2483, 2131-2245 / 2332-2336 -> 2338-2375 / 2344-2351
#   bf16 4096 x 49168 / 57344 / 61440 (75 / 87.5 / 94% of the tile): 2231-2233 / 2425-2431 / 2471-2478 ->
#     2341-2361 / 2652-2679 / 2785-2798; 4096 x 40000 (61%) lost: 2486-2488 -> 2006-2022
# Only with the first read in halves: read whole, the row spilled 28 registers (1959). Not kept: fp32 (a row of
# 65536 spills 52-56 registers on 32 warps: 1786 against 2757 shared), 16-bit rows read in frames (odd lengths:
# 12-16 spilled, 4096 x 50257 1924-2247 against 2143-2147 shared), and rows the fused kernel holds (fp32 16384 /
# 32768 gained 1-1.5%, bf16 16384 0.5-1%, bf16 32768 lost 11%: 2498 against 2803).
FWD_REREAD_MAX_COLS = {2: 65536}  # by element size: the longest row so read (none for fp32)
FWD_REREAD_WARPS = 32
FWD_REREAD_MIN_WAVES = 5  # ... while the rows make at least this many waves of one program a multiprocessor
FWD_REREAD_MIN_FILL = 0.75  # ... and fill at least this much of the tile
# Slots each program of a shared-row launch zeroes in one turn of _clear_slots.
SLOTS_CLEAR_BLOCK = 256


@dataclass(frozen=True)
class BackwardTiles:
    """How the backward (``plan_backward``) holds rows on chip, for one element size of y."""

    fused_max_cols: int  # longest row one program takes (y and dy loaded twice from BWD_REREAD_MIN_COLS on)
    shared_cols: int  # longer rows: columns each resident program holds of a shared row (y and dy held)
    shared_warps: int
    prefetch: int  # what a shared program fetches of its next row's part while the parts wait


# The backward reads two values a column (y and dy) where the forward reads one, so wide rows no longer fit
# a program's registers: the rule before held rows of up to 32768 columns on 16 warps (fp32 32768: 128
# registers, 36 spilled) and streamed longer ones (online: y and dy read twice from memory).
# * Rows of BWD_REREAD_MIN_COLS columns and more take a program each on BWD_REREAD_WARPS warps, which loads
#   y and dy once (evict_last) for sum(dy * y) and again (evict_first) for dx, from L1 or L2 (as
#   torch.compile's backward does): nothing is held across the reduction. Against the best holding tile, GB/s,
#   H100 (bench/results/h100/softmax_backward_tune.log, parts 6-7): fp32 4096 x 8192 / 16384 / 20000 / 30001 /
#   32768 2931 / 2987 / 2843 / 2646 / 2872 -> 2959 / 3017 / 2998 / 2914 / 2926; bf16 4096 x 8192 / 16384 /
#   65536 / 50257 2781 / 2918 / 2730 / 2514 -> 2844 / 2941 / 2896 / 2935, 32768 2922 -> 2851 (2936 -> 2942 in
#   part 6). At 4096 columns bf16 lost (2745 held on 8 warps, 2288 loaded twice on 32), so shorter rows keep
#   the forward's tiles.
# * Longer rows are shared by resident programs that hold shared_cols columns of y and dy each, publish the
#   sum(dy * y) of their part and wait for the row's other parts (_softmax_bwd_shared_rows_kernel). Parts, GB/s
#   (parts 2-3; parts of 16384 or 32768 columns loading y and dy twice lost at every shape, part 7):
#                               4096 x 65536  1024 x 128K  128 x 128K  16 x 1M  4096 x 50257
#    fp32  8192 cols, 4 warps       2888         2819         2481       2222       2586
#          ... into L2              2601         2554         2262       2259       2632
#          16384 cols, 8 warps      2732         2504         2109       2046       2488
#          online (the rule before) 1892         1829         1771       1681       1756
#    bf16  8192 cols, 4 warps           -        2440         1970       1761         -
#          ... into L2                  -        2568         2049       2030         -
#          online (the rule before)     -        1865         1594       1567         -
#   fp32 rows read in frames gain from the prefetch too: 16 x 1000003 1917 -> 2230.
# torch.compile's backward ran 3014 / 2938 / 1835 GB/s fp32 at 4096 x 20000 / 32768 / 65536 in the same process.
BWD_TILES = {
    4: BackwardTiles(32768, 8192, 4, PREFETCH_NONE.value),
    2: BackwardTiles(65536, 8192, 4, PREFETCH_L2.value),
}
BWD_FRAMED_PREFETCH = PREFETCH_L2.value
BWD_REREAD_MIN_COLS, BWD_REREAD_WARPS = 8192, 32


@dataclass(frozen=True)
class SoftmaxPlan:
    """How one softmax call runs: the regime and its tile sizes."""

    algorithm: str  # "fused" or "online"
    block_m: int
    block_n: int
    num_warps: int
    n_splits: int = 1  # programs sharing one row: online chunks, or (fused) parts held at once
    cols_per_split: int = 0
    head_cols: int = 0  # fused with shared rows: columns of each part streamed twice before the block_n held
    prefetch: int = 0  # fused with shared rows: PREFETCH_NONE or PREFETCH_L2 (the next part into L2)
    head_block: int = 0  # fused with shared rows and heads: columns of one streamed head block
    head_group: int = 1  # fused with shared rows and heads: columns of a head block that keep one state
    head_eviction: str = ""  # fused with shared rows and heads: L2 eviction hint of the head loads
    vec_cols: int = 1  # row_vectors() of the rows planned for (> 1: read in the frame of _row_frame; 0: shared
    # rows take the unaligned tiles). Fused tiles of several rows keep 1.
    reread: bool = False  # fused, a row a program: its tile loaded twice, not held across the reduction (REREAD)

    @property
    def shares_rows(self) -> bool:
        """True if resident programs share rows (the shared-row kernel): parts, or a part with a head."""
        return self.algorithm == "fused" and (self.n_splits > 1 or self.head_cols > 0)


def row_vectors(x2d: torch.Tensor, out_dtype: torch.dtype) -> int:
    """How the shared-row kernel reads the rows of ``x2d`` (n_rows, n_cols) and writes a contiguous output.

    1: every row starts 16-byte aligned in both, as Triton sees it (an aligned
    base, row stride and length multiples of 16 elements): vector loads and
    stores. The columns of one 16-byte vector (> 1): rows start anywhere, but
    ``x2d`` is contiguous, so each row is read from the first vector boundary in
    it (``_row_frame``; the output starts as far past a boundary as ``x2d``:
    ``rows_output``). 0: neither (a strided view of odd rows): one element a
    load, in ``SHARED_TILES_UNALIGNED``.
    """
    n_rows, n_cols = x2d.shape
    if x2d.stride(1) != 1:
        return 0
    if x2d.data_ptr() % 16 == 0 and n_cols % 16 == 0 and x2d.stride(0) % 16 == 0:
        return 1
    if (x2d.stride(0) == n_cols or n_rows == 1) and _frame_in_storage(x2d):
        return 16 // min(x2d.element_size(), out_dtype.itemsize)
    return 0


def _frame_in_storage(t: torch.Tensor) -> bool:
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


def output_lead(x2d: torch.Tensor, plan: SoftmaxPlan) -> int:
    """Elements past a 16-byte boundary at which the output of ``x2d`` under ``plan`` starts (``rows_output``):
    ``frame_lead(x2d)`` where the kernels read the rows in frames (``plan.vec_cols > 1``), else 0."""
    return frame_lead(x2d) if plan.vec_cols > 1 else 0


def input_frame(x2d: torch.Tensor, plan: SoftmaxPlan) -> tuple[torch.Tensor, int]:
    """``(x_arg, base_lead)``: what the forward kernels read ``x2d`` through under ``plan``: its frame
    (``aligned_frame``) where they read the rows in frames (``plan.vec_cols > 1``), else ``x2d`` and 0."""
    return aligned_frame(x2d) if plan.vec_cols > 1 else (x2d, 0)


def rows_output(n_rows: int, n_cols: int, dtype: torch.dtype, device: torch.device, lead: int) -> tuple:
    """``(y, frame)``: a contiguous (n_rows, n_cols) output that starts ``lead`` elements past a 16-byte
    boundary, as its input does (``aligned_frame``), and the same rows viewed from that boundary."""
    storage = torch.empty(n_rows * n_cols + lead, dtype=dtype, device=device)
    return storage[lead:].view(n_rows, n_cols), storage[:n_rows * n_cols].view(n_rows, n_cols)


def shares_rows_on_chip(device: torch.device) -> bool:
    """True if rows longer than one program's tile can be spread over resident programs on ``device``.

    Needs a GPU (the interpreter runs programs one at a time, so they cannot wait
    for each other) and a Triton with cooperative launches.
    """
    return device.type == "cuda" and cooperative_launch_supported()


def fused_warps(tile_elems: int, elems_per_thread: int | None = None) -> int:
    """Warps of a fused program holding ``tile_elems`` elements, ``elems_per_thread`` a thread (default
    ``FUSED_ELEMS_PER_THREAD``, read at the call: bench/softmax.py --tune sets it): 4 to 16."""
    return min(16, max(4, tile_elems // (32 * (elems_per_thread or FUSED_ELEMS_PER_THREAD))))


@functools.lru_cache(maxsize=4096)
def plan_softmax(
    n_rows: int, n_cols: int, device: torch.device, algorithm: str = "auto",
    block_n: int | None = None, n_splits: int | None = None, shared_rows: torch.dtype | None = None,
    vec_cols: int = 1,
) -> SoftmaxPlan:
    """Choose the regime and tile sizes for a (n_rows, n_cols) softmax; ``block_n``/``n_splits`` force them (tests).

    With ``shared_rows``, the input dtype (softmax only: masked softmax has no
    shared-row kernel), rows past ``FUSED_MAX_COLS`` stay fused, spread over
    programs that hold ``SHARED_TILES`` columns each, while
    ``shares_rows_on_chip(device)`` and the parts fit the device. Cached: the
    host cost of a call matters for small tensors (bench/results: a 4096 x 256
    softmax is 9 us on an H100).
    """
    shared = shared_rows is not None and algorithm in ("auto", "fused") and shares_rows_on_chip(device)
    if n_cols > FUSED_MAX_COLS and shared:
        reread = _plan_reread(n_rows, n_cols, device, shared_rows.itemsize, n_splits, vec_cols)
        if reread is not None:
            return reread
        return _plan_shared_rows(n_rows, n_cols, device, shared_rows.itemsize, n_splits, vec_cols)
    if algorithm == "auto":
        algorithm = "fused" if n_cols <= FUSED_MAX_COLS else "online"
    if algorithm == "fused":
        if n_cols > FUSED_MAX_COLS:
            raise ValueError(
                f"algorithm='fused' holds rows of at most {FUSED_MAX_COLS} elements on chip here "
                f"(longer ones only on a GPU, across programs), got {n_cols}; use algorithm='online' or 'auto'"
            )
        bn = triton.next_power_of_2(n_cols)
        tile = FUSED_SHORT_TILE_ELEMS if bn <= FUSED_SHORT_MAX_COLS else FUSED_TILE_ELEMS
        bm = max(1, min(tile // bn, triton.next_power_of_2(n_rows)))
        # Frames for one-row tiles only: rows short enough to share a tile ran one element a load as fast as
        # aligned ones (fp32 4096 x 1000 / 1008: 2120-2138 / 2119-2225 GB/s), and lost speed in frames (1896).
        return SoftmaxPlan("fused", bm, bn, fused_warps(bm * bn), vec_cols=max(vec_cols, 1) if bm == 1 else 1)

    if n_splits is None:
        n_sms = device_info(device).num_sms
        wanted = math.ceil(ONLINE_ITEMS_PER_SM * n_sms / n_rows) if n_rows < ONLINE_SPLIT_BELOW_ROWS_PER_SM * n_sms else 1
        n_splits = max(1, min(wanted, n_cols // (ONLINE_MIN_BLOCKS_PER_SPLIT * (block_n or SPLIT_BLOCK_N))))
    bn, warps = (ONLINE_BLOCK_N, ONLINE_NUM_WARPS) if n_splits == 1 else (SPLIT_BLOCK_N, SPLIT_NUM_WARPS)
    bn = max(block_n or min(bn, triton.next_power_of_2(n_cols)), vec_cols)  # chunks of whole vectors (_body_end)
    # Chunks are whole blocks, so only the row's last chunk has a ragged end.
    cols_per_split = triton.cdiv(triton.cdiv(n_cols, n_splits), bn) * bn
    n_splits = triton.cdiv(n_cols, cols_per_split)
    return SoftmaxPlan("online", 1, bn, warps, n_splits, cols_per_split, vec_cols=max(vec_cols, 1))


def plan_rows(x2d: torch.Tensor, out_dtype: torch.dtype, algorithm: str = "auto") -> SoftmaxPlan:
    """``plan_softmax`` for a softmax of the rows of ``x2d`` written in ``out_dtype``: shared rows planned
    for how the kernel reads them (``row_vectors``)."""
    return plan_softmax(x2d.shape[0], x2d.shape[1], x2d.device, algorithm, shared_rows=x2d.dtype,
                        vec_cols=row_vectors(x2d, out_dtype))


def _plan_reread(
    n_rows: int, n_cols: int, device: torch.device, itemsize: int, n_splits: int | None, vec_cols: int,
) -> SoftmaxPlan | None:
    """A program a row that reads it twice (``FWD_REREAD_MAX_COLS``), for many aligned rows (``vec_cols`` 1); else
    None. Rows read in frames or one element a load keep the shared rows' tiles (read twice, they spilled)."""
    block_n = triton.next_power_of_2(n_cols)
    if n_splits is not None or vec_cols != 1 or block_n > FWD_REREAD_MAX_COLS.get(itemsize, 0):
        return None
    many_rows = n_rows >= FWD_REREAD_MIN_WAVES * device_info(device).num_sms
    fills_tile = n_cols >= FWD_REREAD_MIN_FILL * block_n
    return SoftmaxPlan("fused", 1, block_n, FWD_REREAD_WARPS, reread=True) if many_rows and fills_tile else None


def _plan_shared_rows(
    n_rows: int, n_cols: int, device: torch.device, itemsize: int, n_splits: int | None, vec_cols: int,
) -> SoftmaxPlan:
    """Rows held by resident programs, ``SHARED_TILES[itemsize]`` columns each: a row in as many parts
    as it needs, in waves of as many rows as the programs hold; or in parts that also stream a head,
    when one row is longer than all programs hold, or when few rows would otherwise take several
    waves and one or two waves' heads fit L2 (SHARED_MAX_HEAD_WAVES, SHARED_HEADS_L2_FRACTION).
    Rows left to plain waves of parts take ``SHARED_WAVE_TILES`` (fp32 parts there stream a head too,
    unless read in frames). ``vec_cols`` (``row_vectors``): 0 takes the unaligned tiles; a row's frame
    (``_row_frame``) needs no more columns than the row."""
    tiles, wave_tiles = (SHARED_TILES, SHARED_WAVE_TILES) if vec_cols else (SHARED_TILES_UNALIGNED,) * 2
    wave_tile = wave_tiles[min(itemsize, 4)]
    if vec_cols > 1:
        wave_tile = dataclasses.replace(wave_tile, wave_head=0)  # heads lost on rows read in frames
    plan = _plan_shared_parts(n_rows, n_cols, device, itemsize, n_splits, tiles[min(itemsize, 4)], wave_tile)
    return dataclasses.replace(plan, vec_cols=vec_cols)


def _plan_shared_parts(
    n_rows: int, n_cols: int, device: torch.device, itemsize: int, n_splits: int | None, tile: SharedRowTile,
    wave_tile: SharedRowTile,
) -> SoftmaxPlan:
    """``_plan_shared_rows`` with one tile, and ``wave_tile`` for many rows in plain waves of parts."""
    info = device_info(device)
    programs = tile.programs_per_sm * info.num_sms
    parts = n_splits or triton.cdiv(n_cols, tile.cols)
    if parts > programs or triton.cdiv(n_cols, parts) > tile.cols:
        return _plan_with_heads(n_cols, min(parts, programs), tile)
    if n_splits is None and n_rows * parts > programs:
        # Fewer waves than the held parts alone need, each part streaming a head: as few as L2 allows.
        plain_waves = triton.cdiv(n_rows, programs // parts)
        for waves in range(1, min(plain_waves, SHARED_MAX_HEAD_WAVES + 1)):
            rows_per_wave = triton.cdiv(n_rows, waves)
            if rows_per_wave > programs:
                continue
            plan = _plan_with_heads(n_cols, programs // rows_per_wave, tile)
            heads = rows_per_wave * plan.n_splits * plan.head_cols * itemsize
            if plan.head_cols and heads <= SHARED_HEADS_L2_FRACTION * info.l2_bytes:
                return plan
        tile = wave_tile
        if tile.wave_head:
            return _plan_with_heads(n_cols, triton.cdiv(n_cols, tile.cols + tile.wave_head), tile)
        parts = triton.cdiv(n_cols, tile.cols)
    bn = triton.next_power_of_2(triton.cdiv(n_cols, parts))  # no wider than tile.cols
    return SoftmaxPlan("fused", 1, bn, tile.num_warps, triton.cdiv(n_cols, bn), bn, prefetch=tile.prefetch)


def _plan_with_heads(n_cols: int, parts: int, tile: SharedRowTile) -> SoftmaxPlan:
    """A row in at most ``parts`` parts, each [a head of whole head blocks | tile.cols held on chip]."""
    part_cols = max(triton.cdiv(triton.cdiv(n_cols, parts), tile.head_block) * tile.head_block, tile.cols)
    return SoftmaxPlan("fused", 1, tile.cols, tile.num_warps, triton.cdiv(n_cols, part_cols), part_cols,
                       part_cols - tile.cols, tile.prefetch, tile.head_block, tile.head_group, tile.head_eviction)


def launch_online(kernel, plan: SoftmaxPlan, n_rows: int, device: torch.device, args: tuple, **meta) -> None:
    """Run an online kernel's passes: one launch over whole rows, or partials then final when rows are split.

    The grid fills the device; any grid is correct (the kernels loop over their
    work items). ``meta``: the kernel's own constexprs besides ``PASS``,
    ``BLOCK_N`` and ``SPLITS_POW2``. The masked softmax's kernels run here too.
    """
    info = device_info(device)
    grid = (max(1, min(n_rows * plan.n_splits, info.num_sms * (info.max_warps_per_sm // plan.num_warps))),)
    # With split rows every chunk is its own program; the second launch walks them backwards (see the kernel).
    passes = (BOTH_PASSES,) if plan.n_splits == 1 else (PARTIAL_PASS, FINAL_PASS)
    for pass_ in passes:
        launch(kernel, grid, args, PASS=pass_.value, BLOCK_N=plan.block_n,
               SPLITS_POW2=triton.next_power_of_2(plan.n_splits), num_warps=plan.num_warps, **meta)


# Programs of the shared-row kernel resident at once on a device, per compiled configuration.
_RESIDENT_PROGRAMS: dict = {}


def _launch_shared_rows(
    x2d: torch.Tensor, y_arg: torch.Tensor, lse_arg: torch.Tensor, plan: SoftmaxPlan, write_y: bool, write_lse: bool,
) -> bool:
    """Run the shared-row kernel, each row spread over ``plan.n_splits`` programs, cooperatively.

    Returns False, launching nothing, where a row's programs cannot all be
    resident: on the interpreter (it would run them one by one, each waiting),
    or when the compiled kernel keeps fewer programs resident than a row has parts.
    """
    if not shares_rows_on_chip(x2d.device):
        return False

    def launch_with(slots: torch.Tensor, clear: torch.Tensor, n_clear: int) -> bool:
        shared = _shared_rows_launch(x2d, y_arg, lse_arg, (slots, clear, n_clear), plan, write_y, write_lse)
        if shared is not None:
            launch(_softmax_shared_rows_kernel, *shared[:2], **shared[2])
        return shared is not None

    return zeroed_slots(x2d.device, x2d.shape[0] * plan.n_splits, launch_with)


def _shared_rows_launch(
    x2d: torch.Tensor, y_arg: torch.Tensor, lse_arg: torch.Tensor, slots: tuple, plan: SoftmaxPlan,
    write_y: bool, write_lse: bool,
) -> tuple | None:
    """``(grid, args, meta)`` of the shared-row kernel's cooperative launch; None if a row's parts
    cannot all be resident. ``slots``: ``(slots, clear, n_clear)`` from ``zeroed_slots``. With
    ``plan.vec_cols > 1``, ``y_arg`` is the output's frame (``rows_output``).

    The grid holds as many whole rows at once as the device keeps programs
    resident (read off the compiled kernel), and never more: a program waiting
    for a part that cannot start would wait forever.
    """
    n_rows, n_cols = x2d.shape
    device = x2d.device
    x_arg, base_lead = input_frame(x2d, plan)
    args = (x_arg, y_arg, lse_arg, *slots, n_rows, n_cols, plan.n_splits, plan.head_cols, base_lead, x2d.stride(0),
            x2d.stride(1), n_cols)
    meta = dict(BLOCK_N=plan.block_n, HEAD_BLOCK_N=max(plan.head_block, 1), HEAD_GROUP_N=plan.head_group,
                HEAD_EVICTION=plan.head_eviction, PARTS_POW2=triton.next_power_of_2(plan.n_splits),
                HAS_HEAD=plan.head_cols > 0, PREFETCH=plan.prefetch,
                VEC_COLS=max(plan.vec_cols, 1),
                EVEN_COLS=plan.vec_cols <= 1 and n_cols == plan.n_splits * plan.cols_per_split,
                WRITE_Y=write_y, WRITE_LSE=write_lse,
                CLEAR_BLOCK=SLOTS_CLEAR_BLOCK, num_warps=plan.num_warps, launch_cooperative_grid=True)
    resident = resident_programs(_softmax_shared_rows_kernel, args, meta, device)
    if plan.n_splits > resident:
        return None
    rows_at_once = min(n_rows, resident // plan.n_splits)
    return (rows_at_once * plan.n_splits,), args, meta


def resident_programs(kernel, args: tuple, meta: dict, device: torch.device) -> int:
    """Programs of ``kernel``, compiled for ``args`` and ``meta`` (``num_warps`` among them), that the device
    keeps resident at once: the most a cooperative launch of programs that wait for each other may have.

    Keyed by the arguments' specialization too: n_cols % 16, say, compiles another kernel, whose registers
    (and so residency) can differ; a grid larger than what stays resident fails to launch.
    """
    key = (kernel, *meta.items(), *signature_key(args), device)
    if key not in _RESIDENT_PROGRAMS:
        info = device_info(device)
        compiled = kernel.warmup(*args, grid=(1,), **meta)
        _RESIDENT_PROGRAMS[key] = info.num_sms * (occupancy(compiled, meta["num_warps"], info) or 1)
    return _RESIDENT_PROGRAMS[key]


def _fused_launch(
    x2d: torch.Tensor, y_arg: torch.Tensor, lse_arg: torch.Tensor, out_dtype: torch.dtype, plan: SoftmaxPlan,
    write_y: bool, write_lse: bool,
) -> tuple:
    """``(grid, args, meta, residency_key)`` of the fused kernel's launch for ``x2d`` under ``plan``.

    Tiles wider than FUSED_PERSISTENT_MAX_COLS get a program each (the hardware
    schedules them; residency_key None); narrower ones a persistent grid, sized
    from the compiled kernel's residency once it is known (``persistent_grid``).
    """
    n_rows, n_cols = x2d.shape
    n_tiles = triton.cdiv(n_rows, plan.block_m)
    x_arg, base_lead = input_frame(x2d, plan)
    args = (x_arg, y_arg, lse_arg, n_rows, n_cols, base_lead, x2d.stride(0), x2d.stride(1), n_cols)
    meta = dict(BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, VEC_COLS=plan.vec_cols, REREAD=plan.reread,
                WRITE_Y=write_y, WRITE_LSE=write_lse, num_warps=plan.num_warps)
    if plan.block_n > FUSED_PERSISTENT_MAX_COLS:
        return (n_tiles,), args, meta, None
    key = ("softmax_fwd", plan, x2d.dtype, out_dtype, write_y, write_lse, x2d.device)
    return persistent_grid(n_tiles, x2d.device, key), args, meta, key


def softmax_forward(
    x2d: torch.Tensor, out_dtype: torch.dtype, plan: SoftmaxPlan, write_y: bool = True, write_lse: bool = False,
) -> tuple[torch.Tensor | None, torch.Tensor | None]:
    """Softmax (and/or log-sum-exp) of each row of ``x2d`` (n_rows, n_cols), column stride 1 or not.

    With ``plan.vec_cols > 1`` the kernels read the rows in frames (``_row_frame``)
    and write ``y`` through its frame (``rows_output``), which starts as far
    past a 16-byte boundary as ``x2d``.
    """
    n_rows, n_cols = x2d.shape
    y, y_frame = rows_output(n_rows, n_cols, out_dtype, x2d.device, output_lead(x2d, plan)) if write_y else (None, None)
    lse = torch.empty((n_rows,), dtype=torch.float32, device=x2d.device) if write_lse else None
    y_arg = y_frame if y is not None else x2d  # else a pointer the kernel never writes through
    lse_arg = lse if lse is not None else x2d
    if plan.shares_rows:
        if _launch_shared_rows(x2d, y_arg, lse_arg, plan, write_y, write_lse):
            return y, lse
        # The row's parts cannot all be resident: stream the rows, in the same frames.
        plan = plan_softmax(n_rows, n_cols, x2d.device, "online", vec_cols=plan.vec_cols)
    if plan.algorithm == "fused":
        grid, args, meta, residency_key = _fused_launch(x2d, y_arg, lse_arg, out_dtype, plan, write_y, write_lse)
        compiled = launch(_softmax_fused_kernel, grid, args, **meta)
        if residency_key is not None:
            record_residency(residency_key, compiled, plan.num_warps, x2d.device)
    else:
        split = plan.n_splits > 1  # partial states only between the two launches of split rows
        part_m = torch.empty(n_rows * plan.n_splits, dtype=torch.float32, device=x2d.device) if split else None
        part_d = torch.empty(n_rows * plan.n_splits, dtype=torch.float32, device=x2d.device) if split else None
        x_arg, base_lead = input_frame(x2d, plan)
        args = (x_arg, y_arg, lse_arg, part_m, part_d, n_rows, n_cols, plan.n_splits, plan.cols_per_split, base_lead,
                x2d.stride(0), x2d.stride(1), n_cols)
        launch_online(_softmax_online_kernel, plan, n_rows, x2d.device, args,
                      NUM_STAGES=ONLINE_NUM_STAGES, VEC_COLS=plan.vec_cols, WRITE_Y=write_y, WRITE_LSE=write_lse)
    return y, lse


def backward_vectors(y2d: torch.Tensor, dy2d: torch.Tensor, dx_dtype: torch.dtype, plan: SoftmaxPlan) -> int:
    """How the backward kernels read ``y2d`` and ``dy2d`` (n_rows, n_cols) and write a fresh contiguous ``dx``
    under ``plan`` (fused or online).

    The columns of one 16-byte vector (> 1): rows of a length that is not a
    multiple of 16 start at the same place in all three (bases 16-byte aligned,
    row stride ``n_cols``), so they are read and written in frames
    (``_row_frame``), vectorized; as in the forward, not in fused tiles of
    several rows. 1: as they come (Triton vectorizes rows of a multiple of 16
    from aligned bases itself; other layouts go one element a load).
    """
    n_rows, n_cols = y2d.shape
    if n_cols % 16 == 0 or plan.block_m > 1:
        return 1
    alike = all(t.stride(1) == 1 and (t.stride(0) == n_cols or n_rows == 1) and t.data_ptr() % 16 == 0
                for t in (y2d, dy2d))
    return 16 // min(y2d.element_size(), dy2d.element_size(), dx_dtype.itemsize) if alike else 1


@functools.lru_cache(maxsize=4096)
def plan_backward(plan: SoftmaxPlan, n_rows: int, n_cols: int, itemsize: int, device: torch.device) -> SoftmaxPlan:
    """The backward's plan for (n_rows, n_cols) rows of y (``itemsize`` bytes an element) whose forward ran under
    ``plan``, from ``BWD_TILES``.

    Online plans stay online. Rows shorter than ``BWD_REREAD_MIN_COLS`` keep
    the forward's tiles, y and dy held. Rows of up to ``fused_max_cols`` take a
    program each that loads y and dy twice (``reread``). Longer ones are shared
    by resident programs holding ``shared_cols`` columns each where the device
    shares rows (``shares_rows_on_chip``) and a row has no more parts than the
    device has multiprocessors, and streamed otherwise. Cached, as ``plan_softmax``.
    """
    if plan.algorithm == "online":
        return plan
    tiles = BWD_TILES[min(itemsize, 4)]
    block_n = triton.next_power_of_2(n_cols)
    if block_n < BWD_REREAD_MIN_COLS and not plan.shares_rows:
        return plan
    if block_n <= tiles.fused_max_cols:
        return SoftmaxPlan("fused", 1, block_n, BWD_REREAD_WARPS, reread=True)
    parts = triton.cdiv(n_cols, tiles.shared_cols)
    if shares_rows_on_chip(device) and parts <= device_info(device).num_sms:
        bn = triton.next_power_of_2(triton.cdiv(n_cols, parts))  # no wider than shared_cols
        return SoftmaxPlan("fused", 1, bn, tiles.shared_warps, triton.cdiv(n_cols, bn), bn, prefetch=tiles.prefetch)
    return plan_softmax(n_rows, n_cols, device, "online")


def _launch_backward_shared_rows(y2d: torch.Tensor, dy2d: torch.Tensor, dx: torch.Tensor, strides: tuple,
                                 plan: SoftmaxPlan, vec_cols: int) -> bool:
    """Run the shared-row backward kernel cooperatively, ``plan.n_splits`` programs a row, as many rows at
    once as stay resident; False, launching nothing, where a row's programs cannot all be resident."""
    n_rows, n_cols = y2d.shape
    device = y2d.device

    def launch_with(slots: torch.Tensor, clear: torch.Tensor, n_clear: int) -> bool:
        args = (y2d, dy2d, dx, slots, clear, n_clear, n_rows, n_cols, plan.n_splits, *strides)
        meta = dict(BLOCK_N=plan.block_n, PARTS_POW2=triton.next_power_of_2(plan.n_splits), PREFETCH=plan.prefetch,
                    VEC_COLS=vec_cols, EVEN_COLS=vec_cols == 1 and n_cols == plan.n_splits * plan.block_n,
                    CLEAR_BLOCK=SLOTS_CLEAR_BLOCK, num_warps=plan.num_warps, launch_cooperative_grid=True)
        resident = resident_programs(_softmax_bwd_shared_rows_kernel, args, meta, device)
        if plan.n_splits > resident:
            return False
        launch(_softmax_bwd_shared_rows_kernel, (min(n_rows, resident // plan.n_splits) * plan.n_splits,), args, **meta)
        return True

    return shares_rows_on_chip(device) and zeroed_slots(device, n_rows * plan.n_splits, launch_with)


def softmax_backward(y2d: torch.Tensor, dy2d: torch.Tensor, dx_dtype: torch.dtype, plan: SoftmaxPlan) -> torch.Tensor:
    """``dx = y * (dy - sum(dy * y))`` row by row, for rows whose forward ran under ``plan`` (``plan_backward``
    chooses the backward's); ``y2d`` is contiguous, ``dy2d`` any row-strided view."""
    n_rows, n_cols = y2d.shape
    plan = plan_backward(plan, n_rows, n_cols, y2d.element_size(), y2d.device)
    vec_cols = backward_vectors(y2d, dy2d, dx_dtype, plan)
    dx = torch.empty((n_rows, n_cols), dtype=dx_dtype, device=y2d.device)
    strides = (n_cols, dy2d.stride(0), dy2d.stride(1), n_cols)
    if plan.shares_rows:
        if vec_cols > 1:
            plan = dataclasses.replace(plan, prefetch=BWD_FRAMED_PREFETCH)
        if _launch_backward_shared_rows(y2d, dy2d, dx, strides, plan, vec_cols):
            return dx
        plan = plan_softmax(n_rows, n_cols, y2d.device, "online")  # the programs of a row cannot all wait
        vec_cols = backward_vectors(y2d, dy2d, dx_dtype, plan)
    if plan.algorithm == "fused":
        n_tiles = triton.cdiv(n_rows, plan.block_m)
        args = (y2d, dy2d, dx, n_rows, n_cols, *strides)
        meta = dict(BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, VEC_COLS=vec_cols, REREAD=plan.reread)
        if plan.block_n > FUSED_PERSISTENT_MAX_COLS:  # a program a tile, as in the forward (BWD_TILES' log)
            launch(_softmax_bwd_fused_kernel, (n_tiles,), args, num_warps=plan.num_warps, **meta)
        else:
            key = ("softmax_bwd", plan, vec_cols, y2d.dtype, dy2d.dtype, dx_dtype, y2d.device)
            launch_persistent(_softmax_bwd_fused_kernel, n_tiles, y2d.device, key, args, plan.num_warps, **meta)
    else:
        partials = (torch.empty(n_rows * plan.n_splits, dtype=torch.float32, device=y2d.device)
                    if plan.n_splits > 1 else None)
        args = (y2d, dy2d, dx, partials, n_rows, n_cols, plan.n_splits, plan.cols_per_split, *strides)
        launch_online(_softmax_bwd_online_kernel, plan, n_rows, y2d.device, args, NUM_STAGES=ONLINE_NUM_STAGES,
                      VEC_COLS=vec_cols)
    return dx


# ----------------------------------------------------------------------------- argument handling


def _check_args(x: torch.Tensor, dim: int, algorithm: str) -> int:
    """Validate ``x``, ``dim`` and ``algorithm``; return ``dim`` made non-negative."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    check_float_dtype("x", x)
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    return check_dim(dim, x.dim())


def as_rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    """View ``x`` as (rows, n) with the softmax dim last; copies only if that dim's stride is not 1
    or the other dims cannot be flattened into one row stride. A 2-D ``x`` over its last dim is
    returned as is (the common case: no tensor op on the host path)."""
    last = x.dim() - 1
    if dim == last and x.dim() == 2 and (x.stride(1) == 1 or x.shape[1] <= 1):
        return x
    if x.dim() == 0:
        moved = x.reshape(1)
    else:
        moved = x if dim == last else x.movedim(dim, -1)
    n = moved.shape[-1]
    if moved.stride(-1) != 1 and n > 1:
        moved = moved.contiguous()
    try:
        return moved.view(-1, n)
    except RuntimeError:
        return moved.reshape(-1, n)  # leading dims not collapsible: one copy


def from_rows(rows: torch.Tensor, like: torch.Tensor, dim: int) -> torch.Tensor:
    """Undo ``as_rows`` for an output of the same shape as ``like``."""
    if like.dim() == 0:
        return rows.reshape(())
    if dim == like.dim() - 1:
        return rows if like.dim() == 2 else rows.view(like.shape)
    return rows.view(like.movedim(dim, -1).shape).movedim(-1, dim)


def _softmax_as_rows(x: torch.Tensor, dim: int, out_dtype: torch.dtype, algorithm: str) -> tuple:
    """``(y2d, plan)``: the softmax of ``x`` viewed as rows along ``dim``, and the plan it ran with."""
    x2d = as_rows(x, dim)
    plan = plan_rows(x2d, out_dtype, algorithm)
    y2d, _ = softmax_forward(x2d, out_dtype, plan)
    return y2d, plan


def softmax_rows(x: torch.Tensor, dim: int, out_dtype: torch.dtype, algorithm: str = "auto") -> torch.Tensor:
    """Softmax of checked, non-empty ``x`` along ``dim`` (made non-negative) on the kernels, without autograd."""
    y2d, _ = _softmax_as_rows(x, dim, out_dtype, algorithm)
    return from_rows(y2d, x, dim)


def reduced_shape(x: torch.Tensor, dim: int) -> tuple:
    """``x``'s shape without ``dim`` (``()`` for a 0-d ``x``): the shape of a reduction over ``dim``."""
    return tuple(x.shape[:dim] + x.shape[dim + 1:]) if x.dim() > 0 else ()


def logsumexp_rows(x: torch.Tensor, dim: int) -> torch.Tensor:
    """Log-sum-exp of checked, non-empty ``x`` along ``dim`` (made non-negative) on the kernels, in ``x``'s dtype."""
    x2d = as_rows(x, dim)
    plan = plan_rows(x2d, x.dtype)
    _, lse = softmax_forward(x2d, x.dtype, plan, write_y=False, write_lse=True)
    return lse.to(x.dtype).view(reduced_shape(x, dim))


# ----------------------------------------------------------------------------- autograd


class _Softmax(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int, algorithm: str, out_dtype: torch.dtype) -> torch.Tensor:
        y2d, plan = _softmax_as_rows(x, dim, out_dtype, algorithm)
        ctx.save_for_backward(y2d)
        ctx.dim, ctx.plan, ctx.x_dtype, ctx.x_shape = dim, plan, x.dtype, x.shape
        return from_rows(y2d, x, dim)

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        (y2d,) = ctx.saved_tensors
        dy2d = as_rows(dy, ctx.dim)
        dx2d = softmax_backward(y2d, dy2d, ctx.x_dtype, ctx.plan)
        return from_rows(dx2d, dy, ctx.dim), None, None, None


def logsumexp_grad(x: torch.Tensor, lse: torch.Tensor, y: torch.Tensor, g: torch.Tensor, dim: int) -> torch.Tensor:
    """The gradient of ``lse = logsumexp(x, dim)`` from ``y = softmax(x, dim)`` (fp32) and the incoming ``g``:
    ``g · softmax(x)``, in x's dtype. A row whose LSE is ``+inf`` gets ``torch.logsumexp``'s ``g · e^(x - lse)``
    instead: NaN at its ``+inf`` entries, 0 elsewhere (where softmax is NaN throughout)."""
    if x.dim() > 0:
        g, lse = g.unsqueeze(dim), lse.unsqueeze(dim)
    y = torch.where(torch.isposinf(lse), torch.exp(x.float() - lse.float()), y)
    return (y * g).to(x.dtype)


class _LogSumExp(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x: torch.Tensor, dim: int) -> torch.Tensor:
        lse = logsumexp_rows(x, dim)
        ctx.save_for_backward(x, lse)
        ctx.dim = dim
        return lse

    @staticmethod
    def backward(ctx, g: torch.Tensor):
        x, lse = ctx.saved_tensors
        y = _Softmax.apply(x, ctx.dim, "auto", torch.float32)  # d lse / dx = softmax(x)
        return logsumexp_grad(x, lse, y, g, ctx.dim), None


# ----------------------------------------------------------------------------- public API


def softmax(x: torch.Tensor, dim: int = -1, *, algorithm: str = "auto", dtype: torch.dtype | None = None) -> torch.Tensor:
    """Softmax of ``x`` along ``dim``, like ``torch.softmax``, on flashlite's Triton kernels.

    Args:
        x: float32, float16 or bfloat16 tensor of any shape; strided views are read
            in place when ``dim`` has stride 1.
        dim: the dimension to normalise over.
        algorithm: ``"fused"`` (row on chip: up to ``FUSED_MAX_COLS`` in one
            program; on a GPU, many 16-bit rows of up to 65536 a program each,
            read twice, and longer rows across resident programs, each part
            streaming a head twice where the row is longer than they hold;
            streamed as by ``"online"`` where a launch cannot keep them resident),
            ``"online"`` (blocked two-pass, any length, long rows split across
            programs), or ``"auto"`` (fused while the row fits, online after).
        dtype: output dtype (float32/float16/bfloat16); default ``x.dtype``.
            Accumulation is always fp32.

    Returns:
        A tensor of ``x``'s shape. NaN in a row gives NaN for the row; a row of
        ``-inf`` gives NaN, as in ``torch.softmax``. Differentiable.

    CPU tensors run the kernels through Triton's interpreter under
    ``TRITON_INTERPRET=1``, else ``torch.softmax`` in fp32.
    """
    dim = _check_args(x, dim, algorithm)
    out_dtype = x.dtype if dtype is None else dtype
    if out_dtype not in (torch.float32, torch.float16, torch.bfloat16):
        raise TypeError(f"dtype must be float32, float16 or bfloat16, got {out_dtype}")
    if is_compiling():  # one node of the graph (flashlite.ops)
        return torch.ops.flashlite.softmax(x, dim, algorithm, out_dtype)
    if x.numel() == 0:
        return torch.empty_like(x, dtype=out_dtype)
    if not runs_kernels(x):
        return torch.softmax(x.float(), dim).to(out_dtype)
    if torch.is_grad_enabled() and x.requires_grad:
        return _Softmax.apply(x, dim, algorithm, out_dtype)
    key = repeat_key(x, dim, out_dtype, algorithm)
    repeat = _REPEATS.get(key, _UNSEEN)
    if repeat is _UNSEEN:
        y = softmax_rows(x, dim, out_dtype, algorithm)
        if len(_REPEATS) >= REPEATS_KEPT:
            _REPEATS.clear()
        _REPEATS[key] = _repeat_launch(x, dim, out_dtype, algorithm)
        return y
    return softmax_rows(x, dim, out_dtype, algorithm) if repeat is None else repeat(x)


# Repeated calls: a second call with the same shape, strides, dtypes, dim, algorithm, device and
# address of x modulo 16 repeats the first one's launch directly, when that was one launch of the
# fused or the shared-row kernel on a contiguous x over its last dim: the host cost decides small
# softmaxes (4096 x 256 bf16 runs 8 us on the H100, while the general path took 45 us of its host's
# time a call, this one 20, torch.softmax 8-11; bench/results/h100/host_overhead.log), and do_bench
# hides less of it than the L2 flush before each run takes. None: the general path serves the call.
_REPEATS: dict = {}
_UNSEEN = object()
REPEATS_KEPT = 4096  # signatures remembered before the cache starts over


def repeat_key(x: torch.Tensor, dim: int, out_dtype: torch.dtype, algorithm: str) -> tuple:
    """The signature under which ``_REPEATS`` keeps the launch of a softmax of ``x`` (``dim`` non-negative)."""
    return (x.shape, x.stride(), x.dtype, out_dtype, dim, algorithm, x.device,
            torch.cuda.current_device() if x.is_cuda else None, x.data_ptr() % 16)


def clear_plans() -> None:
    """Forget every softmax plan and repeated launch, after changing this module's tile constants.

    ``plan_softmax.cache_clear()`` alone would leave the launches that repeated
    calls replay (``_REPEATS``), made with the old constants.
    """
    plan_softmax.cache_clear()
    plan_backward.cache_clear()
    _REPEATS.clear()


def _repeat_launch(x: torch.Tensor, dim: int, out_dtype: torch.dtype, algorithm: str):
    """``f(x) -> y``: the launch the general path just made for ``x``, for tensors of the same signature; or None."""
    if dim != x.dim() - 1 or not x.is_contiguous():
        return None
    n_cols = x.shape[-1]
    x2d = x.view(-1, n_cols)
    plan = plan_rows(x2d, out_dtype, algorithm)
    y_like = torch.empty((1,), dtype=out_dtype, device=x.device)  # the output's dtype and alignment
    n_slots = 0
    lead = output_lead(x2d, plan)  # rows in frames from an unaligned base: x[1:] of odd rows (the key holds data_ptr % 16)
    if plan.shares_rows:
        if not shares_rows_on_chip(x.device):
            return None
        n_slots = x2d.shape[0] * plan.n_splits
        slots_like = torch.empty((SLOTS_ALIGN,), dtype=torch.int64, device=x.device)
        shared = _shared_rows_launch(x2d, y_like, x2d, (slots_like, slots_like, SLOTS_ALIGN), plan, True, False)
        if shared is None:
            return None
        kernel, (grid, args, meta) = _softmax_shared_rows_kernel, shared
        sizes = args[6:]
    elif plan.algorithm == "fused":
        kernel = _softmax_fused_kernel
        grid, args, meta, _ = _fused_launch(x2d, y_like, x2d, out_dtype, plan, True, False)
        sizes = args[3:]
    else:
        return None
    run = compiled_launcher(kernel, grid, args, **meta)
    if run is None:
        return None

    def repeat(x: torch.Tensor) -> torch.Tensor:
        # The kernels read pointers only: x and y stand for their (rows, n_cols) views.
        if lead:
            if not _frame_in_storage(x):  # a storage that starts unaligned (from DLPack, say): no frame
                return softmax_rows(x, x.dim() - 1, out_dtype, algorithm)
            y, y_arg = rows_output(x.numel() // n_cols, n_cols, out_dtype, x.device, lead)
            y, x_arg = y.view(x.shape), aligned_frame(x)[0]
        else:
            y = y_arg = torch.empty_like(x, dtype=out_dtype)  # contiguous, as x
            x_arg = x
        if n_slots:
            zeroed_slots(x.device, n_slots,
                         lambda slots, clear, n_clear: run((x_arg, y_arg, x, slots, clear, n_clear, *sizes)))
        else:
            run((x_arg, y_arg, x, *sizes))
        return y

    return repeat


def logsumexp(x: torch.Tensor, dim: int = -1) -> torch.Tensor:
    """``log(sum(exp(x), dim))`` from the online-softmax core's final state, ``m + log d``.

    Args:
        x: float32, float16 or bfloat16 tensor; ``dim`` must be in range.
        dim: the dimension reduced (removed from the result).

    Returns:
        A tensor of ``x``'s dtype without ``dim``: ``-inf`` for a row of ``-inf``,
        NaN for a row with NaN, like ``torch.logsumexp``. Differentiable
        (the gradient is ``softmax(x)``). This is the quantity attention returns as LSE.
    """
    dim = _check_args(x, dim, "auto")
    if is_compiling():  # one node of the graph (flashlite.ops)
        return torch.ops.flashlite.logsumexp(x, dim)
    if x.numel() == 0 or not runs_kernels(x):
        return torch.logsumexp(x.float(), dim).to(x.dtype)
    return _LogSumExp.apply(x, dim)
