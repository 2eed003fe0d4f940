"""The fused softmax kernel: a tile of rows held on chip, one read of ``x`` and one write of ``y``.

Rows short enough share a tile (``BLOCK_M`` rows); a program loops over tiles
on a persistent grid up to ``tuning.FUSED_PERSISTENT_MAX_COLS`` columns, and
wider tiles get a program each. A row of up to ``tuning.FUSED_MAX_COLS``
elements fits one program's registers; 16-bit rows of up to 65536 are read
twice instead of held (``REREAD``). Rows that start unaligned are read in
frames (``flashlite.softmax.frames``). With ``WRITE_LSE`` the log-sum-exp is
written too (``logsumexp``).
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.online_softmax import LOG2E, empty_state, final_weights, normalize, online_update, state_logsumexp
from ..core.runtime import persistent_grid
from ..core.tiles import tile_rows
from . import tuning
from .frames import FIRST_OF_TWO_READS, SECOND_OF_TWO_READS, frame_rows, in_frame, row_edges
from .plan import SoftmaxPlan, input_frame


@triton.jit
def softmax_fused_kernel(
    x_ptr, y_ptr, lse_ptr,
    n_rows, n_cols, base_lead,
    stride_xm, stride_xn, stride_ym,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, VEC_COLS: tl.constexpr, REREAD: tl.constexpr,
    WRITE_Y: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    # Columns are those of each row's frame (row_frame): with VEC_COLS > 1 (rows that start unaligned:
    # stride_xm = stride_ym, stride_xn = 1) a row's whole vectors are read from an aligned address and
    # its edges apart; x_ptr and y_ptr are then 16-byte aligned, base_lead elements before row 0 of each.
    # With REREAD (one row a tile) the row is read twice, nothing held across the reduction: first as two
    # halves, both in flight, folded into the state one after the other (one half widened to fp32 at a
    # time: a 16-bit row of 65536 widened whole spills on 32 warps), then whole for y, its weights worked
    # out again from x under the final state. A row's edges stay held.
    HALF_N: tl.constexpr = BLOCK_N // 2
    cols = tl.arange(0, BLOCK_N)[None, :]
    col_ok = cols < n_cols  # without frames; a frame's whole vectors end at its row's own bound
    n_tiles = tl.cdiv(n_rows, BLOCK_M)
    for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        rows = tile_rows(tile, BLOCK_M)
        row_ok = (rows < n_rows)[:, None]
        x_starts, pre, hi = frame_rows(rows, n_cols, base_lead, stride_xm, VEC_COLS)
        y_starts, _, _ = frame_rows(rows, n_cols, base_lead, stride_ym, VEC_COLS)
        x_rows, y_rows = x_ptr + x_starts, y_ptr + y_starts
        ok = row_ok & in_frame(cols, col_ok, hi, VEC_COLS)
        if REREAD:
            low_cols = tl.arange(0, HALF_N)[None, :]
            high_cols = low_cols + HALF_N
            low_ok = row_ok & in_frame(low_cols, low_cols < n_cols, hi, VEC_COLS)
            high_ok = row_ok & in_frame(high_cols, high_cols < n_cols, hi, VEC_COLS)
            x_low = tl.load(x_rows + low_cols * stride_xn, mask=low_ok, other=float("-inf"),
                            eviction_policy=FIRST_OF_TWO_READS)
            x_high = tl.load(x_rows + high_cols * stride_xn, mask=high_ok, other=float("-inf"),
                             eviction_policy=FIRST_OF_TWO_READS)
        else:
            x = tl.load(x_rows + cols * stride_xn, mask=ok, other=float("-inf"))
        m, d = empty_state(BLOCK_M)
        if VEC_COLS > 1:  # the edges first: their few weights are worked out again from the final state
            edge_cols, edge_ok = row_edges(pre, hi, n_cols, VEC_COLS)
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


# ----------------------------------------------------------------------------- host side


def fused_launch(
    x2d: torch.Tensor, y_arg: torch.Tensor, lse_arg: torch.Tensor, out_dtype: torch.dtype, plan: SoftmaxPlan,
    write_y: bool, write_lse: bool,
) -> tuple:
    """``(grid, args, meta, residency_key)`` of the fused kernel's launch for ``x2d`` under ``plan``.

    Tiles wider than tuning.FUSED_PERSISTENT_MAX_COLS get a program each (the hardware
    schedules them; residency_key None); narrower ones a persistent grid, sized
    from the compiled kernel's residency once it is known (``persistent_grid``).
    """
    n_rows, n_cols = x2d.shape
    n_tiles = triton.cdiv(n_rows, plan.block_m)
    x_arg, base_lead = input_frame(x2d, plan)
    args = (x_arg, y_arg, lse_arg, n_rows, n_cols, base_lead, x2d.stride(0), x2d.stride(1), n_cols)
    meta = dict(BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, VEC_COLS=plan.vec_cols, REREAD=plan.reread,
                WRITE_Y=write_y, WRITE_LSE=write_lse, num_warps=plan.num_warps)
    if plan.block_n > tuning.FUSED_PERSISTENT_MAX_COLS:
        return (n_tiles,), args, meta, None
    key = ("softmax_fwd", plan, x2d.dtype, out_dtype, write_y, write_lse, x2d.device)
    return persistent_grid(n_tiles, x2d.device, key), args, meta, key
