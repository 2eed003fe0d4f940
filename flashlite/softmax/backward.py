"""The softmax backward, ``dx = y * (dy - sum(dy * y))``, in the forward's regimes.

Rows on chip (a tile of rows; wide rows a program each that loads y and dy
twice rather than holding them); on Hopper, rows over a thread-block cluster
(``flashlite.softmax.cluster``); longer rows shared by resident programs that
trade their ``sum(dy * y)`` (``flashlite.core.partials.share_partial_sums``);
or streamed (online, split when rows are few). ``plan.plan_backward`` chooses
from ``tuning.BWD_TILES``.
"""

from __future__ import annotations

import dataclasses

import torch
import triton
import triton.language as tl

from ..core.partials import FINAL_PASS, PARTIAL_PASS, clear_slots, share_partial_sums, work_item, zeroed_slots
from ..core.runtime import launch, launch_persistent
from ..core.tiles import tile_rows
from . import tuning
from .cluster import launch_backward_cluster
from .frames import (
    FIRST_OF_TWO_READS, HOLD_READ, SECOND_OF_TWO_READS, aligned_body_end, frame_rows, frame_start, in_frame, in_row, row_edges,
    row_frame,
)
from .online import launch_online
from .plan import (
    SoftmaxPlan, backward_vectors, plan_backward, plan_softmax, shares_rows_on_chip, short_backward_rows,
)
from .shared_rows import prefetch_to_l2, resident_programs
from .tuning import PREFETCH_L2


@triton.jit
def _load_grad_inputs(y_ptrs, dy_ptrs, mask, EVICTION: tl.constexpr):
    """``(y, dy)`` as fp32 at the pointers given (0 where masked), loaded with the L2 ``EVICTION`` hint."""
    y = tl.load(y_ptrs, mask=mask, other=0.0, eviction_policy=EVICTION).to(tl.float32)
    dy = tl.load(dy_ptrs, mask=mask, other=0.0, eviction_policy=EVICTION).to(tl.float32)
    return y, dy


@triton.jit
def softmax_bwd_fused_kernel(
    y_ptr, dy_ptr, dx_ptr,
    n_rows, n_cols,
    stride_ym, stride_dym, stride_dyn, stride_dxm,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, VEC_COLS: tl.constexpr, REREAD: tl.constexpr,
):
    # With VEC_COLS > 1 (rows that start unaligned) y, dy and dx are read and written in the rows' frames, as
    # x and y in softmax_fused_kernel: every pointer 16-byte aligned at row 0, one row stride, stride_dyn = 1.
    # With REREAD the tile's y and dy are loaded again for dx (a row's edges stay held).
    FIRST_READ: tl.constexpr = FIRST_OF_TWO_READS if REREAD else HOLD_READ
    cols = tl.arange(0, BLOCK_N)[None, :]
    col_ok = cols < n_cols  # without frames
    n_tiles = tl.cdiv(n_rows, BLOCK_M)
    for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        rows = tile_rows(tile, BLOCK_M)
        row_ok = (rows < n_rows)[:, None]
        y_starts, pre, hi = frame_rows(rows, n_cols, 0, stride_ym, VEC_COLS)
        dy_starts, _, _ = frame_rows(rows, n_cols, 0, stride_dym, VEC_COLS)
        dx_starts, _, _ = frame_rows(rows, n_cols, 0, stride_dxm, VEC_COLS)
        ok = row_ok & in_frame(cols, col_ok, hi, VEC_COLS)
        y, dy = _load_grad_inputs(y_ptr + y_starts + cols, dy_ptr + dy_starts + cols * stride_dyn, ok, FIRST_READ)
        dot = tl.sum(y * dy, axis=1)
        if VEC_COLS > 1:
            edge_cols, edge_ok = row_edges(pre, hi, n_cols, VEC_COLS)
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
def softmax_bwd_online_kernel(
    y_ptr, dy_ptr, dx_ptr, part_ptr,
    n_rows, n_cols, n_splits, cols_per_split,
    stride_ym, stride_dym, stride_dyn, stride_dxm,
    BLOCK_N: tl.constexpr, SPLITS_POW2: tl.constexpr, PASS: tl.constexpr, NUM_STAGES: tl.constexpr,
    VEC_COLS: tl.constexpr,
):
    # Frames as in softmax_bwd_fused_kernel; a row's first chunk also takes its edges.
    n_items = n_rows * n_splits
    for item in tl.range(tl.program_id(0), n_items, tl.num_programs(0)):
        row, col_start, col_end = work_item(item, n_items, n_splits, cols_per_split, n_cols, PASS)
        pre, hi = row_frame(row * stride_ym, n_cols, VEC_COLS)
        y_row = y_ptr + frame_start(0, row * stride_ym, pre, VEC_COLS)
        dy_row = dy_ptr + frame_start(0, row * stride_dym, pre, VEC_COLS)
        body_end = aligned_body_end(col_end, hi, VEC_COLS)
        if VEC_COLS > 1:
            edge_cols, edge_ok = row_edges(pre, hi, n_cols, VEC_COLS)
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
            dx_row = dx_ptr + frame_start(0, row * stride_dxm, pre, VEC_COLS)
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
def softmax_bwd_shared_rows_kernel(
    y_ptr, dy_ptr, dx_ptr, slot_ptr, clear_ptr, n_clear,
    n_rows, n_cols, n_parts,
    stride_ym, stride_dym, stride_dyn, stride_dxm,
    BLOCK_N: tl.constexpr, PARTS_POW2: tl.constexpr, PREFETCH: tl.constexpr, VEC_COLS: tl.constexpr,
    EVEN_COLS: tl.constexpr, CLEAR_BLOCK: tl.constexpr,
):
    # The backward of rows that n_parts resident programs hold between them, laid out as in
    # softmax_shared_rows_kernel without heads: program pid = k * n_parts + part holds columns
    # [part * BLOCK_N, (part + 1) * BLOCK_N) of y and dy of rows k, k + rows_at_once, ..., publishes the
    # sum(dy * y) of its part, waits for the row's other parts (share_partial_sums) and writes its part of
    # dx. Frames as in softmax_bwd_fused_kernel (part 0 takes a row's edges); slots as in the forward. The parts
    # hold y and dy: loading them again for dx was slower (TUNING.md#backward-tiles).
    clear_slots(clear_ptr, n_clear, CLEAR_BLOCK)
    part = tl.program_id(0) % n_parts
    row_step = tl.num_programs(0) // n_parts
    cols = part * BLOCK_N + tl.arange(0, BLOCK_N)[None, :]
    for row in tl.range(tl.program_id(0) // n_parts, n_rows, row_step):
        row = tl.cast(row, tl.int64)  # rows times strides can pass 2^31
        rows = row + tl.arange(0, 1)
        y_starts, pre, hi = frame_rows(rows, n_cols, 0, stride_ym, VEC_COLS)
        dy_starts, _, _ = frame_rows(rows, n_cols, 0, stride_dym, VEC_COLS)
        dx_starts, _, _ = frame_rows(rows, n_cols, 0, stride_dxm, VEC_COLS)
        ok = in_row(cols, hi, EVEN_COLS)
        y, dy = _load_grad_inputs(y_ptr + y_starts + cols, dy_ptr + dy_starts + cols * stride_dyn, ok, HOLD_READ)
        part_dot = tl.sum(y * dy, axis=1)
        if VEC_COLS > 1:  # masks from tl.where: the interpreter's scalar & is int32
            edge_cols, edge_ok = row_edges(pre, hi, n_cols, VEC_COLS)
            edge_ok = tl.where(part == 0, edge_ok, False)
            y_edge, dy_edge = _load_grad_inputs(y_ptr + y_starts + edge_cols, dy_ptr + dy_starts + edge_cols, edge_ok,
                                                HOLD_READ)
            part_dot += tl.sum(y_edge * dy_edge, axis=1)
        if PREFETCH == PREFETCH_L2:  # the next row's part of y and dy travels to L2 while the parts meet
            if row + row_step < n_rows:
                prefetch_to_l2(y_ptr + (row + row_step) * stride_ym, part * BLOCK_N, n_cols, 1, BLOCK_N)
                prefetch_to_l2(dy_ptr + (row + row_step) * stride_dym, part * BLOCK_N, n_cols, stride_dyn, BLOCK_N)
        dot = share_partial_sums(slot_ptr + rows * n_parts, part, n_parts, part_dot, PARTS_POW2)
        if VEC_COLS > 1:
            tl.store(dx_ptr + dx_starts + edge_cols, (y_edge * (dy_edge - dot[:, None])).to(dx_ptr.dtype.element_ty),
                     mask=edge_ok)
        tl.store(dx_ptr + dx_starts + cols, (y * (dy - dot[:, None])).to(dx_ptr.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------- host side


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
                    CLEAR_BLOCK=tuning.SLOTS_CLEAR_BLOCK, num_warps=plan.num_warps, launch_cooperative_grid=True)
        resident = resident_programs(softmax_bwd_shared_rows_kernel, args, meta, device)
        if plan.n_splits > resident:
            return False
        launch(softmax_bwd_shared_rows_kernel, (min(n_rows, resident // plan.n_splits) * plan.n_splits,), args, **meta)
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
    if plan.algorithm == "cluster":
        launch_backward_cluster(y2d, dy2d, dx, plan)
        return dx
    if plan.shares_rows:
        if vec_cols > 1:
            plan = dataclasses.replace(plan, prefetch=tuning.BWD_FRAMED_PREFETCH)
        if _launch_backward_shared_rows(y2d, dy2d, dx, strides, plan, vec_cols):
            return dx
        plan = plan_softmax(n_rows, n_cols, y2d.device, "online")  # the programs of a row cannot all wait
        vec_cols = backward_vectors(y2d, dy2d, dx_dtype, plan)
    if plan.algorithm == "fused":
        n_tiles = triton.cdiv(n_rows, plan.block_m)
        args = (y2d, dy2d, dx, n_rows, n_cols, *strides)
        meta = dict(BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, VEC_COLS=vec_cols, REREAD=plan.reread)
        # A program a tile, as in the forward past FUSED_PERSISTENT_MAX_COLS, and for short rows (BWD_SHORT_TILES)
        if plan.block_n > tuning.FUSED_PERSISTENT_MAX_COLS or short_backward_rows(plan.block_n, y2d.element_size()):
            launch(softmax_bwd_fused_kernel, (n_tiles,), args, num_warps=plan.num_warps, **meta)
        else:
            key = ("softmax_bwd", plan, vec_cols, y2d.dtype, dy2d.dtype, dx_dtype, y2d.device)
            launch_persistent(softmax_bwd_fused_kernel, n_tiles, y2d.device, key, args, plan.num_warps, **meta)
    else:
        partials = (torch.empty(n_rows * plan.n_splits, dtype=torch.float32, device=y2d.device)
                    if plan.n_splits > 1 else None)
        args = (y2d, dy2d, dx, partials, n_rows, n_cols, plan.n_splits, plan.cols_per_split, *strides)
        launch_online(softmax_bwd_online_kernel, plan, n_rows, y2d.device, args, NUM_STAGES=tuning.ONLINE_NUM_STAGES,
                      VEC_COLS=vec_cols)
    return dx
