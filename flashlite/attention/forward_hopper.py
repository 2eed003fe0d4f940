"""The attention forward on Hopper: the K/V loop software-pipelined by hand with asynchronous wgmma.

The kernel of ``flashlite.attention.forward`` is written in ``triton.language``, where
the compiler decides when a matrix product is waited for. On Hopper (Triton
3.6) it waits for ``S = Q Kᵀ`` as soon as it is issued and for ``O += P V``
before the next tile's scores, so a program's tensor cores sit idle during its
softmax. This module writes the same loop in Gluon (``triton.experimental.gluon``),
Triton's lower-level language, where tiles live in shared memory that the
kernel allocates, copies are TMA transfers completing on mbarriers, and a
``warpgroup_mma`` is waited for explicitly. That lets one turn of the loop run
the softmax of K tile ``j`` while the tensor cores still work on tile ``j - 1``:

    issue  S_j = Q K_jᵀ                 (async)
    issue  O  += P_{j-1} V_{j-1}         (async)
    wait until only the second is in flight: S_j is ready
    (m, d), P_j, alpha = online_update(S_j)     <- overlaps the P V product
    wait for O; release the K and V slots read (refill by TMA, or signal the load warp); O *= alpha

The online-softmax state is the same ``(m, d)`` as in every other kernel of
flashlite (``flashlite.core.online_softmax``): ``online_update_scaled`` folds
``qk_scale = scale · log2(e)`` into the exponential of the fp32 scores of the
unscaled Q and K (base-2 units, one fused multiply-add a score); masking is
``flashlite.core.masking.apply_masks`` on the tiles that need it (the causal
diagonal, the ragged last K tile), which sets hidden scores to ``-inf`` before
the scale (``scale > 0`` here, so they stay ``-inf``).

Two kernels run that loop (``_attend_kv_tiles``):

* ``_attention_fwd_wgmma_kernel``: a program is one warpgroup (64 query rows)
  that loads its own K/V tiles into two buffers and refills a buffer as soon
  as its product is done; two programs share a multiprocessor, so one's
  softmax also overlaps the other's products (D = 64 and 256; short causal calls).
* ``_attention_fwd_ws_kernel``, warp-specialized (``gl.warp_specialize``): a
  load warp streams K/V tiles into a ring of buffers, and two softmax
  warpgroups of 64 query rows each read every tile, releasing a buffer through
  an mbarrier that counts both (D = 65 to 128). Each K/V tile brought in serves 128
  rows, and the load warp hands most of its registers to the softmax warpgroups
  (``setmaxnreg``), which then hold 128-key tiles.

The variants. A softcap or ALiBi (``core.masking.modified_scores_scaled``) turns each score tile into ``x``
with logits ``c · x`` before the masks, and ``online_update_scaled`` takes ``c`` as it takes the plain scale
(the softcap's tanh is one ``tanh.approx.f32`` per score); the head's sink, loaded when the program starts, is
merged into every row's final state (``merge_sink``); V and O may be narrower or wider than Q and K
(``HEAD_DIM_V``; O then leaves through a shared-memory buffer of its own). Scope: fp16/bf16, head dims 33 to
256 (boxes as wide as the next power of two, zero-filled past D by TMA), no user mask, causal or not, sliding
windows (K/V tiles outside a program's window never loaded), GQA/MQA, any lengths, Q/K/V whose strides TMA
accepts (16-byte aligned), on Hopper.

Head dims as sums of power-of-two parts (``plan.head_split_enabled``; ``FLASHLITE_HEAD_SPLIT=0`` pads them
instead). Padded, D = 192 runs D = 256's products, a third of them on zeros, and D = 96 D = 128's,
a quarter. Split, both kernels load Q/K's head dim, and V/O's on its own, in column parts
(``plan.head_dim_parts``: 192 = 128 + 64, 160 = 128 + 32 in the kernel that is not warp-specialized; 96 = 64 +
32, 80 = 64 + 16 mostly in the warp-specialized one), one TMA box and one shared-memory buffer a part (the
warp-specialized kernel's load warp puts every part of a tile onto one mbarrier, which counts the bytes of all);
S is the sum of one wgmma a part chained on one accumulator, O one accumulator a part (each rescaled, normalized
and stored by TMA on its own, through Q's boxes of the same parts when O is as wide as Q), and the loop waits
until the P V products, one a part of O, are the only ones in flight (``wgmma.wait_group 2`` for two parts).
``flashlite.attention.api.attention_forward`` sends such calls here and the rest
to the ``triton.language`` kernel (``forward``). Gluon has no interpreter, so these kernels
run on the GPU only: ``pytest -m gpu`` (tests/test_gpu_attention.py) tests them
there against a float64 reference. On CPU, tests/test_attention_wgmma.py checks the dispatch
rules and builds the kernels for sm_90, asserting that their loop keeps a product
in flight (``wgmma.wait_group 1``; 2 with O in two parts); the jit helpers they share are tested
through the other kernels.

Speed against the ``triton.language`` kernel and SDPA: bench/results/h200/attention.md
(column ``flashlite_tl``: that kernel on its own tiles).
"""

from __future__ import annotations

import os

import torch
import triton

from ..core.masking import apply_masks, key_ranges, modified_scores_scaled
from ..core.online_softmax import BASE2_UNITS, LOG2E, merge_sink, normalize, online_update_scaled, state_logsumexp
from ..core.runtime import TmaLaunch, device_info
from ..core.tiles import tma_usable
from ..core.triton_compat import gluon_source, mangle_type
from . import tuning
from .forward import alibi_slope
from .gluon_tiles import (
    WGMMA_CAPABILITY, accumulate_products, batch_coordinate, box_views, descriptor_parts, gluon, issue_kv_load,
    load_boxes, part_descriptors, part_templates, query_program, register_operands, ring_slots,
    slot_boxes, store_boxes, store_rows, sum_of_products, thread_barrier, tile_boxes, wait_kv, wait_products,
    zero_accumulators, zero_rows_past,
)
from .plan import (
    NO_VARIANTS, OutputLayout, column_parts, head_dim_padded, head_dim_parts, packed_schedule, variant_args,
    wgmma_config,
)
from .tuning import WgmmaConfig

if gluon is not None:
    from triton.experimental.gluon import language as gl
    from triton.experimental.gluon.language.nvidia.hopper import (
        fence_async_shared, mbarrier, tma, warpgroup_mma, warpgroup_mma_wait,
    )

    @gluon.jit
    def _release_kv_slot(ring, tile, source, NUM_WARPS: gl.constexpr, LOAD_WARP: gl.constexpr):
        """K (or V) tile ``tile`` of ``ring`` (``gluon_tiles``) has been read: its slot may take tile
        ``tile + KV_STAGES`` (from ``source``, as ``issue_kv_load`` takes it).

        With a load warp, tell it so (the slot is shared by two warpgroups: it waits for both);
        else refill the slot here: one thread issues the copy, after a barrier when two
        warpgroups read the slot.
        """
        descs, slots, ready, free = ring
        KV_STAGES: gl.constexpr = slots[0].type.shape[0]
        if LOAD_WARP:
            mbarrier.arrive(free.index(tile % KV_STAGES))
        else:
            if NUM_WARPS > 4:
                thread_barrier()
            issue_kv_load(ring, tile + KV_STAGES, source)

    @gluon.jit
    def _fold_scores(s, m, d, tile, key_start, full, rows, qk_scale, mods, IS_CAUSAL: gl.constexpr,
                     MODS: gl.constexpr, P_LAYOUT: gl.constexpr, DTYPE: gl.constexpr):
        """Mask K tile ``tile``'s scores (keys from ``key_start + tile · BLOCK_N``) unless it is one of the
        tiles ``full = (full_first, full_stop)`` every row sees whole, ``rows = (q_idx, seqlen_q, seqlen_k)``
        giving the queries' positions and the lengths, and fold them into ``(m, d)``: ``(m, d, P, alpha)``, P
        rounded to the input dtype in the register-operand layout of the P V product. Under a softcap or ALiBi
        (``mods``/``MODS``, ``core.masking``; the softcap and slope in base-2 units) the scores become
        ``modified_scores_scaled``'s ``x``, whose factor ``c`` the exponential takes as it takes the plain scale."""
        HAS_SOFTCAP, FAST_TANH, HAS_ALIBI, HAS_WINDOW = MODS
        softcap, alibi, window_left, window_right = mods
        full_first, full_stop = full
        q_idx, seqlen_q, seqlen_k = rows
        BLOCK_N: gl.constexpr = s.shape[1]
        cols = gl.arange(0, BLOCK_N, layout=gl.SliceLayout(0, s.type.layout))
        tile_start = key_start + tile * BLOCK_N
        k_idx = tile_start + cols
        scale = qk_scale
        if HAS_SOFTCAP or HAS_ALIBI:
            s, scale = modified_scores_scaled(s, qk_scale, q_idx, tile_start, cols, seqlen_q, seqlen_k, mods, MODS)
        if (tile < full_first) | (tile >= full_stop):
            s = apply_masks(s, q_idx, k_idx, seqlen_q, seqlen_k, mask_ptr=None, stride_mask_q=0, stride_mask_k=0,
                            IS_CAUSAL=IS_CAUSAL, HAS_MASK=False, MASK_IS_BOOL=False, BIAS_TO_UNITS=LOG2E,
                            window_left=window_left, window_right=window_right, HAS_WINDOW=HAS_WINDOW)
        m, d, p, alpha = online_update_scaled(m, d, s, scale)
        return m, d, gl.convert_layout(p.to(DTYPE), P_LAYOUT), alpha

    # ------------------------------------------------ column parts: a head dim as a sum of power-of-two widths
    #
    # Q/K's head dim and V/O's are each loaded in one or more column parts (``plan.head_dim_parts``: usually
    # one, the padded head dim; 192 = 128 + 64, 96 = 64 + 32 and so on unless FLASHLITE_HEAD_SPLIT=0). Every tile of
    # Q, K, V or O is then a tuple of one box (and one product operand) a part: S sums one product a part of
    # Q/K, and O is one accumulator a part of V/O. With one part each helper compiles to the code of a single
    # tile. The helpers the backward shares live in ``gluon_tiles``.

    @gluon.jit
    def _q_operands(q_tiles, S_LAYOUT: gl.constexpr):
        """Q, loaded from its (arrived) tiles, one a column part, into registers as the S products' first operands
        (a tuple, one a part)."""
        q_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=S_LAYOUT, k_width=2)
        q_ops = ()
        for i in gl.static_range(len(q_tiles)):
            q_ops = q_ops + (q_tiles[i].load(q_layout),)
        return q_ops

    @gluon.jit
    def _rescale(accs, alpha):
        """Each column part of O times its row's ``alpha``."""
        scaled = ()
        for i in gl.static_range(len(accs)):
            scaled = scaled + (accs[i] * gl.convert_layout(alpha, gl.SliceLayout(1, accs[i].type.layout))[:, None],)
        return scaled

    # ------------------------------------------------------------------------------------------ the K/V loop

    @gluon.jit
    def _attend_kv_tiles(q_ops, s_zero, accs, k_ring, v_ring, source, keys, rows, qk_scale, mods,
                         IS_CAUSAL: gl.constexpr, MODS: gl.constexpr, NUM_WARPS: gl.constexpr,
                         LOAD_WARP: gl.constexpr, PACKED: gl.constexpr = False):
        """The K/V loop of one query tile: ``(m, d, O)`` after every K/V tile, O not yet divided by d.

        Q, its K tiles and its V tiles and O come as tuples of column parts (above): ``q_ops`` Q's operands,
        ``accs`` O's accumulators. The tiles come through the rings ``k_ring`` and ``v_ring`` (``gluon_tiles``)
        from ``source = (b, h_kv, row, n_kv_tiles)``: its ``n_kv_tiles`` K/V tiles start at row ``row`` of K/V
        (the rows' coordinate in the tensors); ``keys = (key_start, full_first, full_stop)``: their first key's
        position in its sequence, and the full tiles, numbered from there; ``rows``: the queries
        (``_fold_scores``). V tiles are as wide as O. (A packed batch's sequence starts at a row of its own.)

        Turn j issues ``S_j = Q K_jᵀ`` and ``O += P_{j-1} V_{j-1}`` together, waits until only the
        second is in flight (one product a part of O), folds S_j into ``(m, d)`` while P V runs, then waits
        for O, rescales it and releases the K and V slots it read (``_release_kv_slot``). ``s_zero`` carries
        the layout of S. In a packed batch (``PACKED``) the last V tile, the only one a sequence's end can cut,
        has the rows past the sequence cleared first (``zero_rows_past``; the masks have hidden its keys).
        """
        dtype: gl.constexpr = k_ring[0][0].dtype
        n_kv_tiles = source[3]
        key_start, full_first, full_stop = keys
        full = (full_first, full_stop)
        p_layout: gl.constexpr = gl.DotOperandLayout(operand_index=0, parent=accs[0].type.layout, k_width=2)
        m = gl.full([s_zero.shape[0]], float("-inf"), gl.float32, layout=gl.SliceLayout(1, s_zero.type.layout))
        d = gl.zeros_like(m)
        if n_kv_tiles > 0:
            # Turn 0: S_0 alone (there is no P V to overlap yet).
            k_tiles = wait_kv(k_ring, 0)
            s = warpgroup_mma_wait(0, deps=(sum_of_products(q_ops, k_tiles, s_zero),))
            _release_kv_slot(k_ring, 0, source, NUM_WARPS, LOAD_WARP)
            m, d, p, alpha = _fold_scores(s, m, d, 0, key_start, full, rows, qk_scale, mods, IS_CAUSAL, MODS,
                                          p_layout, dtype)
            for j in range(1, n_kv_tiles):
                k_tiles = wait_kv(k_ring, j)
                v_tiles = wait_kv(v_ring, j - 1)
                s_token = sum_of_products(q_ops, k_tiles, s_zero)
                acc_tokens = accumulate_products(register_operands(p, accs), v_tiles, accs)
                s = warpgroup_mma_wait(len(acc_tokens), deps=(s_token,))  # S_j is ready; P V may still run
                _release_kv_slot(k_ring, j, source, NUM_WARPS, LOAD_WARP)
                m, d, p, alpha = _fold_scores(s, m, d, j, key_start, full, rows, qk_scale, mods, IS_CAUSAL, MODS,
                                              p_layout, dtype)
                accs = wait_products(acc_tokens)
                _release_kv_slot(v_ring, j - 1, source, NUM_WARPS, LOAD_WARP)
                accs = _rescale(accs, alpha)
            v_tiles = wait_kv(v_ring, n_kv_tiles - 1)
            if PACKED:
                zero_rows_past(v_tiles, rows[2] - key_start - (n_kv_tiles - 1) * s_zero.shape[1], NUM_WARPS)
            accs = wait_products(accumulate_products(register_operands(p, accs), v_tiles, accs))
            if LOAD_WARP:  # (without one, nothing is left to load into the slot)
                _release_kv_slot(v_ring, n_kv_tiles - 1, source, NUM_WARPS, LOAD_WARP)
        return m, d, accs

    @gluon.jit
    def _write_output(accs, m, d, rows, out, o_start, sink, packed, WRITE_LSE: gl.constexpr,
                      HAS_SINKS: gl.constexpr):
        """O / d through shared memory by TMA into its tile at ``o_start = (b, h, row, q_row0)`` (the tile's
        coordinate in O, and its sequence's first row's; rows past seqlen_q dropped), and the LSE into
        ``lse_row`` (this batch and head's), for ``out = (o_descs, o_boxes, lse_row)`` (a descriptor and a
        shared-memory box a column part of O, as ``accs``) and the queries ``rows = (q_idx, seqlen_q,
        seqlen_k)``; rows that saw no key give zeros. With ``HAS_SINKS`` the head's ``sink`` (``_sink_logit``) is
        merged into every row's state first (``merge_sink``).

        ``packed``: None for a dense batch (TMA drops the rows past the tensor's end). In a packed batch
        (``gluon_tiles.query_program``'s ``packed``) the next sequence's rows follow, so the last tile of a
        sequence, cut by its end, is stored from registers by pointer instead (``store_rows``)."""
        q_idx, seqlen_q, seqlen_k = rows
        o_descs, o_boxes, lse_row = out
        b, h, row, q_row0 = o_start
        if HAS_SINKS:
            m, d, alpha = merge_sink(m, d, sink, BASE2_UNITS)
            accs = _rescale(accs, alpha)
        if WRITE_LSE:
            gl.store(lse_row + q_idx, state_logsumexp(m, d, BASE2_UNITS), mask=q_idx < seqlen_q)
        outs = ()
        for i in gl.static_range(len(accs)):
            o = normalize(accs[i], gl.convert_layout(d, gl.SliceLayout(1, accs[i].type.layout)), ZERO_IF_EMPTY=True)
            outs = outs + (o.to(o_descs[i].dtype),)
        # (Two branches to the same TMA store: a dense batch's test is a compile-time one, whose pointer branch
        # is never built; or-ing it with the packed batch's run-time test would build both.)
        if packed is None:
            _store_by_tma(outs, o_descs, o_boxes, (b, h, row))
        elif gl.max(q_idx, axis=0) < seqlen_q:
            _store_by_tma(outs, o_descs, o_boxes, (b, h, row))
        else:  # the sequence's last tile: this head's rows of the sequence by pointer
            store_rows(outs, o_descs, (q_idx, seqlen_q), (packed[3], packed[4], packed[5], packed[6]), (h, q_row0))

    @gluon.jit
    def _store_by_tma(outs, o_descs, o_boxes, start):
        """Each column part of O's tile, ``outs`` (registers), through its shared-memory box of ``o_boxes`` by TMA
        into its tile at ``start = (b, h, row)`` of ``o_descs``."""
        o_tiles = box_views(o_boxes)
        for i in gl.static_range(len(outs)):
            o_tiles[i].store(outs[i])
        fence_async_shared()
        thread_barrier()  # every warp's part of O is written before the copies start
        store_boxes(o_descs, start, o_boxes)
        tma.store_wait(0)

    @gluon.jit
    def _sink_logit(sinks_ptr, h, HAS_SINKS: gl.constexpr):
        """Head ``h``'s sink in base-2 units, loaded when the program starts (its latency hidden under the K/V
        loop, not paid at the end); 0.0 (unused) without sinks."""
        sink = 0.0
        if HAS_SINKS:
            sink = gl.load(sinks_ptr + h).to(gl.float32) * LOG2E
        return sink

    @gluon.jit
    def _attention_fwd_wgmma_kernel(
        q_desc, k_desc, v_desc, o_desc, q_desc_b, k_desc_b, v_desc_b, o_desc_b, lse_ptr, alibi_ptr, sinks_ptr,
        packed, n_heads, kv_group, seqlen_q, seqlen_k, stride_alibi_b, qk_scale, softcap, window_left, window_right,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr,
        KV_STAGES: gl.constexpr, Q_IN_REGISTERS: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_SOFTCAP: gl.constexpr,
        FAST_TANH: gl.constexpr, HAS_ALIBI: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_SINKS: gl.constexpr,
        WRITE_LSE: gl.constexpr, SEQ_BLOCK: gl.constexpr, num_warps: gl.constexpr,
    ):
        # The column parts of Q/K's head dim and of V/O's (``plan.head_dim_parts``): the ``*_desc`` descriptors
        # load the first part's boxes, the ``*_desc_b`` ones the second's, or are None (one part). HEAD_DIM and
        # HEAD_DIM_V are the widths on chip: the parts' sums.
        q_descs = descriptor_parts(q_desc, q_desc_b)
        k_descs = descriptor_parts(k_desc, k_desc_b)
        v_descs = descriptor_parts(v_desc, v_desc_b)
        o_descs = descriptor_parts(o_desc, o_desc_b)
        # The register layout of the wgmma accumulator S [BLOCK_M, BLOCK_N] (O's: zero_accumulators).
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[num_warps, 1], instr_shape=[16, BLOCK_N, 16])

        # One query tile per program, numbered as the other kernels number them (a packed batch: its sequence's
        # rows and lengths, ``packed`` as ``gluon_tiles.query_program`` takes it; its tensors are (1, H, total, D)).
        b, h, m_start, row0s, lengths, stats_row = query_program(
            gl.program_id(0), packed, n_heads, seqlen_q, seqlen_k, BLOCK_M, IS_CAUSAL, SEQ_BLOCK, num_warps)
        q_row0, k_row0 = row0s
        seqlen_q, seqlen_k = lengths
        b_row = batch_coordinate(b, SEQ_BLOCK)
        h_kv = h // kv_group
        # The score modifiers (core.masking), softcap and slope in base-2 units.
        mods = (softcap, alibi_slope(alibi_ptr, stride_alibi_b, b.to(gl.int64), h, BASE2_UNITS, HAS_ALIBI),
                window_left, window_right)
        MODS: gl.constexpr = (HAS_SOFTCAP, FAST_TANH, HAS_ALIBI, HAS_WINDOW)
        sink = _sink_logit(sinks_ptr, h, HAS_SINKS)

        key_start, full_start, full_end, key_end = key_ranges(
            m_start, gl.minimum(m_start + BLOCK_M, seqlen_q) - 1, seqlen_q, seqlen_k, BLOCK_N, IS_CAUSAL,
            HAS_MASK=False, window_left=window_left, window_right=window_right, HAS_WINDOW=HAS_WINDOW)
        n_kv_tiles = gl.cdiv(key_end - key_start, BLOCK_N) * (m_start < seqlen_q).to(gl.int32)

        q_smem = tile_boxes(q_descs)
        k_smem = ring_slots(k_descs, KV_STAGES)
        v_smem = ring_slots(v_descs, KV_STAGES)
        q_bar = gl.allocate_shared_memory(gl.int64, [1], mbarrier.MBarrierLayout())
        k_bars = gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], mbarrier.MBarrierLayout())
        v_bars = gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], mbarrier.MBarrierLayout())
        mbarrier.init(q_bar, count=1)
        for i in gl.static_range(KV_STAGES):
            mbarrier.init(k_bars.index(i), count=1)
            mbarrier.init(v_bars.index(i), count=1)

        # The K/V rings (gluon_tiles). No load warp: the program refills its slots itself (no free-slot barriers:
        # the ready ones fill in). Each barrier counts the bytes of every column part of its tile.
        k_ring = (k_descs, k_smem, k_bars, k_bars)
        v_ring = (v_descs, v_smem, v_bars, v_bars)
        source = (b_row, h_kv, k_row0 + key_start, n_kv_tiles)
        load_boxes(q_descs, (b_row, h, q_row0 + m_start), q_bar, q_smem)
        for i in gl.static_range(KV_STAGES):
            issue_kv_load(k_ring, i, source)
            issue_kv_load(v_ring, i, source)

        # Q, unscaled: kept in registers as the S products' first operands (Q_IN_REGISTERS: then only K is
        # read from shared memory by each product), or read by each product from shared memory.
        q_tiles = box_views(q_smem)
        mbarrier.wait(q_bar, 0)
        if Q_IN_REGISTERS:
            q_ops = _q_operands(q_tiles, s_layout)
        else:
            q_ops = q_tiles

        q_idx = m_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        accs = zero_accumulators(v_descs, BLOCK_M, num_warps)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        keys = (key_start, (full_start - key_start) // BLOCK_N, (full_end - key_start) // BLOCK_N)
        rows = (q_idx, seqlen_q, seqlen_k)
        m, d, accs = _attend_kv_tiles(q_ops, s_zero, accs, k_ring, v_ring, source, keys, rows, qk_scale, mods,
                                      IS_CAUSAL, MODS, NUM_WARPS=num_warps, LOAD_WARP=False,
                                      PACKED=SEQ_BLOCK > 0)

        mbarrier.invalidate(q_bar)
        for i in gl.static_range(KV_STAGES):
            mbarrier.invalidate(k_bars.index(i))
            mbarrier.invalidate(v_bars.index(i))
        # Q's buffers are free: O goes out through them (buffers of their own when O is narrower or wider than
        # Q; equal widths are split into equal parts).
        if HEAD_DIM_V == HEAD_DIM:
            o_smem = q_smem
        else:
            o_smem = tile_boxes(o_descs)
        _write_output(accs, m, d, rows, (o_descs, o_smem, lse_ptr + stats_row), (b_row, h, q_row0 + m_start, q_row0),
                      sink, packed, WRITE_LSE, HAS_SINKS)

    # ---------------------------------------------- warp-specialized: a load warp, two softmax warpgroups

    @gluon.jit
    def _ws_load_partition(q_tiles, k_ring, v_ring, q_start, source):
        """The load warp: both Q tiles (``q_tiles = (q_descs, q_smem, q_bars)``, rows from ``q_start = (b, h,
        row, ...)``, ``row`` their coordinate in Q; each warpgroup's tile, every column part of it, onto its own
        mbarrier), then every K and V tile (from ``source``, ``issue_kv_load``) into its ring of slots, each once
        both softmax warpgroups have released the slot (a fresh mbarrier counts as released: phase 1 is done)."""
        q_descs, q_smem, q_bars = q_tiles
        k_descs, k_slots, k_ready, k_free = k_ring
        v_descs, v_slots, v_ready, v_free = v_ring
        b, h, row = q_start[0], q_start[1], q_start[2]
        n_kv_tiles = source[3]  # (b, h_kv, row, n_kv_tiles)
        BLOCK_M: gl.constexpr = q_descs[0].block_type.shape[2]
        KV_STAGES: gl.constexpr = k_slots[0].type.shape[0]
        for wg in gl.static_range(2):
            load_boxes(q_descs, (b, h, row + wg * BLOCK_M), q_bars.index(wg), slot_boxes(q_smem, wg))
        for tile in range(n_kv_tiles):
            slot = tile % KV_STAGES
            released = ((tile // KV_STAGES) & 1) ^ 1
            mbarrier.wait(k_free.index(slot), released)
            issue_kv_load(k_ring, tile, source)
            mbarrier.wait(v_free.index(slot), released)
            issue_kv_load(v_ring, tile, source)

    @gluon.jit
    def _ws_softmax_partition(q_tiles, k_ring, v_ring, out, q_start, source, lengths, sinks_ptr, packed, qk_scale,
                              mods, IS_CAUSAL: gl.constexpr, MODS: gl.constexpr, HAS_SINKS: gl.constexpr,
                              WRITE_LSE: gl.constexpr, WARPGROUP: gl.constexpr):
        """One softmax warpgroup: query rows ``m_start + WARPGROUP * BLOCK_M`` on, over the shared K/V tiles
        (the arguments as ``_ws_load_partition`` and ``_write_output`` take them, a tuple of column parts where
        the other kernel has them too; ``out = (o_descs, o_smem, lse_row)``, ``o_smem`` holding both warpgroups'
        boxes of each part of O; ``q_start = (b, h, row, m_start, q_row0)``: the program's first row's coordinate
        in Q and position in its sequence, and the sequence's first row's coordinate; ``lengths = (seqlen_q,
        seqlen_k, key_start)``, ``key_start`` the position of the first key of ``source``'s tiles)."""
        q_descs, q_smem, q_bars = q_tiles
        o_descs, o_smem, lse_row = out
        b, h, row, m_start, q_row0 = q_start
        seqlen_q, seqlen_k, key_start = lengths
        BLOCK_M: gl.constexpr = q_descs[0].block_type.shape[2]
        BLOCK_N: gl.constexpr = k_ring[0][0].block_type.shape[2]  # (the rings as gluon_tiles describes them)
        HAS_SOFTCAP, FAST_TANH, HAS_ALIBI, HAS_WINDOW = MODS
        softcap, alibi, window_left, window_right = mods
        s_layout: gl.constexpr = gl.NVMMADistributedLayout(
            version=[3, 0], warps_per_cta=[4, 1], instr_shape=[16, BLOCK_N, 16])

        row_start = m_start + WARPGROUP * BLOCK_M
        sink = _sink_logit(sinks_ptr, h, HAS_SINKS)
        _, full_start, full_end, _ = key_ranges(
            row_start, gl.minimum(row_start + BLOCK_M, seqlen_q) - 1, seqlen_q, seqlen_k, BLOCK_N, IS_CAUSAL,
            HAS_MASK=False, window_left=window_left, window_right=window_right, HAS_WINDOW=HAS_WINDOW)
        q_tiles = box_views(slot_boxes(q_smem, WARPGROUP))  # this warpgroup's Q, one [BLOCK_M, width] a part
        mbarrier.wait(q_bars.index(WARPGROUP), 0)
        q_ops = _q_operands(q_tiles, s_layout)
        q_idx = row_start + gl.arange(0, BLOCK_M, layout=gl.SliceLayout(1, s_layout))
        accs = zero_accumulators(v_ring[0], BLOCK_M, 4)
        s_zero = gl.zeros([BLOCK_M, BLOCK_N], gl.float32, layout=s_layout)
        # Both warpgroups walk the K/V tiles of the whole program (masking covers the tiles only the other sees).
        keys = (key_start, (full_start - key_start) // BLOCK_N, (full_end - key_start) // BLOCK_N)
        rows = (q_idx, seqlen_q, seqlen_k)
        m, d, accs = _attend_kv_tiles(q_ops, s_zero, accs, k_ring, v_ring, source, keys, rows, qk_scale, mods,
                                      IS_CAUSAL, MODS, NUM_WARPS=4, LOAD_WARP=True, PACKED=packed is not None)
        # Q is in registers: O goes out through this warpgroup's Q boxes (o_smem is q_smem when O is as wide).
        _write_output(accs, m, d, rows, (o_descs, slot_boxes(o_smem, WARPGROUP), lse_row),
                      (b, h, row + WARPGROUP * BLOCK_M, q_row0), sink, packed, WRITE_LSE, HAS_SINKS)

    @gluon.jit
    def _attention_fwd_ws_kernel(
        q_desc, k_desc, v_desc, o_desc, q_desc_b, k_desc_b, v_desc_b, o_desc_b, lse_ptr, alibi_ptr, sinks_ptr,
        packed, n_heads, kv_group, seqlen_q, seqlen_k, stride_alibi_b, qk_scale, softcap, window_left, window_right,
        BLOCK_M: gl.constexpr, BLOCK_N: gl.constexpr, HEAD_DIM: gl.constexpr, HEAD_DIM_V: gl.constexpr,
        KV_STAGES: gl.constexpr, IS_CAUSAL: gl.constexpr, HAS_SOFTCAP: gl.constexpr, FAST_TANH: gl.constexpr,
        HAS_ALIBI: gl.constexpr, HAS_WINDOW: gl.constexpr, HAS_SINKS: gl.constexpr, WRITE_LSE: gl.constexpr,
        SEQ_BLOCK: gl.constexpr, SOFTMAX_REGISTERS: gl.constexpr, LOAD_REGISTERS: gl.constexpr,
        num_warps: gl.constexpr,
    ):
        # The column parts of Q/K's head dim and of V/O's, as _attention_fwd_wgmma_kernel takes them: the
        # ``*_desc_b`` descriptors load the second part's boxes, or are None (one part); HEAD_DIM and HEAD_DIM_V
        # are the parts' sums.
        q_descs = descriptor_parts(q_desc, q_desc_b)
        k_descs = descriptor_parts(k_desc, k_desc_b)
        v_descs = descriptor_parts(v_desc, v_desc_b)
        o_descs = descriptor_parts(o_desc, o_desc_b)
        # A program holds 2 * BLOCK_M query rows, BLOCK_M per softmax warpgroup, numbered as the other kernels do
        # (a packed batch: as in _attention_fwd_wgmma_kernel).
        b, h, m_start, row0s, lengths, stats_row = query_program(
            gl.program_id(0), packed, n_heads, seqlen_q, seqlen_k, 2 * BLOCK_M, IS_CAUSAL, SEQ_BLOCK, num_warps)
        q_row0, k_row0 = row0s
        seqlen_q, seqlen_k = lengths
        b_row = batch_coordinate(b, SEQ_BLOCK)
        h_kv = h // kv_group
        mods = (softcap, alibi_slope(alibi_ptr, stride_alibi_b, b.to(gl.int64), h, BASE2_UNITS, HAS_ALIBI),
                window_left, window_right)
        MODS: gl.constexpr = (HAS_SOFTCAP, FAST_TANH, HAS_ALIBI, HAS_WINDOW)
        key_start, _, _, key_end = key_ranges(
            m_start, gl.minimum(m_start + 2 * BLOCK_M, seqlen_q) - 1, seqlen_q, seqlen_k, BLOCK_N, IS_CAUSAL,
            HAS_MASK=False, window_left=window_left, window_right=window_right, HAS_WINDOW=HAS_WINDOW)
        n_kv_tiles = gl.cdiv(key_end - key_start, BLOCK_N) * (m_start < seqlen_q).to(gl.int32)

        q_smem = ring_slots(q_descs, 2)  # a Q box of each part for each softmax warpgroup
        k_smem = ring_slots(k_descs, KV_STAGES)
        v_smem = ring_slots(v_descs, KV_STAGES)
        q_bars = gl.allocate_shared_memory(gl.int64, [2, 1], mbarrier.MBarrierLayout())
        k_ready = gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], mbarrier.MBarrierLayout())
        v_ready = gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], mbarrier.MBarrierLayout())
        k_free = gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], mbarrier.MBarrierLayout())
        v_free = gl.allocate_shared_memory(gl.int64, [KV_STAGES, 1], mbarrier.MBarrierLayout())
        # O goes out through the Q boxes (Q lives in registers by then; equal widths are split into equal parts),
        # or through boxes of its own when it is narrower or wider than Q.
        if HEAD_DIM_V == HEAD_DIM:
            o_smem = q_smem
        else:
            o_smem = ring_slots(o_descs, 2)
        for wg in gl.static_range(2):
            mbarrier.init(q_bars.index(wg), count=1)
        for i in gl.static_range(KV_STAGES):
            mbarrier.init(k_ready.index(i), count=1)  # each counts the bytes of every column part of its tile
            mbarrier.init(v_ready.index(i), count=1)
            mbarrier.init(k_free.index(i), count=2)  # released by both softmax warpgroups
            mbarrier.init(v_free.index(i), count=2)

        q_tiles = (q_descs, q_smem, q_bars)
        k_ring = (k_descs, k_smem, k_ready, k_free)  # (gluon_tiles)
        v_ring = (v_descs, v_smem, v_ready, v_free)
        out = (o_descs, o_smem, lse_ptr + stats_row)  # this batch and head's LSE row
        q_start = (b_row, h, q_row0 + m_start, m_start, q_row0)
        source = (b_row, h_kv, k_row0 + key_start, n_kv_tiles)
        lengths = (seqlen_q, seqlen_k, key_start)
        # (Each partition's argument tuple is written out in the call, its constexpr flags as literals or
        # constexpr names: a tuple held in a variable would turn them into run-time values. Tuples of run-time
        # values, as the groups above, may be held.)
        gl.warp_specialize(
            [(_ws_softmax_partition,  # warpgroup 0: the default partition
              (q_tiles, k_ring, v_ring, out, q_start, source, lengths, sinks_ptr, packed, qk_scale, mods,
               IS_CAUSAL, MODS, HAS_SINKS, WRITE_LSE, 0)),
             (_ws_softmax_partition,  # warpgroup 1
              (q_tiles, k_ring, v_ring, out, q_start, source, lengths, sinks_ptr, packed, qk_scale, mods,
               IS_CAUSAL, MODS, HAS_SINKS, WRITE_LSE, 1)),
             (_ws_load_partition, (q_tiles, k_ring, v_ring, q_start, source))],
            [4, 1], [SOFTMAX_REGISTERS, LOAD_REGISTERS])


def wgmma_eligible(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, has_mask: bool, scale: float) -> bool:
    """True when this kernel takes the call: Gluon present, a Hopper GPU, fp16/bf16, head dims (q/k's and v's)
    padded to one of ``tuning.WGMMA_CONFIGS``' (33 to 256), no user mask, ``scale > 0`` (masked scores stay
    ``-inf`` under it), non-empty, TMA-aligned. ``FLASHLITE_WGMMA=0`` turns it off (A/B runs)."""
    return (
        gluon is not None and not has_mask and scale > 0 and q.is_cuda
        and q.dtype in (torch.float16, torch.bfloat16) and head_dim_padded(q.shape[3]) in tuning.WGMMA_CONFIGS
        and head_dim_padded(v.shape[3]) in tuning.WGMMA_CONFIGS
        and q.shape[2] > 0 and k.shape[2] > 0
        and device_info(q.device).capability == WGMMA_CAPABILITY
        and os.environ.get("FLASHLITE_WGMMA", "1") != "0"
        and tma_usable(q, k, v)
    )


def descriptor_specs(tensors: tuple, config: WgmmaConfig, q_parts: tuple, v_parts: tuple) -> tuple:
    """``gluon_tiles.part_descriptors``' specs of the kernels' descriptors of ``tensors = (q, k, v, o)``: rows, the
    tiles' of ``config``; parts, ``q_parts`` for q and k, ``v_parts`` for v and o (both kernels take the eight
    descriptors, first parts then second parts)."""
    rows = (config.block_m, config.block_n, config.block_n, config.block_m)
    return tuple(zip(tensors, rows, (q_parts, q_parts, v_parts, v_parts)))


def kernel_descriptors(tensors: tuple, config: WgmmaConfig, q_parts: tuple, v_parts: tuple) -> tuple:
    """The kernels' TMA descriptor arguments for ``tensors = (q, k, v, o)`` (``descriptor_specs``,
    ``gluon_tiles.part_descriptors``): a box as wide as its part; None where a head dim is one part."""
    return part_descriptors(descriptor_specs(tensors, config, q_parts, v_parts))


def kernel_for(config: WgmmaConfig, head_dim: int, head_dim_v: int, causal: bool, write_lse: bool,
               variant_meta: dict | None = None, seq_block: int = 0) -> tuple:
    """``(kernel, launch keywords)`` of a call: its constexprs (``variant_meta``: ``plan.variant_args``' switches,
    none by default; ``head_dim``, ``head_dim_v``: the widths on chip, the sums of the column parts;
    ``seq_block``: a packed batch's ``SEQ_BLOCK``, ``plan.packed_schedule``, 0 for a dense one), ``num_warps``
    and, warp-specialized, ``maxnreg``."""
    variants = {**NO_VARIANTS, **(variant_meta or {})}
    meta = dict(BLOCK_M=config.block_m, BLOCK_N=config.block_n, HEAD_DIM=head_dim, HEAD_DIM_V=head_dim_v,
                KV_STAGES=config.kv_stages, IS_CAUSAL=causal, WRITE_LSE=write_lse, SEQ_BLOCK=seq_block,
                num_warps=config.num_warps, **variants)
    if config.warp_specialized:
        return _attention_fwd_ws_kernel, dict(meta, SOFTMAX_REGISTERS=tuning.WS_SOFTMAX_REGISTERS,
                                              LOAD_REGISTERS=tuning.WS_LOAD_REGISTERS, maxnreg=tuning.WS_LAUNCH_REGISTERS)
    return _attention_fwd_wgmma_kernel, dict(meta, Q_IN_REGISTERS=config.q_in_registers)


class HopperForwardLaunch:
    """The Hopper kernel for one call signature, planned once (as ``forward.TlForwardLaunch``): tiles, grid,
    descriptor templates (``descriptor_specs``; a call rebinds them to its tensors), constexprs, scalars.

    Built from checked (B, H, L, D) fp16/bf16 tensors that ``wgmma_eligible`` accepted (v's head dim Dv may
    differ from D). The variants as ``forward.TlForwardLaunch`` takes them: ``window`` (its key tiles outside
    it never loaded), ``softcap``, ``has_alibi`` ((B, H) slopes per call), ``has_sinks`` ((H,) per call).

    Head dims are loaded in column parts (``plan.column_parts``): D (and Dv) of 65 to 96 and 129 to 192 in two
    (96 = 64 + 32, 80 = 64 + 16, 192 = 128 + 64, 160 = 128 + 32), running the products of 96 (80, 192, 160)
    columns, not 128 (256); any other head dim, and every one under ``FLASHLITE_HEAD_SPLIT=0``, in one box as
    wide as the padded head dim, TMA filling the columns past D with zeros on loads and dropping them on the
    output's store.

    A packed batch (``varlen = (sequences, max_seqlen_q, max_seqlen_k)``, ``core.packed``): (1, H, total, D)
    tensors whose calls bring ``seqs = (cu_seqlens_q, cu_seqlens_k)``, run as one flattened schedule of every
    sequence's query tiles (``plan.packed_schedule``); a K/V tile cut by its sequence's end reads the next
    sequence's first rows, which the masks hide (keys past the sequence's length), and the query tile cut so
    is stored by pointer, not TMA (``_write_output``). The tiles are those of the longest sequence's keys.
    """

    def __init__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, write_lse: bool,
        config: WgmmaConfig | None = None, window: tuple[int, int] | None = None, softcap: float | None = None,
        has_alibi: bool = False, has_sinks: bool = False, varlen: tuple[int, int, int] | None = None,
    ):
        batch, n_heads, seqlen_q, head_dim = q.shape
        seqlen_k, head_dim_v = k.shape[2], v.shape[3]
        self.output = OutputLayout(q, head_dim_v)
        self.lse_shape = (batch, n_heads, seqlen_q) if write_lse else None  # packed: (1, H, total_q)
        self.sizes = (n_heads, n_heads // k.shape[1], seqlen_q, seqlen_k)  # packed: the totals
        self.varlen = varlen
        if varlen is not None:
            batch, seqlen_q, seqlen_k = varlen  # the longest sequences'
        q_parts, v_parts = column_parts(head_dim), column_parts(head_dim_v)
        config = config or wgmma_config(max(head_dim, head_dim_v), causal, seqlen_k, max(sum(q_parts), sum(v_parts)))
        self.descriptors = part_templates(
            descriptor_specs((q, k, v, self.output.meta(q.dtype)), config, q_parts, v_parts))
        variant_scalars, variant_meta = variant_args(q, False, softcap, window, has_alibi, has_sinks,
                                                     *self.sizes[2:])  # (the totals: forward.TlForwardLaunch's)
        self.scalars = (scale * LOG2E.value, *variant_scalars)
        if varlen is not None:
            numbers, seq_block = packed_schedule(batch, q.shape[2], config.rows_per_program, config.num_warps)
            grid = (numbers * n_heads,)
            self.packed_strides = (batch, *self.output.strides[1:3], head_dim_v)  # (sequences, O's H and L strides)
        else:
            seq_block = 0
            grid = (triton.cdiv(seqlen_q, config.rows_per_program) * batch * n_heads,)
        kernel, meta = kernel_for(config, sum(q_parts), sum(v_parts), causal, write_lse, variant_meta, seq_block)
        self.kernel = TmaLaunch(kernel, grid, self.descriptors, **meta)

    def __call__(
        self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, alibi: torch.Tensor | None = None,
        sinks: torch.Tensor | None = None, seqs: tuple[torch.Tensor, torch.Tensor] | None = None,
    ) -> tuple[torch.Tensor, torch.Tensor | None]:
        """``(o, lse)``: o (B, H, Lq, Dv), lse (B, H, Lq) fp32 or None; a packed batch brings ``seqs``."""
        o = self.output.empty(q)
        lse = torch.empty(self.lse_shape, dtype=torch.float32, device=q.device) if self.lse_shape else None
        packed = None
        if self.varlen is not None:
            n_seqs, stride_h, stride_l, head_dim_v = self.packed_strides
            packed = (*seqs, n_seqs, o, stride_h, stride_l, head_dim_v)
        self.kernel((q, k, v, o), lse if lse is not None else o, alibi, sinks, packed, *self.sizes,
                    alibi.stride(0) if alibi is not None else 0, *self.scalars)
        return o, lse


def build_for_sm90(config: WgmmaConfig, head_dim: int, causal: bool, write_lse: bool,
                   variant_meta: dict | None = None, head_dim_v: int | None = None, split: bool = False,
                   dtype: torch.dtype = torch.bfloat16, packed: bool = False) -> "triton.compiler.CompiledKernel":
    """The kernel ``config`` selects, built for sm_90 on any machine, no GPU needed, with the argument types a
    launch on Hopper gives (``dtype``; head dim ``head_dim`` for q and k, ``head_dim_v``, by default the same, for
    v and o; ``split``: in column parts as ``plan.head_dim_parts`` plans them, else padded; ``variant_meta``:
    ``plan.variant_args``' switches that are on; ``packed``: a packed batch's kernel, ``SEQ_BLOCK`` 256): Triton's
    compiled kernel, whose ``asm["ptx"]`` the CPU build tests and bench/forward_resources.py read."""
    from triton.backends.compiler import GPUTarget

    head_dim_v = head_dim_v or head_dim
    parts = head_dim_parts if split else (lambda d: (head_dim_padded(d),))
    q_parts, v_parts = parts(head_dim), parts(head_dim_v)
    tensors = [torch.empty(1, 1, 256, d, dtype=dtype) for d in (head_dim, head_dim, head_dim_v, head_dim_v)]
    kernel, meta = kernel_for(config, sum(q_parts), sum(v_parts), causal, write_lse, variant_meta,
                              256 if packed else 0)
    descs = dict(zip(kernel.arg_names, kernel_descriptors(tensors, config, q_parts, v_parts)))  # (its first args)
    options = {name: meta[name] for name in ("num_warps", "maxnreg") if name in meta}
    constants = {name: value for name, value in meta.items() if name != "maxnreg"}
    constants.update({name: None for name, desc in descs.items() if desc is None})
    if not packed:
        constants["packed"] = None
    scalars = {"lse_ptr": "*fp32", "alibi_ptr": "*fp32", "sinks_ptr": "*fp32", "qk_scale": "fp32", "softcap": "fp32",
               # (cu_seqlens_q, cu_seqlens_k, sequences, o, O's H and L strides, Dv): gluon_tiles.query_program's
               "packed": ("*i32", "*i32", "i32", mangle_type(tensors[3]), "i32", "i32", "i32")}
    signature = {name: "constexpr" if name in constants else mangle_type(descs[name]) if name in descs
                 else scalars.get(name, "i32") for name in kernel.arg_names}
    return triton.compile(gluon_source(kernel, signature, constants), target=GPUTarget("cuda", 90, 32),
                          options=options)


def attention_forward_hopper(
    q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, causal: bool, scale: float, write_lse: bool,
    config: WgmmaConfig | None = None, window: tuple[int, int] | None = None, softcap: float | None = None,
    alibi: torch.Tensor | None = None, sinks: torch.Tensor | None = None,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """One call of the Hopper kernel, planned and launched once (``HopperForwardLaunch``; ``alibi`` the (B, H)
    slopes, ``sinks`` the (H,) logits themselves). Returns ``(o, lse)``: o (B, H, Lq, Dv), lse (B, H, Lq) fp32
    or None."""
    plan = HopperForwardLaunch(q, k, v, causal, scale, write_lse, config, window, softcap, alibi is not None,
                               sinks is not None)
    return plan(q, k, v, alibi, sinks)
