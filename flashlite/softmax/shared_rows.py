"""Rows longer than one program holds, held on chip by several resident programs that merge their states.

Every program holds a part of a row, publishes its part's ``(m, d)``, waits for
the row's other parts (``flashlite.core.partials.share_partial_states``), merges
them and normalises the part it still holds: one read and one write, where the
online kernel reads twice. All of a row's programs must be resident, so the
launch is cooperative and sized from the compiled kernel (``resident_programs``).
A row longer than the resident programs hold is still shared by them: each part
first streams a head of whole blocks, holds the rest, and reads the head again
from L2 once the row's state is known. GPU only: the interpreter runs programs
one at a time.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.online_softmax import (
    LOG2E, empty_state, final_weights, merge_partial_states, normalize, online_update, online_update_lanes,
    rescale_factor, state_logsumexp,
)
from ..core.partials import clear_slots, share_partial_states, zeroed_slots
from ..core.runtime import device_info, launch, occupancy, signature_key
from . import tuning
from .frames import frame_start, in_row, row_edges, row_frame
from .plan import SoftmaxPlan, input_frame, shares_rows_on_chip
from .tuning import PREFETCH_L2


# Bytes of one L2 sector, what a prefetch fetches at least.
L2_SECTOR_BYTES = tl.constexpr(32)


@triton.jit
def prefetch_to_l2(row_ptr, start, n_cols, stride_xn, COLS: tl.constexpr):
    """Ask L2 to fetch columns ``[start, start + COLS)`` of a row (cut at ``n_cols``): no registers, no wait.

    One ``prefetch.global.L2`` a sector, issued and forgotten, so a later load of
    those columns finds them in L2. GPU only (inline PTX; the interpreter has none).
    """
    SECTOR_COLS: tl.constexpr = L2_SECTOR_BYTES * 8 // row_ptr.dtype.element_ty.primitive_bitwidth
    cols = tl.minimum(start + tl.arange(0, COLS // SECTOR_COLS) * SECTOR_COLS, n_cols - 1)
    tl.inline_asm_elementwise("mov.u32 $0, 0;\n\tprefetch.global.L2 [$1];", "=r,l", [row_ptr + cols * stride_xn],
                              dtype=tl.int32, is_pure=False, pack=1)


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
    return tl.load(x_row + cols * stride_xn, mask=(cols < head_end) & in_row(cols, hi, EVEN_COLS), other=float("-inf"),
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
    x_even = tl.load(x_row + cols * stride_xn, mask=in_row(cols, hi, EVEN_COLS), other=float("-inf"),
                     eviction_policy="evict_first")
    cols -= HEAD_BLOCK_N  # before head_start when the head is one block: nothing loaded or stored
    x_odd = tl.load(x_row + cols * stride_xn, mask=(cols >= head_start) & in_row(cols, hi, EVEN_COLS),
                    other=float("-inf"), eviction_policy="evict_first")
    for k in tl.range(0, (head_end - head_start) // HEAD_BLOCK_N, 2, num_stages=1):
        cols = head_end - (k + 1) * HEAD_BLOCK_N + tl.arange(0, HEAD_BLOCK_N)[None, :]
        y_block = final_weights(x_even.to(tl.float32), m, d, LOG2E, False)
        tl.store(y_row + cols, y_block.to(y_row.dtype.element_ty), mask=in_row(cols, hi, EVEN_COLS),
                 eviction_policy="evict_first")
        ahead = cols - 2 * HEAD_BLOCK_N  # before head_start on the last turns: nothing loaded
        x_even = tl.load(x_row + ahead * stride_xn, mask=(ahead >= head_start) & in_row(ahead, hi, EVEN_COLS),
                         other=float("-inf"), eviction_policy="evict_first")
        cols -= HEAD_BLOCK_N  # block k + 1: before head_start when the head has an odd number of blocks
        y_block = final_weights(x_odd.to(tl.float32), m, d, LOG2E, False)
        tl.store(y_row + cols, y_block.to(y_row.dtype.element_ty),
                 mask=(cols >= head_start) & in_row(cols, hi, EVEN_COLS), eviction_policy="evict_first")
        ahead = cols - 2 * HEAD_BLOCK_N
        x_odd = tl.load(x_row + ahead * stride_xn, mask=(ahead >= head_start) & in_row(ahead, hi, EVEN_COLS),
                        other=float("-inf"), eviction_policy="evict_first")


@triton.jit
def softmax_shared_rows_kernel(
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
    # row's frame (row_frame): with VEC_COLS > 1 (rows that start unaligned: stride_xm = stride_ym,
    # stride_xn = 1) a row is read from the first vector boundary in it, and part 0 also takes its edges;
    # x_ptr and y_ptr are then 16-byte aligned, base_lead elements before row 0 of x and of y.
    # The row's slots at slot_ptr are zero (unpublished); those at clear_ptr, which the last launch
    # published into, are zeroed for the next one (core.partials.zeroed_slots).
    clear_slots(clear_ptr, n_clear, CLEAR_BLOCK)
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
        pre, hi = row_frame(base_lead + row * stride_xm, n_cols, VEC_COLS)
        tail_ok = in_row(tail_cols, hi, EVEN_COLS)  # with EVEN_COLS (every part inside the row): folds away
        x_row = x_ptr + frame_start(base_lead, row * stride_xm, pre, VEC_COLS)
        if PREFETCH == PREFETCH_L2:  # the first BLOCK_N columns of the next row's part travel to L2
            if row + row_step < rows_prefetched:
                prefetch_to_l2(x_row + row_step * stride_xm, part_start, n_cols, stride_xn, BLOCK_N)
        m_head, d_head = empty_state(1)
        if HAS_HEAD:
            m_head, d_head = _head_statistics(x_row, part_start, head_end, hi, stride_xn, HEAD_BLOCK_N, HEAD_GROUP_N,
                                              EVEN_COLS, HEAD_EVICTION)
        if VEC_COLS > 1:  # part 0 takes the row's edges (masks from tl.where: the interpreter's scalar & is int32)
            edge_cols, edge_ok = row_edges(pre, hi, n_cols, VEC_COLS)
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
            y_row = y_ptr + frame_start(base_lead, row * stride_ym, pre, VEC_COLS)
            if VEC_COLS > 1:
                y_edge = final_weights(x_edge, m_row, d_row, LOG2E, False)
                tl.store(y_row + edge_cols, y_edge.to(y_ptr.dtype.element_ty), mask=edge_ok)
            y = normalize(p * rescale_factor(m_part, m_row, LOG2E)[:, None], d_row, False)
            tl.store(y_row + tail_cols, y.to(y_ptr.dtype.element_ty), mask=tail_ok, eviction_policy="evict_first")
            if HAS_HEAD:
                _head_normalize(x_row, y_row, part_start, head_end, hi, stride_xn, m_row, d_row, HEAD_BLOCK_N,
                                EVEN_COLS)


# ----------------------------------------------------------------------------- host side


# Programs of the shared-row kernel resident at once on a device, per compiled configuration.
_RESIDENT_PROGRAMS: dict = {}


def launch_shared_rows(
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
        shared = shared_rows_launch(x2d, y_arg, lse_arg, (slots, clear, n_clear), plan, write_y, write_lse)
        if shared is not None:
            launch(softmax_shared_rows_kernel, *shared[:2], **shared[2])
        return shared is not None

    return zeroed_slots(x2d.device, x2d.shape[0] * plan.n_splits, launch_with)


def shared_rows_launch(
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
                CLEAR_BLOCK=tuning.SLOTS_CLEAR_BLOCK, num_warps=plan.num_warps, launch_cooperative_grid=True)
    resident = resident_programs(softmax_shared_rows_kernel, args, meta, device)
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
