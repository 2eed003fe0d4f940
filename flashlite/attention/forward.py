"""The attention forward kernel in ``triton.language``: ``O = softmax(Q Kᵀ · scale + mask) V`` without the L×L scores.

Each program owns one tile of ``BLOCK_M`` query rows of one (batch, head). It
keeps the Q tile on chip and streams the K/V tiles of its key range, ``BLOCK_N``
keys at a time (``attend_kv_tiles``). Per query row it carries the online-softmax
state ``(m, d)`` of ``flashlite.core.online_softmax`` and an output accumulator
``acc = Σ e^(s - m) v``. When a K tile raises the running maximum,
``online_update`` returns the same ``alpha = e^(m_old - m_new)`` that rescales
``d``, and ``acc`` is rescaled by it too; at the end ``O = acc / d``
(``normalize``) and ``LSE = m + log d`` (``state_logsumexp``).

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

Key ranges. For a query tile, keys split into full tiles (every (query, key)
pair counts; no mask arithmetic at all) and masked tiles (the causal diagonal,
the ragged last K tile, or every tile under a user mask). Under ``causal``
(aligned bottom-right), K tiles past the tile's last visible key are never
read. Worked example: seqlen_q = 4, seqlen_k = 6 (offset 2), BLOCK_M = 2,
BLOCK_N = 2. Query tile 0 (queries 0, 1) sees keys 0..2 and 0..3: full tiles
end at 2, masked keys 2..3, keys 4..5 skipped.

Layout. Tensors are (B, H, L, D) as in ``scaled_dot_product_attention``, read
through their strides (the head dim with stride 1), so views of a packed qkv
projection or of a (B, L, H, D) tensor cost nothing. K/V may have fewer heads
(GQA/MQA): query head ``h`` reads K/V head ``h // (H / H_kv)``. Head dims that
are not powers of two are padded to the next one inside the kernel (masked
loads). On Hopper, Q/K/V tiles arrive by TMA through host-side tensor
descriptors (their bounds give zeros past L and D). A packed batch (``flash_attention_varlen``) comes as
(1, H, total, D) with its ``cu_seqlens`` (``core.packed``): programs take the tiles of one flattened schedule
of every sequence's query tiles (``plan.packed_tile``: ``total_q // BLOCK_M + B`` a head, at most one a
sequence without work); its K/V come by pointer loads. Scheduling: one program a query tile, numbered as
``plan.query_tile`` says; a persistent grid
(``AttentionConfig.persistent``) runs the same loop with fewer programs.

Variants. The score modifiers (softcap, ALiBi, the sliding window: ``core.masking``'s ``mods``/``MODS``)
apply to every tile's logits before the masks; V (and O) may have a head dim of their own
(``HEAD_DIM_V_PADDED``); a head's attention sink joins each row's final state (``finish_rows``).

The loop ``attend_kv_tiles`` takes the running ``(acc, m, d)`` and a key range,
so the split-K/V kernel (``split_kv``) runs it on a sub-range, and the study
trace one tile at a time.
"""

from __future__ import annotations

import functools
import inspect

import torch
import triton
import triton.language as tl

from ..core.masking import apply_masks, key_ranges, modify_scores, range_part
from ..core.online_softmax import (
    LN2, LOG2E, empty_state, merge_sink, normalize, online_update, online_update_scaled, rescale_accumulator,
    state_logsumexp,
)
from ..core.packed import sequence_bounds
from ..core.runtime import KernelLaunch, launch_persistent
from ..core.triton_compat import descriptor_template, rebind_descriptor
from ..core.tiles import dot, load_paged_tile, load_tile, store_tile, tensor_descriptor, tma_usable
from . import tuning
from .plan import (
    NATURAL_BIAS, OutputLayout, autotune_enabled, default_config, head_dim_padded, kernel_switches, mask_layout,
    packed_schedule, packed_tile, prune_tune_space, qk_scale_for, query_tile, tma_safe, variant_args,
)
from .tuning import AttentionConfig


@triton.jit
def _store_row_stats(stats_ptr, rows, n_rows, m, d, ok, UNITS: tl.constexpr):
    """Store each row's final state as ``(m, log d)`` in natural-log units: ``m`` at ``stats_ptr + rows``,
    ``log d`` ``n_rows`` further on (``(2, B, H, Lq)``). The backward recomputes ``P = e^(s - m - log d)``
    from these; their sum, the LSE, loses ``log d`` to rounding once ``|m|`` is ~1e8 (a bias of -1e9)."""
    tl.store(stats_ptr + rows, m * (UNITS * LN2), mask=ok)
    tl.store(stats_ptr + n_rows + rows, tl.log2(d) * LN2, mask=ok)


# attend_kv_tiles' PAGED: a contiguous cache, tiles inside pages (one lookup a tile), rows gathered from pages.
PAGED_NONE = tl.constexpr(0)
PAGED_TILES = tl.constexpr(1)
PAGED_ROWS = tl.constexpr(2)


@triton.jit
def positive_scale(q, qk_scale):
    """``(q, qk_scale)`` with the scale made non-negative: ``(-q) · k · |c|`` is ``q · k · c`` exactly (a sign flip
    rounds nothing), and ``online_update_scaled`` needs ``qk_scale >= 0``. The flip goes through fp32, exactly:
    Triton's interpreter negates a bf16 tile as the integers of its bit patterns (as it multiplies them, dot)."""
    return tl.where(qk_scale < 0, (-q.to(tl.float32)).to(q.dtype), q), tl.abs(qk_scale)


@triton.jit
def attend_kv_tiles(
    acc, m, d, q, q_idx, qk_scale, k_src, v_src, stride_kn, stride_vn, key_start, key_end, sizes, mask_bh, mods,
    pages, TILE: tl.constexpr, MASKING: tl.constexpr, UNITS: tl.constexpr, MASKED: tl.constexpr, USE_TMA: tl.constexpr,
    DOTS: tl.constexpr, MODS: tl.constexpr, PAGED: tl.constexpr = 0,
):
    """Fold keys ``[key_start, key_end)`` into the running ``(acc, m, d)`` of the query tile ``q``.

    ``q`` ``[BLOCK_M, HEAD_DIM_PADDED]`` is the unscaled query tile and ``qk_scale``
    (>= 0, ``positive_scale``) turns its fp32 scores into logits of ``UNITS``
    (``BASE2_UNITS``: ``scale · log2(e)``; ``LOG2E``, under an additive mask:
    ``scale``). ``q_idx`` (64-bit) are its rows. ``key_start`` must be a
    multiple of ``BLOCK_N`` (``TILE``'s ``BLOCK``: the K/V tiles). With ``MASKED`` every tile is scaled, then goes
    through ``apply_masks`` (bounds, causal, the window, the user's mask ``mask_bh``) and its K/V rows are
    bounds-checked; without it every key of the range must count for every row
    (base-2 units only), and the scale is folded into the exponential. The score modifiers
    ``mods``/``MODS`` (``core.masking``: softcap, ALiBi, the window) apply to the scaled scores of every
    tile (``modify_scores``), before the masks. V tiles are ``head_dim_v`` wide (padded to
    ``HEAD_DIM_V_PADDED``), and so is ``acc``. ``sizes``, ``TILE``, ``DOTS``: the module docstring;
    ``mask_bh``, ``MASKING``: ``core.masking``'s.
    ``k_src``/``v_src`` are the (batch, kv head)'s base pointers, or with
    ``USE_TMA`` its ``(descriptor, b, h_kv)`` (see ``load_tile``). A paged cache (``PAGED`` not 0, ``pages``
    ``(block_table_row, page_size, stride_k_page, stride_v_page, last_block)``): key ``j`` at row ``j %
    page_size`` of page ``block_table_row[j // page_size]`` (clamped to ``[0, last_block]``) of the K/V bases.
    ``PAGED_TILES``: each tile inside one page (``BLOCK_N`` divides the page size), found by one lookup;
    ``PAGED_ROWS``: each row finds its page (``core.tiles.load_paged_tile``; pages smaller than a tile).
    Returns the new ``(acc, m, d)``; ``acc`` is not normalised.
    """
    seqlen_q, seqlen_k, head_dim, head_dim_v = sizes
    mask_ptr, stride_mask_q, stride_mask_k = mask_bh
    BLOCK_N: tl.constexpr = TILE[0]
    HEAD_DIM_PADDED: tl.constexpr = TILE[1]
    HEAD_DIM_V_PADDED: tl.constexpr = TILE[2]
    EVEN_D: tl.constexpr = TILE[3]
    EVEN_DV: tl.constexpr = TILE[4]
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
    for start in tl.range(key_start, key_end, BLOCK_N):
        start = tl.multiple_of(start, BLOCK_N)
        k_tile, v_tile = k_src, v_src
        if PAGED != 0:
            table, page_size, stride_k_page, stride_v_page, last_block = pages
        if PAGED == PAGED_TILES:  # the tile's page; its rows addressed as if the page held keys from `start` on
            block = tl.minimum(tl.maximum(tl.load(table + start // page_size), 0), last_block).to(tl.int64)
            shift = (start % page_size - start).to(tl.int64)  # times a row stride: past 2^31 on long caches
            k_tile = k_src + block * stride_k_page + shift * stride_kn
            v_tile = v_src + block * stride_v_page + shift * stride_vn
        if PAGED == PAGED_ROWS:
            k = load_paged_tile(k_src, (table, page_size, stride_k_page, last_block), start, seqlen_k, stride_kn,
                                head_dim, BLOCK_N, HEAD_DIM_PADDED, EVEN_D)
        else:
            k = load_tile(k_tile, start, seqlen_k, stride_kn, head_dim, BLOCK_N, HEAD_DIM_PADDED, MASKED, EVEN_D,
                          USE_TMA)
        s = dot(q, tl.trans(k), None, DOT_PRECISION, UPCAST_DOTS)
        if MASKED or HAS_SOFTCAP or HAS_ALIBI:  # logits first: the modifiers and masks work on them
            cols = tl.arange(0, BLOCK_N)
            k_idx = start + cols
            s = modify_scores(s * qk_scale, q_idx, start, cols, seqlen_q, seqlen_k, mods, MODS)[0]
            if MASKED:
                s = apply_masks(
                    s, q_idx, k_idx, seqlen_q, seqlen_k, mask_ptr, stride_mask_q, stride_mask_k,
                    IS_CAUSAL, HAS_MASK, MASK_IS_BOOL, NATURAL_BIAS, MASK_PER_KEY, False,
                    window_left, window_right, HAS_WINDOW,
                )
            m, d, p, alpha = online_update(m, d, s, UNITS)
        else:
            m, d, p, alpha = online_update_scaled(m, d, s, qk_scale)
        if PAGED == PAGED_ROWS:
            v = load_paged_tile(v_src, (table, page_size, stride_v_page, last_block), start, seqlen_k, stride_vn,
                                head_dim_v, BLOCK_N, HEAD_DIM_V_PADDED, EVEN_DV)
        else:
            v = load_tile(v_tile, start, seqlen_k, stride_vn, head_dim_v, BLOCK_N, HEAD_DIM_V_PADDED, MASKED,
                          EVEN_DV, USE_TMA)
        acc = dot(p.to(v.dtype), v, rescale_accumulator(acc, alpha), DOT_PRECISION, UPCAST_DOTS)
    return acc, m, d


@triton.jit
def attend_key_range(
    acc, m, d, q, q_idx, qk_scale, k_src, v_src, stride_kn, stride_vn, key_cut, sizes, mask_bh, mods, pages,
    TILE: tl.constexpr, MASKING: tl.constexpr, UNITS: tl.constexpr, USE_TMA: tl.constexpr, DOTS: tl.constexpr,
    MODS: tl.constexpr, PAGED: tl.constexpr = 0,
):
    """``attend_kv_tiles`` over keys ``[key_start, key_stop)`` cut as ``key_ranges`` cuts them, ``key_cut =
    (key_start, full_start, full_end, key_stop)``: ``[key_start, full_start)`` masked (only under a window;
    without one ``full_start`` must be ``key_start``), ``[full_start, full_end)`` seen whole by every row (no mask
    arithmetic; under a user mask that part must be empty, and is not built), then ``[full_end, key_stop)``
    masked. The forward and split-K/V kernels' walk over their keys (``pages``, ``PAGED``: ``attend_kv_tiles``'s)."""
    HAS_MASK: tl.constexpr = MASKING[1]
    HAS_WINDOW: tl.constexpr = MODS[3]
    key_start, full_start, full_end, key_stop = key_cut
    for part in tl.static_range(3):  # the window's near edge, the full tiles, the far edge
        first, last = range_part(part, key_start, full_start, full_end, key_stop)
        if (part != 0 or HAS_WINDOW) and (part != 1 or not HAS_MASK):
            acc, m, d = attend_kv_tiles(
                acc, m, d, q, q_idx, qk_scale, k_src, v_src, stride_kn, stride_vn, first, last, sizes, mask_bh, mods,
                pages, TILE, MASKING, UNITS, MASKED=part != 1, USE_TMA=USE_TMA, DOTS=DOTS, MODS=MODS,
                PAGED=PAGED,
            )
    return acc, m, d


@triton.jit
def alibi_slope(alibi_ptr, stride_alibi_b, b64, heads, UNITS: tl.constexpr, HAS_ALIBI: tl.constexpr):
    """The ALiBi slope of query head(s) ``heads`` of batch ``b64`` in the logits' ``UNITS`` (the slopes are
    natural-log): a scalar for one head, a vector for a vector of heads; 0.0 (unused) without ALiBi."""
    slope = 0.0
    if HAS_ALIBI:
        slope = tl.load(alibi_ptr + b64 * stride_alibi_b + heads) * (LOG2E / UNITS)
    return slope


@triton.jit
def finish_rows(acc, m, d, sinks_ptr, heads, UNITS: tl.constexpr, HAS_SINKS: tl.constexpr):
    """``(acc, m, d)`` with each row's attention sink merged in (``merge_sink``; the sinks are natural-log, one
    per query head, ``heads`` a scalar or a vector of the rows' heads), or unchanged without sinks."""
    if HAS_SINKS:
        sink = tl.load(sinks_ptr + heads).to(tl.float32) * (LOG2E / UNITS)
        m, d, alpha = merge_sink(m, d, sink, UNITS)
        acc = rescale_accumulator(acc, alpha)
    return acc, m, d


@triton.jit(do_not_specialize=["tune_bucket", "tune_mask_layout"])
def attention_fwd_kernel(
    q_ptr, k_ptr, v_ptr, o_ptr, lse_ptr, stats_ptr, alibi_ptr, sinks_ptr,
    q_desc, k_desc, v_desc,  # (B, H, L, D) tensor descriptors under USE_TMA, else None
    mask, seqs, q_strides, k_strides, v_strides, o_strides, stride_alibi_b, heads, sizes, qk_scale, variants,
    # Read by the autotuner's key only: a power-of-two bucket of seqlen_k, and the mask's
    # layout (MASK_LAYOUT_*), which the heuristics above derive too late for a key.
    tune_bucket, tune_mask_layout,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, DIMS: tl.constexpr, MASKING: tl.constexpr, UNITS: tl.constexpr,
    WRITE_LSE: tl.constexpr, WRITE_STATS: tl.constexpr, USE_TMA: tl.constexpr, DOTS: tl.constexpr,
    MODS: tl.constexpr, HAS_SINKS: tl.constexpr,
):
    # Tiles are numbered as ``query_tile`` says. Any grid size is correct: one
    # program per tile, or a persistent grid where each program takes several.
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
    n_query_tiles = tl.cdiv(seqlen_q, BLOCK_M)
    n_tiles = n_query_tiles * n_bh
    if VARLEN:  # a packed batch: one flattened schedule of every sequence's tiles (plan.packed_tile)
        n_tiles = (seqs[2] // BLOCK_M + n_bh // n_heads) * n_heads
    for tile in tl.range(tl.program_id(0), n_tiles, tl.num_programs(0)):
        if VARLEN:
            h, b, m_start = packed_tile(tile, seqs[0], n_bh // n_heads, seqs[2], tl.arange(0, SEQ_BLOCK), BLOCK_M,
                                        IS_CAUSAL)
        else:
            bh, m_start = query_tile(tile, n_query_tiles, BLOCK_M, IS_CAUSAL)
            b = bh // n_heads
            h = bh % n_heads
        # A packed batch: sequence b's rows and lengths (core.packed); a number with no tile has no work.
        q_row0, k_row0, len_q, len_k, stats_row0, stats_head_stride = sequence_bounds(
            seqs, b, n_heads, seqlen_q, seqlen_k, VARLEN)
        live = True
        if VARLEN:
            live = (m_start >= 0) & (m_start < len_q)
        if live:
            b64 = tl.cast(b, tl.int64)
            h64 = tl.cast(h, tl.int64)
            h_kv = h // kv_group
            h_kv64 = tl.cast(h_kv, tl.int64)

            o_dst = o_ptr + b64 * o_strides[0] + h64 * o_strides[1] + q_row0 * o_strides[2]
            if USE_TMA:  # dense batches only
                q_src = (q_desc, b, h)
                k_src = (k_desc, b, h_kv)
                v_src = (v_desc, b, h_kv)
            else:
                q_src = q_ptr + b64 * q_strides[0] + h64 * q_strides[1] + q_row0 * q_strides[2]
                k_src = k_ptr + b64 * k_strides[0] + h_kv64 * k_strides[1] + k_row0 * k_strides[2]
                v_src = v_ptr + b64 * v_strides[0] + h_kv64 * v_strides[1] + k_row0 * v_strides[2]
            mask_bh = (mask[0], mask[3], mask[4])  # this (batch, head)'s mask (core.masking)
            if HAS_MASK:
                mask_bh = (mask[0] + b64 * mask[1] + h64 * mask[2], mask[3], mask[4])
            # The score modifiers (core.masking): run-time values and constexpr switches.
            mods = (softcap, alibi_slope(alibi_ptr, stride_alibi_b, b64, h, UNITS, HAS_ALIBI), window_left,
                    window_right)

            q = load_tile(q_src, m_start, len_q, q_strides[2], head_dim, BLOCK_M, HEAD_DIM_PADDED, True, EVEN_D,
                          USE_TMA)
            q, tile_scale = positive_scale(q, qk_scale)
            q_idx = tl.cast(m_start, tl.int64) + tl.arange(0, BLOCK_M)
            m, d = empty_state(BLOCK_M)
            acc = tl.zeros([BLOCK_M, HEAD_DIM_V_PADDED], tl.float32)

            # [full_start, full_end): tiles every row of this query tile sees whole (none under a user mask);
            # the rest of [key_start, key_end): masked tiles.
            key_cut = key_ranges(
                m_start, tl.minimum(m_start + BLOCK_M, len_q) - 1, len_q, len_k, BLOCK_N, IS_CAUSAL, HAS_MASK,
                window_left, window_right, HAS_WINDOW)
            acc, m, d = attend_key_range(
                acc, m, d, q, q_idx, tile_scale, k_src, v_src, k_strides[2], v_strides[2], key_cut,
                (len_q, len_k, head_dim, head_dim_v), mask_bh, mods, None, KV_TILE, MASKING, UNITS, USE_TMA, DOTS,
                MODS,
            )
            acc, m, d = finish_rows(acc, m, d, sinks_ptr, h, UNITS, HAS_SINKS)

            rows = stats_row0 + h64 * stats_head_stride + q_idx
            if WRITE_LSE:
                tl.store(lse_ptr + rows, state_logsumexp(m, d, UNITS), mask=q_idx < len_q)
            if WRITE_STATS:  # (m, log d) apart, natural-log units (forward_for_backward)
                _store_row_stats(stats_ptr, rows, n_bh * seqlen_q, m, d, q_idx < len_q, UNITS)
            o = normalize(acc, d, True)  # rows that saw no key (d = 0) give zeros
            store_tile(o_dst, o.to(q.dtype), m_start, len_q, o_strides[2], head_dim_v, BLOCK_M, HEAD_DIM_V_PADDED,
                       EVEN_DV)


# ----------------------------------------------------------------------------- host side


def _set_descriptor_blocks(nargs: dict) -> None:
    """Autotune pre-hook: box the descriptors to the BLOCK_M/BLOCK_N being tried."""
    hd_pad, dv_pad = nargs["DIMS"][:2]
    for name, rows, width in (("q_desc", "BLOCK_M", hd_pad), ("k_desc", "BLOCK_N", hd_pad), ("v_desc", "BLOCK_N", dv_pad)):
        if nargs[name] is not None:
            nargs[name].block_shape = [1, 1, nargs[rows], width]


@functools.lru_cache(maxsize=None)
def autotuned_kernel():
    """``attention_fwd_kernel`` under triton.autotune, built on first use (nothing happens at import).

    Keyed on the padded head dims (and whether they are exact), the masking and score-modifier switches, the mask's
    layout and
    a power-of-two bucket of seqlen_k; the winners are kept on disk where this Triton can (``cache_results``).
    """
    options = {}
    if "cache_results" in inspect.signature(triton.autotune).parameters:
        options["cache_results"] = True
    configs = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn}, num_warps=w, num_stages=s, pre_hook=_set_descriptor_blocks)
        for bm, bn, w, s in tuning.TUNE_SPACE
    ]
    return triton.autotune(
        configs, key=["tune_bucket", "tune_mask_layout", "DIMS", "MASKING", "WRITE_LSE", "MODS"],
        prune_configs_by={"early_config_prune": prune_tune_space}, **options,
    )(attention_fwd_kernel)


class TlForwardLaunch:
    """This module's kernel for one call signature, planned once: tiles, grid, descriptor boxes, constexprs and
    scalar arguments; calling it binds the tensors of a call and launches (``core.runtime.KernelLaunch``).

    Built from checked (B, H, L, D) tensors whose head dim has stride 1 (v's head dim Dv may differ from q and
    k's D), used for their shapes, strides, dtypes and alignments only: every call must bring tensors of the
    same signature. ``mask`` is broadcast to (B, H, Lq, Lk) already (``broadcast_mask``). ``config`` forces
    the tiles (tests use small ones to cover the multi-tile paths); without it, the fixed table
    (``plan.default_config``), or triton.autotune under ``FLASHLITE_AUTOTUNE=1``. ``write_stats``: calls bring
    a (2, B, H, Lq) fp32 ``row_stats`` to fill with each row's ``(m, log d)`` (``_store_row_stats``: the
    backward of an additive mask). The variants (``plan.variant_args``): ``softcap``, the scaled scores become
    ``softcap · tanh(s / softcap)`` before the mask; ``window``, a sliding window ``(left, right)``
    (``plan.visibility``; causal folded in), key tiles outside it not read; ``has_alibi``, calls bring (B, H)
    fp32 slopes (``plan.alibi_view``); ``has_sinks``, (H,) logits merged into every row's state at the end.
    """

    def __init__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
        mask: torch.Tensor | None, mask_is_bool: bool, write_lse: bool, config: AttentionConfig | None = None,
        *, write_stats: bool = False, softcap: float | None = None, window: tuple[int, int] | None = None,
        has_alibi: bool = False, has_sinks: bool = False, varlen: tuple[int, int, int] | None = None,
    ):
        batch, n_heads, seqlen_q, head_dim = q.shape
        seqlen_k, head_dim_v = k.shape[2], v.shape[3]
        hd_pad, dv_pad = head_dim_padded(head_dim), head_dim_padded(head_dim_v)
        self.output = OutputLayout(q, head_dim_v)
        self.lse_shape = (batch, n_heads, seqlen_q) if write_lse else None
        self.totals = (seqlen_q, seqlen_k)
        if varlen is not None:  # (1, H, total, D) tensors of (sequences, max_seqlen_q, max_seqlen_k): core.packed
            batch, seqlen_q, seqlen_k = varlen
        self.tuned = (config is None and autotune_enabled() and q.is_cuda and q.dtype != torch.float32
                      and varlen is None)
        if config is None:
            config = default_config(max(head_dim, head_dim_v), q.dtype, q.device, causal, seqlen_k, mask is not None)
        self.descriptors = None  # (q, k, v) descriptor templates: TMA loads
        if (config.use_tma and varlen is None and tma_safe(mask is not None, config.block_n, hd_pad)
                and tma_safe(mask is not None, config.block_n, dv_pad) and tma_usable(q, k, v)):
            self.descriptors = tuple(descriptor_template(tensor_descriptor(t, rows, width)) for t, rows, width in (
                (q, config.block_m, hd_pad), (k, config.block_n, hd_pad), (v, config.block_n, dv_pad)))
        bh = batch * n_heads
        self.mask_strides = mask.stride() if mask is not None else (0, 0, 0, 0)
        additive = mask is not None and not mask_is_bool
        # (a window's unbounded side from the tensors' lengths: a packed batch's totals, which no sequence
        # passes even when max_seqlen is given too short)
        variant_scalars, variant_meta = variant_args(q, additive, softcap, window, has_alibi, has_sinks,
                                                     *self.totals)
        # The arguments after the tensors: the scale goes in as a float (a run-time argument, one kernel for any
        # scale); the last two are read by the autotuner's key only.
        self.strides = (q.stride()[:3], k.stride()[:3], v.stride()[:3], self.output.strides[:3])
        if varlen is not None:  # one (1, H, total) row space: a sequence's rows start at its cu_seqlens
            self.strides = tuple((0, *strides[1:]) for strides in self.strides)
        self.sizes = ((n_heads, n_heads // k.shape[1], bh), (seqlen_q, seqlen_k, head_dim, head_dim_v),
                      qk_scale_for(scale, additive), variant_scalars, triton.next_power_of_2(seqlen_k),
                      mask_layout(mask))
        self.n_tiles = triton.cdiv(seqlen_q, config.block_m) * bh
        seq_block = 0
        if varlen is not None:  # the flattened schedule of every sequence's query tiles (plan.packed_schedule)
            numbers, seq_block = packed_schedule(batch, self.totals[0], config.block_m, config.num_warps)
            self.n_tiles = numbers * n_heads
        meta = dict(
            WRITE_LSE=write_lse, WRITE_STATS=write_stats, USE_TMA=self.descriptors is not None,
            HAS_SINKS=variant_meta["HAS_SINKS"],
            **kernel_switches(q, causal, mask, mask_is_bool, head_dim, head_dim_v, variant_meta, seq_block),
        )
        self.grid_rows = (seqlen_q, bh)
        self.config, self.meta = config, meta
        self.persistent_key = None
        self.kernel = None
        if self.tuned:
            return
        meta = dict(meta, BLOCK_M=config.block_m, BLOCK_N=config.block_n, num_stages=config.num_stages)
        if config.persistent:
            self.meta = meta
            self.persistent_key = ("attention_fwd", config, q.dtype, q.device, self.descriptors is not None,
                                   mask is not None, *meta.values())
        else:
            self.kernel = KernelLaunch(attention_fwd_kernel, (self.n_tiles,), num_warps=config.num_warps, **meta)

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask: torch.Tensor | None = None,
        alibi: torch.Tensor | None = None, sinks: torch.Tensor | None = None, row_stats: torch.Tensor | None = None,
        seqs: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(o, lse)``: o (B, H, Lq, Dv) in q's memory order, lse (B, H, Lq) fp32 natural-log, or None. A packed
        batch brings ``seqs = (cu_seqlens_q, cu_seqlens_k)``."""
        o = self.output.empty(q)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device) if self.lse_shape else None
        descs = (None, None, None)
        if self.descriptors is not None:
            descs = tuple(rebind_descriptor(d, t) for d, t in zip(self.descriptors, (q, k, v)))
        seqs = (*seqs, *self.totals) if seqs is not None else None
        args = (q, k, v, o, lse if lse is not None else o, row_stats, alibi, sinks, *descs, (mask, *self.mask_strides),
                seqs, *self.strides, alibi.stride(0) if alibi is not None else 0, *self.sizes)
        if self.kernel is not None:
            self.kernel(*args)
        elif self.tuned:
            seqlen_q, bh = self.grid_rows
            autotuned_kernel()[lambda cfg: (triton.cdiv(seqlen_q, cfg["BLOCK_M"]) * bh,)](*args, **self.meta)
        else:
            launch_persistent(attention_fwd_kernel, self.n_tiles, q.device, self.persistent_key, args,
                              self.config.num_warps, **self.meta)
        return o, lse


def attention_forward_tl(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
    mask: torch.Tensor | None, mask_is_bool: bool, write_lse: bool, config: AttentionConfig | None = None,
    *, row_stats: torch.Tensor | None = None, softcap: float | None = None, window: tuple[int, int] | None = None,
    alibi: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One call of this module's kernel, planned and launched once (``TlForwardLaunch``; its arguments as there,
    ``alibi`` the (B, H) slopes and ``sinks`` the (H,) logits themselves). Returns ``(o, lse)``."""
    plan = TlForwardLaunch(q, k, v, causal, scale, mask, mask_is_bool, write_lse, config,
                           write_stats=row_stats is not None, softcap=softcap, window=window,
                           has_alibi=alibi is not None, has_sinks=sinks is not None)
    return plan(q, k, v, mask, alibi, sinks, row_stats)
