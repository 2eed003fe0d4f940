"""The attention backward on Hopper: two Gluon kernels with TMA tiles and their products kept in flight.

``flashlite.attention.backward``'s kernels are written in ``triton.language``, where the compiler waits for
each product of a (key tile, query tile) pair before it issues the next and every tile config spills
(bench/results/h200/TUNING.md#backward-configs). This module writes the same two passes in Gluon, as
``forward_hopper`` writes the forward.

The dK/dV kernel (``_attention_bwd_wgmma_kernel``). A program is one key tile of one (batch, K/V head): its K
and V tiles stay in shared memory, and TMA streams the Q and dO tiles of every query head of its GQA group
through ``STAGES`` buffers (the next tiles arrive while this one is worked on). Each turn runs

    issue  Sᵀ = K Qᵀ,  dPᵀ = V dOᵀ                    (async, keys on rows: P and dS come out as the
    wait for Sᵀ;       Pᵀ = 2^(Sᵀ · c - m)               first operands of dV and dK, no transpose)
    issue  dV += Pᵀ dO
    wait for dPᵀ;      dSᵀ = Pᵀ ⊙ (dPᵀ - δ)             (while dV runs)
    issue  dK += dSᵀ Q

with Pᵀ and dSᵀ in registers, or, when two warpgroups split the columns (``split``: head dims above 128),
through shared memory.

The dQ kernel (``_attention_bwd_dq_wgmma_kernel``), the second pass. A program is one query tile; Q and dO stay
in shared memory, K/V tiles stream through ``STAGES`` buffers (a ``gluon_tiles`` ring each), and turn j issues
``dQ += dS_j K_j`` (dS from registers), then ``S_{j+1} = Q K_{j+1}ᵀ`` and ``dP_{j+1} = dO V_{j+1}ᵀ``, and works
out ``dS_{j+1}`` while the last of them runs. It sums dQ in a fixed order, so the gradients are bitwise equal
run to run. (A one-pass variant, the dK/dV kernel adding dQ by atomic adds, measured 0.67-0.76x this
two-pass path on the H200 and was removed: TUNING.md#backward-hopper.)

The one pass (``_attention_bwd_one_pass_kernel``, ``FLASHLITE_BACKWARD_ONE_PASS=1`` or forced tiles; off by
default: 0.78-0.92x the two passes on the H200, TUNING.md#one-pass-ws). Warp-specialized, FlashAttention-3's
plan: a program is two key tiles of 64 on two compute warpgroups (``gl.warp_specialize``) and a load warp that
streams the Q/dO tiles both share; each warpgroup runs the dK/dV turn above plus a fifth product, its key tile's
share of dQ = dS K (dSᵀ through shared memory, read transposed); the two shares are summed on chip (the
warpgroups take turns) and added to an fp32 workspace by one TMA reduction a query tile, then copied into dq.
Not deterministic (the reductions' order varies): under ``torch.use_deterministic_algorithms(True)`` the two
passes run.

The notation and the P, δ, ``(m, d)`` conventions are ``backward``'s: P is recomputed from the forward's LSE
(base-2 units: the row's final state is ``(LSE · log2 e, 1)``, ``core.online_softmax.safe_max`` for empty
rows), δ comes from ``backward``'s preprocess kernel, the masks from ``core.masking`` (``query_ranges`` and
``key_ranges`` choose the tiles a tile meets; ``apply_masks`` runs on the causal diagonal, the window's edges
and ragged last tiles), and the score modifiers (softcap, ALiBi) are ``core.masking.modify_scores``.

Scope: fp16/bf16 on Hopper, no user mask, causal or not, sliding windows, softcap, ALiBi, GQA/MQA, any
lengths, head dims 17 to 256 (tiles as wide as the next power of two, TMA zero-filling past D; v's may
differ), tensors TMA accepts. Gluon has no interpreter: ``pytest -m gpu`` checks both kernels on the GPU
against float64 (tests/test_gpu_attention.py, every path); on CPU tests/test_attention_backward_wgmma.py
builds them for sm_90 and checks that their products stay in flight.

Head dims as sums of power-of-two parts (``plan.head_split_enabled``; ``FLASHLITE_HEAD_SPLIT=0`` pads them
instead). Padded, D = 192 runs D = 256's products, a quarter of them on zeros. Split, both kernels
load Q/K's head dim, and V/dO's on its own, in column parts (``plan.head_dim_parts``: 192 = 128 + 64, 160 =
128 + 32; ``gluon_tiles``' column-part helpers, as the forward): one TMA box and one shared-memory buffer a
part, one mbarrier a tile counting the bytes of all; every product contracting over a head dim (Sᵀ, dPᵀ; S,
dP) is a sum of one wgmma a part chained on one accumulator, every accumulator whose columns are a head dim
(dK, dV; dQ) one accumulator a part, stored part by part. The tiles stay the padded head dim's (256: two
warpgroups, each holding half the columns of every part of dK and dV: 190 registers, no spills, for D = 192;
on one warpgroup dK and dV would take 96 + 96 accumulator registers a thread: 255 and 452 bytes of spills).
"""

from __future__ import annotations

import os

import torch
import triton

from ..core.masking import apply_masks, key_ranges, modify_scores, query_ranges
from ..core.online_softmax import BASE2_UNITS, LOG2E, safe_max
from ..core.runtime import TmaLaunch, device_info
from ..core.tiles import tma_usable
from ..core.triton_compat import descriptor_template, gluon_source, mangle_type
from . import tuning
from .forward import alibi_slope
from . import plan
from .gluon_tiles import (
    WGMMA_CAPABILITY, accumulate_products, batch_coordinate, box_views, boxes_nbytes, copy_boxes, descriptor_parts,
    gluon, gluon_descriptor, issue_kv_load, packed_program, part_descriptors, part_templates, query_program,
    register_operands, ring_slots, slot_boxes, store_boxes, store_rows, sum_of_products, thread_barrier,
    tile_boxes, tile_bounds, tma_add, wait_kv, zero_accumulators, zero_rows_past,
)
from .plan import NO_VARIANTS, OutputLayout, head_dim_padded, head_dim_parts, packed_schedule

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
    )

    @gluon.jit
    def _load_query_tile(q_ring, it, items):
        """Start the TMA copies of work item ``it``'s Q and dO tiles (query head ``h_first + it // n_query_tiles``,
        rows from ``query_start + (it % n_query_tiles) · BLOCK_M``), every column part of each, into slot ``it %
        STAGES`` of ``q_ring = (q_descs, do_descs, q_slots, do_slots, bars)`` (``gluon_tiles``: one descriptor and
        one ``[STAGES, 1, 1, BLOCK_M, width]`` buffer a part), if it exists: ``items = (b, h_first, query_start,
        n_query_tiles, n_items)``. One mbarrier a slot counts the bytes of all the copies."""
        q_descs, do_descs, q_slots, do_slots, bars = q_ring
        b, h_first, query_start, n_query_tiles, n_items = items
        BLOCK_M: gl.constexpr = q_descs[0].block_type.shape[2]
        STAGES: gl.constexpr = q_slots[0].type.shape[0]
        slot = it % STAGES
        exists = it < n_items
        h = h_first + it // gl.maximum(n_query_tiles, 1)
        start = (b, h, query_start + (it % gl.maximum(n_query_tiles, 1)) * BLOCK_M)
        bar = bars.index(slot)
        mbarrier.expect(bar, boxes_nbytes(q_descs) + boxes_nbytes(do_descs), pred=exists)
        copy_boxes(q_descs, start, bar, slot_boxes(q_slots, slot), pred=exists)
        copy_boxes(do_descs, start, bar, slot_boxes(do_slots, slot), pred=exists)

    @gluon.jit
    def _key_tile_queries(n_start, seqlen_q, seqlen_k, BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr,
                          IS_CAUSAL: gl.constexpr, window_left, window_right, HAS_WINDOW: gl.constexpr):
        """``core.masking.query_ranges`` of the key tile from ``n_start``: ``(query_start, full_start, full_end,
        query_end)``, with a ragged last key tile masked whole (its rows past Lk are zeros, whose unmasked P could
        overflow)."""
        query_start, full_start, full_end, query_end = query_ranges(
            n_start, n_start + BLOCK_N - 1, seqlen_q, seqlen_k, BLOCK_M, IS_CAUSAL, window_left=window_left,
            window_right=window_right, HAS_WINDOW=HAS_WINDOW)
        if n_start + BLOCK_N > seqlen_k:
            full_start = query_end
            full_end = query_end
        return query_start, full_start, full_end, query_end

    @gluon.jit
    def _query_stats(lse_ptr, delta_ptr, stats_row, stat_rows, seqlen_q, QUERY_COLS: gl.constexpr):
        """The rows' final states (``(LSE · log2 e)``, ``safe_max`` for empty rows) and δ of the queries
        ``stat_rows`` (a value a thread, loaded while the products run), spread to the columns of Sᵀ
        (``QUERY_COLS``) through shared memory: loaded there directly, each thread would hold a pointer for each of
        its 16 columns. Rows past ``seqlen_q`` (TMA's zero fill, or cleared rows of the next sequence) get δ = 0
        and a state of +inf, so that their P is exactly 0 whatever the masks leave of their scores: with a state
        of 0, a negative ALiBi slope could raise an unmasked P past fp32's range, and inf · 0 is NaN."""
        in_q = stat_rows < seqlen_q
        row_m = safe_max(gl.load(lse_ptr + stats_row + stat_rows, mask=in_q, other=0.0) * LOG2E)
        row_m = gl.where(in_q, row_m, float("inf"))
        row_m = gl.convert_layout(row_m, QUERY_COLS)
        delta = gl.convert_layout(gl.load(delta_ptr + stats_row + stat_rows, mask=in_q, other=0.0), QUERY_COLS)
        return row_m, delta

    @gluon.jit
    def _key_rows_probabilities(s, row_m, masked, rows, qk_scale, mods, IS_CAUSAL: gl.constexpr, MODS: gl.constexpr,
                                HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr, HAS_WINDOW: gl.constexpr):
        """``(Pᵀ, tanh)`` of a tile's scores ``s = Sᵀ`` (keys on rows: ``rows = (k_idx, start, cols, seqlen_q,
        seqlen_k)``, the keys' positions, the query tile's first position and its columns), the score modifiers
        (``core.masking.modify_scores``: ``tanh`` is the softcap's, ``s`` where there is none) and, where ``masked``
        (a tile not every query sees whole), the masks: hidden scores ``-inf`` before the scale (scale > 0), as the
        forward. (``HAS_SOFTCAP``, ``HAS_ALIBI`` and ``HAS_WINDOW`` are ``MODS``' own, passed apart.)"""
        k_idx, start, cols, seqlen_q, seqlen_k = rows
        window_left, window_right = mods[2], mods[3]
        q_idx = start + cols
        tanh = s
        if HAS_SOFTCAP or HAS_ALIBI:
            s, tanh = modify_scores(s * qk_scale, k_idx, start, cols, seqlen_q, seqlen_k, mods, MODS,
                                    KEYS_ON_ROWS=True)
            if masked:
                s = apply_masks(s, q_idx, k_idx, seqlen_q, seqlen_k, mask_ptr=None, stride_mask_q=0,
                                stride_mask_k=0, IS_CAUSAL=IS_CAUSAL, HAS_MASK=False, MASK_IS_BOOL=False,
                                BIAS_TO_UNITS=LOG2E, KEYS_ON_ROWS=True, window_left=window_left,
                                window_right=window_right, HAS_WINDOW=HAS_WINDOW)
            p = gl.exp2(s - row_m[None, :])
        else:
            if masked:
                s = apply_masks(s, q_idx, k_idx, seqlen_q, seqlen_k, mask_ptr=None, stride_mask_q=0,
                                stride_mask_k=0, IS_CAUSAL=IS_CAUSAL, HAS_MASK=False, MASK_IS_BOOL=False,
                                BIAS_TO_UNITS=LOG2E, KEYS_ON_ROWS=True, window_left=window_left,
                                window_right=window_right, HAS_WINDOW=HAS_WINDOW)
            p = gl.exp2(s * qk_scale - row_m[None, :])
        return p, tanh

    @gluon.jit
    def _stage_parts(accs, factor, boxes):
        """Write each column part of a gradient (``accs``, fp32 accumulators, times ``factor``) into its box of
        ``boxes`` (shared memory of the operand the gradient replaces: no product reads it any more), in the
        boxes' dtype, for ``gluon_tiles.store_boxes`` (after a fence and a barrier of the program)."""
        for i in gl.static_range(len(accs)):
            box = boxes[i]
            box.reshape([box.type.shape[2], box.type.shape[3]]).store((accs[i] * factor).to(box.dtype))

    @gluon.jit
    def _attention_bwd_wgmma_kernel(
        q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, q_desc_b, k_desc_b, v_desc_b, do_desc_b, dk_desc_b,
        dv_desc_b, lse_ptr, delta_ptr, alibi_ptr, packed,
        n_heads, kv_group, seqlen_q, seqlen_k, stride_alibi_b, qk_scale, scale, softcap, window_left, window_right,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr,
        STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_SOFTCAP: gl.constexpr, FAST_TANH: gl.constexpr,
        HAS_ALIBI: gl.constexpr, HAS_WINDOW: gl.constexpr, SEQ_BLOCK: gl.constexpr, num_warps: gl.constexpr,
    ):
        dtype: gl.constexpr = q_desc.dtype
        # The column parts of Q/K's head dim (q, k, dk) and of V/dO's (v, do, dv) (``plan.head_dim_parts``): the
        # ``*_desc`` descriptors load the first part's boxes, the ``*_desc_b`` ones the second's, or are None (one
        # part, the padded head dim). HEAD_DIM and HEAD_DIM_V are the widths on chip: the parts' sums.
        q_descs = descriptor_parts(q_desc, q_desc_b)
        k_descs = descriptor_parts(k_desc, k_desc_b)
        v_descs = descriptor_parts(v_desc, v_desc_b)
        do_descs = descriptor_parts(do_desc, do_desc_b)
        dk_descs = descriptor_parts(dk_desc, dk_desc_b)
        dv_descs = descriptor_parts(dv_desc, dv_desc_b)
        # Key-row tiles (Sᵀ, dPᵀ, dK, dV): the warps split the keys, 16 rows a warp, and with more warps than
        # that (SPLIT > 1: wide head dims) the columns too (of each column part of dK and dV:
        # ``zero_accumulators``).
        KEY_WARPS: gl.constexpr = BLOCK_N // 16
        SPLIT: gl.constexpr = num_warps // KEY_WARPS
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[KEY_WARPS, SPLIT], instr_shape=[16, BLOCK_M // SPLIT, 16])
        key_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
        query_cols: gl.constexpr = gl.SliceLayout(0, s_layout)

        # Programs numbered per (batch, K/V head), key tile fastest: under causal the first key tiles meet
        # the most query tiles, and they start first (a packed batch: ``_key_program``).
        b, h_kv, n_start, row0s, lengths, stats = _key_program(
            gl.program_id(0), packed, n_heads, kv_group, seqlen_q, seqlen_k, BLOCK_N, SEQ_BLOCK, num_warps)
        q_row0, k_row0 = row0s
        seqlen_q, seqlen_k = lengths
        stats_row0, stats_head_stride = stats
        b_row = batch_coordinate(b, SEQ_BLOCK)
        h_first = h_kv * kv_group
        MODS: gl.constexpr = (HAS_SOFTCAP, FAST_TANH, HAS_ALIBI, HAS_WINDOW)

        # The query tiles this key tile meets (the same for every head of the group): [full_start, full_end)
        # see all its keys; the rest of [query_start, query_end) are masked. A ragged last key tile is masked
        # whole: its rows past Lk are zeros, whose unmasked P could overflow.
        query_start, full_start, full_end, query_end = _key_tile_queries(
            n_start, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, IS_CAUSAL, window_left, window_right, HAS_WINDOW)
        if SEQ_BLOCK > 0:  # a packed batch: the next sequence's rows follow a ragged last query tile: masked too
            full_end = gl.minimum(full_end, seqlen_q // BLOCK_M * BLOCK_M)
        n_query_tiles = gl.cdiv(query_end - query_start, BLOCK_M) * (n_start < seqlen_k).to(gl.int32)
        n_items = n_query_tiles * kv_group

        k_smem = tile_boxes(k_descs)
        v_smem = tile_boxes(v_descs)
        q_smem = ring_slots(q_descs, STAGES)
        do_smem = ring_slots(do_descs, STAGES)
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(q_bars.index(i), count=1)
        # Pᵀ and dSᵀ as the first operands of dV and dK: from registers when a warp holds whole rows of them,
        # else (SPLIT > 1) through shared memory.
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], dtype)
        if SPLIT > 1:
            p_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], ds_layout)
            ds_smem = gl.allocate_shared_memory(dtype, [BLOCK_N, BLOCK_M], ds_layout)

        # K and V, every column part, on one barrier counting all their bytes.
        kv_start = (b_row, h_kv, k_row0 + n_start)
        mbarrier.expect(kv_bar, boxes_nbytes(k_descs) + boxes_nbytes(v_descs))
        copy_boxes(k_descs, kv_start, kv_bar, k_smem)
        copy_boxes(v_descs, kv_start, kv_bar, v_smem)
        q_ring = (q_descs, do_descs, q_smem, do_smem, q_bars)
        items = (b_row, h_first, q_row0 + query_start, n_query_tiles, n_items)
        for i in gl.static_range(STAGES):
            _load_query_tile(q_ring, i, items)

        # dK and dV: one accumulator a column part of K's (V's) head dim.
        dks = zero_accumulators(k_descs, BLOCK_N, KEY_WARPS, SPLIT)
        dvs = zero_accumulators(v_descs, BLOCK_N, KEY_WARPS, SPLIT)
        s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
        k_idx = n_start + gl.arange(0, BLOCK_N, layout=key_rows)
        cols = gl.arange(0, BLOCK_M, layout=query_cols)
        stat_offsets = gl.arange(0, BLOCK_M, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
        mbarrier.wait(kv_bar, 0)
        k_tiles = box_views(k_smem)
        v_tiles = box_views(v_smem)

        for it in range(n_items):
            slot = it % STAGES
            g = it // n_query_tiles
            start = query_start + (it % n_query_tiles) * BLOCK_M
            h = h_first + g
            stats_row = stats_row0 + h.to(gl.int64) * stats_head_stride  # this head's LSE and δ
            mbarrier.wait(q_bars.index(slot), (it // STAGES) & 1)
            q_tiles = box_views(slot_boxes(q_smem, slot))
            do_tiles = box_views(slot_boxes(do_smem, slot))
            if SEQ_BLOCK > 0:  # a query tile cut by its sequence's end: the next sequence's rows cleared
                if start + BLOCK_M > seqlen_q:
                    zero_rows_past(q_tiles + do_tiles, seqlen_q - start, num_warps)
            # Sᵀ and dPᵀ: one product a column part each, chained on its accumulator.
            s_token = sum_of_products(k_tiles, q_tiles, s_zero)
            dp_token = sum_of_products(v_tiles, do_tiles, s_zero)
            row_m, delta = _query_stats(lse_ptr, delta_ptr, stats_row, start + stat_offsets, seqlen_q, query_cols)
            mods = (softcap, alibi_slope(alibi_ptr, stride_alibi_b, b.to(gl.int64), h, BASE2_UNITS, HAS_ALIBI),
                    window_left, window_right)

            s = warpgroup_mma_wait(len(v_tiles), deps=(s_token,))  # dPᵀ's products may still run
            masked = (start < full_start) | (start >= full_end)
            p, tanh = _key_rows_probabilities(s, row_m, masked, (k_idx, start, cols, seqlen_q, seqlen_k), qk_scale,
                                              mods, IS_CAUSAL, MODS, HAS_SOFTCAP, HAS_ALIBI, HAS_WINDOW)
            # dV += Pᵀ dO, one product a column part of dO.
            if SPLIT > 1:
                p_smem.store(p.to(dtype))
                fence_async_shared()
                thread_barrier()  # dV's rows of Pᵀ span both warpgroups' columns
                p_ops = (p_smem,) * len(dvs)
                p_live = (p,)  # (kept alive with the products, as the register operands are below)
            else:
                p_ops = register_operands(p.to(dtype), dvs)
                p_live = p_ops  # (kept alive with the products)
            dv_tokens = accumulate_products(p_ops, do_tiles, dvs)

            dp = warpgroup_mma_wait(len(dvs), deps=(dp_token,))  # dV's products may still run
            ds = p * (dp - delta[None, :])
            if HAS_SOFTCAP:  # the gradient of the scaled scores: c · tanh(s / c)' = 1 - tanh²
                ds = ds * (1.0 - tanh * tanh)
            # dK += dSᵀ Q, one product a column part of Q.
            if SPLIT > 1:  # dSᵀ through shared memory, where dK's products read it
                ds_smem.store(ds.to(dtype))
                fence_async_shared()
                thread_barrier()  # every warp's part of dSᵀ is written before the products read it whole
                ds_ops = (ds_smem,) * len(dks)
            else:
                ds_ops = register_operands(ds.to(dtype), dks)
            dk_tokens = accumulate_products(ds_ops, q_tiles, dks)
            done = warpgroup_mma_wait(0, deps=dv_tokens + dk_tokens + p_live)
            dvs = done[:len(dvs)]
            dks = done[len(dvs):len(dvs) + len(dks)]
            if num_warps > 4:
                thread_barrier()  # both warpgroups are done with the slot (and dSᵀ) before either reuses it
            _load_query_tile(q_ring, it + STAGES, items)

        mbarrier.invalidate(kv_bar)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(q_bars.index(i))
        # dK and dV leave through the K and V buffers (no product reads them any more), part by part; in a packed
        # batch, a key tile cut by its sequence's end by pointer (``store_rows``: the next sequence's rows follow).
        # (Twin TMA branches as in forward_hopper._write_output: the dense test is a compile-time one.)
        if SEQ_BLOCK == 0:
            _store_key_tile(dks, dvs, scale, (dk_descs, dv_descs), (k_smem, v_smem), kv_start)
        elif n_start + BLOCK_N <= seqlen_k:
            _store_key_tile(dks, dvs, scale, (dk_descs, dv_descs), (k_smem, v_smem), kv_start)
        else:
            dk_out, dv_out = (packed[3], packed[4], packed[5], packed[6]), (packed[7], packed[8], packed[9], packed[10])
            store_rows(_scaled_parts(dks, scale, dtype), dk_descs, (k_idx, seqlen_k), dk_out, (h_kv, k_row0))
            store_rows(_scaled_parts(dvs, 1.0, dtype), dv_descs, (k_idx, seqlen_k), dv_out, (h_kv, k_row0))

    @gluon.jit
    def _scaled_parts(accs, factor, dtype: gl.constexpr):
        """Each column part of a gradient (``accs``, fp32) times ``factor``, in ``dtype``."""
        parts = ()
        for i in gl.static_range(len(accs)):
            parts = parts + ((accs[i] * factor).to(dtype),)
        return parts

    @gluon.jit
    def _store_key_tile(dks, dvs, scale, descs, boxes, start):
        """dK (times ``scale``) and dV of one key tile, every column part, through the K and V buffers ``boxes =
        (k_smem, v_smem)`` by TMA into their tile at ``start = (b, h_kv, row)`` of ``descs = (dk_descs,
        dv_descs)`` (clipped to L and the head dim by the copies)."""
        dk_descs, dv_descs = descs
        k_smem, v_smem = boxes
        _stage_parts(dks, scale, k_smem)
        _stage_parts(dvs, 1.0, v_smem)
        fence_async_shared()
        thread_barrier()
        store_boxes(dk_descs, start, k_smem)
        store_boxes(dv_descs, start, v_smem)
        tma.store_wait(0)

    @gluon.jit
    def _one_pass_load_partition(kv, q_ring, q_free, items):
        """The one-pass kernel's load warp: K and V of both key tiles (``kv = (k_descs, v_descs, k_slots,
        v_slots, kv_bar, kv_start)``, one slot a compute warpgroup, on one barrier), then each work item's Q and
        dO tiles (``_load_query_tile``) into ring slot ``it % STAGES`` once both compute warpgroups have released
        it (``q_free``; a fresh mbarrier counts as released)."""
        k_descs, v_descs, k_slots, v_slots, kv_bar, kv_start = kv
        b, h_kv, row = kv_start
        BLOCK_N: gl.constexpr = k_descs[0].block_type.shape[2]
        STAGES: gl.constexpr = q_ring[2][0].type.shape[0]
        mbarrier.expect(kv_bar, 2 * (boxes_nbytes(k_descs) + boxes_nbytes(v_descs)))
        for wg in gl.static_range(2):
            copy_boxes(k_descs, (b, h_kv, row + wg * BLOCK_N), kv_bar, slot_boxes(k_slots, wg))
            copy_boxes(v_descs, (b, h_kv, row + wg * BLOCK_N), kv_bar, slot_boxes(v_slots, wg))
        for it in range(items[4]):
            slot = it % STAGES
            mbarrier.wait(q_free.index(slot), ((it // STAGES) & 1) ^ 1)
            _load_query_tile(q_ring, it, items)

    @gluon.jit
    def _one_pass_compute_partition(kv, outs, q_ring, q_free, dq_out, items, rows, stats, scalars, mods,
                                    IS_CAUSAL: gl.constexpr, MODS: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
                                    HAS_ALIBI: gl.constexpr, HAS_WINDOW: gl.constexpr, WARPGROUP: gl.constexpr):
        """One compute warpgroup of the one-pass kernel: key tile ``WARPGROUP`` of the program's two (its K and V
        in slot ``WARPGROUP`` of ``kv``'s), every work item of ``items`` (the Q/dO ring's, shared with the other
        warpgroup), Sᵀ, dPᵀ, dV and dK as ``_attention_bwd_wgmma_kernel`` works them out, and a fifth product,
        this key tile's share of the query tile's dQ = dS K (dSᵀ through shared memory, read transposed), summed
        with the other warpgroup's and added in fp32 to the workspace's tile by one TMA reduction: ``dq_out =
        (dq_desc, stages, ds_smem, share_ready, share_free)``, the workspace's descriptor, both warpgroups' [1, 1,
        BLOCK_M, HEAD_DIM] fp32 stages, this one's dSᵀ buffer, and a barrier of each warpgroup's for a share
        handed over and one for its read. ``outs = (dk_descs, dv_descs)``; ``rows = (seqlen_q, seqlen_k, n_start)``
        (the program's first key); ``stats = (lse_ptr, delta_ptr, stats_row0, stats_head_stride, alibi_ptr,
        stride_alibi_b)``; ``scalars = (qk_scale, scale)``; ``mods`` as ``core.masking.modify_scores`` takes them
        without the ALiBi slope (the head's, looked up here). (``HAS_SOFTCAP``, ``HAS_ALIBI`` and ``HAS_WINDOW``
        are ``MODS``' own, passed apart: unpacked from the tuple, Triton 3.9 takes them for run-time values.)"""
        k_descs, v_descs, k_slots, v_slots, kv_bar, kv_start = kv
        q_descs, do_descs, q_smem, do_smem, q_ready = q_ring
        dq_desc, stages, ds_smem, share_ready, share_free = dq_out
        own_stage = stages[WARPGROUP]
        own_view = own_stage.reshape([own_stage.type.shape[2], own_stage.type.shape[3]])
        other_view = stages[1 - WARPGROUP].reshape([own_stage.type.shape[2], own_stage.type.shape[3]])
        b, h_first, query_start, n_query_tiles, n_items = items
        seqlen_q, seqlen_k, n_start = rows
        lse_ptr, delta_ptr, stats_row0, stats_head_stride, alibi_ptr, stride_alibi_b = stats
        qk_scale, scale = scalars
        softcap, window_left, window_right = mods
        dtype: gl.constexpr = q_descs[0].dtype
        BLOCK_M: gl.constexpr = q_descs[0].block_type.shape[2]
        BLOCK_N: gl.constexpr = k_descs[0].block_type.shape[2]
        STAGES: gl.constexpr = q_smem[0].type.shape[0]
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_M, 16])
        key_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
        query_cols: gl.constexpr = gl.SliceLayout(0, s_layout)

        # This warpgroup's keys see the query tiles [full_start, full_end) whole; the program's other tiles
        # (the other key tile's) are masked here, as a ragged last key tile is whole.
        n_start = n_start + WARPGROUP * BLOCK_N
        _, full_start, full_end, _ = _key_tile_queries(
            n_start, seqlen_q, seqlen_k, BLOCK_M, BLOCK_N, IS_CAUSAL, window_left, window_right, HAS_WINDOW)

        dks = zero_accumulators(k_descs, BLOCK_N, 4)
        dvs = zero_accumulators(v_descs, BLOCK_N, 4)
        s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
        k_idx = n_start + gl.arange(0, BLOCK_N, layout=key_rows)
        cols = gl.arange(0, BLOCK_M, layout=query_cols)
        stat_offsets = gl.arange(0, BLOCK_M, layout=gl.BlockedLayout([1], [32], [4], [0]))
        mbarrier.wait(kv_bar, 0)
        k_tiles = box_views(slot_boxes(k_slots, WARPGROUP))
        v_tiles = box_views(slot_boxes(v_slots, WARPGROUP))
        for it in range(n_items):
            slot = it % STAGES
            g = it // n_query_tiles
            start = query_start + (it % n_query_tiles) * BLOCK_M
            h = h_first + g
            stats_row = stats_row0 + h.to(gl.int64) * stats_head_stride
            mbarrier.wait(q_ready.index(slot), (it // STAGES) & 1)
            q_tiles = box_views(slot_boxes(q_smem, slot))
            do_tiles = box_views(slot_boxes(do_smem, slot))
            s_token = sum_of_products(k_tiles, q_tiles, s_zero)
            dp_token = sum_of_products(v_tiles, do_tiles, s_zero)
            row_m, delta = _query_stats(lse_ptr, delta_ptr, stats_row, start + stat_offsets, seqlen_q, query_cols)
            head_mods = (softcap, alibi_slope(alibi_ptr, stride_alibi_b, b.to(gl.int64), h, BASE2_UNITS, HAS_ALIBI),
                         window_left, window_right)

            s = warpgroup_mma_wait(1, deps=(s_token,))  # dPᵀ may still run
            masked = (start < full_start) | (start >= full_end)
            p, tanh = _key_rows_probabilities(s, row_m, masked, (k_idx, start, cols, seqlen_q, seqlen_k), qk_scale,
                                              head_mods, IS_CAUSAL, MODS, HAS_SOFTCAP, HAS_ALIBI, HAS_WINDOW)
            p_ops = register_operands(p.to(dtype), dvs)
            dv_tokens = accumulate_products(p_ops, do_tiles, dvs)
            dp = warpgroup_mma_wait(len(dvs), deps=(dp_token,))  # dV may still run
            ds = p * (dp - delta[None, :])
            if HAS_SOFTCAP:
                ds = ds * (1.0 - tanh * tanh)
            # dSᵀ through shared memory: dK's products read it as it is, dQ's transposed.
            ds_smem.store(ds.to(dtype))
            fence_async_shared()
            thread_barrier()  # (this warpgroup's warps)
            dk_tokens = accumulate_products((ds_smem,) * len(dks), q_tiles, dks)
            # dV done (Pᵀ's registers free) before dQ's accumulator is taken; dK may still run.
            dvs = warpgroup_mma_wait(len(dks), deps=dv_tokens + p_ops)[:len(dvs)]
            dq_token = warpgroup_mma(ds_smem.permute((1, 0)), k_tiles[0], zero_accumulators(q_descs, BLOCK_M, 4)[0],
                                     use_acc=False, is_async=True)
            done = warpgroup_mma_wait(0, deps=dk_tokens + (dq_token,))
            dks = done[:len(dks)]
            dq = done[len(dks)]
            mbarrier.arrive(q_free.index(slot))  # the Q/dO slot is read (the load warp waits for both)
            # The query tile's dQ: both key tiles' shares summed on chip, then one TMA reduction (times the scale)
            # into the workspace's tile. The warpgroups take turns to sum (item parity); the other hands its share
            # over through its stage. Before a stage is written, its last reduction has read it (store_wait) and
            # the other warpgroup its last share (``share_free``: fresh barriers count as read).
            turn = it // 2
            if it % 2 == WARPGROUP:
                mbarrier.wait(share_ready.index(1 - WARPGROUP), turn & 1)
                dq = dq + other_view.load(dq.type.layout)
                thread_barrier()
                mbarrier.arrive(share_free.index(1 - WARPGROUP))
                tma.store_wait(0)
                mbarrier.wait(share_free.index(WARPGROUP), (turn & 1) ^ (1 - WARPGROUP))
                own_view.store(dq * scale)
                fence_async_shared()
                thread_barrier()
                tma_add(dq_desc, [b, h, start, 0], own_stage)
            else:
                tma.store_wait(0)
                mbarrier.wait(share_free.index(WARPGROUP), (turn & 1) ^ 1)
                own_view.store(dq)
                thread_barrier()
                mbarrier.arrive(share_ready.index(WARPGROUP))

        tma.store_wait(0)
        # dK and dV leave through this warpgroup's K and V slots (no product reads them any more).
        b_row, h_kv, kv_row = kv_start
        _store_key_tile(dks, dvs, scale, outs, (slot_boxes(k_slots, WARPGROUP), slot_boxes(v_slots, WARPGROUP)),
                        (b_row, h_kv, kv_row + WARPGROUP * BLOCK_N))

    @gluon.jit
    def _attention_bwd_one_pass_kernel(
        q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, dq_desc, lse_ptr, delta_ptr, alibi_ptr,
        n_heads, kv_group, seqlen_q, seqlen_k, stride_alibi_b, qk_scale, scale, softcap, window_left, window_right,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr,
        STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_SOFTCAP: gl.constexpr, FAST_TANH: gl.constexpr,
        HAS_ALIBI: gl.constexpr, HAS_WINDOW: gl.constexpr, COMPUTE_REGISTERS: gl.constexpr,
        LOAD_REGISTERS: gl.constexpr, num_warps: gl.constexpr,
    ):
        # A program is two key tiles of BLOCK_N keys of one (batch, K/V head), one a compute warpgroup (the
        # default partition and a worker), sharing the Q/dO tiles a load warp streams in; each query tile's dQ
        # (both warpgroups' shares, summed on chip) goes to an fp32 workspace (``dq_desc``: (B, H, Lq rounded up
        # to BLOCK_M, HEAD_DIM)) by a TMA reduction. Dense batches, one column part.
        q_descs = (q_desc,)
        k_descs = (k_desc,)
        v_descs = (v_desc,)
        do_descs = (do_desc,)
        b, h_kv, n_start, _, lengths, stats = _key_program(
            gl.program_id(0), None, n_heads, kv_group, seqlen_q, seqlen_k, 2 * BLOCK_N, 0, num_warps)
        seqlen_q, seqlen_k = lengths
        stats_row0, stats_head_stride = stats
        h_first = h_kv * kv_group
        MODS: gl.constexpr = (HAS_SOFTCAP, FAST_TANH, HAS_ALIBI, HAS_WINDOW)
        query_start, _, _, query_end = query_ranges(
            n_start, n_start + 2 * BLOCK_N - 1, seqlen_q, seqlen_k, BLOCK_M, IS_CAUSAL, window_left=window_left,
            window_right=window_right, HAS_WINDOW=HAS_WINDOW)
        n_query_tiles = gl.cdiv(query_end - query_start, BLOCK_M) * (n_start < seqlen_k).to(gl.int32)
        n_items = n_query_tiles * kv_group

        k_slots = ring_slots(k_descs, 2)  # a key tile a compute warpgroup
        v_slots = ring_slots(v_descs, 2)
        q_smem = ring_slots(q_descs, STAGES)
        do_smem = ring_slots(do_descs, STAGES)
        ds_layout: gl.constexpr = gl.NVMMASharedLayout.get_default_for([BLOCK_N, BLOCK_M], q_desc.dtype)
        ds_smem0 = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_N, BLOCK_M], ds_layout)
        ds_smem1 = gl.allocate_shared_memory(q_desc.dtype, [BLOCK_N, BLOCK_M], ds_layout)
        stages = (gl.allocate_shared_memory(gl.float32, dq_desc.block_type.shape, dq_desc.layout),
                  gl.allocate_shared_memory(gl.float32, dq_desc.block_type.shape, dq_desc.layout))
        kv_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        q_ready = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        q_free = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        share_ready = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        share_free = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        mbarrier.init(kv_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(q_ready.index(i), count=1)
            mbarrier.init(q_free.index(i), count=2)
        for wg in gl.static_range(2):
            mbarrier.init(share_ready.index(wg), count=1)
            mbarrier.init(share_free.index(wg), count=1)

        kv_start = (b, h_kv, n_start)  # (dense: positions are the tensors' coordinates)
        kv = (k_descs, v_descs, k_slots, v_slots, kv_bar, kv_start)
        outs = ((dk_desc,), (dv_desc,))
        q_ring = (q_descs, do_descs, q_smem, do_smem, q_ready)
        items = (b, h_first, query_start, n_query_tiles, n_items)
        rows = (seqlen_q, seqlen_k, n_start)
        stats = (lse_ptr, delta_ptr, stats_row0, stats_head_stride, alibi_ptr, stride_alibi_b)
        scalars = (qk_scale, scale)
        mods = (softcap, window_left, window_right)
        gl.warp_specialize(
            [(_one_pass_compute_partition,  # key tile 0: the default partition
              (kv, outs, q_ring, q_free, (dq_desc, stages, ds_smem0, share_ready, share_free), items, rows, stats,
               scalars, mods, IS_CAUSAL,
               MODS, HAS_SOFTCAP, HAS_ALIBI, HAS_WINDOW, 0)),
             (_one_pass_compute_partition,  # key tile 1
              (kv, outs, q_ring, q_free, (dq_desc, stages, ds_smem1, share_ready, share_free), items, rows, stats,
               scalars, mods, IS_CAUSAL,
               MODS, HAS_SOFTCAP, HAS_ALIBI, HAS_WINDOW, 1)),
             (_one_pass_load_partition, (kv, q_ring, q_free, items))],
            [4, 1], [COMPUTE_REGISTERS, LOAD_REGISTERS])

    @gluon.jit
    def _key_program(pid, packed, n_heads, kv_group, seqlen_q, seqlen_k, BLOCK_N: gl.constexpr,
                     SEQ_BLOCK: gl.constexpr, NUM_WARPS: gl.constexpr):
        """The dK/dV kernel's program ``pid``: ``(b, h_kv, n_start, (q_row0, k_row0), (seqlen_q, seqlen_k),
        (stats_row0, stats_head_stride))``: batch (or sequence) ``b``, K/V head ``h_kv``, its key tile's first
        key ``n_start``, where the sequence's rows start in the tensors (int32, TMA's coordinates), its lengths,
        and where its rows' statistics lie (``core.packed.sequence_bounds``: row ``i`` of query head ``h`` at
        ``stats_row0 + h · stats_head_stride + i``).

        Dense (``SEQ_BLOCK`` 0): programs numbered per (batch, K/V head), key tile fastest. A packed batch
        (``packed = (cu_seqlens_q, cu_seqlens_k, n_seqs, dk, its H and L strides, D, dv, its H and L strides,
        Dv)``, ``seqlen_q``/``_k`` the totals): ``gluon_tiles.packed_program``'s schedule over every sequence's key
        tiles; a number with no tile gets ``n_start = seqlen_k = 0`` (nothing to read, nothing to store)."""
        VARLEN: gl.constexpr = SEQ_BLOCK > 0
        n_kv_heads = n_heads // kv_group
        seqs = None
        if VARLEN:
            seqs = (packed[0], packed[1], seqlen_q, seqlen_k)
            h_kv, b, n_start = packed_program(pid, packed[1], packed[2], seqlen_k, BLOCK_N, False, SEQ_BLOCK,
                                              NUM_WARPS)
        else:
            n_key_tiles = gl.cdiv(seqlen_k, BLOCK_N)
            bh_kv = pid // n_key_tiles
            n_start = (pid % n_key_tiles) * BLOCK_N
            b = bh_kv // n_kv_heads
            h_kv = bh_kv % n_kv_heads
        n_start, row0s, lengths, stats = tile_bounds(seqs, b, n_heads, seqlen_q, seqlen_k, n_start, True, VARLEN)
        return b, h_kv, n_start, row0s, lengths, stats

    @gluon.jit
    def _dq_scores_grads(s, dp, stats, tile, key_start, full, rows, qk_scale, mods, IS_CAUSAL: gl.constexpr,
                         MODS: gl.constexpr, HAS_SOFTCAP: gl.constexpr, HAS_ALIBI: gl.constexpr,
                         HAS_WINDOW: gl.constexpr):
        """dS (fp32, the gradient of the scaled scores) of one query tile against K tile ``tile`` (keys from
        ``key_start + tile · BLOCK_N``), queries on rows (``rows = (q_idx, seqlen_q, seqlen_k)``, their final
        states and δ ``stats = (row_m, delta)``); masked unless the tile is one of ``full = (full_first,
        full_stop)``, which every row sees whole. (``HAS_SOFTCAP``, ``HAS_ALIBI`` and ``HAS_WINDOW`` are ``MODS``'
        own, passed apart: unpacked from the tuple here, Triton 3.9 takes them for run-time values.)"""
        softcap, alibi, window_left, window_right = mods
        row_m, delta = stats
        full_first, full_stop = full
        q_idx, seqlen_q, seqlen_k = rows
        BLOCK_N: gl.constexpr = s.shape[1]
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        tile_start = key_start + tile * BLOCK_N
        masked = (tile < full_first) | (tile >= full_stop)
        if HAS_SOFTCAP or HAS_ALIBI:
            s, tanh = modify_scores(s * qk_scale, q_idx, tile_start, cols, seqlen_q, seqlen_k, mods, MODS)
            if masked:
                s = apply_masks(s, q_idx, tile_start + cols, seqlen_q, seqlen_k, mask_ptr=None, stride_mask_q=0,
                                stride_mask_k=0, IS_CAUSAL=IS_CAUSAL, HAS_MASK=False, MASK_IS_BOOL=False,
                                BIAS_TO_UNITS=LOG2E, window_left=window_left, window_right=window_right,
                                HAS_WINDOW=HAS_WINDOW)
            p = gl.exp2(s - row_m[:, None])
        else:
            if masked:
                s = apply_masks(s, q_idx, tile_start + cols, seqlen_q, seqlen_k, mask_ptr=None, stride_mask_q=0,
                                stride_mask_k=0, IS_CAUSAL=IS_CAUSAL, HAS_MASK=False, MASK_IS_BOOL=False,
                                BIAS_TO_UNITS=LOG2E, window_left=window_left, window_right=window_right,
                                HAS_WINDOW=HAS_WINDOW)
            p = gl.exp2(s * qk_scale - row_m[:, None])
        ds = p * (dp - delta[:, None])
        if HAS_SOFTCAP:
            ds = ds * (1.0 - tanh * tanh)
        return ds

    @gluon.jit
    def _attention_bwd_dq_wgmma_kernel(
        q_desc, k_desc, v_desc, do_desc, dq_desc, q_desc_b, k_desc_b, v_desc_b, do_desc_b, dq_desc_b,
        lse_ptr, delta_ptr, alibi_ptr, packed,
        n_heads, kv_group, seqlen_q, seqlen_k, stride_alibi_b, qk_scale, scale, softcap, window_left, window_right,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr,
        STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_SOFTCAP: gl.constexpr, FAST_TANH: gl.constexpr,
        HAS_ALIBI: gl.constexpr, HAS_WINDOW: gl.constexpr, SEQ_BLOCK: gl.constexpr, num_warps: gl.constexpr,
    ):
        # One program a (batch, head, query tile), numbered as the forward (a packed batch: as the forward's,
        # ``gluon_tiles.query_program``, ``packed`` ending in dq, its H and L strides and D); Q and dO stay in
        # shared memory, the K/V tiles stream through STAGES buffers. Turn j issues dQ += dS_j K_j, then
        # S_{j+1} = Q K_{j+1}ᵀ and dP_{j+1} = dO V_{j+1}ᵀ, and works out dS_{j+1} while the last of them runs.
        # Head dims come in column parts as in the dK/dV kernel (``*_desc_b``: the second part's descriptors, or
        # None): S and dP sum one product a part, dQ is one accumulator a part of Q's head dim.
        dtype: gl.constexpr = q_desc.dtype
        q_descs = descriptor_parts(q_desc, q_desc_b)
        k_descs = descriptor_parts(k_desc, k_desc_b)
        v_descs = descriptor_parts(v_desc, v_desc_b)
        do_descs = descriptor_parts(do_desc, do_desc_b)
        dq_descs = descriptor_parts(dq_desc, dq_desc_b)
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
        b, h, m_start, row0s, lengths, stats_row = query_program(
            gl.program_id(0), packed, n_heads, seqlen_q, seqlen_k, BLOCK_M, IS_CAUSAL, SEQ_BLOCK, num_warps)
        q_row0, k_row0 = row0s
        seqlen_q, seqlen_k = lengths
        b_row = batch_coordinate(b, SEQ_BLOCK)
        h_kv = h // kv_group
        mods = (softcap, alibi_slope(alibi_ptr, stride_alibi_b, b.to(gl.int64), h, BASE2_UNITS, HAS_ALIBI),
                window_left, window_right)
        MODS: gl.constexpr = (HAS_SOFTCAP, FAST_TANH, HAS_ALIBI, HAS_WINDOW)
        key_start, full_start, full_end, key_end = key_ranges(
            m_start, gl.minimum(m_start + BLOCK_M, seqlen_q) - 1, seqlen_q, seqlen_k, BLOCK_N, IS_CAUSAL,
            HAS_MASK=False, window_left=window_left, window_right=window_right, HAS_WINDOW=HAS_WINDOW)
        n_kv_tiles = gl.cdiv(key_end - key_start, BLOCK_N) * (m_start < seqlen_q).to(gl.int32)
        full = ((full_start - key_start) // BLOCK_N, (full_end - key_start) // BLOCK_N)

        q_smem = tile_boxes(q_descs)
        do_smem = tile_boxes(do_descs)
        k_smem = ring_slots(k_descs, STAGES)
        v_smem = ring_slots(v_descs, STAGES)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_bars.index(i), count=1)
            mbarrier.init(v_bars.index(i), count=1)
        # Q and dO, every column part, on one barrier counting all their bytes.
        q_start = (b_row, h, q_row0 + m_start)
        mbarrier.expect(q_bar, boxes_nbytes(q_descs) + boxes_nbytes(do_descs))
        copy_boxes(q_descs, q_start, q_bar, q_smem)
        copy_boxes(do_descs, q_start, q_bar, do_smem)
        # The K/V rings (gluon_tiles), one descriptor and buffer a column part: the program refills its slots
        # itself (the ready barriers stand in for the free ones).
        k_ring = (k_descs, k_smem, k_bars, k_bars)
        v_ring = (v_descs, v_smem, v_bars, v_bars)
        source = (b_row, h_kv, k_row0 + key_start, n_kv_tiles)  # (K/V rows' coordinates: gluon_tiles)
        for i in gl.static_range(STAGES):
            issue_kv_load(k_ring, i, source)
            issue_kv_load(v_ring, i, source)

        rows: gl.constexpr = gl.SliceLayout(1, s_layout)
        q_idx = m_start + gl.arange(0, BLOCK_M, layout=rows)
        in_q = q_idx < seqlen_q
        row_m = safe_max(gl.load(lse_ptr + stats_row + q_idx, mask=in_q, other=0.0) * LOG2E)
        delta = gl.load(delta_ptr + stats_row + q_idx, mask=in_q, other=0.0)
        stats = (row_m, delta)
        rows = (q_idx, seqlen_q, seqlen_k)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        dqs = zero_accumulators(q_descs, BLOCK_M, num_warps)
        q_tiles = box_views(q_smem)
        do_tiles = box_views(do_smem)
        mbarrier.wait(q_bar, 0)
        if n_kv_tiles > 0:
            # Turn 0's scores and dP alone.
            k_tiles = wait_kv(k_ring, 0)
            v_tiles = wait_kv(v_ring, 0)
            _clear_cut_tile(k_tiles, v_tiles, 0, n_kv_tiles, seqlen_k - key_start, SEQ_BLOCK, num_warps)
            s_token = sum_of_products(q_tiles, k_tiles, s_zero)
            dp_token = sum_of_products(do_tiles, v_tiles, s_zero)
            s = warpgroup_mma_wait(len(v_tiles), deps=(s_token,))  # dP's products may still run
            dp = warpgroup_mma_wait(0, deps=(dp_token,))
            ds = _dq_scores_grads(s, dp, stats, 0, key_start, full, rows, qk_scale, mods, IS_CAUSAL, MODS,
                                  HAS_SOFTCAP, HAS_ALIBI, HAS_WINDOW)
            issue_kv_load(v_ring, STAGES, source)
            for j in range(1, n_kv_tiles):
                # dQ += dS K, one product a column part of K (dS from registers: the same registers in every
                # part's operand layout).
                ds_ops = register_operands(ds.to(dtype), dqs)
                dq_tokens = accumulate_products(ds_ops, k_tiles, dqs)
                k_tiles = wait_kv(k_ring, j)
                v_tiles = wait_kv(v_ring, j)
                _clear_cut_tile(k_tiles, v_tiles, j, n_kv_tiles, seqlen_k - key_start, SEQ_BLOCK, num_warps)
                s_token = sum_of_products(q_tiles, k_tiles, s_zero)
                dp_token = sum_of_products(do_tiles, v_tiles, s_zero)
                # dQ_{j-1} and S_j done; dP_j's products may still run.
                done = warpgroup_mma_wait(len(v_tiles), deps=dq_tokens + ds_ops + (s_token,))
                dqs = done[:len(dqs)]
                s = done[len(dqs) + len(ds_ops)]
                if num_warps > 4:
                    thread_barrier()
                issue_kv_load(k_ring, j - 1 + STAGES, source)
                dp = warpgroup_mma_wait(0, deps=(dp_token,))
                if num_warps > 4:
                    thread_barrier()
                issue_kv_load(v_ring, j + STAGES, source)
                ds = _dq_scores_grads(s, dp, stats, j, key_start, full, rows, qk_scale, mods, IS_CAUSAL, MODS,
                                      HAS_SOFTCAP, HAS_ALIBI, HAS_WINDOW)
            # The last tile's dQ products, waited for one by one.
            ds_ops = register_operands(ds.to(dtype), dqs)
            last = ()
            for i in gl.static_range(len(dqs)):
                last = last + (warpgroup_mma(ds_ops[i], k_tiles[i], dqs[i]),)
            dqs = last

        mbarrier.invalidate(q_bar)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(k_bars.index(i))
            mbarrier.invalidate(v_bars.index(i))
        # dQ leaves through Q's buffers, part by part (clipped to Lq and D by the copies); in a packed batch, a
        # query tile cut by its sequence's end by pointer (``store_rows``: the next sequence's rows follow).
        if SEQ_BLOCK == 0:
            _store_query_tile(dqs, scale, dq_descs, q_smem, q_start)
        elif m_start + BLOCK_M <= seqlen_q:
            _store_query_tile(dqs, scale, dq_descs, q_smem, q_start)
        else:
            store_rows(_scaled_parts(dqs, scale, dtype), dq_descs, (q_idx, seqlen_q),
                       (packed[3], packed[4], packed[5], packed[6]), (h, q_row0))

    @gluon.jit
    def _clear_cut_tile(k_tiles, v_tiles, tile, n_tiles, keys_left, SEQ_BLOCK: gl.constexpr,
                        NUM_WARPS: gl.constexpr):
        """In a packed batch (``SEQ_BLOCK`` > 0), clear the rows past the sequence's end of K/V tile ``tile`` when
        it is the last of ``n_tiles`` (the only one the end can cut; ``keys_left``: the sequence's keys from the
        first tile's on) before its products read them (``zero_rows_past``)."""
        if SEQ_BLOCK > 0:
            if tile == n_tiles - 1:
                zero_rows_past(k_tiles + v_tiles, keys_left - tile * k_tiles[0].shape[0], NUM_WARPS)

    @gluon.jit
    def _store_query_tile(dqs, scale, dq_descs, q_smem, start):
        """dQ (times ``scale``) of one query tile, every column part, through Q's buffers by TMA into its tile at
        ``start = (b, h, row)`` of ``dq_descs``."""
        _stage_parts(dqs, scale, q_smem)
        fence_async_shared()
        thread_barrier()
        store_boxes(dq_descs, start, q_smem)
        tma.store_wait(0)


def wgmma_backward_eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, do: torch.Tensor,
                            has_mask: bool, scale: float) -> bool:
    """True when these kernels take a backward call: Gluon present, a Hopper GPU, fp16/bf16, padded head dims
    (q/k's and v's) in ``tuning.WGMMA_BACKWARD_CONFIGS``, no user mask, ``scale > 0``, non-empty, TMA-aligned
    q, k, v and dO, and head dims whose rows are whole 16-byte units (so that dq, dk and dv, dense when q, k
    and v are not, are TMA-aligned too). ``FLASHLITE_WGMMA_BACKWARD=0`` turns it off (A/B runs)."""
    return (
        gluon is not None and not has_mask and scale > 0 and q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16)
        and max(head_dim_padded(q.shape[3]), head_dim_padded(v.shape[3])) in tuning.WGMMA_BACKWARD_CONFIGS
        and min(head_dim_padded(q.shape[3]), head_dim_padded(v.shape[3])) >= min(tuning.WGMMA_BACKWARD_CONFIGS)
        and q.shape[3] * q.element_size() % 16 == 0 and v.shape[3] * v.element_size() % 16 == 0
        and q.shape[2] > 0 and k.shape[2] > 0
        and device_info(q.device).capability == WGMMA_CAPABILITY
        and os.environ.get("FLASHLITE_WGMMA_BACKWARD", "1") != "0"
        and tma_usable(q, k, v, do)
    )


def _variant_switches(variant_meta: dict | None) -> dict:
    """``plan.variant_args``' switches without the sinks (their gradient is ``backward.sink_gradient``'s)."""
    variants = {**NO_VARIANTS, **(variant_meta or {})}
    del variants["HAS_SINKS"]
    return variants


def dq_kernel_meta(config: tuning.WgmmaBackwardConfig, head_dim: int, head_dim_v: int, causal: bool,
                   variant_meta: dict | None = None, seq_block: int = 0) -> dict:
    """The launch keywords of the dQ kernel on ``config``'s tiles (as ``kernel_meta``)."""
    return dict(BLOCK_M=config.dq_block_m, BLOCK_N=config.dq_block_n, HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v,
                STAGES=config.dq_stages, IS_CAUSAL=causal, SEQ_BLOCK=seq_block, num_warps=config.dq_block_m // 16,
                **_variant_switches(variant_meta))


def kernel_meta(config: tuning.WgmmaBackwardConfig, head_dim: int, head_dim_v: int, causal: bool,
                variant_meta: dict | None = None, seq_block: int = 0) -> dict:
    """The dK/dV kernel's launch keywords (constexprs, ``num_warps`` and, if capped, ``maxnreg``) on ``config``'s
    tiles; ``variant_meta``: ``plan.variant_args``' switches (sinks dropped: their gradient is
    ``backward.sink_gradient``'s); ``seq_block``: a packed batch's ``SEQ_BLOCK`` (``plan.packed_schedule``), 0 for
    a dense one."""
    meta = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v,
                STAGES=config.stages, IS_CAUSAL=causal, SEQ_BLOCK=seq_block,
                num_warps=config.block_n // 16 * config.split, **_variant_switches(variant_meta))
    if config.max_registers:
        meta["maxnreg"] = config.max_registers
    return meta


def one_pass_kernel_meta(config: tuning.WgmmaBackwardConfig, head_dim: int, head_dim_v: int, causal: bool,
                         variant_meta: dict | None = None) -> dict:
    """The one-pass kernel's launch keywords on ``config``'s tiles (as ``kernel_meta``): its partitions'
    registers (``tuning.ONE_PASS_*_REGISTERS``) and the launch's cap."""
    return dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v,
                STAGES=config.stages, IS_CAUSAL=causal, COMPUTE_REGISTERS=tuning.ONE_PASS_COMPUTE_REGISTERS,
                LOAD_REGISTERS=tuning.ONE_PASS_LOAD_REGISTERS, num_warps=4, maxnreg=tuning.ONE_PASS_LAUNCH_REGISTERS,
                **_variant_switches(variant_meta))


# The backward splits only head dims padded to this width (129 to 192: the two-warpgroup tiles of D = 256); its
# kernels were not built for D = 128's tiles in parts (96 = 64 + 32), which stay padded.
SPLIT_PADDED_HEAD_DIM = 256


def column_parts(head_dim: int) -> tuple[int, ...]:
    """The column parts both kernels load a head dim in: the forward's (``plan.column_parts``) for head dims padded
    to ``SPLIT_PADDED_HEAD_DIM``, else one part, the padded head dim."""
    if head_dim_padded(head_dim) == SPLIT_PADDED_HEAD_DIM:
        return plan.column_parts(head_dim)
    return (head_dim_padded(head_dim),)


class HopperBackwardLaunch:
    """The Hopper backward kernels for one call signature, planned once: tiles, grids, descriptor templates
    (a call rebinds them to its tensors), constexprs and scalars.

    Built from (B, H, L, D) tensors ``wgmma_backward_eligible`` accepted (v and dO of head dim Dv). A call takes
    the forward's natural-log ``lse`` and ``backward``'s ``delta`` (both (B, H, Lq) fp32, contiguous) and
    returns ``(dq, dk, dv)``: the dK/dV kernel, then the dQ kernel, which sums each query tile's dQ in a fixed
    order (two runs give bitwise-equal gradients); dq in q's dtype and memory order. One pass instead
    (``one_pass``, the launch or None) where forced tiles say ``one_pass`` or, with the table's,
    ``plan.backward_one_pass_enabled``, for dense calls of one column part on 64-key tiles: the one-pass kernel
    and a copy of its fp32 workspace ((B, H, Lq rounded up to the tile, padded D): a memset and a copy a call)
    into dq; not bitwise repeatable, so calls under ``torch.use_deterministic_algorithms(True)`` take the two
    passes.
    ``variant_scalars``/``variant_meta``: ``plan.variant_args``' (the softcap in base-2 units); ``has_alibi``:
    calls bring the (B, H) slopes.

    Head dims are loaded in boxes as wide as the padded head dim (TMA zero-fills past D). Unless
    ``FLASHLITE_HEAD_SPLIT=0``, D and Dv of 129 to 192 are loaded in two
    column parts (``column_parts``: 192 = 128 + 64, 160 = 128 + 32), on the tiles of the padded head dim (256:
    two warpgroups splitting the columns of every part), and run the products of 192 (160) columns, not 256.
    ``parts = (q_parts, v_parts)``: the widths chosen (the tests read them).

    A packed batch (``varlen = (sequences, max_seqlen_q, max_seqlen_k)``, ``core.packed``; unless
    ``FLASHLITE_HOPPER_VARLEN=0``): (1, H, total, D) tensors whose calls bring ``seqs = (cu_seqlens_q,
    cu_seqlens_k)``, each kernel on one flattened schedule of every sequence's tiles (its key tiles for dK/dV, its
    query tiles for dQ; ``plan.packed_schedule``), a tile cut by its sequence's end masked and stored by pointer.
    """

    def __init__(
        self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
        variant_scalars: tuple, variant_meta: dict, config: tuning.WgmmaBackwardConfig | None = None,
        varlen: tuple[int, int, int] | None = None,
    ):
        batch, n_heads, seqlen_q, head_dim = q.shape
        seqlen_k, head_dim_v = k.shape[2], v.shape[3]
        hd_pad, dv_pad = head_dim_padded(head_dim), head_dim_padded(head_dim_v)
        one_pass = config.one_pass if config is not None else plan.backward_one_pass_enabled()  # (forced tiles decide)
        config = config or tuning.WGMMA_BACKWARD_CONFIGS[max(hd_pad, dv_pad)]
        q_parts, v_parts = column_parts(head_dim), column_parts(head_dim_v)
        self.parts = (q_parts, v_parts)
        self.grads = [OutputLayout(t, t.shape[3]) for t in (q, k, v)]  # dq, dk, dv: laid out as empty_like
        dq_like, dk_like, dv_like = (layout.meta(q.dtype) for layout in self.grads)
        self.dkdv_descriptors = part_templates((
            (q, config.block_m, q_parts), (k, config.block_n, q_parts), (v, config.block_n, v_parts),
            (do, config.block_m, v_parts), (dk_like, config.block_n, q_parts), (dv_like, config.block_n, v_parts)))
        self.dq_descriptors = part_templates((
            (q, config.dq_block_m, q_parts), (k, config.dq_block_n, q_parts), (v, config.dq_block_n, v_parts),
            (do, config.dq_block_m, v_parts), (dq_like, config.dq_block_m, q_parts)))
        softcap, window_left, window_right = variant_scalars
        self.sizes = (n_heads, n_heads // k.shape[1], seqlen_q, seqlen_k)  # packed: the totals
        self.scalars = (scale * LOG2E.value, scale, softcap, window_left, window_right)
        widths = (sum(q_parts), sum(v_parts))  # on chip: the parts' sums
        dkdv_meta, dq_meta = (kernel_meta(config, *widths, causal, variant_meta),
                              dq_kernel_meta(config, *widths, causal, variant_meta))
        self.varlen = varlen
        if varlen is not None:
            batch = varlen[0]
            key_numbers, dkdv_meta["SEQ_BLOCK"] = packed_schedule(batch, seqlen_k, config.block_n,
                                                                  dkdv_meta["num_warps"])
            query_numbers, dq_meta["SEQ_BLOCK"] = packed_schedule(batch, seqlen_q, config.dq_block_m,
                                                                  dq_meta["num_warps"])
            grids = ((key_numbers * k.shape[1],), (query_numbers * n_heads,))
            # (sequences, then each gradient's H and L strides and head dim: the kernels' ``packed`` tuples)
            self.packed_layouts = (batch, *(layout.strides[1:3] + (layout.shape[3],) for layout in self.grads))
        else:
            grids = ((triton.cdiv(seqlen_k, config.block_n) * batch * k.shape[1],),
                     (triton.cdiv(seqlen_q, config.dq_block_m) * batch * n_heads,))
        self.dkdv = TmaLaunch(_attention_bwd_wgmma_kernel, grids[0], self.dkdv_descriptors, **dkdv_meta)
        self.dq = TmaLaunch(_attention_bwd_dq_wgmma_kernel, grids[1], self.dq_descriptors, **dq_meta)
        # One pass where the tiles (or FLASHLITE_BACKWARD_ONE_PASS=1) ask for it and the kernel serves the call:
        # dense, one column part each, a warpgroup's 64 keys a key tile; deterministic calls keep the two passes
        # (``__call__``).
        self.one_pass = None
        if (one_pass and varlen is None and len(q_parts) == len(v_parts) == 1 and config.block_n == 64
                and config.split == 1):
            # dQ's fp32 workspace: whole query tiles (a TMA reduction adds a tile), the padded head dim.
            rows_padded = triton.cdiv(seqlen_q, config.block_m) * config.block_m
            self.workspace = (batch, n_heads, rows_padded, q_parts[0])
            workspace_descriptor = descriptor_template(gluon_descriptor(
                torch.empty(self.workspace, dtype=torch.float32, device="meta"), config.block_m, q_parts[0]))
            self.one_pass = TmaLaunch(
                _attention_bwd_one_pass_kernel,
                (triton.cdiv(seqlen_k, 2 * config.block_n) * batch * k.shape[1],),
                (*self.dkdv_descriptors[:6], workspace_descriptor),  # (the six first parts, then the workspace)
                **one_pass_kernel_meta(config, *widths, causal, variant_meta))

    def __call__(
        self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
        delta: torch.Tensor, alibi: torch.Tensor | None = None,
        seqs: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        """``(dq, dk, dv)``; a packed batch brings ``seqs = (cu_seqlens_q, cu_seqlens_k)``."""
        dq, dk, dv = (layout.empty(t) for layout, t in zip(self.grads, (q, k, v)))
        stride_alibi = alibi.stride(0) if alibi is not None else 0
        dkdv_packed = dq_packed = None
        if self.varlen is not None:
            n_seqs, dq_layout, dk_layout, dv_layout = self.packed_layouts
            dkdv_packed = (*seqs, n_seqs, dk, *dk_layout, dv, *dv_layout)
            dq_packed = (*seqs, n_seqs, dq, *dq_layout)
        if self.one_pass is not None and not torch.are_deterministic_algorithms_enabled():
            workspace = torch.zeros(self.workspace, dtype=torch.float32, device=q.device)
            self.one_pass((q, k, v, do, dk, dv, workspace), lse, delta, alibi, *self.sizes, stride_alibi,
                          *self.scalars)
            dq.copy_(workspace[:, :, :q.shape[2], :q.shape[3]])
            return dq, dk, dv
        self.dkdv((q, k, v, do, dk, dv), lse, delta, alibi, dkdv_packed, *self.sizes, stride_alibi, *self.scalars)
        self.dq((q, k, v, do, dq), lse, delta, alibi, dq_packed, *self.sizes, stride_alibi, *self.scalars)
        return dq, dk, dv


def attention_backward_hopper(
    do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor, delta: torch.Tensor,
    causal: bool, scale: float, variant_scalars: tuple, variant_meta: dict,
    alibi: torch.Tensor | None = None, config: tuning.WgmmaBackwardConfig | None = None,
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """``(dq, dk, dv)`` of one backward call, planned and launched once (``HopperBackwardLaunch``)."""
    plan = HopperBackwardLaunch(do, q, k, v, causal, scale, variant_scalars, variant_meta, config)
    return plan(do, q, k, v, lse, delta, alibi)


def build_for_sm90(kernel_name: str, config: tuning.WgmmaBackwardConfig, head_dim: int, causal: bool,
                   variant_meta: dict | None = None, head_dim_v: int | None = None, split: bool = False,
                   dtype: torch.dtype = torch.bfloat16, packed: bool = False) -> "triton.compiler.CompiledKernel":
    """One of the kernels (``kernel_name`` "dkdv", "dq" or "one_pass") built for sm_90 on any machine, no GPU needed,
    with the argument types a launch on Hopper gives (``dtype``, bf16 by default; head dim ``head_dim`` for q and k,
    ``head_dim_v`` (default: the same) for v and dO; ``split``: in column parts as ``FLASHLITE_HEAD_SPLIT=1``
    plans them, else padded; ``packed``: a packed batch's kernel, ``SEQ_BLOCK`` 256): Triton's compiled kernel,
    whose ``asm["ptx"]`` the CPU build test and bench/backward_resources.py read."""
    from triton.backends.compiler import GPUTarget

    head_dim_v = head_dim_v or head_dim
    parts = head_dim_parts if split else (lambda d: (head_dim_padded(d),))
    q_parts, v_parts = parts(head_dim), parts(head_dim_v)
    dq = kernel_name == "dq"
    rows, keys = (config.dq_block_m, config.dq_block_n) if dq else (config.block_m, config.block_n)
    q_like, v_like = (torch.empty(1, 1, 256, d, dtype=dtype) for d in (head_dim, head_dim_v))
    one_pass = kernel_name == "one_pass"
    kernel = (_attention_bwd_dq_wgmma_kernel if dq else _attention_bwd_one_pass_kernel if one_pass
              else _attention_bwd_wgmma_kernel)
    specs = (((q_like, rows, q_parts), (q_like, keys, q_parts), (v_like, keys, v_parts), (v_like, rows, v_parts),
              (q_like, rows, q_parts)) if dq else
             ((q_like, rows, q_parts), (q_like, keys, q_parts), (v_like, keys, v_parts), (v_like, rows, v_parts),
              (q_like, keys, q_parts), (v_like, keys, v_parts)))
    descs = part_descriptors(specs)
    if one_pass:  # the six first parts and dQ's fp32 workspace
        descs = descs[:len(specs)] + (gluon_descriptor(torch.empty(1, 1, 256, q_parts[0]), rows, q_parts[0]),)
    descs = dict(zip(kernel.arg_names, descs))  # (a launch's first arguments)
    seq_block = 256 if packed else 0
    if one_pass:
        meta = one_pass_kernel_meta(config, sum(q_parts), sum(v_parts), causal, variant_meta)
    elif dq:
        meta = dq_kernel_meta(config, sum(q_parts), sum(v_parts), causal, variant_meta, seq_block)
    else:
        meta = kernel_meta(config, sum(q_parts), sum(v_parts), causal, variant_meta, seq_block)
    options = {name: meta.pop(name) for name in ("num_warps", "maxnreg") if name in meta}
    constants = dict(meta, num_warps=options["num_warps"])  # (the kernels read num_warps as a constexpr)
    constants.update({name: None for name, desc in descs.items() if desc is None})
    if not meta["HAS_ALIBI"]:
        constants["alibi_ptr"] = None
    if not packed and not one_pass:
        constants["packed"] = None
    # (cu_seqlens_q, cu_seqlens_k, sequences, then each gradient, its H and L strides and head dim):
    # HopperBackwardLaunch's ``packed`` tuples
    grad = (mangle_type(q_like), "i32", "i32", "i32")
    packed_types = ("*i32", "*i32", "i32", *grad) + (() if dq else grad)
    signature = {}
    for name in kernel.arg_names:
        if name in constants:
            signature[name] = "constexpr"
        elif name in descs:
            signature[name] = mangle_type(descs[name])
        elif name == "packed":
            signature[name] = packed_types
        elif name.endswith("_ptr"):
            signature[name] = "*fp32"
        else:
            signature[name] = "fp32" if name in ("qk_scale", "scale", "softcap") else "i32"
    return triton.compile(gluon_source(kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                          options=options)
