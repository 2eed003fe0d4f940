"""The attention backward: dQ, dK, dV (and the bias gradient) without storing the L×L probabilities.

The forward saved ``O`` and the natural-log ``LSE`` of every query row. With
``S = Q Kᵀ · scale + bias`` and ``P = softmax(S) = e^(S - LSE)``:

    dV = Pᵀ dO,   dP = dO Vᵀ,   dS = P ⊙ (dP - δ),   δ = rowsum(dO ⊙ O) - dLSE,
    dQ = dS K · scale,   dK = dSᵀ Q · scale,   d(bias) = dS.

(``δ_i = Σ_j P_ij dP_ij = rowsum(dO ⊙ O)``; a gradient flowing into the returned
LSE adds ``P ⊙ dLSE`` to dS, i.e. subtracts ``dLSE`` from δ: supported.)

Three kernels, FlashAttention-2 style:

1. ``_attention_bwd_preprocess_kernel``: δ per query row, in fp32.
2. ``_attention_bwd_dkdv_kernel``: one program per (batch, K/V head, key tile)
   keeps its K and V tile and fp32 dK/dV accumulators on chip and streams the
   Q, dO, LSE and δ tiles of every query head of its GQA group. dK/dV of a
   shared K/V head are therefore summed over the group in registers: no
   repeated K/V in memory, no atomics.
   It works on transposed tiles (``Sᵀ = K Qᵀ``, keys on rows), so that P and dS
   enter its ``Pᵀ dO`` and ``dSᵀ Q`` dots without a transpose in registers.
3. ``_attention_bwd_dq_kernel``: one program per (batch, head, query tile)
   keeps Q, dO and an fp32 dQ accumulator and streams K/V tiles. It recomputes
   P and dS a second time (FlashAttention-2 trades these FLOPs for having no
   atomic adds), so every gradient is deterministic: two runs are bitwise equal.

P is never stored: both kernels recompute it from the scores and LSE, the
scores as the forward made them (fp32 dots of the unscaled Q and K, then
``qk_scale``: ``flashlite.attention``'s units). In base-2 units the LSE is the
row's final online-softmax state ``(m, d) = (LSE · log2(e), 1)``, so
``P = 2^(s · qk_scale - m)``, one fused multiply-add a score on full tiles, with
the core's ``safe_max`` (a row that saw no key has ``LSE = -inf``; ``safe_max``
makes ``m = 0``, and every score of that row is ``-inf``, so its P is 0, never
NaN). Under an additive mask the logits are in natural-log units, and P comes
from each row's ``(m, log d)`` kept apart by the forward
(``api.forward_for_backward``): ``P = 2^((s - m) · log2(e) - log2 d)``,
exact under a bias of any finite size.

Key/query ranges under ``causal`` (bottom-right: query ``i`` sees key
``j <= i + Lk - Lq``, as the forward) and a sliding window (``core.masking``).
The dQ kernel skips key tiles as the forward does (``key_ranges``), the dK/dV
kernel query tiles by the transposed rule (``query_ranges``). The dK/dV kernel skips the query tiles above the diagonal: key
tile ``[n, n + BLOCK_N)`` is first seen by query ``n - (Lk - Lq)`` and seen
whole from query ``n + BLOCK_N - 1 - (Lk - Lq)`` on. Worked example: Lq = 6,
Lk = 8 (offset 2), BLOCK_M = BLOCK_N = 2, key tile 4..5: query 2 is the first
to see key 4, query 3 the first to see key 5; query tiles [0, 2) are skipped,
[2, 4) is masked (the diagonal), [4, 6) is full. Masks (``apply_masks``)
are applied on the diagonal and, with a user mask, on every tile.

Ragged tiles. Loads are bounds-checked and give zeros past L and D (head dims
that are not powers of two are padded like the forward). Query rows past Lq
have dO = 0 and δ = 0, so they add nothing to dK/dV; key rows past Lk only
produce dK/dV rows that are never stored. The dQ kernel masks its ragged last
key tile, as the forward does.

Masks. A boolean mask has no gradient. An additive (float) mask that requires
grad gets ``d(bias) = dS``: the dQ kernel then also writes dS into a
(B, H, Lq, Lk) fp32 buffer (the only L×L memory of the backward, allocated
only in that case), and autograd sums it over the mask's broadcast dims. δ then
comes from a first walk of the dQ kernel over the keys (``DELTA_PASS``:
``Σ_j P_ij dP_ij`` with the P the kernels recompute), not from the forward's O,
whose P was rounded to the input dtype: a row's ``Σ_j dS_ij``, exactly 0 for a
bias broadcast over the keys, is then 0 to fp32 rounding rather than that
rounding (bf16: up to ~1e-2).

Precision: fp32 accumulators; P and dS are rounded to the input dtype for the
dots with dO, Q and K (as FlashAttention); fp32 inputs use IEEE fp32 dots.
Offsets that grow with batch, heads and rows are 64-bit.

Hopper. fp16/bf16 calls without a user mask go to ``backward_hopper``'s Gluon
kernels (the same two passes, with TMA tiles and the products kept in
flight); these kernels serve the rest: masks, fp32 (the interpreter), other GPUs.

Limits: Q/K/V by pointer loads (no TMA) and no persistent grid; the Triton
compiler waits for each product before the next. The split-K/V forward
(``num_splits > 1``, ``cache_seqlens``) has no backward.
"""

from __future__ import annotations

import torch
import triton
import triton.language as tl

from ..core.masking import apply_masks, key_ranges, modify_scores, query_ranges, range_part
from ..core.online_softmax import BASE2_UNITS, LOG2E, safe_max
from ..core.packed import sequence_bounds
from ..core.runtime import KernelLaunch
from ..core.tiles import dot, load_tile, store_tile
from . import tuning
from .backward_hopper import HopperBackwardLaunch, wgmma_backward_eligible
from .forward import alibi_slope
from .plan import (
    NATURAL_BIAS, OutputLayout, default_backward_config, head_dim_padded, hopper_varlen_enabled, kernel_switches,
    packed_schedule, packed_tile, qk_scale_for, query_tile, variant_args,
)
from .reference import attention_backward_torch, attention_varlen_backward_torch
from .tuning import AttentionConfig, BackwardConfig, WgmmaBackwardConfig


@triton.jit
def _load_row_stats(stats_ptr, rows, ok, n_rows, UNITS: tl.constexpr):
    """``(row_m, row_logd2)`` of query rows ``rows`` (flat (B, H, Lq) indices, ``ok`` those inside Lq).

    Base-2 units: ``stats_ptr`` is the natural-log LSE; the row's final state is
    ``(m, d) = (LSE · log2(e), 1)``, so ``row_m`` is that (``safe_max``: 0 for an
    empty row) and ``row_logd2`` 0. Natural-log units (an additive mask):
    ``stats_ptr`` holds ``(m, log d)`` (``attention._store_row_stats``), kept
    apart because their sum loses ``log d`` under a bias of -1e9; ``row_logd2``
    is ``log2 d`` (0 for an empty row, so its ``P`` is ``2^(-inf)`` = 0, not NaN). Rows outside Lq (a ragged
    tile's, loaded as zeros) get a state of +inf, so that their ``P`` is exactly 0 in a tile left unmasked: with a
    state of 0, a negative ALiBi slope could raise it past fp32's range, and ``inf · 0`` is NaN in dK and dV.
    """
    if UNITS == BASE2_UNITS:
        row_m = safe_max(tl.load(stats_ptr + rows, mask=ok, other=0.0) * LOG2E)
        row_logd2 = tl.zeros_like(row_m)
    else:
        m = tl.load(stats_ptr + rows, mask=ok, other=0.0)
        logd = tl.load(stats_ptr + n_rows + rows, mask=ok, other=0.0)
        row_m = safe_max(m)
        row_logd2 = tl.where(m == float("-inf"), 0.0, logd * LOG2E)
    return tl.where(ok, row_m, float("inf")), row_logd2


@triton.jit
def _probs_and_score_grads(
    q, k, v, do, rows, qk_scale, q_idx, k_idx, cols_start, sizes, mask_bh, mods,
    MASKING: tl.constexpr, UNITS: tl.constexpr, DOTS: tl.constexpr, MODS: tl.constexpr, MASKED: tl.constexpr,
    KEYS_ON_ROWS: tl.constexpr,
):
    """``(P, dS, dS_scores)`` (fp32) of one (query tile, key tile) pair: dS is the gradient of the logits (a bias
    gets it), ``dS_scores`` that of the scaled scores, which the products with Q and K take (the same but under
    a softcap).

    ``[BLOCK_M, BLOCK_N]`` (queries on rows, as the dQ kernel's dot ``dS K``
    wants them), or with ``KEYS_ON_ROWS`` ``[BLOCK_N, BLOCK_M]`` (as the dK/dV
    kernel's ``P dO`` and ``dS Q`` want them): each kernel gets its operand
    untransposed, computed directly in that orientation (``S^T = K Q^T``).
    ``q_idx``/``k_idx`` are the tiles' positions, ``cols_start`` the first column's (a query with
    ``KEYS_ON_ROWS``, else a key).
    The scores are fp32 dots of the unscaled tiles, as in the forward; ``qk_scale``
    turns them into logits of ``UNITS``, and ``rows = (row_m, row_logd2, delta)`` are the query rows' final
    states (``_load_row_stats``) and δ. With ``MASKED``, positions that do not
    count (bounds, causal, the window, the user's mask) get ``P = 0``; without it every pair
    must count, and the scale folds into the exponential, as in the forward.
    The score modifiers ``mods``/``MODS`` (``core.masking.modify_scores``) apply as in the forward: under a
    softcap the logits are ``c · tanh(s / c)``, so ``dS_scores = dS · (1 - tanh²)``; ALiBi's bias has no
    gradient to give and leaves dS as it is. ``sizes``, ``mask_bh``, ``MASKING``, ``DOTS``: ``forward``'s
    module docstring.
    """
    seqlen_q, seqlen_k, head_dim, head_dim_v = sizes
    mask_ptr, stride_mask_q, stride_mask_k = mask_bh
    row_m, row_logd2, delta = rows
    IS_CAUSAL: tl.constexpr = MASKING[0]
    HAS_MASK: tl.constexpr = MASKING[1]
    MASK_IS_BOOL: tl.constexpr = MASKING[2]
    MASK_PER_KEY: tl.constexpr = MASKING[3]
    DOT_PRECISION: tl.constexpr = DOTS[0]
    UPCAST_DOTS: tl.constexpr = DOTS[1]
    HAS_SOFTCAP: tl.constexpr = MODS[0]
    HAS_ALIBI: tl.constexpr = MODS[2]
    HAS_WINDOW: tl.constexpr = MODS[3]
    softcap, alibi, window_left, window_right = mods
    if KEYS_ON_ROWS:
        s = dot(k, tl.trans(q), None, DOT_PRECISION, UPCAST_DOTS)
        dp = dot(v, tl.trans(do), None, DOT_PRECISION, UPCAST_DOTS)
        query_m, query_logd2, query_delta = row_m[None, :], row_logd2[None, :], delta[None, :]
    else:
        s = dot(q, tl.trans(k), None, DOT_PRECISION, UPCAST_DOTS)
        dp = dot(do, tl.trans(v), None, DOT_PRECISION, UPCAST_DOTS)
        query_m, query_logd2, query_delta = row_m[:, None], row_logd2[:, None], delta[:, None]
    tanh = s  # tanh(s / softcap) under a softcap (below); named on every path, as Triton wants every name it reads
    if MASKED or HAS_SOFTCAP or HAS_ALIBI:
        if KEYS_ON_ROWS:  # keys on rows, the query tile across (ALiBi's positions: add_alibi)
            s, tanh = modify_scores(s * qk_scale, k_idx, cols_start, tl.arange(0, q_idx.shape[0]), seqlen_q,
                                    seqlen_k, mods, MODS, True)
        else:
            s, tanh = modify_scores(s * qk_scale, q_idx, cols_start, tl.arange(0, k_idx.shape[0]), seqlen_q,
                                    seqlen_k, mods, MODS)
        if MASKED:
            s = apply_masks(
                s, q_idx, k_idx, seqlen_q, seqlen_k, mask_ptr, stride_mask_q, stride_mask_k,
                IS_CAUSAL, HAS_MASK, MASK_IS_BOOL, NATURAL_BIAS, MASK_PER_KEY, KEYS_ON_ROWS,
                window_left, window_right, HAS_WINDOW,
            )
        if UNITS == BASE2_UNITS:
            p = tl.exp2(s - query_m)
        else:  # the difference to m first, then log2(e): a bias of any finite size keeps its precision
            p = tl.exp2((s - query_m) * UNITS - query_logd2)
    else:
        p = tl.exp2(s * qk_scale - query_m)
    ds = p * (dp - query_delta)
    ds_scores = ds
    if HAS_SOFTCAP:
        ds_scores = ds * (1.0 - tanh * tanh)
    return p, ds, ds_scores


@triton.jit
def _load_rows(ptr, q_idx, seqlen_q):
    """One fp32 value per query row (δ) of a (batch, head)'s row vector; 0 past ``seqlen_q``."""
    return tl.load(ptr + q_idx, mask=q_idx < seqlen_q, other=0.0)


@triton.jit
def _dkdv_over_query_tiles(
    dk, dv, k, v, k_idx, q_src, do_src, stride_qm, stride_dom, row_src, query_start, query_end, sizes, qk_scale,
    mask_bh, mods,
    TILE: tl.constexpr, MASKING: tl.constexpr, UNITS: tl.constexpr, DOTS: tl.constexpr, MODS: tl.constexpr,
    MASKED: tl.constexpr,
):
    """Add the query tiles ``[query_start, query_end)`` of one query head to the key tile's (dk, dv) accumulators.

    ``TILE`` is the Q/dO tiles' shape (``BLOCK`` = ``BLOCK_M``). ``query_start`` must be a multiple of
    ``BLOCK_M``. Query rows are always bounds-checked (rows past ``seqlen_q`` load as zeros and add nothing).
    ``row_src = (stats_ptr, bh_rows, n_stat_rows, delta_src)``: the row statistics (``_load_row_stats``), the
    flat row index of the head's query 0 in them, their row count (B·H·Lq), and the head's δ.
    """
    seqlen_q, seqlen_k, head_dim, head_dim_v = sizes
    stats_ptr, bh_rows, n_stat_rows, delta_src = row_src
    BLOCK_M: tl.constexpr = TILE[0]
    HEAD_DIM_PADDED: tl.constexpr = TILE[1]
    HEAD_DIM_V_PADDED: tl.constexpr = TILE[2]
    EVEN_D: tl.constexpr = TILE[3]
    EVEN_DV: tl.constexpr = TILE[4]
    DOT_PRECISION: tl.constexpr = DOTS[0]
    UPCAST_DOTS: tl.constexpr = DOTS[1]
    for start in tl.range(query_start, query_end, BLOCK_M):
        start = tl.multiple_of(start, BLOCK_M)
        q_idx = tl.cast(start, tl.int64) + tl.arange(0, BLOCK_M)
        q = load_tile(q_src, start, seqlen_q, stride_qm, head_dim, BLOCK_M, HEAD_DIM_PADDED, True, EVEN_D, False)
        do = load_tile(do_src, start, seqlen_q, stride_dom, head_dim_v, BLOCK_M, HEAD_DIM_V_PADDED, True, EVEN_DV,
                       False)
        row_m, row_logd2 = _load_row_stats(stats_ptr, bh_rows + q_idx, q_idx < seqlen_q, n_stat_rows, UNITS)
        delta = _load_rows(delta_src, q_idx, seqlen_q)
        p, _, ds = _probs_and_score_grads(
            q, k, v, do, (row_m, row_logd2, delta), qk_scale, q_idx, k_idx, start, sizes, mask_bh, mods,
            MASKING, UNITS, DOTS, MODS, MASKED=MASKED, KEYS_ON_ROWS=True,
        )
        dv = dot(p.to(do.dtype), do, dv, DOT_PRECISION, UPCAST_DOTS)
        dk = dot(ds.to(q.dtype), q, dk, DOT_PRECISION, UPCAST_DOTS)
    return dk, dv


@triton.jit
def _dq_over_key_tiles(
    dq, q, do, rows, qk_scale, q_idx, k_src, v_src, stride_kn, stride_vn, ds_dst, key_start, key_end, sizes,
    mask_bh, mods,
    TILE: tl.constexpr, MASKING: tl.constexpr, UNITS: tl.constexpr, DOTS: tl.constexpr, MODS: tl.constexpr,
    MASKED: tl.constexpr, STORE_DS: tl.constexpr, ROW_SUMS: tl.constexpr,
):
    """Add keys ``[key_start, key_end)`` to the query tile's dq accumulator (unscaled: ``Σ dS K``).

    As ``attend_kv_tiles``: ``key_start`` a multiple of ``BLOCK_N`` (``TILE``'s ``BLOCK``); with
    ``MASKED`` K/V rows are bounds-checked and ``apply_masks`` runs, without it
    every key of the range counts for every row. ``rows``: ``_probs_and_score_grads``'. ``STORE_DS`` also
    writes dS (the bias gradient) to ``ds_dst``, the (batch, head)'s contiguous (Lq, Lk) fp32 matrix.
    With ``ROW_SUMS`` ``dq`` is a ``[BLOCK_M]`` vector instead, which gets
    ``Σ_j dS_ij`` (with δ 0: ``Σ_j P_ij dP_ij``, δ from this P itself).
    """
    seqlen_q, seqlen_k, head_dim, head_dim_v = sizes
    BLOCK_N: tl.constexpr = TILE[0]
    HEAD_DIM_PADDED: tl.constexpr = TILE[1]
    HEAD_DIM_V_PADDED: tl.constexpr = TILE[2]
    EVEN_D: tl.constexpr = TILE[3]
    EVEN_DV: tl.constexpr = TILE[4]
    DOT_PRECISION: tl.constexpr = DOTS[0]
    UPCAST_DOTS: tl.constexpr = DOTS[1]
    for start in tl.range(key_start, key_end, BLOCK_N):
        start = tl.multiple_of(start, BLOCK_N)
        k_idx = tl.cast(start, tl.int64) + tl.arange(0, BLOCK_N)
        k = load_tile(k_src, start, seqlen_k, stride_kn, head_dim, BLOCK_N, HEAD_DIM_PADDED, MASKED, EVEN_D, False)
        v = load_tile(v_src, start, seqlen_k, stride_vn, head_dim_v, BLOCK_N, HEAD_DIM_V_PADDED, MASKED, EVEN_DV,
                      False)
        p, ds, ds_scores = _probs_and_score_grads(
            q, k, v, do, rows, qk_scale, q_idx, k_idx, start, sizes, mask_bh, mods,
            MASKING, UNITS, DOTS, MODS, MASKED=MASKED, KEYS_ON_ROWS=False,
        )
        if ROW_SUMS:
            dq += tl.sum(ds, axis=1)
        else:
            if STORE_DS:
                ok = (q_idx < seqlen_q)[:, None] & (k_idx < seqlen_k)[None, :]
                tl.store(ds_dst + q_idx[:, None] * seqlen_k + k_idx[None, :], ds, mask=ok)
            dq = dot(ds_scores.to(k.dtype), k, dq, DOT_PRECISION, UPCAST_DOTS)
    return dq


@triton.jit
def _attention_bwd_preprocess_kernel(
    o_ptr, do_ptr, dlse_ptr, delta_ptr,
    stride_ob, stride_oh, stride_om, stride_dob, stride_doh, stride_dom,
    n_heads, seqlen_q, head_dim,
    BLOCK_M: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, EVEN_D: tl.constexpr, HAS_DLSE: tl.constexpr,
):
    # For one tile of BLOCK_M rows of one (batch, head): δ = rowsum(dO ⊙ O) - dLSE (dLSE is (B, H, Lq)
    # contiguous). O is the forward's output, or its fp32 copy (forward_for_backward); head_dim is O's (Dv).
    n_query_tiles = tl.cdiv(seqlen_q, BLOCK_M)
    bh = tl.program_id(0) // n_query_tiles
    m_start = (tl.program_id(0) % n_query_tiles) * BLOCK_M
    b64 = tl.cast(bh // n_heads, tl.int64)
    h64 = tl.cast(bh % n_heads, tl.int64)
    o_src = o_ptr + b64 * stride_ob + h64 * stride_oh
    do_src = do_ptr + b64 * stride_dob + h64 * stride_doh
    o = load_tile(o_src, m_start, seqlen_q, stride_om, head_dim, BLOCK_M, HEAD_DIM_PADDED, True, EVEN_D, False)
    do = load_tile(do_src, m_start, seqlen_q, stride_dom, head_dim, BLOCK_M, HEAD_DIM_PADDED, True, EVEN_D, False)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), axis=1)
    rows = tl.cast(bh, tl.int64) * seqlen_q + m_start + tl.arange(0, BLOCK_M)
    ok = (m_start + tl.arange(0, BLOCK_M)) < seqlen_q
    if HAS_DLSE:
        delta -= tl.load(dlse_ptr + rows, mask=ok, other=0.0)
    tl.store(delta_ptr + rows, delta, mask=ok)


@triton.jit
def _attention_bwd_dkdv_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, stats_ptr, delta_ptr, dk_ptr, dv_ptr, alibi_ptr,
    mask, seqs, q_strides, k_strides, v_strides, do_strides, dk_strides, dv_strides, stride_alibi_b,
    heads, sizes, qk_scale, scale, variants,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIMS: tl.constexpr, MASKING: tl.constexpr, UNITS: tl.constexpr,
    DOTS: tl.constexpr, MODS: tl.constexpr,
):
    # Tiles numbered per (batch, kv head), key tile fastest; under causal the first key tiles see the most
    # queries, and they are the first to start. Arguments grouped as the forward kernel's (forward's docstring).
    n_heads, kv_group, n_bh = heads
    seqlen_q, seqlen_k, head_dim, head_dim_v = sizes
    softcap, window_left, window_right = variants
    HEAD_DIM_PADDED: tl.constexpr = DIMS[0]
    HEAD_DIM_V_PADDED: tl.constexpr = DIMS[1]
    EVEN_D: tl.constexpr = DIMS[2]
    EVEN_DV: tl.constexpr = DIMS[3]
    IS_CAUSAL: tl.constexpr = MASKING[0]
    HAS_MASK: tl.constexpr = MASKING[1]
    SEQ_BLOCK: tl.constexpr = MASKING[4]
    VARLEN: tl.constexpr = SEQ_BLOCK > 0
    HAS_ALIBI: tl.constexpr = MODS[2]
    HAS_WINDOW: tl.constexpr = MODS[3]
    Q_TILE: tl.constexpr = (BLOCK_M, HEAD_DIM_PADDED, HEAD_DIM_V_PADDED, EVEN_D, EVEN_DV)
    n_kv_heads = n_heads // kv_group
    if VARLEN:  # a packed batch: one flattened schedule of every sequence's key tiles (plan.packed_tile)
        h_kv, b, n_start = packed_tile(tl.program_id(0), seqs[1], n_bh // n_heads, seqs[3], tl.arange(0, SEQ_BLOCK),
                                       BLOCK_N, False)
    else:
        n_key_tiles = tl.cdiv(seqlen_k, BLOCK_N)
        bh_kv = tl.program_id(0) // n_key_tiles
        n_start = (tl.program_id(0) % n_key_tiles) * BLOCK_N
        b = bh_kv // n_kv_heads
        h_kv = bh_kv % n_kv_heads
    b64 = tl.cast(b, tl.int64)
    h_kv64 = tl.cast(h_kv, tl.int64)
    # A packed batch: sequence b's rows and lengths (core.packed); a number with no tile has no work.
    q_row0, k_row0, len_q, len_k, stats_row0, stats_head_stride = sequence_bounds(
        seqs, b, n_heads, seqlen_q, seqlen_k, VARLEN)
    live = True
    if VARLEN:
        live = (n_start >= 0) & (n_start < len_k)
    if live:
        n_stat_rows = tl.cast(n_bh, tl.int64) * seqlen_q  # B·H·Lq

        k_src = k_ptr + b64 * k_strides[0] + h_kv64 * k_strides[1] + k_row0 * k_strides[2]
        v_src = v_ptr + b64 * v_strides[0] + h_kv64 * v_strides[1] + k_row0 * v_strides[2]
        k = load_tile(k_src, n_start, len_k, k_strides[2], head_dim, BLOCK_N, HEAD_DIM_PADDED, True, EVEN_D, False)
        v = load_tile(v_src, n_start, len_k, v_strides[2], head_dim_v, BLOCK_N, HEAD_DIM_V_PADDED, True, EVEN_DV,
                      False)
        k_idx = tl.cast(n_start, tl.int64) + tl.arange(0, BLOCK_N)
        dk = tl.zeros([BLOCK_N, HEAD_DIM_PADDED], tl.float32)
        dv = tl.zeros([BLOCK_N, HEAD_DIM_V_PADDED], tl.float32)

        # [full_start, full_end): query tiles that see every key of this tile; the rest of [query_start,
        # query_end): masked ones (the causal diagonal, the window's edges, or all with a user mask). See the
        # docstring's example.
        query_start, full_start, full_end, query_end = query_ranges(
            n_start, n_start + BLOCK_N - 1, len_q, len_k, BLOCK_M, IS_CAUSAL, window_left, window_right, HAS_WINDOW)
        if HAS_MASK:  # every tile masked
            full_start = tl.cdiv(query_end, BLOCK_M) * BLOCK_M
            full_end = full_start

        for g in range(0, kv_group):  # every query head that reads this K/V head
            h64 = h_kv64 * kv_group + g
            q_src = q_ptr + b64 * q_strides[0] + h64 * q_strides[1] + q_row0 * q_strides[2]
            do_src = do_ptr + b64 * do_strides[0] + h64 * do_strides[1] + q_row0 * do_strides[2]
            stats_row = stats_row0 + h64 * stats_head_stride
            row_src = (stats_ptr, stats_row, n_stat_rows, delta_ptr + stats_row)
            mask_bh = (mask[0], mask[3], mask[4])  # this (batch, head)'s mask (core.masking)
            if HAS_MASK:
                mask_bh = (mask[0] + b64 * mask[1] + h64 * mask[2], mask[3], mask[4])
            mods = (softcap, alibi_slope(alibi_ptr, stride_alibi_b, b64, h64, UNITS, HAS_ALIBI), window_left,
                    window_right)
            # The diagonal (or the window's near edge), the full tiles, then the window's far edge: query tiles
            # that see only this tile's first keys (empty without a window).
            for part in tl.static_range(3):
                first, last = range_part(part, query_start, full_start, full_end, query_end)
                if (part != 1 or not HAS_MASK) and (part != 2 or HAS_WINDOW):
                    dk, dv = _dkdv_over_query_tiles(
                        dk, dv, k, v, k_idx, q_src, do_src, q_strides[2], do_strides[2], row_src, first, last,
                        (len_q, len_k, head_dim, head_dim_v), qk_scale, mask_bh, mods, Q_TILE, MASKING, UNITS, DOTS,
                        MODS, MASKED=part != 1,
                    )

        dk_dst = dk_ptr + b64 * dk_strides[0] + h_kv64 * dk_strides[1] + k_row0 * dk_strides[2]
        dv_dst = dv_ptr + b64 * dv_strides[0] + h_kv64 * dv_strides[1] + k_row0 * dv_strides[2]
        store_tile(dk_dst, (dk * scale).to(k.dtype), n_start, len_k, dk_strides[2], head_dim, BLOCK_N,
                   HEAD_DIM_PADDED, EVEN_D)
        store_tile(dv_dst, dv.to(v.dtype), n_start, len_k, dv_strides[2], head_dim_v, BLOCK_N, HEAD_DIM_V_PADDED,
                   EVEN_DV)


@triton.jit
def _attention_bwd_dq_kernel(
    q_ptr, k_ptr, v_ptr, do_ptr, stats_ptr, delta_ptr, dlse_ptr, dq_ptr, ds_ptr, alibi_ptr,
    mask, seqs, q_strides, k_strides, v_strides, do_strides, dq_strides, stride_alibi_b,
    heads, sizes, qk_scale, scale, variants,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIMS: tl.constexpr, MASKING: tl.constexpr, UNITS: tl.constexpr,
    STORE_DS: tl.constexpr, HAS_DLSE: tl.constexpr, DELTA_PASS: tl.constexpr, DOTS: tl.constexpr,
    MODS: tl.constexpr,
):
    # Numbered as the forward (``query_tile``). With DELTA_PASS the same walk over the keys writes
    # δ = Σ_j P_ij dP_ij - dLSE per row (from this P, not from the forward's rounded O) instead of dQ.
    n_heads, kv_group, n_bh = heads
    seqlen_q, seqlen_k, head_dim, head_dim_v = sizes
    softcap, window_left, window_right = variants
    HEAD_DIM_PADDED: tl.constexpr = DIMS[0]
    HEAD_DIM_V_PADDED: tl.constexpr = DIMS[1]
    EVEN_D: tl.constexpr = DIMS[2]
    EVEN_DV: tl.constexpr = DIMS[3]
    IS_CAUSAL: tl.constexpr = MASKING[0]
    HAS_MASK: tl.constexpr = MASKING[1]
    SEQ_BLOCK: tl.constexpr = MASKING[4]
    VARLEN: tl.constexpr = SEQ_BLOCK > 0
    HAS_ALIBI: tl.constexpr = MODS[2]
    HAS_WINDOW: tl.constexpr = MODS[3]
    KV_TILE: tl.constexpr = (BLOCK_N, HEAD_DIM_PADDED, HEAD_DIM_V_PADDED, EVEN_D, EVEN_DV)
    if VARLEN:  # a packed batch: the forward's flattened schedule (plan.packed_tile)
        h, b, m_start = packed_tile(tl.program_id(0), seqs[0], n_bh // n_heads, seqs[2], tl.arange(0, SEQ_BLOCK),
                                    BLOCK_M, IS_CAUSAL)
        bh = b * n_heads + h
    else:
        bh, m_start = query_tile(tl.program_id(0), tl.cdiv(seqlen_q, BLOCK_M), BLOCK_M, IS_CAUSAL)
    b64 = tl.cast(bh // n_heads, tl.int64)
    # A packed batch: sequence b's rows and lengths (core.packed); a number with no tile has no work.
    q_row0, k_row0, len_q, len_k, stats_row0, stats_head_stride = sequence_bounds(
        seqs, bh // n_heads, n_heads, seqlen_q, seqlen_k, VARLEN)
    live = True
    if VARLEN:
        live = (m_start >= 0) & (m_start < len_q)
    if live:
        h64 = tl.cast(bh % n_heads, tl.int64)
        h_kv64 = h64 // kv_group
        bh64 = tl.cast(bh, tl.int64)

        q_src = q_ptr + b64 * q_strides[0] + h64 * q_strides[1] + q_row0 * q_strides[2]
        do_src = do_ptr + b64 * do_strides[0] + h64 * do_strides[1] + q_row0 * do_strides[2]
        k_src = k_ptr + b64 * k_strides[0] + h_kv64 * k_strides[1] + k_row0 * k_strides[2]
        v_src = v_ptr + b64 * v_strides[0] + h_kv64 * v_strides[1] + k_row0 * v_strides[2]
        mask_bh = (mask[0], mask[3], mask[4])  # this (batch, head)'s mask (core.masking)
        if HAS_MASK:
            mask_bh = (mask[0] + b64 * mask[1] + h64 * mask[2], mask[3], mask[4])
        ds_dst = ds_ptr
        if STORE_DS:  # a (B, H, Lq, Lk) contiguous fp32 buffer
            ds_dst = ds_ptr + bh64 * seqlen_q * seqlen_k
        mods = (softcap, alibi_slope(alibi_ptr, stride_alibi_b, b64, h64, UNITS, HAS_ALIBI), window_left,
                window_right)

        q = load_tile(q_src, m_start, len_q, q_strides[2], head_dim, BLOCK_M, HEAD_DIM_PADDED, True, EVEN_D, False)
        do = load_tile(do_src, m_start, len_q, do_strides[2], head_dim_v, BLOCK_M, HEAD_DIM_V_PADDED, True, EVEN_DV,
                       False)
        q_idx = tl.cast(m_start, tl.int64) + tl.arange(0, BLOCK_M)
        rows = stats_row0 + h64 * stats_head_stride + q_idx
        row_m, row_logd2 = _load_row_stats(stats_ptr, rows, q_idx < len_q, tl.cast(n_bh, tl.int64) * seqlen_q,
                                           UNITS)
        if DELTA_PASS:
            delta = tl.zeros([BLOCK_M], tl.float32)
            dq = tl.zeros([BLOCK_M], tl.float32)
        else:
            delta = _load_rows(delta_ptr + stats_row0 + h64 * stats_head_stride, q_idx, len_q)
            dq = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], tl.float32)

        # Key ranges as the forward's (attend_key_range): the window's near edge (masked), the full tiles (none
        # under a user mask), the masked rest of [key_start, key_end).
        key_start, full_start, full_end, key_end = key_ranges(
            m_start, tl.minimum(m_start + BLOCK_M, len_q) - 1, len_q, len_k, BLOCK_N, IS_CAUSAL, HAS_MASK,
            window_left, window_right, HAS_WINDOW)
        for part in tl.static_range(3):
            first, last = range_part(part, key_start, full_start, full_end, key_end)
            if (part != 0 or HAS_WINDOW) and (part != 1 or not HAS_MASK):
                dq = _dq_over_key_tiles(
                    dq, q, do, (row_m, row_logd2, delta), qk_scale, q_idx, k_src, v_src, k_strides[2], v_strides[2],
                    ds_dst, first, last, (len_q, len_k, head_dim, head_dim_v), mask_bh, mods,
                    KV_TILE, MASKING, UNITS, DOTS, MODS, MASKED=part != 1,
                    STORE_DS=STORE_DS and part != 1 and not DELTA_PASS, ROW_SUMS=DELTA_PASS,
                )
        # Two branches, no early return: Triton 3.6 still builds the code after a `return` inside a constexpr
        # `if`, where the delta pass's [BLOCK_M] dq does not fit the [BLOCK_M, HEAD_DIM_PADDED] store.
        if DELTA_PASS:
            if HAS_DLSE:
                dq -= tl.load(dlse_ptr + rows, mask=q_idx < len_q, other=0.0)
            tl.store(delta_ptr + rows, dq, mask=q_idx < len_q)
        else:
            dq_dst = dq_ptr + b64 * dq_strides[0] + h64 * dq_strides[1] + q_row0 * dq_strides[2]
            store_tile(dq_dst, (dq * scale).to(q.dtype), m_start, len_q, dq_strides[2], head_dim, BLOCK_M,
                       HEAD_DIM_PADDED, EVEN_D)


# ----------------------------------------------------------------------------- host side


# The Triton backward on CUDA, checked by `pytest -m gpu` (tests/test_gpu_attention.py: FlashAttention's
# test matrix, fp16/bf16, every head dim, MHA/GQA/MQA, causal and not; tests/test_gpu_backward.py: the
# masks). Scores are scaled after the dot, in fp32: scaling the loaded Q tile that also fed a dot was
# miscompiled by Triton 3.6 (TUNING.md#backward-dk-miscompile). fp32 has not been checked on a GPU, so
# CUDA fp32 keeps `attention_backward_torch` (correct, but it materialises the (Lq, Lk) scores), as every
# dtype does with this flag set to False.
TRITON_BACKWARD_ON_GPU = True


def triton_backward_enabled(q: torch.Tensor, packed: bool = False) -> bool:
    """True when ``attention_backward`` runs the Triton kernels for ``q`` (always off CUDA; on CUDA fp16/bf16, and
    fp32 too for a ``packed`` batch, whose PyTorch stand-in would read the sequence lengths on the host)."""
    return not q.is_cuda or (TRITON_BACKWARD_ON_GPU and (packed or q.dtype != torch.float32))


def _bhl_strides(t: torch.Tensor) -> tuple[int, int, int]:
    """Batch, head and row strides of a (B, H, L, D) tensor whose head dim has stride 1."""
    return t.stride(0), t.stride(1), t.stride(2)


def sink_gradient(sinks: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor) -> torch.Tensor:
    """The gradient of attention sinks (H,) from the rows' LSE (the sink included) and δ (B, H, Lq): the sink is
    one more logit of every row with ``dP = 0`` (its value vector is zeros), so its ``dS`` is ``p_sink · (0 -
    δ)`` with ``p_sink = e^(sink - LSE)``, summed over the rows of its head."""
    p_sink = torch.exp(sinks.float().view(1, -1, 1) - lse)
    return (-(p_sink * delta).sum(dim=(0, 2))).to(sinks.dtype)


class BackwardLaunch:
    """The backward of one call signature, planned once: δ's kernel, then the two passes, on ``backward_hopper``'s
    kernels where they apply (``wgmma_backward_eligible``) or this module's; every grid, tile, descriptor box
    and constexpr worked out here, so that a call binds its tensors and launches (``core.runtime.KernelLaunch``).

    Built from the call's (B, H, L, D) tensors whose head dim has stride 1 (v and do of v's head dim Dv), used
    for their shapes, strides, dtypes and alignments: every call must bring tensors of the same signature.
    ``mask`` (broadcast to (B, H, Lq, Lk)), ``mask_is_bool``, ``causal``, ``scale`` and the variants
    (``softcap``, ``window`` as ``plan.visibility`` gives it, ``has_alibi``) are the forward's;
    ``mask_needs_grad``: also the gradient of an additive mask; ``has_dlse``: calls bring the gradient of the
    returned LSE. ``config`` forces the tiles (tests, bench/backward_tune.py): a ``BackwardConfig`` runs this
    module's kernels on it, a ``WgmmaBackwardConfig`` the Hopper kernels (where they apply). CUDA fp32 (and every
    dtype without ``TRITON_BACKWARD_ON_GPU``) takes ``reference.attention_backward_torch``.
    """

    def __init__(
        self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
        mask: torch.Tensor | None, mask_is_bool: bool, mask_needs_grad: bool = False, has_dlse: bool = False,
        config: BackwardConfig | WgmmaBackwardConfig | None = None, softcap: float | None = None,
        window: tuple[int, int] | None = None, has_alibi: bool = False, varlen: tuple[int, int, int] | None = None,
    ):
        self.options = (causal, scale, mask_is_bool, mask_needs_grad, softcap, window)
        self.varlen = varlen
        self.torch_path = not triton_backward_enabled(q, varlen is not None)
        if self.torch_path:
            return
        batch, n_heads, seqlen_q, head_dim = q.shape
        seqlen_k, head_dim_v = k.shape[2], v.shape[3]
        hd_pad, dv_pad = head_dim_padded(head_dim), head_dim_padded(head_dim_v)
        self.delta_shape = (batch, n_heads, seqlen_q)  # a packed batch's: (1, H, total_q), its LSE's layout
        self.totals = (seqlen_q, seqlen_k)
        if varlen is not None:  # (1, H, total, D) tensors of (sequences, max_seqlen_q, max_seqlen_k): core.packed
            batch, seqlen_q, seqlen_k = varlen
        bh = batch * n_heads
        additive = mask is not None and not mask_is_bool
        self.additive, self.mask_needs_grad = additive, mask_needs_grad
        variant_scalars, variant_meta = variant_args(q, additive, softcap, window, has_alibi, False,
                                                     *self.totals)  # (as the forward's: a packed batch's totals)
        variant_meta.pop("HAS_SINKS")  # the sinks' gradient is taken here, from δ; the kernels see the LSE alone
        # δ = rowsum(dO ⊙ O) - dLSE (with a mask's gradient: the dQ kernel's pass instead, below).
        self.delta = None
        if not mask_needs_grad:
            self.delta = KernelLaunch(
                _attention_bwd_preprocess_kernel,  # over the rows of every (batch, head): a packed batch's as one
                (triton.cdiv(self.delta_shape[2], tuning.DELTA_BLOCK_M) * self.delta_shape[0] * n_heads,),
                BLOCK_M=tuning.DELTA_BLOCK_M, HEAD_DIM_PADDED=dv_pad, EVEN_D=head_dim_v == dv_pad, HAS_DLSE=has_dlse)
            self.delta_sizes = self.delta_shape[1:] + (head_dim_v,)  # a packed batch's rows as one sequence
        hopper_config = config if isinstance(config, WgmmaBackwardConfig) else None
        if hopper_config is not None:
            config = None
        self.hopper = None
        if (config is None and (varlen is None or hopper_varlen_enabled())
                and wgmma_backward_eligible(q, k, v, do, mask is not None, scale)):
            self.hopper = HopperBackwardLaunch(do, q, k, v, causal, scale, variant_scalars, variant_meta,
                                               hopper_config, varlen)
            return
        config = config or default_backward_config(max(head_dim, head_dim_v), q.dtype, q.device)
        self.mask_strides = mask.stride() if mask is not None else (0, 0, 0, 0)  # core.masking's `mask` tuple
        self.sizes = ((n_heads, n_heads // k.shape[1], bh), (seqlen_q, seqlen_k, head_dim, head_dim_v),
                      qk_scale_for(scale, additive), scale, variant_scalars)
        self.grads = [OutputLayout(t, t.shape[3]) for t in (q, k, v)]  # dq, dk, dv: laid out as empty_like
        grad_like = [layout.meta(q.dtype) for layout in self.grads]
        inputs = (_bhl_strides(q), _bhl_strides(k), _bhl_strides(v), _bhl_strides(do))
        self.dkdv_strides = (*inputs, _bhl_strides(grad_like[1]), _bhl_strides(grad_like[2]))
        self.dq_strides = (*inputs, _bhl_strides(grad_like[0]))
        if varlen is not None:  # one (1, H, total) row space: a sequence's rows start at its cu_seqlens
            self.dkdv_strides, self.dq_strides = (tuple((0, *strides[1:]) for strides in group)
                                                  for group in (self.dkdv_strides, self.dq_strides))
        seq_block = 0
        dkdv_grid = (triton.cdiv(seqlen_k, config.dkdv.block_n) * batch * k.shape[1],)
        dq_grid = (triton.cdiv(seqlen_q, config.dq.block_m) * bh,)
        if varlen is not None:  # the flattened schedules of every sequence's key and query tiles (plan.packed_tile)
            key_numbers, seq_block = packed_schedule(batch, self.totals[1], config.dkdv.block_n, config.dkdv.num_warps)
            query_numbers, _ = packed_schedule(batch, self.totals[0], config.dq.block_m, config.dkdv.num_warps)
            dkdv_grid, dq_grid = (key_numbers * k.shape[1],), (query_numbers * n_heads,)
        meta = kernel_switches(q, causal, mask, mask_is_bool, head_dim, head_dim_v, variant_meta, seq_block)
        c = config.dkdv
        self.dkdv = KernelLaunch(
            _attention_bwd_dkdv_kernel, dkdv_grid,
            BLOCK_M=c.block_m, BLOCK_N=c.block_n, num_warps=c.num_warps, num_stages=c.num_stages, **meta)
        c = config.dq
        dq_meta = dict(BLOCK_M=c.block_m, BLOCK_N=c.block_n, num_warps=c.num_warps, num_stages=c.num_stages,
                       **meta)
        # δ = Σ_j P_ij dP_ij from the P the kernels recompute (one more walk over the keys), so that the bias
        # gradient's row sums Σ_j dS_ij = Σ_j P_ij dP_ij - δ_i come out 0 to fp32 rounding; rowsum(dO ⊙ O)
        # differs from it by the forward's rounding of P (and of O) to the input dtype.
        self.delta_pass = None
        if mask_needs_grad:
            self.delta_pass = KernelLaunch(_attention_bwd_dq_kernel, dq_grid, DELTA_PASS=True, STORE_DS=False,
                                           HAS_DLSE=has_dlse, **dq_meta)
        self.dq = KernelLaunch(_attention_bwd_dq_kernel, dq_grid, DELTA_PASS=False, STORE_DS=mask_needs_grad,
                               HAS_DLSE=False, **dq_meta)
        self.ds_shape = (batch, n_heads, seqlen_q, seqlen_k)

    def __call__(
        self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor,
        lse: torch.Tensor, dlse: torch.Tensor | None, mask: torch.Tensor | None = None,
        alibi: torch.Tensor | None = None, sinks: torch.Tensor | None = None, row_stats: torch.Tensor | None = None,
        seqs: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
        """``(dq, dk, dv, dmask, dsinks)`` (see ``attention_backward``); a packed batch brings ``seqs =
        (cu_seqlens_q, cu_seqlens_k)``."""
        if self.torch_path:
            causal, scale, mask_is_bool, mask_needs_grad, softcap, window = self.options
            if self.varlen is not None:  # each sequence apart (TRITON_BACKWARD_ON_GPU off)
                return attention_varlen_backward_torch(do, q, k, v, dlse, seqs, causal, scale, softcap, window,
                                                       alibi, sinks)
            return attention_backward_torch(do, q, k, v, dlse, causal, scale, mask, mask_is_bool, mask_needs_grad,
                                            softcap, window, alibi, sinks)
        delta = torch.empty(self.delta_shape, dtype=torch.float32, device=q.device)
        if dlse is not None:
            dlse = dlse.float().contiguous()
        if self.additive and row_stats is None:  # (m, log d) = (lse, 0): the same P wherever the LSE kept log d
            row_stats = torch.stack([lse.float(), torch.zeros_like(lse, dtype=torch.float32)])
        stats = (row_stats if self.additive else lse).contiguous()
        if self.delta is not None:
            self.delta(o, do, dlse, delta, *_bhl_strides(o), *_bhl_strides(do), *self.delta_sizes)
        ds = None
        if self.hopper is not None:
            dq, dk, dv = self.hopper(do, q, k, v, stats, delta, alibi, seqs)
        else:
            dq, dk, dv = (layout.empty(t) for layout, t in zip(self.grads, (q, k, v)))
            visible = ((mask, *self.mask_strides), (*seqs, *self.totals) if seqs is not None else None)
            common = (alibi.stride(0) if alibi is not None else 0, *self.sizes)
            if self.delta_pass is not None:
                self.delta_pass(q, k, v, do, stats, delta, dlse, dq, None, alibi, *visible, *self.dq_strides, *common)
                ds = torch.zeros(self.ds_shape, dtype=torch.float32, device=q.device)
            self.dkdv(q, k, v, do, stats, delta, dk, dv, alibi, *visible, *self.dkdv_strides, *common)
            self.dq(q, k, v, do, stats, delta, None, dq, ds, alibi, *visible, *self.dq_strides, *common)
        dsinks = sink_gradient(sinks, lse, delta) if sinks is not None else None
        return dq, dk, dv, ds, dsinks


def attention_backward(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, o: torch.Tensor, lse: torch.Tensor,
    dlse: torch.Tensor | None, causal: bool, scale: float, mask: torch.Tensor | None, mask_is_bool: bool,
    mask_needs_grad: bool = False, config: BackwardConfig | WgmmaBackwardConfig | None = None,
    row_stats: torch.Tensor | None = None, softcap: float | None = None, window: tuple[int, int] | None = None,
    alibi: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor | None, torch.Tensor | None]:
    """Gradients of ``flash_attention`` from the saved forward, on (B, H, L, D) tensors whose head dim has stride 1
    (v, o and do have v's head dim Dv): one ``BackwardLaunch``, planned and run once.

    Two passes: dK/dV (one program a key tile), then dQ (one program a query tile, summing over the keys in a
    fixed order): two runs give bitwise-equal gradients, on every path. On Hopper, fp16/bf16 calls without a
    mask run them on ``backward_hopper``'s kernels (``backward_hopper.wgmma_backward_eligible``).

    Args:
        do: (B, H, Lq, Dv) gradient of the output ``o`` (head dim stride 1).
        q, k, v, o: the forward's inputs and output; k, v have H_kv heads.
        lse: (B, H, Lq) fp32 natural-log LSE from the forward (``-inf`` for empty rows; the sinks included).
        dlse: None or the (B, H, Lq) gradient of the returned LSE.
        causal, scale, mask, mask_is_bool: as given to the forward (``mask`` broadcast to (B, H, Lq, Lk)).
        mask_needs_grad: also return the gradient of an additive mask.
        config: forces the tiles (``BackwardLaunch``).
        softcap: the forward's logit softcap, or None.
        window: the forward's sliding window (``plan.visibility``), or None.
        alibi: the forward's (B, H) ALiBi slopes (``plan.alibi_view``), or None; they get no gradient.
        sinks: the forward's (H,) sinks, or None: their gradient is returned (``sink_gradient``).
        row_stats: under an additive mask, the forward's (2, B, H, Lq) ``(m, log d)`` of each row; None takes
            ``(lse, 0)``, exact unless a bias near -1e9 or below hides a whole row.

    Returns:
        ``(dq, dk, dv, dmask, dsinks)``: dq like q, dk/dv like k/v (summed over each GQA
        group), ``dmask`` (B, H, Lq, Lk) fp32 or None, ``dsinks`` (H,) or None.
    """
    plan = BackwardLaunch(do, q, k, v, causal, scale, mask, mask_is_bool, mask_needs_grad, dlse is not None, config,
                          softcap, window, alibi is not None)
    return plan(do, q, k, v, o, lse, dlse, mask, alibi, sinks, row_stats)
