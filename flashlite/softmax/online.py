"""The online softmax kernel: a row streamed in blocks, twice (statistics, then normalise), split when rows are few.

Pass 1 folds the blocks into one running state a lane (the core's
``online_update_lanes``: no reduction inside the loop) and merges the lanes;
pass 2 re-reads the blocks, last first (most likely still in L2), and writes
``y = e^(x - m) / d``. When there are too few rows to fill the GPU each row is
split across programs: a first launch writes each part's state, a second
merges a row's partials (``flashlite.core.partials``) and normalises its part.
``launch_online`` runs these passes for this kernel and the masked softmax's.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.online_softmax import (
    LOG2E, final_weights, merge_partial_states, online_update, online_update_lanes, state_logsumexp,
)
from ..core.partials import BOTH_PASSES, FINAL_PASS, PARTIAL_PASS, work_item
from ..core.runtime import device_info, launch
from .frames import aligned_body_end, frame_start, row_edges, row_frame
from .plan import SoftmaxPlan


@triton.jit
def softmax_online_kernel(
    x_ptr, y_ptr, lse_ptr, part_m_ptr, part_d_ptr,
    n_rows, n_cols, n_splits, cols_per_split, base_lead,
    stride_xm, stride_xn, stride_ym,
    BLOCK_N: tl.constexpr, SPLITS_POW2: tl.constexpr, PASS: tl.constexpr, NUM_STAGES: tl.constexpr,
    VEC_COLS: tl.constexpr, WRITE_Y: tl.constexpr, WRITE_LSE: tl.constexpr,
):
    # Columns are those of the row's frame, as in softmax_fused_kernel; a row's first chunk also takes its edges.
    n_items = n_rows * n_splits
    for item in tl.range(tl.program_id(0), n_items, tl.num_programs(0)):
        row, col_start, col_end = work_item(item, n_items, n_splits, cols_per_split, n_cols, PASS)
        pre, hi = row_frame(base_lead + row * stride_xm, n_cols, VEC_COLS)
        x_row = x_ptr + frame_start(base_lead, row * stride_xm, pre, VEC_COLS)
        y_row = y_ptr + frame_start(base_lead, row * stride_ym, pre, VEC_COLS)
        body_end = aligned_body_end(col_end, hi, VEC_COLS)
        if VEC_COLS > 1:
            edge_cols, edge_ok = row_edges(pre, hi, n_cols, VEC_COLS)
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


# ----------------------------------------------------------------------------- host side


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
