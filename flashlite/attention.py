"""Flash attention, forward: ``O = softmax(Q Kᵀ · scale + mask) V`` without the L×L scores.

Each program owns one tile of ``BLOCK_M`` query rows of one (batch, head). It
keeps the Q tile on chip and streams the K/V tiles of its key range, ``BLOCK_N``
keys at a time. Per query row it carries the online-softmax state ``(m, d)`` of
``flashlite.online_softmax`` and an output accumulator ``acc = Σ e^(s - m) v``.
When a K tile raises the running maximum, ``online_update`` returns the same
``alpha = e^(m_old - m_new)`` that rescales ``d``, and ``acc`` is rescaled by it
too; at the end ``O = acc / d`` (``normalize``) and ``LSE = m + log d``
(``state_logsumexp``). Only O and, on request, LSE are written.

Precision and units: the scores ``s = q·kᵀ`` are fp32 dot products of the
unscaled inputs (nothing is rounded to the input dtype before the softmax), and
``qk_scale = scale · log2(e)`` is applied in fp32: on full tiles inside the
exponential (``online_update_scaled``: ``2^(s · qk_scale - m)``, one fused
multiply-add a score), on masked tiles before ``apply_masks``. ``m`` is then in
base-2 units. A negative ``scale`` is taken as ``-q`` with ``|scale|`` (exact).
With an additive mask the logits stay in natural-log units instead
(``UNITS = LOG2E``: ``s · scale + bias``, the difference to ``m`` taken before
the ``log2(e)``), so that a bias as large as ``finfo(fp32).min`` stays finite
and a row hidden by it averages its values, as PyTorch's softmax does.

Key ranges. For a query tile, keys split into
* full tiles: every (query, key) pair counts; no mask arithmetic at all;
* masked tiles: the causal diagonal, the ragged last K tile, or every tile
  when the user gave ``attn_mask``: ``apply_masks`` sets what does not count to
  ``-inf``.
Under ``causal`` (aligned bottom-right, as ``masked_softmax``), K tiles past the
tile's last visible key are never read. Worked example: seqlen_q = 4,
seqlen_k = 6 (offset 2), BLOCK_M = 2, BLOCK_N = 2. Query tile 0 (queries 0, 1)
sees keys 0..2 and 0..3: full tiles end at 2 (key tile 0 is visible to query
0 whole), masked keys 2..3, keys 4..5 skipped.

Layout. Tensors are (B, H, L, D) as in ``scaled_dot_product_attention``, read
through their strides (the head dim must have stride 1, else one copy), so views
of a packed qkv projection or of a (B, L, H, D) tensor cost nothing. K/V may
have fewer heads (GQA/MQA): query head ``h`` reads K/V head ``h // (H / H_kv)``.
Head dims that are not powers of two are padded to the next one inside the
kernel (masked loads), so D = 80 costs what D = 128 costs. On Hopper, Q/K/V
tiles arrive by TMA through host-side tensor descriptors over the tensors'
(B, H, L, D) strides (their bounds give zeros past L and D); without TMA, or
when a stride or base is not 16-byte aligned, through pointer loads.

On Hopper, fp16/bf16 calls at D = 64/128 without a user mask go to
``flashlite.attention_wgmma`` instead: the same loop written in Gluon, where the
softmax of one K tile runs while the previous tile's P V product is still on
the tensor cores (``attention_forward`` decides; ``FLASHLITE_WGMMA=0`` turns it
off). This module's kernel serves every other call, and tests run it.

Scheduling: one program per query tile, numbered head-major so that programs
running together share their head's K/V in L2; under causal, each head's last
(heaviest) query tiles first. A persistent grid (``AttentionConfig.persistent``)
runs the same loop with fewer programs.

The loop over K/V tiles is the jit helper ``_attend_kv_tiles``: it takes the
running ``(acc, m, d)`` and a key range, so the split-K/V (decoding) kernel of
``flashlite.split_kv`` runs it on a sub-range and merges the partial states
with ``merge_states``. ``flash_attention`` sends calls there when it splits
(``num_splits``) or is given per-element cache lengths (``cache_seqlens``).

Precision: fp16/bf16 dots accumulate in fp32, the softmax is fp32, P is rounded
to the input dtype for the second dot (as in FlashAttention). fp32 inputs use
IEEE fp32 dots (no tf32): accurate to ~1e-6, but several times slower than bf16.
The backward pass (dQ, dK, dV, an additive mask's gradient, a gradient through
LSE) is ``flashlite.attention_backward``; when q, k or v requires grad the
forward also writes LSE and saves q, k, v, o, LSE for it.
CPU tensors run the kernel through Triton's interpreter under
``TRITON_INTERPRET=1``, else a PyTorch fp32 computation that materialises the
scores.
"""

from __future__ import annotations

import functools
import inspect
import math
import os
from dataclasses import dataclass

import torch
import triton
import triton.language as tl

try:  # host-side tensor descriptors (TMA on Hopper): Triton >= 3.4
    from triton.tools.tensor_descriptor import TensorDescriptor
except ImportError:  # pragma: no cover - older Triton: K/V through pointers only
    TensorDescriptor = None

from ._runtime import (
    check_flag, check_float_dtype, check_scale, device_info, is_compiling, launch, launch_persistent, runs_kernels,
)
from .masking import apply_masks, broadcast_mask, key_ranges
from .online_softmax import (
    BASE2_UNITS, LN2, LOG2E, empty_state, normalize, online_update, online_update_scaled, state_logsumexp,
)

# An additive mask is only ever added to logits in its own natural-log units (``UNITS = LOG2E``).
NATURAL_BIAS = tl.constexpr(1.0)

# ----------------------------------------------------------------------------- jit helpers


@triton.jit
def _load_tile(
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
def _store_tile(
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
def _dot(a, b, acc, DOT_PRECISION: tl.constexpr, UPCAST_DOTS: tl.constexpr):
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
def _store_row_stats(stats_ptr, rows, n_rows, m, d, ok, UNITS: tl.constexpr):
    """Store each row's final state as ``(m, log d)`` in natural-log units: ``m`` at ``stats_ptr + rows``,
    ``log d`` ``n_rows`` further on (``(2, B, H, Lq)``). The backward recomputes ``P = e^(s - m - log d)``
    from these; their sum, the LSE, loses ``log d`` to rounding once ``|m|`` is ~1e8 (a bias of -1e9)."""
    tl.store(stats_ptr + rows, m * (UNITS * LN2), mask=ok)
    tl.store(stats_ptr + n_rows + rows, tl.log2(d) * LN2, mask=ok)


@triton.jit
def query_tile(tile, n_query_tiles, BLOCK_M: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """``(bh, m_start)`` of query tile number ``tile``: numbered head-major, query tile fastest, so that
    programs running together share their head's K/V in L2; under causal each head's last (heaviest)
    tiles come first. Every forward kernel and the backward's dQ kernel number tiles so."""
    bh = tile // n_query_tiles
    m_tile = tile % n_query_tiles
    if IS_CAUSAL:
        m_tile = n_query_tiles - 1 - m_tile
    return bh, m_tile * BLOCK_M


@triton.jit
def positive_scale(q, qk_scale):
    """``(q, qk_scale)`` with the scale made non-negative: ``(-q) · k · |c|`` is ``q · k · c`` exactly (a sign flip
    rounds nothing), and ``online_update_scaled`` needs ``qk_scale >= 0``. The flip goes through fp32, exactly:
    Triton's interpreter negates a bf16 tile as the integers of its bit patterns (as it multiplies them, _dot)."""
    return tl.where(qk_scale < 0, (-q.to(tl.float32)).to(q.dtype), q), tl.abs(qk_scale)


@triton.jit
def _attend_kv_tiles(
    acc, m, d, q, q_idx, qk_scale,
    k_src, v_src, stride_kn, stride_vn,
    key_start, key_end, seqlen_q, seqlen_k, head_dim,
    mask_ptr, stride_mask_q, stride_mask_k,
    BLOCK_N: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr, MASKED: tl.constexpr, UNITS: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, MASK_PER_KEY: tl.constexpr,
    EVEN_D: tl.constexpr, USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOTS: tl.constexpr,
):
    """Fold keys ``[key_start, key_end)`` into the running ``(acc, m, d)`` of the query tile ``q``.

    ``q`` ``[BLOCK_M, HEAD_DIM_PADDED]`` is the unscaled query tile and ``qk_scale``
    (>= 0, ``positive_scale``) turns its fp32 scores into logits of ``UNITS``
    (``BASE2_UNITS``: ``scale · log2(e)``; ``LOG2E``, under an additive mask:
    ``scale``). ``q_idx`` (64-bit) are its rows. ``key_start`` must be a
    multiple of ``BLOCK_N``. With ``MASKED`` every tile is scaled, then goes
    through ``apply_masks`` (bounds, causal, the user's mask) and its K/V rows are
    bounds-checked; without it every key of the range must count for every row
    (base-2 units only), and the scale is folded into the exponential.
    ``k_src``/``v_src`` are the (batch, kv head)'s base pointers, or with
    ``USE_TMA`` its ``(descriptor, b, h_kv)`` (see ``_load_tile``).
    Returns the new ``(acc, m, d)``; ``acc`` is not normalised.
    """
    for start in tl.range(key_start, key_end, BLOCK_N):
        start = tl.multiple_of(start, BLOCK_N)
        k = _load_tile(k_src, start, seqlen_k, stride_kn, head_dim, BLOCK_N, HEAD_DIM_PADDED, MASKED, EVEN_D, USE_TMA)
        s = _dot(q, tl.trans(k), None, DOT_PRECISION, UPCAST_DOTS)
        if MASKED:
            k_idx = start + tl.arange(0, BLOCK_N)
            s = apply_masks(
                s * qk_scale, q_idx, k_idx, seqlen_q, seqlen_k, mask_ptr, stride_mask_q, stride_mask_k,
                IS_CAUSAL, HAS_MASK, MASK_IS_BOOL, NATURAL_BIAS, MASK_PER_KEY,
            )
            m, d, p, alpha = online_update(m, d, s, UNITS)
        else:
            m, d, p, alpha = online_update_scaled(m, d, s, qk_scale)
        v = _load_tile(v_src, start, seqlen_k, stride_vn, head_dim, BLOCK_N, HEAD_DIM_PADDED, MASKED, EVEN_D, USE_TMA)
        acc = _dot(p.to(v.dtype), v, acc * alpha[:, None], DOT_PRECISION, UPCAST_DOTS)
    return acc, m, d


# ----------------------------------------------------------------------------- kernels


def kv_loop_flags(mask_ptr, mask_is_bool: bool, stride_mask_q: int, head_dim: int, head_dim_pad: int) -> dict:
    """The constexpr flags of every kernel built on ``_attend_kv_tiles``, from its arguments."""
    return dict(
        HAS_MASK=mask_ptr is not None,
        # A key-padding mask (B, 1, 1, Lk): one mask row per key tile instead of BLOCK_M copies of it.
        MASK_PER_KEY=stride_mask_q == 0,
        EVEN_D=head_dim == head_dim_pad,
        UNITS=logit_units(mask_ptr is not None and not mask_is_bool),
    )


def logit_units(additive_mask: bool) -> float:
    """``LOG2_PER_UNIT`` of a kernel's logits: natural-log units under an additive mask (a bias of any finite
    size stays finite), else base 2 (``log2(e)`` folded into the scale)."""
    return LOG2E.value if additive_mask else BASE2_UNITS.value


def qk_scale_for(scale: float, additive_mask: bool) -> float:
    """The factor a kernel multiplies its fp32 scores by: ``scale`` in the units of ``logit_units``."""
    return scale if additive_mask else scale * LOG2E.value


# The same flags as triton.heuristics, for the split-K/V and backward kernels. The forward's launcher
# calls ``kv_loop_flags`` itself: triton.heuristics rebuilds a dict of all ~40 arguments per flag, the
# largest Python part (cProfile) of the 100 us of host time one forward launch took on the H100 machine.
KV_LOOP_FLAGS = {
    name: (lambda args, name=name: kv_loop_flags(
        args["mask_ptr"], args["MASK_IS_BOOL"], args["stride_mask_q"], args["head_dim"], args["HEAD_DIM_PADDED"])[name])
    for name in ("HAS_MASK", "MASK_PER_KEY", "EVEN_D", "UNITS")
}


@triton.jit(do_not_specialize=["tune_bucket", "tune_mask_layout"])
def _attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, stats_ptr, mask_ptr,
    q_desc, k_desc, v_desc,  # (B, H, L, D) tensor descriptors under USE_TMA, else None
    stride_qb, stride_qh, stride_qm,
    stride_kb, stride_kh, stride_kn,
    stride_vb, stride_vh, stride_vn,
    stride_ob, stride_oh, stride_om,
    stride_mask_b, stride_mask_h, stride_mask_q, stride_mask_k,
    n_heads, kv_group, n_bh,
    seqlen_q, seqlen_k, head_dim, qk_scale,
    # Read by the autotuner's key only: a power-of-two bucket of seqlen_k, and the mask's
    # layout (MASK_LAYOUT_*), which the heuristics above derive too late for a key.
    tune_bucket, tune_mask_layout,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, HEAD_DIM_PADDED: tl.constexpr,
    IS_CAUSAL: tl.constexpr, HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, MASK_PER_KEY: tl.constexpr,
    EVEN_D: tl.constexpr, UNITS: tl.constexpr, WRITE_LSE: tl.constexpr, WRITE_STATS: tl.constexpr,
    USE_TMA: tl.constexpr, DOT_PRECISION: tl.constexpr, UPCAST_DOTS: tl.constexpr,
):
    # Tiles are numbered as ``query_tile`` says. Any grid size is correct: one
    # program per tile, or a persistent grid where each program takes several.
    n_query_tiles = tl.cdiv(seqlen_q, BLOCK_M)
    n_tiles = n_query_tiles * n_bh
    for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        bh, m_start = query_tile(tile, n_query_tiles, BLOCK_M, IS_CAUSAL)
        b = bh // n_heads
        h = bh % n_heads
        h_kv = h // kv_group
        b64 = tl.cast(b, tl.int64)

        o_dst = o_ptr + b64 * stride_ob + tl.cast(h, tl.int64) * stride_oh
        if USE_TMA:
            q_src = (q_desc, b, h)
            k_src = (k_desc, b, h_kv)
            v_src = (v_desc, b, h_kv)
        else:
            q_src = q_ptr + b64 * stride_qb + tl.cast(h, tl.int64) * stride_qh
            k_src = k_ptr + b64 * stride_kb + tl.cast(h_kv, tl.int64) * stride_kh
            v_src = v_ptr + b64 * stride_vb + tl.cast(h_kv, tl.int64) * stride_vh
        mask_bh = mask_ptr
        if HAS_MASK:
            mask_bh = mask_ptr + b64 * stride_mask_b + tl.cast(h, tl.int64) * stride_mask_h

        q = _load_tile(q_src, m_start, seqlen_q, stride_qm, head_dim, BLOCK_M, HEAD_DIM_PADDED, True, EVEN_D, USE_TMA)
        q, tile_scale = positive_scale(q, qk_scale)
        q_idx = tl.cast(m_start, tl.int64) + tl.arange(0, BLOCK_M)
        m, d = empty_state(BLOCK_M)
        acc = tl.zeros([BLOCK_M, HEAD_DIM_PADDED], tl.float32)

        # [0, full_end): tiles every row of this query tile sees whole; [full_end, key_end): masked tiles.
        full_end, key_end = key_ranges(m_start, tl.minimum(m_start + BLOCK_M, seqlen_q) - 1, seqlen_q, seqlen_k,
                                       BLOCK_N, IS_CAUSAL, HAS_MASK)
        if not HAS_MASK:  # with a user mask every tile is masked (full_end = 0)
            acc, m, d = _attend_kv_tiles(
                acc, m, d, q, q_idx, tile_scale, k_src, v_src, stride_kn, stride_vn,
                0, full_end, seqlen_q, seqlen_k, head_dim, mask_bh, stride_mask_q, stride_mask_k,
                BLOCK_N, HEAD_DIM_PADDED, False, UNITS, IS_CAUSAL, HAS_MASK, MASK_IS_BOOL, MASK_PER_KEY,
                EVEN_D, USE_TMA, DOT_PRECISION, UPCAST_DOTS,
            )
        acc, m, d = _attend_kv_tiles(
            acc, m, d, q, q_idx, tile_scale, k_src, v_src, stride_kn, stride_vn,
            full_end, key_end, seqlen_q, seqlen_k, head_dim, mask_bh, stride_mask_q, stride_mask_k,
            BLOCK_N, HEAD_DIM_PADDED, True, UNITS, IS_CAUSAL, HAS_MASK, MASK_IS_BOOL, MASK_PER_KEY,
            EVEN_D, USE_TMA, DOT_PRECISION, UPCAST_DOTS,
        )

        rows = tl.cast(bh, tl.int64) * seqlen_q + q_idx
        if WRITE_LSE:
            tl.store(lse_ptr + rows, state_logsumexp(m, d, UNITS), mask=q_idx < seqlen_q)
        if WRITE_STATS:  # (m, log d) apart, natural-log units (forward_for_backward)
            _store_row_stats(stats_ptr, rows, n_bh * seqlen_q, m, d, q_idx < seqlen_q, UNITS)
        o = normalize(acc, d, True)  # rows that saw no key (d = 0) give zeros
        _store_tile(o_dst, o.to(q.dtype), m_start, seqlen_q, stride_om, head_dim, BLOCK_M, HEAD_DIM_PADDED, EVEN_D)


# ----------------------------------------------------------------------------- host launchers

# Head dims the kernel takes. The largest is set by registers: the fp32 output
# accumulator of a 128-row tile, 128 x 256 values over 8 warps, is 128 of a
# thread's 255 registers. The smallest is the K dimension of a tensor-core dot.
MIN_HEAD_DIM = 16
MAX_HEAD_DIM = 256
# Tensor descriptors lower to TMA from compute capability 9.0 (Hopper) on.
TMA_MIN_CAPABILITY = (9, 0)


@dataclass(frozen=True)
class AttentionConfig:
    """Tile sizes and launch options of one kernel launch."""

    block_m: int
    block_n: int
    num_warps: int
    num_stages: int
    use_tma: bool = False  # Q/K/V through host-side tensor descriptors (TMA on Hopper) when aligned
    persistent: bool = False  # a resident grid looping over tiles, instead of one program per tile


# fp16/bf16 configs by padded head dim, from `python bench/attention.py --tune` on an
# H100 (2026-11-23, bf16, B = 4, H = 16, L = 4096; log in
# bench/results/h100/attention_tune.log). BLOCK_M 64 on 4 warps, 3 stages, through
# TMA won at both head dims, over the FlashAttention-2 recipe (BLOCK_M 128, 8 warps)
# used before: a program of one warpgroup is small enough for two to share a
# multiprocessor, and one's softmax overlaps the other's matmuls. D = 128: 64 x 64,
# 495 / 463 TFLOP/s non-causal / causal (was 444 / 400); D = 64: 64 x 128, 434 / 369
# (was 337 / 297; 64 x 64 gives 406 / 377). TMA beat pointers in every shape;
# persistent grids gave nothing. Head dims 16 and 32 take D = 64's tiles, D = 256
# BLOCK_N 32 (at 64 its accumulator and scores spill): neither timed.
# Warp specialisation stays off: Triton 3.6 does not partition this loop on sm_90
# (8 warps: identical code; 4 warps: the pass fails).
_CONFIGS = {
    16: AttentionConfig(64, 128, 4, 3, use_tma=True),
    32: AttentionConfig(64, 128, 4, 3, use_tma=True),
    64: AttentionConfig(64, 128, 4, 3, use_tma=True),
    128: AttentionConfig(64, 64, 4, 3, use_tma=True),
    256: AttentionConfig(128, 32, 8, 2, use_tma=True),
}
# D <= 64 without a mask, where each query tile has little work: 64 x 64 tiles, twice the
# programs (bench/results/h100/attention_d64_short_tiles.log, 64 x 128 -> 64 x 64, TFLOP/s):
# causal L = 1024 230 -> 266, 2048 305 -> 330, 4096 361 -> 375, but 8192 395 -> 382 and
# 16384 414 -> 387; non-causal L = 1024 344 -> 366, 2048 a tie.
_SHORT_WORK_CONFIGS = {hd: AttentionConfig(64, 64, 4, 3, use_tma=True) for hd in (16, 32, 64)}
SHORT_SEQLEN_K, SHORT_SEQLEN_K_CAUSAL = 1024, 4096
# fp32 runs IEEE dots on the FMA units: small tiles, no pipelining; the largest
# that compile for sm_90 without spilling.
_FP32_CONFIGS = {
    16: AttentionConfig(32, 32, 4, 1),
    32: AttentionConfig(32, 32, 4, 1),
    64: AttentionConfig(32, 32, 4, 1),
    128: AttentionConfig(32, 16, 4, 1),
    256: AttentionConfig(32, 16, 8, 1),
}
# The interpreter runs one program at a time in numpy: small tiles, several per test.
INTERPRETER_CONFIG = AttentionConfig(32, 32, 4, 1)

# Candidates for FLASHLITE_AUTOTUNE=1: (BLOCK_M, BLOCK_N, warps, stages), six per
# padded head dim (compiling each takes seconds on first use): the Hopper recipe's
# neighbours that fit in shared memory, and BLOCK_M 64 on 4 warps, small enough
# for two programs a multiprocessor. Head dims under 64 use the 64 list.
_TUNE_SPACE = [(bm, bn, w, s) for bm in (64, 128) for bn in (32, 64, 128) for w in (4, 8) for s in (2, 3, 4)]
_TUNE_CANDIDATES = {
    64: {(128, 64, 8, 3), (128, 128, 8, 2), (128, 128, 8, 3), (128, 128, 4, 3), (64, 64, 4, 2), (64, 128, 4, 2)},
    128: {(128, 64, 8, 2), (128, 64, 8, 3), (128, 128, 8, 2), (64, 64, 4, 2), (64, 64, 4, 3), (64, 128, 4, 2)},
    256: {(128, 32, 8, 2), (128, 32, 8, 3), (128, 64, 8, 2), (64, 32, 4, 2), (64, 32, 4, 3), (64, 64, 4, 2)},
}


def _prune_tune_space(configs, named_args, **kwargs):
    hd_pad = kwargs["HEAD_DIM_PADDED"]
    keep = _TUNE_CANDIDATES[max(64, hd_pad)]
    has_mask = named_args.get("tune_mask_layout", MASK_LAYOUT_NONE) != MASK_LAYOUT_NONE
    return [c for c in configs if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps, c.num_stages) in keep
            and tma_safe(has_mask, c.kwargs["BLOCK_N"], hd_pad)]


@functools.lru_cache(maxsize=None)
def _autotuned_kernel():
    """``_attention_fwd_kernel`` under triton.autotune, built on first use (nothing happens at import).

    Keyed on the head dim (exact and padded), causal, the mask's dtype and layout and
    a power-of-two bucket of seqlen_k; the winners are kept on disk where this Triton can (``cache_results``).
    """
    options = {}
    if "cache_results" in inspect.signature(triton.autotune).parameters:
        options["cache_results"] = True
    configs = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s, pre_hook=_set_descriptor_blocks)
        for bm, bn, w, s in _TUNE_SPACE
    ]
    return triton.autotune(
        configs, key=["tune_bucket", "tune_mask_layout", "head_dim", "HEAD_DIM_PADDED", "IS_CAUSAL", "MASK_IS_BOOL", "WRITE_LSE"],
        prune_configs_by={"early_config_prune": _prune_tune_space}, **options,
    )(_attention_fwd_kernel)


# The mask layouts the autotuner tells apart (tune_mask_layout).
MASK_LAYOUT_NONE, MASK_LAYOUT_PER_KEY, MASK_LAYOUT_FULL = 0, 1, 2


def _mask_layout(mask: torch.Tensor | None) -> int:
    """``MASK_LAYOUT_*`` of a (B, H, Lq, Lk) broadcast mask: none, one row per key tile, or gathered per query."""
    if mask is None:
        return MASK_LAYOUT_NONE
    return MASK_LAYOUT_PER_KEY if mask.stride(2) == 0 else MASK_LAYOUT_FULL


def tma_safe(has_mask: bool, block_n: int, head_dim_pad: int) -> bool:
    """False for the combination that Triton 3.6 miscompiles on the H100: a user mask with K/V
    tiles by TMA in square boxes (``BLOCK_N == HEAD_DIM_PADDED``).

    Found by bench/results/h100/attention_probe_tma_mask.log (full masks: errors 1.2-2.7 against
    tolerances ~0.03 at D = 32, 64 and 128 whenever the box was square and the loop ran more than
    one K tile, at 1, 2 and 3 stages; pointer loads, non-square boxes and unmasked calls right) and
    by the GPU check of key-padding masks on 64 x 64 tiles at D = 64 (errors ~2). Such launches
    take pointer loads, and such configs leave the autotune list.
    """
    return not (has_mask and block_n == head_dim_pad)


def autotune_enabled() -> bool:
    """True when ``FLASHLITE_AUTOTUNE=1``: on first use of a shape bucket, time up to six tile configs."""
    return os.environ.get("FLASHLITE_AUTOTUNE", "0") not in ("", "0")


def head_dim_padded(head_dim: int) -> int:
    """Width of the on-chip Q/K/V tiles: the next power of two, at least 16."""
    return max(MIN_HEAD_DIM, triton.next_power_of_2(head_dim))


def default_config(
    head_dim: int, dtype: torch.dtype, device: torch.device,
    causal: bool = False, seqlen_k: int | None = None, has_mask: bool = False,
) -> AttentionConfig:
    """The fixed tile config of a call: the interpreter's, or the fp32 or fp16/bf16 table's.

    Unmasked fp16/bf16 calls at D <= 64 take ``_SHORT_WORK_CONFIGS`` while ``seqlen_k`` is
    at most ``SHORT_SEQLEN_K`` (``SHORT_SEQLEN_K_CAUSAL`` under causal).
    """
    if device.type != "cuda":
        return INTERPRETER_CONFIG
    hd_pad = head_dim_padded(head_dim)
    if dtype == torch.float32:
        return _FP32_CONFIGS[hd_pad]
    short_limit = SHORT_SEQLEN_K_CAUSAL if causal else SHORT_SEQLEN_K
    if hd_pad in _SHORT_WORK_CONFIGS and not has_mask and seqlen_k is not None and seqlen_k <= short_limit:
        return _SHORT_WORK_CONFIGS[hd_pad]
    return _CONFIGS[hd_pad]


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


def _descriptor(t: torch.Tensor, block_rows: int, head_dim_pad: int) -> TensorDescriptor:
    """A (B, H, L, D) descriptor loading [1, 1, block_rows, HEAD_DIM_PADDED] boxes, zeros past L and D."""
    return TensorDescriptor(t, list(t.shape), descriptor_strides(t), [1, 1, block_rows, head_dim_pad])


def _set_descriptor_blocks(nargs: dict) -> None:
    """Autotune pre-hook: box the descriptors to the BLOCK_M/BLOCK_N being tried."""
    for name, rows in (("q_desc", "BLOCK_M"), ("k_desc", "BLOCK_N"), ("v_desc", "BLOCK_N")):
        if nargs[name] is not None:
            nargs[name].block_shape = [1, 1, nargs[rows], nargs["HEAD_DIM_PADDED"]]


def attention_forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
    mask: torch.Tensor | None, mask_is_bool: bool, write_lse: bool, config: AttentionConfig | None = None,
    *, row_stats: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Launch the forward kernel on checked (B, H, L, D) tensors whose head dim has stride 1.

    ``mask`` is broadcast to (B, H, Lq, Lk) already (``broadcast_mask``). ``config``
    forces this module's kernel and its tiles (tests use small ones to cover the
    multi-tile paths). Without it, calls the Hopper kernel takes (``wgmma_eligible``)
    go there; the rest run this module's kernel on the fixed table, or
    triton.autotune under ``FLASHLITE_AUTOTUNE=1``. For the backward of an
    additive mask ``row_stats``, a (2, B, H, Lq) fp32 tensor, is filled with each
    row's ``(m, log d)`` (``_store_row_stats``).
    Returns ``(o, lse)``: o like q, lse (B, H, Lq) fp32 natural-log, or None.
    """
    if config is None and row_stats is None and wgmma_eligible(q, k, v, mask is not None, scale):
        return attention_forward_wgmma(q, k, v, causal, scale, write_lse)
    batch, n_heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    hd_pad = head_dim_padded(head_dim)
    o = torch.empty_like(q)  # q's memory order when q is dense, e.g. (B, L, H, D) under a transpose
    lse = torch.empty((batch, n_heads, seqlen_q), dtype=torch.float32, device=q.device) if write_lse else None
    tuned = config is None and autotune_enabled() and q.is_cuda and q.dtype != torch.float32
    if config is None:
        config = default_config(head_dim, q.dtype, q.device, causal, seqlen_k, mask is not None)
    q_desc = k_desc = v_desc = None
    if config.use_tma and tma_safe(mask is not None, config.block_n, hd_pad) and tma_usable(q, k, v):
        q_desc = _descriptor(q, config.block_m, hd_pad)
        k_desc, v_desc = (_descriptor(t, config.block_n, hd_pad) for t in (k, v))

    bh = batch * n_heads
    mask_strides = mask.stride() if mask is not None else (0, 0, 0, 0)
    additive = mask is not None and not mask_is_bool
    # The scale goes in as a float (LOG2E.value, not the constexpr LOG2E): a runtime argument, one kernel for any scale.
    args = (
        q, k, v, o, lse if lse is not None else o, row_stats, mask, q_desc, k_desc, v_desc,
        q.stride(0), q.stride(1), q.stride(2),
        k.stride(0), k.stride(1), k.stride(2),
        v.stride(0), v.stride(1), v.stride(2),
        o.stride(0), o.stride(1), o.stride(2),
        *mask_strides,
        n_heads, n_heads // k.shape[1], bh,
        seqlen_q, seqlen_k, head_dim, qk_scale_for(scale, additive), triton.next_power_of_2(seqlen_k),
        _mask_layout(mask),
    )
    meta = dict(
        HEAD_DIM_PADDED=hd_pad, IS_CAUSAL=causal, MASK_IS_BOOL=mask_is_bool, WRITE_LSE=write_lse,
        WRITE_STATS=row_stats is not None,
        DOT_PRECISION="ieee" if q.dtype == torch.float32 else "tf32",
        UPCAST_DOTS=q.dtype == torch.bfloat16 and not q.is_cuda,  # the interpreter (see _dot)
        USE_TMA=k_desc is not None,
        **kv_loop_flags(mask, mask_is_bool, mask_strides[2], head_dim, hd_pad),
    )
    if tuned:
        _autotuned_kernel()[lambda cfg: (triton.cdiv(seqlen_q, cfg["BLOCK_M"]) * bh,)](*args, **meta)
        return o, lse

    n_tiles = triton.cdiv(seqlen_q, config.block_m) * bh
    meta.update(BLOCK_M=config.block_m, BLOCK_N=config.block_n, num_stages=config.num_stages)
    if config.persistent:
        key = ("attention_fwd", config, q.dtype, q.device, k_desc is not None, mask is not None, *meta.values())
        launch_persistent(_attention_fwd_kernel, n_tiles, q.device, key, args, config.num_warps, **meta)
    else:
        launch(_attention_fwd_kernel, (n_tiles,), args, num_warps=config.num_warps, **meta)
    return o, lse


# ----------------------------------------------------------------------------- argument handling


def _check_inputs(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, attn_mask: torch.Tensor | None,
) -> tuple[torch.Tensor | None, bool]:
    """Validate q, k, v (and the mask) with errors naming the argument; return the mask broadcast to (B, H, Lq, Lk)."""
    for name, t in (("q", q), ("k", k), ("v", v)):
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a torch.Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, seqlen, head_dim), got shape {tuple(t.shape)}")
        check_float_dtype(name, t)
        if t.device != q.device:
            raise ValueError(f"{name} is on {t.device} but q is on {q.device}: all inputs must be on one device")
        if t.dtype != q.dtype:
            raise TypeError(f"{name} has dtype {t.dtype} but q has {q.dtype}: q, k and v must share a dtype")
    batch, n_heads, seqlen_q, head_dim = q.shape
    if k.shape[0] != batch or v.shape[0] != batch:
        raise ValueError(f"batch sizes differ: q {batch}, k {k.shape[0]}, v {v.shape[0]}")
    if k.shape[3] != head_dim or v.shape[3] != head_dim:
        raise ValueError(f"head dims differ: q {head_dim}, k {k.shape[3]}, v {v.shape[3]} (all must be equal)")
    if not MIN_HEAD_DIM <= head_dim <= MAX_HEAD_DIM:
        raise ValueError(f"head dim {head_dim} is not supported: q/k/v head_dim must be in [{MIN_HEAD_DIM}, {MAX_HEAD_DIM}]")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"k and v must have the same heads and seqlen, got k {tuple(k.shape)} and v {tuple(v.shape)}")
    if k.shape[1] == 0 or n_heads % k.shape[1]:
        raise ValueError(f"q heads ({n_heads}) must be a multiple of k/v heads ({k.shape[1]}) for grouped-query attention")
    if attn_mask is None:
        return None, False
    if isinstance(attn_mask, torch.Tensor) and attn_mask.device != q.device:
        raise ValueError(f"attn_mask is on {attn_mask.device} but q is on {q.device}")
    return broadcast_mask(attn_mask, (batch, n_heads, seqlen_q, k.shape[2]), "attn_mask")


def _unit_stride_head_dim(t: torch.Tensor) -> torch.Tensor:
    """``t`` itself when its head dim has stride 1 (any other strides are fine), else one contiguous copy."""
    return t if t.stride(3) == 1 or t.shape[3] == 1 else t.contiguous()


def _attention_torch(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, attn_mask: torch.Tensor | None,
    cache_seqlens: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """The same result in PyTorch fp32 ops (CPU without the interpreter); materialises the (Lq, Lk) scores."""
    batch, n_heads, seqlen_q, head_dim = q.shape
    n_kv, seqlen_k = k.shape[1], k.shape[2]
    group = n_heads // n_kv
    qf = q.float().reshape(batch, n_kv, group, seqlen_q, head_dim)  # (B, H_kv, G, Lq, D): no K/V repeat
    s = (qf @ k.float().unsqueeze(2).transpose(-1, -2) * scale).reshape(batch, n_heads, seqlen_q, seqlen_k)
    if cache_seqlens is not None:  # keys [0, len_b) of each element; causal aligned bottom-right against len_b
        used = cache_seqlens.to(device=q.device, dtype=torch.long).view(batch, 1, 1, 1)
        key_idx = torch.arange(seqlen_k, device=q.device)
        keep = key_idx < used  # (B, 1, 1, Lk)
        if causal:
            keep = keep & (key_idx <= torch.arange(seqlen_q, device=q.device)[:, None] + used - seqlen_q)
        s = s.masked_fill(~keep, float("-inf"))
    elif causal:
        keep = torch.ones(seqlen_q, seqlen_k, dtype=torch.bool, device=q.device).tril(seqlen_k - seqlen_q)
        s = s.masked_fill(~keep, float("-inf"))
    if attn_mask is not None:
        s = s.masked_fill(~attn_mask, float("-inf")) if attn_mask.dtype == torch.bool else s + attn_mask.float()
    lse = torch.logsumexp(s, dim=-1)  # (B, H, Lq); -inf for a row that sees no key
    # The weights from softmax (which subtracts the row's maximum), not e^(s - lse): under a bias of -1e9 the
    # LSE has lost log d to rounding, and e^(s - lse) would sum to the key count. A row that sees no key: 0,
    # with gradient 0 (softmax of its -inf would give NaN, and NaN gradients through it).
    empty = (lse == float("-inf")).unsqueeze(-1)
    p = torch.softmax(s.masked_fill(empty, 0.0), dim=-1).masked_fill(empty, 0.0)
    p = p.reshape(batch, n_kv, group, seqlen_q, seqlen_k)
    o = (p @ v.float().unsqueeze(2)).reshape(batch, n_heads, seqlen_q, head_dim)
    return o.to(q.dtype), lse


# ----------------------------------------------------------------------------- autograd


SPLIT_HAS_NO_BACKWARD = (
    "flashlite.flash_attention has no backward pass for split-K/V attention (num_splits > 1 or "
    "cache_seqlens given); call it with num_splits=1 and without cache_seqlens to train"
)


def _forward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, mask: torch.Tensor | None,
    mask_is_bool: bool, write_lse: bool, num_splits: int, cache_seqlens: torch.Tensor | None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """``(o, lse)`` from the forward kernel, or from split-K/V (``num_splits`` > 1 or a cache with lengths)."""
    if num_splits == 1 and cache_seqlens is None:
        return attention_forward(q, k, v, causal, scale, mask, mask_is_bool, write_lse)
    from .split_kv import split_kv_forward  # split_kv builds on this module's K/V loop: imported on use

    return split_kv_forward(q, k, v, causal, scale, mask, mask_is_bool, write_lse, num_splits, cache_seqlens)


def forward_for_backward(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, mask: torch.Tensor | None,
    mask_is_bool: bool,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor | None]:
    """``(o, lse, row_stats)``: the forward a backward will follow.

    Without an additive mask ``row_stats`` is None: the backward recomputes P
    from the LSE. Under one, each row's ``(m, log d)`` is kept apart
    (``row_stats``, (2, B, H, Lq)): a bias of -1e9 leaves no room for ``log d``
    in the LSE's fp32, and P recomputed from it would sum to the key count.
    """
    if mask is None or mask_is_bool:
        o, lse = attention_forward(q, k, v, causal, scale, mask, mask_is_bool, True)
        return o, lse, None
    row_stats = torch.empty((2, *q.shape[:3]), dtype=torch.float32, device=q.device)
    o, _ = attention_forward(q, k, v, causal, scale, mask, mask_is_bool, False, row_stats=row_stats)
    return o, row_stats[0] + row_stats[1], row_stats


class _FlashAttention(torch.autograd.Function):
    """``(o, lse)`` of ``flash_attention``; differentiable in q, k, v, an additive mask and through lse
    (backward: ``flashlite.attention_backward``, not for the split-K/V path). ``attn_mask`` is the user's mask,
    ``mask`` its (B, H, Lq, Lk) view: the mask's gradient is summed to ``attn_mask``'s shape in fp32, before
    it is rounded to its dtype (rounding each of its Lk terms first would leave their rounding in the sum)."""

    @staticmethod
    def forward(ctx, q, k, v, causal, scale, attn_mask, mask, mask_is_bool, write_lse, num_splits, cache_seqlens):
        ctx.split = num_splits != 1 or cache_seqlens is not None
        if ctx.split:
            return _forward(q, k, v, causal, scale, mask, mask_is_bool, write_lse, num_splits, cache_seqlens)
        o, lse, row_stats = forward_for_backward(q, k, v, causal, scale, mask, mask_is_bool)
        ctx.save_for_backward(q, k, v, o, lse, row_stats, mask)
        ctx.causal, ctx.scale, ctx.mask_is_bool = causal, scale, mask_is_bool
        ctx.mask_shape = None if attn_mask is None else attn_mask.shape
        return o, lse

    @staticmethod
    def backward(ctx, do, dlse):
        if ctx.split:
            raise NotImplementedError(SPLIT_HAS_NO_BACKWARD)
        from .attention_backward import attention_backward  # builds on this module's tile helpers: imported on use

        q, k, v, o, lse, row_stats, mask = ctx.saved_tensors
        dq, dk, dv, dmask = attention_backward(
            _unit_stride_head_dim(do), q, k, v, o, lse, dlse, ctx.causal, ctx.scale, mask, ctx.mask_is_bool,
            mask_needs_grad=ctx.needs_input_grad[5], row_stats=row_stats,
        )
        if dmask is not None:
            dmask = dmask.sum_to_size(ctx.mask_shape).to(mask.dtype)
        return dq, dk, dv, None, None, dmask, None, None, None, None, None


# ----------------------------------------------------------------------------- public API


def flash_attention(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, *,
    causal: bool = False, scale: float | None = None, attn_mask: torch.Tensor | None = None, return_lse: bool = False,
    num_splits: int | None = None, cache_seqlens: torch.Tensor | None = None,
) -> torch.Tensor | tuple[torch.Tensor, torch.Tensor]:
    """Attention ``softmax(q kᵀ · scale + mask) v``, tile by tile, without materialising the scores.

    Args:
        q: (B, H, Lq, D) float16, bfloat16 or float32. Any strides with the head
            dim contiguous are read in place (views of a packed qkv projection, a
            (B, L, H, D) tensor transposed); otherwise one copy is made.
        k, v: (B, H_kv, Lk, D), same dtype and device; ``H % H_kv == 0``. Query
            head ``h`` attends to K/V head ``h // (H // H_kv)`` (GQA/MQA, as
            ``scaled_dot_product_attention(enable_gqa=True)``), without copying K/V.
            D from 16 to 256, any value (non-powers of two are padded on chip).
            Lq and Lk are independent and any length. With ``cache_seqlens``, k and v
            are a preallocated cache of L_max = Lk positions.
        causal: query ``i`` sees key ``j`` iff ``j <= i + Lk - Lq`` (``Lk`` is
            ``cache_seqlens[b]`` when given): the causal mask
            aligned bottom-right, as ``flashlite.masked_softmax`` and FlashAttention
            >= 2.1 (not ``scaled_dot_product_attention(is_causal=True)``, which is
            top-left aligned when Lq != Lk).
        scale: multiplies the scores; default ``1 / sqrt(D)``.
        attn_mask: broadcastable to (B, H, Lq, Lk). Boolean (True = keep) or float
            (added to the scaled scores, natural-log units). Broadcast dims are never
            expanded; a key-padding mask (B, 1, 1, Lk) is read once per key tile.
            A bias of any finite size is exact (``torch.finfo(dtype).min`` hides
            a row as SDPA does: it averages the row's values), gradients too.
        return_lse: also return the log-sum-exp of each row's scaled, masked scores.
        num_splits: split-K/V decoding (``flashlite.split_kv``, FlashDecoding): each
            query tile's keys are cut into this many parts, run by separate programs
            and merged. None (default) chooses (``split_kv.auto_num_splits``, a rule
            measured on an H100): on CUDA, with Lk >= 4096, decoding shapes (at
            most 16 query rows per K/V head, GQA heads packed) take the split
            kernel with about half a program per multiprocessor (at least 2
            splits); longer query blocks split only when the forward's grid would
            leave multiprocessors idle. Training (inputs that require grad) never
            splits. 1 never splits; n > 1 forces n splits, clamped to the number of
            key tiles (and to 65535, CUDA's grid limit). The result means the same
            either way.
        cache_seqlens: None, or (B,) int32/int64 on q's device: batch element ``b``
            attends keys ``[0, cache_seqlens[b])`` of k and v only (a KV cache filled
            up to there, read in place without a copy). Values must lie in [0, Lk]
            (checked on CPU; on CUDA they are clamped, to avoid a host sync).

    Returns:
        ``o`` (B, H, Lq, D) in q's dtype (in q's memory order when q is dense), or
        ``(o, lse)`` with ``lse`` (B, H, Lq) float32 natural-log. A query row that
        sees no key at all gives zeros and ``lse = -inf``.

    Decoding (Lq = 1..16 against a long cache) is what ``cache_seqlens`` and
    ``num_splits`` are for.

    fp16/bf16 compute in fp32 with P rounded to the input dtype, like
    FlashAttention; fp32 uses IEEE fp32 dots (slow, accurate to ~1e-6).

    Differentiable (``flashlite.attention_backward``, FlashAttention-2 style,
    deterministic): gradients of q, k, v (dk/dv summed over each GQA group), of
    a float ``attn_mask`` that requires grad (summed over its broadcast dims;
    this materialises one (B, H, Lq, Lk) fp32 buffer), and through the returned
    ``lse``. A boolean mask has no gradient. The split-K/V path (``num_splits``
    > 1, ``cache_seqlens``) has no backward: it raises NotImplementedError. CPU
    tensors run the Triton kernels through the interpreter under
    ``TRITON_INTERPRET=1``, else a PyTorch fp32 path (plain autograd) that
    materialises the scores.
    """
    from .split_kv import auto_num_splits, check_split_args  # split_kv builds on this module: imported on use

    mask, mask_is_bool = _check_inputs(q, k, v, attn_mask)
    causal, return_lse = check_flag("causal", causal), check_flag("return_lse", return_lse)
    check_split_args(num_splits, cache_seqlens, q, k)
    batch, n_heads, seqlen_q, head_dim = q.shape
    seqlen_k = k.shape[2]
    scale = check_scale(scale, 1.0 / math.sqrt(head_dim))
    if is_compiling():  # one node of the graph (flashlite.ops); training keeps the forward kernel, as below
        grads = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, attn_mask) if t is not None)
        splits = 1 if num_splits is None and grads else num_splits
        o, lse, _ = torch.ops.flashlite.flash_attention(q, k, v, causal, scale, attn_mask, splits, cache_seqlens)
        return (o, lse) if return_lse else o
    if not runs_kernels(q):
        o, lse = _attention_torch(q, k, v, causal, scale, attn_mask, cache_seqlens)
    elif batch * n_heads * seqlen_q == 0 or seqlen_k == 0:  # nothing to launch; no key means empty rows
        # Zeros that stay in the autograd graph (gradient 0 for q), whatever q holds (NaN included).
        o = torch.where(torch.zeros_like(q, dtype=torch.bool), q, 0.0)
        lse = torch.full((batch, n_heads, seqlen_q), float("-inf"), dtype=torch.float32, device=q.device)
    else:
        q, k, v = (_unit_stride_head_dim(t) for t in (q, k, v))
        needs_grad = torch.is_grad_enabled() and any(t.requires_grad for t in (q, k, v, attn_mask) if t is not None)
        if num_splits is None:  # training keeps the forward kernel: the split path has no backward
            num_splits = 1 if needs_grad else auto_num_splits(q, k, mask)
        if needs_grad:
            o, lse = _FlashAttention.apply(q, k, v, causal, scale, attn_mask, mask, mask_is_bool, return_lse,
                                           num_splits, cache_seqlens)
        else:  # inference: no autograd node to build (its host cost shows on short calls)
            o, lse = _forward(q, k, v, causal, scale, mask, mask_is_bool, return_lse, num_splits, cache_seqlens)
    return (o, lse) if return_lse else o


# The Hopper kernels (Gluon) take the calls they can; imported last, as they build on this module's
# TMA helpers (descriptor_strides, tma_usable) and query_tile.
from .attention_wgmma import attention_forward_wgmma, wgmma_eligible  # noqa: E402
