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
"""

from __future__ import annotations

import os

import torch
import triton

from ..core.masking import apply_masks, key_ranges, modify_scores, query_ranges
from ..core.online_softmax import BASE2_UNITS, LOG2E, safe_max
from ..core.runtime import KernelLaunch, device_info
from ..core.tiles import tma_usable
from ..core.triton_compat import descriptor_template, gluon_source, mangle_type, rebind_descriptor
from . import tuning
from .forward import alibi_slope
from .gluon_tiles import (
    WGMMA_CAPABILITY, gluon, gluon_descriptor, issue_kv_load, thread_barrier, tma_load, tma_store, wait_kv,
)
from .plan import NO_VARIANTS, OutputLayout, head_dim_padded, query_tile

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
    )

    @gluon.jit
    def _load_query_tile(q_ring, it, items):
        """Start the TMA copies of work item ``it``'s Q and dO tiles (query head ``h_first + it // n_query_tiles``,
        rows from ``query_start + (it % n_query_tiles) · BLOCK_M``) into slot ``it % STAGES`` of ``q_ring = (q_desc,
        do_desc, q_smem, do_smem, bars)``, if it exists: ``items = (b, h_first, query_start, n_query_tiles,
        n_items)``."""
        q_desc, do_desc, q_smem, do_smem, bars = q_ring
        b, h_first, query_start, n_query_tiles, n_items = items
        BLOCK_M: gl.constexpr = q_desc.block_type.shape[2]
        STAGES: gl.constexpr = q_smem.type.shape[0]
        slot = it % STAGES
        exists = it < n_items
        h = h_first + it // gl.maximum(n_query_tiles, 1)
        start = query_start + (it % gl.maximum(n_query_tiles, 1)) * BLOCK_M
        bar = bars.index(slot)
        mbarrier.expect(bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes, pred=exists)
        tma_load(q_desc, [b, h, start, 0], bar, q_smem.index(slot), pred=exists)
        tma_load(do_desc, [b, h, start, 0], bar, do_smem.index(slot), pred=exists)

    @gluon.jit
    def _attention_bwd_wgmma_kernel(
        q_desc, k_desc, v_desc, do_desc, dk_desc, dv_desc, lse_ptr, delta_ptr, alibi_ptr,
        n_heads, kv_group, seqlen_q, seqlen_k, stride_alibi_b, qk_scale, scale, softcap, window_left, window_right,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr,
        STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_SOFTCAP: gl.constexpr, FAST_TANH: gl.constexpr,
        HAS_ALIBI: gl.constexpr, HAS_WINDOW: gl.constexpr, num_warps: gl.constexpr,
    ):
        dtype: gl.constexpr = q_desc.dtype
        # Key-row tiles (Sᵀ, dPᵀ, dK, dV): the warps split the keys, 16 rows a warp, and with more warps than
        # that (SPLIT > 1: wide head dims) the columns too.
        KEY_WARPS: gl.constexpr = BLOCK_N // 16
        SPLIT: gl.constexpr = num_warps // KEY_WARPS
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[KEY_WARPS, SPLIT], instr_shape=[16, BLOCK_M // SPLIT, 16])
        dk_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[KEY_WARPS, SPLIT], instr_shape=[16, HEAD_DIM // SPLIT, 16])
        dv_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[KEY_WARPS, SPLIT], instr_shape=[16, HEAD_DIM_V // SPLIT, 16])
        pt_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dv_layout, k_width=2)
        dst_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dk_layout, k_width=2)
        key_rows: gl.constexpr = gl.SliceLayout(1, s_layout)
        query_cols: gl.constexpr = gl.SliceLayout(0, s_layout)

        # Programs numbered per (batch, K/V head), key tile fastest: under causal the first key tiles meet
        # the most query tiles, and they start first.
        n_key_tiles = gl.cdiv(seqlen_k, BLOCK_N)
        bh_kv = gl.program_id(0) // n_key_tiles
        n_start = (gl.program_id(0) % n_key_tiles) * BLOCK_N
        n_kv_heads = n_heads // kv_group
        b = bh_kv // n_kv_heads
        h_kv = bh_kv % n_kv_heads
        h_first = h_kv * kv_group
        MODS: gl.constexpr = (HAS_SOFTCAP, FAST_TANH, HAS_ALIBI, HAS_WINDOW)

        # The query tiles this key tile meets (the same for every head of the group): [full_start, full_end)
        # see all its keys; the rest of [query_start, query_end) are masked. A ragged last key tile is masked
        # whole: its rows past Lk are zeros, whose unmasked P could overflow.
        query_start, full_start, full_end, query_end = query_ranges(
            n_start, n_start + BLOCK_N - 1, seqlen_q, seqlen_k, BLOCK_M, IS_CAUSAL, window_left=window_left,
            window_right=window_right, HAS_WINDOW=HAS_WINDOW)
        if n_start + BLOCK_N > seqlen_k:
            full_start = query_end
            full_end = query_end
        n_query_tiles = gl.cdiv(query_end - query_start, BLOCK_M)
        n_items = n_query_tiles * kv_group

        k_smem = gl.allocate_shared_memory(dtype, k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, v_desc.block_type.shape, v_desc.layout)
        q_smem = gl.allocate_shared_memory(dtype, [STAGES] + q_desc.block_type.shape, q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, [STAGES] + do_desc.block_type.shape, do_desc.layout)
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

        mbarrier.expect(kv_bar, k_desc.block_type.nbytes + v_desc.block_type.nbytes)
        tma_load(k_desc, [b, h_kv, n_start, 0], kv_bar, k_smem)
        tma_load(v_desc, [b, h_kv, n_start, 0], kv_bar, v_smem)
        q_ring = (q_desc, do_desc, q_smem, do_smem, q_bars)
        items = (b, h_first, query_start, n_query_tiles, n_items)
        for i in gl.static_range(STAGES):
            _load_query_tile(q_ring, i, items)

        dk = gl.zeros([BLOCK_N, HEAD_DIM], gl.float32, layout=dk_layout)
        dv = gl.zeros([BLOCK_N, HEAD_DIM_V], gl.float32, layout=dv_layout)
        s_zero = gl.zeros([BLOCK_N, BLOCK_M], gl.float32, layout=s_layout)
        k_idx = n_start + gl.arange(0, BLOCK_N, layout=key_rows)
        cols = gl.arange(0, BLOCK_M, layout=query_cols)
        stat_offsets = gl.arange(0, BLOCK_M, layout=gl.BlockedLayout([1], [32], [num_warps], [0]))
        mbarrier.wait(kv_bar, 0)
        k_tile = k_smem.reshape([BLOCK_N, HEAD_DIM])
        v_tile = v_smem.reshape([BLOCK_N, HEAD_DIM_V])

        for it in range(n_items):
            slot = it % STAGES
            g = it // n_query_tiles
            start = query_start + (it % n_query_tiles) * BLOCK_M
            h = h_first + g
            bh = (b * n_heads + h).to(gl.int64)
            q_idx = start + cols
            mbarrier.wait(q_bars.index(slot), (it // STAGES) & 1)
            q_tile = q_smem.index(slot).reshape([BLOCK_M, HEAD_DIM])
            do_tile = do_smem.index(slot).reshape([BLOCK_M, HEAD_DIM_V])
            s_token = warpgroup_mma(k_tile, q_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dp_token = warpgroup_mma(v_tile, do_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            # The rows' final states and δ load while the products run: a value a thread, then spread to the
            # columns of Sᵀ through shared memory (loaded there directly, each thread would hold a pointer
            # for each of its 16 columns).
            stat_rows = start + stat_offsets
            in_q = stat_rows < seqlen_q
            row_m = safe_max(gl.load(lse_ptr + bh * seqlen_q + stat_rows, mask=in_q, other=0.0) * LOG2E)
            row_m = gl.convert_layout(row_m, query_cols)
            delta = gl.convert_layout(gl.load(delta_ptr + bh * seqlen_q + stat_rows, mask=in_q, other=0.0),
                                      query_cols)
            mods = (softcap, alibi_slope(alibi_ptr, stride_alibi_b, b.to(gl.int64), h, BASE2_UNITS, HAS_ALIBI),
                    window_left, window_right)

            s = warpgroup_mma_wait(1, deps=(s_token,))
            masked = (start < full_start) | (start >= full_end)
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
                if masked:  # hidden scores -inf before the scale (scale > 0), as the forward
                    s = apply_masks(s, q_idx, k_idx, seqlen_q, seqlen_k, mask_ptr=None, stride_mask_q=0,
                                    stride_mask_k=0, IS_CAUSAL=IS_CAUSAL, HAS_MASK=False, MASK_IS_BOOL=False,
                                    BIAS_TO_UNITS=LOG2E, KEYS_ON_ROWS=True, window_left=window_left,
                                    window_right=window_right, HAS_WINDOW=HAS_WINDOW)
                p = gl.exp2(s * qk_scale - row_m[None, :])
            if SPLIT > 1:
                p_smem.store(p.to(dtype))
                fence_async_shared()
                thread_barrier()  # dV's rows of Pᵀ span both warpgroups' columns
                dv_token = warpgroup_mma(p_smem, do_tile, dv, is_async=True)
                p_op = p  # (kept alive with the products, as the register operand is below)
            else:
                p_op = gl.convert_layout(p.to(dtype), pt_layout)
                dv_token = warpgroup_mma(p_op, do_tile, dv, is_async=True)

            dp = warpgroup_mma_wait(1, deps=(dp_token,))  # dV may still run
            ds = p * (dp - delta[None, :])
            if HAS_SOFTCAP:  # the gradient of the scaled scores: c · tanh(s / c)' = 1 - tanh²
                ds = ds * (1.0 - tanh * tanh)
            if SPLIT > 1:  # dSᵀ through shared memory, where dK's product reads it
                ds_smem.store(ds.to(dtype))
                fence_async_shared()
                thread_barrier()  # every warp's part of dSᵀ is written before the products read it whole
                dk_token = warpgroup_mma(ds_smem, q_tile, dk, is_async=True)
            else:
                dk_token = warpgroup_mma(gl.convert_layout(ds.to(dtype), dst_layout), q_tile, dk, is_async=True)
            dv, dk, p_op = warpgroup_mma_wait(0, deps=(dv_token, dk_token, p_op))
            if num_warps > 4:
                thread_barrier()  # both warpgroups are done with the slot (and dSᵀ) before either reuses it
            _load_query_tile(q_ring, it + STAGES, items)

        mbarrier.invalidate(kv_bar)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(q_bars.index(i))
        # dK and dV leave through the K and V buffers (no product reads them any more), clipped to Lk and D.
        k_tile.store((dk * scale).to(dtype))
        v_tile.store(dv.to(dtype))
        fence_async_shared()
        thread_barrier()
        tma_store(dk_desc, [b, h_kv, n_start, 0], k_smem)
        tma_store(dv_desc, [b, h_kv, n_start, 0], v_smem)
        tma.store_wait(0)

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
        q_desc, k_desc, v_desc, do_desc, dq_desc, lse_ptr, delta_ptr, alibi_ptr,
        n_heads, kv_group, seqlen_q, seqlen_k, stride_alibi_b, qk_scale, scale, softcap, window_left, window_right,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr,
        STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_SOFTCAP: gl.constexpr, FAST_TANH: gl.constexpr,
        HAS_ALIBI: gl.constexpr, HAS_WINDOW: gl.constexpr, num_warps: gl.constexpr,
    ):
        # One program a (batch, head, query tile), numbered as the forward; Q and dO stay in shared memory, the
        # K/V tiles stream through STAGES buffers. Turn j issues dQ += dS_j K_j, then S_{j+1} = Q K_{j+1}ᵀ and
        # dP_{j+1} = dO V_{j+1}ᵀ, and works out dS_{j+1} while the last of them runs.
        dtype: gl.constexpr = q_desc.dtype
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])
        dq_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, HEAD_DIM, 16])
        ds_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=dq_layout, k_width=2)
        bh, m_start = query_tile(gl.program_id(0), gl.cdiv(seqlen_q, BLOCK_M), BLOCK_M, IS_CAUSAL)
        b = bh // n_heads
        h = bh % n_heads
        h_kv = h // kv_group
        mods = (softcap, alibi_slope(alibi_ptr, stride_alibi_b, b.to(gl.int64), h, BASE2_UNITS, HAS_ALIBI),
                window_left, window_right)
        MODS: gl.constexpr = (HAS_SOFTCAP, FAST_TANH, HAS_ALIBI, HAS_WINDOW)
        key_start, full_start, full_end, key_end = key_ranges(
            m_start, gl.minimum(m_start + BLOCK_M, seqlen_q) - 1, seqlen_q, seqlen_k, BLOCK_N, IS_CAUSAL,
            HAS_MASK=False, window_left=window_left, window_right=window_right, HAS_WINDOW=HAS_WINDOW)
        n_kv_tiles = gl.cdiv(key_end - key_start, BLOCK_N)
        full = ((full_start - key_start) // BLOCK_N, (full_end - key_start) // BLOCK_N)

        q_smem = gl.allocate_shared_memory(dtype, q_desc.block_type.shape, q_desc.layout)
        do_smem = gl.allocate_shared_memory(dtype, do_desc.block_type.shape, do_desc.layout)
        k_smem = gl.allocate_shared_memory(dtype, [STAGES] + k_desc.block_type.shape, k_desc.layout)
        v_smem = gl.allocate_shared_memory(dtype, [STAGES] + v_desc.block_type.shape, v_desc.layout)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        v_bars = gl.allocate_shared_memory(gl.int64, [STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(STAGES):
            mbarrier.init(k_bars.index(i), count=1)
            mbarrier.init(v_bars.index(i), count=1)
        mbarrier.expect(q_bar, q_desc.block_type.nbytes + do_desc.block_type.nbytes)
        tma_load(q_desc, [b, h, m_start, 0], q_bar, q_smem)
        tma_load(do_desc, [b, h, m_start, 0], q_bar, do_smem)
        # The K/V rings (gluon_tiles), one column part each (the padded head dim): the program refills its slots
        # itself (the ready barriers stand in for the free ones).
        k_ring = ((k_desc,), (k_smem,), k_bars, k_bars)
        v_ring = ((v_desc,), (v_smem,), v_bars, v_bars)
        source = (b, h_kv, key_start, n_kv_tiles)
        for i in gl.static_range(STAGES):
            issue_kv_load(k_ring, i, source)
            issue_kv_load(v_ring, i, source)

        rows: gl.constexpr = gl.SliceLayout(1, s_layout)
        q_idx = m_start + gl.arange(0, BLOCK_M, layout=rows)
        in_q = q_idx < seqlen_q
        row_m = safe_max(gl.load(lse_ptr + bh.to(gl.int64) * seqlen_q + q_idx, mask=in_q, other=0.0) * LOG2E)
        delta = gl.load(delta_ptr + bh.to(gl.int64) * seqlen_q + q_idx, mask=in_q, other=0.0)
        stats = (row_m, delta)
        rows = (q_idx, seqlen_q, seqlen_k)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        dq = gl.zeros([BLOCK_M, HEAD_DIM], gl.float32, layout=dq_layout)
        q_tile = q_smem.reshape([BLOCK_M, HEAD_DIM])
        do_tile = do_smem.reshape([BLOCK_M, HEAD_DIM_V])
        mbarrier.wait(q_bar, 0)
        if n_kv_tiles > 0:
            # Turn 0's scores and dP alone.
            k_tile = wait_kv(k_ring, 0)[0]
            v_tile = wait_kv(v_ring, 0)[0]
            s_token = warpgroup_mma(q_tile, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            dp_token = warpgroup_mma(do_tile, v_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
            s = warpgroup_mma_wait(1, deps=(s_token,))
            dp = warpgroup_mma_wait(0, deps=(dp_token,))
            ds = _dq_scores_grads(s, dp, stats, 0, key_start, full, rows, qk_scale, mods, IS_CAUSAL, MODS,
                                  HAS_SOFTCAP, HAS_ALIBI, HAS_WINDOW)
            issue_kv_load(v_ring, STAGES, source)
            for j in range(1, n_kv_tiles):
                ds_op = gl.convert_layout(ds.to(dtype), ds_layout)
                dq_token = warpgroup_mma(ds_op, k_tile, dq, is_async=True)
                k_tile = wait_kv(k_ring, j)[0]
                v_tile = wait_kv(v_ring, j)[0]
                s_token = warpgroup_mma(q_tile, k_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                dp_token = warpgroup_mma(do_tile, v_tile.permute((1, 0)), s_zero, use_acc=False, is_async=True)
                dq, ds_op, s = warpgroup_mma_wait(1, deps=(dq_token, ds_op, s_token))  # dP_j may still run
                if num_warps > 4:
                    thread_barrier()
                issue_kv_load(k_ring, j - 1 + STAGES, source)
                dp = warpgroup_mma_wait(0, deps=(dp_token,))
                if num_warps > 4:
                    thread_barrier()
                issue_kv_load(v_ring, j + STAGES, source)
                ds = _dq_scores_grads(s, dp, stats, j, key_start, full, rows, qk_scale, mods, IS_CAUSAL, MODS,
                                      HAS_SOFTCAP, HAS_ALIBI, HAS_WINDOW)
            dq = warpgroup_mma(gl.convert_layout(ds.to(dtype), ds_layout), k_tile, dq)

        mbarrier.invalidate(q_bar)
        for i in gl.static_range(STAGES):
            mbarrier.invalidate(k_bars.index(i))
            mbarrier.invalidate(v_bars.index(i))
        # dQ leaves through Q's buffer (clipped to Lq and D by the copy).
        q_tile.store((dq * scale).to(dtype))
        fence_async_shared()
        thread_barrier()
        tma_store(dq_desc, [b, h, m_start, 0], q_smem)
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
                   variant_meta: dict | None = None) -> dict:
    """The launch keywords of the dQ kernel on ``config``'s tiles (as ``kernel_meta``)."""
    return dict(BLOCK_M=config.dq_block_m, BLOCK_N=config.dq_block_n, HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v,
                STAGES=config.dq_stages, IS_CAUSAL=causal, num_warps=config.dq_block_m // 16,
                **_variant_switches(variant_meta))


def kernel_meta(config: tuning.WgmmaBackwardConfig, head_dim: int, head_dim_v: int, causal: bool,
                variant_meta: dict | None = None) -> dict:
    """The dK/dV kernel's launch keywords (constexprs, ``num_warps`` and, if capped, ``maxnreg``) on ``config``'s
    tiles; ``variant_meta``: ``plan.variant_args``' switches (sinks dropped: their gradient is
    ``backward.sink_gradient``'s)."""
    meta = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v,
                STAGES=config.stages, IS_CAUSAL=causal,
                num_warps=config.block_n // 16 * config.split, **_variant_switches(variant_meta))
    if config.max_registers:
        meta["maxnreg"] = config.max_registers
    return meta


class HopperBackwardLaunch:
    """The two Hopper backward kernels for one call signature, planned once: tiles, grids, descriptor templates
    (a call rebinds them to its tensors), constexprs and scalars.

    Built from (B, H, L, D) tensors ``wgmma_backward_eligible`` accepted (v and dO of head dim Dv). A call takes
    the forward's natural-log ``lse`` and ``backward``'s ``delta`` (both (B, H, Lq) fp32, contiguous) and
    returns ``(dq, dk, dv)``: the dK/dV kernel, then the dQ kernel, which sums each query tile's dQ in a fixed
    order (two runs give bitwise-equal gradients); dq in q's dtype and memory order.
    ``variant_scalars``/``variant_meta``: ``plan.variant_args``' (the softcap in base-2 units); ``has_alibi``:
    calls bring the (B, H) slopes.
    """

    def __init__(
        self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float,
        variant_scalars: tuple, variant_meta: dict, config: tuning.WgmmaBackwardConfig | None = None,
    ):
        batch, n_heads, seqlen_q, head_dim = q.shape
        seqlen_k, head_dim_v = k.shape[2], v.shape[3]
        hd_pad, dv_pad = head_dim_padded(head_dim), head_dim_padded(head_dim_v)
        config = config or tuning.WGMMA_BACKWARD_CONFIGS[max(hd_pad, dv_pad)]
        self.grads = [OutputLayout(t, t.shape[3]) for t in (q, k, v)]  # dq, dk, dv: laid out as empty_like
        dq_like, dk_like, dv_like = (layout.meta(q.dtype) for layout in self.grads)
        self.dkdv_descriptors = tuple(descriptor_template(gluon_descriptor(t, rows, width)) for t, rows, width in (
            (q, config.block_m, hd_pad), (k, config.block_n, hd_pad), (v, config.block_n, dv_pad),
            (do, config.block_m, dv_pad), (dk_like, config.block_n, hd_pad), (dv_like, config.block_n, dv_pad)))
        self.dq_descriptors = tuple(descriptor_template(gluon_descriptor(t, rows, width)) for t, rows, width in (
            (q, config.dq_block_m, hd_pad), (k, config.dq_block_n, hd_pad), (v, config.dq_block_n, dv_pad),
            (do, config.dq_block_m, dv_pad), (dq_like, config.dq_block_m, hd_pad)))
        softcap, window_left, window_right = variant_scalars
        self.sizes = (n_heads, n_heads // k.shape[1], seqlen_q, seqlen_k)
        self.scalars = (scale * LOG2E.value, scale, softcap, window_left, window_right)
        self.dkdv = KernelLaunch(_attention_bwd_wgmma_kernel, (triton.cdiv(seqlen_k, config.block_n) * batch * k.shape[1],),
                                 **kernel_meta(config, hd_pad, dv_pad, causal, variant_meta))
        self.dq = KernelLaunch(_attention_bwd_dq_wgmma_kernel, (triton.cdiv(seqlen_q, config.dq_block_m) * batch * n_heads,),
                               **dq_kernel_meta(config, hd_pad, dv_pad, causal, variant_meta))

    def __call__(
        self, do: torch.Tensor, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, lse: torch.Tensor,
        delta: torch.Tensor, alibi: torch.Tensor | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
        dq, dk, dv = (layout.empty(t) for layout, t in zip(self.grads, (q, k, v)))
        stride_alibi = alibi.stride(0) if alibi is not None else 0
        descs = [rebind_descriptor(d, t) for d, t in zip(self.dkdv_descriptors, (q, k, v, do, dk, dv))]
        self.dkdv(*descs, lse, delta, alibi, *self.sizes, stride_alibi, *self.scalars)
        descs = [rebind_descriptor(d, t) for d, t in zip(self.dq_descriptors, (q, k, v, do, dq))]
        self.dq(*descs, lse, delta, alibi, *self.sizes, stride_alibi, *self.scalars)
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
                   variant_meta: dict | None = None) -> "triton.compiler.CompiledKernel":
    """One of the two kernels (``kernel_name`` "dkdv" or "dq") built for sm_90 on any machine, no GPU needed, with
    the argument types a bf16 launch on Hopper gives (head dim ``head_dim`` for q, k and v): Triton's compiled
    kernel, whose ``asm["ptx"]`` the CPU build test and bench/backward_resources.py read."""
    from triton.backends.compiler import GPUTarget

    dq = kernel_name == "dq"
    rows, keys = (config.dq_block_m, config.dq_block_n) if dq else (config.block_m, config.block_n)
    boxes = {"q_desc": rows, "do_desc": rows, "dq_desc": rows, "k_desc": keys, "v_desc": keys, "dk_desc": keys,
             "dv_desc": keys}
    kernel = _attention_bwd_dq_wgmma_kernel if dq else _attention_bwd_wgmma_kernel
    meta = (dq_kernel_meta(config, head_dim, head_dim, causal, variant_meta) if dq
            else kernel_meta(config, head_dim, head_dim, causal, variant_meta))
    options = {name: meta.pop(name) for name in ("num_warps", "maxnreg") if name in meta}
    constants = dict(meta, num_warps=options["num_warps"])  # (the kernels read num_warps as a constexpr)
    if not meta["HAS_ALIBI"]:
        constants["alibi_ptr"] = None
    signature = {}
    for name in kernel.arg_names:
        if name in boxes:
            box_source = torch.empty(1, 1, 256, head_dim, dtype=torch.bfloat16)
            signature[name] = mangle_type(gluon_descriptor(box_source, boxes[name], head_dim))
        elif name in constants:
            signature[name] = "constexpr"
        elif name.endswith("_ptr"):
            signature[name] = "*fp32"
        else:
            signature[name] = "fp32" if name in ("qk_scale", "scale", "softcap") else "i32"
    return triton.compile(gluon_source(kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                          options=options)
