"""Masked and causal softmax of attention scores, over the keys (the last dim).

``y = softmax(x * scale + bias)`` over keys, for scores ``x`` of shape
``(..., seqlen_q, seqlen_k)``, where positions removed by a boolean mask or by
causal masking count as ``-inf``. Both regimes of ``flashlite.softmax`` are
kept, in one kernel (``SINGLE_BLOCK`` picks the first):

* **fused**: rows of up to ``flashlite.softmax.tuning.FUSED_MAX_COLS`` keys, several short rows
  a tile, one tile on chip: one read of ``x``, one write of ``y``, persistent grid.
* **online**: longer rows stream in blocks of ``BLOCK_N`` through the core's
  ``online_update_lanes`` (a running state per lane, lanes merged after the
  loop), then are re-read (from L2) and normalised; when rows
  are few, each is split across programs whose partial ``(m, d)`` are merged
  with ``merge_partial_states``. The planner is ``flashlite.softmax.plan.plan_softmax``.

Masks. The keep/bias logic is ``masking.apply_masks``, the same helper the
attention kernel calls. A mask is boolean (True = keep, as in
``scaled_dot_product_attention``) or float (added to the scaled scores, in
natural-log units), of any shape that broadcasts to ``x``. It is never
expanded: ``masking.broadcast_mask`` gives a view with stride 0 on broadcast
dims, and each row finds its mask from its coordinates.

Rows and their coordinates. The kernels see up to two leading ("batch") dims:
flat row ``r`` of a ``(B0, B1, seqlen_q, seqlen_k)`` view is query
``q = r % seqlen_q`` of batch ``(t // B1, t % B1)``, ``t = r // seqlen_q``, and
its offset in ``x`` (or the mask) is ``b0 * stride_b0 + b1 * stride_b1 + q *
stride_q``. Example: (B, H, Lq) = (2, 3, 4), row 17 -> t = 4, q = 1,
(b0, b1) = (1, 1). Leading dims are first merged wherever both ``x``'s and the
mask's strides allow (a ``(B, 1, 1, Lk)`` key-padding mask under contiguous
``(B, H, Lq, Lk)`` scores keeps two dims; an ``(Lq, Lk)`` mask merges (B, H)
into one); if more than two remain, the host launches once per index of the
outer ones, still without copying.

Causal, aligned bottom-right: query ``i`` sees keys ``j <= i + seqlen_k - seqlen_q``.
The hidden part of a row is not read, only written (zeros): loads of ``x``
stop at the end of the ``READ_GROUP``-key group that holds the diagonal (so
they stay vector-wide; at most 15 keys past it), loads of the mask stop at the
diagonal itself (``apply_masks``). With ``seqlen_q > seqlen_k`` the first
queries see nothing.

Empty rows. A row with every key masked gives zeros (``normalize`` with
``ZERO_IF_EMPTY``), where ``torch.softmax`` of a row of ``-inf`` gives NaN; NaN
in a visible score still makes its row's visible positions NaN. Masked positions
get exactly 0, in every row (``torch.softmax(x.masked_fill(~keep, -inf))`` puts
NaN there too in a NaN row), and gradient 0, as through ``masked_fill``.

Backward: ``dx = scale * y * (dy - sum(dy * y))`` (exactly 0 where ``y = 0``, as
``masked_fill``'s gradient gives hidden positions even in a NaN row), the same two regimes, reading
a causal row only up to its diagonal's key group, as the forward (masked
positions have ``y = 0``, so gradient 0; no mask is read). A float mask that requires grad gets ``y * (dy - sum(dy * y))``
summed over its broadcast dims; a boolean mask has no gradient.

CPU tensors run the kernels through Triton's interpreter under
``TRITON_INTERPRET=1``; otherwise PyTorch in fp32.
"""

from __future__ import annotations

import dataclasses
import itertools

import torch
import triton
import triton.language as tl

from .core.checks import check_dim, check_flag, check_float_dtype, check_scale
from .core.masking import apply_masks, broadcast_mask, causal_key_end
from .core.online_softmax import (
    LOG2E, empty_state, final_weights, merge_partial_states, normalize, online_update, online_update_lanes,
)
from .core.partials import BOTH_PASSES, FINAL_PASS, PARTIAL_PASS, work_item
from .core.runtime import PersistentLaunch, is_compiling, runs_kernels
from .core.tiles import tile_rows
from .softmax.api import as_rows, empty_rows_layout, from_rows, softmax_grad_torch
from .softmax.api import clear_plans as clear_softmax_plans
from .softmax.online import launch_online
from .softmax.plan import ALGORITHMS, SoftmaxPlan, fused_warps, plan_softmax

# Elements a thread of the fused masked kernels holds: 32, where plain softmax holds 64
# (tuning.FUSED_ELEMS_PER_THREAD, half the warps from 8192 columns): causal masked rows were slower with 64.
# H100 2026-11-25, no committed script; TUNING.md#masked-elems-per-thread
MASKED_ELEMS_PER_THREAD = 32
# Scores a fused masked tile holds at most (plain softmax's tile, tuning.FUSED_TILE_ELEMS, when larger): rows of
# up to MASKED_TILE_ELEMS keys share a tile. python bench/masked_softmax.py --tune; TUNING.md#masked-softmax-host
MASKED_TILE_ELEMS = 4096
# The forward of causal rows without a mask tensor: one row a tile from 1024 keys (+7-8% at L = 1024 and 2048
# against 4096-score tiles, bf16 and fp32; rows with a mask lost; the backward keeps its tiles:
# TUNING.md#masked-softmax-host).
MASKED_CAUSAL_TILE_ELEMS = 1024
# Those tiles take as few as MASKED_CAUSAL_FEWEST_WARPS warps (plain softmax's take 4 or more) holding
# MASKED_CAUSAL_THREAD_BYTES a thread (32 bf16 or 16 fp32 scores): a row of 1024 keys on 4 warps is issue-bound
# (each warp's share of the row's index work, reductions across warps), and one warp (bf16) or two (fp32) issue
# less. python bench/masked_softmax.py --tune causal-warps; TUNING.md#masked-row-warps
MASKED_CAUSAL_FEWEST_WARPS = 1
MASKED_CAUSAL_THREAD_BYTES = 64
# Additive masks are in the same natural-log units as the scores here.
NATURAL_UNITS = tl.constexpr(1.0)
# Causal loads stop at a multiple of this many keys: 16 bytes of a bool mask, 32 of bf16, 64 of fp32,
# so every vector load of a row is whole (the PTX for sm_90 shows ld.global.v4 instead of 16 scalar loads).
READ_GROUP = tl.constexpr(16)


# ----------------------------------------------------------------------------- jit helpers


@triton.jit
def _row_coords(rows, seqlen_q, n_inner):
    """Leading indices ``(b0, b1)`` and query index ``q`` of flat rows of a ``(B0, n_inner, seqlen_q, *)`` view."""
    q = rows % seqlen_q
    t = rows // seqlen_q
    return t // n_inner, t % n_inner, q


@triton.jit
def _visible_end(q, row_ok, seqlen_q, seqlen_k, IS_CAUSAL: tl.constexpr):
    """Per row, one past the last key that may count (0 for rows outside the tensor)."""
    if IS_CAUSAL:
        end = causal_key_end(q, seqlen_q, seqlen_k)
    else:
        end = tl.zeros_like(q) + seqlen_k
    return tl.where(row_ok, end, 0)


@triton.jit
def _read_end(key_end, seqlen_k):
    """Where the loads of a row stop: ``key_end`` rounded up to whole groups of ``READ_GROUP`` keys.

    Loads whose mask ends at an arbitrary key are split into single-element
    loads; ending on a group boundary keeps them vector-wide. The few keys read
    past ``key_end`` (fewer than ``READ_GROUP``, mostly in a sector fetched anyway)
    are masked by ``apply_masks``. Example: key_end = 37 -> loads stop at 48.
    """
    return tl.minimum(tl.cdiv(key_end, READ_GROUP) * READ_GROUP, seqlen_k)


@triton.jit
def _masked_scores(
    x_rows, mask_rows, q_idx, cols, key_end, col_end, seqlen_q, seqlen_k, scale,
    stride_xn, stride_mm, stride_mn,
    IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr,
):
    """Scaled, masked scores ``[M, N]`` of columns ``cols``; keys past ``_read_end(key_end)`` (per row) or
    ``col_end`` are not read; they, and everything masking removes, come back ``-inf``."""
    readable = (cols[None, :] < _read_end(key_end, seqlen_k)[:, None]) & (cols < col_end)[None, :]
    x = tl.load(x_rows[:, None] + cols[None, :] * stride_xn, mask=readable, other=float("-inf"))
    s = x.to(tl.float32) * scale
    return apply_masks(
        s, q_idx, cols, seqlen_q, seqlen_k, mask_rows, stride_mm, stride_mn,
        IS_CAUSAL, HAS_MASK, MASK_IS_BOOL, NATURAL_UNITS,
    )


@triton.jit
def _visible_y_dy(y_rows, dy_rows, cols, key_end, col_end, seqlen_k, stride_dyn):
    """``y`` and ``dy`` (fp32) ``[M, N]`` of columns ``cols``, both 0 past each row's ``key_end``.

    Loads stop at ``_read_end``; ``y`` is already 0 past ``key_end`` (the forward
    wrote it so), and ``dy`` is zeroed there so that values the forward never
    looked at (NaN, inf) cannot reach the row's sum.
    """
    readable = (cols[None, :] < _read_end(key_end, seqlen_k)[:, None]) & (cols < col_end)[None, :]
    y = tl.load(y_rows[:, None] + cols[None, :], mask=readable, other=0.0).to(tl.float32)
    dy = tl.load(dy_rows[:, None] + cols[None, :] * stride_dyn, mask=readable, other=0.0).to(tl.float32)
    return y, tl.where(cols[None, :] < key_end[:, None], dy, 0.0)


@triton.jit
def _hidden_zero(hidden, out):
    """``out`` with exactly 0 where ``hidden``: the forward's hidden positions (scores ``-inf``) are 0 even in a
    NaN row (``0 * NaN`` otherwise); in the backward, positions with ``y = 0`` get gradient 0 there too, as
    through PyTorch's ``masked_fill``."""
    return tl.where(hidden, 0.0, out)


@triton.jit
def _nonfinite_rows(v):
    """Per row, whether its value ``v`` (one a row) is NaN or infinite."""
    return (v != v) | (tl.abs(v) == float("inf"))


@triton.jit
def _any_nonfinite(v):
    """True when a row's value ``v`` (one a row of the tile) is NaN or infinite: only then can a hidden position
    come out other than 0 and need ``_hidden_zero``. In the forward ``v = d``: a row that held NaN or ``+inf``
    has ``normalize`` give NaN weights, hidden positions included. In the backward ``v = Σ y·dy``: a hidden
    position's ``y · (dy − Σ y·dy)`` is ``0 · NaN`` only if its dy or the sum is not finite, and a non-finite
    dy anywhere in the row makes the sum so (``0 · inf`` is NaN). Tested once a tile, so that tiles of finite
    rows pay no select per element: the select on ``s == -inf`` (a boolean tile the compiler packs and unpacks)
    cost the fused causal rows up to a third of their speed on an H200 (TUNING.md, "Masked softmax: the
    hidden-zero select"). The fused forward does not branch at all: it flags such tiles, and
    ``_zero_hidden_kernel`` zeroes their hidden positions (a branch re-reading the scores would raise every
    tile's registers)."""
    return tl.max(_nonfinite_rows(v).to(tl.int32), axis=0) > 0


@triton.jit
def _score_rows(rows, n_rows, n_inner, seqlen_q, seqlen_k, x_ptr, stride_xb, stride_xh, stride_xm,
                IS_CAUSAL: tl.constexpr):
    """``(row_ok, b0, b1, x_rows, q_idx, key_end)`` of rows ``rows`` of the (B0, B1, Lq, Lk) scores: which exist,
    their batch entries, score row pointers, query index (out of range past the end, so that ``apply_masks``
    reads nothing there) and visible end."""
    row_ok = rows < n_rows
    b0, b1, q = _row_coords(rows, seqlen_q, n_inner)
    x_rows = x_ptr + b0 * stride_xb + b1 * stride_xh + q * stride_xm
    q_idx = tl.where(row_ok, q, seqlen_q)
    key_end = _visible_end(q, row_ok, seqlen_q, seqlen_k, IS_CAUSAL)
    return row_ok, b0, b1, x_rows, q_idx, key_end


# ----------------------------------------------------------------------------- kernels


@triton.jit
def _masked_softmax_fwd_kernel(
    x_ptr, mask_ptr, y_ptr, part_m_ptr, part_d_ptr, bad_ptr,
    n_rows, n_inner, seqlen_q, seqlen_k, n_splits, cols_per_split, scale,
    stride_xb, stride_xh, stride_xm, stride_xn,
    stride_mb, stride_mh, stride_mm, stride_mn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS_POW2: tl.constexpr, PASS: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, SINGLE_BLOCK: tl.constexpr,
):
    # A work item is (tile of BLOCK_M rows, chunk of columns); chunks exist only when rows are split (BLOCK_M = 1).
    n_items = tl.cdiv(n_rows, BLOCK_M) * n_splits
    for item in tl.range(tl.program_id(0), n_items, tl.num_programs(0)):
        tile, col_start, col_end = work_item(item, n_items, n_splits, cols_per_split, seqlen_k, PASS)
        rows = tile_rows(tile, BLOCK_M)
        row_ok, b0, b1, x_rows, q_idx, key_end = _score_rows(
            rows, n_rows, n_inner, seqlen_q, seqlen_k, x_ptr, stride_xb, stride_xh, stride_xm, IS_CAUSAL)
        if HAS_MASK:
            mask_rows = (mask_ptr + b0 * stride_mb + b1 * stride_mh)[:, None]
        else:
            mask_rows = mask_ptr
        tile_end = tl.minimum(col_end, tl.max(key_end, axis=0))  # no key past this is read by the tile

        if PASS == FINAL_PASS:
            parts = tl.arange(0, SPLITS_POW2)
            part_at = rows[:, None] * n_splits + parts[None, :]
            part_ok = (parts < n_splits)[None, :]
            part_m = tl.load(part_m_ptr + part_at, mask=part_ok, other=float("-inf"))
            part_d = tl.load(part_d_ptr + part_at, mask=part_ok, other=0.0)
            m, d = merge_partial_states(part_m, part_d, LOG2E)
        elif SINGLE_BLOCK:
            cols = tl.arange(0, BLOCK_N)
            s = _masked_scores(
                x_rows, mask_rows, q_idx, cols, key_end, col_end, seqlen_q, seqlen_k, scale,
                stride_xn, stride_mm, stride_mn, IS_CAUSAL, HAS_MASK, MASK_IS_BOOL,
            )
            m, d = empty_state(BLOCK_M)
            m, d, p, _ = online_update(m, d, s, LOG2E)
        else:
            # Every lane keeps its own (m, d) over the blocks (no reduction in the loop); lanes merge after it.
            lane_m = tl.full([BLOCK_M, BLOCK_N], float("-inf"), tl.float32)
            lane_d = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for start in tl.range(col_start, tile_end, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                s = _masked_scores(
                    x_rows, mask_rows, q_idx, cols, key_end, col_end, seqlen_q, seqlen_k, scale,
                    stride_xn, stride_mm, stride_mn, IS_CAUSAL, HAS_MASK, MASK_IS_BOOL,
                )
                lane_m, lane_d = online_update_lanes(lane_m, lane_d, s, LOG2E)
            m, d = merge_partial_states(lane_m, lane_d, LOG2E)
        if PASS == PARTIAL_PASS:
            tl.store(part_m_ptr + rows * n_splits + col_start // cols_per_split, m)
            tl.store(part_d_ptr + rows * n_splits + col_start // cols_per_split, d)

        if PASS != PARTIAL_PASS:
            y_rows = y_ptr + rows * seqlen_k
            if SINGLE_BLOCK:
                y = normalize(p, d, True)  # 0 · NaN at hidden positions of a row of NaN or +inf: the next kernel
                ok = row_ok[:, None] & (cols < seqlen_k)[None, :]
                tl.store(y_rows[:, None] + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)
                tl.store(bad_ptr + tile, _any_nonfinite(d).to(tl.int8))
            else:
                # Blocks past tile_end load nothing and come out as zeros.
                n_blocks = tl.cdiv(col_end - col_start, BLOCK_N)
                bad_rows = _any_nonfinite(d)
                for k in tl.range(0, n_blocks):
                    cols = col_start + (n_blocks - 1 - k) * BLOCK_N + tl.arange(0, BLOCK_N)
                    s = _masked_scores(
                        x_rows, mask_rows, q_idx, cols, key_end, col_end, seqlen_q, seqlen_k, scale,
                        stride_xn, stride_mm, stride_mn, IS_CAUSAL, HAS_MASK, MASK_IS_BOOL,
                    )
                    y = final_weights(s, m, d, LOG2E, True)
                    if bad_rows:
                        y = _hidden_zero(s == float("-inf"), y)
                    ok = row_ok[:, None] & (cols < col_end)[None, :]
                    tl.store(y_rows[:, None] + cols[None, :], y.to(y_ptr.dtype.element_ty), mask=ok)


@triton.jit
def _zero_hidden_kernel(
    x_ptr, mask_ptr, y_ptr, bad_ptr,
    n_rows, n_inner, seqlen_q, seqlen_k, scale,
    stride_xb, stride_xh, stride_xm, stride_xn,
    stride_mb, stride_mh, stride_mm, stride_mn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, FLAGS: tl.constexpr, IS_CAUSAL: tl.constexpr,
    HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr,
):
    # The forward's tiles that held a row of NaN or +inf (bad_ptr, one flag a tile): their scores read again,
    # and zeros stored over those rows' hidden positions (the forward stored 0 · NaN there). A kernel of its
    # own: the same branch in the forward would hold its registers for every tile (TUNING.md, "Masked softmax:
    # the hidden-zero select"). Finite inputs cost one vector load of FLAGS flags a program.
    n_tiles = tl.cdiv(n_rows, BLOCK_M)
    for first in tl.range(tl.program_id(0) * FLAGS, n_tiles, tl.num_programs(0) * FLAGS):
        at = first + tl.arange(0, FLAGS)
        if tl.max(tl.load(bad_ptr + at, mask=at < n_tiles, other=0).to(tl.int32), axis=0) > 0:  # rare
            for tile in tl.range(first, tl.minimum(first + FLAGS, n_tiles)):
                _zero_hidden_of_tile(
                    tile, x_ptr, mask_ptr, y_ptr, bad_ptr, n_rows, n_inner, seqlen_q, seqlen_k, scale,
                    stride_xb, stride_xh, stride_xm, stride_xn, stride_mb, stride_mh, stride_mm, stride_mn,
                    BLOCK_M, BLOCK_N, IS_CAUSAL, HAS_MASK, MASK_IS_BOOL,
                )


@triton.jit
def _zero_hidden_of_tile(
    tile, x_ptr, mask_ptr, y_ptr, bad_ptr, n_rows, n_inner, seqlen_q, seqlen_k, scale,
    stride_xb, stride_xh, stride_xm, stride_xn, stride_mb, stride_mh, stride_mm, stride_mn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr,
    MASK_IS_BOOL: tl.constexpr,
):
    """Zeros over the hidden positions of the rows of NaN or +inf of a flagged tile (``_zero_hidden_kernel``)."""
    if tl.load(bad_ptr + tile) != 0:
        rows = tile_rows(tile, BLOCK_M)
        row_ok, b0, b1, x_rows, q_idx, key_end = _score_rows(
            rows, n_rows, n_inner, seqlen_q, seqlen_k, x_ptr, stride_xb, stride_xh, stride_xm, IS_CAUSAL)
        if HAS_MASK:
            mask_rows = (mask_ptr + b0 * stride_mb + b1 * stride_mh)[:, None]
        else:
            mask_rows = mask_ptr
        cols = tl.arange(0, BLOCK_N)
        s = _masked_scores(
            x_rows, mask_rows, q_idx, cols, key_end, seqlen_k, seqlen_q, seqlen_k, scale,
            stride_xn, stride_mm, stride_mn, IS_CAUSAL, HAS_MASK, MASK_IS_BOOL,
        )
        m, d = empty_state(BLOCK_M)
        m, d, _, _ = online_update(m, d, s, LOG2E)
        hidden = _nonfinite_rows(d)[:, None] & (s == float("-inf")) & row_ok[:, None] & (cols < seqlen_k)[None, :]
        zeros = tl.zeros([BLOCK_M, BLOCK_N], tl.float32).to(y_ptr.dtype.element_ty)
        tl.store(y_ptr + rows[:, None] * seqlen_k + cols[None, :], zeros, mask=hidden)


@triton.jit
def _masked_softmax_bwd_kernel(
    y_ptr, dy_ptr, dx_ptr, part_ptr,
    n_rows, seqlen_q, seqlen_k, n_splits, cols_per_split, scale,
    stride_dym, stride_dyn,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, SPLITS_POW2: tl.constexpr, PASS: tl.constexpr,
    IS_CAUSAL: tl.constexpr, SINGLE_BLOCK: tl.constexpr,
):
    # y and dx are contiguous (n_rows, seqlen_k); y is 0 wherever the forward masked, so no mask is needed here.
    n_items = tl.cdiv(n_rows, BLOCK_M) * n_splits
    for item in tl.range(tl.program_id(0), n_items, tl.num_programs(0)):
        tile, col_start, col_end = work_item(item, n_items, n_splits, cols_per_split, seqlen_k, PASS)
        rows = tile_rows(tile, BLOCK_M)
        row_ok = rows < n_rows
        key_end = _visible_end(rows % seqlen_q, row_ok, seqlen_q, seqlen_k, IS_CAUSAL)
        tile_end = tl.minimum(col_end, tl.max(key_end, axis=0))
        y_rows = y_ptr + rows * seqlen_k
        dy_rows = dy_ptr + rows * stride_dym

        if PASS == FINAL_PASS:
            parts = tl.arange(0, SPLITS_POW2)
            part_at = rows[:, None] * n_splits + parts[None, :]
            dot = tl.sum(tl.load(part_ptr + part_at, mask=(parts < n_splits)[None, :], other=0.0), axis=1)
        elif SINGLE_BLOCK:
            cols = tl.arange(0, BLOCK_N)
            y, dy = _visible_y_dy(y_rows, dy_rows, cols, key_end, col_end, seqlen_k, stride_dyn)
            dot = tl.sum(y * dy, axis=1)
        else:
            acc = tl.zeros([BLOCK_M, BLOCK_N], tl.float32)
            for start in tl.range(col_start, tile_end, BLOCK_N):
                cols = start + tl.arange(0, BLOCK_N)
                y, dy = _visible_y_dy(y_rows, dy_rows, cols, key_end, col_end, seqlen_k, stride_dyn)
                acc += y * dy
            dot = tl.sum(acc, axis=1)
        if PASS == PARTIAL_PASS:
            tl.store(part_ptr + rows * n_splits + col_start // cols_per_split, dot)

        if PASS != PARTIAL_PASS:
            dx_rows = dx_ptr + rows * seqlen_k
            if SINGLE_BLOCK:
                if _any_nonfinite(dot):  # rare: hidden positions (y = 0) exactly 0, not 0 · NaN
                    dx = _hidden_zero(y == 0.0, scale * y * (dy - dot[:, None]))
                else:
                    dx = scale * y * (dy - dot[:, None])
                ok = row_ok[:, None] & (cols < seqlen_k)[None, :]
                tl.store(dx_rows[:, None] + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=ok)
            else:
                n_blocks = tl.cdiv(col_end - col_start, BLOCK_N)
                bad_rows = _any_nonfinite(dot)
                for k in tl.range(0, n_blocks):
                    cols = col_start + (n_blocks - 1 - k) * BLOCK_N + tl.arange(0, BLOCK_N)
                    y, dy = _visible_y_dy(y_rows, dy_rows, cols, key_end, col_end, seqlen_k, stride_dyn)
                    dx = scale * y * (dy - dot[:, None])
                    if bad_rows:
                        dx = _hidden_zero(y == 0.0, dx)
                    ok = row_ok[:, None] & (cols < col_end)[None, :]
                    tl.store(dx_rows[:, None] + cols[None, :], dx.to(dx_ptr.dtype.element_ty), mask=ok)


# ----------------------------------------------------------------------------- host launchers


def batch_layout(x: torch.Tensor, mask: torch.Tensor | None) -> tuple[list[int], list[int], list[int]]:
    """The leading dims of ``x`` (..., Lq, Lk) and of its broadcast ``mask``, merged as far as the strides of
    both allow: ``(sizes, x strides, mask strides)``, outermost first, at least two (padded with size-1 dims).

    Dims of size 1 are dropped; neighbours merge when both tensors step over them
    as over one dim. Example: contiguous x (2, 3, 4, Lq, Lk) with a key-padding
    mask (2, 1, 1, 1, Lk) keeps (2, 12); with a mask (2, 1, 4, 1, Lk) nothing
    merges, and the three dims are launched as 2 x (3, 4).
    """
    lead = x.shape[:-2]
    mask_strides = mask.stride()[:-2] if mask is not None else (0,) * len(lead)
    sizes: list[int] = []
    sx: list[int] = []
    sm: list[int] = []
    for size, stride_x, stride_m in zip(lead, x.stride()[:-2], mask_strides):
        if size == 1:
            continue
        if sizes and sx[-1] == stride_x * size and sm[-1] == stride_m * size:
            sizes[-1] *= size
            sx[-1], sm[-1] = stride_x, stride_m
        else:
            sizes.append(size)
            sx.append(stride_x)
            sm.append(stride_m)
    pad = max(0, 2 - len(sizes))
    return [1] * pad + sizes, [0] * pad + sx, [0] * pad + sm


def masked_plan(n_rows: int, seqlen_k: int, device: torch.device, algorithm: str = "auto",
                block_n: int | None = None, n_splits: int | None = None, tile_elems: int | None = None,
                elems_per_thread: int | None = None, fewest_warps: int = 4) -> SoftmaxPlan:
    """The plan of a masked softmax over ``n_rows`` rows of ``seqlen_k`` keys: plain softmax's (``plan_softmax``),
    a fused tile cut to ``tile_elems`` scores (default ``MASKED_TILE_ELEMS``; at least a row) on warps of
    ``elems_per_thread`` a thread (default ``MASKED_ELEMS_PER_THREAD``), ``fewest_warps`` at the fewest."""
    # Plain softmax's regimes, limits and block sizes (tuned on an H100 for softmax), not re-tuned for
    # the mask tile: bench/masked_softmax.py measures the fused regime (L <= 4096) only. Wide fused rows
    # keep the warps of MASKED_ELEMS_PER_THREAD.
    plan = plan_softmax(n_rows, seqlen_k, device, algorithm, block_n, n_splits)
    if plan.algorithm == "fused":
        block_m = max(1, min(plan.block_m, (tile_elems or MASKED_TILE_ELEMS) // plan.block_n))
        plan = dataclasses.replace(plan, block_m=block_m,
                                   num_warps=fused_warps(block_m * plan.block_n,
                                                         elems_per_thread or MASKED_ELEMS_PER_THREAD, fewest_warps))
    return plan


def forward_plan(x: torch.Tensor, mask: torch.Tensor | None, causal: bool, algorithm: str = "auto",
                 block_n: int | None = None, n_splits: int | None = None) -> SoftmaxPlan:
    """The forward's plan (``masked_plan``) for scores ``x`` (..., Lq, Lk) under ``mask`` (None or a tensor) and
    ``causal``: causal rows without a mask tensor on their own tiles (``MASKED_CAUSAL_*``), the rest on
    ``MASKED_TILE_ELEMS``'."""
    seqlen_k = x.shape[-1]
    n_rows = x.numel() // seqlen_k
    if causal and mask is None:
        return masked_plan(n_rows, seqlen_k, x.device, algorithm, block_n, n_splits, MASKED_CAUSAL_TILE_ELEMS,
                           MASKED_CAUSAL_THREAD_BYTES // x.element_size(), MASKED_CAUSAL_FEWEST_WARPS)
    return masked_plan(n_rows, seqlen_k, x.device, algorithm, block_n, n_splits)


# Tile flags one program of the hidden-zero kernel scans with one load (a dependent load a tile took 0.1-0.4 ms
# of a 0.1-1 ms forward on an H200).
ZERO_HIDDEN_FLAGS = 1024


class _ForwardCall:
    """The masked softmax forward of one signature, planned: rows of (B0, B1, Lq, Lk) = (*sizes, Lq, Lk) scores
    laid out as ``x`` (leading strides ``sx``, ``sm`` for the broadcast ``mask``), their plan, launches and
    fixed arguments. ``call(x, mask, y, scale)`` launches them for a call's tensors of that layout (``y``
    contiguous): one launch (two for split rows), then the hidden-zero kernel where a row is read in one tile.
    Built once a signature (``masked_softmax_forward``), so a repeated call pays for its launches only."""

    def __init__(self, x: torch.Tensor, mask: torch.Tensor | None, sizes: list[int], sx: list[int],
                 sm: list[int], causal: bool, algorithm: str, block_n: int | None, n_splits: int | None):
        seqlen_q, seqlen_k = x.shape[-2:]
        self.n_rows = sizes[0] * sizes[1] * seqlen_q
        self.plan = plan = forward_plan(x, mask, causal, algorithm, block_n, n_splits)
        fused = plan.algorithm == "fused"
        block_m = plan.block_m if fused else 1
        n_tiles = triton.cdiv(self.n_rows, block_m)
        single_block = seqlen_k <= plan.block_n  # the kernels' SINGLE_BLOCK: a row read in one tile
        self.n_flags = n_tiles if single_block else 0  # a flag a tile read whole: a row of NaN or +inf in it
        self.n_parts = self.n_rows * plan.n_splits if plan.algorithm == "online" and plan.n_splits > 1 else 0
        mask_qk = mask.stride()[-2:] if mask is not None else (0, 0)
        self.sizes = (self.n_rows, sizes[1], seqlen_q, seqlen_k)
        self.chunks = (plan.n_splits, plan.cols_per_split or seqlen_k)  # the fused plan: one chunk, the whole row
        self.strides = (sx[0], sx[1], x.stride(-2), x.stride(-1), sm[0], sm[1], *mask_qk)
        key = ("masked_softmax_fwd", plan, x.dtype, None if mask is None else mask.dtype, causal, x.device)
        # Constexprs from the host, not triton.heuristics: a kernel so wrapped takes Triton's own launch path,
        # tens of microseconds a call (core.runtime.launch).
        mask_kind = dict(HAS_MASK=mask is not None, MASK_IS_BOOL=mask is not None and mask.dtype == torch.uint8)
        self.online_meta = dict(BLOCK_M=1, IS_CAUSAL=causal, SINGLE_BLOCK=single_block, **mask_kind)
        self.forward = PersistentLaunch(
            _masked_softmax_fwd_kernel, n_tiles, x.device, key, plan.num_warps, BLOCK_M=plan.block_m,
            BLOCK_N=plan.block_n, SPLITS_POW2=1, PASS=BOTH_PASSES.value, IS_CAUSAL=causal, SINGLE_BLOCK=single_block,
            **mask_kind,
        ) if fused else None
        self.zero_hidden = PersistentLaunch(
            _zero_hidden_kernel, triton.cdiv(n_tiles, ZERO_HIDDEN_FLAGS), x.device,
            ("masked_softmax_zero_hidden", *key[1:]), plan.num_warps, BLOCK_M=block_m, BLOCK_N=plan.block_n,
            FLAGS=ZERO_HIDDEN_FLAGS, IS_CAUSAL=causal, **mask_kind,
        ) if single_block else None

    def __call__(self, x: torch.Tensor, mask: torch.Tensor | None, y: torch.Tensor, scale: float) -> None:
        device = x.device
        bad = torch.empty(self.n_flags, dtype=torch.int8, device=device) if self.n_flags else None
        part_m = torch.empty(self.n_parts, dtype=torch.float32, device=device) if self.n_parts else None
        part_d = torch.empty(self.n_parts, dtype=torch.float32, device=device) if self.n_parts else None
        args = (x, mask, y, part_m, part_d, bad, *self.sizes, *self.chunks, scale, *self.strides)
        if self.forward is not None:
            self.forward(*args)
        else:
            launch_online(_masked_softmax_fwd_kernel, self.plan, self.n_rows, device, args, **self.online_meta)
        if bad is not None:
            self.zero_hidden(x, mask, y, bad, *self.sizes, scale, *self.strides)


class _BackwardCall:
    """The masked softmax backward of one signature, planned as ``_ForwardCall`` is: rows (n_rows, Lk) of ``y``
    (contiguous) and ``dy`` (strided as ``dy2d``), row r being query ``r % seqlen_q``. ``call(y2d, dy2d, scale)``
    returns ``dx`` (n_rows, Lk) in ``dx_dtype``."""

    def __init__(self, y2d: torch.Tensor, dy2d: torch.Tensor, seqlen_q: int, causal: bool, dx_dtype: torch.dtype,
                 algorithm: str, block_n: int | None, n_splits: int | None):
        n_rows, seqlen_k = y2d.shape
        self.plan = plan = masked_plan(n_rows, seqlen_k, y2d.device, algorithm, block_n, n_splits)
        self.dx_dtype = dx_dtype
        self.n_parts = n_rows * plan.n_splits if plan.algorithm == "online" and plan.n_splits > 1 else 0
        self.sizes = (n_rows, seqlen_q, seqlen_k, plan.n_splits, plan.cols_per_split or seqlen_k)
        self.strides = (dy2d.stride(0), dy2d.stride(1))
        single_block = seqlen_k <= plan.block_n  # the kernel's SINGLE_BLOCK: a row read in one tile
        self.online_meta = dict(BLOCK_M=1, IS_CAUSAL=causal, SINGLE_BLOCK=single_block)
        key = ("masked_softmax_bwd", plan, y2d.dtype, dy2d.dtype, dx_dtype, causal, y2d.device)
        self.backward = PersistentLaunch(
            _masked_softmax_bwd_kernel, triton.cdiv(n_rows, plan.block_m), y2d.device, key, plan.num_warps,
            BLOCK_M=plan.block_m, BLOCK_N=plan.block_n, SPLITS_POW2=1, PASS=BOTH_PASSES.value, IS_CAUSAL=causal,
            SINGLE_BLOCK=single_block,
        ) if plan.algorithm == "fused" else None

    def __call__(self, y2d: torch.Tensor, dy2d: torch.Tensor, scale: float) -> torch.Tensor:
        dx = torch.empty(y2d.shape, dtype=self.dx_dtype, device=y2d.device)
        parts = torch.empty(self.n_parts, dtype=torch.float32, device=y2d.device) if self.n_parts else None
        args = (y2d, dy2d, dx, parts, *self.sizes, scale, *self.strides)
        if self.backward is not None:
            self.backward(*args)
        else:
            launch_online(_masked_softmax_bwd_kernel, self.plan, self.sizes[0], y2d.device, args, **self.online_meta)
        return dx


# Planned calls by signature (``_ForwardCall``, ``_BackwardCall``): everything that fixes a plan, the kernels'
# size and stride arguments and Triton's specialization of them (16-byte alignment of each tensor read in
# place). A masked call of a seen signature checks its arguments and launches; planning, the batch layout and
# the launches' keys took most of a small call's host time (TUNING.md#masked-softmax-host).
_CALLS: dict = {}


CALLS_KEPT = 4096  # signatures remembered before the cache starts over


def _signature(t: torch.Tensor | None) -> tuple | None:
    return None if t is None else (t.shape, t.stride(), t.dtype, t.data_ptr() % 16)


def _call_key(direction: str, first: torch.Tensor, second: torch.Tensor | None, plan_args: tuple) -> tuple:
    """The key of a planned call: its direction, its two tensors' signatures, its plan's arguments, the device
    (and the current CUDA device, which the replayed launches run on)."""
    return (direction, _signature(first), _signature(second), *plan_args, first.device,
            torch.cuda.current_device() if first.is_cuda else None)


def _planned(key: tuple, build):
    """The planned call of ``key``, built by ``build()`` the first time it is asked for."""
    call = _CALLS.get(key)
    if call is None:
        call = build()
        if len(_CALLS) >= CALLS_KEPT:
            _CALLS.clear()
        _CALLS[key] = call
    return call


def clear_plans() -> None:
    """Forget every planned masked softmax call and the softmax plans they were built from
    (``flashlite.softmax.api.clear_plans``), after changing the softmax's or this module's tile constants."""
    clear_softmax_plans()
    _CALLS.clear()


def masked_softmax_forward(
    x: torch.Tensor, mask: torch.Tensor | None, scale: float, causal: bool,
    algorithm: str = "auto", block_n: int | None = None, n_splits: int | None = None,
) -> torch.Tensor:
    """Masked softmax of ``x`` (..., Lq, Lk) over its last dim; ``mask`` already broadcast to ``x``'s shape
    (``broadcast_mask``: uint8 for boolean). Returns a contiguous tensor of ``x``'s shape and dtype.
    ``block_n``/``n_splits`` force the online plan (tests)."""
    y = torch.empty(x.shape, dtype=x.dtype, device=x.device)
    plan_args = (causal, algorithm, block_n, n_splits)
    key = _call_key("forward", x, mask, plan_args)
    call = _CALLS.get(key)
    if call is not None:
        call(x, mask, y, float(scale))
        return y
    sizes, sx, sm = batch_layout(x, mask)
    if len(sizes) == 2:
        _planned(key, lambda: _ForwardCall(x, mask, sizes, sx, sm, *plan_args))(x, mask, y, float(scale))
        return y
    # More than two leading dims that do not merge: one launch per index of the outer ones, on strided views
    # (each planned afresh: their bases differ in alignment).
    seqlen_q, seqlen_k = x.shape[-2:]
    xv = x.as_strided((*sizes, seqlen_q, seqlen_k), (*sx, *x.stride()[-2:]))
    mv = None if mask is None else mask.as_strided((*sizes, seqlen_q, seqlen_k), (*sm, *mask.stride()[-2:]))
    yv = y.view(*sizes, seqlen_q, seqlen_k)  # y is contiguous and size-1 dims do not move it
    for outer in itertools.product(*(range(n) for n in sizes[:-2])):
        xo, mo = xv[outer], None if mv is None else mv[outer]
        _ForwardCall(xo, mo, sizes[-2:], sx[-2:], sm[-2:], *plan_args)(xo, mo, yv[outer], float(scale))
    return y


def masked_softmax_backward(
    y2d: torch.Tensor, dy2d: torch.Tensor, seqlen_q: int, scale: float, causal: bool, dx_dtype: torch.dtype,
    algorithm: str = "auto", block_n: int | None = None, n_splits: int | None = None,
) -> torch.Tensor:
    """``dx = scale * y * (dy - sum(dy * y))`` of rows (n_rows, Lk), row r being query ``r % seqlen_q``;
    ``y2d`` contiguous, ``dy2d`` any row-strided view. A causal row is read up to the ``READ_GROUP``-key
    group that holds its diagonal."""
    plan_args = (seqlen_q, causal, dx_dtype, algorithm, block_n, n_splits)
    key = _call_key("backward", y2d, dy2d, plan_args)
    return _planned(key, lambda: _BackwardCall(y2d, dy2d, *plan_args))(y2d, dy2d, float(scale))


# ----------------------------------------------------------------------------- argument handling


def _check_args(x: torch.Tensor, mask, scale, causal: bool, dim: int, algorithm: str) -> tuple[int, float]:
    """Validate everything but the mask's shape and dtype (``broadcast_mask`` checks those);
    return ``dim`` made non-negative and ``scale`` as a float."""
    if not isinstance(x, torch.Tensor):
        raise TypeError(f"x must be a torch.Tensor, got {type(x).__name__}")
    check_float_dtype("x", x)
    causal = check_flag("causal", causal)
    if x.dim() < 1 or (causal and x.dim() < 2):
        need = "(..., seqlen_q, seqlen_k)" if causal else "at least one dim"
        raise ValueError(f"x must have shape {need}, got {tuple(x.shape)}")
    dim = check_dim(dim, x.dim())
    if causal and dim != x.dim() - 1:
        raise ValueError(f"causal=True needs the softmax over the last dim (the keys), got dim={dim}")
    if algorithm not in ALGORITHMS:
        raise ValueError(f"algorithm must be one of {ALGORITHMS}, got {algorithm!r}")
    if mask is not None and isinstance(mask, torch.Tensor) and mask.device != x.device:
        raise ValueError(f"mask is on {mask.device} but x is on {x.device}")
    return dim, check_scale(scale, 1.0)


def masked_softmax_torch(x: torch.Tensor, mask: torch.Tensor | None, scale: float, causal: bool,
                          dim: int) -> torch.Tensor:
    """The same function in PyTorch (fp32), for tensors the kernels do not run on."""
    s = x.float() * scale
    keep = torch.ones((), dtype=torch.bool, device=x.device)
    if causal:
        lq, lk = x.shape[-2:]
        keep = torch.ones(lq, lk, dtype=torch.bool, device=x.device).tril(lk - lq)
    if mask is not None and mask.dtype == torch.bool:
        keep = keep & mask
    elif mask is not None:
        s = s + mask.float()
    s = s.masked_fill(~keep, float("-inf"))
    # Hidden positions exactly 0, also in a NaN row, as the kernels give; an empty row is 0 with gradient 0
    # (softmax of its -inf would give NaN, and NaN gradients through it).
    hidden = s == float("-inf")
    empty = hidden.all(dim, keepdim=True)
    return torch.softmax(s.masked_fill(empty, 0.0), dim).masked_fill(hidden, 0.0).to(x.dtype)


# ----------------------------------------------------------------------------- autograd


def forward_keys_last(x: torch.Tensor, mask_view: torch.Tensor | None, scale: float, causal: bool, dim: int,
                   algorithm: str) -> torch.Tensor:
    """The masked softmax of ``x`` in the layout of ``x.movedim(dim, -1)`` (contiguous); ``mask_view`` is
    ``broadcast_mask(mask, x.shape)``'s view."""
    if dim != x.dim() - 1:
        x = x.movedim(dim, -1)  # (..., Lq, Lk): the keys last
        mask_view = None if mask_view is None else mask_view.movedim(dim, -1)
    if (x.shape[-1] - 1) * abs(x.stride(-1)) >= 2**31:
        x = x.contiguous()  # the kernels step keys with 32-bit offsets; rows and batches are 64-bit
    if x.dim() == 1:
        y = masked_softmax_forward(x[None], None if mask_view is None else mask_view[None], scale, causal, algorithm)
        return y[0]  # one row: Lq = 1
    return masked_softmax_forward(x, mask_view, scale, causal, algorithm)


# One op for eager and compiled code: ``flashlite::masked_softmax`` and ``flashlite::masked_softmax_backward``,
# torch.library custom ops with fake implementations and one autograd rule (``_masked_softmax_setup`` /
# ``_masked_softmax_gradient``). While torch.compile traces, ``masked_softmax`` calls the op; eager calls run
# the same implementation, under ``_MaskedSoftmax`` when a gradient is needed (an autograd.Function that
# applies the same rule), without the dispatcher's host cost.


def _masked_softmax_impl(x: torch.Tensor, mask: torch.Tensor | None, scale: float, causal: bool, dim: int,
                         algorithm: str, mask_view: torch.Tensor | None = None) -> torch.Tensor:
    """The op's implementation; ``mask_view``: ``broadcast_mask(mask, x.shape)``'s view when the caller has it."""
    if x.numel() == 0 or not runs_kernels(x):
        out = empty_rows_layout(x, dim, x.dtype)
        return out if x.numel() == 0 else out.copy_(masked_softmax_torch(x, mask, scale, causal, dim))
    if mask is not None and mask_view is None:
        mask_view = broadcast_mask(mask, x.shape)[0]
    y = forward_keys_last(x, mask_view, scale, causal, dim, algorithm)
    return y if dim == x.dim() - 1 else y.movedim(-1, dim)


@torch.library.custom_op(
    "flashlite::masked_softmax", mutates_args=(),
    schema="(Tensor x, Tensor? mask, float scale, bool causal, int dim, str algorithm) -> Tensor",
)
def _masked_softmax_op(x: torch.Tensor, mask: torch.Tensor | None, scale: float, causal: bool, dim: int,
                       algorithm: str) -> torch.Tensor:
    return _masked_softmax_impl(x, mask, scale, causal, dim, algorithm)


@_masked_softmax_op.register_fake
def _(x, mask, scale, causal, dim, algorithm):
    return empty_rows_layout(x, dim, x.dtype)


def _masked_softmax_backward_impl(y: torch.Tensor, dy: torch.Tensor, scale: float, causal: bool, dim: int,
                                  algorithm: str, dx_dtype: torch.dtype) -> torch.Tensor:
    if y.numel() == 0 or not runs_kernels(y):
        return empty_rows_layout(y, dim, dx_dtype).copy_(softmax_grad_torch(y, dy, dim, scale, True))
    y_keys_last = y.movedim(dim, -1).contiguous()  # (..., Lq, Lk), as the forward wrote it
    seqlen_q = y_keys_last.shape[-2] if y.dim() > 1 else 1
    dy2d = as_rows(dy, dim)  # (rows, Lk); copies only if dy is not row-strided
    dx2d = masked_softmax_backward(y_keys_last.view(dy2d.shape), dy2d, seqlen_q, scale, causal, dx_dtype, algorithm)
    return from_rows(dx2d, y, dim)


@torch.library.custom_op(
    "flashlite::masked_softmax_backward", mutates_args=(),
    schema="(Tensor y, Tensor dy, float scale, bool causal, int dim, str algorithm, ScalarType dx_dtype) -> Tensor",
)
def _masked_softmax_backward_op(y: torch.Tensor, dy: torch.Tensor, scale: float, causal: bool, dim: int,
                                algorithm: str, dx_dtype: torch.dtype) -> torch.Tensor:
    return _masked_softmax_backward_impl(y, dy, scale, causal, dim, algorithm, dx_dtype)


@_masked_softmax_backward_op.register_fake
def _(y, dy, scale, causal, dim, algorithm, dx_dtype):
    return empty_rows_layout(y, dim, dx_dtype)


def _masked_softmax_setup(ctx, inputs, output) -> None:
    _, mask, ctx.scale, ctx.causal, ctx.dim, ctx.algorithm = inputs
    ctx.mask_shape, ctx.mask_dtype = (None, None) if mask is None else (mask.shape, mask.dtype)
    ctx.save_for_backward(output)


def _masked_softmax_gradient(ctx, dy, run_backward) -> tuple:
    """``(dx, dmask, None, ...)``; ``run_backward``: the backward op, or its implementation (eager)."""
    (y,) = ctx.saved_tensors
    dx = dmask = None
    if ctx.needs_input_grad[1]:
        # d/d(bias) is the unscaled softmax gradient: one pass in fp32 with scale 1, then scaled for x.
        g = run_backward(y, dy, 1.0, ctx.causal, ctx.dim, ctx.algorithm, torch.float32)
        dmask = g.sum_to_size(ctx.mask_shape).to(ctx.mask_dtype)
        if ctx.needs_input_grad[0]:
            dx = (g * ctx.scale).to(y.dtype)
    elif ctx.needs_input_grad[0]:
        dx = run_backward(y, dy, ctx.scale, ctx.causal, ctx.dim, ctx.algorithm, y.dtype)
    return dx, dmask, None, None, None, None


_masked_softmax_op.register_autograd(
    lambda ctx, dy: _masked_softmax_gradient(ctx, dy, torch.ops.flashlite.masked_softmax_backward),
    setup_context=_masked_softmax_setup)


class _MaskedSoftmax(torch.autograd.Function):
    """The op's eager fast path: its implementation and autograd rule, without the dispatcher."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, mask: torch.Tensor | None, mask_view: torch.Tensor | None, scale: float,
                causal: bool, dim: int, algorithm: str) -> torch.Tensor:
        y = _masked_softmax_impl(x, mask, scale, causal, dim, algorithm, mask_view)
        _masked_softmax_setup(ctx, (x, mask, scale, causal, dim, algorithm), y)
        return y

    @staticmethod
    def backward(ctx, dy: torch.Tensor):
        dx, dmask, *_ = _masked_softmax_gradient(ctx, dy, _masked_softmax_backward_impl)
        return dx, dmask, None, None, None, None, None


# ----------------------------------------------------------------------------- public API


def masked_softmax(
    x: torch.Tensor, mask: torch.Tensor | None = None, *, scale: float | None = None, causal: bool = False,
    dim: int = -1, algorithm: str = "auto",
) -> torch.Tensor:
    """``softmax(x * scale + mask)`` over keys, with masked positions removed; fused on flashlite's kernels.

    Args:
        x: scores (..., seqlen_q, seqlen_k), float32/float16/bfloat16, any leading
            dims, any strides (read in place, never copied).
        mask: None; boolean, True = keep (the convention of
            ``scaled_dot_product_attention``); or float32/float16/bfloat16, added
            to the scaled scores (``-inf`` removes a position). Any shape that
            broadcasts to ``x``: key padding (B, 1, 1, Lk), (Lq, Lk), per head
            (B, H, Lq, Lk), ...; broadcast through strides, never expanded.
        scale: multiplies the scores before the mask is added; None = 1.0.
        causal: query ``i`` sees keys ``j <= i + seqlen_k - seqlen_q`` (aligned
            bottom-right, as FlashAttention >= 2.1); keys past that are not read
            and their outputs are 0. Combines with ``mask``.
        dim: the keys' dim. Must be the last one when ``causal``; otherwise any
            dim, with ``mask`` still broadcast against ``x``'s own shape.
        algorithm: ``"auto"``, ``"fused"`` (rows up to ``flashlite.softmax.tuning.FUSED_MAX_COLS``
            keys) or ``"online"``, as in ``flashlite.softmax``.

    Returns:
        A tensor of ``x``'s shape and dtype (accumulation in fp32). Masked
        positions are exactly 0. **A row with every key masked gives zeros**, where
        ``torch.softmax`` of ``masked_fill(x, ~mask, -inf)`` gives NaN; NaN in a
        visible score still gives NaN for its row. Differentiable in ``x`` and in
        a float ``mask`` (the bias gradient, summed over broadcast dims).

    Raises:
        TypeError for a non-float ``x`` or a mask that is neither bool nor
        float32/float16/bfloat16; ValueError for a mask that does not broadcast
        to ``x``, lives on another device, or ``causal`` without a (Lq, Lk) last pair.
    """
    dim, scale = _check_args(x, mask, scale, causal, dim, algorithm)
    mask_view = None if mask is None else broadcast_mask(mask, x.shape)[0]  # stride 0 on broadcast dims; bool as uint8
    if is_compiling():  # one node of the graph: the op
        return torch.ops.flashlite.masked_softmax(x, mask, scale, causal, dim, algorithm)
    if torch.is_grad_enabled() and (x.requires_grad or (mask is not None and mask.requires_grad)):
        return _MaskedSoftmax.apply(x, mask, mask_view, scale, causal, dim, algorithm)
    return _masked_softmax_impl(x, mask, scale, causal, dim, algorithm, mask_view)
